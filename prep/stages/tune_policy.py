"""Stage ``tune_policy``: HOBBIT's cache weights, tuned for this model by Optuna over the simulator (H3).

HOBBIT evicts the expert of lowest ``w_lru R/T + w_lfu F/T + w_lhu H/T + w_fld (1 - d/L)`` and chooses the
weights "by minimising the mixed-precision miss penalty on a calibration dataset" without publishing
them. This stage does that search: each trial replays the calibration traces through the loader's own
cache (``prep.stages.planning.Draft``) at the budget holding ``plan.tune.share`` of the shipped experts, and
scores the plan's cost (modelled seconds per token with a device profile, else demand bytes per token,
so a high-precision miss weighs its record's size). The search covers the weights (four exponentials
normalised: uniform on the simplex), the pools' eviction group (per layer, or global as HOBBIT's) and the
prefetch depth when next-layer gates are on (dynamic precision's low copies have no pool, so no share to
search: they take main-pool slots). Trial 0 is HOBBIT's equal weights with the plan's own settings.

Then, with a device profile, the predictor set: every subset of the plan's predictors is scored with the
chosen policy, and the plan keeps the cheapest (on a tie, the fewer): a predictor enters the plan only where
the simulator predicts it saves time on the device (a calibrated profile charges the reads of wasted
prefetches where the disk is the bottleneck). Without a profile the objective is demand bytes, which a
prefetch always lowers without saying whether it saves time, so the recipe's set is kept.

The study lives in a journal file in the stage's work directory (``study.journal``), or in the storage
``plan.tune.storage`` names (a journal file on a shared filesystem, or an RDB URL), so a killed run resumes
with its finished trials, and several processes given the same storage share one study until ``trials``
trials are complete. The sampler is seeded. With ``plan.tune.workers`` 1 (the default) the search runs in the
driver and is reproducible byte for byte. With more, the stage hands that many work units to the run's
executor (``worker-<i>``, ``prep/executor.py``): each rebuilds the draft from files the driver writes in the
work directory (``draft.json``: the plan, sizes, trace path and device profile; ``draft.safetensors``: the
routers and predictor tensors the simulator's prefetch feed reads), opens the storage, adds trials until the
study holds ``trials`` complete ones, and writes ``worker-<i>.json`` (its trial numbers). A unit the executor
retries (its worker lost) continues the same study; a rerun reuses finished units. The driver then reads
the study and chooses as with one worker. Which worker runs which trial, and what TPE proposes next,
depends on timing, so the result is no longer reproducible (the local executor runs the units one after
another: worker-0 runs every trial with the recipe's seed, the others find the study complete). LRU,
LFU and EdgeMoE's policy are scored at the same budget; the plan takes whichever of them and the trials
scores best, so the tuned plan is never worse than its default. It runs after ``allocate_cache`` on the
allocated plan (the pools of the operating point for the budget), and scores every operating point
again with the policy it chose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from loader.errors import MoeError
from loader.io import write_json_atomic
from loader.plan import Plan, PolicySpec
from prep.errors import MoeprepError
from prep.executor import Unit
from prep.stages import Stage, StageResult
from prep.stages.allocate_cache import score_plan
from prep.stages.operating_points import point_figures
from prep.stages.planning import AllocateKnobs, PlanSection, TuneKnobs, draft_from_inputs, with_prefill
from prep.stages.trace import RoutingTraces

VERSION = 7  # 7: prefill forms chosen on the device profile, the prefill reserve in the sizes; 3: the predictor set is searched; 4: no low pool share; 5: a CPU target reads kernel-layout int4; 6: the simulator gates prefetches as the loader does
STUDY = "tune_policy"
JOURNAL = "study.journal"
DRAFT, DRAFT_TENSORS = "draft.json", "draft.safetensors"  # what the worker units rebuild the draft from
WEIGHTS = ("w_lru", "w_lfu", "w_lhu", "w_fld")
BASELINES = ("lru", "lfu", "edgemoe")
DEPTH_MAX = 3


@dataclass(frozen=True)
class TunedPolicy(StageResult):
    """The eviction policy, group and prefetch depth the plan takes, and how they were found."""

    eviction: dict  # {"name", "params"}
    group: str | None  # the pools' eviction group (None: as composed)
    depth: int | None  # next_gates depth (None: no next-layer gates)
    chosen: str  # "trial N" or a baseline's name
    unit: str
    budget_bytes: int
    share: float
    objective: dict  # name -> value: each baseline, "default" (trial 0) and "best trial"
    trials: list  # [[number, params, value]] of finished trials
    points: list  # the allocation's operating points scored with the chosen policy (none without allocation)
    predictors: list | None = None  # the predictor names kept (None: the plan's, not searched)
    read_depth: int | None = None  # the device profile's best reads in flight (None: no profile, or one without)
    prefill: dict | None = None  # the prefill values chosen on the device profile (``planning.prefill_choice``)

    def apply(self, plan: Plan, context=None) -> Plan:
        """The tuned eviction policy (and group, next_gates depth, predictor subset) on ``plan``."""
        pools, points = plan.pools, plan.operating_points
        if self.group is not None:
            pools = tuple(dataclasses.replace(p, group=self.group) for p in pools)
            points = tuple(dataclasses.replace(pt, pools=tuple(dataclasses.replace(p, group=self.group) for p in pt.pools))
                           for pt in points)
        predictors = tuple(PolicySpec(p.name, p.params | {"depth": self.depth}) if p.name == "next_gates"
                           and self.depth is not None else p for p in plan.predictors
                           if self.predictors is None or p.name in self.predictors)
        return dataclasses.replace(plan, pools=pools, operating_points=points, predictors=predictors,
                                   eviction=PolicySpec(self.eviction["name"], dict(self.eviction["params"])),
                                   read_depth=self.read_depth or plan.read_depth,
                                   prefill=with_prefill(plan, self.prefill))

    def report(self, entries: dict) -> dict:
        """report.json's ``planning.tune_policy`` (the search, its trials counted) and the operating points' figures
        scored with the chosen policy."""
        rescored = {p["budget_bytes"]: p["tuned"] for p in self.points}
        points = [p | point_figures(rescored[p["budget_bytes"]]) if p["budget_bytes"] in rescored else p
                  for p in entries.get("operating_points") or []]
        summary = {k: v for k, v in self.to_json().items() if k != "trials"} | {"trials": len(self.trials)}
        return entries | {"planning": {"tune_policy": summary} | (entries.get("planning") or {}),
                          "operating_points": points}


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
        except Exception as e:  # noqa: BLE001 (SQLAlchemy's and the drivers' errors: a bad URL, a server that is down)
            raise MoeprepError(f"plan.tune.storage {spec!r} cannot be opened ({type(e).__name__}: {e}); fix the URL "
                               "or the database, or leave storage out for a journal in the stage's work directory") from None
    path = Path(work) / JOURNAL if spec is None else Path(spec)
    if not path.parent.is_dir():
        raise MoeprepError(f"plan.tune.storage {spec!r}: directory {path.parent} does not exist; create it (on a "
                           "filesystem every worker sees) or leave storage out for a journal in the stage's work directory")
    return JournalStorage(JournalFileBackend(str(path)))


def probe_storage(spec: str) -> None:
    """Open and close the database ``spec`` names, as the run will (``open_storage``); one error if it cannot."""
    storage = open_storage(spec, Path("."))
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


class Search:
    """The search over one draft: its space, its objective and trial 0. The driver and every worker unit build
    one from the same draft and settings, so a trial scores the same wherever it runs."""

    def __init__(self, draft, cfg: PlanSection) -> None:
        self.draft, self.plan, self.knobs = draft, draft.plan, cfg.tune
        self.sequences = slice(0, cfg.num_sequences) if cfg.num_sequences is not None else None
        self.budget = draft.budget_for_share(self.knobs.share)
        self.gates = next((p for p in self.plan.predictors if p.name == "next_gates"), None)
        self.max_depth = min(DEPTH_MAX, self.plan.num_layers - 1)

    def score(self, candidate: Plan) -> float:
        try:
            caps = self.draft.capacities(candidate, self.budget)
        except MoeError:  # e.g. per-layer pools of an unallocated mixed plan: a group below one record
            return math.inf
        return self.draft.cost(self.draft.simulate(candidate, caps, self.sequences))

    def settings(self, params: dict) -> TunedPolicy:
        return TunedPolicy(
            eviction={"name": "hobbit", "params": weights_of(params)}, group=params["group"],
            depth=params.get("depth") if self.gates is not None else None,
            chosen="", unit=self.draft.unit,
            budget_bytes=self.budget, share=self.knobs.share, objective={}, trials=[], points=[])

    def objective(self, trial) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")  # which process ran it
        params = {f"x_{w[2:]}": trial.suggest_float(f"x_{w[2:]}", 1e-6, 1.0) for w in WEIGHTS}
        params["group"] = trial.suggest_categorical("group", ["global", "layer"])
        if self.gates is not None and self.max_depth >= 1:
            params["depth"] = trial.suggest_int("depth", 1, self.max_depth)
        return self.score(self.settings(params).apply(self.plan))

    def first(self) -> dict:
        """Trial 0: HOBBIT's equal weights, global pools, the plan's own depth."""
        first = {f"x_{w[2:]}": math.exp(-1) for w in WEIGHTS} | {"group": "global"}
        if self.gates is not None and self.max_depth >= 1:
            first["depth"] = min(max(1, int(self.gates.params.get("depth", 1))), self.max_depth)
        return first


def open_study(spec: str | None, work: Path, study_name: str, seed: int):
    """The study ``study_name`` in storage ``spec`` (``open_storage``), created or loaded, with a TPE sampler
    seeded with ``seed``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name=study_name, storage=open_storage(spec, work), direction="minimize",
                               load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed))


