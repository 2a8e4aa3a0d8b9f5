"""Every size of the loader: slots, held forms, read and staging buffers, capacities, minimum and explicit
budgets. ``capacities()`` is the only place where a memory budget becomes byte capacities per pool and
layer: the loader, the bench, the planner (``prep/stages/planning.py``) and the simulator all call it, so they can
never disagree about what a budget buys.

Budget semantics (``resolve_budget``): bytes, a size string ("1.5GiB"), a percentage ("25%": the dense
weights plus that share of the *source* model's expert bytes in its original dtype, so one percentage is
one number of bytes for a lossless and a 4-bit artifact of one model), ``"unlimited"`` (every expert of
every pool fits), or None (the plan's ``default_budget``).

What is held for an artifact (``artifact_sizes``): a cache slot holds one held form (``loader/forms.py``),
sized by the form alone (``form_slot_bytes``: the one formula, which the planner calls too, through
``layout_forms``, before the artifact exists); a read buffer (a miss the cache cannot admit, used once) holds
the same; each reader thread has one staging buffer a record lands in before its form is made (none when
every store holds its records as they are). Every one of those bytes counts against the budget.

Dynamic precision's low copies have no pool: a low copy takes a slot of the main pool
(``loader.cache.host_pool``), in its own form where that fits the slot, else in its record form
(``lodged_forms``), else it is read into a read buffer and used once. So a plan with dynamic precision needs
what the same plan without it needs (``minimum_bytes``: one record per eviction group of each pool).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loader.cache import host_pool
from loader.codec import RecordLayout
from loader.errors import BudgetError, LoaderError
from loader.format import CONFIG, ArtifactError, read_json, read_manifest
from loader.forms import HeldForm, choose_form
from loader.plan import PLAN_FILE, Plan, PlanError, Pool, parse_budget, read_plan
from loader.prefill import RESERVE_SHARE, ActivationShape, activation_shape, prefill_reserve, smallest_reserve
from loader.store import ExpertStore

DIRECT_ALIGN = 4096  # O_DIRECT reads whole aligned blocks: a slot a record is read into is that long
ALIGN = 64


@dataclass(frozen=True)
class ModelSizes:
    """What the budget arithmetic needs to know about an artifact: the sizes of what is held."""

    num_layers: int
    num_experts: int
    top_k: int
    dense_bytes: int
    source_expert_bytes: int  # every expert of the source model in its original dtype
    record_bytes: dict  # precision -> bytes one cached expert of that precision takes (its slot)
    read_bytes: dict | None = None  # precision -> bytes a read buffer takes (None: a slot's)
    staging_bytes: int = 0  # the reader threads' staging buffers (a read lands there when a form is made)
    prefill_form_bytes: int = 0  # the prefill forms' read buffers (``prefill_form_bytes``)
    activation: ActivationShape | None = None  # the model's, for a prefill chunk's activations (None: not counted)

    def __post_init__(self) -> None:
        if isinstance(self.activation, dict):  # from JSON (a stage's saved draft)
            object.__setattr__(self, "activation", ActivationShape(**self.activation))


@dataclass(frozen=True)
class Capacities:
    """Byte capacities: ``pools[name]`` maps each eviction group ("layer index" or "global") to bytes."""

    limit_bytes: float  # the whole budget (math.inf when unlimited)
    dense_bytes: int
    buffer_bytes: int  # read buffers: records being read or used outside a cache
    pools: dict  # pool name -> {group key: bytes}; group key is the layer position or "global"
    prefill_bytes: int = 0  # one prompt chunk's activations (``loader/prefill.py``)
    prefill_chunk: int = 0  # the largest prompt chunk those fit (0: not counted)

    def to_json(self) -> dict:
        return {"limit_bytes": None if math.isinf(self.limit_bytes) else int(self.limit_bytes),
                "dense_bytes": self.dense_bytes, "buffer_bytes": self.buffer_bytes,
                "prefill_bytes": self.prefill_bytes, "prefill_chunk": self.prefill_chunk,
                "pools": {name: {str(g): b for g, b in groups.items()} for name, groups in self.pools.items()}}


def resolve_budget(budget, plan: Plan, sizes: ModelSizes) -> float:
    """The budget in bytes (math.inf for unlimited); None means the plan's default budget."""
    parsed = parse_budget(budget if budget is not None else plan.default_budget)
    kind, value = parsed
    if kind == "fraction":
        return sizes.dense_bytes + value * sizes.source_expert_bytes
    return value


