"""The expert cache core (loader/cache.py): which expert each policy evicts, on hand-made sequences.

Every victim below is worked out by hand from the policy's definition (digest sections cited), and
``test_a_random_victim_fails_every_scenario`` proves each scenario pins its victims: a policy that
evicts at random gets at least one of them wrong. The rest checks the machinery: byte capacities
with records of different sizes, protection of in-use and prefetched experts, the in-flight join,
precision ranks, reset() against clear(), and per-layer against global eviction groups.
"""

from __future__ import annotations

import random

import pytest

from loader.cache import ExpertCache, PoolConfig
from loader.policies import POLICIES, Clock, EdgeMoEPolicy, EvictionPolicy, policy_factory

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


# ------------------------------------------------------------------------------ victim scenarios
# Each takes a policy factory and returns every eviction in order; EXPECTED holds the hand-worked answer.


def lru_scenario(factory):
    cache = make_cache(factory, 3)
    out = []
    for t, e in enumerate([0, 1, 2, 0, 3, 4, 1]):
        out += step(cache, 0, [e], token=t)
    return out  # [3] evicts 1 (0 was used again), [4] evicts 2, [1] evicts 0


def lfu_scenario(factory):
    """Counts 0:3, 1:2, 2:1 -> [3] evicts 2 (LRU would evict 0). After reset the sequence counts start over."""
    cache = make_cache(factory, 3)
    out = []
    for t, e in enumerate([0, 0, 0, 1, 1, 2, 3]):
        out += step(cache, 0, [e], token=t)
    cache.reset()  # resident 0, 1, 3
    out += step(cache, 0, [1], token=0)
    # per-sequence counts 0:0, 1:1, 3:0 -> the least recent of 0 and 3 leaves: 0.
    # model-level counts 0:3, 1:3, 3:1 -> 3 leaves.
    out += step(cache, 0, [4], token=1)
    return out


def lhu_scenario(factory):
    """High-precision uses: 0 is computed three times at int4 (its int4 copy) and then once at int8, 1 twice at
    int8. The int8 miss of 2 evicts 0 from the int8 pool (1 high use < 2); LRU and LFU would evict 1."""
    lo = PoolConfig("lo", "int4", "layer", {0: 2 * REC})
    cache = make_cache(factory, 2, precision="int8", extra_pools=[lo])
    out = []
    sequence = [(0, "int4"), (0, "int4"), (0, "int4"), (1, "int8"), (1, "int8"), (0, "int8"), (2, "int8")]
    for t, (e, p) in enumerate(sequence):
        out += step(cache, 0, [(e, p)], token=t)
    return out


def fld_scenario(factory):
    """Global group, 4 layers: after layer 0 ran, layer 1's miss evicts layer 0's expert (it runs furthest
    ahead: distance 3); LRU would evict layer 1's old expert. At layer 2 both layer-1 experts are at
    distance 3: the least recent, (1, 0), leaves."""
    cache = make_cache(factory, 4, num_layers=4, group="global")
    out = []
    for layer in range(4):
        out += step(cache, layer, [0], token=0)
    out += step(cache, 0, [0], token=1)
    out += step(cache, 1, [1], token=1)
    out += step(cache, 2, [1], token=1)
    return out


def edgemoe_scenario(factory):
    """Digest §1.7 worked example: S = 6, I = 2, equal f. Keep order 3 > 4 > 5 > 0 > 1 > 2, so six misses
    at layer 2 evict layer 2, 1, 0, 5, 4, 3 in that order."""
    cache = make_cache(factory, 6, num_layers=6, group="global")
    for layer in range(6):
        step(cache, layer, [0], token=0)
    return step(cache, 2, [1, 2, 3, 4, 5, 6], token=1)


def edgemoe_product_scenario(factory):
    """L = f * closeness is a product: at I = 2 layer 3's expert (f 1, closeness 5: L 5) leaves before
    layer 0's (f 3, closeness 2: L 6), though layer 3 runs next."""
    cache = make_cache(factory, 2, num_layers=6, group="global")
    for t in range(3):
        step(cache, 0, [0], token=t)
    step(cache, 3, [0], token=2)
    return step(cache, 2, [1], token=3)


