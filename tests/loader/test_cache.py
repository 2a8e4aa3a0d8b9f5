"""The expert cache core (loader/cache.py), driven by hand: byte capacities with records of different sizes,
protection of in-use and prefetched experts, the in-flight join, precision ranks, reset() against clear(), and
per-layer against global eviction groups. Which expert each policy evicts is in ``tests/loader/test_policies.py``.
"""

from __future__ import annotations

import random

import pytest

from loader.cache import ExpertCache, PoolConfig
from loader.policies import POLICIES, policy_factory
from tests.helpers.cache_steps import REC, make_cache, resident, step

# ----------------------------------------------------------------------------------- the machinery


def test_byte_capacity_with_records_of_different_sizes():
    cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: 100})], 1, 8, policy_factory("lru"))
    sizes = {0: 30, 1: 30, 2: 30, 3: 60, 4: 100, 5: 101}
    assert step(cache, 0, [0], sizes=sizes) == [] and step(cache, 0, [1], sizes=sizes) == []
    assert step(cache, 0, [2], sizes=sizes) == [] and cache.nbytes == 90
    assert step(cache, 0, [3], sizes=sizes) == [(0, 0), (0, 1)]  # 60 more needs two 30s out
    assert cache.nbytes == 90
    assert step(cache, 0, [4], sizes=sizes) == [(0, 2), (0, 3)] and cache.nbytes == 100
    assert step(cache, 0, [5], sizes=sizes) == []  # larger than the group: read, used once, not cached
    assert resident(cache) == {(0, 4, "int4")}
    assert cache.meter.peak <= 100 and cache.meter.held == cache.nbytes


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("group", ["layer", "global"])
def test_never_over_capacity(policy, group):
    """Random requests with random record sizes in two pools: no group ever holds more than its bytes."""
    rng = random.Random(7)
    layers, experts = 3, 6
    caps = {"hi": 250, "lo": 140}
    pools = [PoolConfig(name, prec, group, {"global": cap * layers} if group == "global"
                        else {layer: cap for layer in range(layers)})
             for name, prec, cap in (("hi", "int8", caps["hi"]), ("lo", "int4", caps["lo"]))]
    cache = ExpertCache(pools, layers, experts, policy_factory(policy))
    total = sum(caps.values()) * layers
    for t in range(60):
        cache.clock.token = t
        for layer in range(layers):
            wanted = [(e, rng.choice(["int8", "int4"])) for e in rng.sample(range(experts), 2)]
            for request in cache.begin_layer(layer, wanted):
                if request.kind == "miss":
                    entry = cache.admit(layer, request.expert, request.precision, rng.randint(20, 120))
                    for groups in cache.pools.values():
                        for g in groups.values():
                            assert g.used <= g.capacity
                    if entry is not None:
                        cache.complete(entry)
            cache.end_layer(layer)
    assert cache.meter.peak <= total
    assert cache.meter.held == cache.nbytes


def test_in_use_experts_are_inserted_together():
    """A token's experts are protected from each other: with room for one, the second is read and used
    once, not swapped in over the first. After the layer has run, the first may go."""
    cache = make_cache(policy_factory("lru"), 1)
    assert step(cache, 0, [0, 1]) == []
    assert resident(cache) == {(0, 0, "int4")}
    assert cache.counters[0].misses == 2 and cache.counters[0].hits == 0
    assert step(cache, 0, [2]) == [(0, 0)]


def test_prefetched_experts_are_protected_until_their_layer_has_run():
    cache = make_cache(policy_factory("lru"), 2, num_layers=2, group="global")
    step(cache, 0, [0], token=0)
    entry = cache.admit(1, 5, "int4", REC, prefetch=True)  # predicted for layer 1, never used yet (LRU's pick)
    cache.complete(entry)
    assert step(cache, 0, [1], token=1) == [(0, 0)]  # (1, 5) is protected
    step(cache, 1, [], token=1)  # layer 1 ran without it: protection ends
    assert step(cache, 0, [2], token=2) == [(1, 5)]
    assert cache.counters[1].prefetches == 1 and cache.counters[1].prefetch_used == 0


def test_a_demand_for_an_entry_in_flight_is_a_join():
    cache = make_cache(policy_factory("lru"), 2)
    entry = cache.admit(0, 3, "int4", REC, prefetch=True)  # the read is under way
    (request,) = cache.begin_layer(0, [(3, "int4")])
    cache.use(0, 3, "int4")
    assert request.kind == "join" and request.entry is entry
    counters = cache.counters[0]
    assert (counters.hits, counters.joins, counters.misses, counters.prefetch_used) == (1, 1, 0, 1)
    # an entry being read is never a victim, even when the group is full and it is the only candidate
    other = cache.admit(0, 4, "int4", REC)
    cache.end_layer(0)
    assert cache.admit(0, 5, "int4", REC) is None
    cache.complete(entry)
    cache.complete(other)
    assert cache.admit(0, 5, "int4", REC) is not None  # now one can go: 4, never used (LRU)
    assert cache.view(0).has(3) and not cache.view(0).has(4)


