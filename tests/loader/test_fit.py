"""``moeload plan`` (loader/fit.py), ``--memory-budget auto`` (loader/memory.py) and the device profile's hand-off
to ``moeprep prepare --device-profile``: the plan's fit, the budget's resolution and the profile's checks.

The bytes ``plan`` prints are checked against what ``load`` actually allocated (the engine's slot arenas, buffers and
reserves, and the dense weights the model holds); ``auto`` against faked cgroup and meminfo files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import loader.memory as memory
from loader.cli import main as moeload
from loader.device import DeviceProfile, write_profile
from loader.errors import BudgetError
from loader.fit import preview
from loader.runtime import load
from tests.helpers.tiny_models import tiny_artifact

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return tiny_artifact(tmp_path_factory, precision="int4")[1]


@pytest.fixture
def profile(tmp_path) -> Path:
    """A calibrated profile written by hand (deterministic, unlike a measured one)."""
    made = DeviceProfile(1e9, 2e-5, {"float32": 2e-3, "bfloat16": 1.5e-3, "int4": 1e-3, "int8": 1.2e-3,
                                     "passthrough": 1.5e-3}, "cpu: test",
                         {"expert_shape": {"hidden": 256, "intermediate": 512}, "compute_device": "cpu"},
                         {"int8": 1e-4}, {"overlap": True, "layer_overhead_s": 1e-4, "outside_layer_s": 2e-4,
                                          "prefill_outside_layer_s": 1e-5})
    return write_profile(made, tmp_path / "device.json")


@pytest.mark.parametrize("budget", ["50%", "75%", "unlimited"])
def test_plan_accounts_for_the_bytes_load_allocates_per_pool(artifact, budget):
    view = preview(artifact, budget)
    assert view["fits"], view["error"]
    acc = view["accounting"]
    loaded = load(artifact, memory_budget=budget)
    try:
        engine = loaded.runtime
        for name, arena in engine.arenas.items():
            pool = acc["pools"][name]
            assert (pool["slots"], pool["slot_bytes"]) == (arena.count, arena.slot_bytes)
            assert pool["bytes"] == arena.count * arena.slot_bytes
            if arena.count:
                assert arena.data.numel() == pool["bytes"]  # the memory really allocated
        assert set(acc["pools"]) == set(engine.arenas)
        assert acc["read_buffers"]["bytes"] == engine.buffers.data.numel()
        staging = engine.staging.data.numel() if engine.staging is not None else 0
        assert acc["staging_buffers"]["bytes"] == staging
        prefill = engine.prefill_buffers.data.numel() if engine.prefill_buffers is not None else 0
        assert acc["prefill_buffers"]["bytes"] == prefill
        assert acc["prefill_activations"]["bytes"] == (engine.activation_reserve or 0)
        assert acc["prefill_activations"]["chunk"] == engine.prefill_chunk
        dense = sum(t.numel() * t.element_size() for n, t in loaded.model.state_dict().items())
        assert acc["dense_bytes"] == loaded.budget["dense_bytes"] == dense
        assert view["held_forms"] == loaded.budget["expert_dtype"]
        if view["budget"]["bytes"] is not None:  # every byte of the budget accounted for
            assert acc["held_bytes"] + acc["unused_bytes"] == view["budget"]["bytes"] == loaded.budget["limit_bytes"]
            assert acc["unused_bytes"] >= 0
    finally:
        loaded.close()


def test_the_minimum_plan_prints_is_the_smallest_budget_load_takes(artifact):
    minimum = preview(artifact, "50%")["minimum_budget_bytes"]
    load(artifact, memory_budget=minimum).close()
    with pytest.raises(BudgetError, match=f"{minimum:,}"):
        load(artifact, memory_budget=minimum - 1)


def test_plan_json_is_stable_and_predicts(artifact, profile):
    args = ["plan", str(artifact), "--memory-budget", "50%", "--device-profile", str(profile), "--prompt-tokens", "8",
            "--json"]
    first = CliRunner().invoke(moeload, args)
    second = CliRunner().invoke(moeload, args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output
    view = json.loads(first.output)
    import loader  # the same object in Python

    same = loader.preview(artifact, memory_budget="50%", profile=str(profile), prompt_tokens=8)
    assert json.loads(json.dumps(same)) == view
    p = view["prediction"]
    assert p["available"] and p["calibrated"] and p["profile"] == str(profile)
    assert p["decode_tokens_per_s"] > 0 and p["time_to_first_token_s"] > 0 and 0 <= p["hit_rate"] <= 1
    assert p["sample_tokens"] > 0
    # more memory never predicts slower decoding
    more = preview(artifact, "unlimited", profile=profile, prompt_tokens=8)["prediction"]
    assert more["decode_tokens_per_s"] >= p["decode_tokens_per_s"]
    assert more["hit_rate"] >= p["hit_rate"]


def test_plan_without_a_profile_says_why_and_the_text_form_prints(artifact):
    result = CliRunner().invoke(moeload, ["plan", str(artifact), "--memory-budget", "50%"])
    assert result.exit_code == 0, result.output
    assert "pool main" in result.output and "minimum" in result.output
    assert "predicted  none: no device profile" in result.output


def test_a_budget_that_does_not_fit_exits_1_with_the_numbers(artifact):
    result = CliRunner().invoke(moeload, ["plan", str(artifact), "--memory-budget", "1000", "--json"])
    assert result.exit_code == 1
    view = json.loads(result.stdout)
    assert not view["fits"] and "1,000 bytes" in view["error"]
    assert f"{view['minimum_budget_bytes']:,}" in view["error"]
    parts = view["minimum_parts"]
    assert sum(parts.values()) == view["minimum_budget_bytes"]


def test_the_loader_does_not_import_prep():
    code = ("import sys, loader.fit, loader.cli, loader.simulate, loader.device, loader.memory; "
            "bad = sorted(m for m in sys.modules if m == 'prep' or m.startswith('prep.')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------------------------------- auto


def _fake_v2(tmp_path: Path, limit: str, current: int, file_cache: int, available: int, monkeypatch) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "job"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory cpu\n")
    (root / "memory.max").write_text("max\n")
    (root / "memory.current").write_text("1\n")
    (leaf / "memory.max").write_text(f"{limit}\n")
    (leaf / "memory.current").write_text(f"{current}\n")
    (leaf / "memory.stat").write_text(f"anon {current - file_cache}\nfile {file_cache}\n")
    (tmp_path / "self_cgroup").write_text("0::/user.slice/job\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: 999999999 kB\nMemAvailable: {available // 1024} kB\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "SELF_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")


def test_auto_takes_the_cgroup_limit_less_its_use_and_the_margin(tmp_path, monkeypatch):
    _fake_v2(tmp_path, str(4 * GiB), current=1 * GiB, file_cache=256 * MiB, available=16 * GiB,
             monkeypatch=monkeypatch)
    chosen = memory.auto_budget()
    free = 4 * GiB - (1 * GiB - 256 * MiB)  # page cache is reclaimable
    assert chosen.free.bytes == free and "cgroup" in chosen.free.source
    assert chosen.margin_bytes == memory.MARGIN_BYTES + int(memory.MARGIN_SHARE * free)
    assert chosen.budget_bytes == free - chosen.margin_bytes
    assert f"{chosen.budget_bytes:,}" in chosen.describe()


def test_auto_takes_memavailable_without_a_limit_and_the_smaller_of_both(tmp_path, monkeypatch):
    _fake_v2(tmp_path, "max", current=GiB, file_cache=0, available=3 * GiB, monkeypatch=monkeypatch)
    chosen = memory.auto_budget()
    assert chosen.free.bytes == 3 * GiB and "MemAvailable" in chosen.free.source
    assert chosen.budget_bytes == 3 * GiB - memory.MARGIN_BYTES - int(memory.MARGIN_SHARE * 3 * GiB)
    (tmp_path / "meminfo").write_text(f"MemAvailable: {GiB // 1024} kB\n")  # RAM tighter than a 64 GiB limit
    (tmp_path / "cgroup" / "user.slice" / "job" / "memory.max").write_text(f"{64 * GiB}\n")
    assert memory.auto_budget().free.bytes == GiB


def test_auto_reads_cgroup_v1(tmp_path, monkeypatch):
    leaf = tmp_path / "cgroup" / "memory" / "jobs" / "one"
    leaf.mkdir(parents=True)
    (tmp_path / "cgroup" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (leaf / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (leaf / "memory.usage_in_bytes").write_text(f"{512 * MiB}\n")
    (leaf / "memory.stat").write_text(f"cache {128 * MiB}\nrss {384 * MiB}\n")
    (tmp_path / "self_cgroup").write_text("5:cpu:/\n4:memory:/jobs/one\n")
    (tmp_path / "meminfo").write_text(f"MemAvailable: {(32 * GiB) // 1024} kB\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(memory, "SELF_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    assert memory.auto_budget().free.bytes == 2 * GiB - 384 * MiB


def test_auto_loads_with_the_stated_budget_and_refuses_one_below_the_minimum(artifact, tmp_path, monkeypatch):
    free = 2 * GiB
    _fake_v2(tmp_path, str(free), current=0, file_cache=0, available=64 * GiB, monkeypatch=monkeypatch)
    stated = free - memory.MARGIN_BYTES - int(memory.MARGIN_SHARE * free)
    loaded = load(artifact, memory_budget="auto")
    try:
        assert loaded.budget["limit_bytes"] == stated
        assert loaded.budget["auto"]["budget_bytes"] == stated and loaded.budget["requested"] == "auto"
    finally:
        loaded.close()
    assert preview(artifact, "auto")["budget"]["bytes"] == stated
    # a limit that leaves less than the artifact's minimum: one error naming both numbers
    minimum = preview(artifact, "unlimited")["minimum_budget_bytes"]
    tight = int((memory.MARGIN_BYTES + minimum // 2) / (1 - memory.MARGIN_SHARE)) + 1  # leaves about half of it
    (tmp_path / "cgroup" / "user.slice" / "job" / "memory.max").write_text(f"{tight}\n")
    budget = tight - memory.margin(tight)
    assert 0 < budget < minimum
    with pytest.raises(BudgetError) as refused:
        load(artifact, memory_budget="auto")
    assert f"{budget:,}" in str(refused.value) and f"{minimum:,}" in str(refused.value)
    result = CliRunner().invoke(moeload, ["plan", str(artifact), "--memory-budget", "auto"])
    assert result.exit_code == 1 and f"{minimum:,}" in result.output and "memory budget auto" in result.output


def test_auto_with_no_room_for_the_process_is_one_clear_error(tmp_path, monkeypatch):
    _fake_v2(tmp_path, str(100 * MiB), current=0, file_cache=0, available=64 * GiB, monkeypatch=monkeypatch)
    with pytest.raises(BudgetError, match="margin"):
        memory.auto_budget()


# ------------------------------------------------------------------------------- the profile's hand-off


@pytest.mark.slow
def test_a_profile_from_profile_device_plans_a_prepare_and_the_artifact_carries_it(artifact, tmp_path):
    """``moeload profile-device`` (measured and calibrated here on the tiny artifact) is taken by ``moeprep prepare
    --device-profile``; the artifact carries it, and ``moeload plan`` predicts with it by default."""
    import shutil

    from tests.helpers.tiny_models import save_tiny_model

    output = tmp_path / "device.json"
    made = CliRunner().invoke(moeload, ["profile-device", "--artifact", str(artifact), "--file-mb", "16",
                                        "--dir", str(tmp_path), "--output", str(output)])
    assert made.exit_code == 0, made.output
    measured = json.loads(output.read_text())
    assert measured["calibration"]["overlap"] and "outside_layer_s" in measured["calibration"]

    root = tmp_path / "project"
    save_tiny_model("mixtral", root / "model")
    recipe = root / "tiny.yaml"
    recipe.write_text("name: tiny\nmodel: {path: model}\ncalibration: {num_sequences: 2, sequence_length: 16}\n"
                      "quantize: {precision: int4, group_size: 16}\n")
    result = subprocess.run([str(Path(sys.executable).parent / "moeprep"), "prepare", "--recipe", "tiny.yaml",
                             "--device-profile", str(output), "--output", "artifact"], cwd=root, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    carried = json.loads((root / "artifact" / "device.json").read_text())
    assert carried["calibration"] == measured["calibration"]
    view = preview(root / "artifact", "50%", prompt_tokens=8)
    assert view["prediction"]["available"] and "device.json" in view["prediction"]["profile"]
    shutil.rmtree(root / "artifact", ignore_errors=True)


def test_a_damaged_profile_is_refused_by_prepare_naming_the_file(tmp_path):
    from prep.cli import main as moeprep

    bad = tmp_path / "device.json"
    bad.write_text('{"format": "moeprep-device-profile", "version": 1, "read_bandwidth_bytes_per_s": -1}')
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "recipes/reference.yaml", "--device-profile", str(bad),
                                          "--dry-run"])
    assert result.exit_code == 1
    assert str(bad) in result.output and "profile-device" in result.output
    bad.write_text("{not json")
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "recipes/reference.yaml", "--device-profile", str(bad)])
    assert result.exit_code == 1 and str(bad) in result.output and "not valid JSON" in result.output


# ----------------------------------------------------------------------------------------- the routing sample


def test_the_artifact_carries_the_traces_first_sequences_as_its_routing_sample(artifact):
    from safetensors.torch import load_file

    from loader.format import read_manifest
    from loader.simulate import ROUTING_SAMPLE, read_routing_sample
    from prep.methods.trace import open_trace

    root = artifact.parent  # the prepare root, whose stage cache holds the trace
    [trace_dir] = sorted(root.glob("artifacts/*/stages/trace-*/trace"))
    trace = open_trace(trace_dir)
    sample = load_file(str(artifact / ROUTING_SAMPLE))
    lengths = sample["sequence_lengths"].tolist()
    assert lengths == trace.sequence_tokens[:len(lengths)] and sum(lengths) <= 1024
    recorded = trace.routing()[:len(lengths)]
    assert sample["expert_ids"].long().tolist() == [row for r in recorded for row in r.expert_ids.tolist()]
    replay, _ = read_routing_sample(read_manifest(artifact))
    assert replay.num_tokens == sum(lengths) and replay.top_k == trace.routing()[0].top_k


def test_a_damaged_routing_sample_is_named_and_plan_refuses_it(artifact, tmp_path, profile):
    """A routing sample that does not match its manifest is refused by its reader, and ``moeload plan`` exits 1 with
    that message instead of printing a plan without a prediction (more cases: ``test_file_readers.py``)."""
    import shutil

    from loader.errors import ArtifactError
    from loader.format import read_manifest
    from loader.simulate import ROUTING_SAMPLE, read_routing_sample

    copy = tmp_path / "artifact"
    shutil.copytree(artifact.resolve(), copy)
    (copy / ROUTING_SAMPLE).write_bytes(b"\x00" * 64)
    with pytest.raises(ArtifactError, match=ROUTING_SAMPLE) as refused:
        read_routing_sample(read_manifest(copy))
    result = CliRunner().invoke(moeload, ["plan", str(copy), "--memory-budget", "50%", "--device-profile", str(profile)])
    assert result.exit_code == 1 and str(refused.value) in result.output


# ----------------------------------------------------------------------------------------- the cost model


def test_a_layers_reads_transfer_in_turn_and_do_the_rest_on_the_reader_threads():
    """Computed by hand on a two-layer, two-token replay (token 2: layer 0 one hit, layer 1 two hits): a read
    transfers 1 ms, then costs 0.5 ms of the loader's own (``read_overhead_s``) and 0.1 ms of making its form; two
    reader threads do the second part of a layer's two reads side by side, one thread one after the other."""
    from loader.cache import PoolConfig
    from loader.simulate import CacheSpec, Replay, simulate

    replay = Replay(((((0, 1), (2, 3)), ((0, 2), (2, 3))),), 2, 4, 2)
    spec = CacheSpec((PoolConfig("main", "int4", "layer", {0: 4000, 1: 4000}, 1000),),
                     (("int4",) * 4, ("int4",) * 4), {"int4": 1000}, 4, "layer")
    profile = DeviceProfile(1e6, 0.0, {"int4": 4e-4}, make_seconds={"int4": 1e-4},
                            calibration={"overlap": True, "layer_overhead_s": 5e-5, "read_overhead_s": 5e-4})
    # token 1, each layer: 2 ms of transfers + 1.2 ms of the rest over 2 threads = 2.6 ms stall, 0.8 ms compute
    # token 2, layer 0: one read (1.6 ms) against one hit's 0.4 ms: 1.2 ms stall + 0.8 ms compute; layer 1: 0.8 ms
    two = 2 * (2.6e-3 + 0.8e-3) + (1.2e-3 + 0.8e-3) + 0.8e-3 + 4 * 5e-5
    assert simulate(replay, spec, profile=profile, workers=2).seconds == pytest.approx(two)
    one = 2 * (3.2e-3 + 0.8e-3) + (1.2e-3 + 0.8e-3) + 0.8e-3 + 4 * 5e-5
    assert simulate(replay, spec, profile=profile, workers=1).seconds == pytest.approx(one)


