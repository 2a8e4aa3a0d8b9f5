"""The draft plan and its simulated cost: what ``allocate_cache``, ``tune_policy`` and ``package`` share.

``compose_plan`` is where the stages' outputs become a ``loader.plan.Plan``: the precisions, then each stage
result's own contribution (``StageResult.apply``: pools, miss and routing policies, predictors, and with the
planning stages the per-layer pool sizes, the eviction policy and the operating points). ``Draft`` is that plan before the artifact exists, with
everything the simulator needs to replay the calibration traces through the loader's own cache:
the budget arithmetic's sizes (from the model and the quantize stage), the replay and the predictors'
feed (routers from the model, tensors from the predict stage). ``Draft.cost`` is the objective both
planning stages minimise: modelled seconds per token with a device profile, else bytes read on demand
per token (each miss weighed by its precision's record size, HOBBIT's precision-weighted penalty).

The draft's slots are the loader's: the held form the loader will choose on the target device (the device
profile's ``compute_device``, else the CPU) for each store's record layout, sized by the loader's own functions
(``loader.budget.layout_forms``), so the planner and the loader give one budget the same capacities.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from loader.budget import (
    Capacities,
    ModelSizes,
    buffer_bytes,
    capacities,
    layout_forms,
    prefill_form_bytes,
    record_slot_bytes,
    shape_for,
)
from loader.codec import RecordLayout
from loader.device import load_profile
from loader.plan import Plan
from loader.predict import make_predictor
from loader.prefill import PrefillForm, PrefillSpec, parse_prefill
from loader.vocab import FORM_NAMES, PRECISIONS
from prep.adapters.model_state import dense_state, expert_parameters
from prep.errors import MoeprepError
from prep.sim.replay import load_replay
from prep.sim.simulate import capacities_spec, simulate, trace_feed
from prep.stages.bitwidth import uniform_choice
from prep.stages.predict import predictor_tensors
from prep.stages.trace import RoutingTraces

ALLOCATION_COSTS = ("measured", "closed_form")
REPORT_PROMPT = 512  # tokens of the prompt whose prefill the operating points model


@dataclass(frozen=True)
class AllocateKnobs:
    """AdapMoE's DP over the cache cells (a per-layer pool's layer, or a global pool): ``measured`` cost
    curves from the simulator, or the paper's ``closed_form`` (uniform routing, one prefetch per layer)."""

    enabled: bool = False
    cost: str = "measured"


@dataclass(frozen=True)
class TuneKnobs:
    """HOBBIT's cache weights (w_lru, w_lfu, w_lhu, w_fld on the simplex), the pools' eviction group, the
    prefetch depth, searched by Optuna over the simulator for ``trials`` trials (trial 0: HOBBIT's equal weights) at the budget holding
    ``share`` of the shipped experts.

    ``storage``: where the Optuna study lives: None (a journal file in the stage's work directory), a journal
    file path on a filesystem every worker sees, or an RDB URL (``sqlite:///…``, ``postgresql://…``); a killed
    search resumes from it, and every process given the same storage and recipe adds its trials to one study
    until ``trials`` are complete. ``workers``: Optuna workers; more than 1 runs them as that many work units
    of the run's executor (``prep/stages/tune_policy.py``; without a storage they share a journal in the
    stage's work directory). With more than one worker (or process) the trial order depends on timing, so
    the result is no longer reproducible byte for byte; 1 (the default) is."""

    enabled: bool = False
    trials: int = 24
    seed: int = 0
    share: float = 0.5
    storage: str | None = None
    workers: int = 1


MAX_TRIALS = 100_000
MAX_TUNE_WORKERS = 256
# the database URLs Optuna's RDBStorage takes (SQLAlchemy dialects, each with an optional +driver)
STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")


