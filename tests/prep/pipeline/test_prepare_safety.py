"""prepare never destroys a user's files, swaps an artifact atomically, repairs a damaged one, validates
names, locks, and refuses hostile recipes.

Each test is built from a reproduction of the failure it guards against. "Killed" runs here raise ``Killed`` (a
BaseException nothing in prep catches, ``tests/helpers/interrupt.py``) at the exact step named; tests/prep/pipeline/test_prepare_kill.py kills a real
subprocess with SIGKILL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import prep.store
from loader.format import read_manifest
from loader.verify import verify
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.pipeline import prepare
from prep.recipe import load_recipe, recipe_from_dict
from prep.store import ArtifactOutput, exclusive_lock
from tests.helpers.interrupt import Killed, interrupted, uninterrupted
from tests.helpers.tiny_models import file_hashes
from tests.helpers.tiny_models import tiny_recipe as _tiny_recipe


def tiny_recipe(precision: str = "int4", **sections):
    """The tests' recipe with the divergence off: it merges into the artifact after the swap these tests kill, and a
    kill inside a merge is tested on its own (tests/prep/evals/test_eval.py)."""
    return _tiny_recipe(precision, divergence={"enabled": False}, **sections)


def _loadable(artifact: Path) -> bool:
    read_manifest(artifact)
    return verify(artifact) == []


def _siblings(artifact: Path) -> list[str]:
    """What lies beside the artifact besides the stage cache and the lock."""
    return sorted(p.name for p in artifact.parent.iterdir() if p.name not in ("stages", ".lock"))


def _only_one_version(artifact: Path) -> None:
    assert artifact.is_symlink()
    assert _siblings(artifact) == sorted([artifact.name, os.readlink(artifact)])


# ------------------------------------------------------------------------- 1. no data loss at --output


def test_output_holding_other_files_is_refused_and_left_alone(root):
    notes = root / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("buy milk\n")
    with pytest.raises(MoeprepError, match="not a moeprep artifact.*--overwrite"):
        prepare(tiny_recipe(), root=root, output=notes)
    assert (notes / "todo.txt").read_text() == "buy milk\n"
    a_file = root / "file.txt"
    a_file.write_text("keep")
    with pytest.raises(MoeprepError, match="--overwrite"):
        prepare(tiny_recipe(), root=root, output=a_file)
    assert a_file.read_text() == "keep"
    # with --overwrite the user asked for it
    prepare(tiny_recipe(), root=root, output=notes, overwrite=True)
    assert _loadable(notes) and not (notes / "todo.txt").exists()
    # an empty directory holds nothing to lose
    empty = root / "empty"
    empty.mkdir()
    prepare(tiny_recipe(), root=root, output=empty)
    assert empty.is_symlink() and _loadable(empty)


def test_model_dir_cwd_root_and_their_ancestors_are_refused_even_with_overwrite(root, monkeypatch):
    model = root / "model"
    weights = {p.name: p.read_bytes() for p in model.iterdir()}
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (root / "to-model").symlink_to(model)
    for output in (model, root, root.parent, elsewhere, Path("."), Path(".."), root / "artifacts" / "tiny",
                   root / "artifacts" / "tiny" / "stages", root / "to-model"):
        with pytest.raises(MoeprepError, match="refusing --output"):
            prepare(tiny_recipe(), root=root, output=output, overwrite=True)
    assert {p.name: p.read_bytes() for p in model.iterdir()} == weights
    assert (root / "to-model").resolve() == model.resolve()


def test_cli_output_dot_and_overwrite(root, monkeypatch):
    monkeypatch.chdir(root)
    (root / "r.yaml").write_text("name: tiny\nmodel: {path: model}\n"
                                 "calibration: {num_sequences: 2, sequence_length: 16}\nquantize: {group_size: 16}\n")
    for extra in ([], ["--overwrite"]):
        result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "r.yaml", "--output", ".", *extra])
        assert result.exit_code == 1 and "refusing --output ." in result.output, result.output
        assert "Traceback" not in result.output
    (root / "out").mkdir()
    (root / "out" / "mine.txt").write_text("x")
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "r.yaml", "--output", "out"])
    assert result.exit_code == 1 and "--overwrite" in result.output and (root / "out" / "mine.txt").exists()
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "r.yaml", "--output", "out", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert _loadable(root / "out")


def test_a_symlink_moeprep_did_not_make_is_replaced_only_with_overwrite(root):
    target = root / "precious"
    target.mkdir()
    (target / "data.txt").write_text("x")
    link = root / "link"
    link.symlink_to(target)
    with pytest.raises(MoeprepError, match="symlink.*--overwrite"):
        prepare(tiny_recipe(), root=root, output=link)
    prepare(tiny_recipe(), root=root, output=link, overwrite=True)
    assert _loadable(link) and (target / "data.txt").read_text() == "x"  # the link is replaced, not its target


# ------------------------------------------------------------------- 2. the swap is one atomic rename


def _clean_hashes(tmp_path_factory, **quantize) -> dict[str, str]:
    _, summary = uninterrupted(tmp_path_factory, tiny_recipe(**quantize))
    return file_hashes(Path(summary["artifact"]))


# os.<name> killed before ("before") or after ("after") the call, as the moment says of its arguments
KILL_POINTS = {
    # a kill while the new version is written: nothing published yet
    "while building": ("replace", lambda src, dst, *a: "before" if Path(dst).name == "plan.json" else None),
    # the finished version is renamed into place but not linked
    "after the version rename": ("rename", lambda src, dst, *a: "after" if ".artifact.v-" in str(dst) else None),
    # the new symlink exists but is not yet renamed over the artifact
    "before the swap": ("replace", lambda src, dst, *a: "before" if Path(dst).name == "artifact" else None),
    # swapped; the previous version not yet removed
    "after the swap": ("replace", lambda src, dst, *a: "after" if Path(dst).name == "artifact" else None),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_kill_at_any_step_of_the_swap_leaves_a_loadable_artifact(prepared_root, tmp_path_factory, monkeypatch, point):
    root = prepared_root  # prepared once per run, copied: this test starts after a prepare
    artifact = Path(prepare(tiny_recipe(), root=root)["artifact"])
    old = file_hashes(artifact)
    new = _clean_hashes(tmp_path_factory, precision="int8")
    name, when = KILL_POINTS[point]
    with interrupted(monkeypatch, os, name, when=when, raising=Killed):
        prepare(tiny_recipe(precision="int8"), root=root)
    assert _loadable(artifact)
    assert file_hashes(artifact) in (old, new)
    rerun = prepare(tiny_recipe(precision="int8"), root=root)
    assert rerun["quantize"]["cached"]
    assert file_hashes(artifact) == new and _loadable(artifact)
    _only_one_version(artifact)


def _make_plain(artifact: Path) -> None:
    """Turn the symlinked artifact into a plain directory, as an older moeprep left it."""
    version = artifact.resolve()
    artifact.unlink()
    shutil.copytree(version, artifact)
    shutil.rmtree(version)


def test_a_plain_artifact_of_an_older_moeprep_is_exchanged_in_one_step(prepared_root, tmp_path_factory, monkeypatch):
    root = prepared_root  # prepared once per run, copied: this test starts after a prepare
    artifact = Path(prepare(tiny_recipe(), root=root)["artifact"])
    _make_plain(artifact)
    new = _clean_hashes(tmp_path_factory, precision="int8")
    def exchanged_old_directory(path: Path) -> bool:
        return ".link-" in path.name and path.is_dir() and not path.is_symlink()

    # killed right after the exchange: the old directory is not yet removed
    with interrupted(monkeypatch, prep.store, "_remove", when=exchanged_old_directory, raising=Killed):
        prepare(tiny_recipe(precision="int8"), root=root)
    assert artifact.is_symlink() and file_hashes(artifact) == new
    prepare(tiny_recipe(precision="int8"), root=root)
    _only_one_version(artifact)


def test_without_rename_exchange_the_migration_is_repaired_by_the_next_run(prepared_root, tmp_path_factory, monkeypatch):
    root = prepared_root  # prepared once per run, copied: this test starts after a prepare
    artifact = Path(prepare(tiny_recipe(), root=root)["artifact"])
    old = file_hashes(artifact)
    _make_plain(artifact)
    new = _clean_hashes(tmp_path_factory, precision="int8")
    with monkeypatch.context() as m:  # the documented window: killed between the fallback's two renames
        m.setattr(prep.store, "_exchange", lambda a, b: False)
        with interrupted(m, os, "replace", when=lambda src, dst, *a: Path(dst).name == "artifact", raising=Killed):
            prepare(tiny_recipe(precision="int8"), root=root)
    assert not artifact.exists()
    ArtifactOutput(artifact, protected=[]).tidy()  # what the next run does first, before any work
    assert _loadable(artifact) and file_hashes(artifact) in (old, new)
    with monkeypatch.context() as m:  # and without the kill, the fallback migrates
        artifact_target = artifact.resolve()
        artifact.unlink()
        shutil.copytree(artifact_target, artifact)
        m.setattr(prep.store, "_exchange", lambda a, b: False)
        prepare(tiny_recipe(precision="int8"), root=root, force="package")
    assert file_hashes(artifact) == new
    _only_one_version(artifact)


def test_leftovers_of_killed_runs_do_not_pile_up(prepared_root):
    root = prepared_root  # prepared once per run, copied: this test starts after a prepare
    artifact = Path(prepare(tiny_recipe(), root=root)["artifact"])
    parent = artifact.parent
    for name in (".artifact.tmp-999", ".artifact.v-0123456789ab", ".artifact.old-77"):
        (parent / name).mkdir()
        (parent / name / "dense.safetensors").write_bytes(b"\0" * 4096)
    (parent / ".artifact.link-5").symlink_to(".artifact.v-0123456789ab")
    again = prepare(tiny_recipe(), root=root)
    assert again["package"]["cached"]
    _only_one_version(artifact)
    prepare(tiny_recipe(precision="int8"), root=root)  # the replaced version goes too
    _only_one_version(artifact)


# ------------------------------------------------------------------ 3. re-running prepare repairs it


@pytest.mark.parametrize("damage", ["delete dense", "truncate store", "edit key", "delete manifest"])
def test_a_damaged_artifact_is_rebuilt_by_running_prepare_again(root, damage):
    import json

    artifact = Path(prepare(tiny_recipe(), root=root)["artifact"])
    good = file_hashes(artifact)
    if damage == "delete dense":
        (artifact / "dense.safetensors").unlink()
    elif damage == "truncate store":
        store = artifact / "experts-int4.safetensors"
        store.write_bytes(store.read_bytes()[:-100])
    elif damage == "edit key":
        manifest = json.loads((artifact / "manifest.json").read_text())
        manifest["package_key"] = "0" * 64
        (artifact / "manifest.json").write_text(json.dumps(manifest))
    else:
        (artifact / "manifest.json").unlink()
    if damage != "edit key":  # verify does not know which key an artifact should have; prepare does
        assert verify(artifact) != []
    rerun = prepare(tiny_recipe(), root=root)
    assert not rerun["package"]["cached"] and rerun["quantize"]["cached"]
    assert file_hashes(artifact) == good and _loadable(artifact)


# --------------------------------------------------------------------------------------- 6. names


def test_recipe_names_are_one_plain_path_component(tmp_path):
    for bad in ("../escape", "a/b", "..", ".hidden", "", "-x", "a b", "/abs", "x\\y"):
        with pytest.raises(MoeprepError, match="recipe name"):
            recipe_from_dict({"name": bad, "model": {"path": "m"}})
    for good in ("tiny", "Mixtral-8x7B_v0.1", "7"):
        assert recipe_from_dict({"name": good, "model": {"path": "m"}}).name == good
    bad_file = tmp_path / "my recipe.yaml"  # the name defaults to the file's stem
    bad_file.write_text("model: {path: m}\n")
    with pytest.raises(MoeprepError, match="recipe name 'my recipe'"):
        load_recipe(bad_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my recipe.yaml"]


# ------------------------------------------------------------------------------------- 8. locking


def test_a_second_prepare_of_the_same_name_stops_at_once_naming_the_holder(root):
    lock = root / "artifacts" / "tiny" / ".lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, str(os.getpid()).encode())\n"
         "print('held', flush=True)\ntime.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.perf_counter()
        with pytest.raises(MoeprepError, match=rf"artifact name 'tiny' is in use .*pid {holder.pid}\b"):
            prepare(tiny_recipe(), root=root)
        assert time.perf_counter() - started < 5
    finally:
        holder.kill()
        holder.wait()
    assert prepare(tiny_recipe(), root=root)["artifact"]  # the kernel released the killed holder's lock
    assert lock.read_text().strip() == str(os.getpid())


def test_an_output_elsewhere_is_locked_too(root):
    out = root / "shared-out"
    with exclusive_lock(root / ".shared-out.lock", "test"):
        with pytest.raises(MoeprepError, match=rf"artifact output .*shared-out is in use .*pid {os.getpid()}"):
            prepare(tiny_recipe(), root=root, output=out)
    prepare(tiny_recipe(), root=root, output=out)
    assert _loadable(out)


# ----------------------------------------------------------------------------- 10. hostile recipes


def _laughs(levels: int = 9) -> list[str]:
    """Flow-style anchors, each holding ten aliases of the one before: 10**levels values expanded."""
    items = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return items


def test_billion_laughs_recipe_is_refused_fast(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("name: bomb\nmodel: {path: m}\n" + "".join(f"l{i}: {x}\n" for i, x in enumerate(_laughs())))
    started = time.perf_counter()
    with pytest.raises(MoeprepError, match="aliases"):
        load_recipe(bomb)
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: ok\nmodel: {path: m}\nquantize: &q {precision: int8}\n")  # a small alias is fine
    assert load_recipe(ok).quantize.precision == "int8"
    with pytest.raises(MoeprepError, match="aliases"):  # through --set too
        load_recipe(ok, ("quantize.precision=[" + ", ".join(_laughs()) + "]",))
    assert time.perf_counter() - started < 2
    looped = tmp_path / "loop.yaml"
    looped.write_text("name: loop\nmodel: &m {path: m, again: *m}\n")
    with pytest.raises(MoeprepError, match="recursive alias"):
        load_recipe(looped)
    with pytest.raises(MoeprepError, match="--set value"):
        load_recipe(ok, ("quantize.precision=[unclosed",))


def test_an_artifact_listing_a_report_under_reports_is_complete_and_one_leaving_it_is_not(tmp_path):
    """A published artifact whose manifest lists ``reports/...`` plots counts as complete (the package stage is then
    reused, not rebuilt on every prepare); a listed name that climbs out of the artifact never does."""
    import json

    from prep.store import FORMAT, artifact_files_ok

    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "report-plan.png").write_bytes(b"png")
    (tmp_path / "plan.json").write_text("{}")
    files = {"plan.json": {"bytes": 2}, "reports/report-plan.png": {"bytes": 3}}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT, "package_key": "k", "files": files}))
    assert artifact_files_ok(tmp_path, "k") and not artifact_files_ok(tmp_path, "other")
    for bad in ("../plan.json", "reports/../../x", "/etc/passwd", "reports//report-plan.png"):
        (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT, "package_key": "k",
                                                            "files": files | {bad: {"bytes": 2}}}))
        assert not artifact_files_ok(tmp_path, "k"), bad
