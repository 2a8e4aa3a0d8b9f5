"""Planning for a device: AdapMoE's DP allocation, HOBBIT's tuned cache weights, operating points."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from loader.budget import capacities
from loader.plan import Plan, PolicySpec, Pool
from prep.errors import MoeprepError
from prep.methods.allocation import allocate, closed_form_curve
from prep.recipe import recipe_from_dict
from prep.sim.simulate import capacities_spec, simulate
from prep.stages.planning import Draft
from prep.stages.tune_policy import JOURNAL, STUDY, tune
from tests.helpers.interrupt import interrupted
from tests.helpers.planning_drafts import locality_replay, planning_draft, tune_section
from tests.helpers.tiny_models import prepare_tiny_artifact, tiny_recipe

pytestmark = pytest.mark.xdist_group("test_planning")  # one worker builds the module-scoped fixtures, not both

# ------------------------------------------------------------------------------------------- the DP


def test_closed_form_reproduces_the_digest_numbers():
    assert closed_form_curve(0.25, 0.9, 8) == pytest.approx(
        [0.850, 0.659, 0.493, 0.350, 0.232, 0.138, 0.068, 0.022, 0.0], abs=6e-4)
    assert closed_form_curve(0.6, 0.9, 8) == pytest.approx(
        [0.5000, 0.3925, 0.2979, 0.2161, 0.1471, 0.0911, 0.0479, 0.0175, 0.0], abs=6e-5)
    # no gating, no prefetch: two needed experts, each misses with probability 1 - t/N
    assert closed_form_curve(0, 0, 8) == pytest.approx([2 * (1 - t / 8) for t in range(9)])


def test_the_digest_worked_example():
    curves = [closed_form_curve(a, b, 8) for a, b in [(0, 0.57), (0.25, 0.9), (0.6, 0.9)]]
    slots, cost = allocate(curves, [1, 1, 1], 8)
    assert slots == (6, 2, 0)
    assert cost == pytest.approx(1.22821, abs=1e-5)
    assert curves[0][5] + curves[1][3] + curves[2][0] == pytest.approx(1.23402, abs=1e-5)  # the runner-up


def _brute_force(curves, sizes, capacity, lows):
    best = None
    for slots in itertools.product(*(range(lo, len(c)) for c, lo in zip(curves, lows, strict=True))):
        if sum(t * b for t, b in zip(slots, sizes, strict=True)) > capacity:
            continue
        cost = sum(c[t] for c, t in zip(curves, slots, strict=True))
        if best is None or cost < best[1] - 1e-12:
            best = (slots, cost)
    return best


def test_brute_force_agrees_on_small_random_cases():
    rng = random.Random(0)
    for _ in range(60):
        cells = rng.randint(1, 4)
        curves = []
        for _ in range(cells):
            n = rng.randint(1, 5)
            down = sorted((rng.random() * 3 for _ in range(n + 1)), reverse=True)
            curves.append(down if rng.random() < 0.7 else [rng.random() * 3 for _ in range(n + 1)])
        sizes = [rng.choice([1, 2, 3, 5]) for _ in range(cells)]
        lows = [rng.choice([0, 0, 1]) for _ in range(cells)]
        capacity = rng.randint(sum(lo * b for lo, b in zip(lows, sizes, strict=True)), 25)
        slots, cost = allocate(curves, sizes, capacity, lows)
        want = _brute_force(curves, sizes, capacity, lows)
        assert cost == pytest.approx(want[1], abs=1e-9)
        assert sum(t * b for t, b in zip(slots, sizes, strict=True)) <= capacity
        assert all(lo <= t < len(c) for t, c, lo in zip(slots, curves, lows, strict=True))


def test_the_tie_break_decides_only_between_equal_costs_as_a_brute_force_does():
    rng = random.Random(1)
    for _ in range(60):
        cells = rng.randint(1, 4)
        curves, ties = [], []
        for _ in range(cells):
            n = rng.randint(1, 5)
            curves.append([float(rng.choice([0, 0, 1, 2])) for _ in range(n + 1)])  # many equal costs
            ties.append(sorted((rng.random() for _ in range(n + 1)), reverse=True))
        sizes = [rng.choice([1, 2, 3]) for _ in range(cells)]
        capacity = rng.randint(0, 15)
        slots, cost = allocate(curves, sizes, capacity, tiebreak=ties)
        want = min((sum(c[t] for c, t in zip(curves, s, strict=True)), sum(c[t] for c, t in zip(ties, s, strict=True)))
                   for s in itertools.product(*(range(len(c)) for c in curves))
                   if sum(t * b for t, b in zip(s, sizes, strict=True)) <= capacity)
        assert cost == want[0]
        assert sum(c[t] for c, t in zip(ties, slots, strict=True)) == pytest.approx(want[1])
        assert sum(t * b for t, b in zip(slots, sizes, strict=True)) <= capacity


def test_flat_costs_still_fill_the_budget_with_the_records_that_spare_reads():
    # every read hides behind compute: each cell's cost is 0 whatever it holds; the bytes read still fall
    curves, ties = [[0.0] * 5, [0.0] * 5], [[4.0, 2.0, 1.0, 0.5, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]]
    assert allocate(curves, [1, 1], 3)[0] == (0, 0)  # without it: ties go to fewer bytes
    assert allocate(curves, [1, 1], 3, tiebreak=ties)[0] == (2, 1)
    with pytest.raises(MoeprepError, match="tie-break"):
        allocate(curves, [1, 1], 3, tiebreak=[[0.0]])


def test_no_cell_gets_more_than_its_experts():
    curves = [closed_form_curve(0.1, 0.5, 8), closed_form_curve(0.2, 0.5, 4)]
    slots, cost = allocate(curves, [1, 1], 1000)  # room for far more than 12 records
    assert slots == (8, 4) and cost == pytest.approx(0.0)


def test_an_allocation_that_cannot_fit_says_so():
    with pytest.raises(MoeprepError, match="raise the budget"):
        allocate([[1.0, 0.0]], [10], 5, [1])


# ------------------------------------------------------------------------------------- tune_policy


def test_tuned_policy_is_never_worse_than_the_defaults(tmp_path):
    draft = planning_draft(locality_replay())
    cfg = tune_section(8)
    tuned = tune(draft, cfg, tmp_path, progress=False)
    plan = tuned.apply(draft.plan)
    budget = draft.budget_for_share(0.4)
    chosen = draft.cost(draft.simulate(plan, draft.capacities(plan, budget)))
    assert chosen == pytest.approx(min(v for v in tuned.objective.values() if v is not None))
    # the baselines scored independently of the study, straight through the simulator
    for name in ("lru", "lfu", "edgemoe"):
        spec = capacities_spec(draft.plan, draft.capacities(draft.plan, budget), {"int4": 100})
        plain = simulate(draft.replay, spec, policy=name)
        assert chosen <= sum(r.demand_bytes for r in plain.layers) / plain.tokens + 1e-9
    # trial 0 is HOBBIT's equal weights on one global pool
    hobbit_equal = {"w_lru": 0.25, "w_lfu": 0.25, "w_lhu": 0.25, "w_fld": 0.25}
    assert tuned.trials[0][0] == 0 and tuned.objective["default"] == tuned.trials[0][2]
    default = dataclasses.replace(draft.plan, pools=(Pool("main", "int4", 1.0, "global"),),
                                  eviction=PolicySpec("hobbit", hobbit_equal))
    assert tuned.objective["default"] == pytest.approx(draft.cost(draft.simulate(default, draft.capacities(default, budget))))
    assert chosen <= tuned.objective["default"]


def test_the_planning_stages_put_the_profiles_read_depth_in_the_plan(tmp_path):
    from loader.device import DeviceProfile
    from prep.stages.allocate_cache import CacheAllocation, allocate_plan
    from prep.stages.planning import PlanContext
    from prep.stages.tune_policy import TunedPolicy

    profile = DeviceProfile(1e9, 1e-4, {"int4": 1e-4}, "test", {"read_depths": {"1": 5e8, "4": 1e9}, "read_depth": 4})
    draft = dataclasses.replace(planning_draft(locality_replay()), profile=profile)
    tuned = tune(draft, tune_section(2), tmp_path, progress=False)
    cfg = recipe_from_dict({"name": "t", "model": {"path": "m"},
                            "plan": {"allocate": {"enabled": True}, "points": [0.5]}}).plan
    allocation = allocate_plan(draft, cfg, progress=False)
    context = PlanContext(draft.sizes)
    for result in (tuned, allocation):
        assert result.read_depth == 4
        plan = result.apply(draft.plan, context)
        assert plan.read_depth == 4 and Plan.from_json(plan.to_json()) == plan
        # a result saved before the field (or planned with an old profile) leaves the plan's depth unplanned
        old = type(result).from_json({k: v for k, v in result.to_json().items() if k != "read_depth"})
        assert old.read_depth is None and old.apply(draft.plan, context).read_depth == 0
    assert isinstance(tuned, TunedPolicy) and isinstance(allocation, CacheAllocation)


def test_modelled_seconds_that_never_change_still_fill_the_budget_with_the_records_that_spare_reads(monkeypatch):
    """Where the device model hides every read behind compute, each cell's seconds are flat: the DP held nothing
    (ties went to fewer bytes) and planning stopped with "the budget holds no expert record at all"."""
    from loader.device import DeviceProfile
    from prep.stages.allocate_cache import allocate_plan

    profile = DeviceProfile(1e9, 0.0, {"int4": 1e-2}, "test", calibration={"overlap": True})
    draft = dataclasses.replace(planning_draft(locality_replay()), profile=profile)
    monkeypatch.setattr(Draft, "layer_costs", lambda self, result: [0.0] * len(result.layers))
    cfg = recipe_from_dict({"name": "t", "model": {"path": "m"},
                            "plan": {"allocate": {"enabled": True}, "points": [0.5]}}).plan
    allocation = allocate_plan(draft, cfg, progress=False)
    assert all(v == 0.0 for curve in allocation.curves for v in curve)  # the seconds say nothing
    (point,) = allocation.points
    assert sum(point["slots"]) == 12  # half of 3 layers x 8 experts: the budget is used
    assert point["allocated"]["demand_bytes_per_token"] <= point["uniform"]["demand_bytes_per_token"] + 1e-9


def test_a_killed_study_resumes_with_its_finished_trials(tmp_path, monkeypatch):
    draft = planning_draft(locality_replay(seed=1))
    with interrupted(monkeypatch, draft, "simulate", on_call=4):  # the process is killed during trial 3
        tune(draft, tune_section(6), tmp_path, progress=False)
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    assert (tmp_path / JOURNAL).is_file()
    study = optuna.load_study(study_name=STUDY, storage=JournalStorage(JournalFileBackend(str(tmp_path / JOURNAL))))
    before = [(t.number, t.params, t.value) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(before) == 3
    tuned = tune(draft, tune_section(6), tmp_path, progress=False)
    assert len(tuned.trials) == 6
    assert [tuple(t) for t in tuned.trials[:3]] == before  # kept, not re-run


def test_plan_section_errors_name_the_fix():
    with pytest.raises(MoeprepError, match="plan.allocate.cost"):
        recipe_from_dict({"name": "t", "model": {"path": "m"}, "plan": {"allocate": {"cost": "guess"}}})
    with pytest.raises(MoeprepError, match="plan.points"):
        recipe_from_dict({"name": "t", "model": {"path": "m"}, "plan": {"points": [0, 0.5]}})
    with pytest.raises(MoeprepError, match="unknown"):
        recipe_from_dict({"name": "t", "model": {"path": "m"}, "plan": {"tune": {"trails": 3}}})


# ------------------------------------------------------------------------------------ the pipeline


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    recipe = tiny_recipe("passthrough", calibration={"num_sequences": 4, "sequence_length": 24},
                         predict={"predictors": ["next_gates"]},
                         plan={"points": [0.25, 0.5], "allocate": {"enabled": True},
                               "tune": {"enabled": True, "trials": 3}},
                         package={"cache_fraction": 0.2})
    _, artifact = prepare_tiny_artifact(root, recipe=recipe)
    return artifact


def test_prepare_writes_the_joint_plan_and_its_operating_points(planned):
    from loader.plan import read_plan

    plan = read_plan(planned)
    report = json.loads((planned / "report.json").read_text())
    points = report["operating_points"]
    assert [p["share"] for p in points] == [0.25, 0.5]
    for p in points:
        assert p["budget_bytes"] > 0 and "modeled_tokens_per_s" in p and "accuracy_delta" in p
        assert isinstance(p["cost"], float) and math.isfinite(p["cost"])
    assert {p.budget_bytes for p in plan.operating_points} >= {p["budget_bytes"] for p in points}
    tuned = report["planning"]["tune_policy"]
    assert plan.eviction.name == tuned["eviction"]["name"] and tuned["trials"] == 3
    assert "## Operating points" in (planned / "report.md").read_text()
    # the loader takes each point's pools at its budget, and every cell holds the records the DP gave it
    from loader.runtime import cache_layout

    cells = report["planning"]["allocate_cache"]["cells"]
    for point in points:
        layout = cache_layout(planned, point["budget_bytes"])
        assert layout.plan.pools == next(p.pools for p in plan.operating_points if p.budget_bytes == point["budget_bytes"])
        if layout.plan.pools[0].group == "layer":
            for cell, records in zip(cells, point["slots"], strict=True):
                slot = layout.slot_bytes[next(p.precision for p in plan.pools if p.name == cell["pool"])]
                assert layout.capacities.pools[cell["pool"]][cell["layer"]] >= records * slot


def test_the_loader_runs_each_operating_point_with_unchanged_outputs(planned):
    import torch

    from loader.runtime import load

    report = json.loads((planned / "report.json").read_text())
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    outs = []
    for point in report["operating_points"] + [{"budget_bytes": "unlimited"}]:
        loaded = load(planned, memory_budget=point["budget_bytes"])
        if point["budget_bytes"] != "unlimited":
            assert loaded.budget["operating_point"] == point["budget_bytes"]  # the point made for this budget
        try:
            with torch.no_grad():
                outs.append(loaded.model(ids).logits)
        finally:
            loaded.close()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_measuring_the_device_again_reruns_the_planning_stages(tmp_path):
    from loader.device import DeviceProfile, write_profile
    from prep.pipeline import prepare
    from tests.helpers.tiny_models import save_tiny_model

    save_tiny_model("mixtral", tmp_path / "model")
    recipe = tiny_recipe("passthrough", plan={"device": "device.json", "points": [0.5], "allocate": {"enabled": True}})

    def keys(bandwidth: float) -> dict:
        write_profile(DeviceProfile(bandwidth, 1e-4, {"passthrough": 1e-3}, "test"), tmp_path / "device.json")
        summary = prepare(recipe, root=tmp_path, output=tmp_path / "artifact", until="allocate_cache")
        return {name: summary[name]["key"] for name in ("trace", "allocate_cache")}

    first, again, other = keys(1e9), keys(1e9), keys(2e9)
    assert first == again
    assert other["trace"] == first["trace"] and other["allocate_cache"] != first["allocate_cache"]


def test_a_predictor_enters_the_plan_only_where_the_simulator_says_it_saves_time(tmp_path):
    """With a device profile, every subset of the plan's predictors is scored with the tuned policy: the plan
    keeps the cheapest, the smaller on a tie. The simulator is replaced by a table of seconds per predictor
    set, so the choice is known: path_stats saves time, next_gates costs time, first_gate changes nothing."""
    from types import SimpleNamespace

    from loader.device import DeviceProfile

    draft = planning_draft(locality_replay(seed=2))
    draft.plan = dataclasses.replace(draft.plan, predictors=(
        PolicySpec("next_gates", {"depth": 1}), PolicySpec("path_stats"), PolicySpec("first_gate")))
    draft.profile = DeviceProfile(1e9, 0.0, {"int4": 1e-3})
    effect = {"next_gates": +0.2, "path_stats": -0.3, "first_gate": 0.0}

    def simulate(plan, caps, sequences=None):
        seconds = 1.0 + sum(effect[p.name] for p in plan.predictors)
        return SimpleNamespace(seconds=seconds, tokens=1)

    draft.simulate = simulate
    tuned = tune(draft, tune_section(3), tmp_path, progress=False)
    assert tuned.predictors == ["path_stats"]
    assert [p.name for p in tuned.apply(draft.plan).predictors] == ["path_stats"]
    assert tuned.objective["predictors: none"] == pytest.approx(1.0)
    assert tuned.objective["predictors: path_stats+first_gate"] == pytest.approx(0.7)
    assert tuned.objective["predictors: next_gates+path_stats+first_gate"] == pytest.approx(0.9)
    # without a profile the objective is demand bytes, which says nothing of time: the recipe's set stays
    draft.profile = None
    draft.simulate = lambda plan, caps, sequences=None: SimpleNamespace(layers=[SimpleNamespace(demand_bytes=1)], tokens=1)
    (tmp_path / "bytes").mkdir()
    kept = tune(draft, tune_section(3), tmp_path / "bytes", progress=False)
    assert kept.predictors is None and len(kept.apply(draft.plan).predictors) == 3


# ------------------------------------------------------------------------- the planner's slots are the loader's


@pytest.fixture(scope="module")
def forms_artifact(tmp_path_factory):
    """(model, artifact): a tiny Mixtral whose experts take every held form (intermediate 32 and groups of 32, so
    int4pack applies where the kernel is), int4 experts with dynamic precision's int2 low copies."""
    from prep.pipeline import prepare
    from tests.helpers.tiny_models import VOCAB, build_tiny_model, mixtral_config, tiny_tokenizer

    root = tmp_path_factory.mktemp("forms")
    config = mixtral_config()
    config.intermediate_size = 32
    model = build_tiny_model("mixtral", config=config)
    model.save_pretrained(root / "model")
    tiny_tokenizer(VOCAB).save_pretrained(root / "model")
    recipe = tiny_recipe("int4", group_size=32, quantize={"also": ["int2"]},
                         dynamic_precision={"enabled": True, "low": "int2"})
    prepare(recipe, root=root, output=root / "artifact")
    return model, root / "artifact"


