"""The bench's measuring step: the disk's read bandwidth, the resident candidates, every (system, budget) run of
every subject in interleaved rounds, each in its own worker process (``worker.py``), the rows they make (medians of
the rounds) and, with ``--prefill``, the prefill rows (``prefill.py``).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from loader.io import write_bytes_atomic
from prep.studies.bench.plan import BELOW_4BIT, UNLIMITED, BenchPlan, subject_budget_bytes
from prep.studies.bench.prefill import UNFIT_FOR_PROMPTS, add_bounds, add_memory_verdicts, run_prefill
from prep.studies.bench.subjects import LLAMA, Subject
from prep.studies.bench.worker import TUNED

RESIDENT_DTYPES = ("float32", "bfloat16")  # the resident candidates' dtypes, and on CUDA also:
CUDA_RESIDENT_DTYPES = ("float16",)
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # transformers' (integrations/moe.py)


@dataclass
class Measured:
    """What the measuring step gathered: the read bandwidth, each configuration's runs, every run as it came, the
    prefill rows (None without ``--prefill``)."""

    bandwidth: dict
    runs: dict = field(default_factory=dict)  # (subject, system, budget) -> [result of each repeat]
    raw: list = field(default_factory=list)
    prefill: dict | None = None


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


def _write_atomic(path: Path, data: str | bytes) -> None:
    write_bytes_atomic(path, data if isinstance(data, bytes) else data.encode())


# ---------------------------------------------------------------------------------------- the rounds


def store_bandwidth(plan: BenchPlan) -> dict:
    """The read bandwidth of the disk holding the largest subject's store (``read_bandwidth``)."""
    largest = max(plan.subjects, key=lambda s: s.facts["store_bytes"])
    return read_bandwidth(Path(largest.facts["store_file"]), plan.sizes.bandwidth_bytes)


def worker_spec(plan: BenchPlan, subj: Subject, system: str, budget: str, repeat: int) -> dict:
    """The worker's spec (``worker.py``) of one run; round 1's resident run records the model's own routing where
    none is replayed, and resident runs the chosen candidate."""
    limit = subject_budget_bytes(subj, budget)
    spec = {"subject": subj.name, "system": system, "budget": budget, "device": plan.device, "store": plan.store,
            "memory_budget": limit if budget == BELOW_4BIT else budget,
            "budget_bytes": limit, "host_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2,
            "model_dir": str(subj.model_dir),
            "artifact": str(subj.artifact_for(system)),
            "experts_modules": subj.manifest["moe"]["experts_modules"],
            "prompt_ids": subj.prompt_ids, "decode_ids": subj.decode_ids,
            "replay": str(subj.replay) if subj.replay else None, "offload_dir": str(plan.work / "offload"),
            "record_routing": (str(plan.work / f"{subj.name}-routing.safetensors")
                               if system == "resident" and repeat == 0 and subj.replay is None else None)}
    if system == TUNED:
        spec["tuned_off"] = subj.facts["tuned"][budget]["off"]
    chosen = (subj.facts.get("resident") or {}).get("chosen")
    if system == "resident" and chosen:
        spec |= {"dtype": chosen["dtype"], "experts_implementation": chosen["experts_implementation"]}
    return spec


def planned_candidates(plan: BenchPlan) -> list[tuple[str, str]]:
    """The resident candidates to time: none where ``--systems`` leaves resident out."""
    if plan.chosen_systems is not None and "resident" not in plan.chosen_systems:
        return []
    return resident_candidates(plan.device)


def measure_bench(plan: BenchPlan, bandwidth: dict, echo) -> Measured:
    """Every run of the plan, ``repeats`` rounds interleaved (every configuration once per round), the resident
    candidates of each subject first; then the prefill rows. Each run's result is appended to ``work/raw.json`` as
    it comes, so nothing measured is lost to a run cut short."""
    measured = Measured(bandwidth)
    if plan.decode:
        tune_rows(plan, echo)
    candidates = planned_candidates(plan)
    rounds = plan.repeats if plan.decode else 0
    bar = tqdm(total=sum(len(r) for r in plan.runs.values()) * plan.repeats
               + (len(candidates) * len(plan.subjects) if plan.decode else 0), desc="bench", unit="run")
    for repeat in range(rounds):
        for subj in plan.subjects:
            if repeat == 0 and candidates:  # the resident baseline: the fastest candidate on this device, chosen first
                bar.set_postfix_str(f"{subj.name} resident candidates")
                _choose_subject_resident(plan, subj, candidates, bar, echo)
            for system, budget in plan.runs[subj.name]:
                bar.set_postfix_str(f"round {repeat + 1}/{plan.repeats} {subj.name} {system} {budget}")
                _measure_run(plan, measured, subj, system, budget, repeat, echo)
                bar.update()
    bar.close()
    if plan.prompts:
        measured.prefill = _prefill_rows(plan, candidates, bandwidth, echo)
        plan.notes += measured.prefill["notes"]
    return measured


QUICK_TUNE = {"tokens": 8, "rounds": (1, 1), "in_process": True}  # --quick: a smoke run of the tune, in this process


