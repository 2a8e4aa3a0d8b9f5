"""Reused files are checked: a damaged unit file of an interrupted run, or a damaged file of a cached stage,
is computed again with a notice, never carried into the artifact (``prep/integrity.py``).

Each case damages a real run's files, reruns ``prepare`` and compares the artifact with a clean build's: a rerun must
end in the clean artifact or one ``MoeprepError``; a traceback or an exit 0 with another artifact is a failure."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import prep.stages.quantize as quantize_stage
from prep.errors import MoeprepError
from prep.integrity import SEAL, file_xxh3, seal_directory, sidecar, stage_damage
from prep.pipeline import prepare
from tests.helpers.interrupt import interrupted, stage_files, uninterrupted
from tests.helpers.tiny_models import file_hashes, save_tiny_model, sweep_recipe, tiny_recipe

pytestmark = pytest.mark.xdist_group("test_stage_cache_trust")  # one worker builds the module-scoped fixtures, not both

ARTIFACT = Path("artifacts/tiny/artifact")
STAGES = Path("artifacts/tiny/stages")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(root of a clean run, its artifact's hashes)."""
    root = tmp_path_factory.mktemp("clean")
    save_tiny_model("mixtral", root / "model")
    prepare(_recipe(), root=root)
    return root, file_hashes(root / ARTIFACT)


def _recipe():
    """Two precisions of two MoE layers: four quantize units."""
    return tiny_recipe(quantize={"also": ["int2"]})


def _copy(clean_root: Path, to: Path) -> Path:
    shutil.copytree(clean_root, to, symlinks=True)
    return to


# --- the damage ---------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, seed: int = 0) -> None:
    data = bytearray(path.read_bytes())
    i = random.Random(seed).randrange(len(data))
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def _garbage(path: Path) -> None:
    path.write_bytes(b"{not json, not safetensors")


def _nan(path: Path) -> None:
    """A valid safetensors file of the same tensors, every float one NaN and every packed one 0xFF bytes (NaN as
    the half-precision scales inside a record read them)."""
    tensors = load_file(str(path))
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, -1)
               for k, v in tensors.items()}, str(path))


# --- unit files of an interrupted run -----------------------------------------------------------------------


def _interrupted(root: Path, monkeypatch) -> list[Path]:
    """Run ``prepare`` until the quantize stage's third unit, then stop it as a Ctrl-C would; the two unit files
    it finished."""
    with interrupted(monkeypatch, quantize_stage, "quantize_layer", on_call=3):
        prepare(_recipe(), root=root)
    work = next((root / STAGES).glob(".work-quantize-*"))
    done = sorted(work.glob("*/layer-*.safetensors"))
    assert len(done) == 2
    return done


