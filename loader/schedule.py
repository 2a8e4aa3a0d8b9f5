"""The layer schedule: the rules around the expert cache that decide what one MoE layer call reads and
computes. Torch-free, and the one implementation: the loader's steps (``loader/step.py``,
``loader/neuron.py``) and the simulator (``prep/sim/simulate.py``) both call it, so what the simulator
counts is what the loader does.

Per MoE layer call, in order:

1. ``routed(layer, experts)``: the router has chosen; its experts are protected before any predictor's
   prefetch may make room (only where predictors run);
2. ``begin(layer, rows, ...)``: the wanted experts (``ordered_experts``: token by token, best-weighted
   first, first use wins) are classified by the cache (hit, join of a read in flight, miss); each miss goes
   to the miss policy, which keeps its planned precision, lowers it (a held lower copy then serves it) or
   skips it; then, in a one-token step, the CPU rule (``CpuMissRule``) may serve a miss on the CPU from
   the host store instead (``Decision.served == "cpu"``: counted, not admitted, nothing read or cached);
   every computed expert is recorded as used at the precision it is computed at. Returns the ``Decision``
   per computed expert and the skipped experts;
3. per decision without an entry that is read (not served on the CPU), in order, ``admit``: room is made
   in the pool (or None: the read goes to a read buffer and is used once); the read's bytes are counted
   either way;
4. ``end(layer)``: protection ends; an unused prefetch for the layer is wasted.

``prefetch(requests, slot_bytes)`` is the admission of a predictor's requests at any time: a request for
a precision the artifact has no store or pool for, or outside the model, is dropped; the rest are
protected together, then admitted unless held.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.cache import Entry, ExpertCache
from loader.errors import LoaderError
from loader.vocab import CPU_MISSES, SKIP

READ = "read"  # a decision computed from its entry, or from a read of its record (into the cache or a buffer)
CPU = "cpu"  # a miss computed on the CPU from the host store's record: nothing read, nothing cached


def ordered_experts(indices, num_experts: int) -> list[int]:
    """The experts a layer call needs (``indices`` [T][K], token by token, best-weighted first; -1 or an
    out-of-range id is no expert), in first-use order."""
    seen: dict[int, None] = {}
    for row in indices:
        for e in row:
            if 0 <= e < num_experts:
                seen.setdefault(e, None)
    return list(seen)


@dataclass(frozen=True)
class Decision:
    """One expert a layer computes: at ``precision``, from ``entry`` (held or being read; None: a miss),
    ``served`` by a read (``READ``: the entry, or a read of the record) or on the CPU (``CPU``: a miss only)."""

    expert: int
    precision: str
    entry: Entry | None
    served: str = READ


@dataclass(frozen=True)
class CpuMissRule:
    """Which misses of a one-token (decode) step are computed on the CPU from the host store's record
    instead of copied to the device, the switch Fiddler, ktransformers and llama.cpp make: ``always`` every
    one, ``auto`` those whose precision is in ``prefer`` (where the CPU measured faster at load:
    ``loader.step.MissCosts``), ``never`` none. A plain value, so the loader and the simulator share it."""

    mode: str = "never"
    prefer: frozenset = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in CPU_MISSES:
            raise LoaderError(f"cpu_misses {self.mode!r} unknown; use one of {', '.join(CPU_MISSES)}")
        object.__setattr__(self, "prefer", frozenset(self.prefer))

    @property
    def off(self) -> bool:
        """Serves nothing on the CPU (``never``, or ``auto`` where no precision was faster there)."""
        return self.mode == "never" or (self.mode == "auto" and not self.prefer)

    def serves(self, precision: str) -> bool:
        """Whether a miss at ``precision`` of a one-token step is computed on the CPU."""
        return self.mode == "always" or (self.mode == "auto" and precision in self.prefer)

    def to_json(self) -> dict:
        return {"mode": self.mode, "prefer": sorted(self.prefer)}


@dataclass(frozen=True)
class PrefetchGate:
    """Prefetch reads are issued only while they pay. A wasted prefetch costs a whole read of the one disk, and a
    used one saves at most that read's wait, so once ``warmup`` prefetches have been used or wasted, reads stop
    for good when fewer than ``floor`` of them were used. Decided on the cache's own counters at the end of each
    layer call (a plan with deep predictions issues a few hundred in its first token), so the loader and the
    simulator stop at the same layer."""

    floor: float = 0.5
    warmup: int = 64

    def pays(self, cache: ExpertCache) -> bool:
        used = sum(c.prefetch_used for c in cache.counters)
        decided = used + sum(c.prefetch_wasted for c in cache.counters)
        return decided < self.warmup or used >= self.floor * decided


class LayerSchedule:
    """The rules of one cache, its plan's precisions, its miss policy (None: read the planned one), its
    CPU rule (None: every miss is read) and its prefetch gate (None: every admitted prediction is read)."""

    def __init__(self, cache: ExpertCache, expert_precision, miss_policy=None, readable=None,
                 cpu_rule: CpuMissRule | None = None, prefetch_gate: PrefetchGate | None = None) -> None:
        self.cache = cache
        self.expert_precision = expert_precision  # [L][E] the planned precision of each expert
        self.miss_policy = miss_policy
        self.readable = set(readable) if readable is not None else None  # precisions a miss can read
        self.cpu_rule = cpu_rule
        self.prefetch_gate = prefetch_gate
        self.prefetching = True  # False once the gate has closed: no prediction is read (or computed) any more

    def routed(self, layer: int, experts) -> None:
        for expert in experts:
            if 0 <= expert < self.cache.num_experts:
                self.cache.protect(layer, expert)

    def prefetched(self, layer: int) -> dict[int, Entry]:
        """The layer's entries still marked as prefetched (call before ``begin``, which clears the marks)."""
        return {e.expert: e for e in self.cache.layer_entries(layer) if e.prefetched}

    def begin(self, layer: int, rows, top_k_index=None, top_k_weights=None,
              cpu: bool = True) -> tuple[list[Decision], list[int]]:
        """``rows`` [T][K] expert ids (-1: dropped by the routing policy). top_k_index / top_k_weights: what
        the miss policy decides on (opaque here). cpu: whether the caller's step can serve a miss on the CPU
        (the neuron step, which reads partial records, cannot). Returns (decisions in visiting order, skipped
        experts)."""
        cache, planned = self.cache, self.expert_precision[layer]
        wanted = [(e, planned[e]) for e in ordered_experts(rows, cache.num_experts)]
        rule = self.cpu_rule
        on_cpu = rule if cpu and len(rows) == 1 and rule is not None and not rule.off else None  # decode only
        decisions, skipped = [], []
        for req in cache.begin_layer(layer, wanted):
            entry, precision = req.entry, req.precision
            if req.kind == "miss" and self.miss_policy is not None:
                precision = self.miss_policy.decide(layer, req.expert, req.precision, top_k_index, top_k_weights)
                if precision == SKIP:
                    cache.skip(layer, req.expert)
                    skipped.append(req.expert)
                    continue
                if precision != req.precision:  # a lower copy may be held already
                    entry = cache.find(layer, req.expert, precision)
            if entry is None and self.readable is not None and precision not in self.readable:
                raise LoaderError(f"the miss policy asked for precision {precision!r}, which the artifact has no "
                                  f"store for (stores: {sorted(self.readable)})")
            precision = entry.precision if entry is not None else precision
            served = READ
            if entry is None and on_cpu is not None and on_cpu.serves(precision):
                served = CPU
                cache.count_cpu(layer)
            cache.use(layer, req.expert, precision)
            decisions.append(Decision(req.expert, precision, entry, served))
        return decisions, skipped

    def admit(self, layer: int, expert: int, precision: str, slot_bytes: int, read_bytes: int) -> Entry | None:
        """A miss to read: its entry in the pool, or None (a read buffer); ``read_bytes`` counted either way."""
        entry = self.cache.admit(layer, expert, precision, slot_bytes)
        self.cache.count_read(layer, read_bytes)
        return entry

    def prefetch(self, requests, slot_bytes: dict) -> list[Entry]:
        """Predicted experts (``loader.predict.PrefetchRequest``: layer, expert, precision or None for the
        planned one) -> the entries admitted, to be read. The caller counts their reads. Nothing once the
        prefetch gate has closed."""
        if not self.prefetching:
            return []
        cache, wanted = self.cache, []
        for r in requests:
            if not (0 <= r.layer < cache.num_layers and 0 <= r.expert < cache.num_experts):
                continue
            precision = r.precision or self.expert_precision[r.layer][r.expert]
            if precision in slot_bytes and cache.pool_for(precision, slot_bytes[precision]) is not None:
                wanted.append((r.layer, r.expert, precision, slot_bytes[precision]))
        return cache.prefetch(wanted)

    def end(self, layer: int) -> None:
        self.cache.end_layer(layer)
        if self.prefetching and self.prefetch_gate is not None:
            self.prefetching = self.prefetch_gate.pays(self.cache)
