"""Replay recorded routing through the loader's own expert cache and schedule, and count what the loader
would do.

The cache is ``loader.cache.ExpertCache`` with the loader's eviction policies (plus ``belady``, the
clairvoyant floor, which exists only here); entries hold sizes, never tensors. Every decision is the
loader's own schedule (``loader.schedule.LayerSchedule``), called as the loader calls it, one call per
token per MoE layer as in decode:

    cache.clock.token = t                                 # the token's position in its sequence
    for each MoE layer l in order:
        schedule.routed(l, experts); predictors' prefetches -> schedule.prefetch(...)   (with predictors)
        decisions, skipped = schedule.begin(l, [token's experts at l], idx, w)
        for each decision without an entry and not served on the CPU, in order:
            entry = schedule.admit(l, e, precision, slot_bytes[precision], record_bytes[precision])
            cache.complete(entry) if entry is not None        # else: read into a buffer and used once
        schedule.end(l)

``begin`` protects all of a token's experts before any is admitted, so a token's experts are inserted
together and neither can evict the other (the convention of SOURCES.md and of the loader). Each sequence
starts cold (``cache.clear()``) unless ``cold_start=False``, in which case it only ``reset()``s
(per-sequence policy records forgotten, contents kept). Every call is a one-token step, so the schedule's
CPU rule (``loader.schedule.CpuMissRule``, ``simulate(cpu_misses=...)``) applies to every miss, as in the
loader's decode steps: a miss it serves on the CPU is counted (``cpu_computed``), not read or cached.

Capacity comes from a ``loader.plan.Plan`` and a budget through ``loader.budget.capacities`` (the same
arithmetic as the loader: ``plan_spec``; ``artifact_spec`` also takes the artifact's held-form and read
sizes exactly as ``loader.runtime.load`` does), or from a number of experts per layer
(``capacity_spec``): N records per layer group, or one global group of N x L records.

Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from loader.budget import Capacities, ModelSizes, cache_layout, capacities
from loader.cache import ExpertCache, PoolConfig
from loader.codec import BITS, MatrixSpec, RecordLayout
from loader.format import read_manifest
from loader.plan import Plan, read_plan_file
from loader.policies import POLICIES, policy_factory
from loader.predict import PREDICTORS, PREDICTORS_FILE, ROUTING_ONLY, PredictorContext, make_predictor
from loader.routing import MISS_POLICIES, ROUTING_POLICIES, RoutingError
from loader.schedule import CPU, CPU_MISSES, CpuMissRule, LayerSchedule, PrefetchGate
from prep.errors import MoeprepError
from prep.methods.trace import open_trace
from prep.sim.belady import BeladyPolicy, FutureUses
from prep.sim.device import DeviceProfile, load_profile
from prep.sim.replay import Replay, load_replay

POLICY_NAMES = (*POLICIES, "belady")  # every policy the simulator runs; belady only here
GROUPS = ("layer", "global")
MIXTRAL_GROUP_SIZE = 64


def mixtral_record_bytes(precision: str = "int4", group_size: int = MIXTRAL_GROUP_SIZE) -> int:
    """Bytes of one Mixtral-8x7B expert record in this project's store format.

    The expert is three matrices of 4096 x 14336 (gate, up: [I, H]; down: [H, I]), 176,160,768
    weights. intN stores N-bit codes plus a float16 scale and zero per group of ``group_size``
    weights, each part 16-byte aligned (``loader.codec.RecordLayout``); int4 with groups of 64:
    3 x (29,360,128 + 2 x 1,835,008) = 99,090,432 bytes (94.5 MiB). ``passthrough`` is the source
    bfloat16: 352,321,536 bytes.
    """

    hidden, inter = 4096, 14336
    if precision not in BITS and precision != "passthrough":
        raise MoeprepError(f"no record size for precision {precision!r}; use passthrough or one of {sorted(BITS)}")
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return RecordLayout(tuple(MatrixSpec(n, s, precision, "bfloat16", group_size if precision != "passthrough" else 0)
                              for n, s in shapes.items())).nbytes


DEFAULT_RECORD_BYTES = 99_090_432  # mixtral_record_bytes("int4"), checked by a test
MAX_RECORD_BYTES = 1 << 40  # 1 TiB: far above any expert record (Mixtral's bfloat16 expert is 336 MiB)


def check_record_bytes(record_bytes, what: str = "--record-bytes") -> int:
    """``record_bytes`` when it is a whole number of bytes from 1 to ``MAX_RECORD_BYTES``, else a MoeprepError
    naming ``what``: 0 would be a record that costs nothing (and ``0 or default`` silently the default)."""
    if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or not 1 <= record_bytes <= MAX_RECORD_BYTES:
        raise MoeprepError(f"{what} {record_bytes!r} must be a whole number of bytes from 1 to {MAX_RECORD_BYTES:,} "
                           f"(one expert record; leave it out for {DEFAULT_RECORD_BYTES:,}, an int4 Mixtral-8x7B "
                           "expert)")
    return record_bytes


@dataclass(frozen=True)
class CacheSpec:
    """What a simulated cache holds: its pools (byte capacity per eviction group), the precision each expert
    is requested at ([L][E]), the bytes a cached record takes (``slot_bytes``) and the bytes a miss reads
    (``record_bytes``) per precision, the eviction policy the plan names, and the capacity as reported."""

    pools: tuple[PoolConfig, ...]
    expert_precision: tuple[tuple[str, ...], ...]
    record_bytes: dict
    capacity: object  # N experts per layer, or the pools' byte capacities
    group: str  # "layer", "global" or "plan"
    slot_bytes: dict | None = None  # None: a record takes its own size
    eviction: tuple[str, dict] = ("lru", {})
    routing: tuple[str, dict] = ("topk", {})  # the plan's routing policy (name, params)
    miss: tuple[str, dict] = ("plan", {})  # the plan's miss policy

    @property
    def num_layers(self) -> int:
        return len(self.expert_precision)

    @property
    def num_experts(self) -> int:
        return len(self.expert_precision[0])


def capacity_spec(num_layers: int, num_experts: int, capacity: int, group: str = "layer",
                  record_bytes: int = DEFAULT_RECORD_BYTES, precision: str = "int4") -> CacheSpec:
    """One pool at ``precision`` holding ``capacity`` records per layer (``group="layer"``) or one global
    group of ``capacity * num_layers`` records (``group="global"``)."""
    if group not in GROUPS:
        raise MoeprepError(f"--group must be one of {', '.join(GROUPS)}, not {group!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= num_experts:
        raise MoeprepError(f"capacity {capacity!r} must be a whole number of experts per layer from 1 to "
                           f"{num_experts} (the model's experts per layer)")
    check_record_bytes(record_bytes, "record bytes")
    per_group = ({layer: capacity * record_bytes for layer in range(num_layers)} if group == "layer"
                 else {"global": capacity * num_layers * record_bytes})
    return CacheSpec((PoolConfig("main", precision, group, per_group, record_bytes),),
                     tuple((precision,) * num_experts for _ in range(num_layers)), {precision: record_bytes},
                     capacity, group)


_DEFAULT_HOOKS = ("topk", "plan", "none")  # the names that mean "off" for routing and the miss policy


def capacities_spec(plan: Plan, caps: Capacities, record_bytes: dict, slot_bytes: dict | None = None) -> CacheSpec:
    """The pools of ``plan`` with byte capacities ``caps`` (from ``loader.plan.capacities``).

    record_bytes: bytes a miss reads per precision; slot_bytes: bytes a cached record takes (the loader's
    slot, which ``capacities`` was given as the record size); None means the same as record_bytes.
    """
    slot_bytes = dict(slot_bytes if slot_bytes is not None else record_bytes)
    pools = tuple(PoolConfig(p.name, p.precision, p.group, dict(caps.pools[p.name]), slot_bytes.get(p.precision, 0))
                  for p in plan.pools)
    missing = sorted(set(plan.precisions) - set(record_bytes) - set(slot_bytes))
    if missing:
        raise MoeprepError(f"no record size for precisions {missing}; give the artifact's sizes")
    return CacheSpec(pools, plan.expert_precision, dict(record_bytes),
                     {name: {str(k): v for k, v in groups.items()} for name, groups in caps.pools.items()}, "plan",
                     slot_bytes, (plan.eviction.name, dict(plan.eviction.params)),
                     (plan.routing.name, dict(plan.routing.params)), (plan.miss.name, dict(plan.miss.params)))


def plan_spec(plan: Plan, budget, sizes) -> CacheSpec:
    """The cache the loader builds for ``plan`` under ``budget`` (``loader.plan.capacities``);
    ``sizes.record_bytes`` are both what a record takes and what a miss reads."""
    return capacities_spec(plan, capacities(plan, budget, sizes), sizes.record_bytes)


def artifact_spec(artifact, budget=None, plan: Plan | None = None, store: str = "disk") -> CacheSpec:
    """The cache ``loader.runtime.load(artifact, memory_budget=budget, store=store, plan=plan)`` builds
    (``loader.budget.cache_layout``, the arithmetic ``load`` itself uses)."""

    layout = cache_layout(artifact, budget, store=store, plan=plan)
    return capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)


# ------------------------------------------------------------------------------------------ results


@dataclass
class LayerResult:
    requests: int = 0
    hits: int = 0
    misses: int = 0
    joins: int = 0
    bytes_read: int = 0
    demand_bytes: int = 0  # bytes of demand reads (misses), without prefetches
    read_seconds: float = 0.0  # demand reads: the modelled stall
    compute_seconds: float = 0.0
    prefetch_read_seconds: float = 0.0  # prefetch reads, modelled as hidden behind compute
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    skipped: int = 0  # misses the miss policy skipped
    cpu_computed: int = 0  # misses the CPU rule computed on the CPU (counted in misses; nothing read)

    def to_json(self, layer: int, modelled: bool) -> dict:
        out = {"layer": layer, "requests": self.requests, "hits": self.hits, "misses": self.misses,
               "joins": self.joins, "miss_rate": self.misses / self.requests if self.requests else None,
               "bytes_read": self.bytes_read, "demand_bytes": self.demand_bytes, "skipped": self.skipped,
               "cpu_computed": self.cpu_computed, "prefetches": self.prefetches,
               "prefetch_used": self.prefetch_used,
               "prefetch_wasted": self.prefetch_wasted}
        if modelled:
            out |= {"read_seconds": self.read_seconds, "compute_seconds": self.compute_seconds,
                    "seconds": self.read_seconds + self.compute_seconds,
                    "prefetch_read_seconds": self.prefetch_read_seconds}
        return out


@dataclass
class SimResult:
    """What one replay counted: totals and per MoE layer; modelled seconds when a profile was given."""

    policy: str
    params: dict
    capacity: object
    group: str
    source: str
    sequences: int
    tokens: int
    record_bytes: dict
    cold_start: bool
    layers: list[LayerResult] = field(default_factory=list)
    profile: DeviceProfile | None = None
    predictors: list = field(default_factory=list)  # names of the predictors replayed
    cpu_misses: dict | None = None  # the CPU rule replayed (``CpuMissRule.to_json``); None: every miss read
    # a calibrated profile: what tokens waited beyond their layers' path because their reads (demand and
    # prefetch, one disk) took longer than it
    io_bound_seconds: float = 0.0

    @property
    def outside_seconds(self) -> float:
        """A calibrated profile's time outside the MoE layers' steps, for every token replayed."""
        return self.profile.token_overhead * self.tokens if self.profile is not None else 0.0

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.layers)

    @property
    def hits(self) -> int:
        return sum(r.hits for r in self.layers)

    @property
    def misses(self) -> int:
        return sum(r.misses for r in self.layers)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.layers)

    @property
    def cpu_computed(self) -> int:
        return sum(r.cpu_computed for r in self.layers)

    @property
    def miss_rate(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    @property
    def seconds(self) -> float | None:
        if self.profile is None:
            return None
        return sum(r.read_seconds + r.compute_seconds for r in self.layers) + self.io_bound_seconds + self.outside_seconds

    def to_json(self) -> dict:
        modelled = self.profile is not None
        out = {
            "policy": self.policy, "params": self.params, "capacity": self.capacity, "group": self.group,
            "trace": self.source, "sequences": self.sequences, "tokens": self.tokens,
            "requests": self.requests, "hits": self.hits, "misses": self.misses,
            "joins": sum(r.joins for r in self.layers), "miss_rate": self.miss_rate,
            "bytes_read": self.bytes_read, "bytes_read_per_token": self.bytes_read / self.tokens if self.tokens else None,
            "record_bytes": self.record_bytes, "cold_start": self.cold_start,
            "cpu_misses": self.cpu_misses, "cpu_computed": self.cpu_computed,
            "convention": "one call per token per MoE layer; a token's experts inserted together",
            "seconds": None,
            "prefetch": {"predictors": self.predictors, "issued": sum(r.prefetches for r in self.layers),
                         "used": sum(r.prefetch_used for r in self.layers),
                         "wasted": sum(r.prefetch_wasted for r in self.layers),
                         "model": "a prefetch lands before its layer runs (its read hidden behind compute)"},
        }
        if modelled:
            read = sum(r.read_seconds for r in self.layers)
            compute = sum(r.compute_seconds for r in self.layers)
            total = read + compute + self.io_bound_seconds + self.outside_seconds
            out["seconds"] = {"total": total, "per_token": total / self.tokens if self.tokens else None,
                              "read": read, "compute": compute, "io_bound": self.io_bound_seconds,
                              "outside_layers": self.outside_seconds,
                              "device": self.profile.device}
        out["layers"] = [r.to_json(layer, modelled) for layer, r in enumerate(self.layers)]
        return out


# ------------------------------------------------------------------------------------------- replay


def _factory(policy: str, params: dict | None, future: FutureUses | None):
    if policy == "belady":
        if params:
            raise MoeprepError(f"the belady policy takes no parameters, got {sorted(params)}")
        return lambda clock, num_experts: BeladyPolicy(clock, num_experts, future)
    try:
        return policy_factory(policy, params)
    except ValueError as e:
        raise MoeprepError(f"{e}; the simulator also runs 'belady'") from None


@dataclass(frozen=True)
class PredictionFeed:
    """What the loader's predictors read, per replayed sequence: router inputs [T, L, H] (None: routing only, for
    the predictors that read nothing else, ``loader.predict.ROUTING_ONLY``) and the LM head's input [T, H] (None:
    the trace lacks it, and ``first_gate`` cannot be replayed); plus each MoE layer's router (weight [E, H], bias
    [E] or None) and the artifact's predictor tensors."""

    router_inputs: list | None
    head_inputs: list | None
    routers: list
    tensors: dict


