"""The plan's schema (loader/plan.py): operating points round-trip through JSON and are picked by budget, and
malformed points and pool splits are refused by name."""

from __future__ import annotations

import json

import pytest

from loader.budget import capacities
from loader.plan import OperatingPoint, Plan, PlanError, Pool
from tests.helpers.planning_drafts import small_model_sizes


def test_operating_points_round_trip_and_are_picked_by_budget():
    pools = (Pool("main", "int4", 1.0, "layer"),)
    small = OperatingPoint(1500, (Pool("main", "int4", 1.0, "layer", (1.0, 2.0)),))
    large = OperatingPoint(1800, (Pool("main", "int4", 1.0, "layer", (2.0, 1.0)),))
    plan = Plan(2, 4, (("int4",) * 4,) * 2, pools, operating_points=(small, large))
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert plan.for_budget(1700).pools == small.pools
    assert plan.for_budget(1800).pools == large.pools
    assert plan.for_budget(10).pools == small.pools  # below every point: the smallest
    caps = capacities(plan, 1200 + 300, small_model_sizes())
    assert caps.pools["main"] == {0: 100, 1: 200}


@pytest.mark.parametrize("edit, match", [
    (lambda raw: raw["operating_points"][0].update(pools=[{"name": "other", "precision": "int4", "share": 1.0,
                                                           "group": "layer"}]), "names, precisions, groups"),
    (lambda raw: raw["operating_points"].reverse(), "rising"),
    (lambda raw: raw["pools"][0].update(layers=[0, 0]), "not all 0"),
    (lambda raw: raw["pools"][0].update(layers=[1]), "non-negative"),
])
def test_malformed_points_and_splits_are_refused(edit, match):
    pools = (Pool("main", "int4", 1.0, "layer"),)
    points = tuple(OperatingPoint(b, pools) for b in (1500, 1800))
    raw = Plan(2, 4, (("int4",) * 4,) * 2, pools, operating_points=points).to_json()
    edit(raw)
    with pytest.raises(PlanError, match=match):
        Plan.from_json(raw)
