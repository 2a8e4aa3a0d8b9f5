"""What one MoE layer step works with, shared by the whole-expert step (``loader/step.py``) and the neuron step
(``loader/neuron.py``): ``StepHost``, the typed interface of the engine they run on (``loader/engine.py``), the only
members of it a step may use; ``LayerStart``, what the schedule decided for the call; ``Held``, the runtime state of
a cache entry; ``Mixer``, the weighted sum of the experts' outputs; ``renormalized``, the weights after skips."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class StepTimes:
    """One layer call's seconds: computing experts, waiting for reads, and the one device sync of its routing."""

    computed: float = 0.0
    stalled: float = 0.0
    synced: float = 0.0

    def reset(self) -> None:
        self.computed = self.stalled = self.synced = 0.0


@dataclass(slots=True)
class LayerStart:
    """The schedule's answer for one layer call (``StepHost.begin``): the decisions (``loader.schedule.Decision``,
    every miss placed), the routing after skips as lists (rows [T][K] of expert ids, -1 where a selection has
    weight 0, and their weights) and as weights [T, K], and the layer's prefetched entries before the call."""

    decisions: list
    rows: list
    weights: list
    top_k_weights: torch.Tensor
    prefetched: dict

    def mixer(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> Mixer:
        """The weighted sum this call's experts add to, zero to begin with."""
        return Mixer(hidden, self.rows, self.weights, top_k_index, self.top_k_weights, torch.zeros_like(hidden))


class StepHost(Protocol):
    """What a layer step may use of the engine (``loader.engine.ExpertEngine``): its state and its I/O primitives.
    A test holds both steps to these members, so a step's needs are written here, once."""

    plan: Any  # loader.plan.Plan
    cache: Any  # loader.cache.ExpertCache
    schedule: Any  # loader.schedule.LayerSchedule
    stores: dict  # precision -> store
    forms: dict  # precision -> held form
    arenas: dict  # pool name -> SlotArena
    buffers: Any  # SlotArena: the read buffers
    prefill_buffers: Any  # SlotArena of the prefill forms, or None
    prefill_forms: dict  # precision -> (prefill form, from tokens)
    read_bytes: dict  # precision -> bytes of one record read
    slot_bytes: dict  # precision -> bytes of one slot
    modules: list  # the experts module of each MoE layer
    counters: Any  # loader.engine.Counters
    step_times: StepTimes
    num_layers: int
    num_experts: int

    def begin(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, cpu: bool = True,
              read_bytes: dict | None = None, prefill_forms: bool = True) -> LayerStart: ...

    def finish_layer(self, layer: int) -> None: ...

    def key(self, layer: int, expert: int) -> str: ...

    def submit(self, job: Any) -> Any: ...

    def take_slot(self, entry: Any) -> Held: ...

    def read_entry(self, entry: Any, priority: int) -> Any: ...

    def note_read(self, expert: int) -> None: ...

    def take_buffer(self, arena: Any = None) -> int: ...

    def give_buffer(self, slot: int, arena: Any = None) -> None: ...

    def await_job(self, layer: int, job: Any) -> None: ...

    def land(self, layer: int, entry: Any) -> None: ...

    def reap(self) -> None: ...

    def track_prefetch(self, entry: Any) -> None: ...

    def compute(self, module: Any, d: Any, weights: Any, mix: Mixer, form: Any = None) -> None: ...

    def compute_together(self, module: Any, ds: list, mix: Mixer) -> list: ...

    def cpu_form(self, precision: str) -> Any: ...


@dataclass(eq=False)
class Held:
    """The runtime's state of one cache entry (its ``payload``): the slot, the read in flight, what the held
    form made, and for neuron-layout records which rows are in the slot."""

    slot: int
    job: Any = None  # the ``loader.store.ReadJob`` in flight
    weights: object = None
    read_seconds: float = 0.0  # how long the read took (a landed prefetch: what a demand would have waited)
    neurons: object = None  # bool [I] rows in the slot (None: the whole record)
    row_job: Any = None  # a neuron read in flight, and the rows it brings
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
