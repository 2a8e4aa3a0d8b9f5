"""Strict recipes: a YAML file maps one-to-one onto frozen dataclasses; an unknown key is an error.

A recipe names the model, the calibration data and one section per pipeline stage. ``load_recipe``
reads the YAML, applies ``--set section.key=value`` overrides, checks every key and type, and returns a
``Recipe``. ``Recipe.to_dict()`` is the resolved recipe; each stage records the sections it derives from.

YAML is read with a bounded loader: aliases may not expand the document past ``MAX_YAML_NODES`` nodes
(a "billion laughs" recipe is refused at once instead of filling memory), and recursive aliases are
refused. A recipe ``name`` names a directory (``artifacts/<name>/``), so it is one plain path component.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from prep.calibration import SOURCES, CalibrationSection  # noqa: F401 (CalibrationSection: a Recipe section)
from prep.errors import MoeprepError

PRECISIONS = ("passthrough", "int8", "int4", "int3", "int2")  # highest first
SENSITIVITY_METHODS = ("sweep", "prerank")
BITWIDTH_METHODS = ("uniform", "edgemoe", "frequency", "random")
PREDICTOR_NAMES = ("next_gates", "path_stats", "first_gate")  # loader.predict.PREDICTORS
FIRST_GATE_INITS = ("zeros", "router")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_YAML_NODES = 10_000  # a recipe has well under a hundred; aliases may not expand past this


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents whose aliases expand past ``MAX_YAML_NODES`` nodes, or loop."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node, sizes: dict, active: set) -> int:
    """Nodes in ``node`` with every alias expanded (each shared node counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in active:
        raise MoeprepError("the recipe YAML has a recursive alias (an anchor used inside itself); remove it")
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, active)
        if size > MAX_YAML_NODES:
            raise MoeprepError(f"the recipe YAML expands to more than {MAX_YAML_NODES:,} values through its "
                               "aliases (&anchor / *alias), far more than a recipe needs; write it out plainly")
    active.discard(id(node))
    sizes[id(node)] = size
    return size


def _load_yaml(text: str, what: str):
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise MoeprepError(f"{what} is not valid YAML: {e}") from None
    except RecursionError:
        raise MoeprepError(f"{what} nests too deeply to be a recipe") from None


@dataclass(frozen=True)
class ModelSection:
    """Where the source model comes from: ``path``, a local directory (relative to the repo root), else the
    Hugging Face hub cache's snapshot of ``hub_id`` at ``revision``. ``config``: the model's config.json as
    shipped beside a real-model recipe (public facts; ``moeprep inspect-model`` reads it without weights)."""

    path: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    config: str | None = None


@dataclass(frozen=True)
class TraceSection:
    """``batch``: calibration sequences per forward. With the model streamed a layer at a time (a model
    bigger than ``--expert-memory``), one batch of all sequences reads every layer once; 1 reads it once
    per sequence. Batching changes float rounding, so it is part of the key."""

    hidden_dtype: str = "float16"
    shard_tokens: int = 4096
    batch: int = 1


