"""CORM's neuron-level loading: which neurons of an expert are active, and the expert's MLP over a subset.

A neuron j of an expert is row j of W1 (gate) and W3 (up) and column j of W2 (down). It is *active* for
an input x when |act(W1 x)_j| > theta (digest C1, ambiguity 2: the activation alone, what W1 tells
before W3 and W2 are read). ``act`` is the experts module's own gate function evaluated with the up
projection at 1, so every architecture's activation is used as the model computes it (for gpt-oss
this is (1 + 1) * glu: its theta is on that scale; theta is calibrated per model anyway).

A neuron-layout record (``loader.codec.NeuronLayout``) holds W1 whole in its header and one contiguous
row per neuron (up row, down column). The runtime reads the header, finds the active set, and reads the
rows it lacks, or the whole rest above ``crossover`` (CORM's 75% rule); each cached expert keeps a mask
of its resident neurons, grown as the union of what it read (C3). The plan's ``neuron`` entry holds the
knobs (``NeuronConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loader.codec import NeuronLayout
from loader.errors import MoeError
from loader.routing import RoutingPolicy, selection_weights

COMPUTE = ("resident", "active")


class NeuronError(MoeError):
    """A neuron configuration the loader cannot use; the message says what to change."""


@dataclass(frozen=True)
class NeuronConfig:
    """theta: the activity threshold; crossover: the active share above which the whole expert is read;
    compute: "resident" (every resident neuron of the expert, the default: more accurate at no extra
    read) or "active" (the token's active set only; digest ambiguity 6); trust_prediction: a predicted
    expert computes with the neurons the predictor read, missing active ones are not read on demand
    (CORM's own behaviour; off: wrong predictions are fixed on demand); prefill: also in prefill (off:
    decode only, since a prompt's union of active sets is nearly everything). With trust_prediction and the
    neuron_gates predictor the layers also compute the predicted experts instead of the router's
    (``TrustedPrediction``)."""

    theta: float = 0.0
    crossover: float = 0.75
    compute: str = "resident"
    trust_prediction: bool = False
    prefill: bool = False

    @classmethod
    def from_params(cls, params: dict) -> NeuronConfig:
        known = {"theta", "crossover", "compute", "trust_prediction", "prefill"}
        if unknown := sorted(set(params) - known):
            raise NeuronError(f"neuron: unknown knobs {unknown}; known: {sorted(known)}")
        cfg = cls(**params)
        if isinstance(cfg.theta, bool) or not isinstance(cfg.theta, (int, float)) or cfg.theta < 0:
            raise NeuronError(f"neuron.theta must be a number >= 0, got {cfg.theta!r}")
        if isinstance(cfg.crossover, bool) or not isinstance(cfg.crossover, (int, float)) \
                or not 0 <= cfg.crossover <= 1:
            raise NeuronError(f"neuron.crossover must be a share in [0, 1], got {cfg.crossover!r}")
        if cfg.compute not in COMPUTE:
            raise NeuronError(f"neuron.compute must be one of {COMPUTE}, got {cfg.compute!r}")
        for name in ("trust_prediction", "prefill"):
            if not isinstance(getattr(cfg, name), bool):
                raise NeuronError(f"neuron.{name} must be true or false, got {getattr(cfg, name)!r}")
        return cfg


def pair(gate: torch.Tensor, up: torch.Tensor, pairing: str) -> torch.Tensor:
    """gate, up [T, S] -> the module's fused gate_up [T, 2S]: halves ([gate | up]) or interleaved (gpt-oss)."""
    if pairing == "interleaved":
        return torch.stack([gate, up], -1).flatten(-2)
    return torch.cat([gate, up], -1)


def gate_projection(header: dict, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """W1 x (+ gate bias) for x [T, H] -> [T, I] (or the neurons ``index`` only)."""
    w = header["gate"] if index is None else header["gate"][index]
    g = x @ w.to(x.dtype).T
    if "gate_bias" in header:
        b = header["gate_bias"] if index is None else header["gate_bias"][index]
        g = g + b.to(x.dtype)
    return g


def activity(module, gate: torch.Tensor, pairing: str) -> torch.Tensor:
    """|act(W1 x)| [T, I] from the gate projection, through the module's own gate function (up at 1)."""
    return module._apply_gate(pair(gate, torch.ones_like(gate), pairing)).abs()


def active_set(module, header: dict, x: torch.Tensor, pairing: str, theta: float) -> torch.Tensor:
    """The neurons active for any token of x [T, H]: bool [I] on the CPU (the union over tokens; the masks the
    runtime keeps per cached expert live there)."""
    return (activity(module, gate_projection(header, x), pairing) > theta).any(0).cpu()


def neuron_forward(module, layout: NeuronLayout, record: torch.Tensor, pairing: str, x: torch.Tensor,
                   index: torch.Tensor | None = None, header: dict | None = None,
                   theta: float | None = None) -> torch.Tensor:
    """The expert's MLP on x [T, H] over the neurons ``index`` (None: all) -> [T, H], read from a neuron-layout
    record whose header and those rows are in place. With ``theta`` each token also drops the neurons
    inactive for it (``compute: active``: a token of a prefill computes its own active set, as in decode)."""
    header = header if header is not None else layout.header(record)
    if index is None:
        index = torch.arange(layout.intermediate)
    rows = layout.rows(record, index).to(x.dtype)  # [S, 2H]: up row, down column
    gate = gate_projection(header, x, index)
    up = x @ rows[:, :layout.hidden].T
    if "up_bias" in header:
        up = up + header["up_bias"][index].to(x.dtype)
    hidden = module._apply_gate(pair(gate, up, pairing))
    if theta is not None:
        hidden = hidden * (activity(module, gate, pairing) > theta)
    y = hidden @ rows[:, layout.hidden:]
    if "down_bias" in header:
        y = y + header["down_bias"].to(x.dtype)
    return y


class TrustedPrediction(RoutingPolicy):
    """CORM proceeds with its prediction (``trust_prediction``): where the neuron path runs, MoE layer l computes
    the experts the ``neuron_gates`` predictor named from layer l-1's router input instead of its router's
    choice (the first MoE layer, with nothing named, keeps its router's). They are weighted by the router's
    own weight function on its logits (digest ambiguity 5: the true gate, renormalized as the model does)."""

    name = "trusted_prediction"

    def __init__(self, predictor, weights: dict, applies) -> None:
        """predictor: the bound ``loader.predict.NeuronGates``; weights: the manifest's ``routing_weights``;
        applies(tokens) -> whether a call of that many tokens takes the neuron path."""
        self.predictor, self.weights, self.applies = predictor, weights, applies
        self.decisions = self.replaced = 0

    def route(self, layer, logits, weights, indices, view=None):
        named = self.predictor.named_for(layer)
        if named is None or not self.applies(indices.shape[0]):
            return weights, indices
        k = indices.shape[-1]
        own = indices[0].tolist()
        chosen = (named + [e for e in own if e not in named])[:k]  # too few named: the router's next ones
        new = torch.tensor([chosen] * indices.shape[0], dtype=indices.dtype, device=indices.device)
        self.decisions += 1
        self.replaced += len(set(own) - set(chosen))
        self.predictor.router_choice[layer] = indices
        return selection_weights(self.weights, logits, new).to(weights.dtype), new

    def stats(self) -> dict:
        """Layer decisions taken from the prediction, and the router's experts they replaced."""
        return {"policy": self.name, "decisions": self.decisions, "experts_replaced": self.replaced}
