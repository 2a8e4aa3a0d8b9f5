"""Trust, second pass: what a careless or hostile user can hand the loader gets one clear error, from ``verify``
as from ``load``, never a traceback and never a silent success. (The neuron layout's partial reads:
``tests/loader/test_neuron.py``.)"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from loader.cli import main as moeload
from loader.errors import MoeError
from loader.format import read_manifest, sha256_file, write_manifest
from loader.runtime import load
from loader.verify import verify
from tests.helpers.tiny_models import prepare_tiny_artifact, tiny_recipe

pytestmark = pytest.mark.xdist_group("test_trust")  # one worker builds the module-scoped fixtures, not both

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A tiny artifact whose plan has a routing policy with numbers (gating) and operating points."""
    root = tmp_path_factory.mktemp("planned")
    recipe = tiny_recipe("int4", gating={"enabled": True, "num_sequences": 2},
                         plan={"points": [0.5, 0.75], "allocate": {"enabled": True}})
    return prepare_tiny_artifact(root, "mixtral", recipe=recipe)[1]


def _edited_plan(artifact, tmp_path, change, name: str = "plan.json") -> object:
    """A copy of ``artifact`` whose plan.json (or JSON file ``name``) ``change(value)`` edited, with the manifest's
    hashes recomputed (an editor, not a damaged disk)."""
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    value = json.loads((copy / name).read_text())
    change(value)
    (copy / name).write_text(json.dumps(value))
    manifest = read_manifest(copy)
    raw = manifest.raw
    raw["files"][name] = {"bytes": (copy / name).stat().st_size, "sha256": sha256_file(copy / name)}
    write_manifest(copy, raw)
    return copy


@pytest.mark.parametrize("change, named", [
    (lambda plan: plan["routing"]["params"].update(threshold=math.nan), "routing.params.threshold is nan"),
    (lambda plan: plan["routing"]["params"].update(threshold=-0.5), "routing.params.threshold is -0.5"),
    (lambda plan: plan["operating_points"][0].update(budget_bytes=-1024), "budget_bytes: a positive int"),
])
def test_nan_and_negative_numbers_in_the_plan_are_refused_by_verify_and_load(planned, tmp_path, change, named):
    assert json.loads((planned / "plan.json").read_text())["routing"]["name"] == "adaptive_gating"
    edited = _edited_plan(planned, tmp_path, change)
    problems = verify(edited)
    assert len(problems) == 1 and problems[0].startswith("plan.json:") and named in problems[0]
    with pytest.raises(MoeError, match=named.replace("[", r"\[")):
        load(edited)


@pytest.mark.parametrize("name, change, named", [
    ("plan.json", lambda plan: plan.update(eviction={"name": "fifo", "params": {}}), "eviction policy 'fifo' unknown"),
    ("plan.json", lambda plan: plan.update(eviction={"name": "lru", "params": {"w": 1}}), "'lru' takes no parameters"),
    ("plan.json", lambda plan: plan.update(miss={"name": "guess", "params": {}}), "miss policy 'guess'"),
    ("plan.json", lambda plan: plan.update(miss={"name": "dynamic_precision", "params": {"t1": 2, "t2": 3, "low": "int4"}}),
     "dynamic_precision.t1 must be in [0, 1]"),
    ("plan.json", lambda plan: plan.update(routing={"name": "random", "params": {}}), "routing policy 'random'"),
    ("plan.json", lambda plan: plan["routing"]["params"].update(sensitivity=[1.0]), "1 sensitivities for 2 MoE layers"),
    ("plan.json", lambda plan: plan["routing"]["params"]["sensitivity"].append(1.0), "3 sensitivities for 2 MoE layers"),
    ("plan.json", lambda plan: plan.update(default_budget="9" * 400), "too large to be a number of bytes"),
    ("plan.json", lambda plan: plan.update(default_budget="lots"), "default_budget: memory budget 'lots' not understood"),
    ("plan.json", lambda plan: plan.update(neuron={"name": "dense", "params": {}}), "neuron entry 'dense' is unknown"),
    ("plan.json", lambda plan: plan.update(neuron={"name": "sparse", "params": {}}), "neuron layout"),
    ("plan.json", lambda plan: plan.update(forms={"int9": "bfloat16"}), "forms must map precisions"),
    ("plan.json", lambda plan: plan.update(eviction={"name": "hobbit", "params": {"w_lru": 1e308}}),
     "w_lru must be a number in [0, 1e+06], got 1e+308"),
    ("plan.json", lambda plan: plan.update(eviction={"name": "hobbit", "params": {"w_fld": 2e6}}),
     "w_fld must be a number in [0, 1e+06], got 2000000.0"),
    ("tokenizer.json", lambda tokenizer: tokenizer.pop("model"), "tokenizer files"),
])
def test_verify_refuses_what_load_refuses(planned, tmp_path, name, change, named):
    """Each check ``load`` runs that needs no weights (the plan's policies, gating sensitivities per layer,
    neuron entry, default budget, the tokenizer) and each bound of a sealed plan value (forms' precisions, HOBBIT's
    weights) is refused by ``verify`` and by ``load`` alike, with the same cause named; hashes recomputed, so the
    check under test is the one that fires."""
    assert verify(planned) == []
    edited = _edited_plan(planned, tmp_path, change, name)
    problems = verify(edited)
    assert len(problems) == 1 and problems[0].startswith(f"{name}:") and named in problems[0], problems
    with pytest.raises(MoeError) as refused:
        load(edited)
    assert named in str(refused.value), str(refused.value)


