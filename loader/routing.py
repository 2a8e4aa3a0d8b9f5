"""Routing policies: who decides, at run time, which experts each MoE layer uses for each token.

The default is the model's own router. Another policy rewrites the router's decision through a forward
hook on the router module, so no model class is patched and the same policy installs on any
transformers model, whether the loader offloads its experts or not. (The bench installs one replay on
every system it compares, so all of them route identically.)

The routers of every supported architecture (Mixtral, Qwen-MoE, OLMoE, Phi-MoE, DeepSeek-V2, gpt-oss)
return ``(router_logits, top_k_weights, top_k_index)`` over the flattened tokens; a policy receives
those, plus a read-only view of the layer's cache when the experts are offloaded (cache-aware routing),
and returns the weights and indices the experts will use. The artifact manifest records each MoE
layer's router module path; for a plain transformers model the router is found as the sibling ``gate``
(or ``router``) of each layer's experts module.

The hook also feeds the predictors (``loader/predict.py``): after each router they get the router input
and the chosen experts and name experts to prefetch.

On the experts side, a ``MissPolicy`` decides per missed expert which precision to read, or to skip it.

Techniques (each a plan entry, ``Plan.routing`` / ``Plan.miss``, and a class of ``ROUTING_POLICIES`` /
``MISS_POLICIES``):

- ``adaptive_gating`` (AdapMoE section 4.2, eqs. 3-8): drop the tail of a token's selected experts when its
  normalized weight w_R satisfies w_R^2 * S_l <= T (for top-2: keep only the top-1 when (1 - alpha)^2 * S_l
  <= T). A dropped expert gets weight 0 and the loader never reads it; the survivors are rescaled to the
  selection's original total weight. Top-k > 2 and routers that do not renormalize are an extension of the
  paper (which is top-2 and renormalized); on a renormalizing top-2 router the rule is the paper's.
- ``dynamic_precision`` (HOBBIT section 3.2): a missed expert's unimportance is the summed normalized
  weight of the more important selected experts of its token (``unimportance``); at or below ``t1`` it is
  read at its planned precision, at or below ``t2`` at ``low``, above ``t2`` skipped. The top-1 always
  scores 0. With several tokens the most demanding token decides.
- ``cache_routing`` (Skliar et al., Mixture of Cache-Conditional Experts, sections 3.1-3.3 and 4.1): prefer
  experts already resident when the router is nearly indifferent. ``prior``: add lambda times the layer's
  running logit range to the logits of resident experts and of the token's top-J; ``max_rank``: cached
  experts within the top m move ahead; ``threshold``: m is the smallest rank whose cumulative probability
  reaches tau. The J best experts always stay. The ranking changes, the weights do not: they are the router's
  own weight function (``selection_weights``, the manifest's ``routing_weights``) on the unmodified logits.
  The tokens of one call are routed in order, each seeing the cache as decode would (the earlier tokens'
  experts added, least recently used out at the layer's capacity).

``ReplayRouting`` hands out recorded decisions (for example the real Mixtral-8x7B traces): each router
call with T tokens takes the next T records of its layer, so a prefill of T tokens consumes T records
and each decode step one. Batch size 1: with more sequences the flattened tokens would consume records
of one stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from loader.cache import precision_rank
from loader.errors import MoeError
from loader.plan import PLAN_FILE, Plan, PlanError, PolicySpec
from loader.vocab import SKIP, weights_spec_problem

ROUTER_NAMES = ("gate", "router")


class RoutingError(MoeError):
    """A routing policy that does not fit the model, or a replay that ran out of records."""


class RoutingPolicy:
    """The model's own routing (changes nothing). Subclasses override ``route`` and, if stateful, ``reset``."""

    name = "topk"

    def bind(self, num_layers: int) -> None:
        """Called once when installed on a model with ``num_layers`` MoE layers."""

    def route(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
              view=None) -> tuple[torch.Tensor, torch.Tensor]:
        """layer: position among the model's MoE layers (0-based); logits [T, E], weights and indices
        [T, K]; view: ``loader.cache.LayerView`` of the layer's cache (None without offloading).
        Returns (weights [T, K'], indices [T, K'])."""
        return weights, indices

    def reset(self) -> None:
        """Start over (a new sequence)."""