def simulate(replay: Replay, spec: CacheSpec, policy: str | None = None, params: dict | None = None,
             profile: DeviceProfile | None = None, cold_start: bool = True, predictors: list | None = None,
             feed: PredictionFeed | None = None, routing=None, miss=None,
             cpu_misses: CpuMissRule | None = None) -> SimResult:
    """Replay ``replay`` through an ``ExpertCache`` built from ``spec`` with eviction ``policy``.

    policy: a name of ``POLICY_NAMES`` with ``params``; None takes the spec's (a plan's) eviction policy.
    Returns a ``SimResult``: hits, misses, joins and bytes read per MoE layer (a miss reads one record of
    its precision whether or not the cache keeps it), and with ``profile`` the modelled read and
    compute seconds (``prep.sim.device``).

    predictors: ``loader.predict`` predictors, run as the loader runs them (after each router, with the
    token's chosen experts protected first; and after the last layer) on ``feed``. A prefetch is admitted
    through ``ExpertCache.prefetch`` and modelled as landing before its layer runs: its bytes count, its
    read seconds go to ``prefetch_read_seconds`` (hidden behind compute), not to the stall.

    routing / miss: ``loader.routing`` policy objects (default: the spec's, i.e. the plan's), deciding on the
    replay's recorded weights exactly as in the loader: a selection the routing policy gives weight 0 is not
    wanted; a miss the miss policy skips is not read, one it lowers is read at that precision (or served by
    a held lower copy).

    cpu_misses: the loader's CPU rule (``loader.schedule.CpuMissRule``; ``cpu_miss_rule`` reads one from
    text): a miss it serves is computed on the CPU from the host store, counted in ``cpu_computed``, not
    read or cached. The profile has no CPU compute time, so such a miss is modelled at the profile's expert
    compute time for its precision (``compute_seconds_per_expert``), done while the layer's reads run, as
    the loader does it; on a profile measured on a GPU this understates it.
    """
    if policy is None:
        policy, params = spec.eviction[0], (params if params is not None else spec.eviction[1])
    if policy not in POLICY_NAMES:
        raise MoeprepError(f"eviction policy {policy!r} unknown; use one of {', '.join(POLICY_NAMES)}")
    if (replay.num_layers, replay.num_experts) != (spec.num_layers, spec.num_experts):
        raise MoeprepError(f"the trace has {replay.num_layers} MoE layers x {replay.num_experts} experts but the "
                           f"cache is for {spec.num_layers} x {spec.num_experts}; use a plan made for this model")
    future = FutureUses() if policy == "belady" else None
    cache = ExpertCache(spec.pools, spec.num_layers, spec.num_experts, _factory(policy, params, future))
    layers = [LayerResult() for _ in range(spec.num_layers)]
    precision, record_bytes = spec.expert_precision, spec.record_bytes
    slot_bytes = spec.slot_bytes if spec.slot_bytes is not None else record_bytes
    routing, miss = _policies(spec, replay, routing, miss)
    decide = routing is not None or miss is not None
    if miss is not None:
        miss.view = cache.view
    predictors = list(predictors or [])
    if predictors:
        import torch

        _bind_predictors(predictors, cache, spec, replay, feed)

    schedule = LayerSchedule(cache, precision, miss, readable=record_bytes, cpu_rule=cpu_misses,
                             prefetch_gate=PrefetchGate() if predictors else None)  # as the loader's step

    token_io = [0.0, 0.0]  # this token's reads (demand and prefetch) and its layers' path, in modelled seconds
    io_bound = 0.0

    def prefetch(requests) -> None:
        for entry in schedule.prefetch(requests, slot_bytes):
            cache.count_read(entry.layer, record_bytes[entry.precision])
            cache.complete(entry)
            if profile is not None:  # the read and the form made on a reader thread, behind compute
                seconds = profile.read_seconds(record_bytes[entry.precision]) + profile.make(entry.precision)
                layers[entry.layer].prefetch_read_seconds += seconds
                token_io[0] += seconds

    for s, sequence in enumerate(replay.sequences):
        cache.clear() if cold_start else cache.reset()
        for p in predictors:
            p.reset()
        if future is not None:
            future.start(sequence)
        for t, token in enumerate(sequence):
            cache.clock.token = t
            token_io[0] = token_io[1] = 0.0
            for layer, experts in enumerate(token):
                counts = layers[layer]
                idx = w = None
                if decide:
                    logits = replay.logits[s][t, layer][None] if replay.logits is not None else None
                    experts, idx, w = _route(routing, replay.weights[s][t][layer], experts, layer, cache, logits)
                if predictors and schedule.prefetching:  # the router has decided: protect its experts, then predict
                    schedule.routed(layer, experts)
                    x = feed.router_inputs[s][t, layer][None].float() if feed.router_inputs is not None else None
                    chosen = torch.tensor([list(experts)])
                    for p in predictors:
                        prefetch(p.after_router(layer, x, chosen))
                decisions, skipped = schedule.begin(layer, [experts], idx, w)
                counts.requests += len(decisions) + len(skipped)
                held_compute = reads = 0.0
                for d in decisions:
                    if profile is not None:
                        counts.compute_seconds += profile.compute(d.precision)
                    if d.entry is not None or d.served == CPU:  # computed while the reads run
                        held_compute += profile.compute(d.precision) if profile is not None else 0.0
                        continue
                    nbytes = record_bytes[d.precision]
                    entry = schedule.admit(layer, d.expert, d.precision, slot_bytes[d.precision], nbytes)
                    counts.demand_bytes += nbytes
                    if entry is not None:
                        cache.complete(entry)
                    if profile is not None:  # the read, then the held form made on the reader thread
                        reads += profile.read_seconds(nbytes) + profile.make(d.precision)
                if profile is not None:
                    # calibrated: the hits compute while the reads run; the layer waits for what is left
                    stall = max(0.0, reads - held_compute) if profile.overlap else reads
                    counts.read_seconds += stall
                    counts.compute_seconds += profile.layer_overhead
                    token_io[0] += reads
                    token_io[1] += stall + profile.layer_overhead + sum(profile.compute(d.precision) for d in decisions)
                schedule.end(layer)
            if predictors and schedule.prefetching and feed.head_inputs is not None:
                for p in predictors:
                    prefetch(p.after_last_layer(feed.head_inputs[s][t][None].float()))
            if profile is not None and profile.overlap:  # one disk: a token takes at least its reads
                io_bound += max(0.0, token_io[0] - token_io[1] - profile.token_overhead)
    for layer, counts in enumerate(layers):
        c = cache.counters[layer]
        counts.hits, counts.misses, counts.joins, counts.bytes_read = c.hits, c.misses, c.joins, c.bytes_read
        counts.prefetches, counts.prefetch_used, counts.prefetch_wasted = c.prefetches, c.prefetch_used, c.prefetch_wasted
        counts.skipped, counts.cpu_computed = c.skipped, c.cpu_computed
    return SimResult(policy, dict(params or {}), spec.capacity, spec.group, replay.source, len(replay.sequences),
                     replay.num_tokens, dict(record_bytes), cold_start, layers, profile, [p.name for p in predictors],
                     cpu_misses=cpu_misses.to_json() if cpu_misses is not None and not cpu_misses.off else None,
                     io_bound_seconds=io_bound)


