"""The eviction policies (loader/policies.py): which expert each policy evicts, on hand-made sequences.

Every victim below is worked out by hand from the policy's definition (digest sections cited), and
``test_a_random_victim_fails_every_scenario`` proves each scenario pins its victims: a policy that
evicts at random gets at least one of them wrong."""

from __future__ import annotations

import random

import pytest

from loader.cache import PoolConfig
from loader.policies import POLICIES, Clock, EdgeMoEPolicy, EvictionPolicy, policy_factory
from tests.helpers.cache_steps import REC, make_cache, step

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
