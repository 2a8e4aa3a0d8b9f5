"""Prefetch predictors: who names the experts to read before they are asked for.

A ``Predictor`` is called after each MoE layer's router (with the router input and the experts it
chose) and before the LM head (with its input, the final-normed last hidden state, to name the first MoE
layer's experts of the next token). It returns ``PrefetchRequest``s; the loader reads each named expert
into its cache if it is not there and room can be made, protects it from eviction until its layer has
run, and counts whether it was used. Prefetching never changes what is computed, only when records
arrive: reads are queued behind demand reads, and a prefetch the router did not choose is cancelled
if its read has not started.

Three techniques, each a plan entry (``Plan.predictors``: name and knobs) and a class of ``PREDICTORS``:

- ``next_gates`` (HOBBIT H2, AdapMoE 2.3): the routers of layers l+1..l+depth applied to layer l's
  router input in one batched product; the walk goes to the first layer with a predicted expert not
  held, prefetches that layer's missing ones and stops, protecting every predicted expert on the way.
  Every architecture's router computes ``x W^T + b``; the prediction takes a plain top-k of those
  logits, so DeepSeek-V2's group-limited top-k and Phi-MoE's sparsemixer are approximated there.
- ``path_stats`` (EdgeMoE 3.3.2): P(E_l | E_{l-2}, E_{l-1}) from calibration counts, backing off to
  P(E_l | E_{l-1}) and then to the marginal when a key was seen fewer than ``min_count`` times; the
  next layer's experts by descending probability, at most ``max_preload`` with probability >= ``floor``.
- ``first_gate`` (AdapMoE 4.3): a trained linear map from the LM head's input to the next token's first
  MoE layer routing; it also serves the first decode step after prefill.
- ``neuron_gates`` (CORM C2): layer l+1's router on layer l's router input names the experts, and the
  requests carry that input, so that on a neuron-layout artifact the loader reads each predicted
  expert's W1 and then the neurons W1 names (``loader/neuron.py``); elsewhere it is a one-layer
  next-gate predictor. It counts how many chosen experts it had named (expert-level accuracy).

Their learned tensors come from the artifact's ``predictors.safetensors`` (``PathStats.from_tensors``
documents the path-statistics layout; ``first_gate.weight`` is [E, H] float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loader.errors import LoaderError

PREDICTORS_FILE = "predictors.safetensors"


class PredictorError(LoaderError):
    """A predictor that cannot run on this artifact (missing tensors, bad knobs); the message says what to do."""


@dataclass(frozen=True)
class PrefetchRequest:
    """Read expert ``expert`` of MoE layer position ``layer``; ``precision`` None means the planned one.
    ``inputs`` [T, H]: an input to predict the expert's active neurons from (neuron-level loading)."""

    layer: int
    expert: int
    precision: str | None = None
    inputs: torch.Tensor | None = field(default=None, compare=False)


@dataclass
class PredictorContext:
    """What the loader hands every predictor once: the model's sizes, each MoE layer's router weights
    (``routers[l]``: weight [E, H], bias [E] or None), the artifact's predictor tensors, and what the
    cache holds (``held(layer, expert, precision)``: resident or in flight)."""

    num_layers: int
    num_experts: int
    top_k: int
    routers: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    held: Callable[[int, int, str | None], bool] = lambda layer, expert, precision: False
    precision_of: Callable[[int, int], str | None] = lambda layer, expert: None


class Predictor:
    """Names experts to prefetch. The base predicts nothing."""

    name = "none"

    def bind(self, context: PredictorContext) -> None:
        """Called once when the loader starts."""
        self.context = context
        self.num_layers = context.num_layers
        self.num_experts = context.num_experts

    def after_router(self, layer: int, router_input: torch.Tensor, indices: torch.Tensor) -> list[PrefetchRequest]:
        """layer: MoE layer position; router_input [T, H]; indices [T, K] (the experts chosen)."""
        return []

    def after_last_layer(self, hidden: torch.Tensor) -> list[PrefetchRequest]:
        """hidden [..., H]: the LM head's input; requests here are for the next token."""
        return []

    def reset(self) -> None:
        """Start over (a new sequence)."""


