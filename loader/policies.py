"""The eviction policies of the expert cache, and ``POLICIES``: name -> class.

A policy picks the victim among a group's evictable entries; the cache core (``loader/cache.py``) calls
it. Torch-free, so the simulator in ``prep/sim`` runs exactly these policies.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

from loader.errors import MoeError


class PolicyError(MoeError, ValueError):
    """An eviction policy name or parameter the cache does not know (a ``ValueError`` too, as before)."""


@dataclass
class Clock:
    """Where the model is: the token's position in the sequence, the current MoE layer (0..L-1)."""

    num_layers: int
    token: int = 0
    layer: int = 0



class EvictionPolicy:
    """Chooses the victim among a group's evictable entries: the lowest ``score`` loses, ties go to the
    entry inserted first. Records are kept per (layer, expert), whatever the precision of its entry.

    ``on_use`` is called for every expert a layer computes (hit or miss, before any eviction of that
    layer), with ``high`` telling whether it ran at the group's high precision.
    """

    name = "base"

    def __init__(self, clock: Clock, num_experts: int, **params) -> None:
        if params:
            raise PolicyError(f"eviction policy {self.name!r} takes no parameters, got {sorted(params)}")
        self.clock = clock
        self.num_experts = num_experts
        self.tick = 0
        self.last: dict[tuple[int, int], int] = {}  # (layer, expert) -> tick of its last use

    def on_use(self, layer: int, expert: int, high: bool) -> None:
        self.tick += 1
        self.last[(layer, expert)] = self.tick

    def reset(self) -> None:
        """A new sequence: forget per-sequence records (recency is kept)."""

    def score(self, layer: int, expert: int) -> tuple:
        return (self.last.get((layer, expert), 0),)

    def victim(self, candidates: list[tuple[int, int]]) -> tuple[int, int]:
        return min(candidates, key=lambda key: self.score(*key))

    def distance(self, layer: int) -> int:
        """Layers from the current one forward to ``layer``: 0 for the current layer, 1 for the next."""
        return (layer - self.clock.layer) % self.clock.num_layers


class LRUPolicy(EvictionPolicy):
    """Least recently used."""

    name = "lru"


class LFUPolicy(EvictionPolicy):
    """Least frequently used in the current sequence (ties: least recently used)."""

    name = "lfu"
    per_sequence = True

    def __init__(self, clock: Clock, num_experts: int, **params) -> None:
        super().__init__(clock, num_experts, **params)
        self.count: dict[tuple[int, int], int] = {}

    def on_use(self, layer, expert, high):
        super().on_use(layer, expert, high)
        self.count[(layer, expert)] = self.count.get((layer, expert), 0) + 1

    def reset(self):
        if self.per_sequence:
            self.count.clear()

    def score(self, layer, expert):
        return (self.count.get((layer, expert), 0), self.last.get((layer, expert), 0))


class GlobalLFUPolicy(LFUPolicy):
    """Least frequently used since the loader started (model-level frequency)."""

    name = "lfu-global"
    per_sequence = False


class LHUPolicy(EvictionPolicy):
    """Least high-precision used (HOBBIT): uses at the high precision in the current sequence."""

    name = "lhu"

    def __init__(self, clock: Clock, num_experts: int, **params) -> None:
        super().__init__(clock, num_experts, **params)
        self.high: dict[tuple[int, int], int] = {}

    def on_use(self, layer, expert, high):
        super().on_use(layer, expert, high)
        if high:
            self.high[(layer, expert)] = self.high.get((layer, expert), 0) + 1

    def reset(self):
        self.high.clear()

    def score(self, layer, expert):
        return (self.high.get((layer, expert), 0), self.last.get((layer, expert), 0))


class FLDPolicy(EvictionPolicy):
    """Forward layer distance (HOBBIT's term alone): the expert whose layer runs furthest ahead leaves first,
    so the layer that just ran goes before the next one. Within a layer: least recently used."""

    name = "fld"

    def score(self, layer, expert):
        return (1 - self.distance(layer) / self.clock.num_layers, self.last.get((layer, expert), 0))


