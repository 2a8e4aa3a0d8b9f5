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

Each loss is one work unit (``prep/executor.py``), ``evaluate_candidate``, named after its candidate
(``bound-int4``, ``k-37``, ``chosen``) and writing ``<name>.json``; the driver only searches. The bounds are one
map (independent units side by side); each search round is one map, since a round's candidates depend on
the previous round's losses. ``fanout`` candidates per round make the bisection a (fanout+1)-ary search
(1: plain bisection; more: fewer rounds on a cluster, the same K for a loss monotone in K). A killed run
resumes with the evaluations already written; the held-out tokens go to ``sequences.safetensors`` in the
work directory for the units to read (removed at the end).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loader.io import write_json_atomic
from loader.vocab import PRECISIONS
from prep.errors import MoeprepError
from prep.executor import Unit
from prep.methods.decoded import (
    DecodedExperts,
    load_sequences,
    mean_kl,
    next_token_logprobs,
    original_experts,
    save_sequences,
)
from prep.report import BITWIDTH_PLOT, study_section
from prep.stages import Stage, StageResult
from prep.stages.quantize import PackedExperts

VERSION = 3  # 2: every loss is a unit computed with one torch thread: the losses change in the 6th digit or so;
# 3: the sensitivity stage's wall seconds are no longer copied into the result (they reached report.json, so a Ray
# run's artifact differed from a local run's)
METRIC = "mean next-token KL(source || configuration), nats, held-out calibration sequences"


BITWIDTH_METHODS = ("uniform", "edgemoe", "frequency", "random")


@dataclass(frozen=True)
class BitwidthSection:
    """How each expert's precision is chosen (the plan's per-expert map).

    ``uniform``: every expert at ``quantize.precision``. ``edgemoe``: bounds from uniform precisions, then
    bisection on K, the number of least sensitive experts moved down, under ``tolerance`` (mean KL in nats
    against the source model on held-out calibration tokens); ``fanout`` candidate Ks per search round (1:
    bisection; more: a wider search in fewer rounds, for a cluster to evaluate side by side). ``frequency``
    (CORM): per layer the least used ``share`` of experts (calibration routing counts) at ``low``. ``random``:
    ``share`` of all experts, drawn with ``seed``, at ``low`` (the control that shows whether a ranking matters).
    """

    method: str = "uniform"
    tolerance: float = 0.05
    share: float = 0.25
    low: str = "int2"
    seed: int = 0
    num_sequences: int | None = 8  # calibration sequences the tolerance is measured on (None: all)
    fanout: int = 1  # edgemoe: candidate Ks evaluated per search round

    def __post_init__(self) -> None:
        if self.low not in PRECISIONS:
            raise MoeprepError(f"bitwidth.low: precision {self.low!r} unknown; use one of {PRECISIONS}")
        if self.method not in BITWIDTH_METHODS:
            raise MoeprepError(f"bitwidth.method {self.method!r} unknown; use one of {BITWIDTH_METHODS}")
        if not 0 <= self.share <= 1 or not self.tolerance >= 0:
            raise MoeprepError("bitwidth.share must be in [0, 1] and bitwidth.tolerance >= 0")
        if self.num_sequences is not None and self.num_sequences <= 0:
            raise MoeprepError("bitwidth.num_sequences must be positive (or null for all)")
        if isinstance(self.fanout, bool) or not isinstance(self.fanout, int) or self.fanout < 1:
            raise MoeprepError(f"bitwidth.fanout must be a whole number >= 1 (1: bisection), got {self.fanout!r}")


@dataclass(frozen=True)
class BitwidthChoice(StageResult):
    method: str
    knobs: dict
    expert_precision: list  # [L][E] precision names
    counts: dict  # precision -> number of experts
    expert_bytes: int  # bytes of one record per expert at its precision
    details: dict  # metric, loss, and the method's own figures (edgemoe: bounds, b_hi, b_lo, K, trail)

    # the shipped mix is the package stage's own entry (``bitwidth``, also for a uniform artifact); the study shows here
    REPORT_SECTIONS = (study_section("bitwidth_study", 20, BITWIDTH_PLOT, "accuracy delta against expert bytes"),)


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