def _policies(spec: CacheSpec, replay: Replay, routing, miss):
    """(routing, miss) policy objects: the given ones, else the spec's (None for the defaults)."""

    def build(given, named, registry, what):
        if given is not None:
            return given
        name, params = named
        if name in _DEFAULT_HOOKS and not params:
            return None
        if name not in registry:
            raise MoeprepError(f"the plan's {what} {name!r} is unknown to this moeprep (known: {sorted(registry)})")
        try:
            return registry[name](**params)
        except (TypeError, RoutingError) as e:
            raise MoeprepError(f"the plan's {what} {name!r}: {e}") from None

    routing = build(routing, spec.routing, ROUTING_POLICIES, "routing policy")
    miss = build(miss, spec.miss, MISS_POLICIES, "miss policy")
    if (routing is not None or miss is not None) and replay.weights is None:
        raise MoeprepError(f"{replay.source or 'the replay'} holds no routing weights, which the plan's routing and "
                           "miss policies decide on; replay a trace that records them")
    if routing is not None:
        routing.bind(spec.num_layers)
    if miss is not None:
        miss.bind(spec.num_layers, spec.num_experts)
    return routing, miss


def _route(routing, weights: tuple, experts: tuple, layer: int, cache: ExpertCache, logits=None):
    """(the experts wanted, indices [1, K], weights [1, K]) of one token at one layer after ``routing``
    (logits [1, E]: the recorded router logits, for policies that re-rank)."""
    import torch

    idx, w = torch.tensor([list(experts)]), torch.tensor([list(weights)], dtype=torch.float32)
    if routing is not None:
        w, idx = routing.route(layer, logits, w, idx, cache.view(layer))
    return tuple(e for e, x in zip(idx[0].tolist(), w[0].tolist(), strict=True) if x != 0), idx, w


