"""Dynamic precision without a second pool: a low-precision miss is lodged in a slot of the
main pool (``loader.cache.host_pool``) or read into a read buffer, so a plan with dynamic precision loads at
every budget the same artifact's plain plan does; plans written with a ``low`` pool are run the same way."""

from __future__ import annotations

import json

import pytest
import torch

from loader.budget import cache_layout, minimum_budget
from loader.cache import ExpertCache, PoolConfig, host_pool
from loader.plan import Plan
from loader.policies import policy_factory
from loader.routing import DynamicPrecision
from loader.runtime import LoaderError, load
from loader.schedule import LayerSchedule
from tests.helpers.tiny_models import prepare_tiny_artifact, tiny_recipe

pytestmark = pytest.mark.xdist_group("test_one_pool")  # one worker builds the module-scoped fixtures, not both

# ------------------------------------------------------------------------------------------- the cache


def test_a_precision_without_a_pool_is_lodged_in_the_closest_pool_above_whose_slot_it_fits():
    pools = [("main", "int4", 100), ("high", "passthrough", 400)]
    assert host_pool(pools, "int4", 100) == "main"  # its own pool first
    assert host_pool(pools, "int2", 60) == "main"  # the lowest-ranked pool above it
    assert host_pool(pools, "int2", 150) == "high"  # main's slot is too small for it
    assert host_pool(pools, "int2", 500) is None  # no slot holds it: a read buffer
    assert host_pool([("main", "int2", 100)], "int4", 10) is None  # never below its own precision
    assert host_pool([("main", "int4", 0)], "int2", 10**9) == "main"  # slot unknown (0): taken as fitting


def _cache(slots: int = 2) -> tuple[ExpertCache, LayerSchedule]:
    """One layer of 4 experts planned at int4, a main pool of ``slots`` 100-byte slots, misses read at int2
    (60 bytes) for every selection but the top-1."""
    cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: slots * 100}, 100)], 1, 4,
                        policy_factory("lru", {}))
    return cache, LayerSchedule(cache, [("int4",) * 4], DynamicPrecision(0.0, 1.0, "int2"), readable={"int4", "int2"})


def _step(cache, schedule, rows, weights):
    ids, w = torch.tensor(rows), torch.tensor(weights)
    decisions, _ = schedule.begin(0, rows, ids, w)
    for d in decisions:
        if d.entry is None:
            entry = schedule.admit(0, d.expert, d.precision, {"int4": 100, "int2": 60}[d.precision], 1)
            if entry is not None:
                cache.complete(entry)
    schedule.end(0)
    return decisions


def test_a_low_copy_takes_a_whole_main_slot_serves_a_later_low_miss_and_a_high_read_replaces_it():
    cache, schedule = _cache()
    first = _step(cache, schedule, [[0, 1]], [[0.7, 0.3]])
    assert [(d.expert, d.precision) for d in first] == [(0, "int4"), (1, "int2")]
    low = cache.find(0, 1, "int2")
    assert low.pool == "main" and low.precision == "int2" and low.nbytes == 100  # a slot, not its 60 bytes
    assert cache.nbytes == 200 and cache.find(0, 1, "int4") is None
    again = _step(cache, schedule, [[0, 1]], [[0.6, 0.4]])  # lowered again: the held copy serves it, no read
    assert [d.entry is low for d in again] == [False, True] and cache.counters[0].bytes_read == 2
    _step(cache, schedule, [[1, 0]], [[0.8, 0.2]])  # now its top-1: read high into the same group, copy replaced
    high = cache.find(0, 1)
    assert high.precision == "int4" and high.pool == "main" and cache.nbytes == 200
    assert schedule.miss_policy.stats()["low"] == 2 and schedule.miss_policy.stats()["high"] == 2


def test_a_low_copy_that_fits_no_slot_goes_to_a_read_buffer():
    cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: 200}, 50)], 1, 4, policy_factory("lru", {}))
    assert cache.admit(0, 1, "int2", 60) is None and cache.nbytes == 0


# -------------------------------------------------------------------------------------- the loader (gate)


@pytest.fixture(scope="module")
def dynamic_artifact(tmp_path_factory):
    """A tiny Mixtral with an int4 main store, an int2 low store and dynamic precision reading every selection
    but a token's top-1 low (t1 = 0, t2 = 1: nothing skipped)."""
    recipe = tiny_recipe("int4", quantize={"also": ["int2"]},
                         dynamic_precision={"enabled": True, "low": "int2", "t1": 0.0, "t2": 1.0})
    return prepare_tiny_artifact(tmp_path_factory.mktemp("dynamic-one-pool"), "mixtral", recipe=recipe)[1]


