"""Stage ``dynamic_precision``: HOBBIT's thresholds (HOBBIT section 3.2) for the plan's miss policy.

Runs when ``dynamic_precision.enabled``. Reads the calibration routing (trace stage): t1 and t2 are the
recipe's, or the quantiles of the unimportance score that give ``high_share`` of the selections at the
planned precision and ``skip_share`` skipped (``prep.methods.routing_stats.split_thresholds``). The split those
thresholds give on the calibration routing is reported. No model run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loader.plan import PolicySpec
from loader.vocab import PRECISIONS
from prep.errors import MoeprepError
from prep.methods.routing_stats import precision_split, split_thresholds
from prep.methods.trace import open_trace
from prep.stages import Stage, StageResult
from prep.stages.trace import RoutingTraces

VERSION = 2  # 2: no low pool (its share is gone from the result)


@dataclass(frozen=True)
class DynamicPrecisionSection:
    """HOBBIT's dynamic precision: a missed expert whose unimportance (the summed normalized weight of its
    token's more important experts) is at most t1 is read at its planned precision, at most t2 at ``low``,
    above t2 skipped. t1 and t2 come from quantiles of the calibration routing that give ``high_share`` high
    and ``skip_share`` skipped selections, unless given. ``strict``: a cached low copy does not satisfy a
    high want; ``renormalize``: rescale a token's remaining weights after a skip. The low copies have no pool
    of their own: a low copy takes a slot of the main pool (``loader.cache.host_pool``), so the plan runs at
    every budget the plan without dynamic precision does. ``low_share`` (the share of a low pool) is gone with
    that pool: a recipe that sets it is refused with the fix."""

    enabled: bool = False
    low: str = "int2"
    high_share: float = 0.67
    skip_share: float = 0.03
    t1: float | None = None
    t2: float | None = None
    strict: bool = True
    renormalize: bool = False
    low_share: float | None = None  # no longer used (see above); kept so a recipe setting it gets the fix

    def __post_init__(self) -> None:
        if self.low not in PRECISIONS:
            raise MoeprepError(f"dynamic_precision.low: precision {self.low!r} unknown; use one of {PRECISIONS}")
        if not (0 <= self.skip_share <= 1 and 0 <= self.high_share <= 1 - self.skip_share):
            raise MoeprepError(f"dynamic_precision needs 0 <= skip_share <= 1 and 0 <= high_share <= 1 - skip_share, "
                               f"got high_share {self.high_share}, skip_share {self.skip_share}")
        if (self.t1 is None) != (self.t2 is None):
            raise MoeprepError("dynamic_precision: give both t1 and t2, or neither (then the shares set them)")
        if self.t1 is not None and not 0 <= self.t1 <= self.t2 <= 1:
            raise MoeprepError(f"dynamic_precision needs 0 <= t1 <= t2 <= 1, got t1 {self.t1}, t2 {self.t2}")
        if self.low_share is not None:
            raise MoeprepError("dynamic_precision.low_share is no longer used: a low copy is held in a slot of the "
                               "main pool, so there is no low pool to give a share; remove the key from the recipe")


@dataclass(frozen=True)
class PrecisionThresholds(StageResult):
    t1: float
    t2: float
    split: dict  # {high, low, skip, selections} on the calibration routing
    knobs: dict  # the plan's dynamic_precision params

    def apply(self, plan, context):
        """HOBBIT's miss policy; the pools stay as they are (a low copy is lodged in a main-pool slot)."""
        return dataclasses.replace(plan, miss=PolicySpec("dynamic_precision", self.knobs))

    def report(self, entries: dict) -> dict:
        """report.json's ``dynamic_precision``: the stage's figures."""
        return entries | {"dynamic_precision": self.to_json()}

    REPORT_OFF = {"dynamic_precision": None}


def choose_thresholds(trace_dir, cfg: DynamicPrecisionSection) -> PrecisionThresholds:

    weights = torch.cat([r.expert_weights.reshape(-1, r.top_k) for r in open_trace(trace_dir).routing()])
    t1, t2 = (cfg.t1, cfg.t2) if cfg.t1 is not None else split_thresholds(weights, cfg.high_share, cfg.skip_share)
    return PrecisionThresholds(t1=t1, t2=t2, split=precision_split(weights, t1, t2),
                               knobs={"t1": t1, "t2": t2, "low": cfg.low, "strict": cfg.strict,
                                      "renormalize": cfg.renormalize})


def _run(inputs) -> PrecisionThresholds:

    trace_dir, _ = inputs.upstream("trace")
    return choose_thresholds(RoutingTraces.path(trace_dir), inputs.config)


def check(recipe) -> None:
    """The low copies must be a precision the quantize stage writes."""
    d, precisions = recipe.dynamic_precision, recipe.quantize.precisions
    if d.enabled and d.low not in precisions:
        raise MoeprepError(f"dynamic_precision.low is {d.low}, which the quantize stage does not write; add it to "
                           f"quantize.also (now {list(precisions[1:])})")


STAGE = Stage(
    name="dynamic_precision", version=VERSION, config=DynamicPrecisionSection, result=PrecisionThresholds,
    reads=("trace",), enabled=lambda recipe: recipe.dynamic_precision.enabled, run=_run,
    section="dynamic_precision", check=check,
)