def buffer_bytes(plan: Plan, sizes: ModelSizes) -> int:
    """Read buffers (K experts of the largest precision the plan reads, low copies included, can be in flight
    or in use outside a cache) plus the reader threads' staging buffers plus the prefill forms' read buffers
    (``loader/prefill.py``)."""
    read = sizes.read_bytes or sizes.record_bytes
    return sizes.top_k * max(read[p] for p in plan.precisions) + sizes.staging_bytes + sizes.prefill_form_bytes


def prefill_floor(plan: Plan, sizes: ModelSizes) -> int:
    """The least a budget keeps for prefill activations: one token per chunk (0 where they are not counted)."""
    return smallest_reserve(sizes.activation, plan.prefill) if sizes.activation is not None else 0


def pool_need(plan: Plan, sizes: ModelSizes) -> float:
    """The bytes the pools need so that every eviction group given bytes holds one record."""
    best = 0.0
    for pool in plan.pools:
        if pool.share == 0:
            continue
        weights = layer_weights(plan, pool) if pool.group == "layer" else [1.0]
        # the smallest group given bytes must hold one record: bytes * share * (w_min / sum w) >= record
        smallest = min(w for w in weights if w > 0)
        best = max(best, sizes.record_bytes[pool.precision] * sum(weights) / smallest / pool.share)
    return best


def minimum_bytes(plan: Plan, sizes: ModelSizes) -> int:
    """The smallest budget in bytes that ``capacities`` accepts for this plan: every eviction group a pool
    gives bytes to holds at least one record, and a prompt runs one token per chunk."""
    return int(math.ceil(sizes.dense_bytes + buffer_bytes(plan, sizes) + prefill_floor(plan, sizes)
                         + pool_need(plan, sizes)))


def _flat(plan: Plan) -> Plan:
    """``plan`` with every per-layer pool split equally across layers (no allocation)."""
    return dataclasses.replace(plan, pools=tuple(dataclasses.replace(p, layers=None) for p in plan.pools),
                               layer_capacity=None)


def plan_for(plan: Plan, limit: float, sizes: ModelSizes) -> Plan:
    """The plan a budget of ``limit`` bytes runs: its operating point's pools (``Plan.for_budget``); where they do
    not fit (a budget below the smallest point, whose DP allocation gives some layers several records), the same
    pools split equally across layers, so an allocated plan runs wherever the plain one does."""
    chosen = plan.for_budget(limit)
    if not plan.operating_points or limit >= minimum_bytes(chosen, sizes):
        return chosen
    flat = _flat(chosen)
    return flat if limit >= minimum_bytes(flat, sizes) else chosen


def lowest_budget(plan: Plan, sizes: ModelSizes) -> int:
    """The smallest budget ``capacities`` accepts for ``plan``. A budget takes the pools of its operating point
    (``Plan.for_budget``: the largest point it covers, the smallest point below them all), so each point is a
    candidate from the budget that selects it, and the smallest candidate within its range wins. The loader's
    refusal and ``minimum_budget`` both say this one number."""
    points = sorted(plan.operating_points, key=lambda p: p.budget_bytes)
    if not points:
        return minimum_bytes(plan, sizes)
    bare = dataclasses.replace(plan, operating_points=())
    found = []
    for i, point in enumerate(points):
        lower = 0 if i == 0 else point.budget_bytes
        upper = points[i + 1].budget_bytes if i + 1 < len(points) else math.inf
        own = dataclasses.replace(bare, pools=point.pools)
        need = minimum_bytes(own, sizes) if i else min(minimum_bytes(own, sizes), minimum_bytes(_flat(own), sizes))
        need = max(need, lower)
        if need < upper:
            found.append(need)
    return min(found) if found else minimum_bytes(plan, sizes)