@dataclass(frozen=True)
class QuantizeSection:
    """Expert precisions: ``passthrough`` keeps the source dtype; intN is HQQ with ``group_size`` weights per
    scale/zero and, with ``meta_group`` > 0, those scales and zeros themselves stored in 8 bits per
    ``meta_group`` groups (0: float16). None takes each precision's default (``loader.codec.DEFAULT_FORMATS``).
    ``precision`` is the base every expert is quantized at; ``also`` lists more precisions every expert is
    quantized at, for the ``sensitivity`` and ``bitwidth`` stages to choose from."""

    precision: str = "int4"
    group_size: int | None = None
    meta_group: int | None = None
    also: tuple[str, ...] = ()

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the stage writes, base first."""
        return tuple(dict.fromkeys((self.precision, *self.also)))

    def format_of(self, precision: str) -> tuple[int, int]:
        """(group_size, meta_group) of ``precision`` (0, 0 for passthrough)."""
        from loader.codec import DEFAULT_FORMATS

        if precision == "passthrough":
            return 0, 0
        group, meta = DEFAULT_FORMATS[precision]
        return (group if self.group_size is None else self.group_size,
                meta if self.meta_group is None else self.meta_group)


@dataclass(frozen=True)
class SensitivitySection:
    """EdgeMoE's expert importance profile: the damage of moving one expert alone to ``precision``.

    ``method``: ``sweep`` (mean KL of next-token distributions against the base configuration, layer-local
    re-evaluation, one run per expert) or ``prerank`` (trace-only output error, no forward pass; the fast path
    for thousands of experts). The pre-rank is always computed too, with its rank correlation to the sweep.
    """

    method: str = "sweep"
    precision: str = "int2"
    num_sequences: int | None = 8  # calibration sequences the sweep evaluates (None: all)


@dataclass(frozen=True)
class BitwidthSection:
    """How each expert's precision is chosen (the plan's per-expert map).

    ``uniform``: every expert at ``quantize.precision``. ``edgemoe``: bounds from uniform precisions, then
    bisection on K, the number of least sensitive experts moved down, under ``tolerance`` (mean KL in nats
    against the source model on held-out calibration tokens). ``frequency`` (CORM): per layer the least used
    ``share`` of experts (calibration routing counts) at ``low``. ``random``: ``share`` of all experts, drawn
    with ``seed``, at ``low`` (the control that shows whether a ranking matters).
    """

    method: str = "uniform"
    tolerance: float = 0.05
    share: float = 0.25
    low: str = "int2"
    seed: int = 0
    num_sequences: int | None = 8  # calibration sequences the tolerance is measured on (None: all)


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


@dataclass(frozen=True)
class GatingSection:
    """AdapMoE's adaptive gating: drop a token's second expert where (1 - alpha)^2 * S_l <= T, S_l the Fisher
    sensitivity over the first ``num_sequences`` calibration sequences. T comes from ``threshold``, else from
    ``target_single`` (the share of single-expert decisions on the calibration routing: T itself does not
    carry over between implementations); with ``tolerance`` (mean next-token KL, nats, on the last
    ``num_sequences`` sequences) T is lowered until the gated model is within it. ``decode_only`` leaves
    calls of several tokens exact."""

    enabled: bool = False
    target_single: float = 0.25
    threshold: float | None = None
    tolerance: float | None = None
    decode_only: bool = False
    num_sequences: int | None = 8


@dataclass(frozen=True)
class DynamicPrecisionSection:
    """HOBBIT's dynamic precision: a missed expert whose unimportance (the summed normalized weight of its
    token's more important experts) is at most t1 is read at its planned precision, at most t2 at ``low``,
    above t2 skipped. t1 and t2 come from quantiles of the calibration routing that give ``high_share`` high
    and ``skip_share`` skipped selections, unless given. ``strict``: a cached low copy does not satisfy a
    high want; ``renormalize``: rescale a token's remaining weights after a skip; ``low_share``: the share of
    the expert budget held by the pool of low copies."""

    enabled: bool = False
    low: str = "int2"
    high_share: float = 0.67
    skip_share: float = 0.03
    t1: float | None = None
    t2: float | None = None
    strict: bool = True
    renormalize: bool = False
    low_share: float = 0.25


@dataclass(frozen=True)
class CacheRoutingSection:
    """Cache-conditional routing (Skliar et al.): prefer resident experts where the router is nearly
    indifferent. ``method``: ``prior`` (``lam`` times the running logit range added to resident experts'
    logits), ``max_rank`` (cached experts within the top ``m`` move ahead) or ``threshold`` (m from the
    cumulative probability ``tau``); the ``top_j`` best experts always stay. With ``tolerance`` (mean
    next-token KL, nats, on the last ``num_sequences`` calibration sequences) the method's knob is lowered
    from the given value to the largest one within it, measured with a cache of ``cache_share`` of each
    layer's experts emulated from a cold start."""

    enabled: bool = False
    method: str = "prior"
    lam: float = 0.5
    m: int | None = None
    tau: float = 0.9
    top_j: int = 1
    tolerance: float | None = None
    cache_share: float = 0.5
    num_sequences: int | None = 8


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