def test_a_profile_for_a_model_adds_its_dense_weights_and_layers_and_its_own_techniques():
    shape = {"hidden": 256, "intermediate": 512}
    weights = 3 * 256 * 512
    base = DeviceProfile(1e9, 0.0, {"float32": 2e-3, "int4": 1e-3}, "cpu", {"expert_shape": shape},
                         calibration={"overlap": True, "outside_token_s": 1e-3, "outside_layer_s": 2e-4},)
    own = DeviceProfile(base.read_bandwidth, 0.0, base.compute_seconds, "cpu",
                        {"expert_shape": shape, "calibrated_on": {"package_key": "k", "technique_layer_s": 1e-4}},
                        calibration=base.calibration)
    for profile, key, techniques in ((base, None, 0.0), (own, "other", 0.0), (own, "k", 4 * 1e-4)):
        model = profile.for_model(2 * weights, 1000, 500, 4, "float32", key)
        assert model.compute_seconds["int4"] == pytest.approx(2e-3)  # twice the weights of the profile's expert
        assert model.compute_seconds["passthrough"] == pytest.approx(4e-3)  # the source dtype's product
        want = 1e-3 + 4 * 2e-4 + 1500 * 2e-3 / weights + techniques
        assert model.token_overhead == pytest.approx(want)