def tune_rows(plan: BenchPlan, echo) -> None:
    """``moeload tune`` on each subject's artifact at each budget with a ``moeprep+tuned`` row, before the rounds: the
    decisions (written to no device file: the artifact stays as shipped) go into the subject's facts, which the
    tuned row's worker runs with, and each budget's kept and switched-off techniques into the notes."""
    from loader.tune import tune

    for subj in plan.subjects:
        for system, budget in plan.runs.get(subj.name, []):
            if system != TUNED:
                continue
            base = worker_spec(plan, subj, "moeprep", budget, 1)
            echo(f"tuning {subj.name} at {budget} ({plan.tune_minutes:g} minutes at most)")
            point = tune(base["artifact"], base["memory_budget"], plan.tune_minutes, plan.device, plan.store,
                         subj.replay, echo=echo, write=False, **(QUICK_TUNE if plan.quick else {}))
            subj.facts.setdefault("tuned", {})[budget] = point.to_json()
            plan.notes.append(f"{subj.name} at {budget}: `moeload tune` kept {', '.join(point.kept) or 'none'}; "
                              f"switched off {', '.join(point.off) or 'none'}"
                              + "".join(f"; {n} {d['verdict']}" + (f" ({d['ratio']:.3f}x [{d['low']:.3f}, "
                                                                   f"{d['high']:.3f}])" if "ratio" in d else "")
                                        for n, d in point.decisions.items()))


def _choose_subject_resident(plan: BenchPlan, subj: Subject, candidates: list, bar, echo) -> None:
    """Time the resident candidates of ``subj`` and record them and the chosen one in its facts; say which."""
    subj.facts["resident"] = measure_resident_candidates(
        worker_spec(plan, subj, "resident", "100%", 0), candidates, plan.sizes.candidate_decode, plan.work,
        on_run=lambda _entry: bar.update())
    for c in subj.facts["resident"]["candidates"]:
        if c.get("error"):
            echo(f"{subj.name} resident candidate {c['dtype']} {c['experts_implementation']}: FAILED {c['error']}")
    chosen = subj.facts["resident"]["chosen"]
    if chosen is None:
        note = (f"{subj.name}: every resident candidate failed; resident runs transformers' defaults "
                "(the checkpoint's dtype, the default experts implementation)")
        echo(note)
        plan.notes.append(note)
        return
    speed = chosen["decode_tokens_per_s"]
    echo(f"{subj.name}: resident = {chosen['dtype']} with experts implementation {chosen['experts_implementation']} ("
         + (f"{speed:.3g} tok/s, the fastest of {len(candidates)} candidates)" if speed else
            "the only candidate that can run)"))


def _measure_run(plan: BenchPlan, measured: Measured, subj: Subject, system: str, budget: str, repeat: int,
                 echo) -> None:
    """One run in its worker; its result kept under its configuration and in ``work/raw.json``."""
    result = _measure_system(worker_spec(plan, subj, system, budget, repeat), plan.work,
                             (subj.facts.get("llama_cpp") or {}).get("file"))
    routing_file = result.pop("routing_file", None)
    if routing_file is not None:
        subj.facts["routing_file"] = routing_file
    measured.raw.append({"subject": subj.name, "system": system, "budget": budget, "repeat": repeat} | result)
    _write_atomic(plan.work / "raw.json", json.dumps(measured.raw, indent=1) + "\n")  # nothing measured is lost
    if "error" in result:
        echo(f"{subj.name} {system} {budget}: FAILED {result['error']}")
    measured.runs.setdefault((subj.name, system, budget), []).append(result)


def result_rows(plan: BenchPlan, measured: Measured) -> list[dict]:
    """One row per configuration (``summarize``); a budget-free one (resident, ``@unlimited``) repeated at each
    budget, marked ``measured_once``."""
    results = []
    for (name, system, budget), runs_of in measured.runs.items():
        row = summarize(runs_of)
        once = system == "resident" or budget == UNLIMITED  # budget-free: the row repeated at each budget
        for b in (plan.budgets if once else [budget]):
            results.append({"subject": name, "system": system, "budget": b} | row | ({"measured_once": True} if once else {}))
    return results


def _prefill_rows(plan: BenchPlan, candidates: list, bandwidth: dict, echo) -> dict:
    """The prefill rows (``prefill.run_prefill``) measured with the bench's workers, each moeprep row's bound against
    the disk's read bandwidth measured at the start of the run, each row's memory against its budget."""
    load_before = os.getloadavg()  # the machine may be shared: its load beside the figures
    bar = tqdm(desc="bench prefill", unit="run")
    by_name = {s.name: s for s in plan.subjects}

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update()

    def run_one(spec: dict) -> dict:
        return _measure_system(spec, plan.work, (by_name[spec["subject"]].facts.get("llama_cpp") or {}).get("file"))

    fit = [c for c in candidates if c[1] not in UNFIT_FOR_PROMPTS]

    def resident_for(spec: dict) -> dict:
        return measure_resident_candidates(spec, fit, 0, plan.work, on_run=lambda _entry: bar.update(),
                                           speed="prefill_tokens_per_s")

    out = run_prefill(plan.subjects, plan.prefill_budgets, plan.prompts, plan.repeats, plan.work, plan.traces,
                      lambda subj, system, budget: worker_spec(plan, subj, system, budget, 1), run_one,
                      resident_for if fit else lambda _spec: None, plan.chosen_systems, echo, progress)
    bar.close()
    out["notes"] += [f"prefill rows: resident is not chosen among experts implementation {impl}: {why}"
                     for impl, why in UNFIT_FOR_PROMPTS.items() if any(c[1] == impl for c in candidates)]
    bandwidth_bytes = bandwidth["mb_s"] * 1e6 if bandwidth.get("mb_s") else None
    add_bounds(out["rows"], bandwidth_bytes)
    add_memory_verdicts(out["rows"])
    return out | {"read_bandwidth_bytes_per_s": bandwidth_bytes,
                  "load_average": {"before": load_before, "after": os.getloadavg()}}
