"""Device profiles: what a read and an expert's compute cost on a machine, for the simulator's cost model.

A profile is a small JSON file (``moeload profile-device`` writes one for this machine):

    {"format": "moeprep-device-profile", "version": 1, "device": "...",
     "read_bandwidth_bytes_per_s": float, "read_latency_s": float, "direct_io": bool,
     "compute_seconds_per_expert": {precision: float, ...},    # one token through one expert
     "expert_shape": {"hidden": H, "intermediate": I},
     "read_depths": {"1": float, "2": float, ...}, "read_depth": int, ...}   # optional: record reads in flight

The cost model: a demand miss reads for ``read_latency_s + bytes / read_bandwidth_bytes_per_s`` and then
its held form is made (``make_seconds_per_expert``), both on a reader thread; every computed expert costs
``compute_seconds_per_expert[precision]``. Without ``calibration`` nothing overlaps: a layer waits for all
its reads (an upper bound). A profile calibrated against the loader on the device (``calibration``:
``{"overlap": true, "layer_overhead_s": float}``, written by the bench from the loader's own
``decode_timing``) models the loader's step: hits compute while the layer's reads run one after another,
the layer stalls only for what is left of them (``max(0, reads - hits' compute)``), each MoE layer
call costs ``layer_overhead_s`` of the loader's own time, each token ``token_overhead_s`` outside the MoE
layers' steps (attention, dense layers, routers: one model's, so a profile calibrated on one model holds
for that model), and a token takes at least the time of all its reads, prefetches included (one disk): a
wasted prefetch costs time where the disk is the bottleneck.

Measurement (``measure_device``): reads bypass the page cache (O_DIRECT where the filesystem allows
it, else ``posix_fadvise(DONTNEED)`` before reading) from a temporary file of a few hundred MB. Reads
are timed three ways: large sequential 8 MiB reads (``sequential_read_bandwidth_bytes_per_s``), the median
of small random 4 KiB reads (``read_latency_s``), and random reads of one record (``record_bytes``, the
artifact's largest record stride, else 2 MiB) at 4 KiB-aligned offsets with 1, 2, 4 and 8 reads in flight
(that many threads each issuing one blocking ``os.preadv`` at a time, as the loader's reader threads do):
``read_depths`` ({depth: bytes/s}) and ``read_depth``, the smallest depth within 5% of the best (no more
reader threads than pay). ``read_bandwidth_bytes_per_s``, what the simulator charges a miss, is the
bandwidth at ``read_depth``: the loader's misses are record-sized reads at scattered offsets, and a loader
run with ``workers="auto"`` keeps ``read_depth`` of them in flight (the plan carries the depth). That
figure already includes each read's latency, so ``read_latency_s + bytes / bandwidth`` counts the latency of
a read twice; at record sizes (~MBs) the 4 KiB latency is a small part of a read. Compute is timed on a scaled-down expert (H/4, I/4) and scaled by the weight count to
the target expert shape (decode is a matrix-vector product: its time grows with the weights read):
``passthrough``/``bfloat16``/``float16``/``float32`` run the three matrices at that dtype; intN first
dequantizes the packed record with the loader's own codec (``loader.codec.decode_matrix``), then
runs in bfloat16, as the loader does.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loader.codec import MatrixSpec, RecordLayout
from loader.errors import ModelingError
from loader.format import DEVICE_FILE  # noqa: F401 (re-exported: in an artifact, the profile its plan was made with)
from loader.forms import choose_form, matrices_forward
from loader.io import parse_json, write_json_atomic
from loader.vocab import BITS, MX

PROFILE_FORMAT = "moeprep-device-profile"
PROFILE_VERSION = 1
MIXTRAL_SHAPE = (4096, 14336)  # (hidden H, expert intermediate I) of Mixtral-8x7B
MEASURED_PRECISIONS = ("float32", "bfloat16", *BITS)
_ALIGN = 4096
# calibration a profile keeps for any model (``DeviceProfile.for_model``): seconds per token and per decoder layer per
# token outside the MoE steps and the dense weights' products, in decode and in a prompt, fitted by ``moeload
# profile-device --artifact``
MODEL_FREE_CALIBRATION = ("outside_token_s", "outside_layer_s", "prefill_outside_token_s", "prefill_outside_layer_s",
                          "read_overhead_s")


@dataclass(frozen=True)
class DeviceProfile:
    """Costs of one machine: reads (bandwidth, latency) and one token's compute per expert and precision."""

    read_bandwidth: float  # bytes per second
    read_latency: float  # seconds per read, on top of the transfer
    compute_seconds: dict = field(default_factory=dict)  # precision -> seconds per expert per token
    device: str = ""
    extra: dict = field(default_factory=dict)  # everything else the file records (shapes, sizes, direct_io)
    # precision -> seconds to make a missed expert's held form once (loader/forms.py: decode or repack, on a reader thread);
    # compute_seconds is then one use of the held form. Empty in profiles measured before held forms.
    make_seconds: dict = field(default_factory=dict)
    # fitted against the loader on this device: {"overlap": bool, "layer_overhead_s": float} (empty: plain)
    calibration: dict = field(default_factory=dict)

    @property
    def overlap(self) -> bool:
        return bool(self.calibration.get("overlap", False))

    @property
    def layer_overhead(self) -> float:
        return float(self.calibration.get("layer_overhead_s", 0.0))

    @property
    def token_overhead(self) -> float:
        """Seconds per token outside the MoE layers' expert steps (attention, dense layers, routers, the LM
        head, predictors), of the model the profile was calibrated on."""
        return float(self.calibration.get("token_overhead_s", 0.0))

    @property
    def read_depth(self) -> int | None:
        """The reads in flight that measured best (``read_depths``), None in profiles measured before depths."""
        return self.extra.get("read_depth")

    @property
    def prefill_seconds(self) -> dict:
        """{precision: {form: {"make_s": seconds, "tokens": {count: seconds}}}} (``measure_prefill``; empty in
        profiles measured before prefill forms)."""
        return self.extra.get("prefill_seconds_per_expert") or {}

    def weight_seconds(self, dtype: str, prompt: bool = False) -> float:
        """Seconds per weight of a plain ``dtype`` matrix product for one token: a decode step's (``compute_seconds``
        over the profile's expert weights), or with ``prompt`` one token's share of the largest prompt batch timed
        (``prefill_seconds``; 0 where the profile has none)."""
        shape = self.extra.get("expert_shape", {"hidden": MIXTRAL_SHAPE[0], "intermediate": MIXTRAL_SHAPE[1]})
        weights = self.extra.get("scaled_to_weights_per_expert") or 3 * shape["hidden"] * shape["intermediate"]
        if not prompt:
            return self.compute_seconds.get(dtype, self.compute_seconds.get("float32", 0.0)) / weights
        timed = self.prefill_seconds.get(dtype, {}).get("record")
        if not timed:
            return 0.0
        tokens, seconds = max((int(t), s) for t, s in timed["tokens"].items())
        return seconds / tokens / weights

    def for_model(self, weights_per_expert: float, layer_weights: int, head_weights: int, decoder_layers: int,
                  dtype: str, package_key: str | None = None, dense_dtype: str | None = None) -> DeviceProfile:
        """This profile for one model: compute scaled to its experts (``scaled_to``; a source-dtype record computes in
        its dtype) and, where the calibration is model-free (``MODEL_FREE_CALIBRATION``, written by ``moeload
        profile-device --artifact``), the time per token outside the MoE steps for this model: its decoder layers'
        dense weights (attention, norms, routers) and its LM head's at this device's rate, plus the fitted time per
        decoder layer and per token beyond them, for decode and for a prompt; for the artifact the profile was
        calibrated on (``package_key``), what its techniques add per decoder layer too. ``dense_dtype``: the rate the
        dense weights compute at (default ``dtype``; "int8" where the loader holds them at int8)."""
        scaled = self.scaled_to(weights_per_expert)
        dense_dtype = dense_dtype or dtype
        compute = dict(scaled.compute_seconds)
        if dtype in compute:
            compute["passthrough"] = compute[dtype]
        calibration = dict(self.calibration)
        weights = layer_weights + head_weights
        own = self.extra.get("calibrated_on") or {}
        own = own if package_key is not None and own.get("package_key") == package_key else {}
        if "outside_layer_s" in calibration:
            calibration["token_overhead_s"] = (calibration.get("outside_token_s", 0.0)
                                               + decoder_layers * (calibration["outside_layer_s"]
                                                                   + own.get("technique_layer_s", 0.0))
                                               + weights * self.weight_seconds(dense_dtype))
        if "prefill_outside_layer_s" in calibration:
            calibration["prefill_token_overhead_s"] = (calibration.get("prefill_outside_token_s", 0.0)
                                                       + decoder_layers * (calibration["prefill_outside_layer_s"]
                                                                           + own.get("prefill_technique_layer_s", 0.0))
                                                       + weights * self.weight_seconds(dtype, prompt=True))
        return DeviceProfile(scaled.read_bandwidth, scaled.read_latency, compute, scaled.device, scaled.extra,
                             scaled.make_seconds, calibration)

    def transfer_seconds(self, nbytes: int) -> float:
        """The part of a read the disk's bandwidth sets (the rest is per read: ``read_seconds``)."""
        return nbytes / self.read_bandwidth

    def read_seconds(self, nbytes: int) -> float:
        """One record read: latency + bytes / bandwidth, plus a calibrated profile's ``read_overhead_s`` (what the
        loader adds per read: ``loader/calibrate.py``)."""
        return self.read_latency + nbytes / self.read_bandwidth + float(self.calibration.get("read_overhead_s", 0.0))

    def compute(self, precision: str) -> float:
        """Seconds of one expert's compute for a token at ``precision``; an ``MX`` precision computes from its
        bfloat16 held form, so a profile without it uses bfloat16's time."""
        if precision in MX and precision not in self.compute_seconds and "bfloat16" in self.compute_seconds:
            return self.compute_seconds["bfloat16"]
        try:
            return self.compute_seconds[precision]
        except KeyError:
            raise ModelingError(f"the device profile has no compute time for precision {precision!r} (it has "
                               f"{sorted(self.compute_seconds)}); measure again with `moeload profile-device` "
                               "or add the precision to compute_seconds_per_expert") from None

    def make(self, precision: str) -> float:
        """Seconds to make a missed expert's held form (0 where the profile has none: plain records)."""
        if precision in MX and precision not in self.make_seconds:  # a 4-bit decode into bfloat16, as int4's
            return self.make_seconds.get("int4", 0.0)
        return self.make_seconds.get(precision, 0.0)

    def scaled_to(self, weights_per_expert: float) -> DeviceProfile:
        """This profile for experts of ``weights_per_expert`` weights: compute scales with the weights read,
        as decode's matrix-vector products do (the profile's own expert shape is recorded in it)."""
        shape = self.extra.get("expert_shape", {"hidden": MIXTRAL_SHAPE[0], "intermediate": MIXTRAL_SHAPE[1]})
        factor = weights_per_expert / (3 * shape["hidden"] * shape["intermediate"])
        prefill = {p: {f: {"make_s": m["make_s"] * factor, "tokens": {t: s * factor for t, s in m["tokens"].items()}}
                       for f, m in forms.items()} for p, forms in self.prefill_seconds.items()}
        return DeviceProfile(self.read_bandwidth, self.read_latency,
                             {p: s * factor for p, s in self.compute_seconds.items()}, self.device,
                             self.extra | {"scaled_to_weights_per_expert": weights_per_expert}
                             | ({"prefill_seconds_per_expert": prefill} if prefill else {}),
                             {p: s * factor for p, s in self.make_seconds.items()}, dict(self.calibration))

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "device": self.device,
                "read_bandwidth_bytes_per_s": self.read_bandwidth, "read_latency_s": self.read_latency,
                "compute_seconds_per_expert": dict(self.compute_seconds)} | self.extra \
            | ({"make_seconds_per_expert": dict(self.make_seconds)} if self.make_seconds else {}) \
            | ({"calibration": dict(self.calibration)} if self.calibration else {})

    @classmethod
    def from_json(cls, raw: dict, where: str = "device profile") -> DeviceProfile:
        """A profile from its JSON, every field the cost model reads checked for type, range and finiteness
        (``profile_problem``); one ModelingError naming ``where`` and the field otherwise."""
        if problem := profile_problem(raw):
            raise ModelingError(f"device profile {where}: {problem}; {PROFILE_FIX}")
        known = {"format", "version", "device", "read_bandwidth_bytes_per_s", "read_latency_s",
                 "compute_seconds_per_expert", "make_seconds_per_expert", "calibration"}
        return cls(float(raw["read_bandwidth_bytes_per_s"]), float(raw["read_latency_s"]),
                   {k: float(v) for k, v in raw["compute_seconds_per_expert"].items()}, str(raw.get("device", "")),
                   {k: v for k, v in raw.items() if k not in known},
                   {k: float(v) for k, v in raw.get("make_seconds_per_expert", {}).items()},
                   dict(raw.get("calibration", {})))