def _decode(loaded, tokens: int = 8) -> None:
    ids = torch.randint(4, 60, (1, tokens), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        step = loaded.model(input_ids=ids[:, :2], use_cache=True)
        for t in range(2, tokens):
            step = loaded.model(input_ids=ids[:, t:t + 1], past_key_values=step.past_key_values, use_cache=True)
            assert torch.isfinite(step.logits).all()


def test_a_plan_with_dynamic_precision_loads_at_the_budget_plain_int4_needs(dynamic_artifact):
    plan = Plan.from_json(json.loads((dynamic_artifact / "plan.json").read_text()))
    assert plan.miss.name == "dynamic_precision" and plan.low_precision == "int2"
    assert [p.precision for p in plan.pools] == ["int4"]  # one pool: no room of the low copies' own
    plain = Plan.default(plan.num_layers, plan.num_experts, "int4")
    need = minimum_budget(dynamic_artifact, plan=plain)
    assert minimum_budget(dynamic_artifact) == need
    with pytest.raises(LoaderError, match=f"minimum of {need:,} bytes"):
        load(dynamic_artifact, memory_budget=need - 1)
    loaded = load(dynamic_artifact, memory_budget=need)
    try:
        _decode(loaded)
        stats = loaded.stats()
        decided = stats["miss_policy"]
        assert decided["policy"] == "dynamic_precision" and decided["low"] > 0 and decided["high"] > 0
        assert decided["skip"] == 0 and stats["bytes_read"] > 0
        budget = loaded.budget
        assert set(budget["pools"]) == {"main"}
        assert stats["peak_expert_bytes"] <= need - budget["dense_bytes"]  # the meter never passed the budget
    finally:
        loaded.close()


def test_held_low_copies_live_in_main_slots_and_serve_later_misses(dynamic_artifact):
    """With room, low copies stay in the main pool's slots; latency-first (strict off) a held low copy serves a
    later miss of the expert at its planned precision."""
    policy = DynamicPrecision(0.0, 1.0, "int2", strict=False)
    loaded = load(dynamic_artifact, memory_budget="unlimited", miss_policy=policy)
    try:
        _decode(loaded, 12)
        cache = loaded.runtime.cache
        held = [e for layer in range(cache.num_layers) for e in cache.layer_entries(layer)]
        assert {e.pool for e in held} == {"main"}
        assert any(e.precision == "int2" for e in held) and any(e.precision == "int4" for e in held)
        slot = loaded.budget["slot_bytes"]["int4"]
        assert all(e.nbytes == slot for e in held)
        assert policy.stats()["low"] > 0 and policy.stats()["low_copy_used"] > 0
    finally:
        loaded.close()


def test_a_plan_written_with_a_low_pool_runs_in_one_pool(dynamic_artifact):
    """The plan of an artifact prepared before (dynamic precision's copies in a ``low`` pool of their own, in
    every operating point too) is read as one pool with the low pool's share given back, so it loads at the
    budget the plain plan needs."""
    raw = json.loads((dynamic_artifact / "plan.json").read_text())
    low = {"name": "low", "precision": "int2", "share": 0.25, "group": "layer"}
    main = raw["pools"][0] | {"share": 0.75}
    raw |= {"pools": [main, low], "operating_points": [{"budget_bytes": 10**6, "pools": [main, low]}]}
    old = Plan.from_json(raw)
    assert [(p.name, p.share) for p in old.pools] == [("main", 1.0)]
    assert [[(p.name, p.share) for p in point.pools] for point in old.operating_points] == [[("main", 1.0)]]
    need = minimum_budget(dynamic_artifact, plan=Plan.default(old.num_layers, old.num_experts, "int4"))
    assert cache_layout(dynamic_artifact, need, plan=old).capacities.pools.keys() == {"main"}
    loaded = load(dynamic_artifact, memory_budget=need, plan=old)
    try:
        _decode(loaded)
        assert loaded.stats()["miss_policy"]["low"] > 0
    finally:
        loaded.close()
    mixed = raw | {"expert_precision": [["int2"] + row[1:] for row in raw["expert_precision"]],
                   "operating_points": []}
    assert len(Plan.from_json(mixed).pools) == 2  # a pool an expert is planned at stays


def test_a_low_copy_whose_form_would_not_fit_a_main_slot_is_held_as_its_record(dynamic_artifact, monkeypatch):
    """Main experts held as records (4 KiB strides) and low copies asked for in float32 (larger than that slot):
    the low copies take their record form, which fits, so they still lodge in main slots."""
    import dataclasses

    monkeypatch.delenv("MOEPREP_EXPERT_DTYPE", raising=False)  # the plan's forms decide
    plan = Plan.from_json(json.loads((dynamic_artifact / "plan.json").read_text()))
    plan = dataclasses.replace(plan, forms=(("int2", "float32"), ("int4", "record")))
    alone = cache_layout(dynamic_artifact, "unlimited", plan=dataclasses.replace(plan, miss=Plan.default(1, 1, "x").miss))
    assert alone.forms == {"int4": "record", "int2": "float32"}  # without dynamic precision nothing is lodged
    assert alone.slot_bytes["int2"] > alone.slot_bytes["int4"]
    layout = cache_layout(dynamic_artifact, "unlimited", plan=plan)
    assert layout.forms == {"int4": "record", "int2": "record"}
    assert layout.slot_bytes["int2"] <= layout.slot_bytes["int4"]
    loaded = load(dynamic_artifact, memory_budget=minimum_budget(dynamic_artifact, plan=plan), plan=plan)
    try:
        _decode(loaded)
        assert loaded.stats()["miss_policy"]["low"] > 0
    finally:
        loaded.close()