def _hobbit_setup(factory):
    """Global group of 3 records over L = 4 layers. Token 0: layers 0, 1, 2 read expert 0. Token 1: layer 0
    uses expert 0 again, asked at int4 but served by its int8 entry (so computed at int8: a high-precision
    use), layer 1 misses expert 1.

    At that eviction T = 2, current layer 1:
      (0,0): R = 2, F = 2, H = 2, distance 3 -> FLD term 1 - 3/4 = 0.25
      (1,0): R = 1, F = 1, H = 1, distance 0 -> 1
      (2,0): R = 1, F = 1, H = 1, distance 1 -> 0.75
    """
    lo = PoolConfig("lo", "int4", "global", {"global": 3 * REC})
    cache = make_cache(factory, 3, num_layers=4, group="global", precision="int8", extra_pools=[lo])
    for layer in range(3):
        step(cache, layer, [(0, "int8")], token=0)
    step(cache, 0, [(0, "int4")], token=1)
    return cache


def hobbit_scenario(factory):
    """Weights (0.4, 0.3, 0.2, 0.1): p(0,0) = 0.4*2/2 + 0.3*2/2 + 0.2*2/2 + 0.1*0.25 = 0.925,
    p(1,0) = 0.4/2 + 0.3/2 + 0.2/2 + 0.1*1 = 0.55, p(2,0) = 0.45 + 0.1*0.75 = 0.525: (2,0) leaves."""
    cache = _hobbit_setup(factory)
    return step(cache, 1, [(1, "int8")], token=1)


def hobbit_fld_scenario(factory):
    """Weights (0.1, 0.1, 0.1, 0.7): p(0,0) = 0.1 + 0.1 + 0.1 + 0.7*0.25 = 0.475,
    p(1,0) = 0.15 + 0.7 = 0.85, p(2,0) = 0.15 + 0.525 = 0.675: (0,0) leaves."""
    cache = _hobbit_setup(factory)
    return step(cache, 1, [(1, "int8")], token=1)


HOBBIT_A = {"w_lru": 0.4, "w_lfu": 0.3, "w_lhu": 0.2, "w_fld": 0.1}
HOBBIT_B = {"w_lru": 0.1, "w_lfu": 0.1, "w_lhu": 0.1, "w_fld": 0.7}

SCENARIOS = [  # (id, scenario, policy, params, expected evictions)
    ("lru", lru_scenario, "lru", {}, [(0, 1), (0, 2), (0, 0)]),
    ("lfu", lfu_scenario, "lfu", {}, [(0, 2), (0, 0)]),
    ("lfu-global", lfu_scenario, "lfu-global", {}, [(0, 2), (0, 3)]),
    ("lru-on-lfu", lfu_scenario, "lru", {}, [(0, 0), (0, 2)]),
    ("lhu", lhu_scenario, "lhu", {}, [(0, 0)]),
    ("lfu-on-lhu", lhu_scenario, "lfu", {}, [(0, 1)]),
    ("fld", fld_scenario, "fld", {}, [(0, 0), (1, 0)]),
    ("lru-on-fld", fld_scenario, "lru", {}, [(1, 0), (2, 0)]),
    ("edgemoe", edgemoe_scenario, "edgemoe", {}, [(2, 0), (1, 0), (0, 0), (5, 0), (4, 0), (3, 0)]),
    ("edgemoe-product", edgemoe_product_scenario, "edgemoe", {}, [(3, 0)]),
    ("hobbit", hobbit_scenario, "hobbit", HOBBIT_A, [(2, 0)]),
    ("hobbit-fld", hobbit_fld_scenario, "hobbit", HOBBIT_B, [(0, 0)]),
]