def _bind_predictors(predictors: list, cache: ExpertCache, spec: CacheSpec, replay: Replay,
                     feed: PredictionFeed | None) -> None:

    if feed is None:
        raise MoeprepError("predictors need what they read: simulate a project trace (router inputs) with an "
                           "artifact (routers and predictors.safetensors)")
    if feed.router_inputs is None:
        if reading := [p.name for p in predictors if p.name not in ROUTING_ONLY]:
            raise MoeprepError(f"the predictors {reading} read router inputs, which this replay (routing only) "
                               f"lacks; replay only {list(ROUTING_ONLY)}, or trace the model itself")
    elif len(feed.router_inputs) != len(replay.sequences):
        raise MoeprepError(f"the prediction feed has {len(feed.router_inputs)} sequences, the replay "
                           f"{len(replay.sequences)}; build both from one trace")
    if feed.head_inputs is None and any(p.name == "first_gate" for p in predictors):
        raise MoeprepError("first_gate needs the LM head's input, which this trace lacks (recorded before "
                           "moeprep kept it); record the trace again (`moeprep prepare --force trace`)")
    context = PredictorContext(spec.num_layers, spec.num_experts, replay.top_k, feed.routers, feed.tensors,
                               held=lambda layer, expert, p: cache.find(layer, expert, p) is not None,
                               precision_of=lambda layer, expert: spec.expert_precision[layer][expert])
    for p in predictors:
        p.bind(context)


