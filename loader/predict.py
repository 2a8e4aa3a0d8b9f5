"""Prefetch predictors: who names the experts to read before they are asked for.

A ``Predictor`` is called after each MoE layer's router (with the router input and the experts it
chose) and after the last decoder layer (with its hidden state, to name the first layer's experts of
the next token). It returns ``PrefetchRequest``s; the loader reads each named expert into its cache if
it is not there and room can be made, protects it from eviction until its layer has run, and counts
whether it was used. Prefetching never changes what is computed, only when records arrive.

The techniques (stacked next-layer gates, the first-layer gate, path statistics) subclass this; the
plan names them (``Plan.predictors``) and ``PREDICTORS`` maps those names to classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefetchRequest:
    """Read expert ``expert`` of MoE layer position ``layer``; ``precision`` None means the planned one."""

    layer: int
    expert: int
    precision: str | None = None


class Predictor:
    """Names experts to prefetch. The base predicts nothing."""

    def bind(self, num_layers: int, num_experts: int) -> None:
        """Called once when the loader starts."""
        self.num_layers = num_layers
        self.num_experts = num_experts

    def after_router(self, layer: int, router_input: torch.Tensor, indices: torch.Tensor) -> list[PrefetchRequest]:
        """layer: MoE layer position; router_input [T, H]; indices [T, K] (the experts chosen)."""
        return []

    def after_last_layer(self, hidden: torch.Tensor) -> list[PrefetchRequest]:
        """hidden [T, H]: the last decoder layer's output; requests here are for the next token."""
        return []

    def reset(self) -> None:
        """Start over (a new sequence)."""


PREDICTORS: dict[str, type[Predictor]] = {}
