"""The cost model: recorded routing replayed through the loader's own expert cache and schedule, timed with a
device profile (``loader/device.py``). The loader's ``moeload plan`` predicts decode tokens/s and time to first
token with it (``loader/fit.py``); the preparation's simulator and planner (``prep/sim``, ``prep/stages``)
call the same functions, so the plan a device team is shown and the plan the preparation tuned are modelled alike.

The decode replay (``simulate``) runs one call per token per MoE layer, as in decode:

    cache.clock.token = t                                 # the token's position in its sequence
    for each MoE layer l in order:
        schedule.routed(l, experts); predictors' prefetches -> schedule.prefetch(...)   (with predictors)
        served = schedule.serve(l, [token's experts at l], idx, w, ...)   # every miss placed, as in the loader
        for each decision served CACHE: cache.complete(entry)    # BUFFER: read into a buffer and used once
        schedule.end(l)

``serve`` protects all of a token's experts before any is admitted, so a token's experts are inserted together and
neither can evict the other. Each sequence starts cold unless ``cold_start=False``. The prefill replay
(``simulate_prefill``) runs a prompt in the loader's chunks (``loader/prefill.py``). Policies beyond the loader's
(the simulator's clairvoyant ``belady``) come in through ``simulate(..., extra_policies=...)``.

Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from loader.budget import Capacities, cache_layout, capacities
from loader.cache import ExpertCache, PoolConfig
from loader.device import DeviceProfile
from loader.errors import ModelingError
from loader.plan import Plan
from loader.policies import POLICIES, policy_factory
from loader.predict import ROUTING_ONLY, PredictorContext
from loader.prefill import PrefillSpec
from loader.routing import MISS_POLICIES, ROUTING_POLICIES, RoutingError
from loader.schedule import CACHE, CPU, HELD, PROMPT, CpuMissRule, LayerSchedule, PrefetchGate
from loader.vocab import DEFAULT_HOOKS

ROUTING_SAMPLE = "routing.safetensors"  # in an artifact: recorded routing to replay (``read_routing_sample``)
MAX_EXPERTS = 65536  # experts per layer a routing sample may name (a trace's bound, ``prep.methods.trace``)

@dataclass(frozen=True)
class Replay:
    """Recorded routing of one or more sequences.

    sequences[s][t][l] is the tuple of experts token t of sequence s used at MoE layer l, in the
    router's slot order (K of them, no repeats). weights[s][t][l], when recorded, are their combination
    weights in the same order (what routing and miss policies decide on).
    """

    sequences: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]  # [S][T][L] -> K experts
    num_layers: int
    num_experts: int
    top_k: int
    source: str = ""
    weights: tuple | None = None  # [S][T][L] -> K floats, aligned with sequences
    logits: tuple | None = None  # per sequence the router logits [T, L, E] (project traces hold them)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq) for seq in self.sequences)

    @property
    def requests(self) -> int:
        """Expert requests: one per (token, layer, distinct chosen expert)."""
        return sum(len(experts) for seq in self.sequences for token in seq for experts in token)


def replay_from_routing(traces: Sequence, num_experts: int | None = None, source: str = "") -> Replay:
    """A ``Replay`` from ``prep.methods.trace.RoutingTrace`` objects (expert_ids [T, L, K]) of one model.

    num_experts: E of the model (a whole number from 1 to ``MAX_EXPERTS``); None takes the largest expert id
    seen + 1. The sequences are routing already checked by their reader (``open_trace``, ``read_mixtral_traces``);
    what is checked here is what a caller can get wrong: the expert count, ids in range, finite weights.
    """
    where = source or "the trace"
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                    or not 1 <= num_experts <= MAX_EXPERTS):
        raise ModelingError(f"{where}: num_experts {num_experts!r} must be a whole number of experts per layer from "
                           f"1 to {MAX_EXPERTS}")
    if not traces:
        raise ModelingError(f"no routed sequences in {source or 'the trace'}; record a trace with tokens in it")
    shapes = {(t.num_layers, t.top_k) for t in traces}
    if len(shapes) != 1:
        raise ModelingError(f"the sequences of {source or 'the trace'} disagree on (layers, top-k): {sorted(shapes)}")
    num_layers, top_k = shapes.pop()
    sequences, weights = [], []
    seen_max = -1
    for trace in traces:
        if not torch.isfinite(trace.expert_weights).all():
            raise ModelingError(f"{where} holds non-finite gating weights (NaN or inf); record the trace again")
        rows = trace.expert_ids.tolist()  # [T][L][K]
        seq = tuple(tuple(tuple(dict.fromkeys(int(e) for e in experts)) for experts in token) for token in rows)
        mass = trace.expert_weights.tolist()
        weights.append(tuple(tuple(tuple(w[:len(experts)]) for experts, w in zip(token, m, strict=True))
                             for token, m in zip(seq, mass, strict=True)) if seq else ())
        for token in seq:
            for experts in token:
                seen_max = max(seen_max, *experts) if experts else seen_max
        if min((min(experts) for token in seq for experts in token if experts), default=0) < 0:
            raise ModelingError(f"{source or 'the trace'} has a negative expert id; record the trace again")
        if seq:
            sequences.append(seq)
        else:
            weights.pop()
    if not sequences:
        raise ModelingError(f"every sequence of {source or 'the trace'} is empty; nothing to replay")
    if num_experts is None:
        num_experts = seen_max + 1
        if num_experts > MAX_EXPERTS:
            raise ModelingError(f"{where} names expert {seen_max}, more than the {MAX_EXPERTS} experts per layer a "
                               "trace may have; record the trace again")
    elif seen_max >= num_experts:
        raise ModelingError(f"{source or 'the trace'} names expert {seen_max} but the model has {num_experts} experts")
    return Replay(tuple(sequences), num_layers, int(num_experts), top_k, source, tuple(weights))


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
        raise ModelingError(f"no record size for precisions {missing}; give the artifact's sizes")
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


def layer_reads(transfer: float, fixed: float, reads: int, workers: int) -> float:
    """Seconds a layer's ``reads`` reads take: their transfers one after another through the disk (the profile's
    bandwidth is the aggregate at the reads in flight), and the rest of each read (latency, the loader's own time,
    making the form) spread over the ``workers`` reader threads."""
    return transfer + fixed / max(1, min(workers, reads))


def policy_builder(policy: str, params: dict | None, extra_policies: dict | None = None):
    """(cache policy factory, the object told each sequence before it replays or None) for ``policy``: one of the
    loader's (``loader.policies``) or of ``extra_policies`` ({name: builder(params) -> (factory, lookahead)})."""
    if extra_policies and policy in extra_policies:
        return extra_policies[policy](params)
    try:
        return policy_factory(policy, params), None
    except ValueError as e:
        known = sorted(set(POLICIES) | set(extra_policies or ()))
        raise ModelingError(f"{e}; the cost model runs {', '.join(known)}") from None


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
             cpu_misses: CpuMissRule | None = None, extra_policies: dict | None = None, workers: int = 1) -> SimResult:
    """Replay ``replay`` through an ``ExpertCache`` built from ``spec`` with eviction ``policy``.

    policy: a name of ``loader.policies.POLICIES`` (or of ``extra_policies``, see ``policy_builder``) with
    ``params``; None takes the spec's (a plan's) eviction policy.
    Returns a ``SimResult``: hits, misses, joins and bytes read per MoE layer (a miss reads one record of
    its precision whether or not the cache keeps it), and with ``profile`` the modelled read and
    compute seconds (``loader.device``).

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
    known = (*POLICIES, *(extra_policies or ()))
    if policy not in known:
        raise ModelingError(f"eviction policy {policy!r} unknown; use one of {', '.join(known)}")
    if (replay.num_layers, replay.num_experts) != (spec.num_layers, spec.num_experts):
        raise ModelingError(f"the trace has {replay.num_layers} MoE layers x {replay.num_experts} experts but the "
                           f"cache is for {spec.num_layers} x {spec.num_experts}; use a plan made for this model")
    factory, future = policy_builder(policy, params, extra_policies)
    cache = ExpertCache(spec.pools, spec.num_layers, spec.num_experts, factory)
    routing, miss = _policies(spec, replay, routing, miss)
    if miss is not None:
        miss.view = cache.view
    predictors = list(predictors or [])
    if predictors:
        _bind_predictors(predictors, cache, spec, replay, feed)
    run = _DecodeReplay(spec, cache, profile, _Deciders(routing, miss, cpu_misses, predictors, feed), workers)
    for s, sequence in enumerate(replay.sequences):
        cache.clear() if cold_start else cache.reset()
        for p in predictors:
            p.reset()
        if future is not None:
            future.start(sequence)
        for t, token in enumerate(sequence):
            run.token(replay, s, t, token)
    for layer, counts in enumerate(run.layers):
        c = cache.counters[layer]
        counts.hits, counts.misses, counts.joins, counts.bytes_read = c.hits, c.misses, c.joins, c.bytes_read
        counts.prefetches, counts.prefetch_used, counts.prefetch_wasted = c.prefetches, c.prefetch_used, c.prefetch_wasted
        counts.skipped, counts.cpu_computed = c.skipped, c.cpu_computed
    return SimResult(policy, dict(params or {}), spec.capacity, spec.group, replay.source, len(replay.sequences),
                     replay.num_tokens, dict(spec.record_bytes), cold_start, run.layers, profile,
                     [p.name for p in predictors],
                     cpu_misses=cpu_misses.to_json() if cpu_misses is not None and not cpu_misses.off else None,
                     io_bound_seconds=run.io_bound)


@dataclass(frozen=True)
class _Deciders:
    """What decides besides the cache in ``simulate``: the routing and miss policies, the CPU rule, and the
    predictors with what they read."""

    routing: object
    miss: object
    cpu_misses: CpuMissRule | None
    predictors: list
    feed: PredictionFeed | None


class _DecodeReplay:
    """``simulate``'s state: the cache's schedule as the loader's step builds it, the per-layer results, and the
    modelled seconds of the token being replayed (its reads, demand and prefetch, and its layers' path)."""

    def __init__(self, spec: CacheSpec, cache: ExpertCache, profile: DeviceProfile | None, deciders: _Deciders,
                 workers: int) -> None:
        self.cache, self.profile, self.workers = cache, profile, workers
        self.routing, self.miss = deciders.routing, deciders.miss
        self.predictors, self.feed = deciders.predictors, deciders.feed
        self.record_bytes = spec.record_bytes
        self.slot_bytes = spec.slot_bytes if spec.slot_bytes is not None else spec.record_bytes
        self.schedule = LayerSchedule(cache, spec.expert_precision, deciders.miss, readable=spec.record_bytes,
                                      cpu_rule=deciders.cpu_misses,
                                      prefetch_gate=PrefetchGate() if deciders.predictors else None)  # as the loader's
        self.layers = [LayerResult() for _ in range(spec.num_layers)]
        self.token_io = [0.0, 0.0]
        self.io_bound = 0.0

    def token(self, replay: Replay, s: int, t: int, token) -> None:
        """One token of sequence ``s`` through every MoE layer, then the predictors' look past the last."""
        self.cache.clock.token = t
        self.token_io[0] = self.token_io[1] = 0.0
        for layer, experts in enumerate(token):
            idx = w = None
            if self.routing is not None or self.miss is not None:
                logits = replay.logits[s][t, layer][None] if replay.logits is not None else None
                experts, idx, w = _route(self.routing, replay.weights[s][t][layer], experts, layer, self.cache, logits)
            if self.predictors and self.schedule.prefetching:  # the router has decided: protect, then predict
                self.schedule.routed(layer, experts)
                x = self.feed.router_inputs[s][t, layer][None].float() if self.feed.router_inputs is not None else None
                chosen = torch.tensor([list(experts)])
                for p in self.predictors:
                    self.prefetch(p.after_router(layer, x, chosen))
            self.layer(layer, experts, idx, w)
        if self.predictors and self.schedule.prefetching and self.feed.head_inputs is not None:
            for p in self.predictors:
                self.prefetch(p.after_last_layer(self.feed.head_inputs[s][t][None].float()))
        profile = self.profile
        if profile is not None and profile.overlap:  # one disk: a token takes at least its reads
            self.io_bound += max(0.0, self.token_io[0] - self.token_io[1] - profile.token_overhead)

    def layer(self, layer: int, experts, idx, w) -> None:
        """One MoE layer call: the schedule serves it; hits compute while the misses' reads run."""
        profile, counts = self.profile, self.layers[layer]
        served = self.schedule.serve(layer, [experts], idx, w, slot_bytes=self.slot_bytes,
                                     read_bytes=self.record_bytes)
        counts.requests += len(served.decisions) + len(served.skipped)
        held_compute = transfer = fixed = 0.0
        n_reads = 0
        for d in served.decisions:
            compute = profile.compute(d.precision) if profile is not None else 0.0
            counts.compute_seconds += compute
            if d.served in (HELD, CPU):  # computed while the reads run
                held_compute += compute
                continue
            nbytes = self.record_bytes[d.precision]
            counts.demand_bytes += nbytes
            if d.served == CACHE:
                self.cache.complete(d.entry)
            if profile is not None:  # the read, then the held form made on the reader thread
                transfer += profile.transfer_seconds(nbytes)
                fixed += profile.read_seconds(nbytes) - profile.transfer_seconds(nbytes) + profile.make(d.precision)
                n_reads += 1
        if profile is not None:
            reads = layer_reads(transfer, fixed, n_reads, self.workers)
            # calibrated: the hits compute while the reads run; the layer waits for what is left
            stall = max(0.0, reads - held_compute) if profile.overlap else reads
            counts.read_seconds += stall
            counts.compute_seconds += profile.layer_overhead
            self.token_io[0] += reads
            self.token_io[1] += stall + profile.layer_overhead + sum(profile.compute(d.precision)
                                                                     for d in served.decisions)
        self.schedule.end(layer)

    def prefetch(self, requests) -> None:
        """A predictor's requests admitted; each modelled as landing before its layer runs, its read and form
        made on a reader thread behind compute."""
        for entry in self.schedule.prefetch(requests, self.slot_bytes):
            self.cache.count_read(entry.layer, self.record_bytes[entry.precision])
            self.cache.complete(entry)
            if self.profile is not None:
                seconds = self.profile.read_seconds(self.record_bytes[entry.precision]) + self.profile.make(entry.precision)
                self.layers[entry.layer].prefetch_read_seconds += seconds
                self.token_io[0] += seconds


def _policies(spec: CacheSpec, replay: Replay, routing, miss):
    """(routing, miss) policy objects: the given ones, else the spec's (None for the defaults)."""

    def build(given, named, registry, what):
        if given is not None:
            return given
        name, params = named
        if name in DEFAULT_HOOKS and not params:
            return None
        if name not in registry:
            raise ModelingError(f"the plan's {what} {name!r} is unknown to this moeprep (known: {sorted(registry)})")
        try:
            return registry[name](**params)
        except (TypeError, RoutingError) as e:
            raise ModelingError(f"the plan's {what} {name!r}: {e}") from None

    routing = build(routing, spec.routing, ROUTING_POLICIES, "routing policy")
    miss = build(miss, spec.miss, MISS_POLICIES, "miss policy")
    if (routing is not None or miss is not None) and replay.weights is None:
        raise ModelingError(f"{replay.source or 'the replay'} holds no routing weights, which the plan's routing and "
                           "miss policies decide on; replay a trace that records them")
    if routing is not None:
        routing.bind(spec.num_layers)
    if miss is not None:
        miss.bind(spec.num_layers, spec.num_experts)
    return routing, miss


def _route(routing, weights: tuple, experts: tuple, layer: int, cache: ExpertCache, logits=None):
    """(the experts wanted, indices [1, K], weights [1, K]) of one token at one layer after ``routing``
    (logits [1, E]: the recorded router logits, for policies that re-rank)."""
    idx, w = torch.tensor([list(experts)]), torch.tensor([list(weights)], dtype=torch.float32)
    if routing is not None:
        w, idx = routing.route(layer, logits, w, idx, cache.view(layer))
    return tuple(e for e, x in zip(idx[0].tolist(), w[0].tolist(), strict=True) if x != 0), idx, w


def _bind_predictors(predictors: list, cache: ExpertCache, spec: CacheSpec, replay: Replay,
                     feed: PredictionFeed | None) -> None:

    if feed is None:
        raise ModelingError("predictors need what they read: simulate a project trace (router inputs) with an "
                           "artifact (routers and predictors.safetensors)")
    if feed.router_inputs is None:
        if reading := [p.name for p in predictors if p.name not in ROUTING_ONLY]:
            raise ModelingError(f"the predictors {reading} read router inputs, which this replay (routing only) "
                               f"lacks; replay only {list(ROUTING_ONLY)}, or trace the model itself")
    elif len(feed.router_inputs) != len(replay.sequences):
        raise ModelingError(f"the prediction feed has {len(feed.router_inputs)} sequences, the replay "
                           f"{len(replay.sequences)}; build both from one trace")
    if feed.head_inputs is None and any(p.name == "first_gate" for p in predictors):
        raise ModelingError("first_gate needs the LM head's input, which this trace lacks (recorded before "
                           "moeprep kept it); record the trace again (`moeprep prepare --force trace`)")
    context = PredictorContext(spec.num_layers, spec.num_experts, replay.top_k, feed.routers, feed.tensors,
                               held=lambda layer, expert, p: cache.find(layer, expert, p) is not None,
                               precision_of=lambda layer, expert: spec.expert_precision[layer][expert])
    for p in predictors:
        p.bind(context)


# ------------------------------------------------------------------------------------------ prefill


@dataclass
class PrefillModel:
    """A modelled prefill: its tokens and chunks, seconds (experts' steps and per-token overhead), reads."""

    tokens: int
    chunks: int
    seconds: float
    step_seconds: float  # the MoE layer steps (compute and reads)
    compute_seconds: float  # every expert's compute
    read_seconds: float  # every read and form made (on reader threads)
    layer_overhead_seconds: float  # the profile's per layer step
    token_overhead_seconds: float  # the calibration's per prompt token
    reads: int
    read_bytes: int
    prefill_form_computes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict:
        return asdict(self) | {"tokens_per_second": self.tokens_per_second}


def prompt_routing(replay: Replay, tokens: int) -> list:
    """The first ``tokens`` tokens' routing ([T][L] -> experts): the replay's sequences one after another, again
    from the first where they run out."""
    flat = [token for sequence in replay.sequences for token in sequence]
    if not flat:
        raise ModelingError("the trace holds no token to model a prefill with; record routing traces first")
    return [flat[i % len(flat)] for i in range(tokens)]


def expert_seconds(profile: DeviceProfile, precision: str, form: str | None, tokens: int) -> float:
    """One expert's compute for ``tokens`` tokens in ``form``: the profile's prefill timings linearly interpolated
    between its token counts (past the largest, at its per-token rate); without them, ``tokens`` decode steps."""
    timed = profile.prefill_seconds.get(precision, {}).get(form) if form is not None else None
    if not timed:
        return tokens * profile.compute(precision)
    points = sorted((int(t), s) for t, s in timed["tokens"].items())
    if tokens <= points[0][0]:
        return points[0][1] * tokens / points[0][0]
    for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False):
        if tokens <= t1:
            return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
    last, seconds = points[-1]
    return seconds * tokens / last