def prediction_feed(trace_dir, artifact) -> PredictionFeed:
    """The feed of a project trace directory and the artifact whose routers and predictor tensors to use."""
    from safetensors import safe_open
    from safetensors.torch import load_file


    manifest = read_manifest(artifact)
    routers = []
    with safe_open(str(manifest.path("dense.safetensors")), framework="pt") as f:
        names = set(f.keys())
        for path in manifest.raw["moe"]["router_modules"]:
            bias = f"{path}.bias"
            routers.append((f.get_tensor(f"{path}.weight").float(),
                            f.get_tensor(bias).float() if bias in names else None))
    tensors = load_file(str(manifest.path(PREDICTORS_FILE))) if PREDICTORS_FILE in manifest.raw["files"] else {}
    return trace_feed(trace_dir, routers, tensors)


def trace_feed(trace_dir, routers: list, tensors: dict) -> PredictionFeed:
    """The feed of a project trace directory with the given routers ([(weight, bias)] per MoE layer) and
    predictor tensors: per sequence the router inputs and, when recorded, the LM head's inputs."""
    import torch


    trace = open_trace(trace_dir)
    if f"layers.{trace.layers[0]}.router_input" not in trace.index["tensors"]:
        if "recorded" in trace.index:  # imported routing: only the predictors that read nothing else replay
            return PredictionFeed(None, None, routers, tensors)
        raise MoeprepError(f"{trace_dir} holds no router inputs; record it with hidden states (record_hidden)")
    inputs = torch.stack([trace.router_inputs(layer) for layer in trace.layers], dim=1)  # [N, L, H]
    head = trace.tensor("head_input") if "head_input" in trace.index["tensors"] else None
    slices = trace.sequence_slices()
    return PredictionFeed([inputs[s] for s in slices], [head[s] for s in slices] if head is not None else None,
                          routers, tensors)


