"""The shipped artifact's accuracy resolved to one point: the paired delta's 95% interval against a hand computation
and against its coverage on simulated paired data, the suites sized from the check's flips, the held-out suites made
once and reused, and `moeprep accuracy` end to end on a small stand-in for the reference artifact."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from loader.verify import verify
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.evals.compare import mcnemar_p, summary_markdown
from prep.evals.power import detectable_difference, items_to_resolve, paired_interval, paired_verdict
from prep.evals.resolved import extended_suites, items_needed, resolve_accuracy, suite_sizes
from prep.report import merge_section
from prep.stages.evaluate import accuracy_markdown
from prep.stages.table import REPORT
from tests.helpers.tiny_models import prepare_tiny_artifact, write_tiny_suites

REFERENCE = Path(__file__).resolve().parents[3] / "recipes" / "reference"


def _row(n: int, right_to_wrong: int, wrong_to_right: int) -> dict:
    return {"n": n, "num_fewshot": 0, "original": {"acc": 0.5}, "prepared": {"acc": 0.5},
            "delta": (wrong_to_right - right_to_wrong) / n,
            "flips": {"right_to_wrong": right_to_wrong, "wrong_to_right": wrong_to_right},
            "mcnemar_p": mcnemar_p(right_to_wrong, wrong_to_right)}


# the shipped reference artifact's check (report.json eval): GSM8K 300 items, MMLU 400, TruthfulQA 200
SHIPPED_CHECK = {"gsm8k": _row(300, 16, 12), "mmlu": _row(400, 10, 5), "truthfulqa_mc1": _row(200, 0, 1),
                 "truthfulqa_mc2": _row(200, 2, 1)}


# ------------------------------------------------------------------------------------------- the interval


def test_the_interval_is_the_agresti_min_one_computed_by_hand():
    # b = 10, c = 5 of n = 400; half an item added to each cell: b 10.5, c 5.5, n 402
    # d = (5.5 - 10.5) / 402 = -0.0124378; var = (16 - 25 / 402) / 402^2 = 9.86222e-5, sd 0.00993087
    # d -+ 1.959964 * sd = -0.0319019, +0.0070264
    low, high = paired_interval(10, 5, 400)
    assert low == pytest.approx(-0.0319019, abs=1e-6) and high == pytest.approx(0.0070264, abs=1e-6)
    assert paired_interval(5, 10, 400) == pytest.approx((-high, -low))  # the sign of the flips only mirrors it
    zero_low, zero_high = paired_interval(0, 0, 200)  # no flips: still an interval, of half an item each way
    assert zero_low < 0 < zero_high and zero_high == pytest.approx(1.959964 * math.sqrt(1) / 202, rel=1e-5)
    assert paired_interval(0, 3, 3) == (pytest.approx(3 / 5 - 1.959964 * math.sqrt(4 - 9 / 5) / 5), 1.0)  # clipped
    with pytest.raises(ValueError):
        paired_interval(3, 3, 5)


@pytest.mark.parametrize(("n", "right_to_wrong", "wrong_to_right"),
                         [(400, 0.025, 0.0125), (300, 0.05, 0.04), (100, 0.1, 0.02), (50, 0.2, 0.1)])
def test_the_interval_covers_the_true_difference_95_times_in_100(n, right_to_wrong, wrong_to_right):
    """Seeded paired data: each item flips right->wrong or wrong->right with the given probabilities; the share of
    intervals holding the true difference (wrong_to_right - right_to_wrong) is near 0.95 (4000 draws: sd 0.0034)."""
    draws = np.random.default_rng(7).multinomial(n, [right_to_wrong, wrong_to_right,
                                                     1 - right_to_wrong - wrong_to_right], size=4000)
    true = wrong_to_right - right_to_wrong
    covered = np.mean([low <= true <= high for low, high in (paired_interval(int(b), int(c), n) for b, c, _ in draws)])
    assert 0.935 <= covered <= 0.97, covered


def test_with_few_flips_it_errs_wide_not_narrow():
    """About one flip in 200 items (the shipped TruthfulQA MC1): a plain Wald interval would often be [0, 0]."""
    draws = np.random.default_rng(3).multinomial(200, [0.0025, 0.0025, 0.995], size=2000)
    covered = np.mean([low <= 0 <= high for low, high in (paired_interval(int(b), int(c), 200) for b, c, _ in draws)])
    assert covered >= 0.95


def test_the_verdict_states_the_interval_and_whether_it_lies_within_a_point():
    v = paired_verdict(-0.0125, {"right_to_wrong": 10, "wrong_to_right": 5}, 400, mcnemar_p(10, 5), None)
    assert v["interval_points"] == pytest.approx([-3.19019, 0.70264], abs=1e-4)
    assert v["resolved_to_one_point"] is False  # -1.25 points, and the interval reaches -3.19
    tight = paired_verdict(-0.001, {"right_to_wrong": 30, "wrong_to_right": 20}, 10_000, mcnemar_p(30, 20), None)
    assert -1 < tight["interval_points"][0] < tight["interval_points"][1] < 1 and tight["resolved_to_one_point"]


def test_the_tables_of_paired_deltas_print_the_interval():
    mmlu = {"mmlu": SHIPPED_CHECK["mmlu"]}
    assert "| delta | 95% interval (points) |" in summary_markdown({"suites": mmlu})
    assert "| -0.0125 | [-3.19, +0.70] | 10 | 5 |" in summary_markdown({"suites": mmlu})
    check = accuracy_markdown({"eval": {"suites": mmlu, "memory_budget": None}})
    assert "| delta (points) | 95% interval (points) |" in check and "| mmlu | 400 | 0.25 | -1.25 | [-3.19, +0.70] |" in check


def test_what_n_items_resolve_is_the_inverse_of_the_items_a_difference_needs():
    d = detectable_difference(28 / 300, 200)
    assert items_to_resolve(28 / 300, d) <= 200 < items_to_resolve(28 / 300, d * 0.99)
    assert detectable_difference(15 / 400, items_to_resolve(15 / 400)) == pytest.approx(0.01, rel=1e-3)
    assert detectable_difference(0.0, 500) is None and detectable_difference(0.1, 2) is None


# ---------------------------------------------------------------------------------------------- sizing


def test_each_suite_is_sized_from_the_flips_the_check_measured():
    needed = items_needed(SHIPPED_CHECK)
    assert needed == {"gsm8k": items_to_resolve(28 / 300), "mmlu": items_to_resolve(15 / 400),
                      "truthfulqa": items_to_resolve(1 / 200)}
    assert needed["mmlu"] == 2941  # 15 flips of 400
    sizes = suite_sizes(SHIPPED_CHECK, gsm8k_cap=200)
    assert sizes == {"gsm8k": 200, "mmlu": 2941, "truthfulqa": needed["truthfulqa"]}  # GSM8K at its cap
    assert suite_sizes(SHIPPED_CHECK, 200, {"mmlu": 5, "truthfulqa": None}) == sizes | {"mmlu": 5}
    no_flips = SHIPPED_CHECK | {"mmlu": _row(400, 0, 0)}
    assert suite_sizes(no_flips, 200)["mmlu"] == 400  # nothing to size from: as many as the check scored
    assert "gsm8k" not in suite_sizes({"mmlu": SHIPPED_CHECK["mmlu"]}, 200)


def test_the_held_out_suites_are_made_once_and_reused_while_they_hold_enough(tmp_path):
    out = tmp_path / "suites"
    have, made = extended_suites(REFERENCE, out, {"gsm8k": 2, "mmlu": 402, "truthfulqa": 201})
    assert made and have["mmlu"] == 402 and have["truthfulqa"] == 201 and have["gsm8k"] == 300  # shipped first
    shipped = (REFERENCE / "suites" / "mmlu.jsonl").read_text().splitlines()
    assert (out / "mmlu.jsonl").read_text().splitlines()[:400] == shipped
    assert extended_suites(REFERENCE, out, {"mmlu": 401, "truthfulqa": 200}) == (have, False)
    more, made = extended_suites(REFERENCE, out, {"mmlu": 403})
    assert made and more["mmlu"] == 403


# ------------------------------------------------------------------------------------------ the command


@pytest.fixture
def stand_in(tmp_path):
    """A small artifact prepared from a tiny model laid out as the reference is (training.json and the shipped
    suites beside it), its report.json holding the shipped artifact's check: the reference artifact's shape in
    seconds."""
    _, artifact = prepare_tiny_artifact(tmp_path / "ref")
    shutil.copy(REFERENCE / "training.json", tmp_path / "ref" / "training.json")
    shutil.copytree(REFERENCE / "suites", tmp_path / "ref" / "suites")
    return artifact


def _check(artifact: Path) -> None:
    merge_section(artifact, {"eval": {"suites": SHIPPED_CHECK, "data": "suites", "memory_budget": "90%"}}, REPORT)


def test_accuracy_resolves_the_artifact_and_merges_beside_the_check(stand_in, tmp_path):
    _check(stand_in)
    before = json.loads((stand_in / "report.json").read_text())
    work = tmp_path / "work"
    result = CliRunner().invoke(moeprep, ["accuracy", "--artifact", str(stand_in), "--work", str(work),
                                          "--mmlu", "5", "--truthfulqa", "4", "--gsm8k", "1",
                                          "--model", str(stand_in.parent / "model")])
    assert result.exit_code == 0, result.output
    assert "## Accuracy resolved to one point" in result.output and "95% interval (points)" in result.output
    figures = json.loads((work / "accuracy.json").read_text())
    assert {k: s["n"] for k, s in figures["suites"].items()} == {"gsm8k": 1, "mmlu": 5, "truthfulqa_mc1": 4,
                                                                 "truthfulqa_mc2": 4}
    mmlu = figures["suites"]["mmlu"]
    low, high = paired_interval(mmlu["flips"]["right_to_wrong"], mmlu["flips"]["wrong_to_right"], 5)
    assert mmlu["interval_points"] == pytest.approx([100 * low, 100 * high])
    assert mmlu["resolved_to_one_point"] is False and mmlu["resolution_points"] == 20  # 5 items resolve nothing
    assert mmlu["sized_for_one_point"] == 2941 and figures["overridden"] == ["mmlu", "truthfulqa"]
    assert (work / "accuracy.md").read_text().startswith("## Accuracy resolved to one point")
    report = json.loads((stand_in / "report.json").read_text())
    assert report["resolved_accuracy"] == figures and report["eval"] == before["eval"]  # the check keeps its own
    markdown = (stand_in / "report.md").read_text()
    assert markdown.index("## Accuracy check") < markdown.index("## Accuracy resolved to one point")
    assert verify(stand_in) == []  # report.json and report.md re-listed in the manifest
    # a second run scores the original from its kept rows and the suites from the work directory
    kept = sorted((work / "original").iterdir())
    again = CliRunner().invoke(moeprep, ["accuracy", "--artifact", str(stand_in), "--work", str(work),
                                         "--mmlu", "5", "--truthfulqa", "4", "--gsm8k", "1",
                                          "--model", str(stand_in.parent / "model")])
    assert again.exit_code == 0 and "reusing" in again.output and sorted((work / "original").iterdir()) == kept


def test_an_artifact_without_a_check_is_told_to_run_one_first(stand_in, tmp_path):
    with pytest.raises(MoeprepError, match=r"make prepare.*moeprep eval"):
        resolve_accuracy(stand_in, tmp_path / "work", say=lambda _: None)
    result = CliRunner().invoke(moeprep, ["accuracy", "--artifact", str(stand_in), "--work", str(tmp_path / "w")])
    assert result.exit_code == 1 and "run `make prepare`" in result.output and "Traceback" not in result.output


def test_an_artifact_not_from_the_reference_needs_data(tmp_path):
    _, artifact = prepare_tiny_artifact(tmp_path)
    _check(artifact)
    with pytest.raises(MoeprepError, match="pass --data"):
        resolve_accuracy(artifact, tmp_path / "work", original=tmp_path / "model", say=lambda _: None)
    write_tiny_suites(tmp_path / "mine")
    figures = resolve_accuracy(artifact, tmp_path / "work", tmp_path / "mine", tmp_path / "model", gsm8k=1,
                               say=lambda _: None)
    assert {k: s["n"] for k, s in figures["suites"].items()} == {"gsm8k": 1, "mmlu": 6, "truthfulqa_mc1": 4,
                                                                 "truthfulqa_mc2": 4}  # all the suites hold