def _swap(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


def _unsealed(path: Path, other: Path) -> None:
    sidecar(path).unlink()


def _swap_sealed(path: Path, other: Path) -> None:
    """Another unit's file copied over this one together with its seal: the bytes match the seal, the unit not."""
    shutil.copyfile(other, path)
    shutil.copyfile(sidecar(other), sidecar(path))


def _old_seal(path: Path, other: Path) -> None:
    """The sidecar an older moeprep wrote: the bare hash of the bytes, bound to no unit."""
    sidecar(path).write_text(file_xxh3(path) + "\n")


def _linked_outside(path: Path, other: Path) -> None:
    """The unit file moved outside ``artifacts/tiny/`` and linked back: the same bytes, its own seal beside the link."""
    outside = path.parents[5] / f"outside-{path.name}"
    path.replace(outside)
    path.symlink_to(outside)


def _fifo_seal(path: Path, other: Path) -> None:
    sidecar(path).unlink()
    os.mkfifo(sidecar(path))


def _deep_seal(path: Path, other: Path) -> None:
    sidecar(path).write_text("[" * 100_000 + "]" * 100_000)


UNIT_DAMAGE = (_swap_sealed, _old_seal, _linked_outside, _fifo_seal, _deep_seal)  # damage(path, other)


@pytest.mark.parametrize("damage", [_truncate, _swap, _nan, _flip, _garbage, _unsealed, *UNIT_DAMAGE],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_unit_file_of_an_interrupted_run_is_run_again(clean, tmp_path, monkeypatch, capfd, damage):
    clean_root, want = clean
    root = tmp_path / "run"
    save_tiny_model("mixtral", root / "model")
    damaged, intact = _interrupted(root, monkeypatch)
    damage(damaged, intact) if damage in (_swap, _unsealed, *UNIT_DAMAGE) else damage(damaged)
    kept = {p: p.read_bytes() for p in root.glob("outside-*")}
    capfd.readouterr()
    summary = _within(120, prepare, _recipe(), root=root)  # a FIFO seal must not block the rerun
    assert summary["quantize"]["units"]["reused"] == 1  # the other file was intact
    unit = f"{damaged.parent.name}/{damaged.stem}"
    err = capfd.readouterr().err
    assert f"unit {unit}'s file" in err or (damage is _linked_outside and "outside" in err), err
    assert file_hashes(root / ARTIFACT) == want
    assert {p: p.read_bytes() for p in root.glob("outside-*")} == kept  # what a link pointed to is left alone


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, failing the test (not hanging it) when it has not returned after ``seconds``."""
    out: dict = {}

    def call() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 (raised again in the test's thread)
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s (blocked)"
    if "error" in out:
        raise out["error"]
    return out["value"]


# --- files of a cached stage ----------------------------------------------------------------------------------


def test_a_flipped_byte_in_a_cached_stage_file_is_computed_again_not_packaged(clean, tmp_path, capfd):
    clean_root, want = clean
    root = _copy(clean_root, tmp_path / "run")
    (quantized,) = (root / STAGES).glob("quantize-*")
    _flip(quantized / "int4/layer-0.safetensors")
    assert "layer-0.safetensors is not what the stage wrote" in stage_damage(quantized)
    capfd.readouterr()
    summary = prepare(_recipe(), root=root, force="package")
    assert not summary["quantize"]["cached"] and "stage quantize: the cached result" in capfd.readouterr().err
    assert file_hashes(root / ARTIFACT) == want
    assert stage_damage(quantized) is None  # computed again, and sealed again


def test_a_stage_cached_before_the_seals_is_computed_again(clean, tmp_path):
    root = _copy(clean[0], tmp_path / "run")
    (traced,) = (root / STAGES).glob("trace-*")
    (traced / SEAL).unlink()
    assert "no .seal.json" in stage_damage(traced)
    assert not prepare(_recipe(), root=root)["trace"]["cached"]


MUTATIONS = (_truncate, _flip, _garbage)
FUZZ_CASES = 40


def test_fuzz_the_stage_cache_no_traceback_and_no_silent_success(clean, tmp_path):
    """Mutated files of every stage directory, a seeded sample; then a rerun that packages again."""
    clean_root, want = clean
    files = sorted(p.relative_to(clean_root) for p in (clean_root / STAGES).rglob("*")
                   if p.is_file() and not p.name.endswith(".lock"))
    rng = random.Random(42)
    drawn = [(rng.choice(files), rng.choice(MUTATIONS)) for _ in range(FUZZ_CASES)]
    # one case per kind of damage drawn, the first drawn: a file kind (the layer files of one precision are one
    # kind, read by one code path) and a mutation; a repeat of a kind is the same check again (22 of the 40 drawn)
    cases, kinds = [], set()
    for name, mutate in drawn:
        if (kind := (re.sub(r"layer-\d+", "layer-N", str(name)), mutate)) not in kinds:
            kinds.add(kind)
            cases.append((name, mutate))
    tracebacks, silent, clear = [], [], 0
    for i, (name, mutate) in enumerate(cases):
        root = _copy(clean_root, tmp_path / f"case-{i}")
        mutate(root / name)
        try:
            prepare(_recipe(), root=root, force="package")
        except MoeprepError:
            clear += 1
            continue
        except Exception as e:  # noqa: BLE001 (what the fuzz counts)
            tracebacks.append(f"{name} {mutate.__name__}: {type(e).__name__}: {e}")
            continue
        if file_hashes(root / ARTIFACT) != want:
            silent.append(f"{name} {mutate.__name__}")
        shutil.rmtree(root)
    print(f"stage-cache fuzz: {len(cases)} cases, {clear} clear errors, {len(tracebacks)} tracebacks, "
          f"{len(silent)} silent successes")
    assert tracebacks == [] and silent == [], (tracebacks, silent)


def test_a_merged_trace_left_by_an_interrupted_run_is_checked_before_it_is_reused(clean, tmp_path, monkeypatch,
                                                                                    capfd):
    """The trace stage merges its units' files into ``trace/`` in the work directory: a run stopped after the merge
    reuses it, only when it is what was merged."""
    import prep.stages.trace as trace_stage

    clean_root, want = clean
    root = tmp_path / "run"
    save_tiny_model("mixtral", root / "model")
    with interrupted(monkeypatch, trace_stage, "open_trace", on_call=1):  # stopped right after the merge
        prepare(_recipe(), root=root)
    (work,) = (root / STAGES).glob(".work-trace-*")
    shard = sorted(p for p in (work / "trace").rglob("*") if p.is_file() and p.suffix == ".safetensors")[0]
    _flip(shard)
    capfd.readouterr()
    prepare(_recipe(), root=root)
    assert "the merged trace" in capfd.readouterr().err
    assert file_hashes(root / ARTIFACT) == want


# --- what a seal says, links, and seals that are not files ------------------------------------------------------


def _reseal(directory: Path) -> None:
    """Seal ``directory`` again as its stage would (what a careful forger, or a tool that "repairs" seals, does)."""
    seal = json.loads((directory / SEAL).read_text())
    seal_directory(directory, "result.json", (directory / "result.json").read_text(), seal["bound"])


def _old_stage_seal(stage: Path) -> None:
    seal = json.loads((stage / SEAL).read_text())
    (stage / SEAL).write_text(json.dumps({"files": seal["files"]}))  # an older moeprep's: bound to no stage or key


def _stage_renamed(stage: Path) -> None:
    """Another key's directory of the same stage copied to this key's name, seal and all."""
    seal = json.loads((stage / SEAL).read_text())
    seal["bound"]["key"] = "0" * 64
    (stage / SEAL).write_text(json.dumps(seal))


def _stage_linked_outside(stage: Path) -> None:
    outside = stage.parents[3] / "outside-stage"
    stage.replace(outside)
    stage.symlink_to(outside)


def _file_linked_outside(stage: Path) -> None:
    outside = stage.parents[3] / "outside-layer-0.safetensors"
    (stage / "int4/layer-0.safetensors").replace(outside)
    (stage / "int4/layer-0.safetensors").symlink_to(outside)


def _fifo_stage_seal(stage: Path) -> None:
    (stage / SEAL).unlink()
    os.mkfifo(stage / SEAL)


def _deep_stage_seal(stage: Path) -> None:
    (stage / SEAL).write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")


@pytest.mark.parametrize("damage", [_old_stage_seal, _stage_renamed, _stage_linked_outside, _file_linked_outside,
                                    _fifo_stage_seal, _deep_stage_seal], ids=lambda f: f.__name__.strip("_"))
def test_a_cached_stage_that_is_not_this_stages_or_leaves_the_artifact_directory_is_computed_again(
        clean, tmp_path, capfd, damage):
    """The quantize stage's cache: a seal bound to no key or another key, a link leaving ``artifacts/tiny/`` (the
    directory or one file), a FIFO or a bottomless seal: computed again with a notice, what a link pointed to kept."""
    clean_root, want = clean
    root = _copy(clean_root, tmp_path / "run")
    (quantized,) = (root / STAGES).glob("quantize-*")
    damage(quantized)
    kept = {p: sorted(p.rglob("*")) if p.is_dir() else p.read_bytes() for p in root.glob("outside-*")}
    capfd.readouterr()
    summary = _within(120, prepare, _recipe(), root=root, force="package")
    assert not summary["quantize"]["cached"] and "stage quantize: the cached result" in capfd.readouterr().err
    assert file_hashes(root / ARTIFACT) == want
    assert not quantized.is_symlink() and stage_damage(quantized) is None  # computed again, where it belongs
    assert {p: sorted(p.rglob("*")) if p.is_dir() else p.read_bytes() for p in root.glob("outside-*")} == kept


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A clean run of the sensitivity sweep (its result's ranking is what the bit-width search orders by)."""
    return uninterrupted(tmp_path_factory, sweep_recipe(), until="sensitivity")[0]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_resealed_sensitivity_result_out_of_range_never_enters_the_plan(swept, tmp_path, capfd, value):
    """A NaN, an infinity or a negative KL written into the cached sensitivity result and sealed again: the bytes
    match the seal, the values do not; the stage is computed again, so bitwidth never orders by them."""
    root = _copy(swept, tmp_path / "run")
    (profile,) = (root / STAGES).glob("sensitivity-*")
    raw = json.loads((profile / "result.json").read_text())
    raw["result"]["ranking"][0][1] = value
    (profile / "result.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    _reseal(profile)
    assert "xxh3" not in (stage_damage(profile) or "")  # the seal vouches for the bytes: the values are refused
    capfd.readouterr()
    summary = prepare(sweep_recipe(), root=root, until="sensitivity")
    assert not summary["sensitivity"]["cached"]
    assert "stage sensitivity: the cached result" in capfd.readouterr().err
    assert stage_files(root) == stage_files(swept)


def test_a_resealed_nan_unit_file_is_run_again(swept, tmp_path, monkeypatch, capfd):
    """An interrupted sweep's finished unit file with a NaN, sealed again as that unit's: run again, with a notice."""
    import prep.stages.sensitivity as sensitivity_stage

    root = tmp_path / "run"
    save_tiny_model("qwen3_moe", root / "model")
    with interrupted(monkeypatch, sensitivity_stage, "sweep_layer", on_call=2):
        prepare(sweep_recipe(), root=root, until="sensitivity")
    (done,) = (root / STAGES).glob(".work-sensitivity-*/layer-0.json")
    bound = json.loads(sidecar(done).read_text())["bound"]
    row = json.loads(done.read_text())
    done.write_text(json.dumps([float("nan")] + row[1:]))
    sidecar(done).unlink()
    from prep.integrity import seal_unit

    seal_unit(done, done, bound)
    capfd.readouterr()
    summary = prepare(sweep_recipe(), root=root, until="sensitivity")
    assert summary["sensitivity"]["units"]["reused"] == 0
    err = capfd.readouterr().err
    assert "not a finite number" in err, err[-2000:]
    assert stage_files(root) == stage_files(swept)