@pytest.mark.parametrize("form", ["record", "float32", "bfloat16", "float16", "int4pack", "qdot"])
def test_the_planner_and_the_loader_give_the_same_slots_and_capacities_for_every_held_form(forms_artifact, form):
    """What the planner sizes before the artifact exists (``prep.stages.planning.model_sizes`` from the stores'
    record layouts, then ``capacities``) is what the loader builds from the artifact (``cache_layout``), for each
    held form: the slots, the read and staging buffers, and every pool's capacity at several budgets."""
    import torch

    from loader.budget import cache_layout, minimum_budget
    from loader.codec import RecordLayout
    from loader.format import read_manifest
    from loader.forms import FORMS
    from loader.plan import read_plan
    from prep.adapters import get_adapter
    from prep.stages.planning import model_sizes

    assert set(FORMS) == {"record", "float32", "bfloat16", "float16", "int4pack", "qdot"}  # a new form joins the list
    model, artifact = forms_artifact
    layouts = {p: RecordLayout.from_json(s["layout"]) for p, s in read_manifest(artifact).raw["stores"].items()}
    if FORMS[form](layouts["int4"], torch.device("cpu")) is None:
        pytest.skip(f"{form} does not apply here (no CPU int4 kernel in this torch build, or no compiled kernels)")
    dtype = "packed" if form == "record" else form
    plan = read_plan(artifact)
    sizes = model_sizes(model, get_adapter(model), {p: lay.nbytes for p, lay in layouts.items()}, layouts, "cpu",
                        dtype, plan)
    lowest = minimum_budget(artifact, expert_dtype=dtype)
    for budget in (lowest, lowest + 5 * 4096, 3 * lowest, "unlimited"):
        loader = cache_layout(artifact, budget, expert_dtype=dtype)
        assert set(loader.forms.values()) == {form}
        assert sizes.record_bytes == loader.slot_bytes and sizes.staging_bytes == loader.sizes.staging_bytes
        assert capacities(plan, budget, sizes) == loader.capacities, budget
