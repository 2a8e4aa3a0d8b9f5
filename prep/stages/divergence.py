"""Stage ``divergence``: the fresh artifact's next-token distributions against its source's on held-out text.

On by default in every recipe: it costs a forward of each model over a few thousand tokens, where the suites cost
hours on a real model, and it resolves differences the suites cannot (``prep/evals/divergence.py``). The held-out
text is the calibration source's text after the calibration windows, or ``text`` (a calibration-style section);
it shares no text and no window with the calibration set every stage and trace is cut from (checked,
``prep.calibration.held_out_sequences``). The artifact runs through the loader at ``memory_budget``; with
cache-conditional routing its outputs depend on what is resident, so each operating point is measured at its own
budget. The result lands in report.json (``divergence``) and leads report.md's accuracy part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tqdm import tqdm

from loader.format import read_json, read_manifest
from loader.memory import is_auto
from loader.plan import PlanError, parse_budget, read_plan
from loader.runtime import load
from prep.calibration import CalibrationSection, check_length, held_out_sequences, model_context
from prep.errors import MoeprepError
from prep.evals import divergence as D
from prep.evals.compare import writable
from prep.report import ReportSection, current_report, merge_section
from prep.stages import Stage, StageResult
from prep.streaming import give_back_memory

VERSION = 2  # 2: the held-out text goes on where the calibration windows end
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class HeldOutText(CalibrationSection):
    """``divergence.text``: a calibration-style section naming another source of held-out text. Its source keys
    are read (``source``, ``files``, ``dataset``, ``dataset_config``, ``split``, ``text_field``, and ``seed`` for the
    reference generator); the windows are ``divergence.num_sequences`` of ``divergence.sequence_length``. Its
    messages name ``divergence.text``."""

    KEY: ClassVar[str] = "divergence.text"


def check_budget(budget, key: str) -> None:
    """A loader budget as ``load`` takes it (bytes, a size, a share, ``unlimited`` or ``auto``), refused now under
    the name ``key`` rather than when the artifact is loaded."""
    if budget is None or is_auto(budget):
        return
    try:
        parse_budget(budget)
    except PlanError as e:
        raise MoeprepError(f"{key}: {e}") from None


@dataclass(frozen=True)
class DivergenceSection:
    """Held-out text (``num_sequences`` windows of ``sequence_length`` tokens, null: 256 or the model's context if
    shorter; ``text``: another source than the calibration's, whose source keys are read), the loader budget (null:
    unlimited, or the artifact's minimum where preparation streams the source under a bound; where the plan's
    outputs depend on what is resident, each operating point, or the plan's default budget, is measured at its own
    too) and ``resamples`` bootstrap draws for the 95% intervals."""

    enabled: bool = True
    num_sequences: int = 64
    sequence_length: int | None = None
    text: HeldOutText | None = None
    memory_budget: str | None = None
    resamples: int = D.RESAMPLES
    seed: int = 0

    def __post_init__(self) -> None:
        if not 4 <= self.num_sequences <= 100_000:
            raise MoeprepError(f"divergence.num_sequences must be from 4 to 100,000 (the interval is a bootstrap over "
                               f"sequences: 64 or more keeps its coverage near 95%), got {self.num_sequences}")
        if self.sequence_length is not None and not 2 <= self.sequence_length <= 1 << 17:
            raise MoeprepError(f"divergence.sequence_length must be from 2 to 131,072 tokens, got "
                               f"{self.sequence_length}")
        if not 100 <= self.resamples <= 100_000:
            raise MoeprepError(f"divergence.resamples must be from 100 to 100,000, got {self.resamples}")
        if not 0 <= self.seed <= MAX_SEED:
            raise MoeprepError(f"divergence.seed must be from 0 to {MAX_SEED:,} (it seeds the bootstrap), got "
                               f"{self.seed}")
        check_budget(self.memory_budget, "divergence.memory_budget")


@dataclass(frozen=True)
class Divergence(StageResult):
    """report.json's ``divergence``: the held-out text's provenance, the figures at the budget measured, and per
    operating point where routing makes them differ."""

    held_out: dict
    memory_budget: str | int | None
    summary: dict  # prep.evals.divergence.measure's output; no wall time: result.json and report.json are functions
    # of the inputs (a rebuild, or a run on Ray, writes the same bytes); prepare's summary prints the time
    points: list  # [{"budget_bytes", "summary"}], only where outputs depend on what is resident

    def report_entry(self) -> dict:
        return {"held_out": self.held_out, "memory_budget": self.memory_budget, **self.summary,
                "points": self.points}

    REPORT_SECTIONS = (ReportSection("divergence", 9, lambda report: [divergence_markdown(report["divergence"]), ""]
                                     if report.get("divergence") else []),)


LABELS = {"mean_kl": ("mean KL (nats)", "{:.3g}"), "kl_p99": ("KL 99th percentile", "{:.3g}"),
          "kl_p999": ("KL 99.9th percentile", "{:.3g}"), "top_token_agreement": ("same top token", "{:.2%}"),
          "ppl_source": ("perplexity, source", "{:.4g}"), "ppl_prepared": ("perplexity, prepared", "{:.4g}"),
          "ppl_ratio": ("perplexity ratio", "{:.5f}")}


def stats_rows(stats: dict) -> list[str]:
    """One markdown row per figure: value and its interval."""
    rows = []
    for name, (label, form) in LABELS.items():
        s = stats[name]
        rows.append(f"| {label} | {form.format(s['value'])} | {form.format(s['low'])} to {form.format(s['high'])} |")
    return rows


def divergence_markdown(entry: dict) -> str:
    """report.md's section: what was measured on what text, the table, and per operating point when they differ."""
    held = entry["held_out"]
    where = ("the calibration source's text from where the calibration windows end" if held.get("after_calibration")
             else f"{held.get('source')} text")
    budget = entry.get("memory_budget")
    budget = ("every expert resident" if budget == "unlimited" else
              f"budget {budget / 2**20:.1f} MiB" if isinstance(budget, int | float) else
              f"budget {budget or 'the plan default'}")
    lines = ["## Divergence from the source", "",
             f"The prepared model through the loader ({budget}) "
             f"against its source, next token by next token on held-out text: {entry['sequences']} sequences of "
             f"{held['sequence_length']} tokens ({entry['tokens']:,} predicted), {where}, with no window and no whole "
             f"text in common with the calibration set. Intervals: {entry['level']:.0%}, bootstrap over sequences "
             f"({entry['resamples']} draws, BCa).", "",
             f"| figure | value | {entry['level']:.0%} interval |", "| --- | ---: | ---: |", *stats_rows(entry["stats"])]
    if entry.get("points"):
        lines += ["", "The plan's outputs depend on what is resident (cache-conditional routing, its miss rule or "
                  "neuron-level loading): each operating point measured at its budget.", "",
                  "| budget | mean KL | interval | same top token | perplexity ratio |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for point in entry["points"]:
            s = point["summary"]["stats"]
            at = point["budget_bytes"]
            lines.append(f"| {f'{at / 2**20:.1f} MiB' if isinstance(at, int | float) else at} | "
                         f"{s['mean_kl']['value']:.3g} | "
                         f"{s['mean_kl']['low']:.3g} to {s['mean_kl']['high']:.3g} | "
                         f"{s['top_token_agreement']['value']:.2%} | {s['ppl_ratio']['value']:.5f} |")
    return "\n".join(lines)


SOURCE_TOKENS = 512  # a bounded streamed source's forward: as many sequences as keep its tokens under this (a trace
# batch's 8 x 64: its activations stay below the layer it reads)


def bounded_stream(source):
    """The source's expert stream where it keeps fewer expert bytes resident than the model has (preparation
    streams it under ``--expert-memory``), else None: the source is whole in memory."""
    from prep.adapters import get_adapter
    from prep.streaming import stream_of

    adapter = get_adapter(source)
    stream = stream_of(source, adapter)
    if stream is None or stream.resident_bytes >= stream.layer_bytes * len(adapter.moe_layers):
        return None
    return stream


def source_hidden(source, sequences) -> list | None:
    """None for a source whole in memory (each sequence's logits are computed beside the prepared model's). A bounded
    stream's last hidden states of every sequence first, ``SOURCE_TOKENS`` per forward (each forward reads every
    expert layer once), its layers then dropped: the prepared model never runs beside a resident source layer, and
    every budget measured reuses them."""
    stream = bounded_stream(source)
    if stream is None or not sequences:
        return None
    batch = max(1, SOURCE_TOKENS // max(len(s) for s in sequences))
    with tqdm(total=len(sequences), desc="divergence: source", unit="seq", leave=False) as bar:
        hidden = D.final_hidden(source, sequences, batch, progress=lambda i, n: bar.update(i - bar.n))
    stream.drop_all()
    give_back_memory()
    return hidden


def measure_artifact(artifact, source, sequences, budget, cfg: DivergenceSection, label: str = "",
                     hidden: list | None = None) -> dict:
    """``prep.evals.divergence.measure`` of ``artifact`` through the loader at ``budget`` (the loader takes the
    operating point for it) against ``source`` (``hidden``: its ``source_hidden``)."""
    prepared = load(artifact, memory_budget=budget)
    try:
        with tqdm(total=len(sequences), desc=f"divergence{label}", unit="seq", leave=False) as bar:
            return D.measure(source, prepared.model, sequences, resamples=cfg.resamples, seed=cfg.seed,
                             progress=lambda i, n: bar.update(1), source_hidden=hidden)
    finally:
        prepared.close()


DEFAULT_LENGTH = 256


def depends_on_residency(plan) -> bool:
    """Whether the loader's outputs depend on which experts are resident: cache-conditional routing, a miss rule
    other than reading the planned precision, or neuron-level loading. Otherwise any budget computes the same."""
    return plan.routing.name == "cache_routing" or plan.miss.name != "plan" or plan.neuron.name != "off"


def window_length(cfg: DivergenceSection, config) -> int:
    """The held-out windows' length: the section's, else 256 tokens or the model's context if shorter; longer than
    the context is an error naming both (``prepare`` and its dry run refuse it before any stage:
    ``prep.calibration.check_context``)."""
    if cfg.sequence_length is None:
        return min(DEFAULT_LENGTH, model_context(config) or DEFAULT_LENGTH)
    check_length("divergence.sequence_length", cfg.sequence_length, config, " (or null)")
    return cfg.sequence_length


def divergence_of(artifact, source, tokenizer, calibration: CalibrationSection, root, cfg: DivergenceSection,
                  layout) -> Divergence:
    """The divergence of ``artifact`` from ``source`` (the source model, loaded) on held-out text after
    ``calibration``'s, merged into the artifact's report.json (report.md rendered with ``layout``): the stage's work,
    and ``moeprep eval``'s on an existing artifact."""
    manifest = read_manifest(artifact)
    artifact = manifest.root
    current_report(manifest)  # an altered report.json, or one that cannot be written, is refused now, not after
    writable(artifact)  # the measurement
    held = held_out_sequences(calibration, tokenizer, root, cfg.num_sequences, window_length(cfg, source.config),
                              cfg.text)
    plan = read_plan(artifact)
    budget = cfg.memory_budget or default_budget(artifact, source)
    hidden = source_hidden(source, held.sequences)
    summary = measure_artifact(artifact, source, held.sequences, budget, cfg, hidden=hidden)
    points = []
    if depends_on_residency(plan):
        report = read_json(manifest.path("report.json"), "report.json")
        for at in [p["budget_bytes"] for p in report.get("operating_points") or []] or [_default_budget(artifact, plan)]:
            label = f" at {at / 2**20:.1f} MiB" if isinstance(at, int | float) else f" at {at}"
            points.append({"budget_bytes": at, "summary": measure_artifact(artifact, source, held.sequences, at, cfg,
                                                                           label, hidden)})
    result = Divergence(held_out=held.provenance, memory_budget=budget, summary=summary, points=points)
    merge_section(artifact, {"divergence": result.report_entry()}, layout, package_key=manifest.raw["package_key"])
    return result


def divergence_of_existing(artifact, original=None, num_sequences: int = 64, sequence_length: int | None = None,
                           memory_budget=None, expert_memory="auto", root=".", layout=None) -> Divergence:
    """``moeprep eval``'s divergence: the held-out text after the calibration section the artifact's manifest
    records, the source read as ``moeprep eval`` reads it (``prep.streaming.load_streamed``)."""
    from transformers import AutoTokenizer

    from prep.adapters import load_config
    from prep.streaming import load_streamed

    manifest = read_manifest(artifact)
    recorded = (manifest.raw.get("recipe") or {}).get("calibration")
    if not recorded:
        raise MoeprepError(f"{manifest.root}'s manifest records no calibration section, so the held-out text cannot "
                           "be told apart from it; pass --divergence-sequences 0 to skip the divergence")
    original = Path(original or manifest.raw["source_model"]["path"])
    if not original.is_dir():
        raise MoeprepError(f"original model {original} not found; pass --model with its directory")
    try:
        calibration = CalibrationSection(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()})
    except TypeError as e:  # a manifest from another moeprep version
        raise MoeprepError(f"{manifest.root}'s recorded calibration section is not one this moeprep reads ({e}); "
                           "pass --divergence-sequences 0 to skip the divergence") from None
    check_budget(memory_budget, "--memory-budget")  # the options' own names, before the source loads
    check_length("--divergence-length", sequence_length, load_config(original))
    cfg = DivergenceSection(num_sequences=num_sequences, sequence_length=sequence_length, memory_budget=memory_budget)
    source = load_streamed(original, resident_bytes=expert_memory)
    return divergence_of(manifest.root, source, AutoTokenizer.from_pretrained(original), calibration, Path(root),
                         cfg, layout)


def default_budget(artifact, source):
    """The budget of an unset ``memory_budget``: unlimited (every expert resident), but the artifact's minimum where
    the source is streamed under a bound: the memory preparation was told to keep is not spent holding every
    prepared expert (the plan's outputs do not depend on the budget, or each operating point is measured too)."""
    if bounded_stream(source) is None:
        return "unlimited"
    from loader.budget import minimum_budget

    return minimum_budget(artifact)


def _default_budget(artifact, plan):
    """The plan's default budget, or the artifact's minimum where that is less (a tiny model's 50% can be)."""
    from loader.budget import minimum_budget
    from loader.errors import BudgetError

    try:
        load(artifact, memory_budget=plan.default_budget).close()
        return plan.default_budget
    except BudgetError:
        return minimum_budget(artifact)


def held_out_files(recipe) -> list[str]:
    """The files ``divergence.text`` names (none when it is unset or another source)."""
    text = recipe.divergence.text
    return list(text.files) if text is not None and text.source == "files" else []


def run(inputs) -> Divergence:
    return divergence_of(inputs.artifact.path, inputs.model, inputs.tokenizer, inputs.calibration, inputs.root,
                         inputs.config, inputs.report_layout)


def _in_report(inputs, result: Divergence) -> bool:
    try:
        report = json.loads((inputs.artifact.path / "report.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and report.get("divergence") == json.loads(json.dumps(result.report_entry()))


STAGE = Stage(
    name="divergence", version=VERSION, config=DivergenceSection, result=Divergence,
    reads=("package",), needs=frozenset({"model", "calibration", "artifact"}),
    files=held_out_files,  # checked to be there by prepare and its dry run; their digests are in the stage's key
    run=run, enabled=lambda recipe: recipe.divergence.enabled, output_ok=_in_report, section="divergence",
)