@pytest.mark.parametrize("theta", ["nan", "inf", "-1"])
def test_a_theta_that_is_not_a_finite_number_is_one_clear_error(planned, theta):
    result = CliRunner().invoke(moeload, ["generate", str(planned), "--prompt", "hello", "--theta", theta])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)  # handled: no traceback
    assert "theta" in result.output


@pytest.fixture(scope="module")
def predicting(tmp_path_factory):
    """A tiny artifact whose plan runs all three prefetch predictors (a predictors.safetensors)."""
    root = tmp_path_factory.mktemp("predicting")
    recipe = tiny_recipe("int4", predict={"predictors": ["next_gates", "path_stats", "first_gate"]})
    return prepare_tiny_artifact(root, "mixtral", recipe=recipe)[1]


def _edited_file(artifact, tmp_path, name: str, data: bytes):
    """A copy of ``artifact`` with file ``name`` replaced by ``data`` and the manifest's hashes recomputed."""
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    (copy / name).write_bytes(data)
    raw = read_manifest(copy).raw
    raw["files"][name] = {"bytes": len(data), "sha256": sha256_file(copy / name)}
    write_manifest(copy, raw)
    return copy


def _predictors_with(artifact, change) -> bytes:
    from safetensors.torch import load_file, save

    tensors = load_file(str(artifact / "predictors.safetensors"))
    change(tensors)
    return save(tensors)


@pytest.mark.parametrize("what", ["garbage header", "huge length", "empty", "wrong shape", "nan", "missing gate"])
def test_verify_refuses_a_predictors_file_that_load_would_refuse(predicting, tmp_path, what):
    """Each reproduction of the probe, hashes recomputed: verify names predictors.safetensors, and generate exits
    with one clear error instead of a SafetensorError traceback."""
    import struct

    import torch

    data = {
        "garbage header": lambda: struct.pack("<Q", 40) + b"{not json at all" + b" " * 24,
        "huge length": lambda: struct.pack("<Q", 2**60) + b"{}",
        "empty": lambda: b"",
        "wrong shape": lambda: _predictors_with(predicting, lambda t: t.update(
            {"first_gate.weight": torch.zeros(3, 5)})),
        "nan": lambda: _predictors_with(predicting, lambda t: t["first_gate.weight"].fill_(math.nan)),
        "missing gate": lambda: _predictors_with(predicting, lambda t: t.pop("first_gate.weight")),
    }[what]()
    assert verify(predicting) == []
    edited = _edited_file(predicting, tmp_path, "predictors.safetensors", data)
    problems = verify(edited)
    assert len(problems) == 1 and problems[0].startswith("predictors.safetensors:"), problems
    result = CliRunner().invoke(moeload, ["generate", str(edited), "--prompt", "hello", "--max-new-tokens", "2"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output  # handled
    assert "predictors.safetensors" in result.output or "first-layer gate" in result.output or "first_gate" in \
        result.output


def test_a_prompt_past_the_context_is_an_error_or_a_stated_truncation(planned):
    """The model's context bounds prompt + new tokens: too long is one clear error naming the sizes (not a run of
    minutes), --truncate keeps the prompt's last tokens, and new tokens alone past the context are refused."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(planned).max_position_embeddings
    long_prompt = " ".join(["a b c d"] * context)
    result = CliRunner().invoke(moeload, ["generate", str(planned), "--prompt", long_prompt, "--max-new-tokens", "2"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)
    assert f"context is {context}" in result.output and "--truncate" in result.output
    result = CliRunner().invoke(moeload, ["generate", str(planned), "--prompt", long_prompt, "--max-new-tokens", "2",
                                          "--truncate", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["stats"]["tokens"] <= context
    result = CliRunner().invoke(moeload, ["generate", str(planned), "--prompt", "hi", "--max-new-tokens",
                                          str(context)])
    assert result.exit_code != 0 and "leaves no room" in result.output


def test_a_prompt_that_is_not_utf8_is_one_clear_error(planned):
    result = CliRunner().invoke(moeload, ["generate", str(planned), "--prompt", "caf\udce9"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit) and "UTF-8" in result.output


def test_calibration_sizes_are_bounded_in_the_recipe_and_by_the_context(tmp_path, monkeypatch):
    """A sequence length of 99,999,999 is refused when the recipe is read (so --dry-run refuses it), and one past the
    model's context by the dry run and by prepare, before any memory is spent."""
    from prep.cli import main as moeprep
    from prep.errors import MoeprepError
    from prep.pipeline import prepare
    from tests.helpers.tiny_models import save_tiny_model

    with pytest.raises(MoeprepError, match="bounds are"):
        tiny_recipe(calibration={"sequence_length": 99_999_999})
    monkeypatch.chdir(REPO)  # the reference recipe names its model relative to the repository
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "recipes/reference.yaml", "--dry-run", "--set",
                                          "calibration.sequence_length=99999999"])
    assert result.exit_code != 0 and "bounds are" in result.output
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "recipes/reference.yaml", "--dry-run", "--set",
                                          "calibration.sequence_length=4096"])
    assert result.exit_code != 0 and "longer than the model's context of 1024" in result.output
    save_tiny_model("mixtral", tmp_path / "model")
    with pytest.raises(MoeprepError, match="model's context"):
        prepare(tiny_recipe(calibration={"sequence_length": 100_000}), root=tmp_path)


