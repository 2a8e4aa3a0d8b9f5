"""The loader's device profile (``loader/device.py``): reads timed at each depth, compute and make times per
precision, and the profile file's round trip and its refusals."""

from __future__ import annotations

import json

import pytest

from loader.device import DeviceProfile
from loader.errors import MoeError


def test_profile_round_trip_and_measurements(tmp_path):
    from loader.device import load_profile, measure_compute, measure_reads, write_profile

    reads = measure_reads(tmp_path, file_bytes=8 << 20, block_bytes=1 << 20, small_reads=8)
    assert reads["read_bandwidth_bytes_per_s"] > 0 and reads["read_latency_s"] > 0
    compute, make = measure_compute((256, 512), scale=2, repeats=1)
    assert set(compute) >= {"passthrough", "bfloat16", "float32", "int8", "int4", "int2"}
    assert all(s > 0 for s in compute.values())
    # the quantized precisions are held decoded (the suite pins float32 copies): made once per miss
    assert set(make) == {"int8", "int4", "int3", "int2"} and all(s > 0 for s in make.values())
    profile = DeviceProfile(reads["read_bandwidth_bytes_per_s"], reads["read_latency_s"], compute, "test",
                            {"direct_io": reads["direct_io"]}, make)
    path = write_profile(profile, tmp_path / "device.json")
    assert load_profile(path) == profile
    (tmp_path / "bad.json").write_text(json.dumps({"format": "moeprep-device-profile", "version": 1}))
    with pytest.raises(MoeError, match="read_bandwidth_bytes_per_s"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(MoeError, match="no compute time for precision 'int3'"):
        DeviceProfile(1e9, 0, {"int4": 1.0}).compute("int3")


def test_record_reads_are_timed_at_each_depth_and_the_profile_keeps_the_best(tmp_path):
    from loader.device import measure_reads

    reads = measure_reads(tmp_path, file_bytes=4 << 20, block_bytes=1 << 20, small_reads=4, record_bytes=64 << 10,
                          depth_bytes=512 << 10)
    depths = reads["read_depths"]
    assert set(depths) == {"1", "2", "4", "8"} and all(bw > 0 for bw in depths.values())
    best = max(depths.values())
    chosen = reads["read_depth"]
    # the smallest depth within 5% of the best: no more reader threads than pay
    assert depths[str(chosen)] >= 0.95 * best
    assert all(depths[d] < 0.95 * best for d in depths if int(d) < chosen)
    assert reads["read_bandwidth_bytes_per_s"] == depths[str(chosen)] and reads["read_record_bytes"] == 64 << 10
    with pytest.raises(MoeError, match="record_bytes"):
        measure_reads(tmp_path, file_bytes=4 << 20, block_bytes=1 << 20, record_bytes=5000)


def test_a_profile_with_and_without_read_depths_round_trips_and_bad_depths_are_refused():
    old = DeviceProfile(1e9, 1e-4, {"int4": 2e-3}, "test", {"direct_io": True})
    assert old.read_depth is None and "read_depths" not in old.to_json()
    assert DeviceProfile.from_json(old.to_json()) == old  # a profile measured before depths still loads
    new = DeviceProfile(2e9, 1e-4, {"int4": 2e-3}, "test", {"read_depths": {"1": 1e9, "4": 2e9}, "read_depth": 4})
    assert DeviceProfile.from_json(new.to_json()) == new and new.read_depth == 4
    assert new.scaled_to(1e6).read_depth == 4
    for bad in ({"read_depths": {"1": 1e9}}, {"read_depth": 1}, {"read_depths": {"1": 1e9}, "read_depth": 2},
                {"read_depths": {"one": 1e9}, "read_depth": 1}, {"read_depths": {"1": 0.0}, "read_depth": 1},
                {"read_depths": {"1": 1e9}, "read_depth": True}, {"read_depths": {}, "read_depth": 1},
                {"read_depths": [1e9], "read_depth": 1}):
        with pytest.raises(MoeError, match="read_depths"):
            DeviceProfile.from_json(old.to_json() | bad)


def test_the_profile_times_each_precision_in_the_form_the_cpu_target_loads(monkeypatch):
    """Unpinned on a CPU with the compiled kernels, every quantized precision is timed as the codec's record the
    qdot form computes from: no make time (a miss costs its read and check)."""

    from loader import kernels
    from loader.device import measure_compute
    from loader.forms import ENV

    if not kernels.available():
        pytest.skip("the compiled kernels are unavailable here")
    monkeypatch.delenv(ENV, raising=False)
    compute, make = measure_compute((256, 512), scale=2, repeats=1)
    assert make == {} and all(compute[p] > 0 for p in ("int8", "int4", "int3", "int2"))

