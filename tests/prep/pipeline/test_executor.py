"""The executor: stage units run in-process or on Ray and give the same bytes; a failed or lost unit is
retried; a killed driver resumes with the units it has; without Ray, asking for it is one clear error.

The Ray tests start a 2-CPU Ray instance on this machine (``ray.init(num_cpus=2)``, Ray's local mode for tests).
A unit that must fail inside a Ray worker is a function of this module, which Ray is told to send by value (the
workers cannot import the tests)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import prep.stages.quantize as quantize_stage
import prep.stages.sensitivity as sensitivity_stage
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.executor import ExecutorSection, LocalExecutor, Unit, UnitPaths, unit_seed
from prep.pipeline import prepare
from prep.recipe import load_recipe
from tests.helpers.interrupt import dying, interrupted, stage_files, uninterrupted
from tests.helpers.planning_drafts import locality_replay, planning_draft, tune_section
from tests.helpers.tiny_models import sweep_recipe

REPO = Path(__file__).resolve().parents[3]
REAL_QUANTIZE_LAYER = quantize_stage.quantize_layer
REAL_SWEEP_LAYER = sensitivity_stage.sweep_layer


# --- units --------------------------------------------------------------------------------------------------


def draw(context, out: Path, *, marker: str | None = None) -> None:
    """A unit writing a random draw (so its seed shows); with ``marker``, it fails on its first try."""
    import torch

    if marker is not None and not Path(marker).exists():
        Path(marker).write_text("failed once")
        raise RuntimeError("a flaky unit")
    out.write_text(json.dumps(torch.rand(3).tolist()))


def test_units_are_seeded_by_identity_retried_and_reused(tmp_path):
    units = [Unit(name=f"u{i}", output=f"u{i}.json", fn=draw) for i in range(4)]
    units.append(Unit(name="flaky", output="flaky.json", fn=draw, args={"marker": str(tmp_path / "marker")}))
    paths = UnitPaths(model_dir=str(tmp_path))
    first = LocalExecutor().map("demo", units, tmp_path / "a", paths)
    assert (first.ran, first.reused, first.retried) == (5, 0, 1)
    second = LocalExecutor().map("demo", list(reversed(units)), tmp_path / "b", paths)  # another order, same bytes
    assert all((tmp_path / "a" / u.output).read_bytes() == (tmp_path / "b" / u.output).read_bytes() for u in units)
    assert len({(tmp_path / "a" / u.output).read_text() for u in units}) == 5  # one seed per unit
    assert second.retried == 0  # the marker is there: no failure this time
    again = LocalExecutor().map("demo", units, tmp_path / "a", paths)
    assert (again.ran, again.reused) == (0, 5)
    assert unit_seed("demo", "u0") != unit_seed("demo", "u1") and unit_seed("demo", "u0") == unit_seed("demo", "u0")
    # no temporary file left: only each unit's seal
    assert sorted(p.name for p in (tmp_path / "a").glob(".*")) == sorted(f".{u.output}.xxh3" for u in units)


def test_a_unit_failing_every_try_fails_the_map_and_a_user_error_is_not_retried(tmp_path):
    calls = []

    def broken(context, out):
        calls.append(1)
        raise MoeprepError("a user's mistake")

    with pytest.raises(MoeprepError, match="mistake"):
        LocalExecutor(ExecutorSection(max_retries=3)).map("demo", [Unit("u", "u.json", broken)], tmp_path,
                                                          UnitPaths(model_dir=str(tmp_path)))
    assert len(calls) == 1


def test_executor_section_is_checked_and_changes_no_key(tmp_path):
    with pytest.raises(MoeprepError, match="unknown key 'workers' in executor"):
        load_recipe(REPO / "recipes/reference.yaml", ("executor.workers=2",))
    with pytest.raises(MoeprepError, match="executor.kind 'slurm' unknown"):
        load_recipe(REPO / "recipes/reference.yaml", ("executor.kind=slurm",))
    recipe = load_recipe(REPO / "recipes/reference.yaml", ("executor.kind=ray", "executor.address=ray://head:10001"))
    assert recipe.executor == ExecutorSection(kind="ray", address="ray://head:10001")
    from prep.pipeline import _Sources
    from prep.stages.table import STAGES

    local = _Sources(load_recipe(REPO / "recipes/reference.yaml"), REPO, tmp_path)
    ray = _Sources(recipe, REPO, tmp_path)
    for stage in STAGES:  # no stage's key or recorded recipe sees the executor
        if "model" not in stage.needs and "calibration" not in stage.needs:
            assert local.key_inputs(stage) == ray.key_inputs(stage)
        if "recipe" in stage.needs:
            assert "executor" not in ray.recipe_of(stage)


def test_dry_run_shows_the_executor_and_units():
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(REPO / "recipes/reference.yaml"), "--dry-run",
                                          "--set", f"model.path={REPO / 'recipes/reference/model'}"])
    assert "executor: local" in result.output
    assert ("work units: trace 16, quantize 16, sensitivity 4, bitwidth 4 + one map per search round (every other "
            "stage runs whole in the driver)") in result.output, result.output


# --- without Ray ------------------------------------------------------------------------------------------


def test_without_ray_executor_ray_is_a_clear_error(root, monkeypatch):
    """Ray may be installed here: its import is made to fail, as on a machine without the extra."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.chdir(root)
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(REPO / "recipes/reference.yaml"), "--set",
                                              f"model.path={REPO / 'recipes/reference/model'}", "--executor", "ray",
                                              *extra])
        assert result.exit_code == 1, result.output
        assert "needs Ray, which is not installed" in result.output and "pip install -e '.[ray]'" in result.output
        assert "Traceback" not in result.output
    assert not (root / "artifacts").exists()  # refused before any work