def _complete(study) -> list:
    import optuna

    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def run_trials(study, objective, trials: int, n_jobs: int = 1, progress: bool = False) -> None:
    """Add trials to ``study`` until it holds ``trials`` complete ones, counting those of every process that shares
    its storage (Optuna's ``MaxTrialsCallback``): so a resumed or a second worker stops where the study is full."""
    import optuna
    from optuna.study import MaxTrialsCallback
    from tqdm import tqdm

    done = len(_complete(study))
    if done >= trials:
        return
    bar = tqdm(total=trials, initial=done, desc="tune_policy", unit="trial", disable=not progress, leave=False)

    def report(study_, _trial) -> None:
        bar.update(1)
        if any(t.state == optuna.trial.TrialState.COMPLETE for t in study_.trials):
            bar.set_postfix(best=f"{study_.best_value:.4g}")

    try:
        complete = (optuna.trial.TrialState.COMPLETE,)
        study.optimize(objective, n_trials=trials - done, n_jobs=n_jobs,
                       callbacks=[report, MaxTrialsCallback(trials, states=complete)])
    finally:
        bar.close()


def tune(draft, cfg: PlanSection, work: Path, allocation=None, progress: bool = True,
         study_name: str = STUDY, search=None) -> TunedPolicy:
    """Run (or resume, or join) the study ``study_name`` in ``plan.tune.storage`` (default: a journal in ``work``)
    and return the best plan settings it found; with ``allocation`` (the draft's plan carries it), its operating
    points are scored again with the chosen policy. ``search``: a function that fills the study elsewhere (the
    stage's worker units, ``search_worker``), called once the study exists with trial 0 enqueued; None: the
    trials run here, in ``plan.tune.workers`` threads."""
    plan, knobs = draft.plan, cfg.tune
    space = Search(draft, cfg)
    study = open_study(knobs.storage, work, study_name, knobs.seed)
    first = space.first()
    if not study.trials:
        study.enqueue_trial(first)
    if search is not None:
        search()
    else:
        run_trials(study, space.objective, knobs.trials, n_jobs=knobs.workers, progress=progress)
    finished = sorted(_complete(study), key=lambda t: t.number)
    if not finished:
        raise MoeprepError(f"the tune_policy study in {work} finished no trial; run prepare again")
    best = min(finished, key=lambda t: (t.value, t.number))
    trial0 = next((t for t in finished if t.number == 0), None)  # a run killed inside trial 0 leaves it unfinished
    score, budget = space.score, space.budget
    objective_values = {"default": trial0.value if trial0 is not None else score(space.settings(first).apply(plan)),
                        "best trial": best.value}
    for name in BASELINES:  # at the plan's own groups, depth and shares
        objective_values[name] = score(dataclasses.replace(plan, eviction=PolicySpec(name)))
    tuned = space.settings(best.params)
    chosen, value = f"trial {best.number}", best.value
    for name in BASELINES:  # a plain policy that beats every trial is the plan's choice
        if objective_values[name] < value:
            chosen, value = name, objective_values[name]
    if chosen in BASELINES:
        tuned = dataclasses.replace(tuned, eviction={"name": chosen, "params": {}}, group=None,
                                    depth=None)
    if not math.isfinite(value):
        raise MoeprepError(f"no policy fits the budget of {budget:,} bytes (plan.tune.share {knobs.share}): every "
                           "trial and baseline was refused; raise plan.tune.share or enable plan.allocate")
    kept = _predictor_set(tuned, plan, score, objective_values) if draft.profile is not None else None
    tuned = dataclasses.replace(tuned, chosen=chosen, objective={k: _finite(v) for k, v in objective_values.items()},
                                trials=[[t.number, t.params, _finite(t.value)] for t in finished], predictors=kept,
                                read_depth=draft.profile.read_depth if draft.profile is not None else None,
                                prefill=draft.prefill)
    if allocation is None:
        return tuned

    final = tuned.apply(plan)
    return dataclasses.replace(tuned, points=[
        {"budget_bytes": p["budget_bytes"], "share": p["share"],
         "tuned": score_plan(draft, final, p["budget_bytes"], space.sequences)}
        for p in allocation.points])


