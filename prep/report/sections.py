"""The contract between report.md and what writes to it: each stage result declares the sections it renders
(``StageResult.REPORT_SECTIONS``), as it declares its plan contribution, and the stage table gathers them into one
``ReportLayout`` (``prep.stages.table.REPORT``). This module knows no stage: a section is a report.json key, a place
in report.md and a function of report.json's data, so report.md can be rendered again whenever a section changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ReportSection:
    """One section of report.md, drawn from report.json alone (never from a stage result: eval and the studies
    render it again on an existing artifact)."""

    key: str  # the report.json entry it shows
    place: int  # report.md's order, ascending (ties: the stage table's order); the accuracy check leads
    render: Callable[[dict], list[str]]  # the whole report.json -> its lines, [] when it has nothing to show


def study_section(key: str, place: int, plot: str | None = None, alt: str = "") -> ReportSection:
    """A study's section: the markdown the study carries in its entry (``section["markdown"]``), and its plot."""
    def render(report: dict) -> list[str]:
        section = report.get(key) or {}
        text = section.get("markdown") if isinstance(section, dict) else None
        if not text:
            return []
        return [text.rstrip(), *([f"![{alt}]({plot})"] if plot else []), ""]
    return ReportSection(key, place, render)


@dataclass(frozen=True)
class ReportLayout:
    """report.md's sections in order: a header of what the artifact holds, then each section that has data."""

    sections: tuple[ReportSection, ...]

    @classmethod
    def of(cls, results: Iterable[type]) -> ReportLayout:
        """The sections the result types declare (``REPORT_SECTIONS``), by place, in the given order where equal."""
        declared = [s for result in results for s in getattr(result, "REPORT_SECTIONS", ())]
        keys = [s.key for s in declared]
        if len(set(keys)) != len(keys):
            raise TypeError(f"report sections must each show their own report.json entry, got {keys}")
        return cls(tuple(sorted(declared, key=lambda s: s.place)))

    def markdown(self, name: str, report: dict) -> str:
        """The artifact's report.md, a function of report.json: what the artifact holds, then each section."""
        sizes, bw = report["sizes"], report.get("bitwidth", {})
        mix = ", ".join(f"{p} {n}" for p, n in bw.get("experts", {}).items())
        lines = [f"# {name}: {report.get('architecture', '')}", "",
                 f"- Experts: {mix} ({bw.get('method', 'uniform')}); {sizes['expert_bytes'] / 2**20:.2f} MiB, "
                 f"{report['compression']['bfloat16']:.2f}x smaller than bfloat16, "
                 f"{report['compression']['source']:.2f}x than the source; dense weights "
                 f"{sizes['dense_bytes'] / 2**20:.2f} MiB."]
        choice = report.get("technique_choice")
        if isinstance(choice, dict):
            names = ", ".join(choice.get("techniques") or []) or "none"
            lines.append(f"- Techniques: {names}; " + (
                f"kept where `moeload tune` measured them paying on {choice.get('device')} at {choice.get('budget')} "
                f"(switched off there: {', '.join(choice.get('off') or []) or 'none'})." if choice.get("tested")
                else f"{choice.get('why')}."))
        lines.append("")
        for section in self.sections:
            lines += section.render(report)
        return "\n".join(lines)

