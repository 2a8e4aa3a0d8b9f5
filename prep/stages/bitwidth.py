"""Stage ``bitwidth``: which precision each expert ships at (the plan's ``expert_precision`` map).

Methods (``recipe.bitwidth.method``):

- ``uniform``: every expert at ``quantize.precision``; this stage is switched off and package uses
  ``uniform_choice`` (no model run, and the trace keys nothing of the artifact).
- ``edgemoe`` (EdgeMoE section 3.2; the paper leaves the loss measure and the K search open, our choices
  follow): the loss of a configuration is the mean KL of next-token distributions against the source model
  on held-out calibration sequences (the *last* ``num_sequences``; the sensitivity sweep uses the first
  ones). Bounds: the loss of every expert at each quantized precision; b_hi is the lowest precision whose
  loss stays within ``tolerance``, b_lo the next lower one. Then the K least sensitive experts (the
  sensitivity stage's order) move down to b_lo: K starts from the linear interpolation of the two bounds
  and is bisected to the largest K whose loss stays within the tolerance. Every (K, loss) evaluated is kept
  in ``details.trail``.
- ``frequency`` (CORM): per layer, the ``share`` of experts least used in the calibration routing
  (trace stage) at ``low``, the others at ``quantize.precision``.
- ``random``: ``share`` of all experts, drawn with ``seed``, at ``low``: the control for a ranking.

Every other method also reports the final configuration's loss (``details.loss``) on the held-out sequences,
so rows of different methods compare.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tqdm import tqdm

from loader.vocab import PRECISIONS
from prep.errors import MoeprepError
from prep.methods.decoded import DecodedExperts, mean_kl, next_token_logprobs, original_experts
from prep.stages import Stage, StageResult

VERSION = 1
METRIC = "mean next-token KL(source || configuration), nats, held-out calibration sequences"


BITWIDTH_METHODS = ("uniform", "edgemoe", "frequency", "random")


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

    def __post_init__(self) -> None:
        if self.low not in PRECISIONS:
            raise MoeprepError(f"bitwidth.low: precision {self.low!r} unknown; use one of {PRECISIONS}")
        if self.method not in BITWIDTH_METHODS:
            raise MoeprepError(f"bitwidth.method {self.method!r} unknown; use one of {BITWIDTH_METHODS}")
        if not 0 <= self.share <= 1 or not self.tolerance >= 0:
            raise MoeprepError("bitwidth.share must be in [0, 1] and bitwidth.tolerance >= 0")
        if self.num_sequences is not None and self.num_sequences <= 0:
            raise MoeprepError("bitwidth.num_sequences must be positive (or null for all)")


@dataclass(frozen=True)
class BitwidthChoice(StageResult):
    method: str
    knobs: dict
    expert_precision: list  # [L][E] precision names
    counts: dict  # precision -> number of experts
    expert_bytes: int  # bytes of one record per expert at its precision
    details: dict  # metric, loss, and the method's own figures (edgemoe: bounds, b_hi, b_lo, K, trail)


def held_out(sequences: list, n: int | None) -> list:
    """The last ``n`` calibration sequences (all when ``n`` is None)."""
    return list(sequences if n is None else sequences[-n:])


def _uniform(num_layers: int, num_experts: int, precision: str) -> list[list[str]]:
    return [[precision] * num_experts for _ in range(num_layers)]


def _moved_down(order: list[int], k: int, num_experts: int, hi: str, lo: str, num_layers: int) -> list[list[str]]:
    """``order`` (flat indices l * E + e, least sensitive first): the first ``k`` at ``lo``, the rest at ``hi``."""
    grid = _uniform(num_layers, num_experts, hi)
    for flat in order[:k]:
        grid[flat // num_experts][flat % num_experts] = lo
    return grid


def flat_order(scores: list[list[float]]) -> list[int]:
    """Flat expert indices l * E + e by ascending score (ties by index, so the order is deterministic)."""
    num_experts = len(scores[0])
    flat = [(v, i * num_experts + e) for i, row in enumerate(scores) for e, v in enumerate(row)]
    return [i for _v, i in sorted(flat)]


def edgemoe_search(loss, order: list[int], precisions: list[str], tolerance: float, num_layers: int,
                   num_experts: int) -> tuple[list[list[str]], dict]:
    """EdgeMoE's bounds and bisection on K. ``loss(grid) -> float``; ``precisions`` highest first."""
    bounds: dict[str, float] = {}
    for p in tqdm(precisions, desc="bitwidth bounds", unit="precision", leave=False):
        bounds[p] = loss(_uniform(num_layers, num_experts, p))
    passing = [p for p in precisions if bounds[p] <= tolerance]
    details = {"bounds": bounds, "tolerance": tolerance, "trail": []}
    if not passing:  # even the highest quantized precision misses: ship it, and say so
        hi = precisions[0]
        return _uniform(num_layers, num_experts, hi), details | {"b_hi": hi, "b_lo": None, "K": 0,
                                                                  "loss": bounds[hi], "met": False}
    hi = passing[-1]
    below = precisions[precisions.index(hi) + 1:]
    if not below:  # the lowest precision meets the tolerance
        return _uniform(num_layers, num_experts, hi), details | {"b_hi": hi, "b_lo": None, "K": 0,
                                                                  "loss": bounds[hi], "met": True}
    lo = below[0]
    n = len(order)
    good, bad = (0, bounds[hi]), (n, bounds[lo])  # loss(0) <= P < loss(n)
    k = round(n * (tolerance - bounds[hi]) / (bounds[lo] - bounds[hi])) if bounds[lo] > bounds[hi] else 0
    k = min(max(k, 1), n - 1)
    with tqdm(desc="bitwidth search", unit="eval", leave=False) as bar:
        while bad[0] - good[0] > 1:
            value = loss(_moved_down(order, k, num_experts, hi, lo, num_layers))
            details["trail"].append([k, value])
            bar.update(1)
            if value <= tolerance:
                good = (k, value)
            else:
                bad = (k, value)
            k = (good[0] + bad[0]) // 2
    grid = _moved_down(order, good[0], num_experts, hi, lo, num_layers)
    return grid, details | {"b_hi": hi, "b_lo": lo, "K": good[0], "loss": good[1], "met": True}


