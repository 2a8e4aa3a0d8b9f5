"""Stage ``dynamic_precision``: HOBBIT's thresholds (paper 3.2, digest H1) for the plan's miss policy.

Runs when ``dynamic_precision.enabled``. Reads the calibration routing (trace stage): t1 and t2 are the
recipe's, or the quantiles of the unimportance score that give ``high_share`` of the selections at the
planned precision and ``skip_share`` skipped (``prep.methods.routing_stats.split_thresholds``). The split those
thresholds give on the calibration routing is reported. No model run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loader.plan import PolicySpec, Pool
from prep.methods.routing_stats import precision_split, split_thresholds
from prep.recipe import DynamicPrecisionSection
from prep.stages import Stage, StageResult

VERSION = 1


@dataclass(frozen=True)
class PrecisionThresholds(StageResult):
    t1: float
    t2: float
    split: dict  # {high, low, skip, selections} on the calibration routing
    knobs: dict  # the plan's dynamic_precision params
    low_share: float

    def apply(self, plan, context):
        """HOBBIT's miss policy, with a pool of its own for the low copies (when no pool holds that precision)."""
        low, pools = self.knobs["low"], plan.pools
        if low not in {p.precision for p in pools}:
            pools = tuple(dataclasses.replace(p, share=p.share * (1 - self.low_share)) for p in pools) + (
                Pool("low", low, self.low_share),)
        return dataclasses.replace(plan, pools=pools, miss=PolicySpec("dynamic_precision", self.knobs))


def choose_thresholds(trace_dir, cfg: DynamicPrecisionSection) -> PrecisionThresholds:
    from prep.methods.trace import open_trace

    weights = torch.cat([r.expert_weights.reshape(-1, r.top_k) for r in open_trace(trace_dir).routing()])
    t1, t2 = (cfg.t1, cfg.t2) if cfg.t1 is not None else split_thresholds(weights, cfg.high_share, cfg.skip_share)
    return PrecisionThresholds(t1=t1, t2=t2, split=precision_split(weights, t1, t2), low_share=cfg.low_share,
                               knobs={"t1": t1, "t2": t2, "low": cfg.low, "strict": cfg.strict,
                                      "renormalize": cfg.renormalize})


def _run(inputs) -> PrecisionThresholds:
    from prep.stages.trace import RoutingTraces

    trace_dir, _ = inputs.upstream("trace")
    return choose_thresholds(RoutingTraces.path(trace_dir), inputs.config)


STAGE = Stage(
    name="dynamic_precision", version=VERSION, config=DynamicPrecisionSection, result=PrecisionThresholds,
    reads=("trace",), enabled=lambda recipe: recipe.dynamic_precision.enabled, run=_run,
)
