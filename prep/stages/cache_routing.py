"""Stage ``cache_routing``: the plan's cache-conditional routing (Skliar et al., Mixture of Cache-Conditional
Experts, sections 3.1-3.3 and 4.1).

Runs when ``cache_routing.enabled``. The prior's boost is lambda times each layer's running logit range;
this stage measures that range on the calibration routing (trace stage: each token's max minus min router
logit, averaged per layer), and the loader starts its running average there (the paper's Fig. 8 finds a
calibration estimate and the running average comparable).

With ``tolerance``, the method's knob (lambda, tau, or m) is lowered from the recipe's value to the largest
one whose routing keeps the mean next-token KL against exact routing within it, on the last
``num_sequences`` calibration sequences. The cache is emulated: each sequence starts cold with room for
``cache_share`` of each layer's experts, and the policy routes its tokens in order against it, as decode
would (``loader.routing.CacheConditionalRouting``). The (knob, KL) trail is kept. The router's weight
function is added by package from the adapter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tqdm import tqdm

from loader.plan import PolicySpec
from loader.routing import CACHE_METHODS, CacheConditionalRouting, install_routing
from prep.errors import MoeprepError
from prep.methods.decoded import mean_kl, next_token_logprobs
from prep.methods.trace import open_trace
from prep.report import ROUTING_PLOT, study_section
from prep.stages import Stage, StageResult
from prep.stages.bitwidth import held_out
from prep.stages.trace import RoutingTraces

VERSION = 2
TOLERANCE_STEPS = 8  # bisection steps on lambda or tau


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

    def __post_init__(self) -> None:
        if self.method not in CACHE_METHODS:
            raise MoeprepError(f"cache_routing.method {self.method!r} unknown; use one of {CACHE_METHODS}")
        if self.lam < 0 or not 0 <= self.tau <= 1 or self.top_j < 0 or (self.m is not None and self.m < 1):
            raise MoeprepError("cache_routing needs lam >= 0, tau in [0, 1], top_j >= 0 and m >= 1 (or null)")
        if self.tolerance is not None and self.tolerance < 0:
            raise MoeprepError(f"cache_routing.tolerance must be >= 0 nats (or null), got {self.tolerance}")
        if not 0 < self.cache_share <= 1 or (self.num_sequences is not None and self.num_sequences <= 0):
            raise MoeprepError("cache_routing needs cache_share in (0, 1] and num_sequences positive (or null)")


@dataclass(frozen=True)
class CacheRoutingChoice(StageResult):
    knobs: dict  # the plan's cache_routing params, without the weight function
    logit_range: list  # [L] mean max-minus-min router logit on the calibration tokens
    details: dict  # with a tolerance: the knob searched, the trail and the chosen value's KL

    def apply(self, plan, context):
        """Cache-conditional routing as the plan's routing policy, with the router's weight function."""
        return dataclasses.replace(plan, routing=PolicySpec("cache_routing", self.knobs | {
            "weights": context.routing_weights}))

    def report(self, entries: dict) -> dict:
        """report.json's ``cache_routing``: the stage's figures."""
        return entries | {"cache_routing": self.to_json()}

    REPORT_OFF = {"cache_routing": None}
    # the routing study (gating, dynamic precision and cache routing against the miss rate) shows here
    REPORT_SECTIONS = (study_section("routing_study", 60, ROUTING_PLOT, "accuracy delta against miss rate"),)


class _ColdView:
    """An emulated layer cache for a plain model: empty at each call, room for ``records`` experts (the
    policy adds each token's experts as it routes the call's tokens in order)."""

    def __init__(self, records: int) -> None:
        self.records = records

    def resident(self) -> dict:
        return {}

    def in_flight(self) -> dict:
        return {}

    def capacity_records(self) -> int:
        return self.records


def measure_ranges(trace_dir, cfg: CacheRoutingSection) -> CacheRoutingChoice:
    """The knobs as given and the calibration logit ranges (no model run)."""

    trace = open_trace(trace_dir)
    ranges = []
    for layer in trace.layers:
        z = trace.router_logits(layer)
        ranges.append(float((z.max(-1).values - z.min(-1).values).mean()))
    knobs = {"method": cfg.method, "lam": cfg.lam, "m": cfg.m, "tau": cfg.tau, "top_j": cfg.top_j,
             "logit_range": ranges}
    return CacheRoutingChoice(knobs=knobs, logit_range=ranges, details={})


def within_tolerance(model, adapter, sequences: list, choice: CacheRoutingChoice, cfg: CacheRoutingSection
                     ) -> CacheRoutingChoice:
    """Lower the method's knob to the largest value within ``cfg.tolerance`` (see the module docstring)."""

    held = held_out(sequences, cfg.num_sequences)
    paths = adapter.module_paths(model)
    records = max(1, round(cfg.cache_share * adapter.num_experts))
    reference = next_token_logprobs(model, held)
    weights = adapter.routing_weights()

    def loss(knobs: dict) -> float:
        policy = CacheConditionalRouting(**knobs, weights=weights)
        installed = install_routing(model, paths["experts_modules"], policy, router_paths=paths["router_modules"],
                                    view=lambda _layer: _ColdView(records))
        try:
            return mean_kl(reference, model, held)
        finally:
            installed.remove()

    knobs = dict(choice.knobs)
    name = {"prior": "lam", "threshold": "tau", "max_rank": "m"}[cfg.method]
    top = knobs[name] if knobs[name] is not None else adapter.num_experts
    trail = [[top, loss(knobs)]]
    chosen = top
    if trail[-1][1] > cfg.tolerance:
        if name == "m":  # whole numbers from K (exact routing) up
            candidates = list(range(adapter.top_k, int(top)))
            chosen = adapter.top_k
            for m in tqdm(candidates, desc="cache routing tolerance", unit="eval", leave=False):
                trail.append([m, loss(knobs | {"m": m})])
                if trail[-1][1] > cfg.tolerance:
                    break
                chosen = m
        else:  # lambda and tau: 0 is exact routing (tau 0: m = 1 <= K)
            good, bad = 0.0, float(top)
            for _ in tqdm(range(TOLERANCE_STEPS), desc="cache routing tolerance", unit="eval", leave=False):
                mid = (good + bad) / 2
                trail.append([mid, loss(knobs | {name: mid})])
                good, bad = (mid, bad) if trail[-1][1] <= cfg.tolerance else (good, mid)
            chosen = good
    knobs[name] = chosen
    kl = next((v for k, v in trail if k == chosen), 0.0)
    return CacheRoutingChoice(knobs=knobs, logit_range=choice.logit_range, details={
        "knob": name, "tolerance": cfg.tolerance, "trail": trail, "loss": kl, "sequences": len(held),
        "cache_records": records})


def _run(inputs) -> CacheRoutingChoice:

    trace_dir, _ = inputs.upstream("trace")
    choice = measure_ranges(RoutingTraces.path(trace_dir), inputs.config)
    if inputs.config.tolerance is None:
        return choice
    return within_tolerance(inputs.model, inputs.adapter, inputs.sequences, choice, inputs.config)


def check(recipe) -> None:
    """One routing policy per plan: cache-conditional routing or adaptive gating, not both."""
    if recipe.cache_routing.enabled and recipe.gating.enabled:
        raise MoeprepError("gating and cache_routing both rewrite the routing and a plan runs one routing policy; "
                           "enable one of them")


STAGE = Stage(
    name="cache_routing", version=VERSION, config=CacheRoutingSection, result=CacheRoutingChoice,
    reads=("trace",), needs=frozenset({"model", "calibration"}),
    enabled=lambda recipe: recipe.cache_routing.enabled, run=_run,
    section="cache_routing", check=check,
)
