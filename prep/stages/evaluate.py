"""Stage ``evaluate``: the accuracy check of the fresh artifact against its source model (optional).

Runs ``moeprep eval`` with the recipe's ``evaluate`` settings; the report lands in the stage directory
and its summary in the artifact's ``report.json`` (re-hashed in the manifest).
"""

from __future__ import annotations

from pathlib import Path

from prep.evals.compare import eval_summary, evaluate_artifact
from prep.recipe import EvaluateSection

VERSION = 1


def check_accuracy(artifact: Path, model_dir: Path, cfg: EvaluateSection, work: Path, root: Path) -> dict:
    data = Path(cfg.data) if cfg.data else None
    if data is not None and not data.is_absolute():
        data = root / data
    report = evaluate_artifact(artifact, model_dir, cfg.suites, data, cfg.limit, cfg.num_fewshot,
                               cfg.memory_budget, cfg.gsm8k_format, output=work / "eval.json")
    return eval_summary(report)
