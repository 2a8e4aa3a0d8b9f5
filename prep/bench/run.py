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
from prep.bench.subjects import Subject, mixtral_shape_subject, reference_subject
from prep.errors import MoeprepError
from prep.trace import MIXTRAL_TRACE_FILE

SYSTEMS = ("resident", "accelerate", "naive", "moeprep")
PREDICTOR_SYSTEMS = tuple(f"naive+{name}" for name in ("next_gates", "path_stats", "first_gate", "neuron_gates"))
SUBJECTS = ("reference", "reference-lossless", "reference-neuron", "mixtral-shape")
DEFAULT_BUDGETS = "12.5%,25%,50%,100%"
QUICK_BUDGETS = "25%"
RESULT_KEYS = ("subject", "system", "budget", "decode_tokens_per_s", "prefill_s", "bytes_read_per_token",
               "hit_rate", "stall_fraction", "peak_rss_mb")


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
    """"12.5%,25%" -> ["12.5%", "25%"]; each a share of the expert store in (0, 100]."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    for b in budgets:
        try:
            share = float(b.removesuffix("%"))
        except ValueError:
            share = -1
        if not b.endswith("%") or not 0 < share <= 100:
            raise MoeprepError(f"--budgets: {b!r} is not a share like 25% (in (0, 100]); "
                               "pass e.g. --budgets 12.5%,25%,50%,100%")
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


def _budget_bytes(subject: Subject, budget: str) -> int:
    """The loader's reading of a share budget, in bytes (one function for the loader, bench and simulator)."""
    from loader.runtime import budget_bytes

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


def _write_atomic(path: Path, data: str | bytes) -> None:
    write_bytes_atomic(path, data if isinstance(data, bytes) else data.encode())


def run_bench(subject: str = "all", budgets: str | None = None, quick: bool = False, device: str = "cpu",
              output: str | Path = "artifacts/bench", traces: str | Path | None = "../shared/data/traces",
              root: str | Path = ".", echo=print) -> dict:
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
            echo(f"preparing subject {name} (the stage cache makes this free when nothing changed)")
            subjects.append(reference_subject(root, sizes.reference_prompt, sizes.reference_decode, name))
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
        plan = json.loads((Path(subj.artifact) / "plan.json").read_text())
        planned = {p["name"] for p in plan["predictors"]}
        neuron = ["naive+neuron"] if plan.get("neuron", {}).get("name", "off") != "off" else []
        return [*SYSTEMS[1:3], *neuron, *(s for s in PREDICTOR_SYSTEMS if s.split("+", 1)[1] in planned), SYSTEMS[3]]

    runs = [(s, sys_, b) for s in subjects for sys_, b in
            [("resident", "100%")] + [(x, b) for b in budget_list for x in systems(s)]]
    results, raw = [], []
    bar = tqdm(runs, desc="bench", unit="run")
    for subj, system, budget in bar:
        bar.set_postfix_str(f"{subj.name} {system} {budget}")
        offload = work / "offload"
        spec = {"subject": subj.name, "system": system, "budget": budget, "device": device,
                "budget_bytes": _budget_bytes(subj, budget), "host_bytes": os.sysconf("SC_PAGE_SIZE") *
                os.sysconf("SC_PHYS_PAGES") // 2, "model_dir": str(subj.model_dir),
                "artifact": str(subj.artifact), "experts_modules": subj.manifest["moe"]["experts_modules"],
                "prompt_ids": subj.prompt_ids, "decode_ids": subj.decode_ids,
                "replay": str(subj.replay) if subj.replay else None, "offload_dir": str(offload)}
        shutil.rmtree(offload, ignore_errors=True)
        measured = _run_worker(spec, work)
        shutil.rmtree(offload, ignore_errors=True)
        raw.append({"subject": subj.name, "system": system, "budget": budget} | measured)
        if "error" in measured:
            echo(f"{subj.name} {system} {budget}: FAILED {measured['error']}")
        targets = budget_list if system == "resident" else [budget]
        for b in targets:
            row = {"subject": subj.name, "system": system, "budget": b} | measured
            if system == "resident":
                row["measured_once"] = True
            results.append(row)

    report = {
        "machine": machine_info(device),
        "read_bandwidth_mb_s": bandwidth["mb_s"],
        "read_bandwidth": bandwidth,
        "results": [{k: r.get(k) for k in RESULT_KEYS} | {k: v for k, v in r.items() if k not in RESULT_KEYS}
                    for r in results],
        "subjects": {s.name: {"model": str(s.model_dir), "artifact": str(s.artifact), "routing": s.routing,
                              "prompt_tokens": len(s.prompt_ids), "decode_tokens": len(s.decode_ids)} | s.facts
                     for s in subjects},
        "budgets": budget_list,
        "quick": quick,
        "notes": notes,
        "wall_seconds": round(time.time() - started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_atomic(output / "bench.json", json.dumps(report, indent=2) + "\n")
    _write_atomic(output / "bench.md", write_markdown(report))
    write_plot(report, output / "bench.png")
    return report
