"""tune_policy's Optuna workers as executor units (``prep/stages/tune_policy.py``): with ``plan.tune.workers`` > 1 the
stage hands that many units to the run's executor; they rebuild the draft from the files the driver wrote and add
trials to one study until ``trials`` are complete. A rerun reuses finished units, a unit the executor retries
continues the study, and two units side by side (one of them killed) fill one study."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

import prep.stages.tune_policy as tune_policy
from loader.device import DeviceProfile, write_profile
from prep.executor import LocalExecutor, UnitContext, UnitPaths, run_unit
from prep.pipeline import prepare
from prep.stages.tune_policy import DRAFT, DRAFT_TENSORS, STUDY, open_storage, tune, worker_units
from tests.helpers.interrupt import dying, interrupted
from tests.helpers.tiny_models import tiny_recipe

optuna = pytest.importorskip("optuna", reason="tune_policy's units need optuna (a GPU machine may lack it)")

TRIALS = 5
REAL_LOAD_DRAFT = tune_policy.load_draft
COMPLETE = optuna.trial.TrialState.COMPLETE


def tuned_recipe(workers: int, trials: int = TRIALS, **tune_knobs):
    return tiny_recipe("int4", plan={"tune": {"enabled": True, "trials": trials, "workers": workers} | tune_knobs})


def stage_dir(root: Path, summary: dict) -> Path:
    return root / "artifacts/tiny/stages" / f"tune_policy-{summary['tune_policy']['key']}"


def result_of(directory: Path) -> dict:
    return json.loads((directory / "result.json").read_text())["result"]


def complete(study_name: str, storage: str | None, work: Path) -> list:
    study = optuna.load_study(study_name=study_name, storage=open_storage(storage, work))
    return [t for t in study.trials if t.state == COMPLETE]


def test_workers_are_units_of_one_study_and_a_killed_driver_reuses_them(root, monkeypatch):
    """With a next-layer-gates predictor and a device profile, so the units rebuild the prefetch feed and the
    profile too. The driver is killed once its units have finished; the rerun reuses both."""
    write_profile(DeviceProfile(1e9, 1e-4, {"int4": 1e-4}, "test"), root / "device.json")

    def recipe(workers):
        return tiny_recipe("int4", predict={"predictors": ["next_gates"]},
                           plan={"device": "device.json", "tune": {"enabled": True, "trials": TRIALS, "workers": workers}})

    assert tune_policy.STAGE.units(recipe(2), 2) == 2 and tune_policy.STAGE.units(recipe(1), 2) == 0

    # the driver dies after the search, before the stage is committed: ``_predictor_set`` is called by the driver
    # only, after the units (with a device profile)
    with interrupted(monkeypatch, tune_policy, "_predictor_set", on_call=1):
        prepare(recipe(2), root=root, until="tune_policy")
    work = next((root / "artifacts/tiny/stages").glob(".work-tune_policy-*"))
    assert sorted(p.name for p in work.glob("worker-*.json")) == ["worker-0.json", "worker-1.json"]

    two = prepare(recipe(2), root=root, until="tune_policy")
    assert two["tune_policy"]["units"] | {"seconds": 0} == {"ran": 0, "reused": 2, "retried": 0, "seconds": 0}
    final = stage_dir(root, two)
    trials = complete(STUDY, None, final)  # no storage given: the journal in the stage's work directory
    assert len(trials) >= TRIALS
    done = [json.loads((final / f"worker-{i}.json").read_text())["trials"] for i in range(2)]
    assert sorted(done[0] + done[1]) == [t.number for t in trials]  # the units' trials are the study
    result = result_of(final)
    assert result["trials"] == [[t.number, t.params, t.value] for t in trials]
    best = min(trials, key=lambda t: (t.value, t.number))
    assert result["objective"]["best trial"] == best.value
    assert result["chosen"] == f"trial {best.number}" or result["objective"][result["chosen"]] < best.value

    # the local executor runs the units one after another: worker-0 runs every trial with the recipe's seed, so
    # the search is the driver's own, which holds only if the draft the units rebuilt scores as the driver's
    one = prepare(recipe(1), root=root, until="tune_policy")
    assert "units" not in one["tune_policy"]
    alone = result_of(stage_dir(root, one))
    assert alone["trials"] == result["trials"] and done == [[t[0] for t in alone["trials"]], []]
    assert alone["predictors"] == result["predictors"] and alone["eviction"] == result["eviction"]


def test_a_worker_unit_that_fails_is_retried_and_continues_the_study(root, tmp_path, monkeypatch):
    """The study lives in a storage the recipe names; the first try of worker-0 dies in its third trial."""
    calls = {"n": 0}

    def lost_in_trial_2(work):
        draft = REAL_LOAD_DRAFT(work)
        real = draft.simulate

        def simulate(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the worker's node is lost")
            return real(*args, **kwargs)

        draft.simulate = simulate
        return draft

    monkeypatch.setattr(tune_policy, "load_draft", lost_in_trial_2)
    storage = str(tmp_path / "shared.journal")
    summary = prepare(tuned_recipe(2, storage=storage), root=root, until="tune_policy")
    assert summary["tune_policy"]["units"] | {"seconds": 0} == {"ran": 2, "reused": 0, "retried": 1, "seconds": 0}
    study = optuna.load_study(study_name=f"{STUDY}-{summary['tune_policy']['key']}",
                              storage=open_storage(storage, tmp_path))
    failed = [t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    trials = [t.number for t in study.trials if t.state == COMPLETE]
    assert failed == [2] and len(trials) >= TRIALS
    final = stage_dir(root, summary)
    mine = json.loads((final / "worker-0.json").read_text())["trials"]
    assert mine == trials and min(mine) < 2 < max(mine)  # both tries of the unit added to the one study
    assert [t[0] for t in result_of(final)["trials"]] == trials


def _side_by_side(unit, work: str, die_after: int | None) -> None:
    """One worker process running ``unit``, each simulation slowed so that the two interleave; with ``die_after``,
    killed (os._exit) in that simulation."""
    def slow_draft(path):  # called once per worker process
        draft = REAL_LOAD_DRAFT(path)
        real = draft.simulate

        def simulate(*args, **kwargs):
            time.sleep(0.05)
            return real(*args, **kwargs)

        draft.simulate = dying(simulate, on_call=die_after, raising=None)
        return draft

    tune_policy.load_draft = slow_draft  # this forked process only
    run_unit("tune_policy", unit, work, UnitContext(UnitPaths(model_dir=work)))
    os._exit(0)


def test_two_worker_units_side_by_side_fill_one_study_and_a_killed_one_is_run_again(root):
    """The units of a finished stage, run again in a fresh work directory by two processes at once (as two Ray
    workers would), one of them killed in its fourth trial; the executor then runs the killed unit again."""
    recipe = tuned_recipe(2, trials=10)
    final = stage_dir(root, prepare(recipe, root=root, until="tune_policy"))
    work = final.parent / ".work-side-by-side"  # in the stage cache, where draft.json's trace path holds
    work.mkdir()
    for name in (DRAFT, DRAFT_TENSORS):  # kept in the stage directory: what the units rebuilt the draft from
        shutil.copy(final / name, work / name)
    units = worker_units(recipe.plan, work, "side-by-side")

    def search() -> None:
        fork = multiprocessing.get_context("fork")
        workers = [fork.Process(target=_side_by_side, args=(u, str(work), die))
                   for u, die in zip(units, (4, None), strict=True)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert [w.exitcode for w in workers] == [1, 0]
        assert not (work / "worker-0.json").exists() and (work / "worker-1.json").exists()
        stats = LocalExecutor().map("tune_policy", units, work, UnitPaths(model_dir=str(work)))
        assert (stats.ran, stats.reused) == (1, 1)

    tuned = tune(REAL_LOAD_DRAFT(work), recipe.plan, work, study_name="side-by-side", search=search, progress=False)
    trials = complete("side-by-side", None, work)
    assert len(trials) >= 10 and {t.user_attrs["unit"] for t in trials} == {"worker-0", "worker-1"}
    for i in range(2):  # each file lists its unit's complete trials; worker-0's, written by its second try, the first's
        listed = json.loads((work / f"worker-{i}.json").read_text())["trials"]
        assert listed == [t.number for t in trials if t.user_attrs["unit"] == f"worker-{i}"] and listed
    assert [t[0] for t in tuned.trials] == [t.number for t in trials]
