"""Per-layer expert caches and the eviction policies that choose what leaves them.

A ``LayerCache`` has a fixed number of slots, each holding one packed expert record. What to evict is
asked of an ``EvictionPolicy`` (LRU here; frequency, layer-distance and the multidimensional policies
of EdgeMoE and HOBBIT plug in behind the same four calls). Experts named in ``protected`` (predicted or
in use) are never evicted. The cache counts the bytes it holds so the runtime can prove it never
exceeds its budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


class EvictionPolicy:
    """Decides which resident expert leaves. Subclasses keep whatever records they need."""

    def on_insert(self, expert: int) -> None: ...

    def on_access(self, expert: int) -> None: ...

    def on_evict(self, expert: int) -> None: ...

    def victim(self, resident: Iterable[int], protected: set[int]) -> int | None:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: evict the expert whose last use is oldest."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, expert: int) -> None:
        self._order[expert] = None
        self._order.move_to_end(expert)

    def on_access(self, expert: int) -> None:
        self._order.move_to_end(expert)

    def on_evict(self, expert: int) -> None:
        self._order.pop(expert, None)

    def victim(self, resident: Iterable[int], protected: set[int]) -> int | None:
        resident = set(resident)
        return next((e for e in self._order if e in resident and e not in protected), None)


POLICIES = {"lru": LRUPolicy}


class MemoryMeter:
    """Bytes of expert records held right now (in every cache and in flight) and the most ever held.

    Updated at every change, not sampled between forwards, so the peak it reports is the true peak.
    """

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def sub(self, nbytes: int) -> None:
        self.held -= nbytes


class LayerCache:
    """The resident experts of one MoE layer: at most ``slots`` records."""

    def __init__(self, slots: int, policy: EvictionPolicy, meter: MemoryMeter | None = None) -> None:
        self.slots = slots
        self.policy = policy
        self.meter = meter or MemoryMeter()
        self.records: dict[int, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(r) for r in self.records.values())

    def get(self, expert: int) -> torch.Tensor | None:
        record = self.records.get(expert)
        if record is not None:
            self.policy.on_access(expert)
        return record

    def put(self, expert: int, record: torch.Tensor, protected: set[int]) -> bool:
        """Insert ``record`` if a slot is free or can be freed; returns whether it was kept."""
        if self.slots <= 0:
            return False
        while len(self.records) >= self.slots:
            victim = self.policy.victim(self.records, protected)
            if victim is None:
                return False
            self.meter.sub(_nbytes(self.records.pop(victim)))
            self.policy.on_evict(victim)
        self.records[expert] = record
        self.meter.add(_nbytes(record))
        self.policy.on_insert(expert)
        return True


def _nbytes(record: torch.Tensor) -> int:
    return record.numel() * record.element_size()
