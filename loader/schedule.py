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
   skips it; every computed expert is recorded as used at the precision it is computed at. Returns the
   ``Decision`` per computed expert and the skipped experts;
3. per decision without an entry, in order, ``admit``: room is made in the pool (or None: the read goes to
   a read buffer and is used once); the read's bytes are counted either way;
4. ``end(layer)``: protection ends; an unused prefetch for the layer is wasted.

``prefetch(requests, slot_bytes)`` is the admission of a predictor's requests at any time: a request for
a precision the artifact has no store or pool for, or outside the model, is dropped; the rest are
protected together, then admitted unless held.
"""

from __future__ import annotations

from dataclasses import dataclass

from loader.cache import Entry, ExpertCache
from loader.errors import LoaderError
from loader.vocab import SKIP


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
    """One expert a layer computes: at ``precision``, from ``entry`` (held or being read; None: read it)."""

    expert: int
    precision: str
    entry: Entry | None


class LayerSchedule:
    """The rules of one cache, its plan's precisions, and its miss policy (None: read the planned one)."""

    def __init__(self, cache: ExpertCache, expert_precision, miss_policy=None, readable=None) -> None:
        self.cache = cache
        self.expert_precision = expert_precision  # [L][E] the planned precision of each expert
        self.miss_policy = miss_policy
        self.readable = set(readable) if readable is not None else None  # precisions a miss can read

    def routed(self, layer: int, experts) -> None:
        for expert in experts:
            if 0 <= expert < self.cache.num_experts:
                self.cache.protect(layer, expert)

    def prefetched(self, layer: int) -> dict[int, Entry]:
        """The layer's entries still marked as prefetched (call before ``begin``, which clears the marks)."""
        return {e.expert: e for e in self.cache.layer_entries(layer) if e.prefetched}

    def begin(self, layer: int, rows, top_k_index=None, top_k_weights=None) -> tuple[list[Decision], list[int]]:
        """``rows`` [T][K] expert ids (-1: dropped by the routing policy). top_k_index / top_k_weights: what
        the miss policy decides on (opaque here). Returns (decisions in visiting order, skipped experts)."""
        cache, planned = self.cache, self.expert_precision[layer]
        wanted = [(e, planned[e]) for e in ordered_experts(rows, cache.num_experts)]
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
            cache.use(layer, req.expert, precision)
            decisions.append(Decision(req.expert, precision, entry))
        return decisions, skipped

    def admit(self, layer: int, expert: int, precision: str, slot_bytes: int, read_bytes: int) -> Entry | None:
        """A miss to read: its entry in the pool, or None (a read buffer); ``read_bytes`` counted either way."""
        entry = self.cache.admit(layer, expert, precision, slot_bytes)
        self.cache.count_read(layer, read_bytes)
        return entry

    def prefetch(self, requests, slot_bytes: dict) -> list[Entry]:
        """Predicted experts (``loader.predict.PrefetchRequest``: layer, expert, precision or None for the
        planned one) -> the entries admitted, to be read. The caller counts their reads."""
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
