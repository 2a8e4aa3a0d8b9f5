"""The expert cache core: byte-sized pools, eviction groups, an in-flight table, protection, a clock.

Torch-free and shared by the runtime (which keeps its slot state as an entry's payload) and the simulator in
``prep/sim`` (which stores sizes only), so a policy measured in simulation is the policy that runs.

Entries are keyed (layer, expert, precision). A pool holds records of one precision and has one
eviction group per MoE layer or one global group; each group has a byte capacity and its own policy
instance. A request for a precision is satisfied by an entry of that precision or a higher one. A precision
no pool holds (dynamic precision's low copies) is lodged in a slot of a pool ranked above it whose slot it
fits (``host_pool``): it takes that whole slot, and a later read of the expert at the pool's precision
replaces it. So dynamic precision needs no pool of its own, and runs at any budget its main pool does.

The order of calls per MoE layer is the same in the runtime and the simulator, because both make them
through ``loader/schedule.py``:

1. ``begin_layer(layer, wanted)``: the clock moves to the layer, the wanted experts are protected and
   each is classified as a hit (resident), a join (already being read: the demand waits on that read,
   never a second one) or a miss.
2. ``use(layer, expert, precision)`` for every expert the layer computes, in the wanted order, at the
   precision it is computed at (a skipped expert is not used; a miss read at a lower precision is a
   low-precision use);
3. per miss, in order, ``admit(layer, expert, precision, nbytes)``: room is made in the pool's group
   and an in-flight entry reserved (its bytes count from now), or None when nothing can be evicted
   (the record is then read into a read buffer and used once); then ``complete(entry)``.
4. ``end_layer(layer)``: protection of that layer's experts ends (in use, or predicted for it).

``reset()`` starts a new sequence (the policies forget per-sequence records; contents stay);
``clear()`` also empties the cache (a cold start).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loader.policies import Clock, EvictionPolicy
from loader.vocab import GROUPS, precision_rank


@dataclass(eq=False)
class Entry:
    """One record held (or being read) in a pool. ``payload`` is the runtime's state of the entry (its slot,
    its read, its held form: ``loader.layer.Held``); None in the simulator."""

    layer: int
    expert: int
    precision: str
    nbytes: int
    pool: str
    payload: object = None
    in_flight: bool = True
    prefetched: bool = False


@dataclass
class LayerCounters:
    """Demand hits and misses of one MoE layer (a join of an in-flight read counts as a hit), the bytes
    read for it, experts the miss policy skipped, misses computed on the CPU instead of read
    (``loader.schedule.CpuMissRule``), and its prefetches: issued (admitted and read), used (the layer asked
    for the expert while it was still marked prefetched), wasted (the layer ran without it, or it was
    evicted first) and cancelled (dropped before its read landed)."""

    hits: int = 0
    misses: int = 0
    joins: int = 0
    bytes_read: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    skipped: int = 0
    cpu_computed: int = 0


class MemoryMeter:
    """Bytes of expert records held right now (every cache entry, reserved or resident, and every
    record read outside a cache) and the most ever held. Updated at every change, so the peak is true."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def sub(self, nbytes: int) -> None:
        self.held -= nbytes


# --------------------------------------------------------------------------------------------- cache


def host_pool(pools: Iterable[tuple[str, str, int]], precision: str, nbytes: int) -> str | None:
    """The pool that holds records of ``precision``: ``pools`` are (name, precision, slot bytes; 0: unknown).
    The pool of that precision, else (a lodged copy) the lowest-ranked pool ranked above it whose slot holds
    ``nbytes``; None where none does (the record is then read into a read buffer and used once). The cache
    admits by this rule and ``loader.budget`` sizes the forms by it, so the two cannot disagree."""
    pools = list(pools)
    for name, held, _ in pools:
        if held == precision:
            return name
    above = [(precision_rank(held), i, name) for i, (name, held, slot) in enumerate(pools)
             if precision_rank(held) > precision_rank(precision) and (slot == 0 or nbytes <= slot)]
    return min(above)[2] if above else None



