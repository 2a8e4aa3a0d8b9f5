"""What one MoE layer step works with, shared by the whole-expert step (``loader/step.py``) and the neuron step
(``loader/neuron.py``): ``Held``, the runtime state of a cache entry; ``Mixer``, the weighted sum of the experts'
outputs; ``renormalized``, the weights after skips."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loader.store import ReadJob


@dataclass(eq=False)
class Held:
    """The runtime's state of one cache entry (its ``payload``): the slot, the read in flight, what the held
    form made, and for neuron-layout records which rows are in the slot."""

    slot: int
    job: ReadJob | None = None
    weights: object = None
    read_seconds: float = 0.0  # how long the read took (a landed prefetch: what a demand would have waited)
    neurons: object = None  # bool [I] rows in the slot (None: the whole record)
    row_job: ReadJob | None = None  # a neuron read in flight, and the rows it brings
    row_mask: object = None
    predicted: object = None  # the rows a predictor named for this expert


class Mixer:
    """The weighted sum of one layer call's expert outputs. A decode step (one token) indexes nothing: each
    expert's weight is a number from the lists read once per layer, and its output is added in one op."""

    def __init__(self, hidden: torch.Tensor, rows: list, weights: list, index: torch.Tensor, top_k_weights: torch.Tensor,
                 out: torch.Tensor) -> None:
        self.hidden, self.out = hidden, out
        self.single = hidden.shape[0] == 1
        if self.single:
            self.weight_of = {e: w for e, w in zip(rows[0], weights[0], strict=True) if e >= 0}
        else:
            self.weights = top_k_weights
            self.chosen = index.masked_fill(top_k_weights == 0, -1)

    def inputs(self, expert: int):
        """(token index [T_e], or None for the one token; x [T_e, H]; weights [T_e, 1], or a number)."""
        if self.single:
            return None, self.hidden, self.weight_of[expert]
        tokens, slot = torch.where(self.chosen == expert)
        return tokens, self.hidden[tokens], self.weights[tokens, slot, None]

    def add(self, tokens, y: torch.Tensor, w) -> None:
        if y.dtype != self.out.dtype:
            y = y.to(self.out.dtype)
        if tokens is None:
            self.out.add_(y, alpha=w)
        else:
            self.out.index_add_(0, tokens, y * w)


def renormalized(weights: torch.Tensor, chosen: torch.Tensor, skipped: list[int]) -> torch.Tensor:
    """weights [T, K] with the selections of ``skipped`` experts zeroed and each token's rest rescaled to the
    token's former total (a token whose every selection was skipped keeps zeros)."""
    gone = torch.isin(chosen, torch.tensor(skipped, device=chosen.device))
    kept = weights.masked_fill(gone, 0)
    total, rest = weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
    return torch.where(rest != 0, kept * (total / rest.where(rest != 0, torch.ones_like(rest))), kept)
