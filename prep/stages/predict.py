"""Stage ``predict``: what the loader's prefetch predictors need, and how well each predicts.

Runs when ``predict.predictors`` names any predictor. The calibration traces (trace stage) are split by
sequence: the last ``held_out`` share is never fitted on and every figure is measured there.

- next-layer gates: nothing to fit (the routers are in the dense weights); top-1 accuracy and top-K
  recall of layer l+d's router on layer l's router input, per layer and distance, against the marginal
  frequency of the target layer;
- path statistics: counts fitted on the other sequences (``prep.methods.routing_stats.fit_path_stats``), the
  same figures per layer against the marginal;
- first-layer gate (only when ``first_gate`` is enabled): trained on the fitted sequences' LM-head inputs
  and first-router logits (``prep.methods.first_gate``), early stopping on the last fifth of them, held-out KL,
  top-1 and top-K recall against the marginal-frequency predictor.

Tensors (``tensors.safetensors``, copied by package into the artifact's ``predictors.safetensors`` for
the enabled predictors): the path counts (``loader.predict.PathStats``) and ``first_gate.weight`` [E, H].
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from loader.plan import PolicySpec
from loader.vocab import PREDICTOR_NAMES as LOADER_PREDICTORS
from prep.errors import MoeprepError
from prep.methods.first_gate import first_gate_data, gate_pairs, prediction_metrics, train_first_gate
from prep.methods.routing_stats import fit_path_stats, next_gate_recall, path_stats_recall
from prep.methods.trace import open_trace
from prep.report import ReportSection, study_section
from prep.stages import TENSORS, Stage, StageResult
from prep.stages.trace import RoutingTraces

VERSION = 1


PREDICTOR_NAMES = tuple(n for n in LOADER_PREDICTORS if n != "neuron_gates")  # neuron_gates: the neuron stage's
FIRST_GATE_INITS = ("zeros", "router")


@dataclass(frozen=True)
class NextGatesKnobs:
    """Stacked next-layer gates: look ``depth`` layers ahead, predict ``experts`` per layer (null: the model's
    top-k), prefetch at ``precision`` (null: the planned one)."""

    depth: int = 3
    experts: int | None = None
    precision: str | None = None


@dataclass(frozen=True)
class PathStatsKnobs:
    """EdgeMoE's path statistics: preload at most ``max_preload`` experts of the next layer with inclusion
    probability >= ``floor``; a key seen fewer than ``min_count`` times backs off to a shorter one."""

    max_preload: int = 3
    floor: float = 0.05
    min_count: int = 5


@dataclass(frozen=True)
class FirstGateKnobs:
    """AdapMoE's first-layer gate: prefetch ``experts`` (null: top-k); trained from ``init`` (zeros, or the
    first MoE router's weights) by AdamW at ``lr`` with early stopping after ``patience`` epochs."""

    experts: int | None = None
    init: str = "zeros"
    lr: float = 1e-3
    max_epochs: int = 200
    patience: int = 10


@dataclass(frozen=True)
class PredictSection:
    """Prefetch predictors the artifact's plan runs (any of ``next_gates``, ``path_stats``, ``first_gate``;
    empty: the stage is off). The stage fits what they need on the calibration traces and measures their
    recall on the last ``held_out`` share of the sequences (never fitted on), next-layer gates at distances
    1..``distances``."""

    predictors: tuple[str, ...] = ()
    held_out: float = 0.25
    distances: int = 3
    next_gates: NextGatesKnobs = field(default_factory=NextGatesKnobs)
    path_stats: PathStatsKnobs = field(default_factory=PathStatsKnobs)
    first_gate: FirstGateKnobs = field(default_factory=FirstGateKnobs)

    def __post_init__(self) -> None:
        if unknown := [n for n in self.predictors if n not in PREDICTOR_NAMES]:
            raise MoeprepError(f"predict.predictors: unknown predictor(s) {unknown}; use any of {PREDICTOR_NAMES}")
        if len(set(self.predictors)) != len(self.predictors):
            raise MoeprepError(f"predict.predictors names a predictor twice: {list(self.predictors)}")
        if not 0 < self.held_out < 1:
            raise MoeprepError(f"predict.held_out is the share of calibration sequences held out, in (0, 1); got "
                               f"{self.held_out}")
        for where, n in (("predict.distances", self.distances), ("predict.next_gates.depth", self.next_gates.depth),
                         ("predict.path_stats.max_preload", self.path_stats.max_preload),
                         ("predict.path_stats.min_count", self.path_stats.min_count),
                         ("predict.next_gates.experts", self.next_gates.experts),
                         ("predict.first_gate.experts", self.first_gate.experts),
                         ("predict.first_gate.max_epochs", self.first_gate.max_epochs),
                         ("predict.first_gate.patience", self.first_gate.patience)):
            if n is not None and n < 1:
                raise MoeprepError(f"{where} must be at least 1, got {n}")
        if not 0 <= self.path_stats.floor <= 1:
            raise MoeprepError(f"predict.path_stats.floor is a probability in [0, 1], got {self.path_stats.floor}")
        if self.first_gate.init not in FIRST_GATE_INITS:
            raise MoeprepError(f"predict.first_gate.init {self.first_gate.init!r} unknown; use one of "
                               f"{FIRST_GATE_INITS}")
        if not self.first_gate.lr > 0:
            raise MoeprepError(f"predict.first_gate.lr must be positive, got {self.first_gate.lr}")