def sweep(replay: Replay, policies: Iterable[str], capacities_per_layer: Iterable[int],
          groups: Iterable[str] = ("layer",), record_bytes: int = DEFAULT_RECORD_BYTES, precision: str = "int4",
          params: dict | None = None, profile: DeviceProfile | None = None,
          cold_start: bool = True, cpu_misses: CpuMissRule | None = None) -> list[SimResult]:
    """``simulate`` for every (group, capacity, policy), in that nesting order. ``params`` go to every
    policy that is not belady (so pass them only with one policy)."""
    results = []
    policies = list(policies)
    for group in groups:
        for capacity in capacities_per_layer:
            spec = capacity_spec(replay.num_layers, replay.num_experts, capacity, group, record_bytes, precision)
            for policy in policies:
                results.append(simulate(replay, spec, policy, params if policy != "belady" else None, profile,
                                        cold_start, cpu_misses=cpu_misses))
    return results


def _synthetic_sizes(plan: Plan, replay: Replay, record_bytes: int | None) -> ModelSizes:
    """Sizes for a plan without its artifact: Mixtral-8x7B-shaped records (``mixtral_record_bytes``; or
    ``record_bytes`` for every precision), no dense weights, source experts in bfloat16."""
    sizes = {p: record_bytes or mixtral_record_bytes(p) for p in plan.precisions}
    return ModelSizes(plan.num_layers, plan.num_experts, replay.top_k, 0,
                      plan.num_layers * plan.num_experts * (record_bytes or mixtral_record_bytes("passthrough")), sizes)


