"""Stage ``gating``: AdapMoE's adaptive gating (AdapMoE section 4.2, eqs. 3-8): the Fisher sensitivity S_l of every
MoE layer and the threshold T of the rule (1 - alpha)^2 * S_l <= T.

Runs when ``gating.enabled``. S comes from ``prep.methods.fisher`` on the first ``num_sequences`` calibration
sequences, or from ``sensitivity_file`` (a JSON file with ``S``, one value per MoE layer, and ``source``: the
values AdapMoE's own code sets for Mixtral-8x7B, ``../shared/data/traces/mixtral-8x7b/adapmoe_sensitivity.json``),
whose source the result records. T is ``threshold`` when given; else the T whose rule leaves ``target_single`` of the (token,
layer) decisions of the calibration routing (trace stage) with one expert, found by bisection on log T
without a forward pass. With ``tolerance``, T is bisected down to the largest value whose gated model (the
source model with the policy installed) stays within that mean next-token KL on the last ``num_sequences``
sequences; the (T, KL) trail is kept. The result holds what the plan's ``adaptive_gating`` policy needs and
what the DP allocator will (alpha_l: the per-layer single-expert shares).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loader.plan import PolicySpec
from loader.routing import AdaptiveGating, install_routing
from prep.errors import MoeprepError
from prep.methods.decoded import mean_kl, next_token_logprobs
from prep.methods.fisher import fisher_sensitivity
from prep.methods.routing_stats import gating_share
from prep.methods.trace import open_trace
from prep.stages import Stage, StageResult
from prep.stages.bitwidth import held_out
from prep.stages.trace import RoutingTraces

VERSION = 1
SEARCH_STEPS = 60  # bisection steps on log T for a target share
TOLERANCE_STEPS = 8  # bisection steps on T for the KL tolerance


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
    sensitivity_file: str | None = None  # S from this JSON file ({"S": [...], "source": ...}) instead of Fisher

    def __post_init__(self) -> None:
        if not 0 <= self.target_single <= 1:
            raise MoeprepError(f"gating.target_single is a share of decisions in [0, 1], got {self.target_single}")
        if self.threshold is not None and self.threshold < 0:
            raise MoeprepError(f"gating.threshold must be >= 0 (or null to take it from target_single), got "
                               f"{self.threshold}")
        if self.tolerance is not None and self.tolerance < 0:
            raise MoeprepError(f"gating.tolerance must be >= 0 nats (or null), got {self.tolerance}")
        if self.num_sequences is not None and self.num_sequences <= 0:
            raise MoeprepError("gating.num_sequences must be positive (or null for all)")


@dataclass(frozen=True)
class GatingChoice(StageResult):
    threshold: float
    sensitivity: list  # [L] S_l
    tau: list  # [L] sqrt(T / S_l): a second expert of normalized weight at most this is dropped (None: S_l = 0)
    single: float  # share of single-expert decisions on the calibration routing
    runs_saved: float  # share of expert runs saved there (about half the single share for top-2)
    per_layer: list  # [L] {single, runs_saved}
    knobs: dict
    details: dict  # fisher convention and positions; target search; KL trail and loss when a tolerance is set

    def apply(self, plan, context):
        """AdapMoE's gating as the plan's routing policy."""
        return dataclasses.replace(plan, routing=PolicySpec("adaptive_gating", self.knobs))

    def report(self, entries: dict) -> dict:
        """report.json's ``gating``: the stage's figures (its knobs are the plan's)."""
        return entries | {"gating": {k: v for k, v in self.to_json().items() if k != "knobs"}}

    REPORT_OFF = {"gating": None}


def threshold_for_share(weights: torch.Tensor, sensitivity: list[float], target: float) -> float:
    """The smallest T whose rule gives at least ``target`` single-expert decisions on ``weights`` [N, L, K]
    (the share only grows with T); 0 for a target of 0."""
    if target <= 0:
        return 0.0
    lo, hi = 1e-12, max(max(sensitivity), 1e-12) * 1.01  # at hi every non-top-1 of weight <= 1 is dropped
    if gating_share(weights, sensitivity, hi)["single"] < target:
        return hi
    for _ in range(SEARCH_STEPS):
        mid = math.sqrt(lo * hi)
        if gating_share(weights, sensitivity, mid)["single"] >= target:
            hi = mid
        else:
            lo = mid
    return hi


def gated_loss(model, adapter, sensitivity: list[float], held: list, decode_only: bool):
    """loss(T): mean next-token KL of the model with gating at T against the model without, on ``held``."""

    paths = adapter.module_paths(model)
    reference = next_token_logprobs(model, held)

    def loss(threshold: float) -> float:
        installed = install_routing(model, paths["experts_modules"], AdaptiveGating(threshold, sensitivity, decode_only),
                                    router_paths=paths["router_modules"])
        try:
            return mean_kl(reference, model, held)
        finally:
            installed.remove()

    return loss


def read_sensitivity(path: Path, layers: int) -> tuple[list[float], dict]:
    """(S [layers], what the file says of itself) from a sensitivity file; a model with fewer MoE layers than the
    file (the bench's quick Mixtral shape) takes the first ones."""
    try:
        raw = json.loads(Path(path).read_text())
        values = [float(v) for v in raw["S"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MoeprepError(f"gating.sensitivity_file {path}: not a sensitivity file ({type(e).__name__}: {e}); it "
                           'needs {"S": [one value per MoE layer], "source": "..."}') from None
    if len(values) < layers or any(not math.isfinite(v) or v < 0 for v in values):
        raise MoeprepError(f"gating.sensitivity_file {path}: needs {layers} finite values >= 0 in S, got "
                           f"{len(values)}")
    about = {k: raw[k] for k in ("model", "quantity", "source", "threshold_T") if k in raw}
    return values[:layers], about | {"file": str(path), "layers_used": layers}


def choose_gating(model, adapter, sequences: list, trace_dir, cfg: GatingSection, root: Path = Path(".")) -> GatingChoice:

    weights = torch.cat([r.expert_weights for r in open_trace(trace_dir).routing()])  # [N, L, K]
    if cfg.sensitivity_file is not None:
        s, about = read_sensitivity(Path(root) / cfg.sensitivity_file, weights.shape[1])
        details: dict = {"sensitivity_file": about}
    else:
        fit = list(sequences if cfg.num_sequences is None else sequences[:cfg.num_sequences])
        with tqdm(total=len(fit), desc="fisher sensitivity", unit="seq", leave=False) as bar:
            fisher = fisher_sensitivity(model, adapter, fit, progress=lambda done, _n: bar.update(1))
        s = fisher.sensitivity
        details = {"fisher": {"convention": fisher.convention, "positions": fisher.positions}}
    if cfg.threshold is not None:
        threshold = cfg.threshold
    else:
        threshold = threshold_for_share(weights, s, cfg.target_single)
        details["target_single"] = cfg.target_single
    if cfg.tolerance is not None:
        held = held_out(sequences, cfg.num_sequences)
        loss = gated_loss(model, adapter, s, held, cfg.decode_only)
        trail = [[threshold, loss(threshold)]]
        if trail[-1][1] > cfg.tolerance:
            good, bad = 0.0, threshold
            for _ in tqdm(range(TOLERANCE_STEPS), desc="gating tolerance", unit="eval", leave=False):
                mid = (good + bad) / 2
                trail.append([mid, loss(mid)])
                good, bad = (mid, bad) if trail[-1][1] <= cfg.tolerance else (good, mid)
            threshold = good
        details |= {"tolerance": cfg.tolerance, "trail": trail, "sequences": len(held),
                    "loss": next((v for t, v in trail if t == threshold), 0.0 if threshold == 0 else None)}
    share = gating_share(weights, s, threshold)
    return GatingChoice(threshold=threshold, sensitivity=s,
                        tau=[math.sqrt(threshold / v) if v > 0 else None for v in s],
                        single=share["single"], runs_saved=share["runs_saved"], per_layer=share["layers"],
                        knobs={"threshold": threshold, "sensitivity": s, "decode_only": cfg.decode_only},
                        details=details)


def _run(inputs) -> GatingChoice:

    trace_dir, _ = inputs.upstream("trace")
    cfg = inputs.config
    if cfg.sensitivity_file is not None and cfg.tolerance is None:  # no forward pass: neither model nor data
        return choose_gating(None, None, [], RoutingTraces.path(trace_dir), cfg, inputs.root)
    return choose_gating(inputs.model, inputs.adapter, inputs.sequences, RoutingTraces.path(trace_dir), cfg,
                         inputs.root)


STAGE = Stage(
    name="gating", version=VERSION, config=GatingSection, result=GatingChoice,
    reads=("trace",), needs=frozenset({"model", "calibration"}),
    enabled=lambda recipe: recipe.gating.enabled,
    run=_run,
    files=lambda recipe: [recipe.gating.sensitivity_file] if recipe.gating.sensitivity_file else [],
    section="gating",
)
