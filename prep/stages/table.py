"""The stage table: every stage of ``moeprep prepare``, in the order they run. Adding a stage is its module, one
row here, and its test: the recipe's sections (``SECTIONS``, from which ``prep.recipe.Recipe`` is made), the
recipe checks, the plan, report.json's entries and report.md's sections (``REPORT``) come from the rows; ``prep/pipeline.py`` walks the table and has no per-stage code."""

from __future__ import annotations

import dataclasses

from prep.report import ReportLayout
from prep.stages import (
    EARLIER_CONTRIBUTIONS,
    Stage,
    allocate_cache,
    bitwidth,
    cache_routing,
    divergence,
    dynamic_precision,
    evaluate,
    gating,
    neuron,
    package,
    predict,
    quantize,
    sensitivity,
    trace,
    tune_policy,
)

ROWS: tuple[Stage, ...] = (
    trace.STAGE,
    quantize.STAGE,
    sensitivity.STAGE,
    bitwidth.STAGE,
    predict.STAGE,
    gating.STAGE,
    dynamic_precision.STAGE,
    cache_routing.STAGE,
    neuron.STAGE,
    allocate_cache.STAGE,
    tune_policy.STAGE,
    package.STAGE,
    divergence.STAGE,
    evaluate.STAGE,
)


def expanded(rows: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """The rows with ``EARLIER_CONTRIBUTIONS`` in ``reads`` replaced by the earlier stages whose result contributes
    to the plan (in table order, after the stage's own reads)."""
    out = []
    for i, stage in enumerate(rows):
        if EARLIER_CONTRIBUTIONS in stage.reads:
            own = tuple(r for r in stage.reads if r != EARLIER_CONTRIBUTIONS)
            stage = dataclasses.replace(stage, reads=own + tuple(
                s.name for s in rows[:i] if s.result.contributes() and s.name not in own))
        out.append(stage)
    return tuple(out)


STAGES = expanded(ROWS)
STAGE_NAMES = tuple(s.name for s in STAGES)


def sections(stages: tuple[Stage, ...]) -> dict[str, type]:
    """Recipe key -> section class, in the table's order; a section two stages share (``plan``) once, and one
    name may not stand for two classes."""
    out: dict[str, type] = {}
    for stage in stages:
        if out.setdefault(stage.section, stage.config) is not stage.config:
            raise TypeError(f"stage {stage.name}: section {stage.section!r} is {out[stage.section].__name__} in an "
                            f"earlier row, not {stage.config.__name__}")
    return out


def check_table(stages: tuple[Stage, ...]) -> None:
    """Every stage reads only stages before it."""
    seen: set[str] = set()
    for stage in stages:
        if missing := [r for r in stage.reads if r not in seen]:
            raise TypeError(f"stage {stage.name} reads {missing}, which do not come before it in the table")
        seen.add(stage.name)


check_table(STAGES)
SECTIONS = sections(STAGES)
REPORT = ReportLayout.of(stage.result for stage in STAGES)  # report.md's sections, from the results' declarations