def check_storage_spec(spec) -> None:
    """``plan.tune.storage`` names a place Optuna can open, checked before any work: an RDB URL of a known scheme,
    or a journal file whose directory exists and is writable (``tune_policy.open_storage`` opens it; the dry run
    opens and closes it too)."""
    import os

    fix = "give an RDB URL (sqlite:///study.db, postgresql://…) or a journal file path, or leave it out"
    if not isinstance(spec, str) or not spec.strip():
        raise MoeprepError(f"plan.tune.storage {spec!r} is empty; {fix}")
    if "://" in spec:
        scheme = spec.split("://", 1)[0].split("+", 1)[0].lower()
        if scheme not in STORAGE_SCHEMES:
            raise MoeprepError(f"plan.tune.storage {spec!r}: unknown database scheme {scheme!r}; use one of "
                               f"{', '.join(STORAGE_SCHEMES)} (or a journal file path)")
        return
    path = Path(spec)
    if path.is_dir():
        raise MoeprepError(f"plan.tune.storage {spec!r} is a directory; name a journal file in it ({path / 'study.journal'})")
    if not path.parent.is_dir():
        raise MoeprepError(f"plan.tune.storage {spec!r}: directory {path.parent} does not exist; create it (on a "
                           "filesystem every worker sees) or leave storage out for a journal in the stage's work directory")
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise MoeprepError(f"plan.tune.storage {spec!r}: {path if path.exists() else path.parent} is not writable; "
                           f"{fix}")


@dataclass(frozen=True)
class PlanSection:
    """Planning for a device: the stages ``tune_policy`` and ``allocate_cache``. ``device``: a device profile
    (``moeprep profile-device``) for modelled seconds (None: costs are bytes read on demand); ``points``:
    the operating points, each a budget holding that share of the shipped experts' bytes; ``tolerance``:
    the accuracy (points of score, per suite) an operating point may lose against the source model;
    ``num_sequences``: the calibration sequences replayed (None: all)."""

    device: str | None = None
    points: tuple[float, ...] = (0.25, 0.5, 0.75)
    tolerance: float | None = None
    num_sequences: int | None = None
    allocate: AllocateKnobs = field(default_factory=AllocateKnobs)
    tune: TuneKnobs = field(default_factory=TuneKnobs)

    def __post_init__(self) -> None:
        if self.allocate.cost not in ALLOCATION_COSTS:
            raise MoeprepError(f"plan.allocate.cost {self.allocate.cost!r} unknown; use one of {ALLOCATION_COSTS}")
        if not self.points or any(not 0 < x <= 1 for x in self.points) or len(set(self.points)) != len(self.points):
            raise MoeprepError(f"plan.points are distinct shares of the shipped expert bytes in (0, 1], got "
                               f"{list(self.points)}")
        if not 0 < self.tune.share <= 1:
            raise MoeprepError(f"plan.tune.share is a share of the shipped expert bytes in (0, 1], got {self.tune.share}")
        if self.tune.trials < 1:
            raise MoeprepError(f"plan.tune.trials must be at least 1 (trial 0 is HOBBIT's equal weights), got "
                               f"{self.tune.trials}")
        if not 1 <= self.tune.trials <= MAX_TRIALS:
            raise MoeprepError(f"plan.tune.trials must be at most {MAX_TRIALS:,}, got {self.tune.trials}")
        if not 1 <= self.tune.workers <= MAX_TUNE_WORKERS:
            raise MoeprepError(f"plan.tune.workers must be from 1 to {MAX_TUNE_WORKERS} (each is a process of the "
                               f"executor holding a replay), got {self.tune.workers}")
        if self.tune.storage is not None:
            check_storage_spec(self.tune.storage)
        if self.tolerance is not None and self.tolerance < 0:
            raise MoeprepError(f"plan.tolerance is points of accuracy a plan may lose, >= 0 (or null); got "
                               f"{self.tolerance}")
        if self.num_sequences is not None and self.num_sequences < 1:
            raise MoeprepError("plan.num_sequences must be positive (or null for all)")


@dataclass(frozen=True)
class PlanContext:
    """What a stage's plan contribution may use besides its own result."""

    sizes: ModelSizes | None = None  # the budget arithmetic's sizes (the allocation solves the default budget)
    routing_weights: str | None = None  # the router's weight function (cache-conditional routing re-weighs)