# ------------------------------------------------------------------------------------------- worker units


def save_draft(draft, trace: Path, work: Path) -> None:
    """Write what a worker unit rebuilds ``draft`` from (``load_draft``) into ``work``: ``draft.json`` (the plan,
    the sizes, the trace directory ``trace`` relative to ``work``, the scaled device profile) and
    ``draft.safetensors`` (the routers and predictor tensors of the prefetch feed). The replay and the router
    inputs are read from the trace again (they are the bulk, and already on the shared filesystem); the relative
    path holds in the stage directory too (both are in the stage cache), and names no machine's root."""
    from safetensors.torch import save_file

    raw = {"plan": draft.plan.to_json(), "sizes": dataclasses.asdict(draft.sizes), "read_bytes": draft.read_bytes,
           "shipped_expert_bytes": draft.shipped_expert_bytes, "prefill": draft.prefill,
           "trace": os.path.relpath(Path(trace).resolve(), Path(work).resolve()),
           "profile": draft.profile.to_json() if draft.profile is not None else None,
           "routers": len(draft.feed.routers) if draft.feed is not None else None}
    if Plan.from_json(raw["plan"]) != draft.plan:  # a worker would search another plan than the driver scores
        raise RuntimeError("the draft plan does not survive its JSON form; fix Plan.to_json/from_json")
    tensors = {}
    if draft.feed is not None:
        for i, (weight, bias) in enumerate(draft.feed.routers):
            tensors[f"routers.{i}.weight"] = weight.contiguous()
            if bias is not None:
                tensors[f"routers.{i}.bias"] = bias.contiguous()
        tensors |= {f"predictors.{name}": t.contiguous() for name, t in draft.feed.tensors.items()}
    tmp = Path(work) / f".{DRAFT_TENSORS}.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(Path(work) / DRAFT_TENSORS)
    write_json_atomic(Path(work) / DRAFT, raw, sort_keys=True)


