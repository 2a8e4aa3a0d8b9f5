"""Stage ``cache_routing``: the plan's cache-conditional routing (Skliar et al., digest CC1-CC4).

Runs when ``cache_routing.enabled``. The prior's boost is lambda times each layer's running logit range;
this stage measures that range on the calibration routing (trace stage: each token's max minus min router
logit, averaged per layer), and the loader starts its running average there (the paper's Fig. 8 finds a
calibration estimate and the running average comparable). The method and knobs are the recipe's; the
router's weight function is added by package from the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

from prep.recipe import CacheRoutingSection
from prep.stages import Stage, StageResult

VERSION = 1


@dataclass(frozen=True)
class CacheRoutingChoice(StageResult):
    knobs: dict  # the plan's cache_routing params, without the weight function
    logit_range: list  # [L] mean max-minus-min router logit on the calibration tokens


def measure_ranges(trace_dir, cfg: CacheRoutingSection) -> CacheRoutingChoice:
    from prep.trace import open_trace

    trace = open_trace(trace_dir)
    ranges = []
    for layer in trace.layers:
        z = trace.router_logits(layer)
        ranges.append(float((z.max(-1).values - z.min(-1).values).mean()))
    knobs = {"method": cfg.method, "lam": cfg.lam, "m": cfg.m, "tau": cfg.tau, "top_j": cfg.top_j,
             "logit_range": ranges}
    return CacheRoutingChoice(knobs=knobs, logit_range=ranges)


def _run(inputs) -> CacheRoutingChoice:
    from prep.stages.trace import RoutingTraces

    trace_dir, _ = inputs.upstream("trace")
    return measure_ranges(RoutingTraces.path(trace_dir), inputs.config)


STAGE = Stage(
    name="cache_routing", version=VERSION, config=CacheRoutingSection, result=CacheRoutingChoice,
    reads=("trace",), enabled=lambda recipe: recipe.cache_routing.enabled, run=_run,
)