def layer_weights(plan: Plan, pool: Pool) -> list[float]:
    """A per-layer pool's relative split across layers: its own, else the plan's, else equal."""
    if pool.layers is not None:
        return list(pool.layers)
    return list(plan.layer_capacity) if plan.layer_capacity is not None else [1.0] * plan.num_layers


def capacities(plan: Plan, budget, sizes: ModelSizes) -> Capacities:
    """Byte capacities per pool and eviction group for ``budget`` (see ``resolve_budget``).

    The plan's operating point for the budget is taken first (``Plan.for_budget``). The expert share
    (budget - dense - read buffers) is split among pools by their ``share``; a per-layer pool splits its
    part across layers by its own ``layers`` weights, else the plan's relative ``layer_capacity`` (equal
    when both are absent), so an explicit budget scales the plan's allocation rather than discarding it.
    No group holds more than all of its experts. A budget below ``minimum_budget`` is refused.
    """
    if plan.num_layers != sizes.num_layers or plan.num_experts != sizes.num_experts:
        raise PlanError(f"{PLAN_FILE} is for {plan.num_layers} layers x {plan.num_experts} experts, the model has "
                        f"{sizes.num_layers} x {sizes.num_experts}; prepare the artifact again")
    for p in plan.precisions:
        if p not in sizes.record_bytes:
            raise PlanError(f"{PLAN_FILE} uses precision {p!r} but the artifact has no store for it "
                            f"(stores: {sorted(sizes.record_bytes)}); prepare the artifact again")
    limit = resolve_budget(budget, plan, sizes)
    whole = plan
    plan = plan_for(plan, limit, sizes)
    buffers = buffer_bytes(plan, sizes)
    if limit < minimum_bytes(plan, sizes):
        lowest = lowest_budget(whole, sizes)
        what, fix = (f"memory budget {budget!r}", "raise the budget") if budget is not None else (
            f"{PLAN_FILE}: the plan's default_budget {plan.default_budget!r}",
            f"pass a memory budget of at least {lowest:,} bytes, or prepare the artifact again")
        raise PlanError(
            f"{what} ({int(limit):,} bytes) is below the minimum of {lowest:,} bytes (dense weights "
            f"{sizes.dense_bytes:,} + read buffers {buffers:,} + prefill activations of one token "
            f"{prefill_floor(plan, sizes):,} + one expert per eviction group); {fix}")
    room = limit - sizes.dense_bytes - buffers
    chunk, reserve = 0, 0
    if sizes.activation is not None:  # prefill's share: what the pools can spare, up to RESERVE_SHARE of the room
        chunk, reserve = prefill_reserve(sizes.activation, plan.prefill,
                                         min(RESERVE_SHARE * room, room - pool_need(plan, sizes)))
    share = room - reserve
    pools: dict = {}
    for pool in plan.pools:
        record = sizes.record_bytes[pool.precision]
        part = share * pool.share
        unlimited = math.isinf(limit)  # every group holds all its experts, whatever the shares and splits say
        if pool.group == "global":
            full = sizes.num_layers * sizes.num_experts * record
            pools[pool.name] = {"global": full if unlimited else int(min(full, part))}
        else:
            weights = layer_weights(plan, pool)
            total = sum(weights)
            full = sizes.num_experts * record
            pools[pool.name] = {layer: full if unlimited else int(min(full, part * w / total))
                                for layer, w in enumerate(weights)}
    return Capacities(limit, sizes.dense_bytes, buffers, pools, reserve, chunk)


# ------------------------------------------------------------------------------------------ artifacts


