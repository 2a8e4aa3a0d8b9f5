"""``moeprep bench``: every system on every subject at every budget, in one run, in turn.

Systems (DESIGN.md section 7, "Speed"):
- ``resident``: transformers with every weight in memory, the ceiling. Budget-independent: measured once
  per subject, its row repeated at each budget.
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

A budget ``p%`` is what the loader makes of it (``loader.runtime.budget_bytes``: the dense weights + p% of
the source model's expert bytes, read buffers included); accelerate gets the same number of bytes as
``max_memory``. Each measurement runs in its own
process (``prep/bench/worker.py``) so peak RSS is per system and memory is handed back between systems.
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

from loader.files import write_bytes_atomic
from prep.bench.llama import missing as llama_missing
from prep.bench.subjects import Subject, mixtral_shape_subject, reference_subject
from prep.errors import MoeprepError
from prep.trace import MIXTRAL_TRACE_FILE

SYSTEMS = ("resident", "accelerate", "naive", "moeprep")
PREDICTOR_SYSTEMS = tuple(f"naive+{name}" for name in ("next_gates", "path_stats", "first_gate", "neuron_gates"))
SUBJECTS = ("reference", "reference-lossless", "reference-neuron", "mixtral-shape", "mixtral-shape-own")
LLAMA = "llama.cpp"
LLAMA_MAX_LOGIT_ERROR = 1e-3  # llama.cpp's float32 logits against transformers', checked before timing
BELOW_4BIT = "4bit-25%"  # the dense weights + 25% of the model's expert bytes at 4 bits: below a 4-bit model's size
DEFAULT_BUDGETS = f"100%,50%,25%,12.5%,{BELOW_4BIT}"
QUICK_BUDGETS = "25%"
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1
RESULT_KEYS = ("subject", "system", "budget", "repeats", "decode_tokens_per_s", "decode_tokens_per_s_min",
               "decode_tokens_per_s_max", "prefill_s", "bytes_read_per_token", "hit_rate", "stall_fraction",
               "peak_rss_mb")


@dataclass(frozen=True)
class Sizes:
    """Tokens per measurement: a prompt prefilled at once, then decode steps of one token each."""

    reference_prompt: int
    reference_decode: int
    shape_prompt: int
    shape_decode: int
    bandwidth_bytes: int  # how much of the largest store file to read for the disk bandwidth


FULL = Sizes(reference_prompt=64, reference_decode=64, shape_prompt=16, shape_decode=24,
             bandwidth_bytes=1 << 30)
QUICK = Sizes(reference_prompt=8, reference_decode=4, shape_prompt=4, shape_decode=4, bandwidth_bytes=16 << 20)


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
    from loader.codec import DEFAULT_FORMATS, MatrixSpec

    group, meta = DEFAULT_FORMATS["int4"]
    moe = subject.manifest["moe"]
    source_weights = int(moe["source_expert_bytes"]) // {"float32": 4, "bfloat16": 2, "float16": 2}[moe["dtype"]]
    spec = MatrixSpec("w", (4096, 4096), "int4", moe["dtype"], group, meta_group=meta)
    per_weight = sum(size for _n, _d, size in spec.parts()) / spec.numel
    return int(source_weights * per_weight)


def _budget_bytes(subject: Subject, budget: str) -> int:
    """The loader's reading of a share budget, in bytes (one function for the loader, bench and simulator);
    ``4bit-25%``: the dense weights + 25% of ``four_bit_expert_bytes``."""
    from loader.runtime import budget_bytes

    if budget == BELOW_4BIT:
        dense = budget_bytes(subject.artifact, "100%") - int(subject.manifest["moe"]["source_expert_bytes"])
        return dense + four_bit_expert_bytes(subject) // 4
    return budget_bytes(subject.artifact, budget)


def _run_worker(spec: dict, work: Path) -> dict:
    """Run one measurement in a fresh process; its stderr goes to a log file beside the spec."""
    tag = f"{spec['subject']}-{spec['system']}-{spec['budget'].replace('%', 'pct')}"
    spec_path, log_path = work / f"{tag}.json", work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    # Flush what the previous system wrote (accelerate's offload folder: GBs) before timing the next
    # one, so its writeback does not compete with the next system's reads.
    os.sync()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "prep.bench.worker", str(spec_path)], stdout=subprocess.PIPE,
                              stderr=log, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text().strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)} (log: {log_path})"}
    return json.loads(lines[-1])


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


def _decisions(subject: Subject) -> torch.Tensor | None:
    """The subject's routing decisions [T, L, K]: the replay, or what the resident run recorded."""
    if subject.replay is not None:
        from safetensors.torch import load_file

        return load_file(str(subject.replay))["expert_ids"]
    recorded = subject.facts.get("recorded_routing")
    return torch.tensor(recorded) if recorded else None