# evaluate(candidates {name: [L][E] grid}, desc) -> {name: loss}: one map of units (or any function, in tests)
Evaluate = Callable[[dict, str], dict]


def _inside(lo: int, hi: int, parts: int) -> list[int]:
    """The integers that cut the open interval (lo, hi) into ``parts`` near-equal parts (fewer when it is short)."""
    return sorted({lo + i * (hi - lo) // parts for i in range(1, parts)} - {lo, hi})


def _round(good: int, bad: int, fanout: int, guess: int | None) -> list[int]:
    """One search round's candidate Ks, strictly between ``good`` and ``bad``: with ``guess`` (the first round),
    the guess and the rest split around it; else ``fanout`` points splitting the interval evenly (fanout 1: the
    midpoint, so the search is EdgeMoE's bisection)."""
    if guess is None:
        return _inside(good, bad, fanout + 1)
    left = (fanout - 1) // 2
    return sorted({*_inside(good, guess, left + 1), guess, *_inside(guess, bad, fanout - left)})


def edgemoe_search(evaluate: Evaluate, order: list[int], precisions: list[str], tolerance: float, num_layers: int,
                   num_experts: int, fanout: int = 1) -> tuple[list[list[str]], dict]:
    """EdgeMoE's bounds and the search on K. ``precisions`` highest first. The bounds are one call of
    ``evaluate`` (units ``bound-<precision>``), each search round another (units ``k-<K>``): the largest K
    found within the tolerance, keeping loss(good) <= tolerance < loss(bad) after every round."""
    bounds = evaluate({f"bound-{p}": _uniform(num_layers, num_experts, p) for p in precisions}, "bitwidth bounds")
    bounds = {p: bounds[f"bound-{p}"] for p in precisions}
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
    guess = min(max(k, 1), n - 1)  # the first round starts at the linear interpolation of the bounds
    rounds = 0
    while bad[0] - good[0] > 1:
        ks = _round(good[0], bad[0], fanout, guess)
        rounds, guess = rounds + 1, None
        losses = evaluate({f"k-{k}": _moved_down(order, k, num_experts, hi, lo, num_layers) for k in ks},
                          f"bitwidth search {rounds}")
        found = [(k, losses[f"k-{k}"]) for k in ks]
        details["trail"] += [[k, value] for k, value in found]
        bad = min((f for f in found if f[1] > tolerance), default=bad)
        good = max((f for f in found if f[1] <= tolerance and f[0] < bad[0]), default=good)
    grid = _moved_down(order, good[0], num_experts, hi, lo, num_layers)
    return grid, details | {"b_hi": hi, "b_lo": lo, "K": good[0], "loss": good[1], "met": True}


def uniform_choice(packed) -> BitwidthChoice:
    """``bitwidth: uniform`` (the stage is switched off): every expert at ``quantize.precision``."""
    grid = _uniform(len(packed.layers), packed.num_experts, packed.precision)
    return BitwidthChoice(method="uniform", knobs={}, expert_precision=grid,
                          counts={packed.precision: len(packed.layers) * packed.num_experts},
                          expert_bytes=packed.stores[packed.precision]["record_bytes"] * len(packed.layers)
                          * packed.num_experts, details={})


def choose_bitwidths(packed, sensitivity, trace, cfg: BitwidthSection, evaluate: Evaluate, sequences: int
                     ) -> BitwidthChoice:
    """The precision map of ``cfg.method``, with its loss on the ``sequences`` held-out sequences measured by
    ``evaluate`` (the stage: one unit per candidate, ``evaluate_candidate``)."""
    num_layers, num_experts = len(packed.layers), packed.num_experts
    base = packed.precision
    knobs: dict = {}
    if cfg.method == "edgemoe":  # fanout recorded only where it is not the plain bisection
        knobs = {"tolerance": cfg.tolerance} | ({"fanout": cfg.fanout} if cfg.fanout != 1 else {})
    elif cfg.method in ("frequency", "random"):
        knobs = {"share": cfg.share, "low": cfg.low} | ({"seed": cfg.seed} if cfg.method == "random" else {})
    details: dict = {"metric": METRIC, "sequences": sequences}
    if cfg.method == "edgemoe":
        order = flat_order(sensitivity["ranking"])
        precisions = [p for p in PRECISIONS if p in packed.stores]
        grid, found = edgemoe_search(evaluate, order, precisions, cfg.tolerance, num_layers, num_experts,
                                     cfg.fanout)
        details |= found | {"ranking": sensitivity["method"], "sensitivity": {
            k: sensitivity[k] for k in ("method", "precision", "sequences", "spearman")}}  # no timing: one key, one result
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
        details["loss"] = evaluate({"chosen": grid}, "bitwidth loss")["chosen"]
    counts: dict[str, int] = {}
    for row in grid:
        for p in row:
            counts[p] = counts.get(p, 0) + 1
    expert_bytes = sum(packed.stores[p]["record_bytes"] * n for p, n in counts.items())
    return BitwidthChoice(method=cfg.method, knobs=knobs, expert_precision=grid, counts=counts,
                          expert_bytes=expert_bytes, details=details)


SEQUENCES = "sequences.safetensors"  # the held-out tokens, for the units to read (removed at the end)


def evaluate_candidate(context, out: Path, *, grid: list, quantize_dir: str, packed: dict, sequences: str,
                       source: str) -> None:
    """One unit: the loss of configuration ``grid`` ([L][E] precision names), the mean next-token KL of the
    model with its experts decoded at those precisions against the source model on the held-out tokens in
    ``sequences``, written to ``out`` as {"loss": ...}. The source model's log-probabilities are computed once
    per process and kept in ``UnitContext.cache`` under the model (``source``: its fingerprint; the device) and
    the tokens' digest, so another model or other tokens never reuse them; they are the same bytes whichever
    unit computed them (one thread in every unit), so the cache changes no loss."""
    model, adapter = context.model, context.adapter
    decoded = DecodedExperts(Path(quantize_dir), PackedExperts.from_json(packed))
    held, digest = load_sequences(sequences)
    state = context.cache(f"bitwidth reference {source} {context.paths.device} {digest}")
    with original_experts(model, adapter):
        if "reference" not in state:
            state["reference"] = next_token_logprobs(model, held)
        decoded.apply(model, adapter, lambda pos, e: grid[pos][e])
        loss = mean_kl(state["reference"], model, held)
    write_json_atomic(out, {"loss": loss})


def _run(inputs) -> BitwidthChoice:
    """Write the held-out tokens for the units, search in the driver, evaluate every candidate as a unit."""
    cfg, work = inputs.config, Path(inputs.work)
    quantize_dir, packed = inputs.upstream("quantize")
    _, trace = inputs.upstream("trace")
    sensitivity = inputs.upstream("sensitivity")[1].to_json() if cfg.method == "edgemoe" else None
    held = held_out(inputs.sequences, cfg.num_sequences)
    tokens = work / SEQUENCES
    save_sequences(tokens, held)
    shared = {"quantize_dir": str(Path(quantize_dir).resolve()), "packed": packed.to_json(),
              "sequences": str(tokens.resolve()), "source": inputs.model_fingerprint}

    def evaluate(candidates: dict, desc: str) -> dict:
        units = [Unit(name=name, output=f"{name}.json", fn=evaluate_candidate, args={"grid": grid, **shared})
                 for name, grid in candidates.items()]
        inputs.map_units(units, desc=desc)
        return {u.name: json.loads((work / u.output).read_text())["loss"] for u in units}

    choice = choose_bitwidths(packed, sensitivity, trace, cfg, evaluate, len(held))
    tokens.unlink(missing_ok=True)
    return choice


def bound_units(recipe) -> int:
    """For ``--dry-run``: the units whose count the recipe fixes. ``edgemoe``: the bounds, one per quantized
    precision (the search's rounds come on top, ``fanout`` units each, as many as the search needs);
    ``frequency`` and ``random``: the one loss."""
    if recipe.bitwidth.method == "edgemoe":
        return sum(p in recipe.quantize.precisions for p in PRECISIONS)
    return 1


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
    units=lambda recipe, num_layers: bound_units(recipe),
    units_per_round=lambda recipe: recipe.bitwidth.method == "edgemoe",  # the bounds, then a map per round
    section="bitwidth", check=check,
)
