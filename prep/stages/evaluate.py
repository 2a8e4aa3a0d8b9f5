"""Stage ``evaluate``: the accuracy check of the fresh artifact against its source model (optional).

Reads the package stage (its key covers everything the artifact derives from) and the artifact
itself; runs ``moeprep eval`` with the recipe's ``evaluate`` settings when ``enabled``. The full report
lands in the stage directory (``eval.json``) and its summary in the artifact's ``report.json`` (under
``eval``). A cached result is reused only while the artifact's ``report.json`` still holds that summary.

When the artifact has operating points (the ``allocate_cache`` stage), each gets its ``accuracy_delta``
per suite. A cache decides only which reads happen, not what is computed, so with the plan's routing
independent of the cache every point has the measured delta; with cache-conditional routing the outputs
depend on what is resident, and each point is evaluated at its own budget (``eval-<bytes>.json``).
report.md is written again with the check and the points; the accuracy check is its first section.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from loader.format import read_manifest
from loader.plan import read_plan
from prep.errors import MoeprepError
from prep.evals.compare import eval_summary, evaluate_artifact, interval_text
from prep.evals.data import SUITES
from prep.evals.power import paired_verdict
from prep.evals.resolved import resolved_markdown
from prep.report import ReportLayout, ReportSection, current_report, merge_section
from prep.stages import Stage, StageResult
from prep.stages.operating_points import PLAN_PLOT, operating_points_plot

VERSION = 5  # 4: per-suite limits; each operating point's delta as a paired test per suite; 5: with its 95% interval


@dataclass(frozen=True)
class SuiteLimits:
    """Items per suite (the first N; null: every item): a stated smaller n where the full suite costs too long."""

    gsm8k: int | None = None
    mmlu: int | None = None
    truthfulqa: int | None = None

    def __post_init__(self) -> None:
        for name, n in dataclasses.asdict(self).items():
            if n is not None and n < 1:
                raise MoeprepError(f"evaluate.limit.{name} must be at least 1 item (or null for the whole suite), "
                                   f"got {n}")


@dataclass(frozen=True)
class EvaluateSection:
    """The accuracy check as the last stage of prepare (``moeprep eval`` with these settings). ``limit``: the first
    N items of every suite, or per suite (``{gsm8k: 100, mmlu: 400, truthfulqa: 200}``), or null for all."""

    enabled: bool = False
    suites: tuple[str, ...] = SUITES
    data: str | None = None  # default: suites/ beside the model
    limit: int | SuiteLimits | None = 20
    num_fewshot: int | None = None
    gsm8k_format: str = "cot"
    memory_budget: str | None = "50%"

    def __post_init__(self) -> None:
        if self.gsm8k_format not in ("cot", "plain"):
            raise MoeprepError("evaluate.gsm8k_format must be cot or plain")
        if unknown := sorted(set(self.suites) - set(SUITES)):
            raise MoeprepError(f"evaluate.suites: unknown suite(s) {unknown}; use {', '.join(SUITES)}")
        if not self.suites or len(set(self.suites)) != len(self.suites):
            raise MoeprepError(f"evaluate.suites must name each suite once and at least one ({', '.join(SUITES)}); "
                               f"got {list(self.suites)} (switch the check off with evaluate.enabled: false)")
        if isinstance(self.limit, int) and not 1 <= self.limit <= 10_000_000:
            raise MoeprepError(f"evaluate.limit must be from 1 to 10,000,000 items (or null for every item), "
                               f"got {self.limit}")
        if self.num_fewshot is not None and not 0 <= self.num_fewshot <= 64:
            raise MoeprepError(f"evaluate.num_fewshot must be from 0 to 64 (or null for each suite's own), "
                               f"got {self.num_fewshot}")

    def limits(self) -> int | dict | None:
        """What ``evaluate_artifact`` takes: one N for every suite, or N per suite."""
        return dataclasses.asdict(self.limit) if isinstance(self.limit, SuiteLimits) else self.limit


@dataclass(frozen=True)
class AccuracyCheck(StageResult):
    """The ``eval`` entry of the artifact's report.json: per-suite headline figures, data, budget. Its sections of
    report.md: the check, then ``resolved_accuracy`` (``moeprep accuracy``'s deltas on more items, when run)."""

    suites: dict
    data: str | None
    memory_budget: str | None
    points: list  # per operating point: {"budget_bytes", "accuracy_delta": {suite: delta}, "measured_at"}

    def report_entry(self) -> dict:
        return {"suites": self.suites, "data": self.data, "memory_budget": self.memory_budget}

    REPORT_SECTIONS = (ReportSection("eval", 10, lambda report: [accuracy_markdown(report), ""]
                                     if (report.get("eval") or {}).get("suites") else []),
                       # written by `moeprep accuracy` on the shipped artifact, never by this stage
                       ReportSection("resolved_accuracy", 11, lambda report: [resolved_markdown(report), ""]
                                     if (report.get("resolved_accuracy") or {}).get("suites") else []))


def accuracy_markdown(report: dict) -> str:
    """The accuracy check (report.json ``eval``) as a paired test per suite: the delta and its 95% interval,
    McNemar's p on the flips,
    the tolerance (the plan's, points per suite) and what the suite can resolve (``prep.evals.power``)."""
    check = report["eval"]
    tolerance = (report.get("planning") or {}).get("tolerance")
    lines = ["## Accuracy check", "",
             f"The prepared model through the loader (budget {check.get('memory_budget') or 'the plan default'}) "
             "against its original, item by item on the same prompts. A suite of n items moves 100/n points per "
             "item; McNemar's exact test on the flips says whether a delta is more than noise, and the interval bounds "
             "it (95%, Agresti-Min, from the flips; truthfulqa_mc2's from the mean per-item difference); the last column is "
             "how many items would resolve a one-point difference (alpha 0.05, power 0.8) at the flip rate measured "
             "here. " + (f"Tolerance: |delta| <= {tolerance:g} points per suite." if tolerance is not None
                         else "No tolerance is stated (plan.tolerance)."), "",
             "| suite | n | points per item | delta (points) | 95% interval (points) | right->wrong | wrong->right | "
             "McNemar p | within tolerance | items to resolve 1 point |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, s in check["suites"].items():
        t = paired_verdict(s["delta"], s["flips"], s["n"], s["mcnemar_p"], tolerance, interval=s.get("delta_interval"))
        within = "-" if t["within_tolerance"] is None else ("yes" if t["within_tolerance"] else "**no**")
        lines.append(f"| {name} | {s['n']} | {t['resolution_points']:.2f} | {t['delta_points']:+.2f} | "
                     f"{interval_text(t['interval_points'])} | {s['flips']['right_to_wrong']} | {s['flips']['wrong_to_right']} | {s['mcnemar_p']:.3g} | "
                     f"{within} | {t['items_for_one_point'] if t['items_for_one_point'] is not None else 'no flips'} |")
    return "\n".join(lines)


def check_accuracy(artifact: Path, model_dir: Path, cfg: EvaluateSection, work: Path, root: Path,
                   layout: ReportLayout | None = None) -> AccuracyCheck:
    """The accuracy check of ``artifact`` (``cfg``'s settings), merged into its report.json and report.md
    (rendered with ``layout``, the stage table's sections), each operating point with its delta."""

    data = Path(cfg.data) if cfg.data else None
    if data is not None and not data.is_absolute():
        data = root / data

    def run(budget, output: Path, plan=None) -> dict:
        return evaluate_artifact(artifact, model_dir, cfg.suites, data, cfg.limits(), cfg.num_fewshot, budget,
                                 cfg.gsm8k_format, output=output, plan=plan, layout=layout)

    report = run(cfg.memory_budget, work / "eval.json")
    check = AccuracyCheck(suites=eval_summary(report), data=report["data"], memory_budget=report["memory_budget"],
                          points=[])
    manifest = read_manifest(artifact)
    artifact_report = current_report(manifest)  # sealed and checked, as `moeload info` and `plan` read it
    if not artifact_report.get("operating_points"):
        return check
    plan = read_plan(manifest.root)
    tolerance = (artifact_report.get("planning") or {}).get("tolerance")
    points = []
    for point in artifact_report["operating_points"]:
        if plan.routing.name == "cache_routing":  # outputs depend on the cache: measure at the point's budget
            summary = eval_summary(run(point["budget_bytes"], work / f"eval-{point['budget_bytes']}.json", plan))
            where = point["budget_bytes"]
        else:
            summary, where = check.suites, report["memory_budget"]
        points.append({"budget_bytes": point["budget_bytes"], "measured_at": where,
                       "accuracy_delta": {suite: s["delta"] for suite, s in summary.items()},
                       "accuracy_test": {suite: paired_verdict(s["delta"], s["flips"], s["n"], s["mcnemar_p"], tolerance,
                                                               interval=s.get("delta_interval"))
                                         for suite, s in summary.items()}})
    updated = [p | {"accuracy_delta": q["accuracy_delta"], "accuracy_test": q["accuracy_test"],
                    "accuracy_measured_at": q["measured_at"],
                    "within_tolerance": (None if tolerance is None else
                                         all(t["within_tolerance"] for t in q["accuracy_test"].values()))}
               for p, q in zip(artifact_report["operating_points"], points, strict=True)]
    artifact_report |= {"operating_points": updated}
    merge_section(manifest.root, {"operating_points": updated}, layout,
                  files={PLAN_PLOT: operating_points_plot(artifact_report)}, package_key=manifest.raw["package_key"])
    return AccuracyCheck(check.suites, check.data, check.memory_budget, points)


def _in_report(inputs, result: AccuracyCheck) -> bool:
    try:
        report = json.loads((inputs.artifact.path / "report.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(report, dict) or report.get("eval") != json.loads(json.dumps(result.report_entry())):
        return False
    have = [p.get("accuracy_delta") for p in report.get("operating_points") or []]
    return have == json.loads(json.dumps([p["accuracy_delta"] for p in result.points]))


STAGE = Stage(
    name="evaluate", version=VERSION, config=EvaluateSection, result=AccuracyCheck,
    reads=("package",), needs=frozenset({"artifact"}),
    run=lambda inputs: check_accuracy(inputs.artifact.path, inputs.model_dir, inputs.config, inputs.work,
                                      inputs.root, inputs.report_layout),
    enabled=lambda recipe: recipe.evaluate.enabled,
    output_ok=_in_report,
    section="evaluate",
)
