"""The stage contract: every pipeline stage is one module that declares a ``Stage``.

A stage declares

- ``config`` and ``section``: its recipe section, a frozen dataclass defined beside the stage that checks its
  own keys in ``__post_init__``, and its key in the recipe (``Recipe`` is made from the table's sections);
- optionally ``check(recipe)``: its rules across sections (``bitwidth.low`` must be a precision
  ``quantize`` writes), run by ``load_recipe`` and ``--dry-run``;
- ``result``: a frozen ``StageResult`` subclass, saved as ``result.json`` (+ an optional
  ``tensors.safetensors``, + any files the stage writes itself) in its stage directory; its
  ``apply(plan, context)`` is the stage's contribution to the artifact's plan (none by default), its
  ``report(entries)`` its contribution to the artifact's report.json (``REPORT_OFF``: its entries when the recipe
  switches the stage off) and ``REPORT_SECTIONS`` the sections of report.md it renders from them
  (``prep.report.ReportSection``; the table gathers them into ``prep.stages.table.REPORT``);
- ``reads``: the upstream stages whose results it reads (``EARLIER_CONTRIBUTIONS``: also every earlier stage
  whose result contributes to the plan, as the package stage reads them, so a new stage's contribution
  reaches the artifact without editing the package stage);
- ``needs``: what else it uses, from ``NEEDS``:
  ``model`` (the loaded source model, its adapter and tokenizer; loaded only when such a stage runs),
  ``calibration`` (the calibration token sequences), ``recipe`` (it records the recipe that made its
  output: name, model and the sections of the stages it derives from), ``artifact`` (it writes or
  reads the artifact directory, ``prep.store.ArtifactOutput``);
- ``run(inputs) -> result``, where ``inputs`` (``prep.pipeline.StageInputs``) hands out only what was
  declared;
- optionally ``files(recipe)``: input files the recipe names (a device profile), whose content the key
  covers (so measuring the file again reruns the stage);
- optionally ``units(recipe, num_moe_layers)``: how many work units it hands the executor
  (``prep/executor.py``, ``StageInputs.map_units``), for ``--dry-run``; a stage without it runs whole in the driver;
- optionally ``enabled(recipe)`` (a stage the recipe can switch off, e.g. the sensitivity sweep only
  the ``edgemoe`` bit-width method reads; the key does not depend on it) and ``output_ok(inputs, result)``
  (for a stage whose real output lives outside the stage store: a cached result is reused only when
  this says its output is still there and is this key's).

The cache key of a stage covers exactly what it declares (``prep.store.stage_key``); ``prep/pipeline.py``
walks the table and has no per-stage code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from loader.io import write_text_atomic
from prep.report import ReportSection

RESULT = "result.json"
# in ``reads``: every earlier stage of the table whose result contributes to the plan (overrides ``apply``)
EARLIER_CONTRIBUTIONS = "*contributions"
TENSORS = "tensors.safetensors"
NEEDS = frozenset({"model", "calibration", "recipe", "artifact"})


@dataclass(frozen=True)
class StageResult:
    """Base of every stage result: a frozen dataclass of JSON values, saved as ``result.json``."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def contributes(cls) -> bool:
        """Whether this result type has a plan contribution (overrides ``apply``)."""
        return cls.apply is not StageResult.apply

    def apply(self, plan, context):
        """This result's contribution to the artifact's plan (``loader.plan.Plan``): ``compose_plan`` hands every
        result a stage reads to this, in the table's order, with a ``prep.stages.planning.PlanContext``. By
        default a result contributes nothing."""
        return plan

    # report.md's sections this result's entries are shown in, and its report.json entries when switched off
    REPORT_SECTIONS: ClassVar[tuple[ReportSection, ...]] = ()
    REPORT_OFF: ClassVar[dict] = {}

    def report(self, entries: dict) -> dict:
        """This result's contribution to the artifact's report.json: the package stage hands every result it reads
        the entries so far, in the table's order (``report_entries``). By default a result contributes nothing."""
        return entries

    def problem(self) -> str | None:
        """Why this result, read back from the stage cache, may not enter a plan though its seal holds (a seal can
        be recomputed): a value out of the range its type knows. None: none found. Every number of every result
        is checked finite before this (``prep.integrity.value_problem``); a result type overrides this to add its
        ranges."""
        return None

    @classmethod
    def from_json(cls, raw: dict) -> StageResult:
        """The result of ``raw``; a field with a default may be missing (a result saved before it was added)."""
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw or (
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)})

    def save(self, directory: Path, tensors: dict | None = None, **meta) -> None:
        """Write ``tensors.safetensors`` (when given), the directory's seal (``prep.integrity``: the xxh3 of every
        file in it), then ``result.json`` last: {"result": ..., **meta}."""
        from prep.integrity import seal_directory

        if tensors:
            from safetensors.torch import save_file

            save_file(tensors, str(Path(directory) / TENSORS))
        text = json.dumps({"result": self.to_json(), **meta}, indent=2, sort_keys=True) + "\n"
        seal_directory(directory, RESULT, text, {"stage": meta.get("stage"), "key": meta.get("key")})
        write_text_atomic(Path(directory) / RESULT, text)

    @classmethod
    def load(cls, directory: Path) -> StageResult:
        return cls.from_json(json.loads((Path(directory) / RESULT).read_text())["result"])

    @staticmethod
    def load_tensors(directory: Path) -> dict:
        from safetensors.torch import load_file

        return load_file(str(Path(directory) / TENSORS))


def report_entries(read: list[tuple[type[StageResult], StageResult | None]]) -> dict:
    """The report.json entries of ``read`` (the result type and result of each stage read, in the table's order;
    None where the recipe switches it off): each result's ``report``, each switched-off type's ``REPORT_OFF``."""
    entries: dict = {}
    for kind, result in read:
        entries = entries | kind.REPORT_OFF if result is None else result.report(entries)
    return entries


@dataclass(frozen=True)
class Stage:
    """One row of the stage table (``prep.pipeline.STAGES``)."""

    name: str
    version: int  # bump whenever the output changes for the same inputs
    config: type  # its recipe section dataclass
    result: type[StageResult]
    run: Callable[[Any], StageResult]
    reads: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()
    enabled: Callable[[Any], bool] | None = None
    files: Callable[[Any], list[str]] | None = None  # input files the recipe names (relative to the project root)
    output_ok: Callable[[Any, StageResult], bool] | None = None
    section: str = ""  # the recipe key of ``config`` (a section two stages share has one name)
    check: Callable[[Any], None] | None = None  # the stage's rules across recipe sections; raises MoeprepError
    # how many work units (prep/executor.py) it splits into for (recipe, number of MoE layers); None or 0: it runs
    # whole in the driver; where ``units_per_round(recipe)`` holds, the first map's count, more following round by round
    units: Callable[[Any, int], int] | None = None
    units_per_round: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if not self.section.isidentifier():
            raise ValueError(f"stage {self.name}: section must name its recipe section, got {self.section!r}")
        if unknown := set(self.needs) - NEEDS:
            raise ValueError(f"stage {self.name}: unknown needs {sorted(unknown)}; use {sorted(NEEDS)}")
