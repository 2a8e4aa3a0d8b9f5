"""An expert cache driven by hand, one layer call at a time, as the runtime drives it: shared by the tests of
the cache (loader/cache.py), its eviction policies (loader/policies.py) and the schedule (loader/schedule.py)."""

from __future__ import annotations

from loader.cache import ExpertCache, PoolConfig

REC = 100  # bytes of one record in these tests


def make_cache(factory, records: int, num_layers: int = 1, num_experts: int = 8, group: str = "layer",
               precision: str = "int4", extra_pools=()) -> ExpertCache:
    """One pool "main" holding ``records`` records of REC bytes per group (per layer or one global)."""
    capacity = ({layer: records * REC for layer in range(num_layers)} if group == "layer"
                else {"global": records * REC})
    pools = [PoolConfig("main", precision, group, capacity), *extra_pools]
    return ExpertCache(pools, num_layers, num_experts, factory)


def resident(cache: ExpertCache) -> set[tuple[int, int, str]]:
    """(layer, expert, precision) of every entry, through the public per-layer view."""
    return {(e.layer, e.expert, e.precision) for layer in range(cache.num_layers)
            for entries in cache.view(layer).entries().values() for e in entries}


def step(cache: ExpertCache, layer: int, experts, token: int | None = None, precision: str = "int4",
         sizes: dict | None = None) -> list[tuple[int, int]]:
    """One layer call as the runtime makes it; returns the (layer, expert) evicted, in order."""
    if token is not None:
        cache.clock.token = token
    wanted = [e if isinstance(e, tuple) else (e, precision) for e in experts]
    evicted = []
    requests = cache.begin_layer(layer, wanted)
    for request in requests:  # every computed expert's use first, in order, as the runtime records it
        cache.use(layer, request.expert, request.entry.precision if request.entry else request.precision)
    for request in requests:
        if request.kind == "miss":
            before = resident(cache)
            nbytes = (sizes or {}).get(request.expert, REC)
            entry = cache.admit(layer, request.expert, request.precision, nbytes)
            evicted += sorted((lay, exp) for lay, exp, _ in before - resident(cache))
            if entry is not None:
                cache.complete(entry)
    cache.end_layer(layer)
    return evicted