ALLOCATION_COSTS = ("measured", "closed_form")


@dataclass(frozen=True)
class AllocateKnobs:
    """AdapMoE's DP over the cache cells (a per-layer pool's layer, or a global pool): ``measured`` cost
    curves from the simulator, or the paper's ``closed_form`` (uniform routing, one prefetch per layer)."""

    enabled: bool = False
    cost: str = "measured"


@dataclass(frozen=True)
class TuneKnobs:
    """HOBBIT's cache weights (w_lru, w_lfu, w_lhu, w_fld on the simplex), the pools' eviction group, the
    prefetch depth and (with dynamic precision and no allocation) the low pool's share, searched by Optuna
    over the simulator for ``trials`` trials (trial 0: HOBBIT's equal weights) at the budget holding
    ``share`` of the shipped experts."""

    enabled: bool = False
    trials: int = 24
    seed: int = 0
    share: float = 0.5


@dataclass(frozen=True)
class PlanSection:
    """Planning for a device: the stages ``tune_policy`` and ``allocate_cache``. ``device``: a device profile
    (``moeprep profile-device``) for modelled seconds (None: costs are bytes read on demand); ``points``:
    the operating points, each a budget holding that share of the shipped experts' bytes; ``tolerance``:
    the accuracy (points of score, per suite) an operating point may lose against the source model;
    ``num_sequences``: the calibration sequences replayed (None: all)."""

    device: str | None = None
    points: tuple[float, ...] = (0.25, 0.5, 0.75)
    tolerance: float | None = None
    num_sequences: int | None = None
    allocate: AllocateKnobs = field(default_factory=AllocateKnobs)
    tune: TuneKnobs = field(default_factory=TuneKnobs)


@dataclass(frozen=True)
class PackageSection:
    """Plan defaults written into the artifact: the share of each layer's experts to cache."""

    cache_fraction: float = 0.5


@dataclass(frozen=True)
class EvaluateSection:
    """The accuracy check as the last stage of prepare (``moeprep eval`` with these settings)."""

    enabled: bool = False
    suites: tuple[str, ...] = ("gsm8k", "mmlu", "truthfulqa")
    data: str | None = None  # default: suites/ beside the model
    limit: int | None = 20
    num_fewshot: int | None = None
    gsm8k_format: str = "cot"
    memory_budget: str | None = "50%"


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelSection
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    trace: TraceSection = field(default_factory=TraceSection)
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    sensitivity: SensitivitySection = field(default_factory=SensitivitySection)
    bitwidth: BitwidthSection = field(default_factory=BitwidthSection)
    predict: PredictSection = field(default_factory=PredictSection)
    gating: GatingSection = field(default_factory=GatingSection)
    dynamic_precision: DynamicPrecisionSection = field(default_factory=DynamicPrecisionSection)
    cache_routing: CacheRoutingSection = field(default_factory=CacheRoutingSection)
    neuron: NeuronSection = field(default_factory=NeuronSection)
    plan: PlanSection = field(default_factory=PlanSection)
    package: PackageSection = field(default_factory=PackageSection)
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))

    def model_path(self, root: Path) -> str:
        """The model as a path when it is a local directory relative to ``root`` or a hub-cache snapshot of
        ``model.hub_id``, else what the recipe names (the path, or the hub id)."""
        if self.model.path is not None:
            candidate = (root / self.model.path)
            return str(candidate) if candidate.exists() else self.model.path
        return hub_snapshot(self.model.hub_id, self.model.revision) or self.model.hub_id

    def missing_model_hint(self) -> str:
        """What to do when the model is not here: how to download it and where to point ``model.path``."""
        if self.model.hub_id is None:
            return "set model.path to the directory holding the model's config.json and *.safetensors"
        where = f"models/{self.name}"
        revision = f" --revision {self.model.revision}" if self.model.revision else ""
        return (f"download it with `hf download {self.model.hub_id}{revision} --local-dir {where}` (huggingface_hub's "
                f"CLI; or `huggingface-cli download`), then run `make prepare MODEL={self.name} MODEL_PATH={where}` "
                f"or pass `--set model.path={where}` (a copy in the hub cache is found without it)")