def load_draft(work: Path):
    """The draft ``save_draft`` wrote into ``work``."""
    from safetensors.torch import load_file

    from loader.budget import ModelSizes
    from loader.device import DeviceProfile
    from prep.sim.replay import load_replay
    from prep.sim.simulate import trace_feed
    from prep.stages.planning import Draft

    raw = json.loads((Path(work) / DRAFT).read_text())
    trace = Path(work) / raw["trace"]
    feed = None
    if raw["routers"] is not None:
        tensors = load_file(str(Path(work) / DRAFT_TENSORS))
        routers = [(tensors[f"routers.{i}.weight"], tensors.get(f"routers.{i}.bias")) for i in range(raw["routers"])]
        feed = trace_feed(trace, routers, {name.removeprefix("predictors."): t for name, t in tensors.items()
                                                  if name.startswith("predictors.")})
    profile = DeviceProfile.from_json(raw["profile"]) if raw["profile"] is not None else None
    return Draft(Plan.from_json(raw["plan"]), ModelSizes(**raw["sizes"]), raw["read_bytes"],
                 load_replay(trace), feed, profile, raw["shipped_expert_bytes"], raw.get("prefill"))


def _plan_section(raw: dict) -> PlanSection:
    """The plan section back from ``dataclasses.asdict`` (a unit's args are plain values)."""
    return PlanSection(**raw | {"points": tuple(raw["points"]), "allocate": AllocateKnobs(**raw["allocate"]),
                                "tune": TuneKnobs(**raw["tune"])})


