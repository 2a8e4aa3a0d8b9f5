"""``moeprep bench``: every system on every subject at every budget, in one run, in turn.

Systems (DESIGN.md section 7, "Speed"):
- ``resident``: transformers with every weight in memory, the ceiling, in its fastest configuration on this
  device: at the start of each subject's measurement every candidate (dtype float32 / bfloat16, and float16
  on CUDA, x transformers' experts implementation eager / grouped_mm / batched_mm) decodes a few tokens in
  its own worker process, and the fastest runs as ``resident`` (the candidates and the choice go into
  bench.json and bench.md; a candidate that fails is listed with its reason). Budget-independent: measured
  once per subject (in each round), its row repeated at each budget; every "vs resident" ratio is against it.
- ``accelerate``: transformers with accelerate's offloading at the same budget, what users do today.
- ``naive``: the loader with per-layer LRU caches, no prediction, one precision.
- ``naive+<predictor>``: ``naive`` plus one prefetch predictor of the artifact's plan (with its knobs), for
  each predictor the plan has: what that predictor alone buys. The mixtral-shape subject's plan has none
  (its weights are random and its routing replayed, so hidden-state predictors would predict noise).
- ``naive+neuron``: ``naive`` plus the plan's neuron-level loading (CORM, a neuron-layout artifact), no
  predictor: against ``naive`` (whole-expert reads of the same records), what reading only the active
  neurons buys at the same budget.
- ``moeprep``: the loader with the artifact's plan (``plan.json``: its pools, eviction policy, predictors,
  routing and miss policies), scaled to the budget.
- ``int4`` and ``int4+<technique>`` (the ``mixtral-shape-techniques`` subject only): the loader on the artifact
  of that one technique (gating, dynamic_precision, path_stats, allocation) prepared on uniform int4 from
  Mixtral's recorded decisions (``prep/studies/bench/subjects.py``); its ``moeprep`` is all of them together.
  A replayed routing goes through each plan's own routing policy (``load(replay=...)``), so gating decides on
  Mixtral's weights; each row records what the routing and miss policies decided in its decode steps.
- every system runs with torch's own intra-op threads (the loader's ``threads`` option is left off), so
  ratios compare systems, not threads.
- ``naive@unlimited`` and ``moeprep@unlimited``: that loader system at the budget ``unlimited``, every expert
  cached in its held form; budget-free like ``resident``. Their speeds are the compute floors of the bounds
  below (``naive``'s for the naive rows, ``moeprep``'s for moeprep and llama.cpp).

Beside each loader row's measured speed (and its ``overhead_us_per_layer``, the loader's own time per MoE
layer step: ``prep/studies/bench/worker.py``), the simulator's model of it (``modelled_tokens_per_s``): the same
artifact, plan, budget and routing decisions (the replayed trace, or what the resident model's routers did,
recorded in round 1) replayed by ``prep.sim.simulate.simulate`` with the device profile measured once at the
start of the run (``loader.device.measure_device``, written to ``device.json``; on CUDA its reads are
pinned host-to-device copies, as the loader's host store reads) scaled to the subject's experts; decode tokens
over the modelled seconds of the decode steps (the replay of prompt + decode less that of the prompt alone).
The cost model counts expert reads and expert compute only, not attention or the dense layers, so modelled
speeds are above measured ones by what those take. A row the simulator cannot model (neuron-level loading,
predictors without recorded router inputs) has None and ``modelled_error`` saying why. Where the loader counts
its overhead, ``modelled_calibrated_tokens_per_s`` is the same replay with the profile calibrated against this
run (``loader.device.calibrated``: reads overlap the hits' compute, plus the median measured overhead per MoE
layer call; written to ``device-calibrated.json``): the simulator's model of the loader's step.

The bound of each budget (``physical_bounds``): 1 / max(the compute floor per token, Belady's I/O floor per
token), where the compute floor is the ``@unlimited`` row of the same artifact and plan and Belady's I/O floor
the demand bytes per decode token a clairvoyant cache reads at that budget over the profile's read bandwidth;
``fraction_of_bound`` of each loader row is its speed over that bound (None for neuron-level loading, which
reads and computes parts of experts, with ``fraction_of_bound_error`` saying so).

A budget ``p%`` is what the loader makes of it (``loader.runtime.budget_bytes``: the dense weights + p% of
the source model's expert bytes, read buffers included); accelerate gets the same number of bytes as
``max_memory``. Each measurement runs in its own
process (``prep/studies/bench/worker.py``) so peak RSS is per system and memory is handed back between systems.

``--prefill 512,2048`` adds prefill rows after the decode rows (time to first token and prompt tokens/s, moeprep's
bound; ``prep/studies/bench/prefill.py``), ``--no-decode`` leaves the decode rows out.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loader.codec import DEFAULT_FORMATS, MatrixSpec
from loader.device import measure_device
from loader.errors import MoeError
from loader.io import write_bytes_atomic
from loader.plan import PolicySpec, read_plan
from loader.predict import PREDICTORS_FILE, ROUTING_ONLY, make_predictor
from loader.runtime import budget_bytes
from loader.vocab import PREDICTOR_NAMES
from prep.errors import MoeprepError
from prep.methods.trace import MIXTRAL_TRACE_FILE
from prep.sim.replay import replay_from_routing
from prep.sim.simulate import PredictionFeed, artifact_spec, simulate
from prep.studies.bench.llama import QUANT, logit_check, prepare_gguf
from prep.studies.bench.llama import missing as llama_missing
from prep.studies.bench.prefill import (
    PREFILL_BUDGETS,
    UNFIT_FOR_PROMPTS,
    add_bounds,
    add_memory_verdicts,
    parse_prompts,
    run_prefill,
)
from prep.studies.bench.report import write_markdown, write_plot
from prep.studies.bench.subjects import (
    TECHNIQUES,
    Subject,
    mixtral_shape_subject,
    mixtral_shape_techniques_subject,
    reference_subject,
)
from prep.studies.bench.worker import loader_plan, runs_loader

SYSTEMS = ("resident", "accelerate", "naive", "moeprep")
UNLIMITED = "unlimited"
RESIDENT_DTYPES = ("float32", "bfloat16")  # the resident candidates' dtypes, and on CUDA also:
CUDA_RESIDENT_DTYPES = ("float16",)
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # transformers' (integrations/moe.py)
PREDICTOR_SYSTEMS = tuple(f"naive+{name}" for name in PREDICTOR_NAMES)
SUBJECTS = ("reference", "reference-lossless", "reference-neuron", "mixtral-shape", "mixtral-shape-own",
            "mixtral-shape-techniques")
LLAMA = "llama.cpp"
LLAMA_MAX_LOGIT_ERROR = 1e-3  # llama.cpp's float32 logits against transformers', checked before timing
BELOW_4BIT = "4bit-25%"  # the dense weights + 25% of the model's expert bytes at 4 bits: below a 4-bit model's size
DEFAULT_BUDGETS = f"100%,50%,25%,12.5%,{BELOW_4BIT}"
QUICK_BUDGETS = "25%"
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1
RESULT_KEYS = ("subject", "system", "budget", "repeats", "decode_tokens_per_s", "decode_tokens_per_s_min",
               "decode_tokens_per_s_max", "modelled_tokens_per_s", "fraction_of_bound", "overhead_us_per_layer",
               "prefill_s", "bytes_read_per_token", "hit_rate", "stall_fraction", "peak_rss_mb")


@dataclass(frozen=True)
class Sizes:
    """Tokens per measurement: a prompt prefilled at once, then decode steps of one token each."""

    reference_prompt: int
    reference_decode: int
    shape_prompt: int
    shape_decode: int
    bandwidth_bytes: int  # how much of the largest store file to read for the disk bandwidth
    candidate_decode: int  # decode steps each resident candidate is timed on
    profile_bytes: int  # the device profile's read-test file


FULL = Sizes(reference_prompt=64, reference_decode=64, shape_prompt=16, shape_decode=24,
             bandwidth_bytes=1 << 30, candidate_decode=8, profile_bytes=256 << 20)
QUICK = Sizes(reference_prompt=8, reference_decode=4, shape_prompt=4, shape_decode=4, bandwidth_bytes=16 << 20,
              candidate_decode=2, profile_bytes=16 << 20)


def parse_budgets(text: str) -> list[str]:
    """"12.5%,25%" -> ["12.5%", "25%"]; each a share of the expert store in (0, 100], or ``4bit-25%`` (the
    dense weights + 25% of the experts' bytes at 4 bits)."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    for b in budgets:
        if b == BELOW_4BIT:
            continue
        try:
            share = float(b.removesuffix("%"))
        except ValueError:
            share = -1
        if not b.endswith("%") or not 0 < share <= 100:
            raise MoeprepError(f"--budgets: {b!r} is not a share like 25% (in (0, 100]) or {BELOW_4BIT}; "
                               f"pass e.g. --budgets 12.5%,25%,50%,100%,{BELOW_4BIT}")
    if not budgets:
        raise MoeprepError("--budgets is empty; pass e.g. --budgets 25%")
    return budgets


def machine_info(device: str) -> dict:
    import accelerate
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(ram / 1e9, 1), "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "python": platform.python_version(), "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def source_commit() -> str:
    """The git commit of the checkout the bench's code runs from, with ``-dirty`` where its tracked files under
    prep/ or loader/ differ from it; ``unknown`` outside a git checkout (or without git)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        top = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        changed = subprocess.run(["git", "-C", top, "status", "--porcelain", "--untracked-files=no", "--", "prep",
                                  "loader"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if changed.returncode != 0 or changed.stdout.strip() else "")


def read_bandwidth(path: Path, limit: int, chunk: int = 16 << 20) -> dict:
    """Sequential read bandwidth of the disk holding ``path``: O_DIRECT reads of up to ``limit`` bytes.

    Without O_DIRECT (a filesystem that refuses it) the file's page cache is dropped first and
    ``direct`` says so.
    """
    size = path.stat().st_size
    total = min(limit, size) // 4096 * 4096
    chunk = min(chunk, max(4096, total))
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    direct = True
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.preadv(fd, [buf], 0)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        done = 0
        start = time.perf_counter()
        while done < total:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        buf.close()
    return {"mb_s": done / seconds / 1e6 if seconds else None, "bytes": done, "file": str(path),
            "direct": direct}


def four_bit_expert_bytes(subject: Subject) -> int:
    """The source model's experts at 4 bits in the codec's default int4 format (its bits per weight: codes,
    8-bit scale and zero per group of 64, their float16 meta)."""

    group, meta = DEFAULT_FORMATS["int4"]
    moe = subject.manifest["moe"]
    source_weights = int(moe["source_expert_bytes"]) // {"float32": 4, "bfloat16": 2, "float16": 2}[moe["dtype"]]
    spec = MatrixSpec("w", (4096, 4096), "int4", moe["dtype"], group, meta_group=meta)
    per_weight = sum(size for _n, _d, size in spec.parts()) / spec.numel
    return int(source_weights * per_weight)


def _budget_bytes(subject: Subject, budget: str) -> int:
    """The loader's reading of a share budget, in bytes (one function for the loader, bench and simulator);
    ``4bit-25%``: the dense weights + 25% of ``four_bit_expert_bytes``."""

    if budget == BELOW_4BIT:
        dense = budget_bytes(subject.artifact, "100%") - int(subject.manifest["moe"]["source_expert_bytes"])
        return dense + four_bit_expert_bytes(subject) // 4
    return budget_bytes(subject.artifact, budget)


def _run_worker(spec: dict, work: Path) -> dict:
    """Run one measurement in a fresh process; its stderr goes to a log file beside the spec."""
    tag = spec.get("tag") or f"{spec['subject']}-{spec['system']}-{spec['budget'].replace('%', 'pct')}"
    spec_path, log_path = work / f"{tag}.json", work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    # Flush what the previous system wrote (accelerate's offload folder: GBs) before timing the next
    # one, so its writeback does not compete with the next system's reads.
    os.sync()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "prep.studies.bench.worker", str(spec_path)], stdout=subprocess.PIPE,
                              stderr=log, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text().strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)} (log: {log_path})"}
    return json.loads(lines[-1])


def _measure_system(spec: dict, work: Path, gguf: str | None = None) -> dict:
    """One worker run with what surrounds it: accelerate's offload folder removed before and after, llama.cpp's
    GGUF (``gguf``) run inside a fresh memory cgroup of the budget + ``CGROUP_HEADROOM``, removed after."""
    offload = Path(spec["offload_dir"])
    cgroup = None
    if spec["system"] == LLAMA:
        from prep.studies.bench.llama import CGROUP_HEADROOM, make_cgroup

        cgroup = make_cgroup(f"moeprep-bench-{os.getpid()}", spec["budget_bytes"] + CGROUP_HEADROOM)
        spec = spec | {"gguf": gguf, "cgroup": str(cgroup)}
    shutil.rmtree(offload, ignore_errors=True)
    try:
        return _run_worker(spec, work)
    finally:
        shutil.rmtree(offload, ignore_errors=True)
        if cgroup is not None:
            from prep.studies.bench.llama import remove_cgroup

            remove_cgroup(cgroup)


def summarize(runs: list[dict]) -> dict:
    """One row from the repeats of a configuration: the median run's figures (by decode speed), the median,
    min and max decode speed, and how many repeats succeeded; an error when none did."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["decode_tokens_per_s"])
    if not ok:
        return {"repeats": 0, "error": runs[-1]["error"]}
    speeds = [r["decode_tokens_per_s"] for r in ok]
    mid = len(ok) // 2
    median = speeds[mid] if len(ok) % 2 else (speeds[mid - 1] + speeds[mid]) / 2
    return ok[mid] | {"repeats": len(ok), "decode_tokens_per_s": median, "decode_tokens_per_s_min": speeds[0],
                      "decode_tokens_per_s_max": speeds[-1], "decode_tokens_per_s_runs": speeds,
                      "failed_repeats": len(runs) - len(ok)}


def accuracy_delta(artifact: Path) -> dict | None:
    """Per suite, the prepared-minus-original accuracy in points from the artifact's report (None: no eval)."""
    path = Path(artifact) / "report.json"
    try:
        suites = (json.loads(path.read_text()).get("eval") or {}).get("suites") or {}
    except (OSError, ValueError):
        return None
    return {name: {"delta_points": 100 * s["delta"], "n": s["n"]} for name, s in suites.items()
            if s.get("delta") is not None} or None


# ------------------------------------------------------------------------------- resident candidates


def resident_candidates(device: str) -> list[tuple[str, str]]:
    """(dtype, transformers experts implementation) pairs the resident baseline is chosen from on ``device``."""
    dtypes = RESIDENT_DTYPES + (CUDA_RESIDENT_DTYPES if device == "cuda" else ())
    return [(dtype, impl) for dtype in dtypes for impl in EXPERTS_IMPLEMENTATIONS]


def _experts_implementations() -> set | None:
    """The experts implementations this transformers knows ("eager" and its ``ALL_EXPERTS_FUNCTIONS``); None
    where it has no such registry (then each candidate is tried and fails in its worker if unknown)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return {"eager", *ALL_EXPERTS_FUNCTIONS.keys()}


def choose_resident(candidates: list[dict], speed: str = "decode_tokens_per_s") -> dict | None:
    """The fastest candidate that ran (by ``speed``: decode tokens/s, or prompt tokens/s for the prefill rows), the
    only one that did not fail when it was not timed, or None when every one failed."""
    ok = [c for c in candidates if not c.get("error")]
    timed = [c for c in ok if c.get(speed)]
    if timed:
        return max(timed, key=lambda c: c[speed])
    return ok[0] if len(ok) == 1 else None


def measure_resident_candidates(base: dict, candidates: list[tuple[str, str]], decode: int, work: Path,
                                on_run=None, speed: str = "decode_tokens_per_s") -> dict:
    """Time a prefill of the prompt and ``decode`` decode steps of each (dtype, experts implementation) candidate
    (a prefill spec, ``speed="prefill_tokens_per_s"``: the prompt alone), each in its own worker process (none when
    only one can run); a candidate that fails is listed with its reason (one this transformers does not know
    without a process). Returns {"candidates": [...], "decode_tokens": decode, "chosen": {dtype,
    experts_implementation, <speed>} or None}."""
    known = _experts_implementations()
    runnable = [c for c in candidates if known is None or c[1] in known]
    out = []
    for dtype, impl in candidates:
        entry = {"dtype": dtype, "experts_implementation": impl}
        if known is not None and impl not in known:
            entry["error"] = f"this transformers has no experts implementation {impl!r} (it has {', '.join(sorted(known))})"
        elif len(runnable) == 1:  # nothing to choose between: not timed
            entry["note"] = "the only candidate, not timed"
        else:
            spec = base | {"system": "resident", "dtype": dtype, "experts_implementation": impl,
                           "decode_ids": base["decode_ids"][:decode], "record_routing": None,
                           "tag": f"{base.get('tag') or base['subject'] + '-resident'}-{dtype}-{impl}"}
            result = _run_worker(spec, work)
            if "error" in result:
                entry["error"] = result["error"]
            else:
                entry |= {k: result[k] for k in (speed, "decode_tokens", "prefill_s", "ttft_s", "load_s",
                                                 "peak_rss_mb") if k in result}
        if on_run is not None:
            on_run(entry)
        out.append(entry)
    chosen = choose_resident(out, speed)
    return {"candidates": out, "decode_tokens": decode,
            "chosen": {k: chosen.get(k) for k in ("dtype", "experts_implementation", speed)} if chosen else None}


# -------------------------------------------------------------------------------- the device profile

FALLBACK_EXPERT_SHAPE = (4096, 14336)  # Mixtral-8x7B's (hidden, intermediate), when no subject says its own
PROFILE_MULTIPLE = 256  # measure_compute times (H/4, I/4), each a multiple of its quantization group (64)


def expert_shape(subject: Subject) -> tuple[int, int] | None:
    """(hidden, expert intermediate) of the subject's model (its config.json); None where it names neither."""
    try:
        config = json.loads((Path(subject.model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hidden, inter = config.get("hidden_size"), config.get("moe_intermediate_size") or config.get("intermediate_size")
    return (int(hidden), int(inter)) if hidden and inter else None


def weights_per_expert(subject: Subject) -> float:
    moe = subject.manifest["moe"]
    per_weight = {"float32": 4, "bfloat16": 2, "float16": 2}[moe["dtype"]]
    return int(moe["source_expert_bytes"]) / per_weight / (len(moe["layers"]) * moe["num_experts"])


def profile_shape(subjects: list[Subject]) -> tuple[int, int]:
    """The expert shape the profile's compute is timed on: the largest subject expert's, rounded up to what
    ``measure_compute`` takes (each subject then scales the profile to its own experts)."""
    shapes = [shape for shape in (expert_shape(s) for s in subjects) if shape]
    if not shapes:
        return FALLBACK_EXPERT_SHAPE
    hidden, inter = max(shapes, key=lambda shape: shape[0] * shape[1])
    return tuple(-(-n // PROFILE_MULTIPLE) * PROFILE_MULTIPLE for n in (hidden, inter))


def _host_copies(nbytes: int, block: int = 8 << 20, small: int = 32) -> dict:
    """Pinned host-to-GPU copies (what the loader's host store does on a CUDA miss): the bandwidth of
    ``block``-sized copies over ``nbytes`` and the latency of 4 KiB copies (the median)."""
    import statistics

    block = min(block, nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(block, dtype=torch.uint8, device="cuda")
    dst.copy_(src[:block])
    torch.cuda.synchronize()
    start, done = time.perf_counter(), 0
    for offset in range(0, nbytes - block + 1, block):
        dst.copy_(src[offset:offset + block], non_blocking=True)
        done += block
    torch.cuda.synchronize()
    bandwidth = done / (time.perf_counter() - start)
    latencies = []
    for i in range(small):
        start = time.perf_counter()
        dst[:4096].copy_(src[i * 4096:(i + 1) * 4096])
        torch.cuda.synchronize()
        latencies.append(time.perf_counter() - start)
    return {"read_bandwidth_bytes_per_s": bandwidth, "read_latency_s": statistics.median(latencies)}


def device_profile(subjects: list[Subject], sizes: Sizes, device: str, output: Path, store: str = "host"):
    """This machine's ``loader.device`` profile, measured once for the run (reads from a file on the output's
    disk, one expert's compute on ``device``; on CUDA with ``store="host"`` the reads are pinned host-to-GPU
    copies, as the loader's host store reads there), written to ``output/device.json``."""

    profile = measure_device(output, file_bytes=sizes.profile_bytes, expert_shape=profile_shape(subjects),
                             device=device)
    if device == "cuda" and store == "disk":
        copies = _host_copies(sizes.profile_bytes)
        profile = dataclasses.replace(profile, extra=profile.extra | {
            "reads": "disk reads bypassing the page cache (the loader's disk store; a pinned copy follows each)",
            "host_copy_bandwidth_bytes_per_s": copies["read_bandwidth_bytes_per_s"]})
    elif device == "cuda":
        copies = _host_copies(sizes.profile_bytes)
        profile = dataclasses.replace(
            profile, read_bandwidth=copies["read_bandwidth_bytes_per_s"], read_latency=copies["read_latency_s"],
            extra=profile.extra | {"reads": "pinned host-to-GPU copies (the loader's host store on CUDA)",
                                   "disk_read_bandwidth_bytes_per_s": profile.read_bandwidth,
                                   "disk_read_latency_s": profile.read_latency})
    else:
        profile = dataclasses.replace(profile, extra=profile.extra | {"reads": "disk reads bypassing the page cache"})
    _write_atomic(output / "device.json", json.dumps(profile.to_json(), indent=2) + "\n")
    return profile


def calibrated_profile(profile, results: list[dict]):
    """``profile`` calibrated against the loader as measured in this run (``loader.device.calibrated``: reads
    overlapping hits' compute, and the loader's own time per MoE layer call, the median ``overhead_us_per_layer``
    of the run's loader rows); None where no loader row counted its overhead."""
    import statistics

    try:
        from loader.device import calibrated
    except ImportError:
        return None
    overheads = [r["overhead_us_per_layer"] for r in results
                 if is_loader(r["system"]) and not r.get("error") and r.get("overhead_us_per_layer") is not None]
    if profile is None or not overheads:
        return None
    return calibrated(profile, statistics.median(overheads) * 1e-6)


def calibrated_for(calibrated, subject: Subject, results: list[dict]):
    """The run's calibrated profile scaled to the subject, with the subject's model's time per decode token
    outside the MoE layers' steps (the median ``outside_us_per_token`` of its loader rows; one model's, as
    the layer overhead is one device's)."""
    import statistics

    outside = [r["outside_us_per_token"] for r in results if r["subject"] == subject.name and is_loader(r["system"])
               and not r.get("error") and r.get("outside_us_per_token") is not None]
    scaled = subject_profile(calibrated, subject)
    if not outside:
        return scaled
    return dataclasses.replace(scaled, calibration=scaled.calibration | {"token_overhead_s": statistics.median(outside) * 1e-6})


def subject_profile(profile, subject: Subject):
    """``profile`` scaled to the subject's experts; a passthrough record computes in the model's own dtype."""
    scaled = profile.scaled_to(weights_per_expert(subject))
    source = subject.manifest["moe"]["dtype"]
    if source in scaled.compute_seconds:
        scaled = dataclasses.replace(scaled, compute_seconds=scaled.compute_seconds
                                     | {"passthrough": scaled.compute_seconds[source]})
    return scaled


# --------------------------------------------------------------------- routing replayed by the simulator


def subject_routing(subject: Subject) -> dict | None:
    """The routing decisions every loader row of the subject ran, as tensors: the replay file's (``expert_ids``,
    ``weights`` [T, L, K]), or what the resident model's routers did in round 1 (also ``logits``,
    ``router_inputs`` and, when recorded, ``head_inputs``: ``prep/studies/bench/worker.py``); None when neither exists."""
    path = subject.replay or subject.facts.get("routing_file")
    if not path or not Path(path).is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))


def _replay(routing: dict, num_experts: int, tokens: int, source: str, warm: int = 0):
    """A ``prep.sim.replay.Replay`` of the first ``tokens`` tokens of ``routing``; with ``warm``, preceded by a
    sequence of its first ``warm`` tokens (replayed with ``cold_start=False``: the untimed pass of an
    ``@unlimited`` row)."""
    from types import SimpleNamespace


    lengths = ([warm] if warm else []) + [tokens]
    traces = [SimpleNamespace(num_layers=routing["expert_ids"].shape[1], top_k=routing["expert_ids"].shape[2],
                              expert_ids=routing["expert_ids"][:n], expert_weights=routing["weights"][:n])
              for n in lengths]
    replay = replay_from_routing(traces, num_experts, source)
    if "logits" in routing:
        replay = dataclasses.replace(replay, logits=tuple(routing["logits"][:n].float() for n in lengths))
    return replay


def cache_spec(artifact: Path, budget, plan, device: str):
    """The simulator's cache for ``load(artifact, memory_budget=budget, plan=plan, store=..., device=device)`` as
    the bench's workers call it (``store="host"`` on CUDA)."""
    import inspect


    store = "host" if device == "cuda" else "disk"
    if device != "cpu" and "device" in inspect.signature(artifact_spec).parameters:
        return artifact_spec(artifact, budget, plan=plan, store=store, device=device)
    if device != "cpu":  # the held forms (and so the slots) depend on the device: size them for it
        try:
            from loader.runtime import cache_layout
            from prep.sim.simulate import capacities_spec

            layout = cache_layout(artifact, budget, store=store, plan=plan, device=device)
            return capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)
        except (ImportError, AttributeError, TypeError):
            pass  # an API that moved: the CPU's sizes below
    return artifact_spec(artifact, budget, plan=plan, store=store)


class NotModelled(Exception):
    """Why the simulator cannot model a row (its message goes into the row's ``modelled_error``)."""


def _prediction_feed(artifact: Path, routing: dict, plan, tokens: int):
    """(the simulator's ``PredictionFeed`` for the first ``tokens`` tokens, a factory of fresh predictors): the
    artifact's routers and predictor tensors, the recorded router and LM-head inputs."""
    names = [s.name for s in plan.predictors]
    reading = [n for n in names if n not in ROUTING_ONLY]
    if "router_inputs" not in routing and reading:
        raise NotModelled(f"the predictors ({', '.join(reading)}) need the router inputs, which a routing replayed "
                          "from a trace does not have")
    if "first_gate" in names and "head_inputs" not in routing:
        raise NotModelled("first_gate needs the LM head's inputs, which the resident run did not record")
    from safetensors import safe_open
    from safetensors.torch import load_file


    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    routers = []
    with safe_open(str(Path(artifact) / "dense.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for path in manifest["moe"]["router_modules"]:
            bias = f"{path}.bias"
            routers.append((f.get_tensor(f"{path}.weight").float(), f.get_tensor(bias).float() if bias in keys else None))
    tensors = load_file(str(Path(artifact) / PREDICTORS_FILE)) if PREDICTORS_FILE in manifest.get("files", {}) else {}
    head = routing.get("head_inputs")
    feed = PredictionFeed([routing["router_inputs"][:tokens].float()] if "router_inputs" in routing else None,
                          [head[:tokens].float()] if head is not None else None, routers, tensors)
    return feed, lambda: [make_predictor(s.name, dict(s.params)) for s in plan.predictors]


def _sim_plan(subject: Subject, system: str):
    """(artifact, plan) the loader row ``system`` ran, as the simulator replays it."""

    artifact = subject.artifact_for(system)
    return artifact, loader_plan(artifact, system) or read_plan(artifact)  # a replay goes through the plan's routing


def modelled(subject: Subject, system: str, memory_budget, routing: dict | None, profile, device: str) -> dict:
    """The simulator's decode tokens/s for one loader row (``modelled_tokens_per_s``, with what it is made of
    under ``modelled``), or None with ``modelled_error`` saying why it cannot be modelled."""
    if routing is None:
        return {"modelled_tokens_per_s": None,
                "modelled_error": "no routing decisions to replay (the resident run that records them failed)"}
    if profile is None:
        return {"modelled_tokens_per_s": None, "modelled_error": "no device profile"}
    try:
        return _modelled(subject, system, memory_budget, routing, profile, device)
    except NotModelled as e:
        return {"modelled_tokens_per_s": None, "modelled_error": str(e)}
    except Exception as e:  # noqa: BLE001 - the column is a model beside the measurement: say why, never fail the run
        return {"modelled_tokens_per_s": None, "modelled_error": f"{type(e).__name__}: {e}"}


def _modelled(subject: Subject, system: str, memory_budget, routing: dict, profile, device: str) -> dict:

    artifact, plan = _sim_plan(subject, system)
    if plan.neuron.name != "off":
        raise NotModelled("the simulator models whole-expert reads; neuron-level loading is not modelled")
    prompt = len(subject.prompt_ids)
    tokens = prompt + len(subject.decode_ids)
    if routing["expert_ids"].shape[0] < tokens:
        raise NotModelled(f"the routing holds {routing['expert_ids'].shape[0]} tokens, the row ran {tokens}")
    feed, make = (_prediction_feed(artifact, routing, plan, tokens) if plan.predictors else (None, lambda: []))
    spec = cache_spec(artifact, memory_budget, plan, device)
    num_experts = subject.manifest["moe"]["num_experts"]

    warm = tokens if system.endswith("@" + UNLIMITED) else 0  # the worker's untimed pass, then the timed one
    lengths = ([warm] if warm else [])

    def run(n: int):
        fed = None if feed is None else dataclasses.replace(
            feed, router_inputs=[feed.router_inputs[0][:m] for m in [*lengths, n]]
            if feed.router_inputs is not None else None,
            head_inputs=[feed.head_inputs[0][:m] for m in [*lengths, n]] if feed.head_inputs is not None else None)
        return simulate(_replay(routing, num_experts, n, f"{subject.name} {system}", warm), spec, profile=profile,
                        predictors=make() or None, feed=fed, cold_start=not warm)

    full, head = run(tokens), run(prompt)  # the decode steps: prompt + decode, less the prompt alone
    n = tokens - prompt
    seconds = full.seconds - head.seconds
    read = sum(x.read_seconds for x in full.layers) - sum(x.read_seconds for x in head.layers)
    return {"modelled_tokens_per_s": n / seconds if seconds > 0 else None,
            "modelled": {"seconds_per_token": seconds / n, "read_seconds_per_token": read / n,
                         "compute_seconds_per_token": (seconds - read) / n,
                         "bytes_read_per_token": (full.bytes_read - head.bytes_read) / n,
                         "misses_per_token": (full.misses - head.misses) / n, "policy": full.policy,
                         "predictors": [s.name for s in plan.predictors], "device": profile.device}}


# ------------------------------------------------------------------------------------------ the bound


def _belady_demand_bytes(routing: dict, num_experts: int, tokens: int, spec) -> int:
    """Demand bytes Belady's policy reads replaying the first ``tokens`` tokens of ``routing`` through ``spec``."""

    replay = _replay(routing, num_experts, tokens, "bench")
    return sum(layer.demand_bytes for layer in simulate(replay, spec, "belady").layers)


def _io_floor(subject: Subject, routing: dict, artifact: Path, limit: int, plan, read_bandwidth: float,
              compute: float | None, device: str) -> dict:
    """Belady's demand bytes per decode token in the cache ``load(artifact, limit, plan=plan)`` builds, that over
    the read bandwidth (bytes/s), and the bound it makes with the compute floor (tokens/s; None: not measured)."""

    prompt = len(subject.prompt_ids)
    tokens = prompt + len(subject.decode_ids)
    num_experts = subject.manifest["moe"]["num_experts"]
    try:
        spec = cache_spec(artifact, limit, plan, device)
        # Belady over prompt + decode, less the prompt alone: what the decode steps must read
        decode_bytes = (_belady_demand_bytes(routing, num_experts, tokens, spec)
                        - _belady_demand_bytes(routing, num_experts, prompt, spec))
    except (MoeprepError, MoeError) as e:
        return {"error": str(e)}
    per_token = decode_bytes / max(1, tokens - prompt)
    io_seconds = per_token / read_bandwidth
    out = {"belady_bytes_per_token": per_token, "io_floor_s_per_token": io_seconds}
    if not compute:
        return out | {"bound_tokens_per_s": None, "bound_error": "the compute floor (@unlimited) was not measured"}
    slowest = max(1 / compute, io_seconds)
    return out | {"bound_tokens_per_s": 1 / slowest}


def _only_systems(only: str | None) -> set[str] | None:
    """``--systems naive,moeprep`` -> {"naive", "moeprep"}; None runs every system."""
    if only is None:
        return None
    chosen = {x.strip() for x in only.split(",") if x.strip()}
    known = {*SYSTEMS, *PREDICTOR_SYSTEMS, *TECHNIQUES, "naive+neuron", LLAMA}
    if not chosen or chosen - known:
        raise MoeprepError(f"--systems {only!r}: unknown {sorted(chosen - known)}; use a comma-separated subset of "
                           f"{', '.join(sorted(known))}")
    return chosen


def unlimited_systems(subject: Subject) -> list[str]:
    """The budget-free loader rows measuring the compute floors: naive's plan on its artifact and moeprep's plan on
    the recipe's (they differ in compute even on one artifact: held forms, routing policies, neuron loading)."""
    return ["naive@unlimited", "moeprep@unlimited"]


def physical_bounds(subject: Subject, budgets: list[str], results: list[dict], routing: dict | None, profile,
                    device: str = "cpu") -> dict:
    """Per budget: the compute floor (the loader system at budget ``unlimited``, every expert cached in its held
    form), the I/O floor (Belady's demand bytes per decode token at that budget over the profile's read
    bandwidth) and the speed bound they make together (reads hidden perfectly behind compute: 1 / max(compute,
    I/O) per token), for ``naive`` (its artifact, plan and ``naive@unlimited``; the entry's top level) and, under
    ``moeprep``, for the recipe's artifact with its plan's pools and precisions (exact routing) and
    ``moeprep@unlimited``."""

    speeds = {r["system"]: r.get("decode_tokens_per_s") for r in results if r["subject"] == subject.name}
    moe = subject.manifest["moe"]
    naive = subject.naive_artifact
    plan = loader_plan(naive, "naive")
    exact = dataclasses.replace(read_plan(subject.artifact), routing=PolicySpec("topk"), miss=PolicySpec("plan"))
    out = {}
    for budget in budgets:
        limit = _budget_bytes(subject, budget)
        dense = _budget_bytes(subject, "100%") - int(moe["source_expert_bytes"])
        entry = {"resident_tokens_per_s": speeds.get("resident"), "compute_system": "naive@unlimited",
                 "compute_tokens_per_s": speeds.get("naive@unlimited"), "budget_bytes": limit,
                 "budget_share": 100 * (limit - dense) / int(moe["source_expert_bytes"])}
        out[budget] = entry
        entry["moeprep"] = {"compute_system": "moeprep@unlimited", "compute_tokens_per_s": speeds.get("moeprep@unlimited")}
        if routing is None or profile is None:
            continue
        entry |= _io_floor(subject, routing, naive, limit, plan, profile.read_bandwidth,
                           speeds.get("naive@unlimited"), device)
        entry["moeprep"] |= _io_floor(subject, routing, subject.artifact, limit, exact, profile.read_bandwidth,
                                      speeds.get("moeprep@unlimited"), device)
    return out


def _neuron_loading(subject: Subject, system: str) -> bool:
    """Whether the loader row ``system`` reads and computes parts of experts (neuron-level loading)."""

    artifact = subject.artifact_for(system)
    plan = loader_plan(artifact, system) or read_plan(artifact)
    return plan.neuron.name != "off"


def is_loader(system: str) -> bool:
    return runs_loader(system)


def _prepare_llama(subject: Subject, output: Path, echo) -> str | None:
    """Convert and quantize the subject's model for llama.cpp and check its float32 logits against
    transformers' on the prompt; records the facts on the subject. Returns why it cannot run, or None."""

    echo("llama.cpp: converting mixtral-shape to GGUF (float32, then Q4_0), reused while the model is unchanged")
    files = prepare_gguf(subject.model_dir, output / "llama-gguf" / subject.model_dir.parent.name)
    error = logit_check(files["f32"], subject.model_dir, subject.prompt_ids)
    if error > LLAMA_MAX_LOGIT_ERROR:
        return (f"llama.cpp skipped: its float32 logits differ from transformers' by {error:.3g} on the prompt "
                f"(more than {LLAMA_MAX_LOGIT_ERROR}); the conversion is wrong")
    subject.facts["llama_cpp"] = {"quant": QUANT, "file": str(files[QUANT]), "file_bytes": files[QUANT].stat().st_size,
                                  "f32_logit_max_abs_diff": error}
    return None


def _write_atomic(path: Path, data: str | bytes) -> None:
    write_bytes_atomic(path, data if isinstance(data, bytes) else data.encode())


def _prefill_rows(subjects: list[Subject], budgets: list[str], prompts: list[int], repeats: int, work: Path,
                  traces: Path | None, spec_for, candidates: list, chosen_systems: set | None, bandwidth: dict,
                  echo) -> dict:
    """The prefill rows (``prefill.run_prefill``) measured with the bench's workers, each moeprep row's bound against
    the disk's read bandwidth measured at the start of the run, each row's memory against its budget."""
    load_before = os.getloadavg()  # the machine may be shared: its load beside the figures
    bar = tqdm(desc="bench prefill", unit="run")

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update()

    def run_one(spec: dict) -> dict:
        subj = next(s for s in subjects if s.name == spec["subject"])
        return _measure_system(spec, work, (subj.facts.get("llama_cpp") or {}).get("file"))

    fit = [c for c in candidates if c[1] not in UNFIT_FOR_PROMPTS]

    def resident_for(spec: dict) -> dict:
        return measure_resident_candidates(spec, fit, 0, work, on_run=lambda _entry: bar.update(),
                                           speed="prefill_tokens_per_s")

    out = run_prefill(subjects, budgets, prompts, repeats, work, traces,
                      lambda subj, system, budget: spec_for(subj, system, budget, 1), run_one,
                      resident_for if fit else lambda _spec: None, chosen_systems, echo, progress)
    bar.close()
    out["notes"] += [f"prefill rows: resident is not chosen among experts implementation {impl}: {why}"
                     for impl, why in UNFIT_FOR_PROMPTS.items() if any(c[1] == impl for c in candidates)]
    bandwidth_bytes = bandwidth["mb_s"] * 1e6 if bandwidth.get("mb_s") else None
    add_bounds(out["rows"], bandwidth_bytes)
    add_memory_verdicts(out["rows"])
    return out | {"read_bandwidth_bytes_per_s": bandwidth_bytes,
                  "load_average": {"before": load_before, "after": os.getloadavg()}}


def run_bench(subject: str = "all", budgets: str | None = None, quick: bool = False, device: str = "cpu",
              output: str | Path = "artifacts/bench", traces: str | Path | None = "../shared/data/traces",
              root: str | Path = ".", echo=print, repeats: int | None = None, store: str = "auto",
              only: str | None = None, prefill: str | None = None, decode: bool = True) -> dict:
    """Measure, write bench.json / bench.md / bench.png (and the device profile, device.json) under ``output``,
    and return the report. store: where the loader's expert stores live (``load(store=...)``); auto is host
    RAM on CUDA (pinned, copied at PCIe speed) and the disk on a CPU. only: comma-separated systems to run
    (``naive`` also selects ``naive@unlimited``; without ``resident`` the resident candidates are not
    measured either), to spend a short GPU lease on what a second store changes. prefill: comma-separated
    prompt lengths ("512,2048") for the prefill rows (``prep/studies/bench/prefill.py``; None: none), at
    ``budgets`` where given, else ``PREFILL_BUDGETS`` (``--quick``: its one budget). decode off: the prefill rows
    alone (no decode rows, no device profile)."""

    if device not in ("cpu", "cuda"):
        raise MoeprepError(f"--device {device!r} unknown; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoeprepError("--device cuda: torch sees no CUDA GPU here; run with --device cpu "
                           "(or install a CUDA build of torch on a machine with a GPU)")
    if store not in ("auto", "disk", "host"):
        raise MoeprepError(f"--store {store!r} unknown; use auto, disk or host")
    options = {"subject": subject, "budgets": budgets, "repeats": repeats, "quick": quick, "device": device,
               "store": store, "systems": only, "prefill": prefill, "decode": decode, "output": str(output),
               "traces": None if traces is None else str(traces)}  # as given: the command that made the report
    store = store if store != "auto" else ("host" if device == "cuda" else "disk")
    chosen_systems = _only_systems(only)  # checked before anything is built
    prompts = parse_prompts(prefill)
    if not decode and not prompts:
        raise MoeprepError("--no-decode leaves nothing to measure; pass --prefill 512,2048 with it")
    wanted = SUBJECTS if subject == "all" else tuple(x.strip() for x in subject.split(",") if x.strip())
    if not wanted or set(wanted) - set(SUBJECTS):
        raise MoeprepError(f"--subject {subject!r} unknown; use all, or a comma-separated subset of "
                           f"{', '.join(SUBJECTS)}")
    budget_list = parse_budgets(budgets or (QUICK_BUDGETS if quick else DEFAULT_BUDGETS))
    prefill_budgets = parse_budgets(budgets or (QUICK_BUDGETS if quick else PREFILL_BUDGETS))
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if repeats < 1:
        raise MoeprepError(f"--repeats must be at least 1, got {repeats}")
    sizes = QUICK if quick else FULL
    root, output = Path(root), Path(output)
    output.mkdir(parents=True, exist_ok=True)
    work = output / "work"
    work.mkdir(exist_ok=True)
    started = time.time()

    notes, subjects = [], []
    traces_dir = Path(traces) if traces else None
    have_traces = traces_dir is not None and any(
        p.is_file() for p in (traces_dir, traces_dir / MIXTRAL_TRACE_FILE, traces_dir / "mixtral-8x7b" / MIXTRAL_TRACE_FILE))
    def skip(message: str) -> None:
        """A subject that cannot run: an error when it was asked for by name, else a note."""
        if subject != "all":
            raise MoeprepError(message)
        echo(message)
        notes.append(message)

    for name in wanted:
        if name.startswith("reference"):
            echo(f"preparing subject {name} with its accuracy check (the stage cache makes this free when nothing "
                 "changed)")
            subjects.append(reference_subject(root, sizes.reference_prompt, sizes.reference_decode, name,
                                              evaluate=not quick))
            continue
        if name == "mixtral-shape-techniques":
            if not have_traces:
                skip(f"mixtral-shape-techniques skipped: the real Mixtral traces are not in {traces_dir} (pass "
                     "--traces DIR holding mixtral-8x7b/gsm8k_routing.jsonl and adapmoe_sensitivity.json)")
                continue
            echo("preparing subject mixtral-shape-techniques (one artifact per technique, fitted on the problems "
                 "not replayed; built once, then reused)")
            subjects.append(mixtral_shape_techniques_subject(output, traces_dir, quick, sizes.shape_prompt,
                                                             sizes.shape_decode, echo))
            continue
        if name == "mixtral-shape-own":
            echo("preparing subject mixtral-shape-own (the mixtral-shape model with its own routers)")
            subj = mixtral_shape_subject(output, None, quick, sizes.shape_prompt, sizes.shape_decode, own=True)
            reason = llama_missing()
            if reason is None:
                reason = _prepare_llama(subj, output, echo)
            if reason is not None:
                echo(reason)
                notes.append(reason)
            subjects.append(subj)
            continue
        if not have_traces and not quick:
            skip(f"mixtral-shape skipped: the real Mixtral traces are not in {traces_dir} "
                 "(pass --traces DIR holding mixtral-8x7b/gsm8k_routing.jsonl)")
            continue
        if not have_traces:
            message = (f"mixtral-shape routes with its own (random) routers: the real traces are not in "
                       f"{traces_dir} (quick mode only; a full run skips the subject)")
            echo(message)
            notes.append(message)
        notes.append("mixtral-shape runs no prefetch predictor: its weights are random and its routing replayed, "
                     "so hidden-state predictors (next_gates, first_gate) would predict noise")
        echo("preparing subject mixtral-shape (built once, then reused)")
        subjects.append(mixtral_shape_subject(output, traces_dir if have_traces else None, quick,
                                              sizes.shape_prompt, sizes.shape_decode))
    if not subjects:
        raise MoeprepError("no subject to measure")

    largest = max(subjects, key=lambda s: s.facts["store_bytes"])
    bandwidth = read_bandwidth(Path(largest.facts["store_file"]), sizes.bandwidth_bytes)

    def systems(subj: Subject) -> list[str]:
        if subj.variants:  # each technique alone (its own artifact), then all together
            return ["naive", *TECHNIQUES]
        if subj.name == "mixtral-shape-own":  # against llama.cpp, which cannot replay routing
            return ["naive", "moeprep"] + ([LLAMA] if "llama_cpp" in subj.facts else [])
        if subj.lossless is not None:  # naive on the lossless artifact, moeprep on the recipe's
            return [*SYSTEMS[1:3], SYSTEMS[3]]
        plan = json.loads((Path(subj.artifact) / "plan.json").read_text())
        planned = {p["name"] for p in plan["predictors"]}
        neuron = ["naive+neuron"] if plan.get("neuron", {}).get("name", "off") != "off" else []
        return [*SYSTEMS[1:3], *neuron, *(s for s in PREDICTOR_SYSTEMS if s.split("+", 1)[1] in planned), SYSTEMS[3]]

    profile = None
    if decode:
        echo("measuring the device profile (reads and one expert's compute) for the simulator")
        profile = device_profile(subjects, sizes, device, output, store)
    candidates = resident_candidates(device)

    def spec_for(subj: Subject, system: str, budget: str, repeat: int) -> dict:
        limit = _budget_bytes(subj, budget)
        spec = {"subject": subj.name, "system": system, "budget": budget, "device": device, "store": store,
                "memory_budget": limit if budget == BELOW_4BIT else budget,
                "budget_bytes": limit, "host_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2,
                "model_dir": str(subj.model_dir),
                "artifact": str(subj.artifact_for(system)),
                "experts_modules": subj.manifest["moe"]["experts_modules"],
                "prompt_ids": subj.prompt_ids, "decode_ids": subj.decode_ids,
                "replay": str(subj.replay) if subj.replay else None, "offload_dir": str(work / "offload"),
                "record_routing": (str(work / f"{subj.name}-routing.safetensors")
                                   if system == "resident" and repeat == 0 and subj.replay is None else None)}
        chosen = (subj.facts.get("resident") or {}).get("chosen")
        if system == "resident" and chosen:
            spec |= {"dtype": chosen["dtype"], "experts_implementation": chosen["experts_implementation"]}
        return spec

    runs = {s.name: [("resident", "100%")] + [(x, UNLIMITED) for x in unlimited_systems(s)]
            + [(x, b) for b in budget_list for x in systems(s)] for s in subjects}
    if chosen_systems is not None:
        runs = {name: [(x, b) for x, b in r if x.split("@", 1)[0] in chosen_systems] for name, r in runs.items()}
        if "resident" not in chosen_systems:
            candidates = []
    if not decode:  # the prefill rows alone
        runs = {s.name: [] for s in subjects}
    measured: dict = {}  # (subject, system, budget) -> [result of each repeat]
    raw = []
    bar = tqdm(total=sum(len(r) for r in runs.values()) * repeats + (len(candidates) * len(subjects) if decode else 0),
               desc="bench", unit="run")
    for repeat in range(repeats if decode else 0):  # interleaved: every configuration once per round
        for subj in subjects:
            if repeat == 0 and candidates:  # the resident baseline: the fastest candidate on this device, chosen first
                bar.set_postfix_str(f"{subj.name} resident candidates")
                subj.facts["resident"] = measure_resident_candidates(
                    spec_for(subj, "resident", "100%", 0), candidates, sizes.candidate_decode, work,
                    on_run=lambda _entry: bar.update())
                for c in subj.facts["resident"]["candidates"]:
                    if c.get("error"):
                        echo(f"{subj.name} resident candidate {c['dtype']} {c['experts_implementation']}: FAILED "
                             f"{c['error']}")
                chosen = subj.facts["resident"]["chosen"]
                if chosen is None:
                    note = (f"{subj.name}: every resident candidate failed; resident runs transformers' defaults "
                            "(the checkpoint's dtype, the default experts implementation)")
                    echo(note)
                    notes.append(note)
                else:
                    speed = chosen["decode_tokens_per_s"]
                    echo(f"{subj.name}: resident = {chosen['dtype']} with experts implementation "
                         f"{chosen['experts_implementation']} ("
                         + (f"{speed:.3g} tok/s, the fastest of {len(candidates)} candidates)" if speed else
                            "the only candidate that can run)"))
            for system, budget in runs[subj.name]:
                bar.set_postfix_str(f"round {repeat + 1}/{repeats} {subj.name} {system} {budget}")
                spec = spec_for(subj, system, budget, repeat)
                result = _measure_system(spec, work, (subj.facts.get("llama_cpp") or {}).get("file"))
                bar.update()
                routing_file = result.pop("routing_file", None)
                if routing_file is not None:
                    subj.facts["routing_file"] = routing_file
                raw.append({"subject": subj.name, "system": system, "budget": budget, "repeat": repeat} | result)
                _write_atomic(work / "raw.json", json.dumps(raw, indent=1) + "\n")  # nothing measured is lost
                if "error" in result:
                    echo(f"{subj.name} {system} {budget}: FAILED {result['error']}")
                measured.setdefault((subj.name, system, budget), []).append(result)
    bar.close()

    prefill_report = None
    if prompts:
        prefill_report = _prefill_rows(subjects, prefill_budgets, prompts, repeats, work, traces_dir if have_traces
                                       else None, spec_for, candidates, chosen_systems, bandwidth, echo)
        notes += prefill_report["notes"]

    results = []
    for (name, system, budget), runs_of in measured.items():
        row = summarize(runs_of)
        once = system == "resident" or budget == UNLIMITED  # budget-free: the row repeated at each budget
        for b in (budget_list if once else [budget]):
            results.append({"subject": name, "system": system, "budget": b} | row | ({"measured_once": True} if once else {}))
    by_name = {s.name: s for s in subjects}
    routings = {s.name: subject_routing(s) for s in subjects}
    profiles = {s.name: subject_profile(profile, s) if profile is not None else None for s in subjects}
    models: dict = {}  # (subject, system, budget) -> the simulator's figures, once per configuration
    for row in results:
        if not is_loader(row["system"]) or row.get("error"):
            continue
        subj = by_name[row["subject"]]
        memory = UNLIMITED if row["system"].endswith("@" + UNLIMITED) else (
            _budget_bytes(subj, row["budget"]) if row["budget"] == BELOW_4BIT else row["budget"])
        key = (row["subject"], row["system"], str(memory))
        if key not in models:
            models[key] = modelled(subj, row["system"], memory, routings[subj.name], profiles[subj.name], device)
        row |= models[key]
        model, speed = row.get("modelled_tokens_per_s"), row.get("decode_tokens_per_s")
        row["modelled_over_measured"] = model / speed if model and speed else None
    calibrated = calibrated_profile(profile, results)
    if calibrated is not None:  # the simulator's model of the loader's step, its one parameter from this run
        _write_atomic(output / "device-calibrated.json", json.dumps(calibrated.to_json(), indent=2) + "\n")
        for row in results:
            if not is_loader(row["system"]) or row.get("error") or not row.get("modelled_tokens_per_s"):
                continue
            subj = by_name[row["subject"]]
            memory = UNLIMITED if row["system"].endswith("@" + UNLIMITED) else (
                _budget_bytes(subj, row["budget"]) if row["budget"] == BELOW_4BIT else row["budget"])
            key = ("calibrated", row["subject"], row["system"], str(memory))
            if key not in models:
                models[key] = modelled(subj, row["system"], memory, routings[subj.name],
                                       calibrated_for(calibrated, subj, results), device)
            model, speed = models[key].get("modelled_tokens_per_s"), row.get("decode_tokens_per_s")
            row["modelled_calibrated_tokens_per_s"] = model
            row["modelled_calibrated_over_measured"] = model / speed if model and speed else None
    bounds = ({s.name: physical_bounds(s, budget_list, results, routings[s.name], profile, device) for s in subjects}
              if decode else {})
    for row in results:
        if row.get("measured_once") or not (is_loader(row["system"]) or row["system"] == LLAMA):
            continue
        if row["system"] != LLAMA and _neuron_loading(by_name[row["subject"]], row["system"]):
            row["fraction_of_bound"] = None
            row["fraction_of_bound_error"] = ("neuron-level loading reads and computes parts of experts: the "
                                              "whole-expert bound does not bind it")
            continue
        entry = bounds[row["subject"]].get(row["budget"], {})
        if row["system"] in ("moeprep", LLAMA):  # the recipe's artifact and plan (llama.cpp: the same 4-bit class)
            entry = entry.get("moeprep", {})
        bound, speed = entry.get("bound_tokens_per_s"), row.get("decode_tokens_per_s")
        row["fraction_of_bound"] = speed / bound if bound and speed else None

    report = {
        "machine": machine_info(device) | {"torch_threads": torch.get_num_threads()},
        "store": store,
        "read_bandwidth_mb_s": bandwidth["mb_s"],
        "read_bandwidth": bandwidth,
        "device_profile": profile.to_json() if profile is not None else None,
        "device_profile_calibrated": calibrated.to_json() if calibrated is not None else None,
        "results": [{k: r.get(k) for k in RESULT_KEYS} | {k: v for k, v in r.items() if k not in RESULT_KEYS}
                    for r in results],
        "subjects": {s.name: {"model": str(s.model_dir), "artifact": str(s.artifact),
                              "naive_artifact": str(s.naive_artifact), "routing": s.routing,
                              "prompt_tokens": len(s.prompt_ids), "decode_tokens": len(s.decode_ids),
                              "accuracy_delta": accuracy_delta(s.artifact)}
                     | s.facts for s in subjects},
        "bounds": bounds,
        "budgets": budget_list,
        "repeats": repeats,
        "raw": raw,
        "decode": decode,
        "prefill": prefill_report,
        "quick": quick,
        "notes": notes,
        "wall_seconds": round(time.time() - started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": source_commit(),
        "options": options,
    }
    _write_atomic(output / "bench.json", json.dumps(report, indent=2) + "\n")
    _write_atomic(output / "bench.md", write_markdown(report))
    write_plot(report, output / "bench.png")
    return report
