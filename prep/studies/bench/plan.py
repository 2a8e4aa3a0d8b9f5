"""The bench's first step: what to run. Options checked, budgets read, subjects built (``subjects.SUBJECTS``, the
registry), and each subject's (system, budget) runs listed, before anything is measured.

Also what every later step reads a budget with: ``subject_budget_bytes`` (a share, or ``4bit-25%``, in bytes) and
``simulated_memory`` (the budget the simulator is given for a row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loader.codec import DEFAULT_FORMATS, MatrixSpec
from loader.runtime import budget_bytes
from prep.errors import MoeprepError
from prep.methods.trace import MIXTRAL_TRACE_FILE
from prep.studies.bench.prefill import PREFILL_BUDGETS, parse_prompts
from prep.studies.bench.subjects import (
    BuildContext,
    Subject,
    SubjectEntry,
    known_systems,
    subject_entries,
    subject_systems,
)

UNLIMITED = "unlimited"
BELOW_4BIT = "4bit-25%"  # the dense weights + 25% of the model's expert bytes at 4 bits: below a 4-bit model's size
DEFAULT_BUDGETS = f"100%,50%,25%,12.5%,{BELOW_4BIT}"
QUICK_BUDGETS = "25%"
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1


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


@dataclass
class BenchPlan:
    """What one bench run measures, and how: the checked options, the built subjects, their runs, the notes so far."""

    options: dict  # as given: the command that made the report
    device: str
    store: str  # where the loader's stores live: "disk" or "host" ("auto" resolved)
    quick: bool
    decode: bool
    sizes: Sizes
    output: Path
    work: Path
    budgets: list[str]
    prefill_budgets: list[str]
    prompts: list[int]
    repeats: int
    chosen_systems: set[str] | None
    traces: Path | None  # the real traces, None where absent
    started: float
    tune_minutes: float = 3.0  # ``moeload tune``'s limit per subject and budget with a moeprep+tuned row
    subjects: list[Subject] = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # subject -> [(system, budget), ...] of each round
    notes: list[str] = field(default_factory=list)


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


def four_bit_expert_bytes(subject: Subject) -> int:
    """The source model's experts at 4 bits in the codec's default int4 format (its bits per weight: codes,
    8-bit scale and zero per group of 64, their float16 meta)."""

    group, meta = DEFAULT_FORMATS["int4"]
    moe = subject.manifest["moe"]
    source_weights = int(moe["source_expert_bytes"]) // {"float32": 4, "bfloat16": 2, "float16": 2}[moe["dtype"]]
    spec = MatrixSpec("w", (4096, 4096), "int4", moe["dtype"], group, meta_group=meta)
    per_weight = sum(size for _n, _d, size in spec.parts()) / spec.numel
    return int(source_weights * per_weight)


def subject_budget_bytes(subject: Subject, budget: str) -> int:
    """The loader's reading of a share budget, in bytes (one function for the loader, bench and simulator);
    ``4bit-25%``: the dense weights + 25% of ``four_bit_expert_bytes``."""

    if budget == BELOW_4BIT:
        dense = budget_bytes(subject.artifact, "100%") - int(subject.manifest["moe"]["source_expert_bytes"])
        return dense + four_bit_expert_bytes(subject) // 4
    return budget_bytes(subject.artifact, budget)


def simulated_memory(subject: Subject, system: str, budget: str):
    """The memory budget the simulator replays a loader row at: ``unlimited`` for an ``@unlimited`` row, bytes for
    ``4bit-25%`` (the loader reads only shares), else the share as given."""
    if system.endswith("@" + UNLIMITED):
        return UNLIMITED
    return subject_budget_bytes(subject, budget) if budget == BELOW_4BIT else budget


def unlimited_systems(subject: Subject) -> list[str]:
    """The budget-free loader rows measuring the compute floors: naive's plan on its artifact and moeprep's plan on
    the recipe's (they differ in compute even on one artifact: held forms, routing policies, neuron loading)."""
    return ["naive@unlimited", "moeprep@unlimited"]


def _only_systems(only: str | None) -> set[str] | None:
    """``--systems naive,moeprep`` -> {"naive", "moeprep"}; None runs every system."""
    if only is None:
        return None
    chosen = {x.strip() for x in only.split(",") if x.strip()}
    known = known_systems()
    if not chosen or chosen - known:
        raise MoeprepError(f"--systems {only!r}: unknown {sorted(chosen - known)}; use a comma-separated subset of "
                           f"{', '.join(sorted(known))}")
    return chosen