def test_loading_needs_no_report_and_every_file_has_one_mode(planned, tmp_path):
    """report.json is informational: without it the artifact loads and generates (verify names it), and every file
    of an artifact is written with the same permissions (safetensors' own writer made dense and predictors 0600)."""
    modes = {p.name: p.stat().st_mode & 0o777 for p in planned.rglob("*") if p.is_file()}
    assert len(set(modes.values())) == 1 and set(modes.values()) == {0o644}, modes
    copy = tmp_path / "artifact"
    shutil.copytree(planned, copy)
    (copy / "report.json").unlink()
    result = CliRunner().invoke(moeload, ["generate", str(copy), "--prompt", "hello", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert [line.split(":")[0] for line in verify(copy)] == ["report.json"]


@pytest.mark.parametrize("expert_dtype", ["auto", "packed", "float32"])
def test_one_minimum_budget_for_the_message_and_the_loader(planned, expert_dtype):
    """minimum_budget is the smallest budget load accepts (found by bisection, with operating points, for each held
    form), one byte less is refused, and the refusal names that same number. stats() reports the process's RSS
    beside the budgeted bytes."""
    from loader.runtime import minimum_budget

    def loads(budget: int) -> bool:
        try:
            load(planned, memory_budget=budget, expert_dtype=expert_dtype).close()
            return True
        except MoeError:
            return False

    lo, hi = 1, 4 * minimum_budget(planned, expert_dtype=expert_dtype)
    assert loads(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if loads(mid) else (mid + 1, hi)
    minimum = minimum_budget(planned, expert_dtype=expert_dtype)
    assert minimum == lo
    with pytest.raises(MoeError, match=f"minimum of {minimum:,} bytes"):
        load(planned, memory_budget=minimum - 1, expert_dtype=expert_dtype)
    loaded = load(planned, memory_budget=minimum, expert_dtype=expert_dtype)
    stats = loaded.stats()
    loaded.close()
    assert stats["process_rss_bytes"] > stats["budget"]["limit_bytes"] > 0


def _refuse(code: int):
    import errno
    import os

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[0]) if args else None)
    assert code in (errno.ENOSPC, errno.EROFS)
    return refuse


def test_a_full_disk_is_one_clear_error_naming_the_path(tmp_path, monkeypatch):
    """An atomic write on a full disk is a DiskError naming the file and the fix (the temporary file is gone), and
    any such OSError reaching either command line is printed as one error line, exit 1, no traceback."""
    import errno

    import loader.io
    from loader.errors import DiskError
    from prep.cli import main as moeprep

    with monkeypatch.context() as m:
        m.setattr(loader.io.os, "fsync", _refuse(errno.ENOSPC))
        with pytest.raises(DiskError, match="cannot write .*report.json: the disk is full"):
            loader.io.write_bytes_atomic(tmp_path / "report.json", b"{}")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr("prep.pipeline.prepare", _refuse(errno.ENOSPC))
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(REPO / "recipes" / "reference.yaml")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "the disk is full" in result.output


def test_prepare_into_a_read_only_place_says_so_before_any_work(tmp_path, monkeypatch):
    import errno
    import os
    import types

    import prep.store
    from loader.errors import DiskError

    shim = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    shim.open = _refuse(errno.EROFS)
    monkeypatch.setattr(prep.store, "os", shim)
    with pytest.raises(DiskError, match="read-only"), prep.store.exclusive_lock(tmp_path / "out" / ".lock", "out"):
        pass


def test_eval_checks_it_can_write_before_it_evaluates(planned, tmp_path, monkeypatch):
    """A read-only artifact: eval refuses at once, before loading anything, instead of after the whole evaluation."""
    import errno
    import pathlib

    from loader.errors import DiskError
    from prep.evals.compare import evaluate_artifact
    from tests.helpers.tiny_models import write_tiny_suites

    real = pathlib.Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".moeprep-write-probe") and self.parent.resolve() == planned.resolve():
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", read_only)
    monkeypatch.setattr("prep.evals.compare.load", lambda *a, **k: pytest.fail("evaluated before checking"))
    write_tiny_suites(tmp_path / "suites")
    with pytest.raises(DiskError, match="read-only"):
        evaluate_artifact(planned, planned.parent / "model", suites=("mmlu",), data=tmp_path / "suites", limit=1,
                          output=tmp_path / "eval.json")


