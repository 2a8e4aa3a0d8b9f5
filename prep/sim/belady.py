"""Belady's clairvoyant eviction, the floor every real policy is measured against (simulator only).

It evicts the resident expert whose next use lies furthest in the future, and an expert never used
again before any other. It is an ``EvictionPolicy`` like the loader's, so it runs through the same
cache core (protection, byte capacities, groups) and differs from them only in what it knows: a
``FutureUses`` object the simulator points at the sequence being replayed before it starts.

Time is a step (token t, MoE layer l), ordered token-major: step index t * L + l. At an eviction
during step (t, l) the experts wanted at this step are protected by the cache; the next use of a
resident (l', e) is its first use at a step after (t, l).
"""

from __future__ import annotations

import math
from bisect import bisect_left

from loader.cache import Clock, EvictionPolicy


class FutureUses:
    """Per (layer, expert): the sorted token positions of the current sequence that use it."""

    def __init__(self) -> None:
        self.uses: dict[tuple[int, int], list[int]] = {}

    def start(self, sequence) -> None:
        """Look ahead into ``sequence`` ([T][L] -> experts), the sequence about to be replayed."""
        uses: dict[tuple[int, int], list[int]] = {}
        for t, token in enumerate(sequence):
            for layer, experts in enumerate(token):
                for expert in experts:
                    uses.setdefault((layer, expert), []).append(t)
        self.uses = uses

    def next_step(self, layer: int, expert: int, clock: Clock) -> float:
        """The step index of the next use of (layer, expert) after the clock's step; inf if never."""
        positions = self.uses.get((layer, expert), ())
        first = clock.token if layer > clock.layer else clock.token + 1
        i = bisect_left(positions, first)
        return positions[i] * clock.num_layers + layer if i < len(positions) else math.inf


class BeladyPolicy(EvictionPolicy):
    """Evict the entry used again furthest ahead (never-used-again first; ties: inserted first)."""

    name = "belady"

    def __init__(self, clock: Clock, num_experts: int, future: FutureUses) -> None:
        super().__init__(clock, num_experts)
        self.future = future

    def score(self, layer, expert):
        return (-self.future.next_step(layer, expert, self.clock),)