def hub_snapshot(hub_id: str, revision: str | None = None) -> str | None:
    """The local directory of ``hub_id``'s snapshot in the Hugging Face hub cache, None when it is not there.
    Never touches the network."""
    try:
        from huggingface_hub import snapshot_download

        cache = os.environ.get("HF_HUB_CACHE")  # read now, not at huggingface_hub's import
        path = Path(snapshot_download(hub_id, revision=revision, local_files_only=True, cache_dir=cache))
    except Exception:  # not cached, or no huggingface_hub: both mean "not here"
        return None
    return str(path) if (path / "config.json").is_file() and any(path.glob("*.safetensors")) else None


def _to_plain(value):
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def _parse_scalar(text: str):
    return _load_yaml(text, f"--set value {text!r}")


def _apply_override(data: dict, assignment: str) -> None:
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise MoeprepError(f"--set expects section.key=value, got {assignment!r}")
    dotted, value = assignment.split("=", 1)
    *path, key = dotted.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise MoeprepError(f"--set {assignment!r}: {part!r} is not a section")
    node[key] = _parse_scalar(value)


def _coerce(value, annotation, where: str):
    """Check ``value`` against a dataclass field's annotation (str/int/float/bool/None/tuple/dataclass)."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise MoeprepError(f"{where} must be a mapping of its keys, got {value!r}")
        return _build(annotation, value, where)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except MoeprepError:
                continue
        kinds = " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)
        raise MoeprepError(f"{where} must be {kinds}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MoeprepError(f"{where} must be a list, got {value!r}")
        (item_type, _ellipsis) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is bool and not isinstance(value, bool):
        raise MoeprepError(f"{where} must be true or false, got {value!r}")
    if annotation in (int, float) and isinstance(value, bool):
        raise MoeprepError(f"{where} must be a number, got {value!r}")
    if not isinstance(value, annotation):
        raise MoeprepError(f"{where} must be {annotation.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise MoeprepError(
            f"unknown key {', '.join(repr(u) for u in unknown)} in {where}; allowed keys: {', '.join(names)}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], f"{where}.{f.name}" if where else f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MoeprepError(f"missing key {f.name!r} in {where or 'the recipe'}")
    return cls(**kwargs)


def _validate(recipe: Recipe) -> None:

    if not NAME_PATTERN.fullmatch(recipe.name):
        raise MoeprepError(f"recipe name {recipe.name!r} is not allowed: it names the directory artifacts/<name>, "
                           "so use letters, digits, '.', '_' and '-', starting with a letter or digit "
                           "(no '/', no '..'); set name: in the recipe")
    if recipe.model.path is None and recipe.model.hub_id is None:
        raise MoeprepError("the recipe names no model: set model.path (a local directory) or model.hub_id")
    if recipe.trace.batch < 1:
        raise MoeprepError(f"trace.batch must be at least 1 (sequences per forward), got {recipe.trace.batch}")
    q, b = recipe.quantize, recipe.bitwidth
    for where, precision in [("quantize.precision", q.precision), *(("quantize.also", p) for p in q.also),
                             ("sensitivity.precision", recipe.sensitivity.precision), ("bitwidth.low", b.low)]:
        if precision not in PRECISIONS:
            raise MoeprepError(f"{where}: precision {precision!r} unknown; use one of {PRECISIONS}")
    if q.group_size is not None and q.group_size <= 0:
        raise MoeprepError("quantize.group_size must be positive (or left out for each precision's default)")
    if q.meta_group is not None and q.meta_group < 0:
        raise MoeprepError("quantize.meta_group must be 0 (float16 scales) or positive (or left out)")
    if recipe.sensitivity.method not in SENSITIVITY_METHODS:
        raise MoeprepError(f"sensitivity.method {recipe.sensitivity.method!r} unknown; use one of "
                           f"{SENSITIVITY_METHODS}")
    if b.method not in BITWIDTH_METHODS:
        raise MoeprepError(f"bitwidth.method {b.method!r} unknown; use one of {BITWIDTH_METHODS}")
    if b.method != "uniform" and b.low not in q.precisions:
        raise MoeprepError(f"bitwidth.low is {b.low}, which the quantize stage does not write; add it to "
                           f"quantize.also (now {list(q.also)})")
    if b.method == "edgemoe" and recipe.sensitivity.precision not in q.precisions:
        raise MoeprepError(f"sensitivity.precision is {recipe.sensitivity.precision}, which the quantize stage "
                           f"does not write; add it to quantize.also (now {list(q.also)})")
    if not 0 <= b.share <= 1 or not b.tolerance >= 0:
        raise MoeprepError("bitwidth.share must be in [0, 1] and bitwidth.tolerance >= 0")
    for where, n in (("sensitivity", recipe.sensitivity.num_sequences), ("bitwidth", b.num_sequences)):
        if n is not None and n <= 0:
            raise MoeprepError(f"{where}.num_sequences must be positive (or null for all)")
    _validate_predict(recipe.predict, q.precisions, recipe.calibration.num_sequences)
    _validate_less_per_token(recipe.gating, recipe.dynamic_precision, q.precisions)
    _validate_cache_routing(recipe.cache_routing, recipe.gating.enabled)
    _validate_neuron(recipe.neuron)
    _validate_plan(recipe.plan)
    if not 0 < recipe.package.cache_fraction <= 1:
        raise MoeprepError("package.cache_fraction must be in (0, 1]")
    if recipe.evaluate.gsm8k_format not in ("cot", "plain"):
        raise MoeprepError("evaluate.gsm8k_format must be cot or plain")
    unknown = sorted(set(recipe.evaluate.suites) - {"gsm8k", "mmlu", "truthfulqa"})
    if unknown:
        raise MoeprepError(f"evaluate.suites: unknown suite(s) {unknown}; use gsm8k, mmlu, truthfulqa")
    if recipe.trace.hidden_dtype not in ("float16", "bfloat16", "float32"):
        raise MoeprepError(f"trace.hidden_dtype {recipe.trace.hidden_dtype!r} unknown; use float16, bfloat16 or float32")
    if recipe.calibration.source not in SOURCES:
        raise MoeprepError(f"calibration.source {recipe.calibration.source!r} unknown; use {', '.join(SOURCES)}")
    if recipe.calibration.num_sequences <= 0 or recipe.calibration.sequence_length <= 1:
        raise MoeprepError("calibration needs num_sequences >= 1 and sequence_length >= 2")


def _validate_predict(p: PredictSection, precisions: tuple[str, ...], num_sequences: int) -> None:
    if unknown := [n for n in p.predictors if n not in PREDICTOR_NAMES]:
        raise MoeprepError(f"predict.predictors: unknown predictor(s) {unknown}; use any of {PREDICTOR_NAMES}")
    if len(set(p.predictors)) != len(p.predictors):
        raise MoeprepError(f"predict.predictors names a predictor twice: {list(p.predictors)}")
    if p.predictors and num_sequences < 2:
        raise MoeprepError("predict needs calibration.num_sequences >= 2: the last ones are held out to measure "
                           "the predictors' recall")
    if not 0 < p.held_out < 1:
        raise MoeprepError(f"predict.held_out is the share of calibration sequences held out, in (0, 1); got {p.held_out}")
    for where, n in (("predict.distances", p.distances), ("predict.next_gates.depth", p.next_gates.depth),
                     ("predict.path_stats.max_preload", p.path_stats.max_preload),
                     ("predict.path_stats.min_count", p.path_stats.min_count),
                     ("predict.next_gates.experts", p.next_gates.experts),
                     ("predict.first_gate.experts", p.first_gate.experts),
                     ("predict.first_gate.max_epochs", p.first_gate.max_epochs),
                     ("predict.first_gate.patience", p.first_gate.patience)):
        if n is not None and n < 1:
            raise MoeprepError(f"{where} must be at least 1, got {n}")
    if not 0 <= p.path_stats.floor <= 1:
        raise MoeprepError(f"predict.path_stats.floor is a probability in [0, 1], got {p.path_stats.floor}")
    if p.next_gates.precision is not None and p.next_gates.precision not in precisions:
        raise MoeprepError(f"predict.next_gates.precision is {p.next_gates.precision}, which the quantize stage does "
                           f"not write ({list(precisions)}); add it to quantize.also or set it to null")
    if p.first_gate.init not in FIRST_GATE_INITS:
        raise MoeprepError(f"predict.first_gate.init {p.first_gate.init!r} unknown; use one of {FIRST_GATE_INITS}")
    if not p.first_gate.lr > 0:
        raise MoeprepError(f"predict.first_gate.lr must be positive, got {p.first_gate.lr}")


def _validate_less_per_token(g: GatingSection, d: DynamicPrecisionSection, precisions: tuple[str, ...]) -> None:
    if not 0 <= g.target_single <= 1:
        raise MoeprepError(f"gating.target_single is a share of decisions in [0, 1], got {g.target_single}")
    if g.threshold is not None and g.threshold < 0:
        raise MoeprepError(f"gating.threshold must be >= 0 (or null to take it from target_single), got {g.threshold}")
    if g.tolerance is not None and g.tolerance < 0:
        raise MoeprepError(f"gating.tolerance must be >= 0 nats (or null), got {g.tolerance}")
    if g.num_sequences is not None and g.num_sequences <= 0:
        raise MoeprepError("gating.num_sequences must be positive (or null for all)")
    if d.low not in PRECISIONS:
        raise MoeprepError(f"dynamic_precision.low: precision {d.low!r} unknown; use one of {PRECISIONS}")
    if d.enabled and d.low not in precisions:
        raise MoeprepError(f"dynamic_precision.low is {d.low}, which the quantize stage does not write; add it to "
                           f"quantize.also (now {list(precisions[1:])})")
    if not (0 <= d.skip_share <= 1 and 0 <= d.high_share <= 1 - d.skip_share):
        raise MoeprepError(f"dynamic_precision needs 0 <= skip_share <= 1 and 0 <= high_share <= 1 - skip_share, got "
                           f"high_share {d.high_share}, skip_share {d.skip_share}")
    if (d.t1 is None) != (d.t2 is None):
        raise MoeprepError("dynamic_precision: give both t1 and t2, or neither (then the shares set them)")
    if d.t1 is not None and not 0 <= d.t1 <= d.t2 <= 1:
        raise MoeprepError(f"dynamic_precision needs 0 <= t1 <= t2 <= 1, got t1 {d.t1}, t2 {d.t2}")
    if not 0 < d.low_share < 1:
        raise MoeprepError(f"dynamic_precision.low_share is the budget share of the low pool, in (0, 1); got {d.low_share}")


def _validate_plan(p: PlanSection) -> None:
    if p.allocate.cost not in ALLOCATION_COSTS:
        raise MoeprepError(f"plan.allocate.cost {p.allocate.cost!r} unknown; use one of {ALLOCATION_COSTS}")
    if not p.points or any(not 0 < x <= 1 for x in p.points) or len(set(p.points)) != len(p.points):
        raise MoeprepError(f"plan.points are distinct shares of the shipped expert bytes in (0, 1], got {list(p.points)}")
    if not 0 < p.tune.share <= 1:
        raise MoeprepError(f"plan.tune.share is a share of the shipped expert bytes in (0, 1], got {p.tune.share}")
    if p.tune.trials < 1:
        raise MoeprepError(f"plan.tune.trials must be at least 1 (trial 0 is HOBBIT's equal weights), got {p.tune.trials}")
    if p.tolerance is not None and p.tolerance < 0:
        raise MoeprepError(f"plan.tolerance is points of accuracy a plan may lose, >= 0 (or null); got {p.tolerance}")
    if p.num_sequences is not None and p.num_sequences < 1:
        raise MoeprepError("plan.num_sequences must be positive (or null for all)")


def _validate_cache_routing(c: CacheRoutingSection, gating: bool) -> None:
    from loader.routing import CACHE_METHODS

    if c.method not in CACHE_METHODS:
        raise MoeprepError(f"cache_routing.method {c.method!r} unknown; use one of {CACHE_METHODS}")
    if c.lam < 0 or not 0 <= c.tau <= 1 or c.top_j < 0 or (c.m is not None and c.m < 1):
        raise MoeprepError("cache_routing needs lam >= 0, tau in [0, 1], top_j >= 0 and m >= 1 (or null)")
    if c.tolerance is not None and c.tolerance < 0:
        raise MoeprepError(f"cache_routing.tolerance must be >= 0 nats (or null), got {c.tolerance}")
    if not 0 < c.cache_share <= 1 or (c.num_sequences is not None and c.num_sequences <= 0):
        raise MoeprepError("cache_routing needs cache_share in (0, 1] and num_sequences positive (or null)")
    if c.enabled and gating:
        raise MoeprepError("gating and cache_routing both rewrite the routing and a plan runs one routing policy; "
                           "enable one of them")


def _validate_neuron(n: NeuronSection) -> None:
    from loader.neuron import COMPUTE

    if n.layout not in ("expert", "neuron"):
        raise MoeprepError(f"neuron.layout {n.layout!r} unknown; use expert or neuron")
    if n.enabled and n.layout != "neuron":
        raise MoeprepError("neuron.enabled needs the neuron record layout: set neuron.layout: neuron")
    if n.theta < 0 or any(t < 0 for t in n.thetas) or not n.thetas:
        raise MoeprepError("neuron.theta and neuron.thetas must be >= 0 (thetas: a non-empty list)")
    if n.tolerance is not None and n.tolerance < 0:
        raise MoeprepError(f"neuron.tolerance must be >= 0 nats (or null), got {n.tolerance}")
    if n.crossover is not None and not 0 <= n.crossover <= 1:
        raise MoeprepError(f"neuron.crossover is a share in [0, 1] (or null to measure it), got {n.crossover}")
    if n.compute not in COMPUTE:
        raise MoeprepError(f"neuron.compute must be one of {COMPUTE}, got {n.compute!r}")
    if n.num_sequences is not None and n.num_sequences <= 0:
        raise MoeprepError("neuron.num_sequences must be positive (or null for all)")


def recipe_from_dict(data: dict, overrides: tuple[str, ...] = ()) -> Recipe:
    """A validated Recipe from plain data plus ``section.key=value`` overrides."""
    data = _to_plain(data or {})
    for assignment in overrides:
        _apply_override(data, assignment)
    recipe = _build(Recipe, data, "")
    _validate(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: tuple[str, ...] = ()) -> Recipe:
    """Read a recipe YAML (see ``recipes/reference.yaml``) and apply overrides."""
    path = Path(path)
    if not path.is_file():
        available = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f"; recipes in {path.parent}: {', '.join(available)}" if available else ""
        raise MoeprepError(f"recipe {path} not found{hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoeprepError(f"cannot read recipe {path} ({e}); it must be a UTF-8 YAML file") from None
    data = _load_yaml(text, f"recipe {path}")
    if not isinstance(data, dict):
        raise MoeprepError(f"recipe {path} must be a mapping of sections")
    data.setdefault("name", path.stem)
    return recipe_from_dict(data, overrides)