def _check_device(device: str, store: str) -> None:
    if device not in ("cpu", "cuda"):
        raise MoeprepError(f"--device {device!r} unknown; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoeprepError("--device cuda: torch sees no CUDA GPU here; run with --device cpu "
                           "(or install a CUDA build of torch on a machine with a GPU)")
    if store not in ("auto", "disk", "host"):
        raise MoeprepError(f"--store {store!r} unknown; use auto, disk or host")


def _have_traces(traces: Path | None) -> bool:
    return traces is not None and any(
        p.is_file() for p in (traces, traces / MIXTRAL_TRACE_FILE, traces / "mixtral-8x7b" / MIXTRAL_TRACE_FILE))


def plan_bench(subject: str, budgets: str | None, quick: bool, device: str, output: str | Path,
               traces: str | Path | None, root: str | Path, echo, repeats: int | None, store: str,
               only: str | None, prefill: str | None, decode: bool, tune_minutes: float = 3.0) -> BenchPlan:
    """Check the options (``run.run_bench``'s) before anything is built, build the subjects and list their runs."""
    _check_device(device, store)
    options = {"subject": subject, "budgets": budgets, "repeats": repeats, "quick": quick, "device": device,
               "store": store, "systems": only, "prefill": prefill, "decode": decode, "output": str(output),
               "traces": None if traces is None else str(traces)}
    chosen_systems = _only_systems(only)  # checked before anything is built
    prompts = parse_prompts(prefill)
    if not decode and not prompts:
        raise MoeprepError("--no-decode leaves nothing to measure; pass --prefill 512,2048 with it")
    entries = subject_entries(subject)
    budget_list = parse_budgets(budgets or (QUICK_BUDGETS if quick else DEFAULT_BUDGETS))
    prefill_budgets = parse_budgets(budgets or (QUICK_BUDGETS if quick else PREFILL_BUDGETS))
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    if repeats < 1:
        raise MoeprepError(f"--repeats must be at least 1, got {repeats}")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "work").mkdir(exist_ok=True)
    traces_dir = Path(traces) if traces else None
    plan = BenchPlan(options, device, store if store != "auto" else ("host" if device == "cuda" else "disk"), quick,
                     decode, QUICK if quick else FULL, output, output / "work", budget_list, prefill_budgets, prompts,
                     repeats, chosen_systems, traces_dir if _have_traces(traces_dir) else None, time.time(),
                     tune_minutes)
    _build_subjects(plan, entries, Path(root), traces_dir, subject == "all", echo)
    plan.runs = _runs(plan)
    return plan


def _build_subjects(plan: BenchPlan, entries: list[SubjectEntry], root: Path, traces_dir: Path | None,
                    everything: bool, echo) -> None:
    """Build each subject asked for, in order; one that needs the real traces where they are absent is an error
    when it was asked for by name, else a note (a quick run routes mixtral-shape with its own routers instead)."""
    sizes = plan.sizes
    context = BuildContext(root, plan.output, plan.traces, plan.quick, (sizes.reference_prompt, sizes.reference_decode),
                           (sizes.shape_prompt, sizes.shape_decode), echo)
    for entry in entries:
        if entry.traces and plan.traces is None:
            if not (entry.quick_without_traces and plan.quick):
                message = (f"{entry.name} skipped: the real Mixtral traces are not in {traces_dir} (pass --traces DIR "
                           f"holding {entry.traces})")
                if not everything:
                    raise MoeprepError(message)
                echo(message)
                plan.notes.append(message)
                continue
            message = (f"{entry.name} routes with its own (random) routers: the real traces are not in {traces_dir} "
                       "(quick mode only; a full run skips the subject)")
            echo(message)
            plan.notes.append(message)
        plan.notes.extend(entry.notes)
        echo(f"preparing subject {entry.name} {entry.preparing}")
        built, notes = entry.build(context, entry.name)
        plan.notes.extend(notes)
        plan.subjects.append(built)
    if not plan.subjects:
        raise MoeprepError("no subject to measure")


def _runs(plan: BenchPlan) -> dict:
    """Subject -> its (system, budget) runs of one round: resident once, the ``@unlimited`` floors, then each budget's
    systems; only those ``--systems`` names; none without decode rows."""
    if not plan.decode:  # the prefill rows alone
        return {s.name: [] for s in plan.subjects}
    runs = {s.name: [("resident", "100%")] + [(x, UNLIMITED) for x in unlimited_systems(s)]
            + [(x, b) for b in plan.budgets for x in subject_systems(s)] for s in plan.subjects}
    if plan.chosen_systems is not None:
        runs = {name: [(x, b) for x, b in r if x.split("@", 1)[0] in plan.chosen_systems] for name, r in runs.items()}
    return runs