def test_a_model_directory_without_its_files_is_one_clear_error(tmp_path):
    from prep.errors import MoeprepError
    from prep.pipeline import prepare

    (tmp_path / "model").mkdir()
    with pytest.raises(MoeprepError, match="holds no config.json"):
        prepare(tiny_recipe(), root=tmp_path)


def test_an_empty_tokenizer_with_hashes_recomputed_is_one_clear_error(planned, tmp_path):
    edited = _edited_file(planned, tmp_path, "tokenizer.json", b"{}")
    result = CliRunner().invoke(moeload, ["generate", str(edited), "--prompt", "hello", "--max-new-tokens", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "tokenizer files" in result.output


@pytest.mark.parametrize("damage", ["garbage index", "truncated shard", "missing shard", "non-utf8 jsonl"])
def test_a_malformed_trace_is_one_clear_error_in_simulate(planned, tmp_path, damage):
    from prep.cli import main as moeprep

    trace = next((planned.parent / "artifacts" / "tiny" / "stages").glob("trace-*/trace"))
    copy = tmp_path / "trace"
    shutil.copytree(trace, copy)
    shards = sorted(p for p in copy.iterdir() if p.suffix == ".safetensors")
    if damage == "garbage index":
        (copy / "index.json").write_bytes(b'{"format": 7, "shards": "no"')
    elif damage == "truncated shard":
        shards[0].write_bytes(shards[0].read_bytes()[:100])
    elif damage == "missing shard":
        shards[0].unlink()
    else:
        copy = tmp_path / "gsm8k_routing.jsonl"
        copy.write_bytes(b'{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2], "gating_probs": '
                         b'[0.6, 0.4]}\n\xff\xfe not text\n')
    result = CliRunner().invoke(moeprep, ["simulate", "--trace", str(copy), "--capacity", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "error:" in result.output and str(copy.name) in result.output


@pytest.mark.parametrize("args, said", [
    (["--set", "quantize.group_size=7"], "group size 7 does not divide"),
    (["--output", "."], "refusing --output ."),
    (["--output", "/"], "refusing --output /"),
    (["--set", "plan.device=no-such-profile.json"], "no-such-profile.json, which the recipe names"),
])
def test_the_dry_run_refuses_what_the_run_refuses(monkeypatch, args, said):
    """Each input the probe found that --dry-run accepted and the run refused: the dry run prints its estimates and
    the refusal, and exits 1; the run refuses it before reading a weight."""
    from prep.cli import main as moeprep

    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "recipes/reference.yaml", "--dry-run", *args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert said in result.output
    assert not (REPO / "no-such-profile.json").exists()


def test_an_altered_report_is_refused_before_the_evaluation(planned, tmp_path, monkeypatch):
    from loader.format import ArtifactError
    from prep.evals.compare import evaluate_artifact
    from tests.helpers.tiny_models import write_tiny_suites

    copy = tmp_path / "artifact"
    shutil.copytree(planned, copy)
    report = json.loads((copy / "report.json").read_text()) | {"compression": {"bfloat16": 99.0}}
    (copy / "report.json").write_text(json.dumps(report))
    monkeypatch.setattr("prep.evals.compare.load", lambda *a, **k: pytest.fail("evaluated before checking"))
    write_tiny_suites(tmp_path / "suites")
    with pytest.raises(ArtifactError, match="not the report.json the manifest lists"):
        evaluate_artifact(copy, planned.parent / "model", suites=("mmlu",), data=tmp_path / "suites", limit=1)
