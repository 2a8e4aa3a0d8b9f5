"""Stage ``tune_policy``: HOBBIT's cache weights, tuned for this model by Optuna over the simulator (H3).

HOBBIT evicts the expert of lowest ``w_lru R/T + w_lfu F/T + w_lhu H/T + w_fld (1 - d/L)`` and chooses the
weights "by minimising the mixed-precision miss penalty on a calibration dataset" without publishing
them. This stage does that search: each trial replays the calibration traces through the loader's own
cache (``prep.stages.planning.Draft``) at the budget holding ``plan.tune.share`` of the shipped experts, and
scores the plan's cost (modelled seconds per token with a device profile, else demand bytes per token,
so a high-precision miss weighs its record's size). The search covers the weights (four exponentials
normalised: uniform on the simplex), the pools' eviction group (per layer, or global as HOBBIT's), the
prefetch depth when next-layer gates are on, and the low pool's share when dynamic precision holds one
and no allocation sets it. Trial 0 is HOBBIT's equal weights with the plan's own settings.

Then, with a device profile, the predictor set: every subset of the plan's predictors is scored with the
chosen policy, and the plan keeps the cheapest (on a tie, the fewer): a predictor enters the plan only where
the simulator predicts it saves time on the device (a calibrated profile charges the reads of wasted
prefetches where the disk is the bottleneck). Without a profile the objective is demand bytes, which a
prefetch always lowers without saying whether it saves time, so the recipe's set is kept.

The study lives in a journal file in the stage's work directory (``study.journal``), or in the storage
``plan.tune.storage`` names (a journal file on a shared filesystem, or an RDB URL), so a killed run resumes
with its finished trials, and several workers (``plan.tune.workers`` in one process, or processes on several
nodes given the same storage) share one study until ``trials`` trials are complete. The sampler is seeded. LRU,
LFU and EdgeMoE's policy are scored at the same budget; the plan takes whichever of them and the trials
scores best, so the tuned plan is never worse than its default. It runs after ``allocate_cache`` on the
allocated plan (the pools of the operating point for the budget), and scores every operating point
again with the policy it chose.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from loader.errors import MoeError
from loader.plan import Plan, PolicySpec
from prep.errors import MoeprepError
from prep.stages import Stage, StageResult
from prep.stages.allocate_cache import score_plan
from prep.stages.planning import PlanSection, draft_from_inputs

VERSION = 3  # 3: the predictor set is searched
STUDY = "tune_policy"
JOURNAL = "study.journal"
WEIGHTS = ("w_lru", "w_lfu", "w_lhu", "w_fld")
BASELINES = ("lru", "lfu", "edgemoe")
DEPTH_MAX = 3
LOW_SHARE = (0.05, 0.6)


@dataclass(frozen=True)
class TunedPolicy(StageResult):
    """The eviction policy, group, prefetch depth and low share the plan takes, and how they were found."""

    eviction: dict  # {"name", "params"}
    group: str | None  # the pools' eviction group (None: as composed)
    depth: int | None  # next_gates depth (None: no next-layer gates)
    low_share: float | None  # the low pool's share (None: not searched)
    chosen: str  # "trial N" or a baseline's name
    unit: str
    budget_bytes: int
    share: float
    objective: dict  # name -> value: each baseline, "default" (trial 0) and "best trial"
    trials: list  # [[number, params, value]] of finished trials
    points: list  # the allocation's operating points scored with the chosen policy (none without allocation)
    predictors: list | None = None  # the predictor names kept (None: the plan's, not searched)

    def apply(self, plan: Plan, context=None) -> Plan:
        """The tuned eviction policy (and group, low share, next_gates depth, predictor subset) on ``plan``."""
        pools, points = plan.pools, plan.operating_points
        if self.group is not None:
            pools = tuple(dataclasses.replace(p, group=self.group) for p in pools)
            points = tuple(dataclasses.replace(pt, pools=tuple(dataclasses.replace(p, group=self.group) for p in pt.pools))
                           for pt in points)
        if self.low_share is not None:
            pools = _with_low_share(pools, self.low_share)
        predictors = tuple(PolicySpec(p.name, p.params | {"depth": self.depth}) if p.name == "next_gates"
                           and self.depth is not None else p for p in plan.predictors
                           if self.predictors is None or p.name in self.predictors)
        return dataclasses.replace(plan, pools=pools, operating_points=points, predictors=predictors,
                                   eviction=PolicySpec(self.eviction["name"], dict(self.eviction["params"])))


def _with_low_share(pools, low_share: float):
    rest = sum(p.share for p in pools if p.name != "low")
    return tuple(dataclasses.replace(p, share=low_share if p.name == "low" else p.share / rest * (1 - low_share))
                 for p in pools)


def _finite(value: float) -> float | None:
    """JSON has no infinity: a refused configuration's score is kept as null."""
    return value if math.isfinite(value) else None


