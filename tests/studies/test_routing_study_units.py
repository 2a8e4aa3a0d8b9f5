"""The routing study runs each (budget, point) as an executor unit: the points are those a direct computation
gives, a rerun reuses every point file, a point measured with other settings is measured again, and an
interrupted study resumes with the points already written. The cheapest configuration of the study's own test
(``tests/prep/methods/test_less_per_token.py``): one budget, one knob per method, loglikelihood suites, 3 items."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner

import prep.studies.routing as routing
from loader.plan import Plan
from prep.cli import main as moeprep
from prep.integrity import seal_unit, unit_binding
from prep.sim.replay import load_replay
from prep.sim.simulate import artifact_spec, simulate
from tests.helpers.interrupt import interrupted

KNOBS = {"gating": (0.3,), "dynamic_precision": ((0.6, 0.1),), "cache_prior": (1.0,), "max_rank": (3,)}
METHODS = ["exact", "gating", "dynamic_precision", "cache_prior", "max_rank"]
REAL_POINT = routing.study_point


def _root(root):
    from tests.helpers.tiny_models import save_tiny_model, tiny_recipe, write_tiny_suites

    save_tiny_model("mixtral", root / "model")
    write_tiny_suites(root / "suites")
    recipe = tiny_recipe("passthrough", calibration={"num_sequences": 4, "sequence_length": 24},
                         quantize={"precision": "passthrough", "also": ["int4"]}, dynamic_precision={"low": "int4"})
    (root / "tiny.yaml").write_text(yaml.safe_dump(recipe.to_dict()))
    return dict(budgets=("unlimited",), knobs=KNOBS, suites=("mmlu", "truthfulqa"), limit=3, data=root / "suites",
                sequences=2, echo=lambda m: None)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One study measured through units, with the plans of its points (captured from ``_plans``)."""
    root = tmp_path_factory.mktemp("routing")
    run = _root(root)
    plans, real = [], routing._plans

    def captured(*args, **kw):
        plans[:] = real(*args, **kw)
        return plans

    mp = pytest.MonkeyPatch()
    mp.setattr(routing, "_plans", captured)
    try:
        study = routing.run_study(root / "tiny.yaml", root / "study", root, **run)
    finally:
        mp.undo()
    return root, run, study, plans


def test_the_points_are_those_of_a_direct_computation(measured):
    """Each point file is what simulating and evaluating its plan here, without units or JSON, gives."""
    root, run, study, plans = measured
    out = root / "study"
    assert [p["method"] for p in study["points"]] == METHODS
    files = [out / "points" / f"{routing.point_slug('unlimited', m, k)}.json" for m, _, k, _ in plans]
    assert [json.loads(f.read_text()) for f in files] == study["points"]
    assert json.loads((out / "study.json").read_text())["points"] == study["points"]
    assert (out / "study.md").is_file() and (out / "study.png").is_file()
    assert all(abs(s["delta"]) == 0 for s in study["points"][0]["suites"].values())  # lossless, exact routing
    assert study["points"][1]["routing"]["single_ratio"] > 0
    assert study["points"][2]["miss_policy"]["policy"] == "dynamic_precision"

    artifact, replay = out / "artifact", load_replay(out / "trace-seed1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a unit computes
    try:
        for (method, _, knob, plan), point in zip(plans, study["points"], strict=True):
            assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).to_json() == plan.to_json()
            sim = simulate(replay, artifact_spec(artifact, "unlimited", plan=plan)).to_json()
            ev = routing.evaluate_artifact(artifact, root / "model", suites=run["suites"], data=run["data"],
                                           limit=3, memory_budget="unlimited", reuse_original=out / "original",
                                           plan=plan)
            assert (point["method"], point["knob"]) == (method, knob)
            assert (point["miss_rate"], point["bytes_per_token"], point["tokens"]) == \
                (sim["miss_rate"], sim["bytes_read_per_token"], sim["tokens"])
            assert {k: (s["delta"], s["flips"]) for k, s in point["suites"].items()} == \
                {k: (s["delta"], s["flips"]) for k, s in ev["suites"].items()}
    finally:
        torch.set_num_threads(threads)