@dataclass
class PoolConfig:
    """A pool as the cache needs it: name, precision, "layer" or "global" grouping, capacity per group
    (keyed by layer position, or "global")."""

    name: str
    precision: str
    group: str
    capacity: dict
    record_bytes: int = 0  # what one record takes (0: unknown); lets a view say how many records fit


@dataclass
class _Group:
    capacity: int
    policy: EvictionPolicy
    used: int = 0
    entries: dict = field(default_factory=dict)  # (layer, expert) -> Entry, in insertion order


@dataclass(frozen=True)
class Request:
    """One wanted expert of a layer: ``kind`` is "hit", "join" or "miss"; ``entry`` the entry found."""

    expert: int
    precision: str
    kind: str
    entry: Entry | None


class LayerView:
    """Read-only: which experts of one layer are resident or in flight, and at which precision."""

    def __init__(self, cache: ExpertCache, layer: int) -> None:
        self._cache = cache
        self.layer = layer

    def entries(self) -> dict[int, list[Entry]]:
        out: dict[int, list[Entry]] = {}
        for entry in self._cache.layer_entries(self.layer):
            out.setdefault(entry.expert, []).append(entry)
        return out

    def resident(self) -> dict[int, str]:
        """expert -> its best resident precision."""
        best: dict[int, str] = {}
        for entry in self._cache.layer_entries(self.layer):
            if not entry.in_flight and precision_rank(entry.precision) > precision_rank(best.get(entry.expert, "")):
                best[entry.expert] = entry.precision
        return best

    def in_flight(self) -> dict[int, str]:
        return {e.expert: e.precision for e in self._cache.layer_entries(self.layer) if e.in_flight}

    def has(self, expert: int, precision: str | None = None) -> bool:
        return self._cache.find(self.layer, expert, precision) is not None

    def capacity_records(self) -> int:
        """About how many records this layer's cache holds: each of its groups' bytes over its pool's record
        size (a global group's share is its total over the layers); 0 when record sizes are unknown."""
        return self._cache.capacity_records(self.layer)


