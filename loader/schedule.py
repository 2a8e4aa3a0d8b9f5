"""The layer schedule: the rules around the expert cache that decide what one MoE layer call reads and
computes. Torch-free, and the one implementation: the loader's steps (``loader/step.py``,
``loader/neuron.py``) and the cost model (``loader/simulate.py``) all call ``serve``, so what the cost model
counts is what the loader does.

Per MoE layer call, in order:

1. ``routed(layer, experts)``: the router has chosen; its experts are protected before any predictor's
   prefetch may make room (only where predictors run);
2. ``serve(layer, rows, ...)`` decides how each wanted expert is served (``Decision.served``):

   a. the wanted experts (``ordered_experts``: token by token, best-weighted first, first use wins) are
      classified by the cache: ``HELD`` (a hit, or a join of a read in flight) or a miss; each miss goes to
      the miss policy, which keeps its planned precision, lowers it (a held lower copy then serves it) or
      skips it (listed in ``skipped``); in a one-token step the CPU rule (``CpuMissRule``) may serve a miss
      on the CPU from the host store (``CPU``: counted, nothing read or cached); every computed expert is
      recorded as used at the precision it is computed at;
   b. cancellation: a prefetch for this layer that the router did not choose and whose read has not
      started is cancelled (where the caller can cancel reads: the loader; the cost model's prefetches
      have always landed);
   c. each miss left is placed, in order: in a prompt chunk, one given to at least its precision's
      ``from_tokens`` tokens is read once in the prefill form (``PROMPT``, not cached); otherwise room is
      made in its pool (``CACHE``, the admitted entry) or, where nothing can be evicted, it is read into a
      read buffer and used once (``BUFFER``). The bytes of every read are counted.

3. ``end(layer)``: protection ends; an unused prefetch for the layer is wasted.

``prefetch(requests, slot_bytes)`` is the admission of a predictor's requests at any time: a request for
a precision the artifact has no store or pool for, or outside the model, is dropped; the rest are
protected together, then admitted unless held. ``begin`` and ``admit`` are steps a and c on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loader.cache import Entry, ExpertCache
from loader.errors import LoaderError
from loader.vocab import CPU_MISSES, SKIP

HELD = "held"  # computed from its entry: resident, or a read in flight joined
READ = "read"  # a miss to read, not yet placed (``begin``; ``serve`` places it: CACHE, BUFFER or PROMPT)
CACHE = "cache"  # a miss read into the entry admitted for it in its pool
BUFFER = "buffer"  # a miss read into a read buffer and used once (nothing in its pool could be evicted)
PROMPT = "prompt"  # a miss of a prompt chunk read once into a prefill buffer, in its precision's prefill form
CPU = "cpu"  # a miss computed on the CPU from the host store's record: nothing read, nothing cached


def _token_counts(rows) -> dict[int, int]:
    """expert -> how many of a call's tokens it is given (rows [T][K])."""
    given: dict[int, int] = {}
    for row in rows:
        for e in row:
            given[e] = given.get(e, 0) + 1
    return given


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
    """One expert a layer computes, at ``precision``, and how it is ``served``: ``HELD`` from ``entry`` (resident
    or being read), or a miss: ``CACHE`` (``entry`` is the one admitted for its read), ``BUFFER``, ``PROMPT``,
    ``CPU`` (``entry`` None), or ``READ`` (not placed yet: ``begin`` alone)."""

    expert: int
    precision: str
    entry: Entry | None
    served: str = HELD

    @property
    def miss(self) -> bool:
        return self.served != HELD


@dataclass(slots=True)
class Served:
    """What ``serve`` decided for one layer call: the decisions in visiting order, the experts the miss policy
    skipped, and the layer's prefetched entries as they stood before the call (the loader counts what they saved)."""

    decisions: list
    skipped: list
    prefetched: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CpuMissRule:
    """Which misses of a one-token (decode) step are computed on the CPU from the host store's record
    instead of copied to the device, the switch Fiddler, ktransformers and llama.cpp make: ``always`` every
    one, ``auto`` those whose precision is in ``prefer`` (where the CPU measured faster at load:
    ``loader.engine.MissCosts``), ``never`` none. A plain value, so the loader and the simulator share it."""

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
            served = HELD if entry is not None else READ
            if entry is None and on_cpu is not None and on_cpu.serves(precision):
                served = CPU
                cache.count_cpu(layer)
            cache.use(layer, req.expert, precision)
            decisions.append(Decision(req.expert, precision, entry, served))
        return decisions, skipped

    def serve(self, layer: int, rows, top_k_index=None, top_k_weights=None, *, cpu: bool = True,
              slot_bytes: dict, read_bytes: dict, prompt_forms: dict | None = None,
              cancel: Callable[[Entry], bool] | None = None) -> Served:
        """The layer call's decisions, every miss placed (steps a to c of the module's docstring).

        rows, top_k_index, top_k_weights, cpu: as ``begin``. slot_bytes / read_bytes: per precision, a slot's and a
        read's bytes; a precision missing from ``read_bytes`` is counted by the caller (the neuron step reads parts
        of records). prompt_forms: precision -> from tokens, the prefill forms of a prompt chunk (None: not one).
        cancel(entry) -> whether the read of an in-flight prefetch could still be stopped (None: never)."""
        prefetched = self.prefetched(layer) if cancel is not None else {}
        decisions, skipped = self.begin(layer, rows, top_k_index, top_k_weights, cpu)
        if cancel is not None and prefetched:
            self.cancel_unwanted(prefetched, {d.expert for d in decisions} | set(skipped), cancel)
        given = _token_counts(rows) if prompt_forms else {}
        placed = []
        for d in decisions:
            if d.served == READ:
                d = self._place(layer, d, slot_bytes, read_bytes, prompt_forms, given)
            placed.append(d)
        return Served(placed, skipped, prefetched)

    def cancel_unwanted(self, prefetched: dict, wanted: set, cancel: Callable[[Entry], bool]) -> None:
        """The router has decided: a prefetch for the layer that was not chosen and whose read has not started is
        cancelled (its slot freed); one already read or reading is left to land (and is wasted)."""
        for expert, entry in prefetched.items():
            if expert not in wanted and entry.in_flight and cancel(entry):
                self.cache.cancel(entry)

    def _place(self, layer: int, d: Decision, slot_bytes: dict, read_bytes: dict, prompt_forms: dict | None,
               given: dict) -> Decision:
        nbytes = read_bytes.get(d.precision, 0)
        if prompt_forms and d.precision in prompt_forms and given.get(d.expert, 0) >= prompt_forms[d.precision]:
            self.cache.count_read(layer, nbytes)
            return Decision(d.expert, d.precision, None, PROMPT)
        entry = self.admit(layer, d.expert, d.precision, slot_bytes[d.precision], nbytes)
        return Decision(d.expert, d.precision, entry, CACHE if entry is not None else BUFFER)

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