def compose_plan(grid, record_bytes: dict, default_budget: str, results, context: PlanContext) -> Plan:
    """The plan of the stages' outputs: precisions ``grid`` ([L][E] precision names) with ``record_bytes`` per
    planned precision, then each result's contribution (``StageResult.apply``) in the stage table's order."""
    plan = Plan.mixed(grid, record_bytes, default_budget=default_budget)
    for result in results:
        plan = result.apply(plan, context)
    return plan


@dataclass
class Draft:
    """A plan before the artifact exists, with what the simulator needs to replay it."""

    plan: Plan
    sizes: ModelSizes  # record_bytes here are slot bytes, as the loader's budget arithmetic counts them
    read_bytes: dict  # precision -> bytes a read fetches
    replay: object  # prep.sim.replay.Replay of the calibration traces
    feed: object | None  # prep.sim.simulate.PredictionFeed (None: no predictor in the plan)
    profile: object | None  # loader.device.DeviceProfile scaled to this model's experts, or None
    shipped_expert_bytes: int  # the slot bytes of every expert at its planned precision
    prefill: dict | None = None  # the plan's prefill values chosen on the device profile (``prefill_choice``)

    @property
    def unit(self) -> str:
        return "seconds per token" if self.profile is not None else "demand bytes per token"

    def capacities(self, plan: Plan, budget) -> Capacities:
        return capacities(plan, budget, self.sizes)

    def budget_for_share(self, share: float) -> int:
        """The budget in bytes whose expert part holds ``share`` of the shipped experts' slots."""
        return int(self.sizes.dense_bytes + buffer_bytes(self.plan, self.sizes) + share * self.shipped_expert_bytes)

    def modeled_prefill(self, plan: Plan, caps: Capacities, tokens: int = REPORT_PROMPT):
        """The modelled prefill (``prep.sim.prefill``) of a ``tokens``-token prompt of the calibration traces in the
        budget's chunks, with the plan's prefill forms (None without a profile)."""
        if self.profile is None:
            return None
        from prep.sim.prefill import plan_prefill

        spec = capacities_spec(plan, caps, self.read_bytes, self.sizes.record_bytes)
        return plan_prefill(self.replay, plan, spec, self.profile, tokens, caps.prefill_chunk or plan.prefill.chunk)

    def simulate(self, plan: Plan, caps: Capacities, sequences: slice | None = None):
        """Replay (a slice of) the calibration traces through the cache ``plan`` builds with ``caps``."""

        replay, feed = self.replay, self.feed
        if sequences is not None:
            replay = dataclasses.replace(replay, sequences=replay.sequences[sequences],
                                         weights=replay.weights[sequences] if replay.weights is not None else None,
                                         logits=replay.logits[sequences] if replay.logits is not None else None)
            if feed is not None:
                feed = dataclasses.replace(feed, router_inputs=feed.router_inputs[sequences]
                                           if feed.router_inputs is not None else None,
                                           head_inputs=feed.head_inputs[sequences] if feed.head_inputs is not None else None)
        spec = capacities_spec(plan, caps, self.read_bytes, self.sizes.record_bytes)
        predictors = [make_predictor(p.name, p.params) for p in plan.predictors]
        return simulate(replay, spec, profile=self.profile, predictors=predictors, feed=feed if predictors else None)

    def cost(self, result) -> float:
        """The objective of one simulation: modelled seconds per token, else demand bytes per token."""
        if self.profile is not None:
            return result.seconds / result.tokens
        return sum(layer.demand_bytes for layer in result.layers) / result.tokens

    def layer_costs(self, result) -> list[float]:
        """The objective per MoE layer (per token)."""
        if self.profile is not None:
            return [(r.read_seconds + r.compute_seconds) / result.tokens for r in result.layers]
        return [r.demand_bytes / result.tokens for r in result.layers]