class ExpertCache:
    """Every pool of the loader (or of a simulation), with the clock, protection and counters."""

    def __init__(self, pools: Iterable[PoolConfig], num_layers: int, num_experts: int,
                 policy: Callable[[Clock, int], EvictionPolicy], meter: MemoryMeter | None = None,
                 high_precision: str | None = None) -> None:
        self.clock = Clock(num_layers)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.meter = meter or MemoryMeter()
        self.pools: dict[str, dict] = {}  # pool name -> {group key: _Group}
        self.record_bytes: dict[str, int] = {}  # pool name -> bytes of one record (0: unknown)
        self.pool_of: dict[str, str] = {}  # precision -> pool name (its own; ``pool_for`` adds the lodged)
        self.group_kind: dict[str, str] = {}
        self._precision: dict[str, str] = {}  # pool name -> the precision it holds
        for pool in pools:
            if pool.group not in GROUPS:
                raise ValueError(f"pool {pool.name}: group must be 'layer' or 'global', not {pool.group!r}")
            self.pools[pool.name] = {key: _Group(int(nbytes), policy(self.clock, num_experts))
                                     for key, nbytes in pool.capacity.items()}
            self.pool_of[pool.precision] = pool.name
            self._precision[pool.name] = pool.precision
            self.group_kind[pool.name] = pool.group
            self.record_bytes[pool.name] = int(pool.record_bytes)
        ranked = sorted(self.pool_of, key=precision_rank, reverse=True)
        self.high_precision = high_precision or (ranked[0] if ranked else None)
        self.protected: dict[int, set[int]] = {}  # layer -> experts not to evict until the layer has run
        self.counters = [LayerCounters() for _ in range(num_layers)]
        self.on_evict: Callable[[Entry], None] | None = None  # the runtime frees the entry's memory here
        self.held_bytes = self.peak_bytes = 0  # every entry's bytes now, and the most ever

    # ---------------------------------------------------------------------------------- structure
    def _group(self, pool: str, layer: int) -> _Group:
        groups = self.pools[pool]
        return groups["global"] if self.group_kind[pool] == "global" else groups[layer]

    def _groups_of_layer(self, layer: int) -> list[_Group]:
        return [self._group(pool, layer) for pool in self.pools]

    def layer_entries(self, layer: int) -> list[Entry]:
        return [e for g in self._groups_of_layer(layer) for (lay, _), e in g.entries.items() if lay == layer]

    def find(self, layer: int, expert: int, precision: str | None = None) -> Entry | None:
        """The best entry (resident or in flight) for (layer, expert) at ``precision`` or higher."""
        want = precision_rank(precision) if precision is not None else 0
        best = None
        for group in self._groups_of_layer(layer):
            entry = group.entries.get((layer, expert))
            if entry is not None and precision_rank(entry.precision) >= want:
                if best is None or precision_rank(entry.precision) > precision_rank(best.precision):
                    best = entry
        return best

    def view(self, layer: int) -> LayerView:
        return LayerView(self, layer)

    def capacity_records(self, layer: int) -> int:
        total = 0
        for pool in self.pools:
            size = self.record_bytes.get(pool, 0)
            if size:
                share = self.num_layers if self.group_kind[pool] == "global" else 1
                total += self._group(pool, layer).capacity // size // share
        return total

    @property
    def nbytes(self) -> int:
        """Bytes held by every entry, reserved or resident."""
        return self.held_bytes

    def pool_for(self, precision: str, nbytes: int) -> str | None:
        """The pool a record of ``precision`` taking ``nbytes`` is admitted into (``host_pool``), or None."""
        if precision in self.pool_of:
            return self.pool_of[precision]
        return host_pool(((name, self._precision[name], self.record_bytes[name]) for name in self.pools),
                         precision, nbytes)

    def capacity(self, pool: str) -> dict:
        """{group key: bytes} of ``pool``."""
        return {key: g.capacity for key, g in self.pools[pool].items()}

    # ------------------------------------------------------------------------------- the layer step
    def begin_layer(self, layer: int, wanted: list[tuple[int, str]]) -> list[Request]:
        """Classify each wanted (expert, precision) of ``layer`` and protect them (uses are recorded by
        ``use`` once the precision each is computed at is known)."""
        self.clock.layer = layer
        # the layer's own decision supersedes what was predicted for it: only the wanted stay protected, so a
        # wrong prediction never keeps the layer from caching what it does use
        protected = self.protected[layer] = set()
        counters = self.counters[layer]
        requests = []
        for expert, precision in wanted:
            protected.add(expert)
            entry = self.find(layer, expert, precision)
            if entry is None:
                kind = "miss"
                counters.misses += 1
            else:
                kind = "join" if entry.in_flight else "hit"
                counters.hits += 1
                counters.joins += kind == "join"
                if entry.prefetched:
                    counters.prefetch_used += 1
                    entry.prefetched = False
            requests.append(Request(expert, precision, kind, entry))
        return requests

    def use(self, layer: int, expert: int, precision: str) -> None:
        """``expert`` of ``layer`` is computed at ``precision``: the policies record the use (a high-precision
        use when ``precision`` ranks with the highest pool's)."""
        high = precision_rank(precision) >= precision_rank(self.high_precision or precision)
        for group in self._groups_of_layer(layer):
            group.policy.on_use(layer, expert, high)

    def protect(self, layer: int, expert: int) -> None:
        """Keep (layer, expert) until ``layer`` has run (a predicted expert, resident or about to be read)."""
        self.protected.setdefault(layer, set()).add(expert)

    def prefetch(self, requests: list[tuple[int, int, str, int]]) -> list[Entry]:
        """Predicted (layer, expert, precision, nbytes): protect every one of them first (so making room for
        one never evicts another), then admit those not already held; returns the entries to read."""
        for layer, expert, _, _ in requests:
            self.protect(layer, expert)
        admitted = []
        for layer, expert, precision, nbytes in requests:
            if self.find(layer, expert, precision) is None:
                entry = self.admit(layer, expert, precision, nbytes, prefetch=True)
                if entry is not None:
                    admitted.append(entry)
        return admitted

    def skip(self, layer: int, expert: int) -> None:
        """The miss policy decided not to compute ``expert``: counted, nothing read."""
        self.counters[layer].skipped += 1

    def count_cpu(self, layer: int) -> None:
        """A miss of ``layer`` is computed on the CPU from the host store: counted, nothing read or admitted."""
        self.counters[layer].cpu_computed += 1

    def admit(self, layer: int, expert: int, precision: str, nbytes: int, prefetch: bool = False) -> Entry | None:
        """Reserve room for a record being read into the pool of ``precision`` (``pool_for``; a lodged copy
        takes a whole slot of its host pool); None if it cannot fit."""
        pool = self.pool_for(precision, nbytes)
        if pool is None:
            return None
        if self._precision[pool] != precision and self.record_bytes[pool]:
            nbytes = max(nbytes, self.record_bytes[pool])  # the host's slot, whatever the copy's own size
        group = self._group(pool, layer)
        if nbytes > group.capacity:
            return None
        old = group.entries.get((layer, expert))  # a lower-precision copy in this pool, replaced below
        freed = old.nbytes if old is not None else 0
        while group.used - freed + nbytes > group.capacity:
            candidates = [key for key, e in group.entries.items() if key != (layer, expert)
                          and not e.in_flight and key[1] not in self.protected.get(key[0], ())]
            if not candidates:
                return None
            self._evict(group, group.policy.victim(candidates))
        if old is not None:
            self._evict(group, (layer, expert))
        entry = Entry(layer, expert, precision, nbytes, pool, prefetched=prefetch)
        group.entries[(layer, expert)] = entry
        group.used += nbytes
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.meter.add(nbytes)
        if prefetch:
            self.protect(layer, expert)
            self.counters[layer].prefetches += 1
        return entry

    def complete(self, entry: Entry) -> None:
        """The read of ``entry`` landed: it is resident now."""
        entry.in_flight = False

    def cancel(self, entry: Entry) -> None:
        """Drop an in-flight entry whose read was cancelled (a prefetch nobody needs any more)."""
        if entry.prefetched:
            entry.prefetched = False
            self.counters[entry.layer].prefetch_cancelled += 1
        group = self._group(entry.pool, entry.layer)
        if group.entries.get((entry.layer, entry.expert)) is entry:
            self._evict(group, (entry.layer, entry.expert))

    def count_read(self, layer: int, nbytes: int) -> None:
        self.counters[layer].bytes_read += nbytes

    def end_layer(self, layer: int) -> None:
        """The layer has run: its experts (used or predicted for it) may be evicted again, and a prefetch for
        it that it did not use is wasted."""
        self.protected.pop(layer, None)
        for entry in self.layer_entries(layer):
            if entry.prefetched:
                entry.prefetched = False
                self.counters[layer].prefetch_wasted += 1

    def _evict(self, group: _Group, key: tuple[int, int]) -> None:
        entry = group.entries.pop(key)
        if entry.prefetched:  # evicted before its layer ran
            entry.prefetched = False
            self.counters[entry.layer].prefetch_wasted += 1
        group.used -= entry.nbytes
        self.held_bytes -= entry.nbytes
        self.meter.sub(entry.nbytes)
        if self.on_evict is not None:
            self.on_evict(entry)

    # ------------------------------------------------------------------------------------ sequences
    def reset(self) -> None:
        """A new sequence: the clock restarts and the policies forget per-sequence records."""
        self.clock.token = 0
        self.clock.layer = 0
        self.protected.clear()
        for groups in self.pools.values():
            for group in groups.values():
                group.policy.reset()

    def clear(self) -> None:
        """Empty every pool (a cold start), then ``reset``."""
        for groups in self.pools.values():
            for group in groups.values():
                for key in list(group.entries):
                    self._evict(group, key)
        self.reset()
