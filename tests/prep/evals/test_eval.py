"""The accuracy check: data sources, paired statistics, MC2 masking, and a lossless artifact's zero flips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from loader.artifact import open_artifact
from loader.errors import MoeError
from loader.format import MANIFEST, ArtifactError
from loader.verify import verify
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.evals import templates as tpl
from prep.evals.compare import (
    PENDING,
    _Models,
    _truthfulqa,
    evaluate_artifact,
    mcnemar_p,
    merge_into_artifact,
)
from prep.evals.data import load_benchmarks
from prep.pipeline import prepare
from prep.recipe import recipe_from_dict
from tests.helpers.interrupt import interrupted
from tests.helpers.tiny_models import save_tiny_model, write_tiny_suites

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data" / "benchmarks"


def test_mcnemar_exact_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0
    # b=1, c=9: 2 * (C(10,0) + C(10,1)) / 2^10
    assert mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)


def test_gsm8k_gold_with_calculator_annotations():
    answer = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert tpl.gsm8k_gold(answer) == "72"
    assert tpl.gsm8k_extract_cot("So 48 + 24 = 72. The answer is 72.\n\nQ:") == "72"
    assert tpl.gsm8k_extract_flexible("She has $1,234.") == "1234"


def test_mmlu_fewshot_prompt_template():
    shot = {"question": "1 + 1?", "subject": "math", "choices": ["1", "2", "3", "4"], "answer": 1}
    item = {"question": "2 + 2?", "subject": "math", "choices": ["4", "5", "6", "7"], "answer": 0}
    assert tpl.mmlu_fewshot_prompt(item, [shot]) == (
        "The following are multiple choice questions (with answers) about math.\n\n"
        "1 + 1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n"
        "2 + 2?\nA. 4\nB. 5\nC. 6\nD. 7\nAnswer:"
    )


class _FixedScores(torch.nn.Module):
    """A 'model' whose next-token logits favour token 5 everywhere, to exercise MC2 masking."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, 64)
        logits[..., 5] = 5.0
        return type("O", (), {"logits": logits})()


class _Tok:
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1] + [5 if c == "T" else 7 for c in text]}


def test_mc2_uses_the_label_mask_in_any_order():
    # choices made of 'T' are likely under the fixed model; true answers are not listed first
    item = {"question": "q", "mc1_targets": {"choices": ["x", "TT"], "labels": [1, 0]},
            "mc2_targets": {"choices": ["x", "TT", "y"], "labels": [0, 1, 0]}}
    models = _Models(_FixedScores(), _FixedScores(), Path("."), None)
    mc1, mc2 = _truthfulqa(models, _Tok(), [item], batch_rows=4)
    assert mc2["original"]["acc"] > 0.9  # the mass sits on 'TT', which is the labelled true answer
    assert mc1["original"]["acc"] == 0.0  # MC1's true answer 'x' is not the argmax
    assert mc2["flips"] == {"right_to_wrong": 0, "wrong_to_right": 0}


def test_lossless_artifact_has_zero_flips(tmp_path):
    save_tiny_model("mixtral", tmp_path / "model")
    write_tiny_suites(tmp_path / "suites")
    recipe = recipe_from_dict({"name": "tiny", "model": {"path": str(tmp_path / "model")},
                               "calibration": {"num_sequences": 2, "sequence_length": 16},
                               "quantize": {"precision": "passthrough"}})
    artifact = Path(prepare(recipe, root=tmp_path)["artifact"])
    report = evaluate_artifact(artifact, data=tmp_path / "suites", memory_budget="90%", max_new_tokens=8,
                               output=tmp_path / "eval.json")
    assert set(report["suites"]) == {"gsm8k", "mmlu", "truthfulqa_mc1", "truthfulqa_mc2"}
    for suite in report["suites"].values():
        assert suite["flips"] == {"right_to_wrong": 0, "wrong_to_right": 0}
        assert suite["delta"] == pytest.approx(0.0, abs=1e-9)
        assert suite["mcnemar_p"] == 1.0
    assert report["suites"]["mmlu"]["mean_kl"] < 1e-8
    assert report["suites"]["mmlu"]["num_fewshot"] == 5
    original = report["suites"]["mmlu"]["original"]
    assert original["acc_by_category"] == {"other": original["acc"]}  # "TEST" is no MMLU subject
    assert (tmp_path / "eval.md").is_file()
    merged = json.loads((artifact / "report.json").read_text())
    assert "eval" in merged
    # the divergence stage, on by default: the lossless artifact through the loader against its source
    divergence = merged["divergence"]
    assert divergence["stats"]["mean_kl"]["value"] < 1e-9 and divergence["stats"]["mean_kl"]["high"] < 1e-9
    assert divergence["stats"]["top_token_agreement"] == {"value": 1.0, "low": 1.0, "high": 1.0}
    assert divergence["stats"]["ppl_ratio"]["value"] == pytest.approx(1.0, abs=1e-6)
    assert divergence["held_out"]["disjoint_from_calibration"] and divergence["points"] == []
    assert verify(artifact) == []  # the manifest was re-hashed after the merge
    with pytest.raises(MoeprepError, match="unknown suite"):
        load_benchmarks(tmp_path / "suites", ("hellaswag",))