def _belady_demand_bytes(ids: list, moe: dict, spec) -> int:
    """Demand bytes Belady's policy reads replaying ``ids`` [T][L][K] (one sequence) through ``spec``."""
    from prep.sim.replay import Replay
    from prep.sim.simulate import simulate

    replay = Replay((tuple(tuple(tuple(e) for e in t) for t in ids),), len(ids[0]), moe["num_experts"],
                    moe["top_k"], "bench")
    return sum(layer.demand_bytes for layer in simulate(replay, spec, "belady").layers)


def _io_floor(ids: list, moe: dict, prompt: int, artifact: Path, limit: int, plan, bandwidth_mb_s: float,
              compute_seconds: float) -> dict:
    """Belady's demand bytes per decode token in the cache ``load(artifact, limit, plan=plan)`` builds, that over
    the disk bandwidth, and the bound it makes with the compute floor."""
    from loader.errors import MoeError
    from prep.sim.simulate import artifact_spec

    try:
        spec = artifact_spec(artifact, limit, plan=plan)
        # Belady over prompt + decode, less the prompt alone: what the decode steps must read
        decode_bytes = _belady_demand_bytes(ids, moe, spec) - _belady_demand_bytes(ids[:prompt], moe, spec)
    except (MoeprepError, MoeError) as e:
        return {"error": str(e)}
    per_token = decode_bytes / max(1, len(ids) - prompt)
    io_seconds = per_token / (bandwidth_mb_s * 1e6)
    slowest = max(compute_seconds, io_seconds)
    return {"belady_bytes_per_token": per_token, "io_floor_s_per_token": io_seconds,
            "bound_tokens_per_s": 1 / slowest if slowest else None}


def physical_bounds(subject: Subject, budgets: list[str], results: list[dict], bandwidth_mb_s: float | None) -> dict:
    """Per budget: the resident compute speed, the I/O floor (Belady's demand bytes per decode token at that
    budget over the measured disk bandwidth) and the speed bound they make together (reads hidden perfectly
    behind compute: 1 / max(compute, I/O) per token), in ``naive``'s cache (the lossless artifact; the
    entry's top level) and, under ``moeprep``, in the recipe's artifact's cache with its plan."""
    from loader.plan import Plan, PolicySpec, read_plan

    resident = next((r.get("decode_tokens_per_s") for r in results
                     if r["subject"] == subject.name and r["system"] == "resident"), None)
    compute_seconds = 1 / resident if resident else 0.0
    decisions = _decisions(subject)
    moe, prompt = subject.manifest["moe"], len(subject.prompt_ids)
    naive = subject.naive_artifact
    own = read_plan(naive)
    stores = json.loads((naive / "manifest.json").read_text())["stores"]
    plan = Plan.mixed(own.expert_precision, {p: s["record_bytes"] for p, s in stores.items()})
    out = {}
    for budget in budgets:
        limit = _budget_bytes(subject, budget)
        dense = _budget_bytes(subject, "100%") - int(moe["source_expert_bytes"])
        entry = {"resident_tokens_per_s": resident, "budget_bytes": limit,
                 "budget_share": 100 * (limit - dense) / int(moe["source_expert_bytes"])}
        out[budget] = entry
        if decisions is None or not bandwidth_mb_s:
            continue
        ids = decisions.tolist()
        entry |= _io_floor(ids, moe, prompt, naive, limit, plan, bandwidth_mb_s, compute_seconds)
        if subject.lossless is not None:  # the recipe's pools and precisions; the model's own routing
            exact = dataclasses.replace(read_plan(subject.artifact), routing=PolicySpec("topk"), miss=PolicySpec("plan"))
            entry["moeprep"] = _io_floor(ids, moe, prompt, subject.artifact, limit, exact, bandwidth_mb_s,
                                         compute_seconds)
    return out