class ReplayRouting(RoutingPolicy):
    """Recorded decisions: expert_ids [T, L, K] (int) and weights [T, L, K] (float), token-major."""

    def __init__(self, expert_ids: torch.Tensor, weights: torch.Tensor) -> None:
        if expert_ids.dim() != 3 or expert_ids.shape != weights.shape:
            raise RoutingError(f"replay needs expert_ids and weights of the same shape [T, L, K], got "
                               f"{tuple(expert_ids.shape)} and {tuple(weights.shape)}")
        if expert_ids.is_floating_point() or not weights.is_floating_point():
            raise RoutingError("replay expert_ids must be integers and weights floating point")
        self.expert_ids = expert_ids.long()
        self.weights = weights.float()
        self.cursor = [0] * expert_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    def bind(self, num_layers: int) -> None:
        if num_layers != self.expert_ids.shape[1]:
            raise RoutingError(f"the replay has {self.expert_ids.shape[1]} layers but the model has {num_layers} "
                               "MoE layers; slice the recorded routing to the model's layers")

    def route(self, layer, logits, weights, indices, view=None):
        n, k = indices.shape
        start, end = self.cursor[layer], self.cursor[layer] + n
        if end > self.num_tokens:
            raise RoutingError(f"replay exhausted at MoE layer {layer}: {self.num_tokens} recorded tokens, "
                               f"{end} asked for; run fewer tokens or record more")
        if k != self.expert_ids.shape[2]:
            raise RoutingError(f"the replay has top-{self.expert_ids.shape[2]} decisions, the model routes top-{k}")
        ids = self.expert_ids[start:end, layer]
        if int(ids.max()) >= logits.shape[-1]:
            raise RoutingError(f"the replay names expert {int(ids.max())} but the model has {logits.shape[-1]}")
        self.cursor[layer] = end
        return (self.weights[start:end, layer].to(device=weights.device, dtype=weights.dtype),
                ids.to(device=indices.device, dtype=indices.dtype))

    def reset(self) -> None:
        self.cursor = [0] * len(self.cursor)


def router_module(model: torch.nn.Module, experts_path: str) -> torch.nn.Module:
    """The router beside the experts module at ``experts_path`` (its sibling ``gate`` or ``router``)."""
    parent_path = experts_path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    for name in ROUTER_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise RoutingError(f"no router ({' or '.join(ROUTER_NAMES)}) beside experts module {experts_path!r}")


class MissPolicy:
    """Per missed expert: the precision to read, or ``SKIP``. The default reads the planned precision.

    ``renormalize``: after a skip, the loader rescales the token's remaining weights to their former total.
    ``view``: set by the loader, ``view(layer)`` is the layer's ``loader.cache.LayerView``."""

    name = "plan"
    renormalize = False
    view = None

    def bind(self, num_layers: int, num_experts: int) -> None:
        """Called once when the loader starts."""

    def decide(self, layer: int, expert: int, planned: str, indices: torch.Tensor, weights: torch.Tensor) -> str:
        """layer: MoE layer position; planned: the plan's precision for this expert; indices and weights
        [T, K]: this call's routing (which tokens use the expert, and how much)."""
        return planned

    def reset(self) -> None:
        """Start over (a new sequence)."""


def unimportance(weights: torch.Tensor) -> torch.Tensor:
    """weights [T, K] of the selected experts -> HOBBIT's unimportance score [T, K] of each selection: the
    summed weight, normalized over the K selected, of the selections weighted more than it (0 for the
    top-1; ties broken by slot order)."""
    w = weights.float()
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    order = w.argsort(dim=-1, descending=True, stable=True)
    ranked = w.gather(-1, order)
    before = ranked.cumsum(-1) - ranked
    return torch.empty_like(before).scatter_(-1, order, before)


