"""report.md from the stage results' declarations: the same text as the central renderer wrote, report.json's
entries folded from the results in the table's order, and `moeprep eval` on an existing artifact renders both
files again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from loader.verify import verify
from prep.cli import main as moeprep
from prep.report import ReportLayout, ReportSection, report_files
from prep.stages import report_entries
from prep.stages.allocate_cache import CacheAllocation
from prep.stages.predict import PredictionStats
from prep.stages.table import REPORT, STAGES
from prep.stages.tune_policy import TunedPolicy
from tests.helpers.tiny_models import prepare_tiny_artifact, tiny_recipe, write_tiny_suites

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize(("fixture", "name"), [("report-every-section", "tiny"), ("report-no-section", "routing")])
def test_report_md_is_the_text_the_central_renderer_wrote(fixture, name):
    """The expected files were rendered by ``prep/report/sections.py`` before the sections moved to the stages."""
    report = json.loads((DATA / f"{fixture}.json").read_text())
    assert REPORT.markdown(name, report) == (DATA / f"{fixture}.md").read_text()


def test_the_every_section_fixture_shows_every_declared_section():
    """So the comparison above covers each renderer, not only the header."""
    report = json.loads((DATA / "report-every-section.json").read_text())
    assert [s.key for s in REPORT.sections if s.render(report)] == [s.key for s in REPORT.sections]
    assert all(s.render({}) == [] for s in REPORT.sections)  # a section without data is left out


def test_the_layout_is_gathered_from_the_stage_results_by_place():
    declared = [s for stage in STAGES for s in stage.result.REPORT_SECTIONS]
    assert sorted(REPORT.sections, key=lambda s: s.key) == sorted(declared, key=lambda s: s.key)
    assert [s.place for s in REPORT.sections] == sorted(s.place for s in declared)

    class First:
        REPORT_SECTIONS = (ReportSection("a", 2, lambda r: ["a"]), ReportSection("b", 1, lambda r: ["b"]))

    class Second:
        REPORT_SECTIONS = (ReportSection("c", 1, lambda r: ["c"]),)

    assert [s.key for s in ReportLayout.of([First, Second]).sections] == ["b", "c", "a"]  # ties: the given order
    with pytest.raises(TypeError, match="their own"):
        ReportLayout.of([First, First])


def _allocation(points):
    return CacheAllocation(cost="measured", unit="seconds", cells=[{"pool": "main"}], curves=[], points=points,
                           inputs={"alpha": 1}, tolerance=2.0, sizes={})


def _point(budget, cost):
    return {"budget_bytes": budget, "share": 0.5, "slots": [1], "pools": [],
            "allocated": {"cost": cost, "miss_rate": 0.5, "modeled_tokens_per_s": 10.0},
            "uniform": {"cost": 9.0}, "closed_form": {"cost": 8.0}}


def test_report_entries_fold_the_results_in_table_order_and_mark_switched_off_stages():
    allocation = _allocation([_point(100, 4.0), _point(200, 3.0)])
    tuned = TunedPolicy(eviction={"name": "lru", "params": {}}, group=None, depth=None, chosen="lru", unit="seconds",
                        budget_bytes=100, share=0.5, objective={"lru": 1.0}, trials=[[0, {}, 1.0], [1, {}, 2.0]],
                        points=[{"budget_bytes": 100, "tuned": {"cost": 2.5, "miss_rate": 0.25}}])
    entries = report_entries([(PredictionStats, None), (CacheAllocation, allocation), (TunedPolicy, tuned)])
    assert entries["prediction"] is None
    assert list(entries["planning"]) == ["tune_policy", "allocate_cache", "tolerance"]
    assert entries["planning"]["tune_policy"]["trials"] == 2 and entries["planning"]["tolerance"] == 2.0
    first, second = entries["operating_points"]
    assert (first["cost"], first["miss_rate"], first["modeled_tokens_per_s"]) == (2.5, 0.25, None)  # the tuned score
    assert first["allocated_default_policy"] == _point(100, 4.0)["allocated"]
    assert (second["cost"], second["modeled_tokens_per_s"]) == (3.0, 10.0)  # not rescored: the allocation's
    assert list(first) == ["budget_bytes", "share", "slots", "modeled_tokens_per_s", "modeled_prefill", "cost",
                           "miss_rate", "demand_bytes_per_token", "allocated_default_policy", "uniform", "closed_form",
                           "accuracy_delta"]
    off = report_entries([(CacheAllocation, None), (TunedPolicy, None)])
    assert off == {"planning": None, "operating_points": []}
    alone = report_entries([(CacheAllocation, None), (TunedPolicy, tuned)])
    assert list(alone["planning"]) == ["tune_policy"] and alone["operating_points"] == []


def test_report_files_render_both_from_one_report():
    report = json.loads((DATA / "report-no-section.json").read_text())
    files = report_files("routing", report, REPORT)
    assert json.loads(files["report.json"]) == report
    assert files["report.md"].decode() == (DATA / "report-no-section.md").read_text()
    assert set(report_files("routing", report, None)) == {"report.json"}


def test_moeprep_eval_on_an_existing_artifact_renders_report_md_again(tmp_path):
    recipe = tiny_recipe("passthrough")
    _, artifact = prepare_tiny_artifact(tmp_path, recipe=recipe)
    write_tiny_suites(tmp_path / "suites")
    before = (artifact / "report.md").read_text()
    assert before == REPORT.markdown("tiny", json.loads((artifact / "report.json").read_text()))
    assert "## Accuracy check" not in before

    result = CliRunner().invoke(moeprep, ["eval", "--artifact", str(artifact), "--model", str(tmp_path / "model"),
                                          "--data", str(tmp_path / "suites"),
                                          "--suites", "mmlu", "--limit", "2", "--memory-budget", "90%",
                                          "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((artifact / "report.json").read_text())
    after = (artifact / "report.md").read_text()
    assert set(report["eval"]["suites"]) == {"mmlu"}
    assert after == REPORT.markdown("tiny", report) != before
    assert "## Accuracy check" in after and "| mmlu | 2 |" in after
    assert after.index("## Divergence from the source") < after.index("## Accuracy check")  # eval measured both
    assert report["divergence"]["sequences"] == 64 and "## Divergence from the source" in result.output
    assert verify(artifact) == []  # both files re-listed in the manifest