def test_a_rerun_reuses_every_point_file_and_measures_again_only_a_changed_one(measured, monkeypatch):
    root, run, study, _ = measured
    out = root / "study"

    def never(*args, **kw):
        raise AssertionError("a kept point was measured again")

    with monkeypatch.context() as m:
        m.setattr(routing, "evaluate_artifact", never)
        m.setattr(routing, "simulate", never)
        assert routing.run_study(root / "tiny.yaml", out, root, **run)["points"] == study["points"]
        for f in (out / "points").glob("*.json"):  # a study made before points were units: study.json only
            f.unlink()
        assert routing.run_study(root / "tiny.yaml", out, root, **run)["points"] == study["points"]
        assert len(list((out / "points").glob("*.json"))) == len(METHODS)

    slug = routing.point_slug("unlimited", "gating", 0.3)
    changed = json.loads((out / "points" / f"{slug}.json").read_text())
    changed["settings"] = changed["settings"] | {"limit": 99}  # as if measured with other settings
    (out / "points" / f"{slug}.json").write_text(json.dumps(changed))
    seal_unit(out / "points" / f"{slug}.json", out / "points" / f"{slug}.json",  # as a unit with those settings would
              unit_binding(routing.STUDY, slug, f"points/{slug}.json"))
    (out / "study.json").unlink()  # else its entry of the point, measured with these settings, would be kept
    calls = []
    monkeypatch.setattr(routing, "study_point", lambda *a, **kw: calls.append(kw["method"]) or REAL_POINT(*a, **kw))
    again = routing.run_study(root / "tiny.yaml", out, root, **run)
    assert calls == ["gating"] and again["points"] == study["points"]
    assert json.loads((out / "points" / "set-aside" / f"{slug}.json").read_text()) == changed


def test_an_interrupted_study_resumes_with_the_points_written(measured, monkeypatch):
    root, run, study, _ = measured
    out = root / "interrupted"
    with interrupted(monkeypatch, routing, "study_point", on_call=3):
        routing.run_study(root / "tiny.yaml", out, root, **run)
    written = {f.name: f.read_bytes() for f in (out / "points").glob("*.json")}
    assert len(written) == 2 and not (out / "study.json").exists()
    assert all(p.name.endswith(".xxh3") for p in (out / "points").glob(".*"))  # no half-written file, only seals

    calls = []
    monkeypatch.setattr(routing, "study_point", lambda *a, **kw: calls.append(kw["method"]) or REAL_POINT(*a, **kw))
    resumed = routing.run_study(root / "tiny.yaml", out, root, **run)
    assert calls == METHODS[2:]
    assert all((out / "points" / name).read_bytes() == data for name, data in written.items())  # kept as written
    assert resumed["points"] == study["points"]  # the same points as the study run in one go


def test_on_ray_without_ray_is_one_clear_error_before_any_work(tmp_path, monkeypatch):
    _root(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as on a machine without the extra
    result = CliRunner().invoke(moeprep, ["routing-study", "--recipe", str(tmp_path / "tiny.yaml"), "--output",
                                          str(tmp_path / "out"), "--executor", "ray"])
    assert result.exit_code == 1 and "needs Ray, which is not installed" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_truncated_point_file_is_measured_again_not_a_traceback(measured, capfd):
    root, run, study, _ = measured
    out = root / "study-truncated"
    routing.run_study(root / "tiny.yaml", out, root, **run)
    slug = routing.point_slug("unlimited", "gating", 0.3)
    point = out / "points" / f"{slug}.json"
    point.write_text(point.read_text()[:20])
    capfd.readouterr()
    again = routing.run_study(root / "tiny.yaml", out, root, **run)
    assert f"point file {point} is not reused" in capfd.readouterr().err
    assert again["points"] == study["points"]