def test_reuse_original_scores_the_original_once_and_gives_the_same_report(tmp_path, monkeypatch):
    save_tiny_model("mixtral", tmp_path / "model")
    write_tiny_suites(tmp_path / "suites")
    recipe = recipe_from_dict({"name": "tiny", "model": {"path": str(tmp_path / "model")},
                               "calibration": {"num_sequences": 2, "sequence_length": 16},
                               "quantize": {"precision": "int4", "group_size": 16}})
    artifact = Path(prepare(recipe, root=tmp_path)["artifact"])
    settings = {"data": tmp_path / "suites", "memory_budget": "90%", "max_new_tokens": 8}
    fresh = evaluate_artifact(artifact, **settings)
    first = evaluate_artifact(artifact, reuse_original=tmp_path / "cache", **settings)
    assert len(list((tmp_path / "cache").glob("original-*.json"))) == 3  # gsm8k, mmlu, truthfulqa

    from prep.evals import suites as scoring
    scored = []
    for name in ("score_gsm8k", "score_mmlu", "score_truthfulqa"):  # count who is scored on the second run
        real = getattr(scoring, name)
        monkeypatch.setattr(scoring, name, lambda *a, _real=real, desc="", **k: scored.append(desc) or _real(
            *a, desc=desc, **k))
    second = evaluate_artifact(artifact, reuse_original=tmp_path / "cache", **settings)
    assert scored and all("prepared" in d for d in scored)  # the original came from the cache
    for report in (first, second):
        for name, suite in fresh["suites"].items():
            assert report["suites"][name]["original"] == suite["original"]
            assert report["suites"][name]["prepared"] == suite["prepared"]
            assert report["suites"][name]["flips"] == suite["flips"]


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/benchmarks is absent")
def test_original_layout_is_read():
    data = load_benchmarks(SHARED)
    assert len(data.items["gsm8k"]) == 1319 and len(data.gsm8k_shots) == 5
    assert len(data.items["mmlu"]) == 14042 and all(len(v) == 5 for v in data.mmlu_dev.values())
    assert len(data.mmlu_dev) == 57
    assert {tpl.mmlu_category(s) for s in data.mmlu_dev} == {"stem", "humanities", "social_sciences", "other"}
    assert set(data.mmlu_dev) == set(tpl.MMLU_CATEGORY)  # the category map names every real subject
    assert len(data.items["truthfulqa"]) == 817
    first = data.items["truthfulqa"][0]
    assert first["mc1_targets"]["labels"][0] == 1 and sum(first["mc1_targets"]["labels"]) == 1
    assert data.items["mmlu"][0]["answer"] in range(4)


# ------------------------------------------------------------------ merging into the artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny passthrough artifact, built once; tests work on copies."""
    root = tmp_path_factory.mktemp("eval-artifact")
    save_tiny_model("mixtral", root / "model")
    recipe = recipe_from_dict({"name": "tiny", "model": {"path": str(root / "model")},
                               "calibration": {"num_sequences": 2, "sequence_length": 16},
                               "quantize": {"precision": "passthrough"}})
    return Path(prepare(recipe, root=root, output=root / "artifact")["artifact"])


@pytest.fixture
def artifact(built, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(built, copy)
    return copy


_REPORT = {"suites": {}, "data": "suites", "memory_budget": "90%"}


def _loads(artifact) -> bool:
    try:
        open_artifact(artifact)
        return True
    except MoeError:
        return False


def test_merge_keeps_the_artifact_loadable_or_verified_at_every_step(artifact, monkeypatch):
    """After each of merge's writes, the artifact verifies or (at least) loads; at the end it verifies."""
    import loader.io

    states = []
    for name in ("write_json_atomic", "write_bytes_atomic"):
        real = getattr(loader.io, name)

        def wrapped(path, data, *args, _real=real, **kwargs):
            _real(path, data, *args, **kwargs)
            states.append((Path(path).name, verify(artifact), _loads(artifact)))

        monkeypatch.setattr(loader.io, name, wrapped)
    merge_into_artifact(artifact, _REPORT)
    names = [s[0] for s in states]  # write_json_atomic goes through write_bytes_atomic: one write shows twice
    assert [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]] == [PENDING, "report.json", MANIFEST]
    for _name, bad, loads in states:
        assert loads and (bad == [] or (len(bad) == 1 and bad[0].startswith("report.json:")))
    assert verify(artifact) == [] and not (artifact / PENDING).exists()
    assert json.loads((artifact / "report.json").read_text())["eval"]["memory_budget"] == "90%"