def uniform_choice(packed) -> BitwidthChoice:
    """``bitwidth: uniform`` (the stage is switched off): every expert at ``quantize.precision``."""
    grid = _uniform(len(packed.layers), packed.num_experts, packed.precision)
    return BitwidthChoice(method="uniform", knobs={}, expert_precision=grid,
                          counts={packed.precision: len(packed.layers) * packed.num_experts},
                          expert_bytes=packed.stores[packed.precision]["record_bytes"] * len(packed.layers)
                          * packed.num_experts, details={})


def choose_bitwidths(model, adapter, sequences, quantize_dir, packed, sensitivity, trace, cfg: BitwidthSection
                     ) -> BitwidthChoice:
    """The precision map of ``cfg.method``, with its loss measured on the held-out sequences."""
    num_layers, num_experts = len(packed.layers), packed.num_experts
    base = packed.precision
    knobs: dict = {"tolerance": cfg.tolerance} if cfg.method == "edgemoe" else (
        {"share": cfg.share, "low": cfg.low} | ({"seed": cfg.seed} if cfg.method == "random" else {})
        if cfg.method in ("frequency", "random") else {})
    decoded = DecodedExperts(quantize_dir, packed)
    held = held_out(sequences, cfg.num_sequences)
    details: dict = {"metric": METRIC, "sequences": len(held)}
    with original_experts(model, adapter):
        reference = next_token_logprobs(model, held)

        def loss(grid: list[list[str]]) -> float:
            decoded.apply(model, adapter, lambda pos, e: grid[pos][e])
            return mean_kl(reference, model, held)

        if cfg.method == "edgemoe":
            order = flat_order(sensitivity["ranking"])
            precisions = [p for p in PRECISIONS if p in packed.stores]
            grid, found = edgemoe_search(loss, order, precisions, cfg.tolerance, num_layers, num_experts)
            details |= found | {"ranking": sensitivity["method"], "sensitivity": {
                k: sensitivity[k] for k in ("method", "precision", "sequences", "spearman", "seconds")}}
        elif cfg.method == "frequency":
            grid = _uniform(num_layers, num_experts, base)
            moved = round(cfg.share * num_experts)
            for pos, shares in enumerate(trace.expert_share):
                for e in sorted(range(num_experts), key=lambda e: (shares[e], e))[:moved]:
                    grid[pos][e] = cfg.low
            details["per_layer"] = moved
        elif cfg.method == "random":
            flat = list(range(num_layers * num_experts))
            random.Random(cfg.seed).shuffle(flat)
            grid = _moved_down(flat, round(cfg.share * len(flat)), num_experts, base, cfg.low, num_layers)
        else:  # the recipe validates the method; a new one must be added here
            raise MoeprepError(f"bitwidth.method {cfg.method!r} has no implementation")
        if "loss" not in details:
            details["loss"] = loss(grid)
    counts: dict[str, int] = {}
    for row in grid:
        for p in row:
            counts[p] = counts.get(p, 0) + 1
    expert_bytes = sum(packed.stores[p]["record_bytes"] * n for p, n in counts.items())
    return BitwidthChoice(method=cfg.method, knobs=knobs, expert_precision=grid, counts=counts,
                          expert_bytes=expert_bytes, details=details)


def _run(inputs) -> BitwidthChoice:
    quantize_dir, packed = inputs.upstream("quantize")
    _, trace = inputs.upstream("trace")
    sensitivity = inputs.upstream("sensitivity")[1].to_json() if inputs.config.method == "edgemoe" else None
    return choose_bitwidths(inputs.model, inputs.adapter, inputs.sequences, quantize_dir, packed, sensitivity,
                            trace, inputs.config)


def check(recipe) -> None:
    """The low precision (and EdgeMoE's sweep precision) must be one the quantize stage writes."""
    q, b = recipe.quantize, recipe.bitwidth
    if b.method != "uniform" and b.low not in q.precisions:
        raise MoeprepError(f"bitwidth.low is {b.low}, which the quantize stage does not write; add it to "
                           f"quantize.also (now {list(q.also)})")
    if b.method == "edgemoe" and recipe.sensitivity.precision not in q.precisions:
        raise MoeprepError(f"sensitivity.precision is {recipe.sensitivity.precision}, which the quantize stage "
                           f"does not write; add it to quantize.also (now {list(q.also)})")


STAGE = Stage(
    name="bitwidth", version=VERSION, config=BitwidthSection, result=BitwidthChoice,
    reads=("trace", "quantize", "sensitivity"), needs=frozenset({"model", "calibration"}),
    run=_run,
    enabled=lambda recipe: recipe.bitwidth.method != "uniform",  # uniform needs no search: package does it
    section="bitwidth", check=check,
)