PROFILE_FIX = "measure it again with `moeload profile-device --output device.json`"
MAX_PROFILE_BYTES = 16 << 20  # a measured profile is a few KB
# sane bounds: no disk reads faster than 10 TB/s, no expert takes an hour a token, no expert dimension passes 2**20
MAX_BANDWIDTH = 1e13
MAX_SECONDS = 3600.0
MAX_DIMENSION = 1 << 20
MAX_DEPTH = 1024  # reads in flight
CALIBRATION_SECONDS = ("layer_overhead_s", "token_overhead_s", "prefill_token_overhead_s", *MODEL_FREE_CALIBRATION)


def _number(x) -> bool:
    """A finite JSON number (``true`` is not one; an integer past float's range is not finite)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _positive(x) -> bool:
    return _number(x) and x > 0


def _seconds(x) -> bool:
    return _number(x) and 0 <= x <= MAX_SECONDS


def _count(x, most: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= most


def _count_key(k, most: int) -> bool:
    return isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9 and 1 <= int(k) <= most


def _seconds_table(x) -> bool:
    """{name: seconds} with every name a non-empty string."""
    return isinstance(x, dict) and all(isinstance(k, str) and k and _seconds(v) for k, v in x.items())


def profile_problem(raw) -> str | None:
    """What is wrong with a device profile's JSON (None: nothing): its format and version, then every field the cost
    model reads, each of its type, finite and within a sane range (``MAX_*``)."""
    if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT or raw.get("version") != PROFILE_VERSION:
        return f"is not a {PROFILE_FORMAT} version {PROFILE_VERSION} file"
    for check in (_reads_problem, _compute_problem, _calibration_problem, _shape_problem, _prefill_problem):
        if problem := check(raw):
            return problem
    return None


def _reads_problem(raw: dict) -> str | None:
    bw, latency = raw.get("read_bandwidth_bytes_per_s"), raw.get("read_latency_s")
    if not (_positive(bw) and bw <= MAX_BANDWIDTH):
        return f"read_bandwidth_bytes_per_s must be bytes/s above 0 and at most {MAX_BANDWIDTH:g}, got {_shown(bw)}"
    if not _seconds(latency):
        return f"read_latency_s must be seconds from 0 to {MAX_SECONDS:g}, got {_shown(latency)}"
    depths, depth = raw.get("read_depths"), raw.get("read_depth")
    if (depths is None) != (depth is None) or depths is not None and not (
            isinstance(depths, dict) and depths
            and all(_count_key(k, MAX_DEPTH) and _positive(v) and v <= MAX_BANDWIDTH for k, v in depths.items())
            and _count(depth, MAX_DEPTH) and str(depth) in depths):
        return (f"read_depths ({{depth: bytes/s above 0}}, depths 1 to {MAX_DEPTH}) and read_depth (one of its depths) "
                "go together or not at all")
    if not isinstance(raw.get("device", ""), str):
        return f"device must be a string, got {_shown(raw.get('device'))}"
    device = raw.get("compute_device", "cpu")
    if not (isinstance(device, str) and re.fullmatch(r"cpu|cuda(:\d{1,3})?|mps", device)):
        return f"compute_device must be cpu, cuda, cuda:N or mps, got {_shown(device)}"
    return None


def _compute_problem(raw: dict) -> str | None:
    compute = raw.get("compute_seconds_per_expert")
    if not (_seconds_table(compute) and compute and all(v > 0 for v in compute.values())):  # no expert is free
        return (f"compute_seconds_per_expert must be {{precision: seconds above 0 and at most {MAX_SECONDS:g}}}, at "
                f"least one, got {_shown(compute)}")
    if not _seconds_table(raw.get("make_seconds_per_expert", {})):
        return (f"make_seconds_per_expert must be {{precision: seconds from 0 to {MAX_SECONDS:g}}}, got "
                f"{_shown(raw.get('make_seconds_per_expert'))}")
    return None


def _calibration_problem(raw: dict) -> str | None:
    calibration = raw.get("calibration", {})
    if not (isinstance(calibration, dict) and set(calibration) <= {"overlap", *CALIBRATION_SECONDS}
            and isinstance(calibration.get("overlap", False), bool)
            and all(_seconds(calibration.get(k, 0.0)) for k in CALIBRATION_SECONDS)):
        return (f"calibration must be {{overlap: bool, and seconds from 0 to {MAX_SECONDS:g} for any of "
                f"{', '.join(CALIBRATION_SECONDS)}}}")
    own = raw.get("calibrated_on", {})
    if not (isinstance(own, dict) and isinstance(own.get("package_key", ""), str)
            and all(_seconds(own.get(k, 0.0)) for k in ("technique_layer_s", "prefill_technique_layer_s"))):
        return (f"calibrated_on must be {{package_key: string, technique_layer_s and prefill_technique_layer_s: "
                f"seconds from 0 to {MAX_SECONDS:g}}}")
    return None


def _shape_problem(raw: dict) -> str | None:
    shape = raw.get("expert_shape", {"hidden": MIXTRAL_SHAPE[0], "intermediate": MIXTRAL_SHAPE[1]})
    if not (isinstance(shape, dict) and set(shape) == {"hidden", "intermediate"}
            and all(_count(v, MAX_DIMENSION) for v in shape.values())):
        return (f"expert_shape must be {{hidden: H, intermediate: I}}, two whole numbers from 1 to {MAX_DIMENSION:,}, "
                f"got {_shown(shape)}")
    scaled = raw.get("scaled_to_weights_per_expert")
    if scaled is not None and not (_positive(scaled) and scaled <= 3 * MAX_DIMENSION ** 2):
        return (f"scaled_to_weights_per_expert must be weights above 0 and at most {3 * MAX_DIMENSION ** 2:,}, got "
                f"{_shown(scaled)}")
    return None


def _prefill_problem(raw: dict) -> str | None:
    table = raw.get("prefill_seconds_per_expert", {})
    fix = (f"prefill_seconds_per_expert must be {{precision: {{form: {{make_s: seconds, tokens: {{count: seconds}}}}}}}}, "
           f"seconds from 0 to {MAX_SECONDS:g}, counts from 1 to {MAX_DIMENSION:,}")
    if not isinstance(table, dict):
        return f"{fix}, got {_shown(table)}"
    for precision, forms in table.items():
        if not (isinstance(precision, str) and isinstance(forms, dict)):
            return f"{fix}; {_shown(precision)} is not"
        for form, timed in forms.items():
            if not (isinstance(form, str) and isinstance(timed, dict) and set(timed) == {"make_s", "tokens"}
                    and _seconds(timed["make_s"]) and isinstance(timed["tokens"], dict) and timed["tokens"]
                    and all(_count_key(k, MAX_DIMENSION) and _seconds(v) for k, v in timed["tokens"].items())):
                return f"{fix}; {precision}.{_shown(form)} is {_shown(timed)}"
    return None


def _shown(value) -> str:
    """A value as the message shows it: JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_profile(path: str | Path) -> DeviceProfile:
    """The one reader of a device profile file, given on a command line (``moeload plan``, ``generate``, ``tune``,
    ``moeprep prepare --device-profile`` and its dry run): a regular file of bounded size, JSON nested at most
    ``loader.io.MAX_JSON_DEPTH`` deep, every field checked (``DeviceProfile.from_json``)."""
    path = Path(path)
    try:
        if not path.exists():
            raise ModelingError(f"device profile {path} does not exist; write one with "
                                f"`moeload profile-device --output {path}`")
        if not path.is_file():
            raise ModelingError(f"device profile {path} is not a regular file; {PROFILE_FIX}")
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise ModelingError(f"device profile {path} is {path.stat().st_size:,} bytes, more than any profile "
                                f"({MAX_PROFILE_BYTES:,}); {PROFILE_FIX}")
        data = path.read_bytes()
    except OSError as e:
        raise ModelingError(f"device profile {path} cannot be read ({e.strerror or e}); {PROFILE_FIX}") from None
    try:
        raw = parse_json(data)
    except ValueError as e:
        raise ModelingError(f"device profile {path} is not valid JSON ({str(e)[:120]}); {PROFILE_FIX}") from None
    return DeviceProfile.from_json(raw, str(path))