def model_sizes(model, adapter, read_bytes: dict, layouts: dict | None = None, device: str = "cpu",
                expert_dtype: str = "auto", plan: Plan | None = None) -> ModelSizes:
    """The budget arithmetic's sizes before the artifact exists: the dense tensors' bytes, the source experts'
    bytes, and per store precision the slot a cached expert takes. With ``layouts`` (precision -> the store's
    ``RecordLayout``): the loader's sizes on ``device`` (``loader.budget.layout_forms``: the held form it will
    choose, with the plan's low copies fitted to its slots; the read and staging buffers; the prefill forms' buffers
    and the model's activation shape, a prompt chunk's activations counting too); without, each ``read_bytes`` record in the record
    form (its O_DIRECT stride)."""

    params, experts = expert_parameters(model, adapter)
    dense = sum(t.numel() * t.element_size() for t in dense_state(model, params).values())
    source = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    shape = (len(adapter.moe_layers), adapter.num_experts, adapter.top_k, dense, source)
    if layouts is None:
        return ModelSizes(*shape, {p: record_slot_bytes(b) for p, b in read_bytes.items()})
    forms, slots, staging = layout_forms(layouts, plan, device, expert_dtype)
    activations = shape_for(model.config.to_dict(), next(iter(layouts.values())), adapter.top_k, model.dtype.itemsize)
    form_buffers = prefill_form_bytes(plan or Plan.default(shape[0], shape[1], next(iter(layouts))), layouts, forms,
                                      adapter.top_k, device)
    return ModelSizes(*shape, slots, dict(slots), staging, form_buffers, activations)


def shipped_layout(layout: RecordLayout, target: str) -> RecordLayout:
    """The layout a store of ``layout`` ships in for a ``target`` of ``package.targets``: the codec's own, which the
    compiled kernels (``loader/kernels``) read in place on any CPU, except for ``cpu-int4pack``: int4 in torch's
    int4pack layout, which only torch builds that pack int4 as the AVX-512 kernel does read in place."""
    kernel = layout.in_kernel_layout("int4pack") if target == "cpu-int4pack" else None
    return kernel if kernel is not None else layout


def target_device(profile) -> str:
    """The device the plan is for: the device profile's compute device (``moeprep profile-device``), else the CPU."""
    device = str(profile.extra.get("compute_device", "cpu")) if profile is not None else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def draft_from_inputs(inputs, profile_path: str | None) -> Draft:
    """The draft of a planning stage's inputs: the precisions of bitwidth (else quantize's uniform one) and the
    contributions of every stage it reads (``StageInputs.contributions``) and the trace; it needs the model."""


    model, adapter = inputs.model, inputs.adapter
    _, quantize = inputs.upstream("quantize")
    chosen = inputs.upstream("bitwidth", optional=True)
    choice = chosen[1] if chosen is not None else uniform_choice(quantize)
    predict = inputs.upstream("predict", optional=True)
    planned = [p for p in quantize.stores if choice.counts.get(p)]
    profile = load_profile(Path(inputs.root) / profile_path) if profile_path is not None else None
    dynamic = inputs.upstream("dynamic_precision", optional=True)
    low = dynamic[1].knobs["low"] if dynamic is not None else None
    device = target_device(profile)
    # the stores the artifact ships (package: the planned precisions and the low copies), as the loader sizes them:
    # the codec's own layout for either device (a ``cpu-int4pack`` target's int4 records are 6% larger)
    layouts = {p: shipped_layout(quantize.layout(p), device) for p in quantize.stores if p in planned or p == low}
    read_bytes = {p: s["record_bytes"] for p, s in quantize.stores.items()} | {p: layout.nbytes for p, layout in layouts.items()}
    sizes = model_sizes(model, adapter, read_bytes, layouts, device)
    plan = compose_plan(choice.expert_precision, {p: read_bytes[p] for p in planned}, "50%", inputs.contributions(),
                        PlanContext(sizes, adapter.routing_weights()))
    sizes = model_sizes(model, adapter, read_bytes, layouts, device, plan=plan)  # the low copies fitted to slots
    shipped = sum(sizes.record_bytes[p] for row in plan.expert_precision for p in row)

    trace_dir, _ = inputs.upstream("trace")
    path = RoutingTraces.path(trace_dir)
    replay = load_replay(path)
    feed = None
    if plan.predictors:
        routers = []
        for router_path in adapter.module_paths(model)["router_modules"]:
            router = model.get_submodule(router_path)
            bias = getattr(router, "bias", None)
            routers.append((router.weight.detach().float(), bias.detach().float() if bias is not None else None))
        feed = trace_feed(path, routers, predictor_tensors(predict[0], [p.name for p in plan.predictors]))
    prefill = None
    if profile is not None:
        itemsize = next(model.parameters()).element_size()
        weights = sizes.source_expert_bytes / itemsize / (sizes.num_layers * sizes.num_experts)
        profile = profile.scaled_to(weights)
        held, _, _ = layout_forms(layouts, plan, device)
        forms = prefill_choice(profile, {p: f.name for p, f in held.items() if f.staged})
        chunk = prefill_chunk(profile, {p: f.name for p, f in held.items() if p in planned},
                              {p: read_bytes[p] for p in planned}, adapter.top_k, adapter.num_experts)
        prefill = dataclasses.replace(forms, chunk=chunk).to_json()
    return Draft(plan, sizes, read_bytes, replay, feed, profile, shipped, prefill)