def _prepare_llama(subject: Subject, output: Path, echo) -> str | None:
    """Convert and quantize the subject's model for llama.cpp and check its float32 logits against
    transformers' on the prompt; records the facts on the subject. Returns why it cannot run, or None."""
    from prep.bench.llama import QUANT, logit_check, prepare_gguf

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


def run_bench(subject: str = "all", budgets: str | None = None, quick: bool = False, device: str = "cpu",
              output: str | Path = "artifacts/bench", traces: str | Path | None = "../shared/data/traces",
              root: str | Path = ".", echo=print, repeats: int | None = None) -> dict:
    """Measure, write bench.json / bench.md / bench.png under ``output``, and return the report."""
    from prep.bench.report import write_markdown, write_plot

    if device not in ("cpu", "cuda"):
        raise MoeprepError(f"--device {device!r} unknown; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoeprepError("--device cuda: torch sees no CUDA GPU here; run with --device cpu "
                           "(or install a CUDA build of torch on a machine with a GPU)")
    if subject not in (*SUBJECTS, "all"):
        raise MoeprepError(f"--subject {subject!r} unknown; use {', '.join(SUBJECTS)} or all")
    budget_list = parse_budgets(budgets or (QUICK_BUDGETS if quick else DEFAULT_BUDGETS))
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if repeats < 1:
        raise MoeprepError(f"--repeats must be at least 1, got {repeats}")
    sizes = QUICK if quick else FULL
    root, output = Path(root), Path(output)
    output.mkdir(parents=True, exist_ok=True)
    work = output / "work"
    work.mkdir(exist_ok=True)
    wanted = SUBJECTS if subject == "all" else (subject,)
    started = time.time()

    notes, subjects = [], []
    traces_dir = Path(traces) if traces else None
    have_traces = traces_dir is not None and any(
        p.is_file() for p in (traces_dir, traces_dir / MIXTRAL_TRACE_FILE, traces_dir / "mixtral-8x7b" / MIXTRAL_TRACE_FILE))
    for name in wanted:
        if name.startswith("reference"):
            echo(f"preparing subject {name} with its accuracy check (the stage cache makes this free when nothing "
                 "changed)")
            subjects.append(reference_subject(root, sizes.reference_prompt, sizes.reference_decode, name,
                                              evaluate=not quick))
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
            message = (f"mixtral-shape skipped: the real Mixtral traces are not in {traces_dir} "
                       "(pass --traces DIR holding mixtral-8x7b/gsm8k_routing.jsonl)")
            if subject == name:
                raise MoeprepError(message)
            echo(message)
            notes.append(message)
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
        if subj.name == "mixtral-shape-own":  # against llama.cpp, which cannot replay routing
            return ["naive", "moeprep"] + ([LLAMA] if "llama_cpp" in subj.facts else [])
        if subj.lossless is not None:  # naive on the lossless artifact, moeprep on the recipe's
            return [*SYSTEMS[1:3], SYSTEMS[3]]
        plan = json.loads((Path(subj.artifact) / "plan.json").read_text())
        planned = {p["name"] for p in plan["predictors"]}
        neuron = ["naive+neuron"] if plan.get("neuron", {}).get("name", "off") != "off" else []
        return [*SYSTEMS[1:3], *neuron, *(s for s in PREDICTOR_SYSTEMS if s.split("+", 1)[1] in planned), SYSTEMS[3]]

    runs = [(s, sys_, b) for s in subjects for sys_, b in
            [("resident", "100%")] + [(x, b) for b in budget_list for x in systems(s)]]
    measured: dict = {}  # (subject, system, budget) -> [result of each repeat]
    raw = []
    bar = tqdm(total=len(runs) * repeats, desc="bench", unit="run")
    for repeat in range(repeats):  # interleaved: every configuration once per round, so drift hits them all
        for subj, system, budget in runs:
            bar.set_postfix_str(f"round {repeat + 1}/{repeats} {subj.name} {system} {budget}")
            offload = work / "offload"
            limit = _budget_bytes(subj, budget)
            spec = {"subject": subj.name, "system": system, "budget": budget, "device": device,
                    "memory_budget": limit if budget == BELOW_4BIT else budget,
                    "budget_bytes": limit, "host_bytes": os.sysconf("SC_PAGE_SIZE") *
                    os.sysconf("SC_PHYS_PAGES") // 2, "model_dir": str(subj.model_dir),
                    "artifact": str(subj.naive_artifact if system.startswith("naive") else subj.artifact),
                    "experts_modules": subj.manifest["moe"]["experts_modules"],
                    "prompt_ids": subj.prompt_ids, "decode_ids": subj.decode_ids,
                    "replay": str(subj.replay) if subj.replay else None, "offload_dir": str(offload),
                    "record_routing": system == "resident" and repeat == 0 and subj.replay is None}
            if system == LLAMA:
                from prep.bench.llama import CGROUP_HEADROOM, make_cgroup, remove_cgroup

                spec["gguf"] = subj.facts["llama_cpp"]["file"]
                spec["cgroup"] = str(make_cgroup(f"moeprep-bench-{os.getpid()}", limit + CGROUP_HEADROOM))
            shutil.rmtree(offload, ignore_errors=True)
            result = _run_worker(spec, work)
            shutil.rmtree(offload, ignore_errors=True)
            if system == LLAMA:
                remove_cgroup(Path(spec["cgroup"]))
            bar.update()
            routing_seen = result.pop("routing", None)
            if routing_seen is not None:
                subj.facts["recorded_routing"] = routing_seen
            raw.append({"subject": subj.name, "system": system, "budget": budget, "repeat": repeat} | result)
            _write_atomic(work / "raw.json", json.dumps(raw, indent=1) + "\n")  # nothing measured is lost
            if "error" in result:
                echo(f"{subj.name} {system} {budget}: FAILED {result['error']}")
            measured.setdefault((subj.name, system, budget), []).append(result)
    bar.close()

    results = []
    for (name, system, budget), runs_of in measured.items():
        row = summarize(runs_of)
        targets = budget_list if system == "resident" else [budget]
        for b in targets:
            results.append({"subject": name, "system": system, "budget": b} | row
                           | ({"measured_once": True} if system == "resident" else {}))
    bounds = {s.name: physical_bounds(s, budget_list, results, bandwidth["mb_s"]) for s in subjects}
    for row in results:
        entry = bounds[row["subject"]].get(row["budget"], {})
        if row["system"] in ("moeprep", LLAMA) and "moeprep" in entry:  # the recipe's artifact (4-bit class)
            entry = entry["moeprep"]
        bound = entry.get("bound_tokens_per_s")
        if bound and row.get("decode_tokens_per_s"):
            row["share_of_bound"] = row["decode_tokens_per_s"] / bound

    report = {
        "machine": machine_info(device),
        "read_bandwidth_mb_s": bandwidth["mb_s"],
        "read_bandwidth": bandwidth,
        "results": [{k: r.get(k) for k in RESULT_KEYS} | {k: v for k, v in r.items() if k not in RESULT_KEYS}
                    for r in results],
        "subjects": {s.name: {"model": str(s.model_dir), "artifact": str(s.artifact),
                              "naive_artifact": str(s.naive_artifact), "routing": s.routing,
                              "prompt_tokens": len(s.prompt_ids), "decode_tokens": len(s.decode_ids),
                              "accuracy_delta": accuracy_delta(s.artifact)}
                     | {k: v for k, v in s.facts.items() if k != "recorded_routing"} for s in subjects},
        "bounds": bounds,
        "budgets": budget_list,
        "repeats": repeats,
        "raw": raw,
        "quick": quick,
        "notes": notes,
        "wall_seconds": round(time.time() - started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_atomic(output / "bench.json", json.dumps(report, indent=2) + "\n")
    _write_atomic(output / "bench.md", write_markdown(report))
    write_plot(report, output / "bench.png")
    return report
