"""The bit-width study: every row prepared and compared, the random control at the middle edgemoe row's
bytes, the table's figures taken from the artifacts, a rerun that re-evaluates nothing, and the study
merged into an artifact that still verifies and loads."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from loader.artifact import open_artifact
from loader.verify import verify
from prep.cli import main as moeprep
from prep.studies import bitwidth as bitwidth_study
from prep.studies.bitwidth import merge_study_into, run_study, study_markdown
from tests.tiny_models import save_tiny_model, write_tiny_suites

RECIPE = """name: tiny
model: {path: model}
calibration: {num_sequences: 4, sequence_length: 16}
quantize: {group_size: 16}
bitwidth: {num_sequences: 2}
sensitivity: {num_sequences: 2}
"""


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    save_tiny_model("mixtral", root / "model")
    write_tiny_suites(root / "suites")
    (root / "tiny.yaml").write_text(RECIPE)
    kwargs = {"root": root, "tolerances": (0.002, 0.02, 0.2), "shares": (0.25, 0.5),
              "suites": ("mmlu", "truthfulqa"), "data": root / "suites", "memory_budget": "1GiB",
              "echo": lambda m: None}
    result = run_study(root / "tiny.yaml", root / "out", **kwargs)
    return root, kwargs, result


def test_every_row_is_prepared_and_compared(study):
    root, _, result = study
    labels = [r["label"] for r in result["rows"]]
    assert labels == ["uniform int8", "uniform int4", "uniform int3", "uniform int2", "edgemoe P=0.002",
                      "edgemoe P=0.02", "random (bytes of edgemoe P=0.02)", "edgemoe P=0.2",
                      "frequency q=25%", "frequency q=50%"]
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["random (bytes of edgemoe P=0.02)"]["experts"] == rows["edgemoe P=0.02"]["experts"]
    assert rows["random (bytes of edgemoe P=0.02)"]["expert_bytes"] == rows["edgemoe P=0.02"]["expert_bytes"]
    assert rows["frequency q=50%"]["experts"] == {"int4": 4, "int2": 4}  # 2 layers x 4 experts, half low
    bytes_by_precision = [rows[f"uniform {p}"]["expert_bytes"] for p in ("int8", "int4", "int3", "int2")]
    assert bytes_by_precision == sorted(bytes_by_precision, reverse=True)
    for row in result["rows"]:
        slug = bitwidth_study.Row(row["label"], ()).slug
        report = json.loads((root / "out/rows" / slug / "artifact/report.json").read_text())
        evaluation = json.loads((root / "out/rows" / slug / "eval.json").read_text())
        assert row["expert_bytes"] == report["sizes"]["expert_bytes"]
        assert row["compression_bfloat16"] == report["compression"]["bfloat16"]
        assert set(row["suites"]) == {"mmlu", "truthfulqa_mc1", "truthfulqa_mc2"}
        for name, suite in row["suites"].items():
            assert suite["delta"] == evaluation["suites"][name]["delta"]
            assert suite["flips"] == evaluation["suites"][name]["flips"]
        assert row["meets_goal"] == (row["compression_bfloat16"] >= 3.5
                                     and all(abs(s["delta"]) <= 0.01 + 1e-9 for s in row["suites"].values()))
    assert len(list((root / "out/original").glob("original-*.json"))) == 2  # the original ran once per suite
    table = (root / "out/study.md").read_text()
    assert all(f"| {label} |" in table for label in labels)
    assert (root / "out/study.png").read_bytes()[:4] == b"\x89PNG"
    assert result["sensitivity"]["method"] == "sweep" and result["sensitivity"]["seconds"]["sweep"] > 0


def test_a_rerun_evaluates_nothing_again(study, monkeypatch):
    root, kwargs, result = study

    def refuse(*args, **kw):
        raise AssertionError("a finished row was evaluated again")

    monkeypatch.setattr("prep.studies.bitwidth.evaluate_artifact", refuse)
    again = run_study(root / "tiny.yaml", root / "out", **kwargs)
    assert again["rows"] == result["rows"]


def test_the_study_merges_into_an_artifact_that_still_verifies_and_loads(study):
    root, _, result = study
    artifact = root / "out/rows/edgemoe-p-0-02/artifact"
    merge_study_into(artifact, result)
    assert verify(artifact) == []
    open_artifact(artifact)
    report = json.loads((artifact / "report.json").read_text())
    assert [r["label"] for r in report["bitwidth_study"]["rows"]] == [r["label"] for r in result["rows"]]
    assert "eval" in report  # what eval merged before is kept
    text = (artifact / "report.md").read_text()
    assert study_markdown(result) in text and "reports/report.png" in text
    assert (artifact / "reports" / "report.png").read_bytes()[:4] == b"\x89PNG"
    (artifact / "report.md").write_text("edited")
    assert [line.split(":")[0] for line in verify(artifact)] == ["report.md"]


def test_bad_tolerances_are_one_clean_error():
    result = CliRunner().invoke(moeprep, ["bitwidth-study", "--tolerances", "0.01,abc"])
    assert result.exit_code != 0 and "--tolerances must be comma-separated numbers" in result.output
    assert "Traceback" not in result.output


def test_one_point_is_three_items_of_three_hundred():
    row = {"compression_bfloat16": 4.0, "suites": {"gsm8k": {"delta": 0.45 - 0.46}, "mmlu": {"delta": 0.0}}}
    assert abs(row["suites"]["gsm8k"]["delta"]) > 0.01  # the float is a hair over one point
    assert bitwidth_study.meets_goal(row)
    row["suites"]["gsm8k"]["delta"] = -4 / 300
    assert not bitwidth_study.meets_goal(row)
    row["suites"]["gsm8k"]["delta"], row["compression_bfloat16"] = 0.0, 3.4
    assert not bitwidth_study.meets_goal(row) and bitwidth_study.within_one_point(row)


def test_best_is_the_fewest_bytes_within_one_point_and_never_the_random_control():
    def row(label, method, nbytes, delta):
        return {"label": label, "bitwidth": {"method": method}, "expert_bytes": nbytes, "compression_bfloat16": 4.0,
                "meets_goal": True, "suites": {"mmlu": {"delta": delta}}}

    rows = [row("uniform int4", "uniform", 100, 0.0), row("edgemoe P=1", "edgemoe", 80, -0.01),
            row("random", "random", 60, 0.0), row("frequency", "frequency", 50, -0.02)]
    best = bitwidth_study.best_row(rows)
    assert best["label"] == "edgemoe P=1" and best["fewer_bytes_than_uniform_int4"]
    assert bitwidth_study.best_row(rows[2:]) is None