def with_prefill(plan: Plan, chosen: dict | None) -> PrefillSpec:
    """The plan's prefill values with a stage's choice (``Draft.prefill``; None: the plan's own)."""
    if chosen is None:
        return plan.prefill
    return parse_prefill(chosen, lambda what: MoeprepError(f"a stage's prefill choice: {what}; run the stage again"),
                         PRECISIONS, FORM_NAMES)


CHUNK_CHOICES = (16, 32, 64, 128, 256, 512, 1024, 2048)  # the prefill chunks the planner considers


def prefill_chunk(profile, held: dict, read_bytes: dict, top_k: int, num_experts: int) -> int:
    """The plan's prefill chunk: the smallest of ``CHUNK_CHOICES`` at which an expert's compute for its share of the
    chunk (chunk x K / E tokens, in its held form: ``prep.sim.prefill.expert_seconds``) takes at least its record's
    read, for every planned precision: there a layer step stops waiting for the disk, so a larger chunk would only
    take more memory. The largest choice where none does (the budget cuts it to what it can hold)."""
    from prep.sim.prefill import expert_seconds

    for chunk in CHUNK_CHOICES:
        tokens = max(1, chunk * top_k // num_experts)
        if all(expert_seconds(profile, p, form, tokens) >= profile.read_seconds(read_bytes[p]) for p, form in held.items()):
            return chunk
    return CHUNK_CHOICES[-1]


def prefill_choice(profile, held: dict) -> PrefillSpec:
    """The plan's prefill values from the device profile (``measure_prefill``): per precision whose held form
    (``held``: precision -> form name, forms made on a reader thread) the profile timed, the other form that costs
    least (made once from the record plus its product) from the smallest timed token count at which it, and at
    every larger count, costs less than the held form; none where no form wins. The chunk and context stay the
    defaults (the budget sizes the chunk)."""
    chosen = []
    for precision, held_name in sorted(held.items()):
        timed = profile.prefill_seconds.get(precision, {})
        if held_name not in timed:
            continue
        base = timed[held_name]
        best = None
        for name, other in sorted(timed.items()):
            if name == held_name:
                continue
            counts = sorted(int(t) for t in other["tokens"] if t in base["tokens"])
            start = None
            for t in reversed(counts):  # the smallest count from which the form wins at every larger one
                if other["make_s"] + other["tokens"][str(t)] < base["make_s"] + base["tokens"][str(t)]:
                    start = t
                else:
                    break
            if start is not None and (best is None or start < best.from_tokens):
                best = PrefillForm(name, start)
        if best is not None:
            chosen.append((precision, best))
    return PrefillSpec(forms=tuple(chosen))