class AdaptiveGating(RoutingPolicy):
    """AdapMoE's sensitivity-based gating (see the module docstring). ``sensitivity[l]`` is S_l of MoE layer
    position l (the Fisher stage's), ``threshold`` T; ``decode_only`` leaves calls of several tokens alone.
    Counts decisions, single-expert decisions and expert runs before and after."""

    name = "adaptive_gating"

    def __init__(self, threshold: float, sensitivity, decode_only: bool = False) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or threshold < 0:
            raise RoutingError(f"adaptive_gating.threshold must be a number >= 0, got {threshold!r}")
        if not isinstance(sensitivity, list | tuple) or not all(isinstance(v, int | float) and v >= 0 for v in sensitivity):
            raise RoutingError("adaptive_gating.sensitivity must be a list of numbers >= 0, one per MoE layer")
        self.threshold = float(threshold)
        self.sensitivity = [float(v) for v in sensitivity]
        self.decode_only = bool(decode_only)
        self.counts = {"decisions": 0, "single": 0, "runs_before": 0, "runs_after": 0}

    def bind(self, num_layers: int) -> None:
        if len(self.sensitivity) != num_layers:
            raise RoutingError(f"adaptive_gating has {len(self.sensitivity)} sensitivities for {num_layers} MoE "
                               "layers; prepare the artifact again")

    def keep_mask(self, layer: int, weights: torch.Tensor) -> torch.Tensor:
        """weights [T, K] -> bool [T, K]: the selections kept (at least the top-1 of every token)."""
        w = weights.float().abs()
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
        order = w.argsort(dim=-1, descending=False, stable=True)  # lightest first
        tail = w.gather(-1, order).cumsum(-1)  # mass of the lightest 1, 2, ... selections
        drop_sorted = tail.square() * self.sensitivity[layer] <= self.threshold
        drop_sorted[:, -1] = False  # the heaviest always stays
        drop_sorted = drop_sorted.cumprod(-1).bool()  # only a contiguous lightest tail is dropped
        return ~torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)

    def route(self, layer, logits, weights, indices, view=None):
        if self.decode_only and weights.shape[0] > 1:
            return weights, indices
        keep = self.keep_mask(layer, weights)
        kept = weights * keep
        rest = kept.sum(-1, keepdim=True)
        scale = weights.sum(-1, keepdim=True) / rest.where(rest != 0, torch.ones_like(rest))
        self.counts["decisions"] += weights.shape[0]
        self.counts["single"] += int((keep.sum(-1) == 1).sum()) if weights.shape[-1] > 1 else 0
        self.counts["runs_before"] += weights.numel()
        self.counts["runs_after"] += int(keep.sum())
        return (kept * scale).to(weights.dtype), indices

    def stats(self) -> dict:
        c = self.counts
        return {"policy": self.name, **c,
                "single_ratio": c["single"] / c["decisions"] if c["decisions"] else None,
                "runs_saved": 1 - c["runs_after"] / c["runs_before"] if c["runs_before"] else None}


