"""Reused files are checked: a damaged unit file of an interrupted run, or a damaged file of a cached stage,
is computed again with a notice, never carried into the artifact (``prep/integrity.py``).

Each case damages a real run's files, reruns ``prepare`` and compares the artifact with a clean build's: a rerun must
end in the clean artifact or one ``MoeprepError``; a traceback or an exit 0 with another artifact is a failure."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import prep.stages.quantize as quantize_stage
from prep.errors import MoeprepError
from prep.integrity import SEAL, sidecar, stage_damage
from prep.pipeline import prepare
from tests.helpers.interrupt import interrupted
from tests.helpers.tiny_models import file_hashes, save_tiny_model, tiny_recipe

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


@pytest.mark.parametrize("damage", [_truncate, _swap, _nan, _flip, _garbage, _unsealed],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_unit_file_of_an_interrupted_run_is_run_again(clean, tmp_path, monkeypatch, capfd, damage):
    clean_root, want = clean
    root = tmp_path / "run"
    save_tiny_model("mixtral", root / "model")
    damaged, intact = _interrupted(root, monkeypatch)
    damage(damaged, intact) if damage in (_swap, _unsealed) else damage(damaged)
    capfd.readouterr()
    summary = prepare(_recipe(), root=root)
    assert summary["quantize"]["units"]["reused"] == 1  # the other file was intact
    unit = f"{damaged.parent.name}/{damaged.stem}"
    assert f"unit {unit}'s file" in capfd.readouterr().err
    assert file_hashes(root / ARTIFACT) == want


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
    cases = [(rng.choice(files), rng.choice(MUTATIONS)) for _ in range(FUZZ_CASES)]
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