def record_slot_bytes(record_bytes: int, direct_io: bool = True) -> int:
    """Memory one record read takes: its 4 KiB-aligned stride when reads are O_DIRECT (which reads whole
    aligned blocks), else the record rounded up to 64 bytes."""
    align = DIRECT_ALIGN if direct_io else ALIGN
    return -(-record_bytes // align) * align


def form_slot_bytes(record_bytes: int, form: HeldForm, direct_io: bool = True) -> int:
    """Memory one cached expert takes in ``form`` (records of ``record_bytes``): the record's read slot for the
    record form, else the form alone (64-byte aligned). The one formula of a slot: the loader's (``held_bytes``,
    from an open store) and the planner's (``held_sizes``, before the artifact exists)."""
    if not form.staged:
        return record_slot_bytes(record_bytes, direct_io)
    return -(-form.nbytes // ALIGN) * ALIGN


def held_bytes(store, form: HeldForm) -> int:
    """Memory one cached expert of the open ``store`` takes in ``form`` (``form_slot_bytes``)."""
    return form_slot_bytes(store.record_bytes, form, store.direct_io)


def held_sizes(record_bytes: dict, forms: dict, workers: int, direct_io: dict | None = None) -> tuple[dict, int]:
    """Per store precision the slot one cached expert takes in its form (``form_slot_bytes``), and the reader
    threads' staging bytes: one buffer per thread, as long as the longest read (its 4 KiB stride) of a store
    whose form is made. ``direct_io``: per precision whether its reads are O_DIRECT (None: all, as on disk)."""
    direct = direct_io or {}
    slots = {p: form_slot_bytes(b, forms[p], direct.get(p, True)) for p, b in record_bytes.items()}
    staging = max(1, workers) * max((record_slot_bytes(b) for p, b in record_bytes.items() if forms[p].staged),
                                    default=0)
    return slots, staging


def staging_bytes(stores: dict, forms: dict, workers: int) -> int:
    """One staging buffer per reader thread, as long as the longest read of a store whose form is made."""
    return held_sizes({p: s.record_bytes for p, s in stores.items()}, forms, workers)[1]


def lodged_forms(plan: Plan, forms: dict, record_forms: dict, record_bytes: dict, direct_io: dict | None = None,
                 workers: int = 2) -> dict:
    """``forms`` with each precision the plan reads but no pool holds (dynamic precision's low copies, lodged
    in a main-pool slot: ``loader.cache.host_pool``) in its record form where its own form would not fit any
    slot that may host it and the record does; where neither fits, its reads go to read buffers, used once."""
    pooled = {p.precision for p in plan.pools}
    lodged = [p for p in plan.precisions if p not in pooled and p in forms]
    if not lodged:
        return forms
    slots, _ = held_sizes(record_bytes, forms, workers, direct_io)
    pools = [(pool.name, pool.precision, slots.get(pool.precision, 0)) for pool in plan.pools]
    out = dict(forms)
    for p in lodged:
        if host_pool(pools, p, slots[p]) is None:
            own, _ = held_sizes({p: record_bytes[p]}, {p: record_forms[p]}, workers, direct_io)
            if host_pool(pools, p, own[p]) is not None:
                out[p] = record_forms[p]
    return out


def shape_for(config: dict, layout: RecordLayout, top_k: int, dtype_bytes: int) -> ActivationShape:
    """The activation shape of a model (``loader.prefill.activation_shape``): one expert's intermediate width from
    its record layout (a gated expert holds 3 x H x I weights)."""
    text = config.get("text_config") or config
    weights = sum(spec.numel for spec in layout.matrices)
    return activation_shape(config, max(1, weights // (3 * int(text["hidden_size"]))), top_k, dtype_bytes)


def artifact_shape(manifest) -> ActivationShape:
    """The activation shape of an artifact's model: its ``config.json``, first store's layout and MoE entry."""
    moe = manifest.moe
    config = read_json(manifest.path(CONFIG), CONFIG)
    layout = RecordLayout.from_json(next(iter(manifest.raw["stores"].values()))["layout"])
    try:
        return shape_for(config, layout, moe.top_k, torch.empty(0, dtype=getattr(torch, moe.dtype)).element_size())
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"{CONFIG} lacks what the prefill reserve needs ({e}); prepare the artifact again",
                            CONFIG) from None


def prefill_form_bytes(plan: Plan, layouts: dict, forms: dict, top_k: int, device) -> int:
    """The prefill forms' read buffers: K of the largest prefill form (``plan.prefill.forms``) of a store whose held
    form is made on a reader thread (the prefill form is made there too, from the same staged record)."""
    device = torch.device(device)
    sizes = [form_slot_bytes(layouts[p].nbytes, choose_form(f.form, layouts[p], device))
             for p, f in plan.prefill.forms if p in layouts and p in forms and forms[p].staged]
    return top_k * max(sizes, default=0)


@dataclass(frozen=True)
class Allocation:
    """The memory ``load`` allocates for a budget, by what holds it: per pool ``(slots, slot bytes)``, the read
    buffers, the reader threads' staging buffers and the prefill forms' buffers, each ``(count, bytes each)``; and
    the prefill forms themselves (precision -> (form, from tokens)). The engine allocates exactly these (``loader/
    step.py``); ``moeload plan`` prints them (``loader/fit.py``)."""

    pools: dict
    read_buffers: tuple[int, int]
    staging: tuple[int, int]
    prefill_buffers: tuple[int, int]
    prefill_forms: dict

    @property
    def bytes(self) -> int:
        return (sum(n * b for n, b in self.pools.values())
                + sum(n * b for n, b in (self.read_buffers, self.staging, self.prefill_buffers)))


def allocation(plan: Plan, layout, layouts: dict, top_k: int, workers: int, device) -> Allocation:
    """What a load with ``layout`` (a ``HeldLayout`` with capacities) allocates; ``layouts``: precision -> the store's
    ``RecordLayout``."""
    device = torch.device(device)
    slot = dict(layout.sizes.record_bytes)
    caps = layout.capacities
    pools = {pool.name: (sum(b // slot[pool.precision] for b in caps.pools[pool.name].values()), slot[pool.precision])
             for pool in plan.pools}
    staging = layout.sizes.staging_bytes
    forms = {p: (choose_form(f.form, layouts[p], device), f.from_tokens) for p, f in plan.prefill.forms
             if p in layout.forms and layout.forms[p].staged and f.form != layout.forms[p].name}
    prefill = (top_k, max(form_slot_bytes(layouts[p].nbytes, f) for p, (f, _) in forms.items())) if forms else (0, 0)
    return Allocation(pools, (top_k, max(slot.values())),
                      (max(1, workers), staging // max(1, workers)) if staging else (0, 0), prefill, forms)


def dense_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file: the file minus its 8-byte length and JSON header."""

    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ArtifactError(f"{path.name} is truncated; copy the artifact again or rerun `moeprep prepare`")
    return path.stat().st_size - 8 - int.from_bytes(head, "little")


def store_forms(manifest, expert_dtype: str, device: torch.device, plan: Plan | None = None) -> dict:
    """Per store precision, the held form (``loader.forms.choose_form``): fixed by the arguments, never timed."""

    planned = dict(plan.forms) if plan is not None else {}
    return {p: choose_form(expert_dtype, RecordLayout.from_json(s["layout"]), device, planned.get(p),
                           neuron=s.get("neuron") is not None)
            for p, s in manifest.raw["stores"].items()}


def layout_forms(layouts: dict, plan: Plan | None = None, device: str | torch.device = "cpu",
                 expert_dtype: str = "auto", workers: int = 2) -> tuple[dict, dict, int]:
    """Before the artifact exists (the planner): per store precision (its ``RecordLayout``) the held form the
    loader will choose on ``device`` (``store_forms``' rule, with the plan's ``forms`` and dynamic precision's low
    copies fitted as ``lodged_forms`` fits them), the slot one cached expert takes, and the reader threads'
    staging bytes: what ``artifact_sizes`` gives for the artifact's stores read with O_DIRECT."""
    device = torch.device(device)
    planned = dict(plan.forms) if plan is not None else {}
    forms = {p: choose_form(expert_dtype, layout, device, planned.get(p)) for p, layout in layouts.items()}
    record_bytes = {p: layout.nbytes for p, layout in layouts.items()}
    if plan is not None:
        record = {p: choose_form("packed", layout, device) for p, layout in layouts.items()}
        forms = lodged_forms(plan, forms, record, record_bytes, workers=workers)
    slots, staging = held_sizes(record_bytes, forms, workers)
    return forms, slots, staging


def artifact_sizes(manifest, stores: dict, device: torch.device, forms: dict, workers: int = 2,
                   plan: Plan | None = None) -> ModelSizes:
    """The sizes the budget arithmetic needs: a cached expert and a read buffer count their held form
    (``held_bytes``), the reader threads their staging buffers, the dense weights their tensor bytes, plus a
    host-mode store's whole file when the budget is RAM (CPU device), the prefill forms' buffers of ``plan`` (the
    artifact's without one) and the model's activation shape (a prompt chunk's activations count too)."""
    moe = manifest.moe
    held = dense_bytes(manifest.path("dense.safetensors"))
    if device.type == "cpu":
        held += sum(s.host_bytes for s in stores.values())
    slots, staging = held_sizes({p: s.record_bytes for p, s in stores.items()}, forms, workers,
                                {p: s.direct_io for p, s in stores.items()})
    layouts = {p: RecordLayout.from_json(s["layout"]) for p, s in manifest.raw["stores"].items()}
    form_buffers = prefill_form_bytes(plan or read_plan(manifest.root), layouts, forms, moe.top_k, device)
    return ModelSizes(len(moe.layers), moe.num_experts, moe.top_k, held, int(moe.source_expert_bytes),
                      slots, dict(slots), staging, form_buffers, artifact_shape(manifest))


def _capacities(plan: Plan, sizes: ModelSizes, memory_budget, host_bytes: int, device: torch.device) -> Capacities:
    """``capacities`` with the loader's error: a host-mode store on a CPU is named as what used the budget."""
    try:
        return capacities(plan, memory_budget, sizes)
    except PlanError as e:
        extra = (f" (store='host' holds the whole expert store, {host_bytes:,} bytes, in RAM inside the budget; "
                 "use store='disk' for a small budget)") if host_bytes and device.type == "cpu" else ""
        raise BudgetError(f"{e}{extra}") from None


NO_BUDGET = object()  # held_layout without a budget: sizes only


@dataclass(frozen=True)
class HeldLayout:
    """What ``load`` builds for a budget: per store precision the held form, the sizes, the byte capacities
    (None without a budget) and the plan at the budget's operating point."""

    forms: dict
    sizes: ModelSizes
    capacities: Capacities | None
    plan: Plan

    @property
    def slot_bytes(self) -> dict:
        return dict(self.sizes.record_bytes)


def held_layout(manifest, stores: dict, plan: Plan, memory_budget, device: torch.device, expert_dtype: str,
                workers: int = 2, smallest: bool = False) -> HeldLayout:
    """The forms, sizes and capacities for ``memory_budget`` (``NO_BUDGET``: sizes only). With ``auto`` a
    budget that cannot hold one held form per eviction group falls back to the record form (decoded per use),
    so a small budget still loads; ``smallest``: that fallback's sizes (``auto``'s minimum budget)."""
    host = sum(s.host_bytes for s in stores.values())
    options = form_options(manifest, plan, device, expert_dtype, stores, workers)
    if smallest:
        options = options[-1:]
    for i, forms in enumerate(options):
        sizes = artifact_sizes(manifest, stores, device, forms, workers, plan)
        if memory_budget is NO_BUDGET:
            return HeldLayout(forms, sizes, None, plan)
        try:
            caps = _capacities(plan, sizes, memory_budget, host, device)
            return HeldLayout(forms, sizes, caps, plan_for(plan, caps.limit_bytes, sizes))
        except LoaderError:
            if i == len(options) - 1:
                raise
    raise AssertionError("unreachable")


def form_options(manifest, plan: Plan, device: torch.device, expert_dtype: str, stores: dict | None = None,
                 workers: int = 2) -> list[dict]:
    """The held forms ``load`` tries, in order: the chosen ones, then with ``auto`` the record form (decoded per
    use) for one made form after another, the one that takes most memory over its record first, so a budget too
    small for the first still loads and a store that fits keeps its fast form (one precision's pool falling back
    to records leaves another pool's int4pack alone); the last option is every store's record. With the open
    ``stores``, dynamic precision's low copies take the form that fits a main-pool slot (``lodged_forms``)."""
    chosen = store_forms(manifest, expert_dtype, device, plan)
    record = store_forms(manifest, "packed", device, plan)
    options = [chosen]
    if expert_dtype == "auto":
        staged = sorted((p for p, f in chosen.items() if f.staged), key=lambda p: -chosen[p].nbytes / record[p].nbytes)
        for p in staged:
            options.append(options[-1] | {p: record[p]})
    if stores is None:
        return options
    sizes = {p: s.record_bytes for p, s in stores.items()}
    direct = {p: s.direct_io for p, s in stores.items()}
    fitted = [lodged_forms(plan, forms, record, sizes, direct, workers) for forms in options]
    return [forms for i, forms in enumerate(fitted) if forms not in fitted[:i]]


def _layout_of(artifact, store: str, plan: Plan | None, device: torch.device, expert_dtype: str, memory_budget,
               workers: int, smallest: bool = False) -> tuple[HeldLayout, dict]:
    """(the held layout ``load`` would build, record bytes per precision), without the model."""

    manifest = read_manifest(artifact)
    plan = plan or read_plan(manifest.root)
    stores = {p: ExpertStore(manifest.path(s.file), p, mode=store) for p, s in manifest.stores.items()}
    try:
        return (held_layout(manifest, stores, plan, memory_budget, device, expert_dtype, workers, smallest),
                {p: s.record_bytes for p, s in stores.items()})
    finally:
        for s in stores.values():
            s.close()


@dataclass(frozen=True)
class CacheLayout:
    """What ``load`` builds for a budget: the plan, the sizes, the byte capacities, and per precision the
    bytes a cached expert takes (its slot) and the bytes a read fetches. The simulator replays through it."""

    plan: Plan
    sizes: ModelSizes
    capacities: Capacities
    slot_bytes: dict
    record_bytes: dict
    forms: dict  # precision -> held form name


def cache_layout(artifact, memory_budget=None, store: str = "disk", plan: Plan | None = None, device: str = "cpu",
                 expert_dtype: str = "auto", workers: int = 2) -> CacheLayout:
    """The cache ``load(artifact, memory_budget, ...)`` builds with the same arguments, without the model."""
    layout, record_bytes = _layout_of(artifact, store, plan, torch.device(device), expert_dtype, memory_budget,
                                      workers)
    return CacheLayout(layout.plan, layout.sizes, layout.capacities, layout.slot_bytes, record_bytes,
                       {p: f.name for p, f in layout.forms.items()})


def minimum_budget(artifact, store: str = "disk", plan: Plan | None = None, device: str = "cpu",
                   expert_dtype: str = "auto", workers: int = 2) -> int:
    """The smallest memory budget in bytes that ``load(artifact, ...)`` accepts with the same arguments: the
    dense weights, the read and staging buffers, and one expert per eviction group (with ``store='host'`` on
    a CPU the store counts too); with ``auto``, the smaller of the chosen forms' and the record form's."""
    manifest = read_manifest(artifact)
    plan = plan or read_plan(manifest.root)
    device = torch.device(device)
    stores = {p: ExpertStore(manifest.path(s.file), p, mode=store) for p, s in manifest.stores.items()}
    try:  # each form ``load`` may fall back to; its held sizes may be smaller than the record's (int4pack)
        return min(lowest_budget(plan, artifact_sizes(manifest, stores, device, forms, workers, plan))
                   for forms in form_options(manifest, plan, device, expert_dtype, stores, workers))
    finally:
        for s in stores.values():
            s.close()


def budget_bytes(artifact, memory_budget, store: str = "disk", plan: Plan | None = None, device: str = "cpu") -> int:
    """What ``memory_budget`` means in bytes for ``artifact`` (the bench gives accelerate the same number)."""
    layout, _ = _layout_of(artifact, store, plan, torch.device(device), "packed", NO_BUDGET, 2)
    return int(min(resolve_budget(memory_budget, layout.plan, layout.sizes), 2**62))