def make_seconds(profile: DeviceProfile, precision: str, form: str | None) -> float:
    """Making ``form`` from a record: its prefill timing, else the profile's held-form make time."""
    timed = profile.prefill_seconds.get(precision, {}).get(form) if form is not None else None
    return timed["make_s"] if timed else profile.make(precision)


def held_form_of(profile: DeviceProfile, precision: str) -> str | None:
    """The held form the profile timed first for ``precision`` (``measure_prefill`` times the held form first)."""
    timed = profile.prefill_seconds.get(precision, {})
    return next(iter(timed), None)


def simulate_prefill(replay: Replay, spec: CacheSpec, profile: DeviceProfile, tokens: int, chunks: list[int],
                     prefill: PrefillSpec | None = None, held_forms: dict | None = None,
                     workers: int = 1) -> PrefillModel:
    """Model a prompt of ``tokens`` tokens run as ``chunks`` (their sizes: ``loader.prefill.chunk_sizes``) on the
    cache of ``spec``, starting cold. ``prefill``: the plan's prefill forms; ``held_forms``: precision -> the held
    form (default: the one the profile timed first)."""
    if sum(chunks) != tokens:
        raise ModelingError(f"the chunks {chunks[:5]}... add up to {sum(chunks)} tokens, not the prompt's {tokens}")
    prefill = prefill or PrefillSpec()
    routing = prompt_routing(replay, tokens)
    cache = ExpertCache(spec.pools, spec.num_layers, spec.num_experts, policy_builder(*spec.eviction)[0])
    record_bytes = spec.record_bytes
    slot_bytes = spec.slot_bytes if spec.slot_bytes is not None else record_bytes
    schedule = LayerSchedule(cache, spec.expert_precision, None, readable=record_bytes)
    held = {p: (held_forms or {}).get(p) or held_form_of(profile, p) for p in record_bytes}
    in_prefill_form = {p: f for p in record_bytes if (f := prefill.form_for(p)) is not None and f.form != held[p]}
    prompt_forms = {p: f.from_tokens for p, f in in_prefill_form.items()}
    step = compute = reads_s = overhead = 0.0
    reads = read_bytes = in_form = 0
    done = 0
    for size in chunks:
        chunk = routing[done:done + size]
        cache.clock.token = done + size - 1
        for layer in range(spec.num_layers):
            rows = [list(token[layer]) for token in chunk]
            given: dict = {}
            for row in rows:
                for e in row:
                    given[e] = given.get(e, 0) + 1
            served = schedule.serve(layer, rows, slot_bytes=slot_bytes, read_bytes=record_bytes,
                                    prompt_forms=prompt_forms or None)
            all_compute = transfer = fixed = last = 0.0
            n_reads = 0
            for d in served.decisions:
                n = given.get(d.expert, 0)
                form = held[d.precision]
                if not d.miss:
                    all_compute += expert_seconds(profile, d.precision, form, n)
                    continue
                nbytes = record_bytes[d.precision]
                if d.served == PROMPT:  # read once into a prefill buffer, not cached
                    form = in_prefill_form[d.precision].form
                    in_form += 1
                elif d.served == CACHE:
                    cache.complete(d.entry)
                seconds = expert_seconds(profile, d.precision, form, n)
                all_compute += seconds
                last = seconds
                transfer += profile.transfer_seconds(nbytes)
                fixed += profile.read_seconds(nbytes) - profile.transfer_seconds(nbytes) + make_seconds(profile, d.precision, form)
                n_reads += 1
                reads += 1
                read_bytes += nbytes
            schedule.end(layer)
            layer_read = layer_reads(transfer, fixed, n_reads, workers)
            step += max(all_compute, layer_read + last)
            compute += all_compute
            reads_s += layer_read
            overhead += profile.layer_overhead
        done += size
    token_overhead = float(profile.calibration.get("prefill_token_overhead_s", 0.0)) * tokens
    return PrefillModel(tokens, len(chunks), step + overhead + token_overhead, step, compute, reads_s, overhead,
                        token_overhead, reads, read_bytes, in_form)