@pytest.mark.parametrize("killed_at", ["report.json", "manifest.json"])
def test_a_kill_inside_merge_leaves_it_loadable_and_the_next_eval_finishes(artifact, monkeypatch, killed_at):
    import loader.io

    # as a SIGKILL right before the rename that writes ``killed_at``
    with interrupted(monkeypatch, loader.io, ("write_json_atomic", "write_bytes_atomic"),
                     when=lambda path, *_: Path(path).name == killed_at):
        merge_into_artifact(artifact, _REPORT)
    assert _loads(artifact)
    bad = verify(artifact)
    assert bad == [] if killed_at == "report.json" else (len(bad) == 1 and bad[0].startswith("report.json:"))
    merge_into_artifact(artifact, _REPORT)  # the report it wrote is recognised as its own
    assert verify(artifact) == [] and not (artifact / PENDING).exists()


def test_merge_never_reblesses_a_report_it_did_not_write(artifact):
    path = artifact / "report.json"
    altered = json.loads(path.read_text()) | {"compression": {"passthrough": 99.0}}
    path.write_text(json.dumps(altered))
    with pytest.raises(ArtifactError, match="altered"):
        merge_into_artifact(artifact, _REPORT)
    assert json.loads(path.read_text()) == altered  # untouched, and still flagged
    assert [line.split(":")[0] for line in verify(artifact)] == ["report.json"]
    (artifact / PENDING).write_text(json.dumps({"sha256": "0" * 64}))  # a stale pending record blesses nothing
    with pytest.raises(ArtifactError, match="altered"):
        merge_into_artifact(artifact, _REPORT)
    result = CliRunner().invoke(moeprep, ["eval", "--artifact", str(artifact), "--data", str(artifact)])
    assert result.exit_code == 1 and result.output.startswith("error: ") and "Traceback" not in result.output


# ------------------------------------------------------------------------- input edges


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_limit_below_one_is_refused(tmp_path, limit):
    with pytest.raises(MoeprepError, match="limit must be a whole number >= 1"):
        evaluate_artifact(tmp_path, limit=int(limit))
    result = CliRunner().invoke(moeprep, ["eval", "--artifact", str(tmp_path), "--limit", limit])
    assert result.exit_code == 1 and "error: limit must be" in result.output and "Traceback" not in result.output


def test_empty_and_malformed_suite_files_name_the_file_and_line(tmp_path):
    write_tiny_suites(tmp_path / "suites")
    suites = tmp_path / "suites"
    (suites / "mmlu.jsonl").write_text("\n")
    with pytest.raises(MoeprepError, match=r"mmlu\.jsonl holds no items"):
        load_benchmarks(suites, ("mmlu",))
    item = {"question": "Q", "subject": "TEST", "choices": ["a", "b", "c", "d"], "answer": 1}
    (suites / "mmlu.jsonl").write_text(json.dumps(item) + "\n" + '{"question": "Q", "subj\n')
    with pytest.raises(MoeprepError, match=r"mmlu\.jsonl:2: not valid JSON"):
        load_benchmarks(suites, ("mmlu",))
    (suites / "mmlu.jsonl").write_text(json.dumps(item) + "\n[1, 2]\n")
    with pytest.raises(MoeprepError, match=r"mmlu\.jsonl:2: expected a JSON object"):
        load_benchmarks(suites, ("mmlu",))
    (suites / "mmlu.jsonl").write_text(json.dumps(item | {"answer": 7}) + "\n")
    with pytest.raises(MoeprepError, match=r"mmlu\.jsonl: item 1 has a missing or malformed answer"):
        load_benchmarks(suites, ("mmlu",))
    (suites / "gsm8k.jsonl").write_bytes(b'{"question": "\xff"}\n')
    with pytest.raises(MoeprepError, match=r"gsm8k\.jsonl is not UTF-8"):
        load_benchmarks(suites, ("gsm8k",))
    assert len(load_benchmarks(suites, ("truthfulqa",)).items["truthfulqa"]) == 4  # the sound file still reads