def parse_list(text: str | None, what: str, convert=str) -> list:
    """"a,b,c" -> [a, b, c] converted; an unconvertible item is a MoeprepError naming ``what``."""
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        return [convert(t) for t in items]
    except ValueError:
        raise MoeprepError(f"{what} {text!r} is not a comma-separated list of {convert.__name__} values") from None


def cpu_miss_rule(text) -> CpuMissRule | None:
    """The CPU rule ``text`` names: ``never`` (or None), ``always``, or comma-separated precisions whose
    misses the CPU computes (what ``load(cpu_misses="auto")`` measures at load); a rule passes as it is."""
    if text is None or isinstance(text, CpuMissRule):
        return text
    names = parse_list(text, "--cpu-misses")
    if names in (["never"], ["always"]):
        return CpuMissRule(names[0])
    if not names or set(names) & set(CPU_MISSES):
        raise MoeprepError(f"--cpu-misses {text!r}: give never, always, or the precisions computed on the CPU "
                           "(e.g. int4,int2)")
    return CpuMissRule("auto", frozenset(names))


def simulate_trace(trace, plan=None, budget=None, policies=None, capacity=None, groups=("layer",),
                   params: dict | None = None, record_bytes: int | None = None, precision: str = "int4",
                   profile=None, cold_start: bool = True, predictors=None,
                   cpu_misses=None) -> tuple[Replay, list[SimResult]]:
    """What ``moeprep simulate`` runs: load the trace, build the cache(s), replay.

    trace: a project trace directory or the real Mixtral traces (``load_replay``). Either ``plan`` (a
    ``plan.json`` path, an artifact directory, or a ``Plan``) with ``budget`` (None: the plan's default),
    or ``capacity`` (experts per layer: an int, a list, or "2,4,6") with ``groups``. policies: names,
    "a,b", "all", or None (the plan's policy; "lru" without a plan). profile: a ``DeviceProfile`` or a
    path to one. predictors: names (a list or "a,b"; "plan": the plan's) replayed with the artifact's knobs
    and tensors on the trace's router inputs; they need ``plan`` to be an artifact and a project trace.
    cpu_misses: the loader's CPU rule (``cpu_miss_rule``: a rule, or never / always / "int4,int2"). Returns
    the replay and one ``SimResult`` per (group, capacity, policy).
    """
    from pathlib import Path


    rule = cpu_miss_rule(cpu_misses)
    if record_bytes is not None:  # before the trace is read: 0 must not fall back to the default below
        check_record_bytes(record_bytes)
    replay = load_replay(trace)
    if profile is not None and not isinstance(profile, DeviceProfile):
        profile = load_profile(profile)
    if isinstance(policies, str):
        policies = list(POLICY_NAMES) if policies.strip() == "all" else parse_list(policies, "--policy")
    for name in policies or ():
        if name not in POLICY_NAMES:
            raise MoeprepError(f"eviction policy {name!r} unknown; use one of {', '.join(POLICY_NAMES)} or 'all'")
    if plan is not None and capacity is not None:
        raise MoeprepError("give either --plan (capacities from the plan and a budget) or --capacity, not both")
    if plan is not None:
        if isinstance(plan, Plan):
            spec = plan_spec(plan, budget, _synthetic_sizes(plan, replay, record_bytes))
        else:
            path = Path(plan)
            if path.is_dir():
                if not (path / "manifest.json").is_file():
                    raise MoeprepError(f"{path} is not an artifact (no manifest.json); pass its plan.json or an artifact")
                spec = artifact_spec(path, budget)
            elif path.name == "plan.json" and (path.parent / "manifest.json").is_file():
                spec = artifact_spec(path.parent, budget)
            else:
                loaded = read_plan_file(path, fix="pass a plan.json or an artifact directory")
                spec = plan_spec(loaded, budget, _synthetic_sizes(loaded, replay, record_bytes))
        names, feed = _predictor_request(predictors, plan, trace)
        runs = []
        for p in (policies or [None]):
            chosen = _make_predictors(names, plan)
            runs.append(simulate(replay, spec, p, params if p != "belady" else None, profile, cold_start, chosen, feed,
                                 cpu_misses=rule))
        return replay, runs
    if predictors:
        raise MoeprepError("--predictors needs --plan ARTIFACT (its routers and predictors.safetensors)")
    if capacity is None:
        raise MoeprepError("give --plan PLAN.json, or --policy NAME with --capacity N (experts per layer)")
    if budget is not None:
        raise MoeprepError("--budget goes with --plan; with --capacity the cache holds N experts per layer")
    capacities_ = capacity if isinstance(capacity, list | tuple) else (
        parse_list(capacity, "--capacity", int) if isinstance(capacity, str) else [capacity])
    if not capacities_:
        raise MoeprepError("--capacity needs at least one number of experts per layer")
    return replay, sweep(replay, policies or ["lru"], capacities_, groups,
                         record_bytes or DEFAULT_RECORD_BYTES, precision, params, profile, cold_start, rule)


