"""Stage ``neuron``: CORM's neuron-level loading (CORM sections 3 and 4.1-4.3), run when ``neuron.layout``
is ``neuron``.

1. Packs every expert at every precision of the quantize stage in the neuron layout
   (``loader.codec.NeuronLayout``): work units as quantize's, one per precision and MoE layer
   (``<precision>/layer-<l>.safetensors``, run by the executor in this process or on Ray workers), so an
   interrupted run resumes with the layers written and a distributed run writes the same bytes.
2. The activation profile: per layer, the share of the selected experts' neurons active against theta, on
   the calibration traces (router inputs and selections).
3. The read-cost crossover: partial against whole neuron reads timed on this machine's disk
   (``prep.methods.neuron.measure_crossover``), unless the recipe gives one.
4. theta: the recipe's, or with a tolerance the largest of ``thetas`` up to it whose source model with the
   inactive neurons dropped (``prep.methods.neuron.dropped_neurons``) stays within the mean next-token KL; the
   trail is kept.

Package ships these records instead of the quantize stage's, and writes the plan's ``neuron`` entry (and the
``neuron_gates`` predictor) when ``neuron.enabled``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save

from loader.codec import RecordLayout
from loader.format import expert_key
from loader.neuron import COMPUTE
from loader.plan import PolicySpec
from prep.errors import MoeprepError
from prep.executor import Unit
from prep.methods.decoded import mean_kl, next_token_logprobs
from prep.methods.neuron import activity_profile, dropped_neurons, measure_crossover, pairing_of
from prep.methods.trace import open_trace
from prep.quant.hqq_codec import encode_neuron_expert, neuron_layout
from prep.report import ReportSection
from prep.stages import Stage, StageResult
from prep.stages.bitwidth import held_out
from prep.stages.quantize import PackedExperts
from prep.stages.trace import RoutingTraces
from prep.streaming import resident_layer

VERSION = 2
CROSSOVER_FRACTIONS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


@dataclass(frozen=True)
class NeuronSection:
    """CORM's neuron-level loading. ``layout``: ``expert`` (whole-expert records) or ``neuron`` (neuron-major
    records: W1 whole, then one contiguous row per neuron; ``loader/codec.py`` NeuronLayout). ``enabled``:
    the loader reads only each token's active neurons (needs the neuron layout; decode only unless
    ``prefill``). ``theta``: the activity threshold; with ``tolerance`` (mean next-token KL, nats, on the last
    ``num_sequences`` calibration sequences) it is the largest of ``thetas`` up to ``theta`` whose source
    model with the inactive neurons dropped stays within it. ``crossover``: the active share above which a
    whole read is cheaper (null: measured on this machine's disk). ``compute``: ``resident`` or ``active``
    neurons; ``predictor``: CORM's next-gate + W1 prefetch (the ``neuron_gates`` predictor);
    ``trust_prediction``: proceed with the prediction as CORM does (the layer computes the predicted experts
    with the prefetched neurons) instead of fixing wrong predictions on demand."""

    layout: str = "expert"
    enabled: bool = False
    theta: float = 0.1
    thetas: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
    tolerance: float | None = None
    num_sequences: int | None = 8
    crossover: float | None = None
    compute: str = "resident"
    predictor: bool = False
    trust_prediction: bool = False
    prefill: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("expert", "neuron"):
            raise MoeprepError(f"neuron.layout {self.layout!r} unknown; use expert or neuron")
        if self.enabled and self.layout != "neuron":
            raise MoeprepError("neuron.enabled needs the neuron record layout: set neuron.layout: neuron")
        if self.theta < 0 or any(t < 0 for t in self.thetas) or not self.thetas:
            raise MoeprepError("neuron.theta and neuron.thetas must be >= 0 (thetas: a non-empty list)")
        if self.tolerance is not None and self.tolerance < 0:
            raise MoeprepError(f"neuron.tolerance must be >= 0 nats (or null), got {self.tolerance}")
        if self.crossover is not None and not 0 <= self.crossover <= 1:
            raise MoeprepError(f"neuron.crossover is a share in [0, 1] (or null to measure it), got {self.crossover}")
        if self.compute not in COMPUTE:
            raise MoeprepError(f"neuron.compute must be one of {COMPUTE}, got {self.compute!r}")
        if self.num_sequences is not None and self.num_sequences <= 0:
            raise MoeprepError("neuron.num_sequences must be positive (or null for all)")


@dataclass(frozen=True)
class NeuronChoice(StageResult):
    packed: dict  # PackedExperts.to_json() of the neuron-layout records in this stage's directory
    pairing: str  # how the experts module fuses gate and up: halves or interleaved
    theta: float
    crossover: float
    crossover_measured: dict | None  # measure_crossover's output (None when the recipe gave the crossover)
    profile: dict  # activity_profile: share of active neurons per layer against theta
    trail: list  # [[theta, mean next-token KL]] when a tolerance was set
    knobs: dict  # the plan's neuron entry: theta, crossover, compute, trust_prediction, prefill
    enabled: bool
    predictor: bool

    def apply(self, plan, context):
        """CORM's neuron-level loading as the plan's ``neuron`` entry, and its predictor, when enabled."""
        if not self.enabled:
            return plan
        predictors = plan.predictors
        if self.predictor and "neuron_gates" not in {p.name for p in predictors}:
            predictors = (*predictors, PolicySpec("neuron_gates", {}))
        return dataclasses.replace(plan, predictors=predictors, neuron=PolicySpec("sparse", self.knobs))

    def packed_experts(self) -> PackedExperts:
        return PackedExperts.from_json(self.packed)

    def report(self, entries: dict) -> dict:
        """report.json's ``neuron``: the stage's figures (the records are the artifact's store) and the layout."""
        return entries | {"neuron": {k: v for k, v in self.to_json().items() if k != "packed"} | {"layout": "neuron"}}

    REPORT_OFF = {"neuron": None}
    REPORT_SECTIONS = (ReportSection("neuron", 70, lambda report: [neuron_markdown(report["neuron"]), ""]
                                     if report.get("neuron") else []),)


def neuron_markdown(neuron: dict) -> str:
    """report.md's neuron-level loading section: the stage's theta, crossover and profile, and the study's
    table when one was merged in."""
    profile = neuron["profile"]
    lines = ["## Neuron-level loading (CORM)", "",
             f"theta {neuron['theta']:g}, crossover {neuron['crossover']:.0%} of the neurons"
             + (" (measured on the preparing machine's disk)" if neuron.get("crossover_measured") else " (given)")
             + f", compute {neuron['knobs']['compute']}, predictor {'on' if neuron['predictor'] else 'off'}"
             + (f"; theta trail (theta, KL): {neuron['trail']}" if neuron.get("trail") else "") + ".", "",
             "Share of the selected experts' neurons active (|act(W1 x)| > theta) on the calibration traces:", "",
             "| theta | " + " | ".join(f"layer {i}" for i in range(len(profile["layers"]))) + " | mean |",
             "| ---: | " + " | ".join("---:" for _ in profile["layers"]) + " | ---: |"]
    for i, theta in enumerate(profile["thetas"]):
        lines.append(f"| {theta:g} | " + " | ".join(f"{row[i]:.3f}" for row in profile["layers"])
                     + f" | {profile['mean'][i]:.3f} |")
    if neuron.get("study"):
        lines += ["", neuron["study"]["markdown"]]
    return "\n".join(lines)


def pack_neuron_layer(context, out: Path, *, precision: str, layer: int, group: int, meta: int) -> None:
    """One unit: every expert of model layer ``layer`` at ``precision`` in the neuron layout, written to ``out`` (a
    streamed model reads this layer from the shards for the block)."""
    model, adapter = context.model, context.adapter
    with resident_layer(model, adapter, layer):
        records = {expert_key(layer, e): encode_neuron_expert(adapter.get_expert(model, layer, e), precision, group,
                                                              meta)[1]
                   for e in range(adapter.num_experts)}
    Path(out).write_bytes(save(records))


def neuron_units(adapter, model, quantize: PackedExperts) -> tuple[list[Unit], PackedExperts]:
    """(units, packed): one unit per precision of ``quantize`` and MoE layer, writing
    ``<precision>/layer-<l>.safetensors``; and the stores they make, each layout from the expert shapes only
    (``neuron_layout`` on the experts module's views, meta for a streamed model: no weight is read here)."""
    views = adapter.module_views(adapter.experts(model, adapter.moe_layers[0]), 0)
    units, stores = [], {}
    for precision, info in quantize.stores.items():
        group, meta = info["group_size"], info["meta_group"]
        layout = neuron_layout(views, precision, group, meta)
        files = [f"layer-{layer}.safetensors" for layer in adapter.moe_layers]
        units += [Unit(name=f"{precision}/layer-{layer}", output=f"{precision}/{name}", fn=pack_neuron_layer,
                       args={"precision": precision, "layer": layer, "group": group, "meta": meta})
                  for layer, name in zip(adapter.moe_layers, files, strict=True)]
        stores[precision] = {"group_size": group, "meta_group": meta, "layout": layout.to_json(),
                             "record_bytes": layout.nbytes, "files": files}
    return units, PackedExperts(precision=quantize.precision, stores=stores, layers=list(quantize.layers),
                                num_experts=quantize.num_experts)


def choose_theta(model, adapter, sequences: list, cfg: NeuronSection) -> tuple[float, list]:
    """The recipe's theta, or with a tolerance the largest candidate within it (from the top down)."""
    if cfg.tolerance is None:
        return cfg.theta, []

    held = held_out(sequences, cfg.num_sequences)
    reference = next_token_logprobs(model, held)
    trail = []
    for theta in sorted({t for t in cfg.thetas if t <= cfg.theta} | {cfg.theta}, reverse=True):
        with dropped_neurons(model, adapter, theta):
            trail.append([theta, mean_kl(reference, model, held)])
        if trail[-1][1] <= cfg.tolerance:
            return theta, trail
    return 0.0, trail


def _run(inputs) -> NeuronChoice:

    cfg: NeuronSection = inputs.config
    quantize_dir, quantize = inputs.upstream("quantize")
    trace_dir, _ = inputs.upstream("trace")
    model, adapter = inputs.model, inputs.adapter
    units, packed = neuron_units(adapter, model, quantize)
    inputs.map_units(units, desc="neuron layout")
    trace = open_trace(RoutingTraces.path(trace_dir))
    profile = activity_profile(model, adapter, trace, sorted(set(cfg.thetas) | {cfg.theta}))
    measured = None
    crossover = cfg.crossover
    if crossover is None:
        layer = packed.layers[0]
        records = dict(packed.records(inputs.work, packed.precision, lambda lay, e: lay == layer).items())
        measured = measure_crossover(records, RecordLayout.from_json(packed.stores[packed.precision]["layout"]),
                                     CROSSOVER_FRACTIONS, directory=inputs.work)
        crossover = measured["crossover"]
    theta, trail = choose_theta(model, adapter, inputs.sequences, cfg)
    knobs = {"theta": theta, "crossover": crossover, "compute": cfg.compute,
             "trust_prediction": cfg.trust_prediction, "prefill": cfg.prefill}
    return NeuronChoice(packed=packed.to_json(), pairing=pairing_of(adapter), theta=theta, crossover=crossover,
                        crossover_measured=measured, profile=profile, trail=trail, knobs=knobs,
                        enabled=cfg.enabled, predictor=cfg.predictor)


STAGE = Stage(
    name="neuron", version=VERSION, config=NeuronSection, result=NeuronChoice,
    reads=("trace", "quantize"), needs=frozenset({"model", "calibration"}),
    enabled=lambda recipe: recipe.neuron.layout == "neuron",
    run=_run,
    units=lambda recipe, num_layers: len(recipe.quantize.precisions) * num_layers,
    section="neuron",
)