def test_a_higher_precision_entry_serves_a_lower_precision_request():
    lo = PoolConfig("lo", "int4", "layer", {0: 2 * REC})
    cache = make_cache(policy_factory("lru"), 2, precision="int8", extra_pools=[lo])
    step(cache, 0, [(0, "int8"), (1, "int4")])
    (hit,) = cache.begin_layer(0, [(0, "int4")])
    cache.end_layer(0)
    assert hit.kind == "hit" and hit.entry.precision == "int8"
    (miss,) = cache.begin_layer(0, [(1, "int8")])  # an int4 copy does not serve an int8 request
    assert miss.kind == "miss"
    cache.admit(0, 1, "int8", REC)
    cache.end_layer(0)
    view = cache.view(0)
    assert view.in_flight() == {1: "int8"} and view.resident() == {0: "int8", 1: "int4"}
    assert cache.find(0, 1).precision == "int8"  # the best entry wins, in flight or not


def test_reset_keeps_contents_clear_empties():
    cache = make_cache(policy_factory("hobbit"), 2)
    step(cache, 0, [0, 1], token=5)
    cache.protected[0] = {0}
    cache.reset()
    assert (cache.clock.token, cache.clock.layer) == (0, 0) and not cache.protected
    assert cache.pools["main"][0].policy.count == {}  # per-sequence records forgotten
    assert step(cache, 0, [0, 1]) == [] and cache.counters[0].hits == 2  # contents kept: hits
    held = cache.nbytes
    assert held == 2 * REC and cache.meter.held == held
    cache.clear()
    assert resident(cache) == set() and cache.nbytes == 0 and cache.meter.held == 0
    assert cache.meter.peak == held  # the peak is history
    step(cache, 0, [0])
    assert cache.counters[0].misses == 3


def test_global_group_spans_layers_per_layer_groups_do_not():
    # per layer: one record each; layer 0's two experts cannot both stay, and layer 1 never evicts layer 0
    per_layer = make_cache(policy_factory("lru"), 1, num_layers=2)
    step(per_layer, 0, [0], token=0)
    step(per_layer, 1, [0], token=0)
    assert step(per_layer, 0, [1], token=1) == [(0, 0)]
    assert step(per_layer, 1, [1], token=1) == [(1, 0)]
    # global: the same two records in one group; layer 1's miss evicts the least recent of any layer
    shared = make_cache(policy_factory("lru"), 2, num_layers=2, group="global")
    step(shared, 0, [0], token=0)
    step(shared, 0, [1], token=1)  # layer 0 holds two records: no room is reserved for layer 1
    assert resident(shared) == {(0, 0, "int4"), (0, 1, "int4")}
    assert step(shared, 1, [0], token=1) == [(0, 0)]
    assert shared.capacity("main") == {"global": 2 * REC}


def test_uses_count_at_the_computed_precision_and_skips_count_nothing():
    """Digest H3: a low-precision use does not raise H; a skipped expert updates no record. The cache
    records a use only through ``use``, at the precision the expert is computed at."""
    hi = PoolConfig("hi", "int8", "layer", {0: 2 * REC})
    lo = PoolConfig("lo", "int4", "layer", {0: 2 * REC})
    cache = ExpertCache([hi, lo], 1, 8, policy_factory("lhu"))
    (miss,) = cache.begin_layer(0, [(3, "int8")])  # planned high, the miss policy reads it low
    cache.use(0, 3, "int4")
    cache.complete(cache.admit(0, 3, "int4", REC))
    cache.end_layer(0)
    policy = cache.pools["hi"][0].policy
    assert miss.kind == "miss" and policy.high.get((0, 3), 0) == 0 and (0, 3) in policy.last
    cache.begin_layer(0, [(5, "int8")])
    cache.skip(0, 5)  # skipped: never used
    cache.end_layer(0)
    assert (0, 5) not in policy.last and cache.counters[0].skipped == 1
    (hit,) = cache.begin_layer(0, [(3, "int4")])
    cache.use(0, 3, hit.entry.precision)
    assert policy.high.get((0, 3), 0) == 0  # computed from its int4 entry: still low