def search_worker(context, out: Path, *, index: int, work: str, storage: str | None, study: str, cfg: dict) -> None:
    """One unit: Optuna worker ``index``. Rebuilds the draft from ``work`` (``load_draft``), opens the study
    ``study`` in ``storage``, adds trials until it holds ``plan.tune.trials`` complete ones (a retried unit
    continues the same study), and writes ``{"unit", "trials"}`` to ``out``: the numbers of the complete trials
    this unit ran, over all its tries. Its sampler is seeded with ``plan.tune.seed + index``, so workers side by
    side do not propose the same trials."""
    section = _plan_section(cfg)
    name = f"worker-{index}"
    space = Search(load_draft(Path(work)), section)
    opened = open_study(storage, Path(work), study, section.tune.seed + index)

    def objective(trial) -> float:
        trial.set_user_attr("unit", name)
        return space.objective(trial)

    run_trials(opened, objective, section.tune.trials)
    write_json_atomic(out, {"unit": name, "trials": [t.number for t in _complete(opened)
                                                     if t.user_attrs.get("unit") == name]})


def worker_units(cfg: PlanSection, work: Path, study: str) -> list[Unit]:
    """``plan.tune.workers`` units (``worker-<i>``, writing ``worker-<i>.json``) sharing the study ``study`` in
    ``plan.tune.storage``, or in ``work``'s journal without one (the stage cache is on a filesystem every
    node sees)."""
    storage = cfg.tune.storage
    if storage is not None and "://" not in storage:
        storage = str(Path(storage).resolve())  # a Ray worker's directory is not the driver's
    args = {"work": str(Path(work).resolve()), "storage": storage, "study": study, "cfg": dataclasses.asdict(cfg)}
    return [Unit(name=f"worker-{i}", output=f"worker-{i}.json", fn=search_worker, args=args | {"index": i})
            for i in range(cfg.tune.workers)]


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
    draft = draft_from_inputs(inputs, cfg.device)
    search = None
    if cfg.tune.workers > 1:  # the trials run in the executor's units; one worker runs them here
        trace_dir, _ = inputs.upstream("trace")

        def search() -> None:
            save_draft(draft, RoutingTraces.path(trace_dir), inputs.work)
            inputs.map_units(worker_units(cfg, inputs.work, name), desc="tune_policy workers")

    return tune(draft, cfg, inputs.work, allocation, study_name=name, search=search)


STAGE = Stage(
    name="tune_policy", version=VERSION, config=PlanSection, result=TunedPolicy,
    reads=("trace", "quantize", "bitwidth", "predict", "gating", "dynamic_precision", "cache_routing", "allocate_cache"),
    needs=frozenset({"model"}), files=lambda recipe: [recipe.plan.device] if recipe.plan.device else [],
    enabled=lambda recipe: recipe.plan.tune.enabled, run=_run,
    # one unit per Optuna worker; with one worker (0 units, as sensitivity's prerank) the search runs in the driver
    units=lambda recipe, num_layers: recipe.plan.tune.workers if recipe.plan.tune.workers > 1 else 0,
    section="plan",
)