def weights_of(x: dict) -> dict:
    """Four draws in (0, 1] -> weights on the simplex (-log x normalised: uniform on the simplex)."""
    raw = [-math.log(x[f"x_{w[2:]}"]) for w in WEIGHTS]
    total = sum(raw)
    return {w: (r / total if total > 0 else 0.25) for w, r in zip(WEIGHTS, raw, strict=True)}


def open_storage(spec: str | None, work: Path):
    """The Optuna storage of ``plan.tune.storage``: None -> ``work/study.journal``; an RDB URL (``scheme://…``) ->
    ``RDBStorage``; any other text -> a journal file at that path (its directory must exist)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if spec is not None and "://" in spec:
        try:
            return optuna.storages.RDBStorage(spec)
        except ImportError as e:
            raise MoeprepError(f"plan.tune.storage {spec!r} is a database URL, which needs {e.name} "
                               "(pip install sqlalchemy, and the database's driver); or give a journal file path") from None
    path = Path(work) / JOURNAL if spec is None else Path(spec)
    if not path.parent.is_dir():
        raise MoeprepError(f"plan.tune.storage {spec!r}: directory {path.parent} does not exist; create it (on a "
                           "filesystem every worker sees) or leave storage out for a journal in the stage's work directory")
    return JournalStorage(JournalFileBackend(str(path)))


def tune(draft, cfg: PlanSection, work: Path, allocation=None, progress: bool = True,
         study_name: str = STUDY) -> TunedPolicy:
    """Run (or resume, or join) the study ``study_name`` in ``plan.tune.storage`` (default: a journal in ``work``)
    and return the best plan settings it found; with ``allocation`` (the draft's plan carries it), its operating
    points are scored again with the chosen policy."""
    import os
    import socket

    import optuna
    from optuna.study import MaxTrialsCallback
    from tqdm import tqdm

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    plan, knobs = draft.plan, cfg.tune
    sequences = slice(0, cfg.num_sequences) if cfg.num_sequences is not None else None
    budget = draft.budget_for_share(knobs.share)
    gates = next((p for p in plan.predictors if p.name == "next_gates"), None)
    low = any(p.name == "low" for p in plan.pools) and not cfg.allocate.enabled
    max_depth = min(DEPTH_MAX, plan.num_layers - 1)

    def score(candidate: Plan) -> float:
        try:
            caps = draft.capacities(candidate, budget)
        except MoeError:  # e.g. per-layer pools of an unallocated mixed plan: a group below one record
            return math.inf
        return draft.cost(draft.simulate(candidate, caps, sequences))

    def settings(params: dict) -> TunedPolicy:
        return TunedPolicy(
            eviction={"name": "hobbit", "params": weights_of(params)}, group=params["group"],
            depth=params.get("depth") if gates is not None else None,
            low_share=params.get("low_share") if low else None, chosen="", unit=draft.unit, budget_bytes=budget,
            share=knobs.share, objective={}, trials=[], points=[])

    def objective(trial) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")  # which process ran it
        params = {f"x_{w[2:]}": trial.suggest_float(f"x_{w[2:]}", 1e-6, 1.0) for w in WEIGHTS}
        params["group"] = trial.suggest_categorical("group", ["global", "layer"])
        if gates is not None and max_depth >= 1:
            params["depth"] = trial.suggest_int("depth", 1, max_depth)
        if low:
            params["low_share"] = trial.suggest_float("low_share", *LOW_SHARE)
        return score(settings(params).apply(plan))

    storage = open_storage(knobs.storage, work)
    study = optuna.create_study(study_name=study_name, storage=storage, direction="minimize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=knobs.seed))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # trial 0: HOBBIT's equal weights, global pools, the plan's own depth and low share
    first = {f"x_{w[2:]}": math.exp(-1) for w in WEIGHTS} | {"group": "global"}
    if gates is not None and max_depth >= 1:
        first["depth"] = min(max(1, int(gates.params.get("depth", 1))), max_depth)
    if low:
        first["low_share"] = min(max(next(p.share for p in plan.pools if p.name == "low"), LOW_SHARE[0]), LOW_SHARE[1])
    if not study.trials:
        study.enqueue_trial(first)
    remaining = knobs.trials - len(done)
    if remaining > 0:
        bar = tqdm(total=knobs.trials, initial=len(done), desc="tune_policy", unit="trial", disable=not progress,
                   leave=False)

        def report(study_, _trial) -> None:
            bar.update(1)
            if any(t.state == optuna.trial.TrialState.COMPLETE for t in study_.trials):
                bar.set_postfix(best=f"{study_.best_value:.4g}")

        try:
            # every worker (thread here, or process sharing the storage) stops once the study has `trials` complete
            complete = (optuna.trial.TrialState.COMPLETE,)
            study.optimize(objective, n_trials=remaining, n_jobs=knobs.workers,
                           callbacks=[report, MaxTrialsCallback(knobs.trials, states=complete)])
        finally:
            bar.close()
    finished = sorted((t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.number)
    if not finished:
        raise MoeprepError(f"the tune_policy study in {work} finished no trial; run prepare again")
    best = min(finished, key=lambda t: (t.value, t.number))
    trial0 = next((t for t in finished if t.number == 0), None)  # a run killed inside trial 0 leaves it unfinished
    objective_values = {"default": trial0.value if trial0 is not None else score(settings(first).apply(plan)),
                        "best trial": best.value}
    for name in BASELINES:  # at the plan's own groups, depth and shares
        objective_values[name] = score(dataclasses.replace(plan, eviction=PolicySpec(name)))
    tuned = settings(best.params)
    chosen, value = f"trial {best.number}", best.value
    for name in BASELINES:  # a plain policy that beats every trial is the plan's choice
        if objective_values[name] < value:
            chosen, value = name, objective_values[name]
    if chosen in BASELINES:
        tuned = dataclasses.replace(tuned, eviction={"name": chosen, "params": {}}, group=None,
                                    depth=None, low_share=None)
    if not math.isfinite(value):
        raise MoeprepError(f"no policy fits the budget of {budget:,} bytes (plan.tune.share {knobs.share}): every "
                           "trial and baseline was refused; raise plan.tune.share or enable plan.allocate")
    kept = _predictor_set(tuned, plan, score, objective_values) if draft.profile is not None else None
    tuned = dataclasses.replace(tuned, chosen=chosen, objective={k: _finite(v) for k, v in objective_values.items()},
                                trials=[[t.number, t.params, _finite(t.value)] for t in finished], predictors=kept)
    if allocation is None:
        return tuned

    final = tuned.apply(plan)
    return dataclasses.replace(tuned, points=[
        {"budget_bytes": p["budget_bytes"], "share": p["share"], "tuned": score_plan(draft, final, p["budget_bytes"], sequences)}
        for p in allocation.points])


def _predictor_set(tuned: TunedPolicy, plan: Plan, score, objective_values: dict) -> list | None:
    """The subset of the plan's predictors (in plan order) whose plan, with the tuned policy, scores best; on a
    tie the smaller set. Each subset's score is recorded as ``objective["predictors: a+b"]``."""
    from itertools import combinations

    names = [p.name for p in plan.predictors]
    if not names:
        return None
    best, best_value = None, math.inf
    for size in range(len(names) + 1):
        for subset in combinations(names, size):
            value = score(dataclasses.replace(tuned, predictors=list(subset)).apply(plan))
            objective_values[f"predictors: {'+'.join(subset) or 'none'}"] = value
            if value < best_value:
                best, best_value = list(subset), value
    return best if best is not None else names


def _run(inputs) -> TunedPolicy:

    cfg = inputs.config
    found = inputs.upstream("allocate_cache", optional=True)
    allocation = found[1] if found is not None else None
    # a storage shared by runs of several recipes holds one study per stage key
    name = STUDY if cfg.tune.storage is None else f"{STUDY}-{inputs.key[:16]}"
    return tune(draft_from_inputs(inputs, cfg.device), cfg, inputs.work, allocation, study_name=name)


STAGE = Stage(
    name="tune_policy", version=VERSION, config=PlanSection, result=TunedPolicy,
    reads=("trace", "quantize", "bitwidth", "predict", "gating", "dynamic_precision", "cache_routing", "allocate_cache"),
    needs=frozenset({"model"}), files=lambda recipe: [recipe.plan.device] if recipe.plan.device else [],
    enabled=lambda recipe: recipe.plan.tune.enabled, run=_run,
    section="plan",
)