@dataclass(frozen=True)
class PredictionStats(StageResult):
    predictors: list  # the enabled predictors, in the recipe's order
    knobs: dict  # predictor name -> the plan's params for it
    sequences: dict  # {"fitted": n, "held_out": n, "tokens_held_out": n}
    next_gates: dict  # routing_stats.next_gate_recall on the held-out tokens
    path_stats: dict  # routing_stats.path_stats_recall on the held-out tokens
    first_gate: dict | None  # training summary and held-out metrics (None when off)
    seconds: float

    def apply(self, plan, context):
        """The enabled predictors, in the recipe's order, with their knobs."""
        if not self.predictors:
            return plan
        return dataclasses.replace(plan, predictors=tuple(PolicySpec(n, self.knobs[n]) for n in self.predictors))

    def report(self, entries: dict) -> dict:
        """report.json's ``prediction``: the figures, without the timing (an artifact's files hold none)."""
        return entries | {"prediction": {k: v for k, v in self.to_json().items() if k != "seconds"}}

    REPORT_OFF = {"prediction": None}
    REPORT_SECTIONS = (
        ReportSection("prediction", 30, lambda report: [prediction_markdown(report["prediction"]), ""]
                      if report.get("prediction") else []),
        study_section("prediction_study", 40),
    )


def recall_key(row: dict) -> str:
    """The ``top{k}_recall`` key of a row of recall figures (k is the model's top-k)."""
    return next(k for k in row if k.endswith("_recall"))