def read_artifact_profile(manifest) -> DeviceProfile | None:
    """The profile an artifact carries (``device.json``, the device its plan was made for), None where it carries
    none: sealed (its size and sha256 as the manifest lists them, ``loader.format.sealed_file``), then read as any
    given profile is (``load_profile``), so a profile is refused with one message wherever it comes from."""
    from loader.format import sealed_file

    if DEVICE_FILE not in manifest.files:
        return None
    profile = load_profile(sealed_file(manifest, DEVICE_FILE))
    check_profile_for(manifest, profile)
    return profile


def check_profile_for(manifest, profile: DeviceProfile) -> None:
    """The profile can time this artifact: a compute time for every precision its plan holds experts at, once scaled
    to its model (``model_profile``); else the ModelingError the cost model would raise mid-replay, raised now."""
    from loader.plan import read_plan

    scaled = model_profile(manifest, profile)
    for precision in sorted(set(read_plan(manifest.root).precisions)):
        scaled.compute(precision)


# ------------------------------------------------------------------------------------------ reads


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)  # anonymous maps are page aligned


def _write_file(path: Path, nbytes: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _open_uncached(path: Path) -> tuple[int, bool]:
    """A descriptor whose reads bypass the page cache: (fd, True) with O_DIRECT, else (fd, False)."""
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            buf = _aligned_buffer(_ALIGN)
            os.preadv(fd, [buf], 0)  # some filesystems accept the flag and fail the read
            return fd, True
        except OSError:
            try:
                os.close(fd)
            except (OSError, UnboundLocalError):
                pass
    return os.open(path, os.O_RDONLY), False


def _drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


DEPTHS = (1, 2, 4, 8)  # reads in flight measured (the loader's reader threads)
RECORD_BYTES = 2 << 20  # a record read when no artifact says otherwise (a Mixtral expert at int4 is ~90 MB; tiny ones ~KBs)
DEPTH_TOLERANCE = 0.05  # the depth chosen is the smallest within this share of the best bandwidth


def measure_reads(directory: str | Path | None = None, file_bytes: int = 256 << 20,
                  block_bytes: int = 8 << 20, small_reads: int = 64, seed: int = 0,
                  record_bytes: int = RECORD_BYTES, depths: tuple[int, ...] = DEPTHS,
                  depth_bytes: int | None = None) -> dict:
    """Read bandwidth and latency of the disk holding ``directory`` (default: the temp dir).

    Writes a temporary file of ``file_bytes``, reads it back in ``block_bytes`` reads (sequential
    bandwidth), with ``small_reads`` random 4 KiB reads (latency, the median), and at each depth of
    ``depths`` with that many threads reading ``record_bytes`` at random 4 KiB-aligned offsets until
    ``depth_bytes`` are read (default: the file's size up to 64 MiB; at least two reads a thread), bypassing the page cache. Returns
    {read_bandwidth_bytes_per_s (at the chosen depth), sequential_read_bandwidth_bytes_per_s, read_latency_s,
    read_depths ({"N": bytes/s}), read_depth (the smallest depth within 5% of the best), read_record_bytes,
    direct_io, read_file_bytes, read_block_bytes}.
    """
    import random

    if file_bytes < block_bytes or block_bytes % _ALIGN:
        raise ModelingError(f"read test: file_bytes ({file_bytes}) must hold one block and block_bytes "
                           f"({block_bytes}) be a multiple of {_ALIGN}")
    file_bytes = file_bytes // block_bytes * block_bytes
    if record_bytes <= 0 or record_bytes % _ALIGN or record_bytes > file_bytes:
        raise ModelingError(f"read test: record_bytes ({record_bytes}) must be a positive multiple of {_ALIGN} "
                           f"no larger than the test file ({file_bytes} bytes); raise --file-mb")
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        raise ModelingError(f"read test: depths {depths!r} must be positive numbers of reads in flight")
    depth_bytes = min(file_bytes, 64 << 20) if depth_bytes is None else depth_bytes
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="moeprep-profile-", dir=directory) as tmp:
        path = Path(tmp) / "read-test.bin"
        _write_file(path, file_bytes)
        fd, direct = _open_uncached(path)
        try:
            _drop_cache(fd)
            buf = _aligned_buffer(block_bytes)
            start = time.perf_counter()
            for offset in range(0, file_bytes, block_bytes):
                if not direct:
                    _drop_cache(fd, offset, block_bytes)
                os.preadv(fd, [buf], offset)
            sequential = file_bytes / (time.perf_counter() - start)
            small = _aligned_buffer(_ALIGN)
            latencies = []
            for _ in range(small_reads):
                offset = rng.randrange(file_bytes // _ALIGN) * _ALIGN
                if not direct:
                    _drop_cache(fd, offset, _ALIGN)
                start = time.perf_counter()
                os.preadv(fd, [small], offset)
                latencies.append(time.perf_counter() - start)
            by_depth = {str(d): _depth_bandwidth(fd, direct, file_bytes, record_bytes, d, depth_bytes, rng)
                        for d in sorted(set(depths))}
        finally:
            os.close(fd)
    best = max(by_depth.values())
    depth = min(int(d) for d, bw in by_depth.items() if bw >= (1 - DEPTH_TOLERANCE) * best)
    return {"read_bandwidth_bytes_per_s": by_depth[str(depth)], "sequential_read_bandwidth_bytes_per_s": sequential,
            "read_latency_s": statistics.median(latencies), "read_depths": by_depth, "read_depth": depth,
            "read_record_bytes": record_bytes, "direct_io": direct, "read_file_bytes": file_bytes,
            "read_block_bytes": block_bytes}


def _depth_bandwidth(fd: int, direct: bool, file_bytes: int, record_bytes: int, depth: int, total_bytes: int,
                     rng) -> float:
    """Bytes/s of ``depth`` threads each issuing blocking ``record_bytes`` reads at random aligned offsets of
    ``fd`` (``os.preadv`` releases the GIL: the reads are in flight together), ``total_bytes`` in all."""
    import threading

    per_thread = max(2, -(-total_bytes // (record_bytes * depth)))
    last = (file_bytes - record_bytes) // _ALIGN
    offsets = [[rng.randint(0, last) * _ALIGN for _ in range(per_thread)] for _ in range(depth)]
    buffers = [_aligned_buffer(record_bytes) for _ in range(depth)]
    ready = threading.Barrier(depth + 1)
    failed: list[BaseException] = []

    def read(mine: list[int], buf) -> None:
        ready.wait()
        try:
            for offset in mine:
                if not direct:
                    _drop_cache(fd, offset, record_bytes)
                os.preadv(fd, [buf], offset)
        except OSError as e:
            failed.append(e)

    threads = [threading.Thread(target=read, args=(mine, buf), daemon=True) for mine, buf in zip(offsets, buffers,
                                                                                                 strict=True)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failed:
        raise ModelingError(f"read test at depth {depth} failed: {failed[0]}")
    return depth * per_thread * record_bytes / elapsed


# ---------------------------------------------------------------------------------------- compute


class _GatedExperts:
    """What ``loader.forms`` forwards need of an experts module: a SiLU-gated MLP, [out, in] weights."""

    is_transposed = False

    @staticmethod
    def _apply_gate(gate_up):
        import torch

        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def measure_compute(expert_shape: tuple[int, int] = MIXTRAL_SHAPE, scale: int = 4, repeats: int = 5,
                    device: str = "cpu", group_size: int = 64) -> tuple[dict, dict]:
    """(compute, make): seconds for one token through one expert of ``expert_shape`` (H, I), per precision,
    and for a quantized precision the seconds to make its held form once after a miss.

    Timed on (H/scale, I/scale) and scaled up by the weight count (scale**2). float32 and bfloat16 (also
    float16 and passthrough: the source dtype of the models we target) are plain products; int8/int4/
    int3/int2 are what the loader does (``loader/forms.py``): the held form ``auto`` takes on this
    device (``choose_form``), made once (make) and then used (compute). Timed in the codec's layout, the one the
    packager writes for a CPU target: where the compiled kernels run, the record is the qdot form, so it has no make
    time: a miss costs its read and its check.
    """
    import torch


    hidden, inter = expert_shape[0] // scale, expert_shape[1] // scale
    if hidden < group_size or inter % group_size or hidden % group_size:
        raise ModelingError(f"expert shape {expert_shape} / {scale} = ({hidden}, {inter}) must be multiples of the "
                           f"group size {group_size}")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        fn()  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        # the fastest: noise only adds time, so the minimum is the work's own cost (a median of 5 on a loaded
        # machine came out 100x slow, and the planner then saw every read hidden behind compute)
        return min(times)

    module = _GatedExperts()
    shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    out: dict[str, float] = {}
    make: dict[str, float] = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            weights = {n: torch.randn(s, generator=gen).to(dev, dtype) for n, s in shapes.items()}
            x = torch.randn(1, hidden, generator=gen).to(dev, dtype)
            out[str(dtype).removeprefix("torch.")] = timed(lambda w=weights, x=x: matrices_forward(module, w, x))
        for precision in BITS:
            specs = [MatrixSpec(name, shape, precision, "bfloat16", group_size) for name, shape in shapes.items()]
            layout = RecordLayout(tuple(specs))
            record = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
            # valid float16 scales and zeros, so the decode does the real arithmetic
            for _name, dtype, offset, size in layout.parts():
                if dtype == "float16":
                    record[offset:offset + size] = torch.rand(size // 2, generator=gen).half().view(torch.uint8)
            record = record.to(dev)
            x = torch.randn(1, hidden, generator=gen).to(dev, torch.bfloat16)
            form = choose_form("auto", layout, dev)
            region = torch.empty(form.nbytes, dtype=torch.uint8, device=dev)
            if form.staged:
                make[precision] = timed(lambda f=form, r=record, g=region: f.make(r, g))
            weights = form.make(record, region)
            out[precision] = timed(lambda f=form, w=weights, x=x: f.forward(module, w, x))
    factor = scale * scale
    seconds = {p: s * factor for p, s in out.items()}
    seconds["float16"] = seconds["passthrough"] = seconds["bfloat16"]
    return dict(sorted(seconds.items())), {p: s * factor for p, s in sorted(make.items())}


PREFILL_TOKENS = (1, 16, 64, 256)  # tokens of one expert in a prompt chunk, where the prefill forms are timed
PREFILL_FORMS = ("float32", "bfloat16")  # forms a prefill may make from a quantized record besides its held form


def measure_prefill(expert_shape: tuple[int, int] = MIXTRAL_SHAPE, scale: int = 4, repeats: int = 3,
                    device: str = "cpu", group_size: int = 64, tokens: tuple = PREFILL_TOKENS,
                    source_dtype: str = "bfloat16") -> dict:
    """Per quantized precision and form (its held form on ``device`` and ``PREFILL_FORMS``): the seconds to make the
    form from a record (``make_s``) and to compute ``tokens`` tokens through one expert of ``expert_shape``
    (``tokens``: {count: seconds}), timed on (H/scale, I/scale) and scaled by the weight count as
    ``measure_compute`` is. What the planner compares to choose a prefill form (``plan.prefill.forms``), and the
    simulator's prefill compute. Plain records ("float32", "bfloat16"; "passthrough" in ``source_dtype``, the source
    model's) are timed in their one form, the record."""
    import torch

    hidden, inter = expert_shape[0] // scale, expert_shape[1] // scale
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    module = _GatedExperts()
    shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    factor = scale * scale

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        return min(times) * factor

    out: dict = {}
    with torch.no_grad():
        for dtype_name in ("float32", "bfloat16"):
            dtype = getattr(torch, dtype_name)
            weights = {n: torch.randn(sh, generator=gen).to(dev, dtype) for n, sh in shapes.items()}
            seconds = {}
            for t in tokens:
                x = torch.randn(t, hidden, generator=gen).to(dev, dtype)
                seconds[str(t)] = timed(lambda w=weights, x=x: matrices_forward(module, w, x))
            out[dtype_name] = {"record": {"make_s": 0.0, "tokens": seconds}}
        out["passthrough"] = out[source_dtype]
        for precision in BITS:
            layout = RecordLayout(tuple(MatrixSpec(n, sh, precision, "bfloat16", group_size) for n, sh in shapes.items()))
            record = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
            for _name, dtype, offset, size in layout.parts():
                if dtype == "float16":
                    record[offset:offset + size] = torch.rand(size // 2, generator=gen).half().view(torch.uint8)
            record = record.to(dev)
            held = choose_form("auto", layout, dev)
            forms = {held.name: held} | {n: choose_form(n, layout, dev) for n in PREFILL_FORMS if n != held.name}
            out[precision] = {}
            for name, form in forms.items():
                region = torch.empty(max(1, form.nbytes), dtype=torch.uint8, device=dev)
                make = timed(lambda f=form, r=record, g=region: f.make(r, g)) if form.staged else 0.0
                weights = form.make(record, region) if form.staged else form.make(record)
                dtype = torch.float32 if name == "float32" else torch.bfloat16
                seconds = {}
                for t in tokens:
                    x = torch.randn(t, hidden, generator=gen).to(dev, dtype)
                    seconds[str(t)] = timed(lambda f=form, w=weights, x=x: f.forward(module, w, x))
                out[precision][name] = {"make_s": make, "tokens": seconds}
    return out


def measure_device(directory: str | Path | None = None, file_bytes: int = 256 << 20,
                   expert_shape: tuple[int, int] = MIXTRAL_SHAPE, device: str = "cpu",
                   record_bytes: int = RECORD_BYTES) -> DeviceProfile:
    """Measure this machine: reads from ``directory``'s disk (``record_bytes``: one read of a miss, see
    ``measure_reads``) and one expert's compute on ``device``: a decode step's on the torch threads the loader's decode
    steps run on beside ``read_depth`` reader threads (``loader.runtime.compute_threads``), a prompt's on torch's own
    count (as ``load(threads="auto")`` runs them)."""
    import torch

    from loader.options import compute_threads

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelingError("--device cuda was asked for but CUDA is not available; use --device cpu")
    reads = measure_reads(directory, file_bytes, record_bytes=record_bytes)
    own = torch.get_num_threads()
    decode_threads = compute_threads(torch.device(device), reads["read_depth"]) or own
    torch.set_num_threads(decode_threads)
    try:
        compute, make = measure_compute(expert_shape, device=device)
    finally:
        torch.set_num_threads(own)
    prefill = measure_prefill(expert_shape, device=device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else (platform.processor() or platform.machine())
    extra = {k: v for k, v in reads.items() if not k.startswith("read_bandwidth") and k != "read_latency_s"}
    extra |= {"expert_shape": {"hidden": expert_shape[0], "intermediate": expert_shape[1]},
              "compute_device": device, "torch_threads": own, "decode_torch_threads": decode_threads,
              "prefill_seconds_per_expert": prefill,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return DeviceProfile(reads["read_bandwidth_bytes_per_s"], reads["read_latency_s"], compute,
                         f"{device}: {name}", extra, make)


def calibrated(profile: DeviceProfile, layer_overhead_s: float, token_overhead_s: float = 0.0) -> DeviceProfile:
    """``profile`` modelling the loader's step: reads overlap hits' compute, plus the loader's own time per MoE
    layer call (``stats()["decode_timing"]["overhead_per_layer_step"]`` of a loader run on this device) and, for
    one model, the time per token outside the MoE layers' steps (``outside_per_token``)."""
    import dataclasses

    return dataclasses.replace(profile, calibration={"overlap": True, "layer_overhead_s": max(0.0, float(layer_overhead_s)),
                                                     "token_overhead_s": max(0.0, float(token_overhead_s))})


def check_output(path: str | Path) -> Path:
    """``path`` as a place a profile can be written: its directory exists and is writable, and it is not a directory
    itself. ``moeload profile-device`` checks it before minutes of measurement, not after."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ModelingError(f"--output {path} is a directory; name a file, e.g. {path / DEVICE_FILE}")
    if not parent.is_dir():
        raise ModelingError(f"--output {path}: the directory {parent} does not exist; create it first or write "
                            "elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ModelingError(f"--output {path}: the directory {parent} is not writable; write elsewhere")
    return path


def write_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write ``profile`` atomically (a reader sees the old file or the new one, never a torn one)."""
    path = Path(path)
    write_json_atomic(path, profile.to_json())
    return path


# ------------------------------------------------------------------------------------------ calibration


def dense_weights(manifest) -> tuple[int, int, int]:
    """(the decoder layers' dense matrix weights, the other products' (the LM head), the decoder layers) of an
    artifact, from its config and the dense file's header: an untied input embedding is a lookup, not a product."""
    from safetensors import safe_open

    from loader.format import read_json

    config = read_json(manifest.path("config.json"), "config.json")
    text = config.get("text_config") or config
    layers = int(text.get("num_hidden_layers", len(manifest.moe.layers)))
    prefix = manifest.moe.last_decoder_layer.rsplit(".", 1)[0] + "."  # e.g. "model.layers."
    in_layers = head = 0
    with safe_open(str(manifest.path("dense.safetensors")), framework="pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) < 2 or (name.endswith("embed_tokens.weight") and not text.get("tie_word_embeddings", False)):
                continue
            if name.startswith(prefix):
                in_layers += math.prod(shape)
            else:
                head += math.prod(shape)
    return in_layers, head, layers


def model_profile(manifest, profile: DeviceProfile) -> DeviceProfile:
    """``profile`` for this artifact's model (``DeviceProfile.for_model``): its experts' weights, its dense weights
    and decoder layers (the time per token outside the MoE steps)."""
    import torch

    moe = manifest.moe
    itemsize = torch.empty((), dtype=getattr(torch, moe.dtype)).element_size()
    per_expert = int(moe.source_expert_bytes) / itemsize / (len(moe.layers) * moe.num_experts)
    in_layers, head, layers = dense_weights(manifest)
    plan = getattr(manifest, "plan", None)
    return profile.for_model(per_expert, in_layers, head, layers, moe.dtype, manifest.raw.get("package_key"),
                             dense_dtype=dense_rate(plan, profile, moe.dtype))


def dense_rate(plan, profile: DeviceProfile, dtype: str) -> str:
    """The ``compute_seconds`` entry a decode step's dense weights compute at: "int8" where the plan holds them at
    int8 (``loader/dense.py``) and the profile timed the kernels' int8, else the model's ``dtype``."""
    held_int8 = plan is not None and plan.dense == "int8"
    return "int8" if held_int8 and "int8" in profile.compute_seconds else dtype