def _count(value, what: str, minimum: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PredictorError(f"{what} must be a whole number >= {minimum} (or null), got {value!r}")
    return value


def ranked_votes(logits: torch.Tensor, k: int, limit: int) -> list[int]:
    """logits [T, E] -> at most ``limit`` experts: each token's top-``k``, ranked by how many tokens chose
    them, then by summed probability (one token: its top-k in logit order)."""
    if logits.shape[0] == 1:  # a decode step: the token's top-k by logit, ties by index, in two calls
        return torch.sort(logits[0].float(), descending=True, stable=True).indices[:min(k, limit)].tolist()
    top = logits.topk(k, -1).indices  # [T, k]
    votes = torch.zeros(logits.shape[-1])
    votes.index_add_(0, top.flatten().cpu(), torch.ones(top.numel()))
    mass = logits.float().softmax(-1).sum(0).cpu().tolist()
    counts = votes.tolist()  # plain floats: this runs per token and layer, tensor indexing would dominate
    order = sorted(range(logits.shape[-1]), key=lambda e: (-counts[e], -mass[e]))
    return [e for e in order if counts[e] > 0][:limit]


# ------------------------------------------------------------------------------------- next gates


def stacked_router_logits(weights: torch.Tensor, biases: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The routers of several layers on one input, in one batched product: weights [p, E, H], biases
    [p, E], x [T, H] -> logits [p, T, E]."""
    # one batched matmul: einsum's planning costs more than the product itself for a decode step's single token
    return torch.matmul(weights, x.to(weights.dtype).t()).transpose(1, 2) + biases[:, None, :]


class NextGates(Predictor):
    """HOBBIT's stacked next-layer gates with the adaptive walk (see the module docstring).

    depth: layers looked ahead (HOBBIT recommends 1-3). experts: experts predicted per layer (None: the
    model's top-k). precision: the precision to prefetch at (None: the planned one).
    """

    name = "next_gates"

    def __init__(self, depth: int = 3, experts: int | None = None, precision: str | None = None) -> None:
        self.depth = _count(depth, "next_gates.depth")
        self.experts = _count(experts, "next_gates.experts")
        if precision is not None and not isinstance(precision, str):
            raise PredictorError(f"next_gates.precision must be a precision name or null, got {precision!r}")
        self.precision = precision

    def bind(self, context: PredictorContext) -> None:
        super().bind(context)
        if len(context.routers) != context.num_layers:
            raise PredictorError("next_gates needs every MoE layer's router weights; the loader found "
                                 f"{len(context.routers)} of {context.num_layers}")
        self.weights = torch.stack([w.detach() for w, _ in context.routers])  # [L, E, H]
        self.biases = torch.stack([b.detach().to(self.weights.dtype) if b is not None
                                   else torch.zeros(w.shape[0], dtype=self.weights.dtype, device=w.device)
                                   for w, b in context.routers])  # [L, E]
        self.k = min(self.experts or context.top_k, context.num_experts)

    def predict(self, layer: int, router_input: torch.Tensor) -> list[list[int]]:
        """The ranked experts predicted for layers layer+1 .. layer+depth (fewer at the end of the model)."""
        last = min(layer + self.depth, self.num_layers - 1)
        if last <= layer:
            return []
        logits = stacked_router_logits(self.weights[layer + 1:last + 1], self.biases[layer + 1:last + 1],
                                       router_input.reshape(-1, router_input.shape[-1]))
        return [ranked_votes(z, self.k, self.k) for z in logits]

    def after_router(self, layer, router_input, indices):
        requests = []
        for d, experts in enumerate(self.predict(layer, router_input), start=1):
            target = layer + d
            wants = [(e, self.precision or self.context.precision_of(target, e)) for e in experts]
            requests += [PrefetchRequest(target, e, self.precision) for e, _ in wants]
            if any(not self.context.held(target, e, p) for e, p in wants):
                break  # the first layer with something missing: prefetch it, look no further
        return requests


# ------------------------------------------------------------------------------------- path stats


class PathStats:
    """EdgeMoE's routing-path statistics as counts, with backoff.

    Tensors (prefix ``path.``; layers are MoE layer positions; a key is a layer's chosen experts, sorted):

    - ``path.marginal.counts`` int32 [L, E]: tokens that chose each expert; ``path.marginal.totals`` [L];
    - for l >= 1, ``path.prev1.{l}.keys`` int32 [M, K] (the experts of layer l-1), ``.counts`` [M, E] and
      ``.totals`` [M] (tokens seen with that key);
    - for l >= 2, ``path.prev2.{l}.keys`` int32 [M, 2K] (layer l-2's experts, then layer l-1's), the same.

    ``probs(l, prev2, prev1)`` is the inclusion probability of each expert at layer l (it sums to K):
    the full key when it was seen at least ``min_count`` times, else the previous layer's key, else the
    marginal.
    """

    def __init__(self, marginal: torch.Tensor, marginal_totals: torch.Tensor, prev1: dict, prev2: dict,
                 min_count: int = 5) -> None:
        self.num_layers, self.num_experts = marginal.shape
        self.marginal = marginal.double() / marginal_totals.double().clamp_min(1)[:, None]
        self.prev1, self.prev2 = prev1, prev2  # layer -> {key tuple: (counts [E] float64, total)}
        self.min_count = min_count

    @classmethod
    def from_tensors(cls, tensors: dict, min_count: int = 5) -> PathStats:
        if "path.marginal.counts" not in tensors:
            raise PredictorError(f"the artifact's {PREDICTORS_FILE} has no path statistics; prepare it with "
                                 "path_stats in predict.predictors")
        marginal = tensors["path.marginal.counts"]

        def table(kind: str, layer: int) -> dict:
            prefix = f"path.{kind}.{layer}"
            if f"{prefix}.keys" not in tensors:
                return {}
            keys, counts, totals = (tensors[f"{prefix}.{n}"] for n in ("keys", "counts", "totals"))
            return {tuple(k): (c.double(), int(t)) for k, c, t in zip(keys.tolist(), counts, totals.tolist(), strict=True)}

        try:
            if marginal.dim() != 2:
                raise ValueError(f"path.marginal.counts is {tuple(marginal.shape)}, not [layers, experts]")
            layers = range(marginal.shape[0])
            return cls(marginal, tensors["path.marginal.totals"],
                       {layer: table("prev1", layer) for layer in layers if layer >= 1},
                       {layer: table("prev2", layer) for layer in layers if layer >= 2}, min_count)
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:  # a table missing or misshapen
            raise PredictorError(f"the artifact's {PREDICTORS_FILE} holds damaged path statistics ({type(e).__name__}: "
                                 f"{e}); prepare it again") from None

    def probs(self, layer: int, prev2: tuple | None, prev1: tuple | None) -> tuple[torch.Tensor, str]:
        """(inclusion probabilities [E] float64, which table answered: "prev2", "prev1" or "marginal")."""
        if prev1 is not None and prev2 is not None and layer >= 2:
            hit = self.prev2[layer].get(tuple(sorted(prev2)) + tuple(sorted(prev1)))
            if hit is not None and hit[1] >= self.min_count:
                return hit[0] / hit[1], "prev2"
        if prev1 is not None and layer >= 1:
            hit = self.prev1[layer].get(tuple(sorted(prev1)))
            if hit is not None and hit[1] >= self.min_count:
                return hit[0] / hit[1], "prev1"
        return self.marginal[layer], "marginal"


class PathStatsPredictor(Predictor):
    """EdgeMoE's path-statistics preloading of the next layer (see the module docstring)."""

    name = "path_stats"

    def __init__(self, max_preload: int = 3, floor: float = 0.05, min_count: int = 5) -> None:
        self.max_preload = _count(max_preload, "path_stats.max_preload")
        self.min_count = _count(min_count, "path_stats.min_count")
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
            raise PredictorError(f"path_stats.floor must be a probability in [0, 1], got {floor!r}")
        self.floor = float(floor)
        self.chosen: dict[int, list[tuple]] = {}

    def bind(self, context: PredictorContext) -> None:
        super().bind(context)
        self.stats = PathStats.from_tensors(context.tensors, self.min_count)
        if self.stats.marginal.shape != (context.num_layers, context.num_experts):
            raise PredictorError(f"the path statistics are for {tuple(self.stats.marginal.shape)} (layers, experts), "
                                 f"the model has ({context.num_layers}, {context.num_experts}); prepare it again")

    def after_router(self, layer, router_input, indices):
        if layer == 0:
            self.chosen.clear()
        rows = [tuple(sorted(r)) for r in indices.tolist()]
        self.chosen[layer] = rows
        if layer + 1 >= self.num_layers:
            return []
        before = self.chosen.get(layer - 1)
        if before is not None and len(before) != len(rows):
            before = None
        probs = [self.stats.probs(layer + 1, before[i] if before is not None else None, row)[0]
                 for i, row in enumerate(rows)]
        if not probs:
            return []
        total = probs[0]  # a decode step's one token: its probabilities as they are, no tensor arithmetic
        if len(probs) > 1:
            total = total.clone()
            for p in probs[1:]:
                total += p
            total /= len(probs)
        values = total.tolist()  # plain floats: indexing the tensor per expert would dominate a decode step
        order = sorted(range(self.num_experts), key=lambda e: -values[e])
        return [PrefetchRequest(layer + 1, e) for e in order[:self.max_preload] if values[e] >= self.floor]

    def reset(self) -> None:
        self.chosen.clear()


# ------------------------------------------------------------------------------------- first gate


class FirstGatePredictor(Predictor):
    """AdapMoE's first-layer gate: after the LM head's input is known, the next token's first-MoE-layer
    experts (the last position's top ``experts``, default the model's top-k)."""

    name = "first_gate"

    def __init__(self, experts: int | None = None) -> None:
        self.experts = _count(experts, "first_gate.experts")

    def bind(self, context: PredictorContext) -> None:
        super().bind(context)
        weight = context.tensors.get("first_gate.weight")
        if weight is None:
            raise PredictorError(f"the artifact's {PREDICTORS_FILE} has no first-layer gate; prepare it with "
                                 "first_gate in predict.predictors")
        if weight.dim() != 2 or weight.shape[0] != context.num_experts:
            raise PredictorError(f"first_gate.weight is {tuple(weight.shape)}, expected [{context.num_experts}, H]; "
                                 "prepare the artifact again")
        self.weight = weight
        self.k = min(self.experts or context.top_k, context.num_experts)

    def after_last_layer(self, hidden):
        last = hidden[:, -1] if hidden.dim() == 3 else hidden.reshape(-1, hidden.shape[-1])[-1:]
        if last.shape[-1] != self.weight.shape[1]:
            raise PredictorError(f"first_gate.weight expects hidden size {self.weight.shape[1]}, got {last.shape[-1]}")
        logits = last.float() @ self.weight.to(last.device, torch.float32).T
        return [PrefetchRequest(0, e) for e in ranked_votes(logits, self.k, self.k)]


class NeuronGates(NextGates):
    """CORM's coarse step: layer l+1's gate on layer l's router input (see the module docstring)."""

    name = "neuron_gates"

    def __init__(self, experts: int | None = None) -> None:
        super().__init__(depth=1, experts=experts)
        self.reset()

    def named_for(self, layer: int) -> list[int] | None:
        """The experts named for ``layer`` (ranked), or None when nothing was named for it."""
        return self._named[1] if self._named is not None and self._named[0] == layer else None

    def after_router(self, layer, router_input, indices):
        named = self.named_for(layer)
        if named is not None:  # score the prediction made for this layer against the router's own choice
            own = self.router_choice.pop(layer, indices)
            chosen = set(own.flatten().tolist()) - {-1}
            self.chosen += len(chosen)
            self.hits += len(chosen & set(named))
        self._named = None
        predicted = self.predict(layer, router_input)
        if not predicted:
            return []
        self._named = (layer + 1, list(predicted[0]))
        x = router_input.reshape(-1, router_input.shape[-1]).detach()
        return [PrefetchRequest(layer + 1, e, None, x) for e in predicted[0]]

    def reset(self) -> None:
        self._named = None
        self.router_choice: dict = {}  # layer -> the router's indices, when a routing policy replaced them
        if not hasattr(self, "chosen"):
            self.chosen = self.hits = 0

    def stats(self) -> dict:
        """Of the experts the routers chose at layers 2..L, the share this predictor had named."""
        return {"chosen": self.chosen, "named": self.hits, "accuracy": self.hits / self.chosen if self.chosen else None}


PREDICTORS: dict[str, type[Predictor]] = {p.name: p for p in (NextGates, PathStatsPredictor, FirstGatePredictor,
                                                             NeuronGates)}
# predictors that read only the routing decisions, never a hidden state: they run on a replay of recorded decisions
ROUTING_ONLY = ("path_stats",)


def make_predictor(name: str, params: dict | None = None) -> Predictor:
    """The named predictor with ``params``; a ``PredictorError`` names the known ones or the bad knob."""
    if name not in PREDICTORS:
        raise PredictorError(f"predictor {name!r} unknown; use one of {', '.join(PREDICTORS)}")
    try:
        return PREDICTORS[name](**dict(params or {}))
    except TypeError as e:
        raise PredictorError(f"predictor {name!r}: {e}") from None