def prediction_markdown(prediction: dict) -> str:
    """The report.md section of the predict stage's figures (report.json ``prediction``)."""
    seqs = prediction["sequences"]
    lines = ["## Prediction", "",
             f"Predictors in the plan: {', '.join(prediction['predictors'])}. Measured on the last "
             f"{seqs['held_out']} calibration sequences ({seqs['tokens_held_out']} tokens), never fitted on; "
             f"the baseline ranks each layer's experts by their frequency in the other {seqs['fitted']}.", ""]
    gates = prediction["next_gates"]
    if gates["layers"]:
        key = recall_key(gates["layers"][0]["gate"])
        k = key.removeprefix("top").removesuffix("_recall")
        lines += ["Next-layer gates (layer l+d's router on layer l's router input), mean over layers:", "",
                  f"| distance | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for d, m in gates["by_distance"].items():
            lines.append(f"| {d} | {m['gate']['top1']:.3f} | {m['gate'][key]:.3f} | {m['marginal']['top1']:.3f} | "
                         f"{m['marginal'][key]:.3f} |")
        lines += ["", "Per layer and distance:", "",
                  f"| layer | d | target | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in gates["layers"]:
            lines.append(f"| {r['layer']} | {r['distance']} | {r['target']} | {r['gate']['top1']:.3f} | "
                         f"{r['gate'][key]:.3f} | {r['marginal']['top1']:.3f} | {r['marginal'][key]:.3f} |")
        lines.append("")
    path = prediction["path_stats"]
    if path["layers"]:
        key = recall_key(path["layers"][0]["path"])
        k = key.removeprefix("top").removesuffix("_recall")
        lines += ["Path statistics P(E_l | E_l-2, E_l-1) with backoff, per layer:", "",
                  f"| layer | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall | answered by "
                  "full key / previous layer / marginal |", "| ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in path["layers"]:
            t = r["tables"]
            lines.append(f"| {r['layer']} | {r['path']['top1']:.3f} | {r['path'][key]:.3f} | "
                         f"{r['marginal']['top1']:.3f} | {r['marginal'][key]:.3f} | "
                         f"{t['prev2']:.2f} / {t['prev1']:.2f} / {t['marginal']:.2f} |")
        lines.append("")
    first = prediction.get("first_gate")
    if first:
        held, base = first["held_out"], first["marginal"]
        key = recall_key(held)
        lines += [f"First-layer gate (init {first['init']}, {first['epochs']} epochs, best {first['best_epoch']}; "
                  f"{first['pairs']['train']} training pairs, {first['pairs']['held_out']} held out): "
                  f"KL {held['kl']:.4f}, top-1 {held['top1']:.3f}, {key.replace('_', ' ')} {held[key]:.3f}; the "
                  f"marginal: KL {base['kl']:.4f}, top-1 {base['top1']:.3f}, {key.replace('_', ' ')} {base[key]:.3f}.", ""]
    return "\n".join(lines)


def plan_knobs(cfg: PredictSection) -> dict:
    """The plan's params of each enabled predictor (what ``loader.predict.make_predictor`` takes)."""
    knobs = {"next_gates": asdict(cfg.next_gates), "path_stats": asdict(cfg.path_stats),
             "first_gate": {"experts": cfg.first_gate.experts}}
    return {name: knobs[name] for name in cfg.predictors}


def split(n: int, share: float) -> int:
    """How many of ``n`` sequences are held out: the share, at least one, leaving at least one to fit."""
    if n < 2:
        raise MoeprepError(f"the trace has {n} sequence(s); predict needs two or more (set "
                           "calibration.num_sequences >= 2)")
    return min(max(1, round(n * share)), n - 1)


def fit_first_gate(model, adapter, sequences: list, n_fit: int, cfg) -> tuple[torch.Tensor, dict]:
    """Train on the first ``n_fit`` sequences (early stopping on their last fifth), measure on the rest."""
    inputs, teachers = first_gate_data(model, adapter, sequences)
    n_val = max(1, n_fit // 5) if n_fit >= 2 else 0
    train = gate_pairs(inputs[:n_fit - n_val], teachers[:n_fit - n_val])
    held = gate_pairs(inputs[n_fit:], teachers[n_fit:])
    val = gate_pairs(inputs[n_fit - n_val:n_fit], teachers[n_fit - n_val:n_fit]) if n_val else held
    init = "zeros"
    if cfg.init == "router":
        router = adapter.router(model, adapter.moe_layers[0])
        init = router.weight.detach().float().cpu()
    with tqdm(desc="first-layer gate", unit="epoch", total=cfg.max_epochs, leave=False) as bar:
        def progress(_epoch, kl):
            bar.update(1)
            bar.set_postfix(held_kl=f"{kl:.4f}")

        gate = train_first_gate(*train, *val, k=adapter.top_k, init=init, lr=cfg.lr, max_epochs=cfg.max_epochs,
                                patience=cfg.patience, on_epoch=progress)
    with torch.no_grad():
        from prep.methods.first_gate import marginal_logits

        test = prediction_metrics(held[0] @ gate.weight.T, held[1], adapter.top_k)
        marginal = prediction_metrics(marginal_logits(train[1], len(held[1])), held[1], adapter.top_k)
    summary = {"init": cfg.init, "epochs": gate.epochs, "best_epoch": gate.best_epoch,
               "pairs": {"train": len(train[0]), "early_stopping": len(val[0]), "held_out": len(held[0])},
               "early_stopping_on": "fitted" if n_val else "held_out",
               "held_out": test, "marginal": marginal}
    return gate.weight.contiguous(), summary


def fit_predictors(model, adapter, sequences: list, trace_dir, cfg: PredictSection) -> tuple[PredictionStats, dict]:
    started = time.perf_counter()
    trace = open_trace(trace_dir)
    routing = trace.routing()
    if len(routing) == 1 and "recorded" in trace.index:
        # one imported problem: its decode tokens are independent decisions, so the last share of them is held out
        whole = routing[0]
        cut = whole.num_tokens - max(1, round(whole.num_tokens * cfg.held_out))
        routing = [type(whole)(whole.expert_ids[a:b], whole.expert_weights[a:b], whole.layers)
                   for a, b in ((0, cut), (cut, whole.num_tokens))]
    n_held = split(len(routing), cfg.held_out)
    n_fit = len(routing) - n_held
    fit_ids = [r.expert_ids for r in routing[:n_fit]]
    held = routing[n_fit:]
    held_ids = [r.expert_ids for r in held]
    held_weights = [r.expert_weights for r in held]
    rows = slice(sum(r.num_tokens for r in routing[:n_fit]), None)
    tensors = fit_path_stats(fit_ids, adapter.num_experts)
    path = path_stats_recall(tensors, held_ids, held_weights, fit_ids, adapter.num_experts, cfg.path_stats.min_count)
    if f"layers.{trace.layers[0]}.router_input" in trace.index["tensors"]:
        routers = [adapter.router(model, layer) for layer in adapter.moe_layers]
        gates = next_gate_recall([trace.router_inputs(layer)[rows] for layer in trace.layers],
                                 [(r.weight.cpu(), b.cpu() if (b := getattr(r, "bias", None)) is not None else None)
                                  for r in routers],  # the traces are on the CPU
                                 torch.cat(held_ids), torch.cat(held_weights), fit_ids, cfg.distances)
    elif "next_gates" in cfg.predictors or "first_gate" in cfg.predictors:
        raise MoeprepError("predict: next_gates and first_gate read hidden states, which an imported routing trace "
                           "(trace.recorded) does not hold; use path_stats only, or trace the model itself")
    else:
        gates = {"layers": [], "by_distance": {},
                 "skipped": "the trace holds routing only (trace.recorded): no router inputs to measure gates on"}
    first = None
    if "first_gate" in cfg.predictors:
        if len(sequences) != len(routing):
            raise MoeprepError(f"the trace holds {len(routing)} sequences but the calibration data has "
                               f"{len(sequences)}; run prepare with --force trace")
        tensors["first_gate.weight"], first = fit_first_gate(model, adapter, sequences, n_fit, cfg.first_gate)
    stats = PredictionStats(
        predictors=list(cfg.predictors), knobs=plan_knobs(cfg),
        sequences={"fitted": n_fit, "held_out": n_held, "tokens_held_out": sum(len(r.expert_ids) for r in held)},
        next_gates=gates, path_stats=path, first_gate=first, seconds=round(time.perf_counter() - started, 3))
    return stats, tensors


def predictor_tensors(stage_dir, predictors: list) -> dict:
    """The tensors of the stage's result the named predictors read at run time."""
    tensors = StageResult.load_tensors(stage_dir)
    keep = (("path.",) if "path_stats" in predictors else ()) + (("first_gate.",) if "first_gate" in predictors else ())
    return {name: t for name, t in tensors.items() if name.startswith(keep)} if keep else {}


def _run(inputs) -> PredictionStats:

    trace_dir, _ = inputs.upstream("trace")
    stats, tensors = fit_predictors(inputs.model, inputs.adapter, inputs.sequences, RoutingTraces.path(trace_dir),
                                    inputs.config)
    from safetensors.torch import save_file


    save_file(tensors, str(inputs.work / TENSORS))  # result.json is written last, by the stage store
    return stats


def check(recipe) -> None:
    """Held-out sequences to measure recall on, and a prefetch precision the quantize stage writes."""
    p = recipe.predict
    if p.predictors and recipe.calibration.num_sequences < 2 and recipe.trace.recorded is None:
        raise MoeprepError("predict needs calibration.num_sequences >= 2: the last ones are held out to measure "
                           "the predictors' recall")
    precisions = recipe.quantize.precisions
    if p.next_gates.precision is not None and p.next_gates.precision not in precisions:
        raise MoeprepError(f"predict.next_gates.precision is {p.next_gates.precision}, which the quantize stage does "
                           f"not write ({list(precisions)}); add it to quantize.also or set it to null")


STAGE = Stage(
    name="predict", version=VERSION, config=PredictSection, result=PredictionStats,
    reads=("trace",), needs=frozenset({"model", "calibration"}),
    enabled=lambda recipe: bool(recipe.predict.predictors),
    run=_run,
    section="predict", check=check,
)