@pytest.mark.parametrize(("scenario", "policy", "params", "expected"), [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_policy_evicts_the_hand_worked_victim(scenario, policy, params, expected):
    assert scenario(policy_factory(policy, params)) == expected


def test_every_loader_policy_has_a_scenario():
    assert {s[2] for s in SCENARIOS} == set(POLICIES)


class RandomPolicy(EvictionPolicy):
    name = "random"

    def __init__(self, clock, num_experts, rng):
        super().__init__(clock, num_experts)
        self.rng = rng

    def victim(self, candidates):
        return self.rng.choice(candidates)


def test_a_random_victim_fails_every_scenario():
    """Each scenario pins its victims: some seed of a random policy evicts otherwise."""
    for name, scenario, _policy, _params, expected in SCENARIOS:
        outcomes = []
        for seed in range(20):
            rng = random.Random(seed)
            outcomes.append(scenario(lambda clock, n, rng=rng: RandomPolicy(clock, n, rng)))
        assert any(got != expected for got in outcomes), f"scenario {name} does not pin its victim"


def test_edgemoe_scores_reproduce_the_worked_order():
    """Digest §1.7: S = 6, I = 2, equal f: L = f * ((S - i + I) mod S) = 2f, f, 0, 5f, 4f, 3f for i = 0..5."""
    clock = Clock(6, token=0, layer=2)
    policy = EdgeMoEPolicy(clock, 8)
    for layer in range(6):
        policy.on_use(layer, 0, True)
        policy.on_use(layer, 0, True)  # f = 2 for all
    assert [policy.score(layer, 0)[0] for layer in range(6)] == [4, 2, 0, 10, 8, 6]
    keep_order = sorted(range(6), key=lambda layer: policy.score(layer, 0), reverse=True)
    assert keep_order == [3, 4, 5, 0, 1, 2]


def test_edgemoe_seeded_frequencies():
    """With offline shares, f starts at n0 * share, so an expert never used yet is not worth zero."""
    clock = Clock(2, layer=0)
    policy = policy_factory("edgemoe", {"shares": [[0.5, 0.5], [0.9, 0.1]], "n0": 10})(clock, 2)
    assert policy.score(1, 0)[0] == pytest.approx(9 * 1)  # f 9, closeness (2 - 1 + 0) % 2 = 1
    assert policy.score(1, 1)[0] == pytest.approx(1 * 1)


def test_hobbit_priorities_by_hand():
    cache = _hobbit_setup(policy_factory("hobbit", HOBBIT_A))
    cache.clock.layer = 1
    policy = cache.pools["main"]["global"].policy
    assert policy.priority(0, 0) == pytest.approx(0.925)
    assert policy.priority(1, 0) == pytest.approx(0.55)
    assert policy.priority(2, 0) == pytest.approx(0.525)
    cache.reset()  # per-sequence records go: only the FLD term is left, at T = 1, current layer 0
    assert policy.priority(0, 0) == pytest.approx(0.1)
    assert policy.priority(2, 0) == pytest.approx(0.1 * (1 - 2 / 4))


def test_unknown_policy_and_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        policy_factory("random")
    with pytest.raises(ValueError, match="hobbit"):
        policy_factory("hobbit", {"w_nope": 1})
    with pytest.raises(ValueError, match="no parameters"):
        policy_factory("lru", {"x": 1})


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


def test_the_schedule_serves_decode_misses_on_the_cpu_by_its_rule():
    """``CpuMissRule`` in ``LayerSchedule.begin``: in a one-token step a miss whose precision the rule names
    is served on the CPU (counted, used, never admitted); hits, a prefill step and a step that cannot (the
    neuron step) are not; ``always`` serves every miss, ``never`` and an ``auto`` rule with nothing faster
    on the CPU none."""
    from loader.errors import LoaderError
    from loader.schedule import CPU, READ, CpuMissRule, LayerSchedule

    def schedule(rule):
        pools = [PoolConfig("hi", "int4", "layer", {0: 4 * REC}), PoolConfig("lo", "int2", "layer", {0: 4 * REC})]
        cache = ExpertCache(pools, 1, 8, policy_factory("lru"))
        return LayerSchedule(cache, [["int4", "int2"] * 4], cpu_rule=rule)

    def run(sched, rows, cpu=True):
        decisions, _ = sched.begin(0, rows, cpu=cpu)
        for d in decisions:
            if d.entry is None and d.served == READ:
                sched.cache.complete(sched.admit(0, d.expert, d.precision, REC, REC))
        sched.end(0)
        return [(d.expert, d.served if d.entry is None else "hit") for d in decisions]

    sched = schedule(CpuMissRule("auto", {"int2"}))
    assert run(sched, [[0, 1]]) == [(0, READ), (1, CPU)]
    assert run(sched, [[1, 0]]) == [(1, CPU), (0, "hit")]  # never cached: the CPU serves it again
    assert resident(sched.cache) == {(0, 0, "int4")}
    counters = sched.cache.counters[0]
    assert (counters.misses, counters.cpu_computed, counters.bytes_read) == (3, 2, REC)
    assert run(sched, [[2, 3], [4, 5]]) == [(2, READ), (3, READ), (4, READ), (5, READ)]  # prefill reads
    assert run(sched, [[7]], cpu=False) == [(7, READ)]
    assert counters.cpu_computed == 2

    sched = schedule(CpuMissRule("always"))
    assert run(sched, [[0, 1]]) == [(0, CPU), (1, CPU)]
    assert run(sched, [[2, 3], [0, 1]]) == [(2, READ), (3, READ), (0, READ), (1, READ)]
    assert run(sched, [[0, 5]]) == [(0, "hit"), (5, CPU)]
    for rule in (CpuMissRule("never"), CpuMissRule("auto"), None):
        assert run(schedule(rule), [[0, 1]]) == [(0, READ), (1, READ)]
    assert CpuMissRule("auto").off and not CpuMissRule("always").off
    with pytest.raises(LoaderError, match="cpu_misses 'sometimes' unknown"):
        CpuMissRule("sometimes")


def test_the_prefetch_gate_stops_predictions_that_do_not_pay():
    """``PrefetchGate`` in ``LayerSchedule``: prefetches are read while at least ``floor`` of the decided ones
    (used or wasted) were used; after ``warmup`` decided ones with fewer used, reads stop for good at the end of
    that layer call (``end``), and no request is admitted any more. Without a gate nothing stops."""
    from loader.predict import PrefetchRequest
    from loader.schedule import LayerSchedule, PrefetchGate

    def schedule(gate):
        cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: 2 * REC, 1: 2 * REC})], 2, 8,
                            policy_factory("lru"))
        return LayerSchedule(cache, [["int4"] * 8] * 2, prefetch_gate=gate)

    def token(sched, predicted, chosen):
        """Predict ``predicted`` for layer 1, then run layer 0 (choosing 0) and layer 1 (choosing ``chosen``)."""
        for entry in sched.prefetch([PrefetchRequest(1, predicted)], {"int4": REC}):
            sched.cache.complete(entry)
        for layer, expert in ((0, 0), (1, chosen)):
            decisions, _ = sched.begin(layer, [[expert]])
            for d in decisions:
                if d.entry is None:
                    sched.cache.complete(sched.admit(layer, d.expert, d.precision, REC, REC))
            sched.end(layer)

    gate = PrefetchGate(floor=0.5, warmup=4)
    sched = schedule(gate)
    for t in range(4):  # right twice, wrong twice: half used, the gate stays open
        token(sched, 2 + t, 2 + t if t % 2 == 0 else 7)
    assert sched.prefetching and gate.pays(sched.cache)
    token(sched, 3, 7)  # wrong again: 2 of 5 used
    assert not sched.prefetching
    issued = sum(c.prefetches for c in sched.cache.counters)
    token(sched, 4, 4)
    assert sum(c.prefetches for c in sched.cache.counters) == issued  # nothing read once closed
    assert sched.prefetch([PrefetchRequest(1, 5)], {"int4": REC}) == []

    ungated = schedule(None)
    for t in range(6):
        token(ungated, 2 + t % 3, 7)
    assert ungated.prefetching and sum(c.prefetch_wasted for c in ungated.cache.counters) >= 5