def plan_prefill(replay: Replay, plan: Plan, spec: CacheSpec, profile: DeviceProfile, tokens: int, chunk: int,
                 held_forms: dict | None = None) -> PrefillModel:
    """``simulate_prefill`` for ``plan`` with the prompt cut into chunks of ``chunk`` tokens (the budget's)."""
    chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    return simulate_prefill(replay, spec, profile, tokens, chunks, plan.prefill, held_forms)



# --------------------------------------------------------------------------------- the artifact's routing sample


ROUTING_FIX = "prepare the artifact again (`moeprep prepare`)"
GIVEN_ROUTING_FIX = ("record it again: expert_ids (integers) and weights (floats) [T, L, K], optional sequence_lengths "
                     "[S], logits [T, L, E], router_inputs [T, L, H] and head_inputs [T, H]")
MAX_SAMPLE_TOKENS = 1 << 20  # tokens a routing file may hold (the artifact's carries 1,024)
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def read_routing_sample(manifest, path=None) -> tuple[Replay, PredictionFeed | None]:
    """The one reader of a routing sample: the one an artifact carries (``routing.safetensors``, written by ``moeprep
    prepare``'s package stage), sealed by the manifest (``loader.format.sealed_file``), or ``path``, another file of
    the same tensors (``--routing``: routing recorded on the device's workload; without ``sequence_lengths``, one
    sequence). Every tensor is checked against the model (``routing_problem``: dtypes, shapes, expert ids in range,
    finite non-negative weights, finite logits and router inputs) before it is replayed. Returns a ``Replay`` and what
    the plan's predictors read when the sample holds the routers' inputs (else None); any refusal is one
    ModelingError naming the file (an ArtifactError for a sealed file that does not match its manifest)."""
    from loader.format import sealed_file

    if path is None and ROUTING_SAMPLE not in manifest.files:
        raise ModelingError(f"{manifest.root} carries no routing sample ({ROUTING_SAMPLE}: artifacts packaged before "
                            "package stage version 11 lack it); prepare it again, or pass --routing FILE")
    fix = ROUTING_FIX if path is None else GIVEN_ROUTING_FIX
    path = sealed_file(manifest, ROUTING_SAMPLE) if path is None else Path(path)
    where = f"routing sample {path}"
    tensors = _routing_tensors(path, where, fix)
    moe = manifest.moe
    if problem := routing_problem(tensors, len(moe.layers), moe.num_experts, moe.top_k):
        raise ModelingError(f"{where}: {problem}; {fix}")
    ids, weights = tensors["expert_ids"], tensors["weights"]
    lengths = tensors["sequence_lengths"].tolist() if "sequence_lengths" in tensors else [int(ids.shape[0])]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    slices = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    traces = [_Routing(len(moe.layers), moe.top_k, ids[s].long(), weights[s].float()) for s in slices]
    replay = replay_from_routing(traces, moe.num_experts, str(path))
    if "logits" in tensors:
        replay = dataclasses.replace(replay, logits=tuple(tensors["logits"][s].float() for s in slices))
    feed = None
    if "router_inputs" in tensors:
        routers, predictor_tensors = _prediction_inputs(manifest)
        width = {tuple(w.shape) for w, _ in routers}
        if width != {(moe.num_experts, tensors["router_inputs"].shape[-1])}:
            raise ModelingError(f"{where}: router_inputs {tuple(tensors['router_inputs'].shape)} do not fit the "
                                f"routers' weights {sorted(width)} [E, H]; {fix}")
        inputs, heads = tensors["router_inputs"], tensors.get("head_inputs")
        feed = PredictionFeed([inputs[s].float() for s in slices],
                              [heads[s].float() for s in slices] if heads is not None else None,
                              routers, predictor_tensors)
    return replay, feed


