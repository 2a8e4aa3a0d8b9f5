"""Stage ``evaluate``: the accuracy check of the fresh artifact against its source model (optional).

Reads the package stage (its key covers everything the artifact derives from) and the artifact
itself; runs ``moeprep eval`` with the recipe's ``evaluate`` settings when ``enabled``. The full report
lands in the stage directory (``eval.json``) and its summary in the artifact's ``report.json`` (under
``eval``). A cached result is reused only while the artifact's ``report.json`` still holds that summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prep.evals.compare import eval_summary, evaluate_artifact
from prep.recipe import EvaluateSection
from prep.stages import Stage, StageResult

VERSION = 2


@dataclass(frozen=True)
class AccuracyCheck(StageResult):
    """The ``eval`` entry of the artifact's report.json: per-suite headline figures, data, budget."""

    suites: dict
    data: str | None
    memory_budget: str | None


def check_accuracy(artifact: Path, model_dir: Path, cfg: EvaluateSection, work: Path, root: Path) -> AccuracyCheck:
    data = Path(cfg.data) if cfg.data else None
    if data is not None and not data.is_absolute():
        data = root / data
    report = evaluate_artifact(artifact, model_dir, cfg.suites, data, cfg.limit, cfg.num_fewshot,
                               cfg.memory_budget, cfg.gsm8k_format, output=work / "eval.json")
    return AccuracyCheck(suites=eval_summary(report), data=report["data"], memory_budget=report["memory_budget"])


def _in_report(inputs, result: AccuracyCheck) -> bool:
    try:
        report = json.loads((inputs.artifact.path / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and report.get("eval") == json.loads(json.dumps(result.to_json()))


STAGE = Stage(
    name="evaluate", version=VERSION, config=EvaluateSection, result=AccuracyCheck,
    reads=("package",), needs=frozenset({"artifact"}),
    run=lambda inputs: check_accuracy(inputs.artifact.path, inputs.model_dir, inputs.config, inputs.work,
                                      inputs.root),
    enabled=lambda recipe: recipe.evaluate.enabled,
    output_ok=_in_report,
)
