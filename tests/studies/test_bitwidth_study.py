"""The bit-width study: every row prepared and compared, the random control at the middle edgemoe row's
bytes, the table's figures (divergence included) taken from the artifacts, a rerun that re-evaluates nothing, the
study merged into an artifact that still verifies and loads, and the rank correlation checked against brute force."""

from __future__ import annotations

import io
import itertools
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from loader.artifact import open_artifact
from loader.verify import verify
from prep.cli import main as moeprep
from prep.evals.power import suite_interval
from prep.studies import bitwidth as bitwidth_study
from prep.studies.bitwidth import merge_study_into, run_study, study_markdown
from tests.helpers.tiny_models import save_tiny_model, write_tiny_suites

pytestmark = pytest.mark.xdist_group("test_bitwidth_study")  # one worker runs the module's study (~30 s), not both

RECIPE = """name: tiny
model: {path: model}
calibration: {num_sequences: 4, sequence_length: 16}
quantize: {group_size: 16}
bitwidth: {num_sequences: 2}
sensitivity: {num_sequences: 2}
divergence: {num_sequences: 4, sequence_length: 16}
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
        assert row["meets_goal"] == (row["compression_bfloat16"] >= 5.0 and all(
            -0.01 <= low and high <= 0.01 for low, high in map(suite_interval, row["suites"].values())))
        assert row["suites"]["truthfulqa_mc2"]["delta_interval"] == evaluation["suites"]["truthfulqa_mc2"]["delta_interval"]
        figures = ("mean_kl", "top_token_agreement", "ppl_ratio")
        assert row["divergence"]["stats"] == {k: report["divergence"]["stats"][k] for k in figures}
        assert row["divergence"]["sequences"] == report["divergence"]["sequences"] == 4
        assert row["divergence"]["memory_budget"] == "1GiB"  # measured at the budget the suites ran at
    assert len(list((root / "out/original").glob("original-*.json"))) == 2  # the original ran once per suite
    table = (root / "out/study.md").read_text()
    assert all(f"| {label} |" in table for label in labels)
    kl = rows["uniform int2"]["divergence"]["stats"]["mean_kl"]
    assert f"| {kl['value']:.3g} [{kl['low']:.3g}, {kl['high']:.3g}] |" in table
    correlations = result["kl_vs_suites"]
    assert set(correlations) == {"mmlu", "truthfulqa_mc1", "truthfulqa_mc2"}
    for suite, c in correlations.items():
        expected = bitwidth_study.spearman([r["divergence"]["stats"]["mean_kl"]["value"] for r in result["rows"]],
                                           [r["suites"][suite]["delta"] for r in result["rows"]])
        assert c == expected and c["n"] == 10
        assert c["method"] is None if c["rho"] is None else c["method"].startswith("monte carlo")  # None: no delta moved
    if any(c["rho"] is not None for c in correlations.values()):
        assert "Spearman's rho between mean KL and each suite's delta across the 10 rows" in table
    assert (root / "out/study.png").read_bytes()[:4] == b"\x89PNG"
    assert result["sensitivity"]["method"] == "sweep" and "seconds" not in result["sensitivity"]  # no timing in an artifact


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
    assert [r["divergence"] for r in report["bitwidth_study"]["rows"]] == [r["divergence"] for r in result["rows"]]
    assert report["bitwidth_study"]["kl_vs_suites"] == result["kl_vs_suites"]
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
    row = {"compression_bfloat16": 5.0, "suites": {"gsm8k": {"delta": 0.45 - 0.46}, "mmlu": {"delta": 0.0}}}
    assert abs(row["suites"]["gsm8k"]["delta"]) > 0.01  # the float is a hair over one point
    assert bitwidth_study.within_one_point(row)
    row["suites"]["gsm8k"]["delta"] = -4 / 300
    assert not bitwidth_study.within_one_point(row)


def test_the_goal_asks_for_every_interval_inside_one_point_not_only_the_delta():
    """A delta of zero from many flips is not resolved; the same delta from few flips on many items is."""
    def row(flips, n, compression=5.0):
        return {"compression_bfloat16": compression, "suites": {"mmlu": {
            "n": n, "delta": (flips[1] - flips[0]) / n, "flips": {"right_to_wrong": flips[0], "wrong_to_right": flips[1]}}}}

    noisy = row((14, 14), 300)
    assert bitwidth_study.within_one_point(noisy) and not bitwidth_study.meets_goal(noisy)
    low, high = bitwidth_study.delta_interval(noisy["suites"]["mmlu"])
    assert low < -0.01 and high > 0.01
    quiet = row((10, 10), 3000)
    assert bitwidth_study.resolved_within_one_point(quiet) and bitwidth_study.meets_goal(quiet)
    assert not bitwidth_study.meets_goal(row((10, 10), 3000, compression=4.99))


def test_best_is_the_fewest_bytes_within_one_point_and_never_the_random_control():
    def row(label, method, nbytes, delta):
        return {"label": label, "bitwidth": {"method": method}, "expert_bytes": nbytes, "compression_bfloat16": 4.0,
                "meets_goal": True, "suites": {"mmlu": {"delta": delta}}}

    rows = [row("uniform int4", "uniform", 100, 0.0), row("edgemoe P=1", "edgemoe", 80, -0.01),
            row("random", "random", 60, 0.0), row("frequency", "frequency", 50, -0.02)]
    best = bitwidth_study.best_row(rows)
    assert best["label"] == "edgemoe P=1" and best["fewer_bytes_than_uniform_int4"]
    assert bitwidth_study.best_row(rows[2:]) is None


def _interval(value):
    return {"value": value, "low": value * 0.8, "high": value * 1.25}


def _fake_row(label, bits, kl, delta, measured=True):
    """A finished row as ``_row_result`` writes it, small enough to tabulate and plot without preparing anything."""
    divergence = ({"stats": {"mean_kl": _interval(kl), "top_token_agreement": _interval(0.9),
                             "ppl_ratio": _interval(1.01)}, "tokens": 60, "sequences": 4, "level": 0.95,
                   "memory_budget": "50%"} if measured else None)
    suite = {"n": 100, "original": 0.5, "prepared": 0.5 + delta, "delta": delta,
             "flips": {"right_to_wrong": 1, "wrong_to_right": 0}, "mcnemar_p": 1.0}
    return {"label": label, "experts": {"int3": 32}, "expert_bytes": int(bits * 1e5), "bits_per_weight": bits,
            "compression_bfloat16": 16 / bits, "bitwidth": {"method": "uniform"}, "divergence": divergence,
            "suites": {"mmlu": suite}, "meets_goal": False}


def _fake_study(rows):
    study = {"recipe": "r.yaml", "settings": {"limit": None}, "rows": rows}
    return study | {"kl_vs_suites": bitwidth_study.kl_vs_suites(rows)}


def test_a_row_without_a_divergence_says_so_and_the_rest_still_tabulate_and_plot():
    assert bitwidth_study.row_divergence({"sizes": {}}) is None  # the recipe switched the stage off
    rows = [_fake_row("a", 4.25, 0.001, 0.0), _fake_row("b", 3.25, 0.004, -0.01),
            _fake_row("c", 3.0, 0.0, -0.02, measured=False), _fake_row("d", 3.03, 0.01, -0.03)]
    study = _fake_study(rows)
    assert study["kl_vs_suites"]["mmlu"]["n"] == 3  # the unmeasured row is left out, not an error
    assert study["kl_vs_suites"]["mmlu"]["rho"] == -1.0 and study["kl_vs_suites"]["mmlu"]["method"] == "exact"
    table = bitwidth_study.study_markdown(study)
    header = next(line for line in table.splitlines() if line.startswith("| row |"))
    assert "| bits/w | mean KL [95%] | same top token |" in header and "mmlu delta [95%] (flips, p)" in header
    assert "| b | int3 32 | 0.31 | 4.92 | 3.25 | 0.004 [0.0032, 0.005] | 90.00% | - |" in table
    assert "| c | int3 32 | 0.29 | 5.33 | 3.00 | - | - | - |" in table
    assert "mmlu rho -1.00 (p 0.33); two-sided, an exact permutation test over all 6 orderings" in table
    for plotted in (study, _fake_study([_fake_row("c", 3.0, 0.0, 0.0, measured=False)])):
        png = bitwidth_study.study_plot(plotted)
        image = plt_imread(png)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[1] > 1.5 * image.shape[0]  # two panels side by side


def plt_imread(png: bytes):
    import matplotlib.pyplot as plt

    return plt.imread(io.BytesIO(png), format="png")


def _average_ranks(values):
    """Ranks from 1, a tie at the mean of the positions it covers: counted, not sorted."""
    return [sum(w < v for w in values) + (sum(w == v for w in values) + 1) / 2 for v in values]


def _brute_force_spearman(x, y):
    """The textbook definition, written out: Pearson's r of average ranks, and the two-sided p as the share of all n!
    orderings of y whose |rho| reaches the observed one."""
    def pearson(a, b):
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        cov = sum((u - ma) * (v - mb) for u, v in zip(a, b, strict=True))
        return cov / math.sqrt(sum((u - ma) ** 2 for u in a) * sum((v - mb) ** 2 for v in b))

    rx, ry = _average_ranks(x), _average_ranks(y)
    rho = pearson(rx, ry)
    orderings = list(itertools.permutations(ry))
    hits = sum(abs(pearson(rx, list(o))) >= abs(rho) - 1e-12 for o in orderings)
    return rho, hits / len(orderings)


@pytest.mark.parametrize("x, y", [
    ([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]),
    ([0.3, 0.1, 0.2, 0.9, 0.5, 0.4], [5, 6, 4, 1, 2, 3]),
    ([1, 1, 2, 3, 3, 4], [2, 1, 1, 5, 4, 4]),  # ties on both sides
    ([0.01, 0.02, 0.02, 0.04], [0.0, -0.01, -0.01, -0.03]),
    ([3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1]),
])
def test_spearman_matches_brute_force_enumeration(x, y):
    rho, p = _brute_force_spearman(x, y)
    got = bitwidth_study.spearman(x, y)
    assert got["rho"] == pytest.approx(rho, abs=1e-6) and got["p"] == pytest.approx(p, abs=1e-12)
    assert got["n"] == len(x) and got["method"] == "exact"


def test_spearman_known_cases():
    for n in (3, 5, 8):
        up = bitwidth_study.spearman(list(range(n)), [v ** 3 for v in range(n)])  # monotone, not linear
        assert up["rho"] == 1.0 and up["p"] == pytest.approx(2 / math.factorial(n))  # identity and its reverse
        down = bitwidth_study.spearman(list(range(n)), [-v for v in range(n)])
        assert down["rho"] == -1.0 and down["p"] == up["p"]
    assert bitwidth_study.spearman([1, 2, 3, 4], [1, 3, 2, 4])["rho"] == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    assert bitwidth_study.spearman([1, 2, 2, 3], [1, 2, 3, 4])["rho"] == pytest.approx(math.sqrt(0.9))  # tie averaged
    for constant in (([1, 1, 1], [1, 2, 3]), ([1, 2, 3], [5, 5, 5]), ([1], [2]), ([], [])):
        assert bitwidth_study.spearman(*constant)["rho"] is None and bitwidth_study.spearman(*constant)["p"] is None
    with pytest.raises(ValueError, match="one length"):
        bitwidth_study.spearman([1, 2], [1, 2, 3])


def test_spearman_above_eight_rows_samples_seeded_permutations_close_to_the_exact_p():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=7), rng.normal(size=7)
    exact = bitwidth_study.spearman(x, y)
    sampled = bitwidth_study.spearman(x, y, exact_up_to=6)
    assert sampled["rho"] == exact["rho"] and sampled["method"] == "monte carlo, 20000 permutations, seed 0"
    assert abs(sampled["p"] - exact["p"]) < 0.015  # 4 standard errors of a proportion over 20,000 draws
    assert bitwidth_study.spearman(x, y, exact_up_to=6) == sampled  # seeded: the same p on every run
    many = bitwidth_study.spearman(list(range(12)), list(range(12)))  # 12! orderings: sampled, never p = 0
    assert many["method"].startswith("monte carlo") and many["p"] == pytest.approx(1 / 20_001)