class DynamicPrecision(MissPolicy):
    """HOBBIT's token-level dynamic precision (see the module docstring).

    strict: a cached ``low`` copy does not satisfy an expert wanted at its planned precision (the read
    happens); latency-first (``strict=False``) computes with that copy instead. renormalize: rescale the
    token's remaining weights after a skip."""

    name = "dynamic_precision"

    def __init__(self, t1: float, t2: float, low: str, strict: bool = True, renormalize: bool = False) -> None:
        for what, v in (("t1", t1), ("t2", t2)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise RoutingError(f"dynamic_precision.{what} must be in [0, 1], got {v!r}")
        if t1 > t2:
            raise RoutingError(f"dynamic_precision needs t1 <= t2, got {t1} > {t2}")
        if not isinstance(low, str):
            raise RoutingError(f"dynamic_precision.low must be a precision name, got {low!r}")
        self.t1, self.t2, self.low = float(t1), float(t2), low
        self.strict, self.renormalize = bool(strict), bool(renormalize)
        self.counts = {"high": 0, "low": 0, "skip": 0, "low_copy_used": 0}

    def score(self, expert: int, indices: torch.Tensor, weights: torch.Tensor) -> float:
        """The expert's unimportance for this call: the lowest over the tokens that selected it."""
        mine = indices == expert
        return float(unimportance(weights)[mine].min()) if bool(mine.any()) else 1.0

    def decide(self, layer, expert, planned, indices, weights):
        s = self.score(expert, indices, weights)
        if s <= self.t1:
            if not self.strict and self.view is not None and self.view(layer).has(expert, self.low):
                self.counts["low_copy_used"] += 1
                return self.low
            self.counts["high"] += 1
            return planned
        if s <= self.t2:
            if precision_rank(self.low) >= precision_rank(planned):  # already planned at or below low
                self.counts["high"] += 1
                return planned
            self.counts["low"] += 1
            return self.low
        self.counts["skip"] += 1
        return SKIP

    def stats(self) -> dict:
        return {"policy": self.name, **self.counts}


class ChainedRouting(RoutingPolicy):
    """Policies applied in order, each to what the previous returned (a replay, then adaptive gating)."""

    name = "chain"

    def __init__(self, *policies: RoutingPolicy) -> None:
        self.policies = policies

    def bind(self, num_layers: int) -> None:
        for p in self.policies:
            p.bind(num_layers)

    def route(self, layer, logits, weights, indices, view=None):
        for p in self.policies:
            weights, indices = p.route(layer, logits, weights, indices, view)
        return weights, indices

    def reset(self) -> None:
        for p in self.policies:
            p.reset()

    def stats(self) -> dict | None:
        found = [p.stats() for p in self.policies if hasattr(p, "stats")]
        return found[-1] if found else None


def check_weights_spec(spec) -> dict:
    """A ``routing_weights`` spec (the manifest's), checked; RoutingError names what is wrong."""
    if problem := weights_spec_problem(spec):
        raise RoutingError(f"{problem}; prepare the artifact again")
    return spec


def selection_weights(spec: dict, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The router's own weights for the chosen ``indices`` [T, K] from its logits [T, E] (float32 [T, K]).

    softmax: softmax over all experts at the chosen ones, renormalized over them if ``renormalize``, times
    ``scale`` (Mixtral, Qwen, OLMoE, DeepSeek-V2); softmax_selected: softmax over the chosen logits (gpt-oss);
    sparsemixer (Phi-MoE, eval mode): slot by slot, the softmax over the logits within relative distance
    2 * jitter_eps of the chosen one, the earlier slots' experts excluded.
    """
    z = logits.float()
    if spec["function"] == "softmax_selected":
        return z.gather(-1, indices).softmax(-1)
    if spec["function"] == "sparsemixer":
        out, taken = [], torch.zeros_like(z, dtype=torch.bool)
        eps = 2 * float(spec["jitter_eps"])
        for slot in range(indices.shape[-1]):
            chosen = indices[:, slot:slot + 1]
            top = z.gather(-1, chosen)
            far = ((top - z) / z.abs().clamp(min=top)) > eps
            gates = z.masked_fill(far | taken, float("-inf"))
            out.append(gates.softmax(-1).gather(-1, chosen))
            taken = taken.scatter(-1, chosen, True)
        return torch.cat(out, -1)
    w = z.softmax(-1).gather(-1, indices)
    if spec["renormalize"]:
        w = w / w.sum(-1, keepdim=True)
    return w * float(spec["scale"])


CACHE_METHODS = ("prior", "max_rank", "threshold")


@dataclass(frozen=True)
class CacheRoutingKnobs:
    """cache_routing's knobs (the plan's ``routing.params`` but ``method`` and ``weights``), checked when made:
    ``lam`` (prior's boost), ``m`` (max_rank's window; None: K), ``tau`` (threshold's mass), ``top_j`` (the best
    experts kept whatever is cached), ``logit_range`` (per layer, the calibration's mean logit range, where prior's
    running mean starts)."""

    lam: float = 0.0
    m: int | None = None
    tau: float = 0.0
    top_j: int = 1
    logit_range: list | None = None

    def __post_init__(self) -> None:
        for what, v in (("lam", self.lam), ("tau", self.tau)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise RoutingError(f"cache_routing.{what} must be a number >= 0, got {v!r}")
        m = self.m
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise RoutingError(f"cache_routing.m must be a whole number >= 1 (or null), got {m!r}")
        if isinstance(self.top_j, bool) or not isinstance(self.top_j, int) or self.top_j < 0:
            raise RoutingError(f"cache_routing.top_j must be a whole number >= 0, got {self.top_j!r}")


class CacheConditionalRouting(RoutingPolicy):
    """Cache-conditional routing (see the module docstring). method: ``prior`` (knob ``lam``), ``max_rank``
    (``m``) or ``threshold`` (``tau``); ``weights``: the router's weight function (``selection_weights``); the
    other knobs are ``CacheRoutingKnobs``'. Needs the layer's cache view; without one (a plain model) it routes
    exactly. Counts decisions and how many selections it changed."""

    name = "cache_routing"

    def __init__(self, method: str, weights: dict, **knobs) -> None:
        if method not in CACHE_METHODS:
            raise RoutingError(f"cache_routing.method {method!r} unknown; use one of {CACHE_METHODS}")
        if unknown := sorted(set(knobs) - {f.name for f in fields(CacheRoutingKnobs)}):
            raise RoutingError(f"cache_routing has no knobs {unknown}; its knobs are method, weights, "
                               f"{', '.join(f.name for f in fields(CacheRoutingKnobs))}")
        checked = CacheRoutingKnobs(**knobs)
        self.method, self.weights = method, check_weights_spec(weights)
        self.lam, self.m, self.tau, self.top_j = float(checked.lam), checked.m, float(checked.tau), checked.top_j
        # the running mean of each layer's logit range, started at the calibration estimate when given
        self.range_sum: dict[int, float] = dict(enumerate(float(v) for v in checked.logit_range or []))
        self.range_n: dict[int, int] = {layer: 1 for layer in self.range_sum}
        self.counts = {"decisions": 0, "changed": 0}

    def reset(self) -> None:
        """The running logit range is kept across sequences (a data statistic, not per sequence)."""

    def _rank(self, layer: int, z: list[float], held: set, k: int) -> list[int]:
        """The K experts of one token (logits ``z`` as a list: E is small and the tokens go one by one, so
        plain Python is faster here than tensor calls)."""
        experts = range(len(z))
        order = sorted(experts, key=lambda e: -z[e])  # stable: ties keep index order
        top_j = order[:self.top_j]
        if self.method == "prior":
            self.range_sum[layer] = self.range_sum.get(layer, 0.0) + (max(z) - min(z))
            self.range_n[layer] = self.range_n.get(layer, 0) + 1
            boost = self.lam * self.range_sum[layer] / self.range_n[layer]
            marked = held | set(top_j)
            return sorted(experts, key=lambda e: -(z[e] + boost if e in marked else z[e]))[:k]
        if self.method == "threshold":
            top = z[order[0]]
            mass = [math.exp(z[e] - top) for e in order]
            total, cum, m = sum(mass), 0.0, 0
            for p in mass:
                if cum >= self.tau * total:
                    break
                cum += p
                m += 1
        else:
            m = self.m if self.m is not None else k
        promoted = [e for e in order[:max(m, k)] if e in held]
        ranked = promoted + [e for e in order if e not in promoted]
        ranked = top_j + [e for e in ranked if e not in top_j]
        return ranked[:k]

    def route(self, layer, logits, weights, indices, view=None):
        if view is None or logits is None:
            return weights, indices
        k = indices.shape[-1]
        held = list(dict.fromkeys([*view.resident(), *view.in_flight()]))
        capacity = max(view.capacity_records(), k) if hasattr(view, "capacity_records") else max(len(held), k)
        zs, original = logits.float().tolist(), indices.tolist()
        changed: dict[int, list[int]] = {}
        for t, z in enumerate(zs):
            chosen = self._rank(layer, z, set(held), k)
            self.counts["decisions"] += 1
            if set(chosen) != set(original[t]):
                changed[t] = chosen
            else:
                chosen = original[t]
            # as decode would see it: this token's experts become the most recent (the heaviest first: by
            # logit, which orders every supported weight function's weights), least recently used out
            for e in sorted(chosen, key=lambda e: -z[e]):
                if e in held:
                    held.remove(e)
                held.append(e)
            del held[:max(len(held) - capacity, 0)]
        self.counts["changed"] += len(changed)
        if not changed:
            return weights, indices
        rows = torch.tensor(list(changed), device=indices.device)
        new_w, new_i = weights.clone(), indices.clone()
        new_i[rows] = torch.tensor(list(changed.values()), dtype=indices.dtype, device=indices.device)
        new_w[rows] = selection_weights(self.weights, logits[rows], new_i[rows]).to(weights.dtype)
        return new_w, new_i

    def stats(self) -> dict:
        c = self.counts
        return {"policy": self.name, "method": self.method, **c,
                "changed_share": c["changed"] / c["decisions"] if c["decisions"] else None}


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (AdaptiveGating, CacheConditionalRouting)}
MISS_POLICIES: dict[str, type[MissPolicy]] = {p.name: p for p in (DynamicPrecision,)}
_AGAIN = "prepare the artifact again"


def _plan_policy(registry: dict, spec: PolicySpec, what: str, default: type):
    """The policy a plan entry names, built with its parameters; a PlanError names plan.json, the entry and the fix."""
    if spec.name in ("topk", "plan", "none") and not spec.params:
        return default()
    if spec.name not in registry:
        raise PlanError(f"{PLAN_FILE} names the {what} {spec.name!r}, which this loader does not know "
                        f"(known: {sorted(registry) or 'none'}); upgrade the loader or {_AGAIN}")
    try:
        return registry[spec.name](**spec.params)
    except (TypeError, RoutingError) as e:
        raise PlanError(f"{PLAN_FILE}: the {what} {spec.name!r}: {str(e).removesuffix('; ' + _AGAIN)}; {_AGAIN}") from None


def plan_routing(plan: Plan) -> RoutingPolicy:
    """The routing policy ``plan`` names, built and bound to its MoE layers (adaptive gating's sensitivities, one
    per layer): ``load`` installs it, ``verify`` builds it to refuse what ``load`` would."""
    policy = _plan_policy(ROUTING_POLICIES, plan.routing, "routing policy", RoutingPolicy)
    try:
        policy.bind(plan.num_layers)
    except RoutingError as e:
        raise PlanError(f"{PLAN_FILE}: the routing policy {plan.routing.name!r}: "
                        f"{str(e).removesuffix('; ' + _AGAIN)}; {_AGAIN}") from None
    return policy


def plan_miss(plan: Plan) -> MissPolicy:
    """The miss policy ``plan`` names, built with its parameters (``load`` runs it, ``verify`` builds it)."""
    return _plan_policy(MISS_POLICIES, plan.miss, "miss policy", MissPolicy)


class InstalledRouting:
    """The hooks of one installed policy; ``remove()`` restores the model's own routing."""

    def __init__(self, policy: RoutingPolicy, handles: list) -> None:
        self.policy = policy
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def install_routing(model: torch.nn.Module, experts_paths: Sequence[str], policy: RoutingPolicy | None,
                    router_paths: Sequence[str] | None = None, view=None, after_router=None) -> InstalledRouting:
    """Route ``model``'s MoE layers (given by their experts module paths, in layer order) with ``policy``.

    router_paths: the routers' module paths (the manifest's); default: the experts' sibling gate/router.
    view: ``view(layer) -> LayerView`` for cache-aware policies. after_router: called with
    (layer, router input [T, H], indices [T, K]) after the policy, for the predictors.
    A default policy (None or a plain ``RoutingPolicy``) with no ``after_router`` installs nothing.
    """
    policy = policy if policy is not None else RoutingPolicy()
    if type(policy) is RoutingPolicy and after_router is None:
        return InstalledRouting(policy, [])
    if router_paths is not None:
        routers = []
        for path in router_paths:
            try:
                routers.append(model.get_submodule(path))
            except AttributeError:
                raise RoutingError(f"the manifest names router module {path!r}, which the model does not have; "
                                   "prepare the artifact again") from None
    else:
        routers = [router_module(model, path) for path in experts_paths]
    policy.bind(len(routers))

    def hook_for(layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RoutingError(f"router of MoE layer {layer} returned {type(output).__name__}, expected "
                                   "(logits, weights, indices); this architecture needs its own routing hook")
            logits, weights, indices = output
            weights, indices = policy.route(layer, logits, weights, indices, view(layer) if view else None)
            if after_router is not None:
                after_router(layer, args[0] if args else None, indices)
            return logits, weights, indices

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    return InstalledRouting(policy, handles)
