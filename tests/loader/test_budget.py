"""The budget (loader/budget.py): what a memory budget buys per pool and layer, and the minimum it states."""

from __future__ import annotations

import dataclasses

import pytest

from loader.budget import capacities, minimum_bytes
from loader.plan import OperatingPoint, Plan, PlanError, Pool
from tests.helpers.planning_drafts import small_model_sizes


def test_a_pools_layer_split_can_leave_a_layer_empty():
    plan = Plan(2, 4, (("int4",) * 4, ("int4",) * 4), (Pool("main", "int4", 1.0, "layer", (3.0, 0.0)),))
    sizes = small_model_sizes()
    caps = capacities(plan, 1000 + 200 + 300, sizes)  # dense + 2 read buffers + 3 records
    assert caps.pools["main"] == {0: 300, 1: 0}
    assert capacities(plan, "unlimited", sizes).pools["main"] == {0: 400, 1: 400}  # every expert fits
    assert minimum_bytes(plan, sizes) == 1000 + 200 + 100  # one record in the only group given bytes


def test_a_budget_below_the_smallest_allocation_runs_its_pools_split_equally():
    """The smallest point gives layer 1 three times layer 0 (it needs 4 records to give layer 0 one): a budget
    with room for 2 records runs those pools split equally instead of being refused, and the minimum the loader
    states is that of the equal split."""
    from loader.budget import lowest_budget

    pools = (Pool("main", "int4", 1.0, "layer"),)
    small = OperatingPoint(1600, (Pool("main", "int4", 1.0, "layer", (1.0, 3.0)),))
    plan = Plan(2, 4, (("int4",) * 4,) * 2, pools, operating_points=(small,))
    sizes = small_model_sizes()
    assert minimum_bytes(dataclasses.replace(plan, pools=small.pools), sizes) == 1200 + 400
    assert lowest_budget(plan, sizes) == 1200 + 200  # one record per layer, split equally
    caps = capacities(plan, 1200 + 200, sizes)
    assert caps.pools["main"] == {0: 100, 1: 100}
    assert capacities(plan, 1200 + 400, sizes).pools["main"] == {0: 100, 1: 300}  # the point's own split
    with pytest.raises(PlanError, match="below the minimum of 1,400 bytes"):
        capacities(plan, 1200 + 199, sizes)
