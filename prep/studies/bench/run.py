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
  routing and miss policies), scaled to the budget, as shipped (a device file, ``tuning.json``, is ignored).
- ``moeprep+tuned``: the same plan with only the techniques ``moeload tune`` kept on this machine at the row's budget
  (``loader/tune.py``: each technique switched off in turn, in fresh processes, on the subject's replayed routing;
  ``--tune-minutes`` each, before the rounds; ``--quick``: one in-process round of 8 tokens). Its decisions, with
  each technique's ratio and interval, are in the notes and in ``subjects[...].tuned``; it has no modelled column.
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

Which subject runs which systems is the registry's (``prep/studies/bench/subjects.py``, ``SUBJECTS``); ``run_bench``
runs the steps: ``plan.py``, ``measure.py``, ``model.py``, ``bound.py``, then writes bench.json, bench.md, bench.png.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from loader.io import write_bytes_atomic
from prep.studies.bench.bound import bound_rows
from prep.studies.bench.kernels import kernel_table
from prep.studies.bench.measure import Measured, measure_bench, result_rows, store_bandwidth
from prep.studies.bench.model import device_profile, model_rows, subject_routing
from prep.studies.bench.plan import BenchPlan, plan_bench
from prep.studies.bench.report import write_markdown, write_plot

RESULT_KEYS = ("subject", "system", "budget", "repeats", "decode_tokens_per_s", "decode_tokens_per_s_min",
               "decode_tokens_per_s_max", "modelled_tokens_per_s", "fraction_of_bound", "overhead_us_per_layer",
               "prefill_s", "bytes_read_per_token", "hit_rate", "stall_fraction", "peak_rss_mb")


def run_bench(subject: str = "all", budgets: str | None = None, quick: bool = False, device: str = "cpu",
              output: str | Path = "artifacts/bench", traces: str | Path | None = "../shared/data/traces",
              root: str | Path = ".", echo=print, repeats: int | None = None, store: str = "auto",
              only: str | None = None, prefill: str | None = None, decode: bool = True,
              tune_minutes: float = 3.0) -> dict:
    """Measure, write bench.json / bench.md / bench.png (and the device profile, device.json) under ``output``,
    and return the report. store: where the loader's expert stores live (``load(store=...)``); auto is host
    RAM on CUDA (pinned, copied at PCIe speed) and the disk on a CPU. only: comma-separated systems to run
    (``naive`` also selects ``naive@unlimited``; without ``resident`` the resident candidates are not
    measured either), to spend a short GPU lease on what a second store changes. prefill: comma-separated
    prompt lengths ("512,2048") for the prefill rows (``prep/studies/bench/prefill.py``; None: none), at
    ``budgets`` where given, else ``PREFILL_BUDGETS`` (``--quick``: its one budget). decode off: the prefill rows
    alone (no decode rows, no device profile).

    The steps: plan (options, subjects, runs), measure (bandwidth, device profile, rounds, prefill rows), model
    (the simulator beside each loader row), bound (the physical bounds and each row's share of them), write."""
    plan = plan_bench(subject, budgets, quick, device, output, traces, root, echo, repeats, store, only, prefill,
                      decode, tune_minutes)
    bandwidth = store_bandwidth(plan)
    profile = None
    if plan.decode:
        echo("measuring the device profile (reads and one expert's compute) for the simulator")
        profile = device_profile(plan.subjects, plan.sizes, plan.device, plan.output, plan.store)
    kernels = None
    if plan.decode and plan.device == "cpu":
        echo("measuring each held form's one-token product against the read bandwidth (the kernel table)")
        kernels = kernel_table(plan.quick)
    measured = measure_bench(plan, bandwidth, echo)
    results = result_rows(plan, measured)
    routings = {s.name: subject_routing(s) for s in plan.subjects}
    calibrated = model_rows(plan, results, routings, profile)
    bounds = bound_rows(plan, results, routings, profile)
    return write_report(plan, measured, results, profile, calibrated, bounds, kernels)


def write_report(plan: BenchPlan, measured: Measured, results: list[dict], profile, calibrated, bounds: dict,
                 kernels: dict | None = None) -> dict:
    """bench.json (the report, returned), bench.md and bench.png under the plan's output."""
    report = {
        "machine": machine_info(plan.device) | {"torch_threads": torch.get_num_threads()},
        "store": plan.store,
        "read_bandwidth_mb_s": measured.bandwidth["mb_s"],
        "read_bandwidth": measured.bandwidth,
        "device_profile": profile.to_json() if profile is not None else None,
        "device_profile_calibrated": calibrated.to_json() if calibrated is not None else None,
        "results": [{k: r.get(k) for k in RESULT_KEYS} | {k: v for k, v in r.items() if k not in RESULT_KEYS}
                    for r in results],
        "subjects": {s.name: {"model": str(s.model_dir), "artifact": str(s.artifact),
                              "naive_artifact": str(s.naive_artifact), "routing": s.routing,
                              "prompt_tokens": len(s.prompt_ids), "decode_tokens": len(s.decode_ids),
                              "accuracy_delta": accuracy_delta(s.artifact)}
                     | s.facts for s in plan.subjects},
        "bounds": bounds,
        "kernels": kernels,
        "budgets": plan.budgets,
        "repeats": plan.repeats,
        "raw": measured.raw,
        "decode": plan.decode,
        "prefill": measured.prefill,
        "quick": plan.quick,
        "notes": plan.notes,
        "wall_seconds": round(time.time() - plan.started, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": source_commit(),
        "options": plan.options,
    }
    write_bytes_atomic(plan.output / "bench.json", (json.dumps(report, indent=2) + "\n").encode())
    write_bytes_atomic(plan.output / "bench.md", write_markdown(report).encode())
    write_plot(report, plan.output / "bench.png")
    return report


def machine_info(device: str) -> dict:
    import accelerate
    import transformers

    from loader.tune import cpu_name

    cpu = cpu_name()
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


def accuracy_delta(artifact: Path) -> dict | None:
    """Per suite, the prepared-minus-original accuracy in points from the artifact's report (None: no eval)."""
    path = Path(artifact) / "report.json"
    try:
        suites = (json.loads(path.read_text()).get("eval") or {}).get("suites") or {}
    except (OSError, ValueError):
        return None
    return {name: {"delta_points": 100 * s["delta"], "n": s["n"]} for name, s in suites.items()
            if s.get("delta") is not None} or None