class EdgeMoEPolicy(EvictionPolicy):
    """EdgeMoE's buffer eviction: L = f * ((S - i + I) mod S), the smallest L leaves (EdgeMoE section 3.3.3).

    The paper's text of the formula lost its operators; this is our reading of it.

    f is the expert's use count since the loader started, seeded with ``n0 * share`` from the offline
    per-layer shares when given (``shares`` [L][E]), so the first tokens are not decided by zeros. The
    second factor is S - d for an expert d layers ahead and 0 for the current layer's experts (next
    needed a whole token later).
    """

    name = "edgemoe"

    def __init__(self, clock: Clock, num_experts: int, shares=None, n0: float = 10.0) -> None:
        super().__init__(clock, num_experts)
        self.freq: dict[tuple[int, int], float] = {}
        if shares is not None:
            for layer, row in enumerate(shares):
                for expert, share in enumerate(row):
                    self.freq[(layer, expert)] = n0 * float(share)

    def on_use(self, layer, expert, high):
        super().on_use(layer, expert, high)
        self.freq[(layer, expert)] = self.freq.get((layer, expert), 0.0) + 1

    def score(self, layer, expert):
        s = self.clock.num_layers
        closeness = (s - layer + self.clock.layer) % s
        return (self.freq.get((layer, expert), 0.0) * closeness, self.last.get((layer, expert), 0))


# HOBBIT's weights: the tuner searches the simplex (each in [0, 1]); only their ratios matter, so 1e6 leaves any
# sane weighting room while keeping every priority (a weight times a ratio in [0, 1], four of them) far from
# overflow: a weight of 1e308 makes priorities infinite, and inf - inf ties are NaN, which no victim order survives.
MAX_HOBBIT_WEIGHT = 1e6


class HobbitPolicy(EvictionPolicy):
    """HOBBIT's multidimensional priority (HOBBIT section 3.4), the lowest leaves:

    p = w_lru * R/T + w_lfu * F/T + w_lhu * H/T + w_fld * (1 - d/L)

    R: 1 + the token position of the expert's last use in this sequence (0 if unused), F and H: its uses
    and high-precision uses in this sequence, T: 1 + the current token position, d: forward layer
    distance from the current layer. The records reset per sequence.
    """

    name = "hobbit"

    def __init__(self, clock: Clock, num_experts: int, w_lru: float = 0.25, w_lfu: float = 0.25,
                 w_lhu: float = 0.25, w_fld: float = 0.25) -> None:
        super().__init__(clock, num_experts)
        for what, w in (("w_lru", w_lru), ("w_lfu", w_lfu), ("w_lhu", w_lhu), ("w_fld", w_fld)):
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0 <= w <= MAX_HOBBIT_WEIGHT:
                raise PolicyError(f"eviction policy 'hobbit': {what} must be a number in [0, {MAX_HOBBIT_WEIGHT:g}], "
                                  f"got {w!r}")
        self.w = (float(w_lru), float(w_lfu), float(w_lhu), float(w_fld))
        self.recent: dict[tuple[int, int], int] = {}
        self.count: dict[tuple[int, int], int] = {}
        self.high: dict[tuple[int, int], int] = {}

    def on_use(self, layer, expert, high):
        super().on_use(layer, expert, high)
        key = (layer, expert)
        self.recent[key] = self.clock.token + 1
        self.count[key] = self.count.get(key, 0) + 1
        if high:
            self.high[key] = self.high.get(key, 0) + 1

    def reset(self):
        self.recent.clear()
        self.count.clear()
        self.high.clear()

    def priority(self, layer: int, expert: int) -> float:
        key = (layer, expert)
        t = self.clock.token + 1
        w_lru, w_lfu, w_lhu, w_fld = self.w
        return (w_lru * self.recent.get(key, 0) / t + w_lfu * self.count.get(key, 0) / t
                + w_lhu * self.high.get(key, 0) / t + w_fld * (1 - self.distance(layer) / self.clock.num_layers))

    def score(self, layer, expert):
        return (self.priority(layer, expert), self.last.get((layer, expert), 0))


POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, LFUPolicy, GlobalLFUPolicy, LHUPolicy, FLDPolicy, EdgeMoEPolicy, HobbitPolicy)
}


def policy_factory(name: str, params: dict | None = None) -> Callable[[Clock, int], EvictionPolicy]:
    """A constructor for the named policy with ``params``; a ValueError names the known policies."""
    if name not in POLICIES:
        raise PolicyError(f"eviction policy {name!r} unknown; use one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    params = dict(params or {})
    try:
        cls(Clock(1), 1, **params)  # reject unknown parameters now, not at the first eviction
    except TypeError as e:
        raise PolicyError(f"eviction policy {name!r}: {e}") from None
    return lambda clock, num_experts: cls(clock, num_experts, **params)