# --- a killed driver resumes -------------------------------------------------------------------------------


def test_a_driver_killed_during_sensitivity_resumes_with_the_finished_units(root, tmp_path_factory, monkeypatch):
    clean, _ = uninterrupted(tmp_path_factory, sweep_recipe(), until="sensitivity")
    # Ctrl-C (or a kill) of the driver while the second unit runs
    with interrupted(monkeypatch, sensitivity_stage, "sweep_layer", on_call=2):
        prepare(sweep_recipe(), root=root, until="sensitivity")
    work = next((root / "artifacts/tiny/stages").glob(".work-sensitivity-*"))
    assert sorted(p.name for p in work.glob("layer-*.json")) == ["layer-0.json"]

    resumed = prepare(sweep_recipe(), root=root, until="sensitivity")
    assert resumed["quantize"]["cached"] and not resumed["sensitivity"]["cached"]
    assert resumed["sensitivity"]["units"] | {"seconds": 0} == {"ran": 1, "reused": 1, "retried": 0, "seconds": 0}
    assert stage_files(root) == stage_files(clean)


# --- Ray ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


MARKER = {"path": ""}  # sent with dies_once (by value) to the workers


def dies_once(context, out: Path, **args) -> None:
    """A quantize unit whose worker process dies on the first try of layer 1 at int2 (a lost node)."""
    marker = Path(MARKER["path"])
    if args["layer"] == 1 and args["precision"] == "int2" and not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(1)
    REAL_QUANTIZE_LAYER(context, out, **args)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray instance at a time on the machine
def test_reference_recipe_on_ray_is_byte_identical_to_local_even_when_a_worker_dies(ray_local, tmp_path,
                                                                                     monkeypatch):
    """The reference recipe prepared whole (the accuracy check aside), locally and on 2 Ray workers, one of which is
    killed inside a quantize unit: every stage key, every stage file and every file of the artifact is the same.
    Four calibration sequences: byte identity holds or fails per unit, and four still give every stage and unit
    kind (a trace unit per sequence, quantize per layer and precision) on both executors; eight took twice as long."""
    overrides = (f"model.path={REPO / 'recipes/reference/model'}", "calibration.num_sequences=4",
                 f"plan.device={REPO / 'recipes/reference/device.json'}", "evaluate.enabled=false",
                 "plan.num_sequences=1", "plan.tune.trials=4",  # the planning stages run in the driver: keep them short
                 "divergence.num_sequences=16")
    local_root, ray_root = tmp_path / "local", tmp_path / "ray"
    local = prepare(load_recipe(REPO / "recipes/reference.yaml", overrides), root=local_root)

    marker = tmp_path / "worker-died"
    monkeypatch.setitem(MARKER, "path", str(marker))
    monkeypatch.setattr(quantize_stage, "quantize_layer", dies_once)
    recipe = load_recipe(REPO / "recipes/reference.yaml", (*overrides, "executor.kind=ray"))
    on_ray = prepare(recipe, root=ray_root)
    assert marker.exists()  # a worker really died inside a unit, and its unit was run again
    ran = {s: v["units"]["ran"] for s, v in on_ray.items() if isinstance(v, dict) and "units" in v}
    assert ran["trace"] == 4 and ran["quantize"] == 16 and ran["sensitivity"] == 4 and ran["bitwidth"] >= 4
    assert {s: v["key"] for s, v in on_ray.items() if s != "artifact"} == \
        {s: v["key"] for s, v in local.items() if s != "artifact"}
    local_files, ray_files = stage_files(local_root), stage_files(ray_root)
    assert {"reference/artifact/experts-int4.safetensors", "reference/artifact/plan.json",
            "reference/artifact/report.md"} <= set(local_files)  # the artifact is compared too
    assert ray_files == local_files


# --- Optuna workers sharing one storage ----------------------------------------------------------------------


def _tune_worker(storage: str, trials: int, die_after: int | None) -> None:
    """One Optuna worker process on the shared journal; with ``die_after``, killed (os._exit) in that simulation."""
    import time

    from prep.stages.tune_policy import tune

    draft = planning_draft(locality_replay(seed=2))
    real = draft.simulate

    def slow(*args, **kwargs):
        time.sleep(0.05)  # so the two workers' trials interleave
        return real(*args, **kwargs)

    draft.simulate = dying(slow, on_call=die_after, raising=None)
    tune(draft, tune_section(trials, storage=storage), Path(storage).parent, progress=False, study_name="shared")
    os._exit(0)


def test_two_optuna_workers_share_one_journal_and_a_killed_one_is_resumed(tmp_path):
    import multiprocessing

    import optuna

    from prep.stages.tune_policy import open_storage, tune

    storage = str(tmp_path / "shared.journal")
    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=_tune_worker, args=(storage, 12, die)) for die in (5, None)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [1, 0]  # the first was killed in its fifth simulation
    study = optuna.load_study(study_name="shared", storage=open_storage(storage, tmp_path))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    by_worker = {t.user_attrs["worker"] for t in complete}
    assert len(complete) >= 12 and len(by_worker) == 2  # one study holds the trials of both
    # the study resumes: a later run finds its trials finished and runs none, whatever the killed worker left
    tuned = tune(planning_draft(locality_replay(seed=2)), tune_section(12, storage=storage), tmp_path, progress=False,
                 study_name="shared")
    assert sorted(t[0] for t in tuned.trials) == sorted(t.number for t in complete)
    with pytest.raises(MoeprepError, match="does not exist"):
        tune(planning_draft(locality_replay(seed=2)), tune_section(2, storage=str(tmp_path / "no/such/dir/j")), tmp_path,
             progress=False)