def _routing_tensors(path: Path, where: str, fix: str) -> dict:
    """The tensors of a routing file, read as safetensors; anything unreadable is one ModelingError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ModelingError(f"{where} " + ("does not exist" if not path.exists() else "is not a regular file")
                            + f"; {fix}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise ModelingError(f"{where} cannot be read as safetensors ({type(e).__name__}: {str(e)[:200]}); "
                            f"{fix}") from None


def routing_problem(tensors: dict, layers: int, experts: int, top_k: int) -> str | None:
    """What is wrong with a routing sample's tensors for a model of ``layers`` MoE layers, ``experts`` experts and
    top-``top_k`` (None: nothing): expert_ids integers [T, L, K] naming experts 0 to E-1, each token's K distinct;
    weights floats of the same shape, finite and never negative; sequence_lengths whole numbers >= 1 adding up to T;
    logits [T, L, E], router_inputs [T, L, H] and head_inputs [T, H] finite floats."""
    ids, weights = tensors.get("expert_ids"), tensors.get("weights")
    if ids is None or weights is None:
        return f"it holds no {'expert_ids' if ids is None else 'weights'} tensor"
    if ids.dtype not in _INTEGER_DTYPES:
        return f"expert_ids are {ids.dtype}, not integers"
    if ids.dim() != 3 or tuple(ids.shape[1:]) != (layers, top_k) or not 1 <= ids.shape[0] <= MAX_SAMPLE_TOKENS:
        return (f"expert_ids are {list(ids.shape)}, not [T, {layers}, {top_k}] ({layers} MoE layers x top-{top_k}, "
                f"T from 1 to {MAX_SAMPLE_TOKENS:,} tokens)")
    tokens = int(ids.shape[0])
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= experts:
        return f"expert_ids name experts {low} to {high}; the model's are 0 to {experts - 1}"
    if top_k > 1 and bool((ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        return "expert_ids name one expert twice for a token at a layer"
    if not weights.is_floating_point() or tuple(weights.shape) != tuple(ids.shape):
        return f"weights are {weights.dtype} {list(weights.shape)}, not floats of expert_ids' {list(ids.shape)}"
    if not bool(torch.isfinite(weights).all()):
        return "weights hold NaN or infinite gating weights"
    if bool((weights < 0).any()):
        return "weights hold negative gating weights"
    if "sequence_lengths" in tensors:
        lengths = tensors["sequence_lengths"]
        if (lengths.dtype not in _INTEGER_DTYPES or lengths.dim() != 1 or lengths.numel() == 0
                or int(lengths.min()) < 1 or int(lengths.sum()) != tokens):
            return (f"sequence_lengths {lengths.tolist()[:4]} ({lengths.dtype}) are not whole numbers >= 1 adding up "
                    f"to the {tokens} tokens")
    for name, lead in (("logits", (tokens, layers, experts)), ("router_inputs", (tokens, layers)),
                       ("head_inputs", (tokens,))):
        if (x := tensors.get(name)) is None:
            continue
        if not x.is_floating_point() or tuple(x.shape[:len(lead)]) != lead or x.dim() != (3 if name != "head_inputs" else 2):
            shape = {"logits": f"[{tokens}, {layers}, {experts}]", "router_inputs": f"[{tokens}, {layers}, H]",
                     "head_inputs": f"[{tokens}, H]"}[name]
            return f"{name} are {x.dtype} {list(x.shape)}, not floats {shape}"
        if not bool(torch.isfinite(x).all()):
            return f"{name} hold NaN or infinite values"
    if "head_inputs" in tensors and "router_inputs" not in tensors:
        return "head_inputs come without router_inputs"
    return None


def _prediction_inputs(manifest) -> tuple[list, dict]:
    """The routers (weight [E, H], bias or None per MoE layer) and the predictor tensors the plan's predictors read,
    from their sealed files (``loader.format.sealed_file``); the predictor tensors checked as ``load`` checks them
    (``loader.binding.read_predictor_tensors``)."""
    from safetensors import safe_open

    from loader.binding import read_predictor_tensors
    from loader.format import DENSE, sealed_file
    from loader.predict import PREDICTORS_FILE

    routers = []
    with safe_open(str(sealed_file(manifest, DENSE)), framework="pt") as f:
        names = set(f.keys())
        for module in manifest.moe.router_modules:
            bias = f"{module}.bias"
            routers.append((f.get_tensor(f"{module}.weight").float(),
                            f.get_tensor(bias).float() if bias in names else None))
    if PREDICTORS_FILE in manifest.files:
        sealed_file(manifest, PREDICTORS_FILE)
    return routers, read_predictor_tensors(manifest)


def first_tokens(replay: Replay, feed: PredictionFeed | None, tokens: int) -> tuple[Replay, PredictionFeed | None]:
    """The first ``tokens`` tokens of ``replay`` (whole sequences, the last one cut) and of its feed."""
    keep, total = [], 0
    for sequence in replay.sequences:
        if total >= tokens:
            break
        keep.append(min(len(sequence), tokens - total))
        total += keep[-1]
    cut = slice(0, len(keep))
    replay = dataclasses.replace(
        replay, sequences=tuple(seq[:n] for seq, n in zip(replay.sequences[cut], keep, strict=True)),
        weights=tuple(w[:n] for w, n in zip(replay.weights[cut], keep, strict=True)) if replay.weights else None,
        logits=tuple(x[:n] for x, n in zip(replay.logits[cut], keep, strict=True)) if replay.logits else None)
    if feed is not None and feed.router_inputs is not None:
        feed = dataclasses.replace(
            feed, router_inputs=[x[:n] for x, n in zip(feed.router_inputs[cut], keep, strict=True)],
            head_inputs=[x[:n] for x, n in zip(feed.head_inputs[cut], keep, strict=True)] if feed.head_inputs else None)
    return replay, feed


@dataclass(frozen=True)
class _Routing:
    """One sequence of a routing sample, shaped as ``replay_from_routing`` reads it."""

    num_layers: int
    top_k: int
    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