def _predictor_request(predictors, plan, trace) -> tuple[list[str], PredictionFeed | None]:
    from pathlib import Path


    if not predictors or predictors == "none":
        return [], None
    path = Path(plan) if not isinstance(plan, Plan) else None
    artifact = path.parent if path is not None and path.name == "plan.json" else path
    if artifact is None or not (artifact / "manifest.json").is_file():
        raise MoeprepError("--predictors needs --plan to be an artifact directory (its routers and predictors)")
    if predictors == "plan":
        names = [s.name for s in read_plan_file(artifact / "plan.json").predictors]
    else:
        names = parse_list(predictors, "--predictors") if isinstance(predictors, str) else list(predictors)
    if unknown := [n for n in names if n not in PREDICTORS]:
        raise MoeprepError(f"--predictors: unknown {unknown}; use any of {', '.join(PREDICTORS)}, 'plan' or 'none'")
    if not Path(trace).is_dir():
        raise MoeprepError("--predictors replays hidden-state inputs: give a project trace directory (the real "
                           "Mixtral traces hold expert ids only)")
    return names, prediction_feed(trace, artifact)


def _make_predictors(names: list[str], plan) -> list:
    from pathlib import Path


    if not names:
        return []
    path = Path(plan)
    knobs = {s.name: s.params for s in read_plan_file((path if path.is_dir() else path.parent) / "plan.json").predictors}
    return [make_predictor(n, knobs.get(n)) for n in names]


def parse_params(items) -> dict:
    """["w_lru=0.4", "shares=[[...]]"] -> {"w_lru": 0.4, ...}: each value JSON, else the plain string."""
    import json

    params = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise MoeprepError(f"--param {item!r} must be KEY=VALUE, e.g. --param w_lru=0.4")
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value
    return params
