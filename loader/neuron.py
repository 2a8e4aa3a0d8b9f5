"""CORM's neuron-level loading: which neurons of an expert are active, and the expert's MLP over a subset.

A neuron j of an expert is row j of W1 (gate) and W3 (up) and column j of W2 (down). It is *active* for
an input x when |act(W1 x)_j| > theta (CORM section 3). The paper does not say whether the activation
includes the W3 product; we take act(W1 x) alone, what W1 tells before W3 and W2 are read. ``act`` is the
experts module's own gate function evaluated with the up projection at 1, so every architecture's
activation is used as the model computes it (for gpt-oss this is (1 + 1) * glu: its theta is on that
scale; theta is calibrated per model anyway).

A neuron-layout record (``loader.codec.NeuronLayout``) holds W1 whole in its header and one contiguous
row per neuron (up row, down column). The runtime reads the header, finds the active set, and reads the
rows it lacks, or the whole rest above ``crossover`` (CORM's 75% rule); each cached expert keeps a mask
of its resident neurons, grown as the union of what it read (C3). The plan's ``neuron`` entry holds the
knobs (``NeuronConfig``). ``NeuronStep`` is the layer step on this path, a peer of the whole-expert step
(``loader/step.py``) on the engine (``loader/engine.py``); both take their decisions from ``loader/schedule.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from loader.codec import NeuronLayout
from loader.errors import LoaderError, MoeError
from loader.layer import StepHost
from loader.plan import PLAN_FILE, Plan, PlanError
from loader.routing import RoutingPolicy, selection_weights
from loader.schedule import BUFFER, Decision
from loader.store import DEMAND, PREFETCH, ReadJob

COMPUTE = ("resident", "active")


class NeuronError(MoeError):
    """A neuron configuration the loader cannot use; the message says what to change."""


@dataclass(frozen=True)
class NeuronConfig:
    """theta: the activity threshold; crossover: the active share above which the whole expert is read;
    compute: "resident" (every resident neuron of the expert, the default: more accurate at no extra
    read) or "active" (the token's active set only; CORM does not say which of the two it computes);
    trust_prediction: a predicted expert computes with the neurons the predictor read, missing active ones
    are not read on demand (CORM's own behaviour; off: wrong predictions are fixed on demand); prefill: also
    in prefill (off: decode only, since a prompt's union of active sets is nearly everything). With
    trust_prediction and the neuron_gates predictor the layers also compute the predicted experts instead of
    the router's (``TrustedPrediction``)."""

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
        if isinstance(cfg.theta, bool) or not isinstance(cfg.theta, (int, float)) or not math.isfinite(cfg.theta) \
                or cfg.theta < 0:
            raise NeuronError(f"neuron.theta must be a finite number >= 0, got {cfg.theta!r}")
        if isinstance(cfg.crossover, bool) or not isinstance(cfg.crossover, (int, float)) \
                or not 0 <= cfg.crossover <= 1:
            raise NeuronError(f"neuron.crossover must be a share in [0, 1], got {cfg.crossover!r}")
        if cfg.compute not in COMPUTE:
            raise NeuronError(f"neuron.compute must be one of {COMPUTE}, got {cfg.compute!r}")
        for name in ("trust_prediction", "prefill"):
            if not isinstance(getattr(cfg, name), bool):
                raise NeuronError(f"neuron.{name} must be true or false, got {getattr(cfg, name)!r}")
        return cfg


def neuron_config(plan: Plan, neuron, pairings: dict) -> NeuronConfig | None:
    """The neuron-level loading a load runs with: ``neuron`` True (the plan's knobs), False (off), a
    ``NeuronConfig`` (these knobs) or None (as the plan says), checked against the artifact's stores (``pairings``:
    precision -> pairing of each neuron-layout store). ``load`` and ``verify`` (with None) both call it."""
    if neuron is False or (neuron is None and plan.neuron.name == "off"):
        return None
    if isinstance(neuron, NeuronConfig):
        cfg = neuron
    else:
        if plan.neuron.name not in ("off", "sparse"):
            raise PlanError(f"{PLAN_FILE}: the neuron entry {plan.neuron.name!r} is unknown (known: off, sparse); "
                            "upgrade the loader or prepare the artifact again")
        try:
            cfg = NeuronConfig.from_params(plan.neuron.params)
        except (NeuronError, TypeError) as e:
            raise PlanError(f"{PLAN_FILE}: {e}; prepare the artifact again") from None
    if not pairings:
        raise LoaderError("neuron-level loading needs an artifact whose expert stores are in the neuron layout; "
                          "prepare it with `--set neuron.layout=neuron` (or leave neuron loading off)")
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
    own weight function on its logits (CORM does not say which gate weighs them; we take the true gate,
    renormalized as the model does)."""

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


@dataclass(frozen=True)
class NeuronRecordForm:
    """A neuron-layout record held as it is (its rows are read and decoded a few at a time); a whole-expert
    compute runs ``neuron_forward`` over every row."""

    layout: NeuronLayout
    pairing: str
    name = "record"
    staged = False

    @property
    def nbytes(self) -> int:
        return self.layout.layout.nbytes

    def make(self, record: torch.Tensor, region=None) -> torch.Tensor:
        return record

    def forward(self, module, record, x: torch.Tensor) -> torch.Tensor:
        return neuron_forward(module, self.layout, record, self.pairing, x)


@dataclass(eq=False)
class NeuronMiss:
    """One expert of a neuron layer call on its way to compute: the schedule's decision, the entry it computes
    from (None: a read buffer, ``buffer``), the read in flight, and once its header has landed: the header, the
    active neurons, the rows resident, the record in its slot and the row read that completes it."""

    decision: Decision
    entry: object = None
    buffer: int | None = None
    job: object = None
    brought: torch.Tensor | None = None  # rows the header's read brought along (a buffer's)
    header: dict | None = None
    wanted: torch.Tensor | None = None
    resident: torch.Tensor | None = None
    record: torch.Tensor | None = None
    rows: tuple | None = None  # (rows the read brings, its job)


class NeuronStep:
    """The layer step with neuron-level loading, a peer of the whole-expert step (``loader/step.py``) on the same
    host (``loader.layer.StepHost``): a miss reads the record's header (W1), W1 names the active neurons, and
    only the rows the slot lacks are read (``to_read``); hits add their missing active rows the same way.
    Headers are read for every miss first, then each expert's rows, so reads overlap."""

    def __init__(self, host: StepHost, cfg: NeuronConfig, pairings: dict) -> None:
        self.host, self.cfg, self.pairings = host, cfg, pairings
        self.layouts = {p: host.forms[p].layout for p in pairings}
        self._pending: list = []  # (entry, router input): predicted experts whose header is on its way
        self._inputs: dict = {}
        self.counts = dict.fromkeys(
            ("experts", "neurons", "active", "computed", "rows_read", "whole_reads", "partial_reads",
             "predicted_experts", "predicted_rows", "predicted_active", "active_predicted"), 0)

    def applies(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` tokens takes the neuron path (decode only unless ``prefill``)."""
        return bool(self.layouts) and (tokens == 1 or self.cfg.prefill)

    # ---------------------------------------------------------------------------------------- reads
    def _rows_job(self, layer: int, store, arena, slot: int, expert: int, rows: torch.Tensor, priority: int):
        """Read the neuron rows of the bool mask ``rows`` into ``slot``: (the job, every row the read brings,
        which with O_DIRECT's whole blocks may be more than asked). The bytes fetched count as read."""
        host, layout = self.host, self.layouts[store.precision]
        spans = store.spans(layout.ranges(rows))
        job = host.submit(ReadJob(store, host.key(layer, expert), (arena, slot), priority, spans))
        host.cache.count_read(layer, sum(length for _s, length in spans))
        brought = rows | layout.covered(spans)
        self.counts["rows_read"] += int(brought.sum())
        return job, brought

    def _header_job(self, layer: int, store, arena, slot: int, expert: int, priority: int):
        """Read a neuron record's header (W1 and the biases) into ``slot``: (the job, the rows its read brings
        along, the rest of its last 4 KiB block with O_DIRECT)."""
        host, layout = self.host, self.layouts[store.precision]
        spans = store.spans([(0, layout.rows_offset)])
        job = host.submit(ReadJob(store, host.key(layer, expert), (arena, slot), priority, spans))
        host.cache.count_read(layer, sum(length for _s, length in spans))
        return job, layout.covered(spans)

    def _land_rows(self, layer: int, held, wait: bool = True) -> None:
        """Merge a finished neuron read into the entry's mask (waiting for it when ``wait``): the union rule."""
        job = held.row_job
        if job is None or (not wait and job.state not in ("done", "failed", "cancelled")):
            return
        if wait:
            self.host.await_job(layer, job)
        if job.state == "done":
            held.neurons = held.neurons | held.row_mask
        held.row_job = held.row_mask = None

    def fill(self, layer: int, entry) -> None:
        """Make a partly read neuron record whole before a whole-expert compute (a prefill after decode)."""
        held = entry.payload
        if held is None or held.neurons is None:
            return
        host = self.host
        self._land_rows(layer, held)
        missing = ~held.neurons
        if bool(missing.any()):
            job, _ = self._rows_job(layer, host.stores[entry.precision], host.arenas[entry.pool], held.slot,
                                    entry.expert, missing, 0)
            host.await_job(layer, job)
        held.neurons = None
        held.weights = host.arenas[entry.pool].tensor(held.slot, host.stores[entry.precision].record_bytes)

    def to_read(self, resident: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The rows to read for ``active`` given ``resident``: the active ones missing, or every missing row
        once the expert would hold more than ``crossover`` of its neurons (a whole read costs less)."""
        need = active & ~resident
        if bool(need.any()) and float((resident | need).float().mean()) > self.cfg.crossover:
            need = ~resident
            self.counts["whole_reads"] += 1
        elif bool(need.any()):
            self.counts["partial_reads"] += 1
        return need

    # ------------------------------------------------------------------------------------ the layer step
    def run(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H]."""
        host = self.host
        # partial reads are this path's way to cut a miss's cost: its misses are never served on the CPU, never
        # in a prefill form, and the reads of neuron-layout records are counted here, by the bytes fetched
        whole = {p: b for p, b in host.read_bytes.items() if p not in self.layouts}
        start = host.begin(layer, top_k_index, top_k_weights, cpu=False, read_bytes=whole, prefill_forms=False)
        mix = start.mixer(hidden, top_k_index)
        self._pending = [(e, x) for e, x in self._pending if e.layer != layer]
        batch = []
        for d in start.decisions:
            item = NeuronMiss(d, d.entry)
            if d.served == BUFFER and not host.buffers.free:
                self._batch(layer, module, mix, batch)
                batch = []
            if d.miss:
                self._start_miss(layer, item)
            batch.append(item)
        self._batch(layer, module, mix, batch)
        host.finish_layer(layer)
        return mix.out

    def _start_miss(self, layer: int, item: NeuronMiss) -> None:
        """A miss: take a slot (the admitted entry's, else a read buffer) and start reading the header (a
        neuron record) or the whole record."""
        host, entry, d = self.host, item.entry, item.decision
        store = host.stores[d.precision]
        if entry is not None:
            arena, slot = host.arenas[entry.pool], host.take_slot(entry).slot
        else:
            arena, slot = host.buffers, host.take_buffer()
            item.buffer = slot
        if d.precision in self.layouts:
            job, item.brought = self._header_job(layer, store, arena, slot, d.expert, DEMAND)
            if entry is not None:
                entry.payload.neurons = item.brought
        else:
            job = host.submit(ReadJob(store, host.key(layer, d.expert), (arena, slot), DEMAND, form=host.forms[d.precision]))
        if entry is not None:
            entry.payload.job = job
        item.job = job

    def _batch(self, layer: int, module, mix, items: list) -> None:
        """Wait for each item's header, read the rows its active set lacks, then compute each over its rows."""
        for item in items:
            self._land_header(layer, item)
            if item.decision.precision in self.layouts:
                self._plan_rows(layer, module, mix, item)
        for item in items:
            self._compute_item(layer, module, mix, item)
            if item.buffer is not None:
                self.host.give_buffer(item.buffer)

    def _land_header(self, layer: int, item: NeuronMiss) -> None:
        host, entry = self.host, item.entry
        if entry is not None and entry.payload is not None and (entry.in_flight or entry.payload.job is not None):
            host.land(layer, entry)
        elif entry is None and item.job is not None:
            host.await_job(layer, item.job)

    def _plan_rows(self, layer: int, module, mix, item: NeuronMiss) -> None:
        """The header has landed: find the active neurons and start reading the rows the slot lacks."""
        host, cfg, entry, d = self.host, self.cfg, item.entry, item.decision
        layout = self.layouts[d.precision]
        if entry is not None:
            held = entry.payload
            self._land_rows(layer, held)
            arena, slot = host.arenas[entry.pool], held.slot
            resident = held.neurons if held.neurons is not None else torch.ones(layout.intermediate, dtype=torch.bool)
        else:
            arena, slot = host.buffers, item.buffer
            resident = item.brought if item.brought is not None else torch.zeros(layout.intermediate, dtype=torch.bool)
        record = arena.tensor(slot, host.stores[d.precision].record_bytes)
        _tokens, x, _ = mix.inputs(d.expert)
        header = layout.header(record)
        wanted = active_set(module, header, x, self.pairings[d.precision], cfg.theta)
        predicted = self._count_active(layout, wanted, entry)
        need = torch.zeros_like(wanted) if cfg.trust_prediction and predicted is not None else self.to_read(resident, wanted)
        item.header, item.wanted, item.resident, item.record = header, wanted, resident, record
        if bool(need.any()):
            job, brought = self._rows_job(layer, host.stores[d.precision], arena, slot, d.expert, need, DEMAND)
            item.rows = (brought, job)

    def _count_active(self, layout: NeuronLayout, wanted: torch.Tensor, entry) -> torch.Tensor | None:
        """Count the expert's active neurons, and against them the rows a predictor named (returned, then cleared)."""
        counts = self.counts
        counts["experts"] += 1
        counts["neurons"] += layout.intermediate
        counts["active"] += int(wanted.sum())
        predicted = entry.payload.predicted if entry is not None else None
        if predicted is not None:
            counts["predicted_experts"] += 1
            counts["predicted_rows"] += int(predicted.sum())
            counts["predicted_active"] += int((predicted & wanted).sum())
            counts["active_predicted"] += int(wanted.sum())
            entry.payload.predicted = None
        return predicted

    def _compute_item(self, layer: int, module, mix, item: NeuronMiss) -> None:
        host, entry, d = self.host, item.entry, item.decision
        if d.precision not in self.layouts:
            weights = entry.payload.weights if entry is not None else item.job.weights
            host.compute(module, d, weights, mix)
            return
        resident = item.resident
        if item.rows is not None:
            need, job = item.rows
            host.await_job(layer, job)
            resident = resident | need
            if entry is not None:
                entry.payload.neurons = resident
        rows = resident if self.cfg.compute == "resident" else item.wanted & resident
        self.counts["computed"] += int(rows.sum())
        self._compute(module, d, item.record, rows, item.header, mix)

    def _compute(self, module, d, record, rows: torch.Tensor, header: dict, mix) -> None:
        """The expert over the neurons of the bool mask ``rows``, each token over its own active ones with
        ``compute: active``."""
        start = time.perf_counter()
        index = None if bool(rows.all()) else rows.nonzero().flatten()
        per_token = self.cfg.theta if self.cfg.compute == "active" else None
        tokens, x, w = mix.inputs(d.expert)
        y = neuron_forward(module, self.layouts[d.precision], record, self.pairings[d.precision], x, index, header,
                           per_token)
        mix.add(tokens, y, w)
        self.host.step_times.computed += time.perf_counter() - start

    # -------------------------------------------------------------------------------------- prediction
    def prefetch(self, requests: list) -> None:
        """The engine's prefetch on this path: each admitted request with router inputs for a neuron-layout
        expert reads its header first (``_prefetch_header``), any other the whole record; requested experts held
        already get their neurons predicted now."""
        host = self.host
        self._take_inputs(requests)
        for entry in host.schedule.prefetch(requests, host.slot_bytes):
            if not self._prefetch_header(entry):
                host.read_entry(entry, PREFETCH)
                host.cache.count_read(entry.layer, host.read_bytes[entry.precision])
            host.track_prefetch(entry)
        self._predict_held()

    def _take_inputs(self, requests: list) -> None:
        """Keep the router inputs of requests for neuron-layout experts (their rows are predicted from them)."""
        host = self.host
        self._inputs = {}
        for r in requests:
            if r.inputs is None or not self.applies(r.inputs.shape[0]):
                continue
            precision = r.precision or host.plan.expert_precision[r.layer][r.expert] \
                if 0 <= r.layer < host.num_layers and 0 <= r.expert < host.num_experts else None
            if precision in self.layouts:
                self._inputs[(r.layer, r.expert, precision)] = r.inputs

    def _prefetch_header(self, entry) -> bool:
        """CORM: an admitted prefetch with router inputs reads its header (W1) first; its neurons once the
        header has landed. False: not such a prefetch (the whole record is read)."""
        x = self._inputs.pop((entry.layer, entry.expert, entry.precision), None)
        if x is None:
            return False
        host = self.host
        held = host.take_slot(entry)
        held.job, held.neurons = self._header_job(entry.layer, host.stores[entry.precision], host.arenas[entry.pool],
                                                  held.slot, entry.expert, PREFETCH)
        self._pending.append((entry, x))
        return True

    def _predict_held(self) -> None:
        """Requested experts held already: predict their neurons now."""
        for (layer, expert, precision), x in self._inputs.items():
            entry = self.host.cache.find(layer, expert, precision)
            if entry is not None and not entry.in_flight:
                self._predict_rows(entry, x)
        self._inputs = {}

    def _predict_rows(self, entry, x: torch.Tensor) -> None:
        """CORM's neuron prediction: the held W1 of a predicted expert on the earlier layer's router input names
        the active neurons; the rows the slot lacks are prefetched."""
        held = entry.payload
        if held is None or entry.in_flight or held.neurons is None or held.row_job is not None:
            return
        host = self.host
        layout = self.layouts[entry.precision]
        record = host.arenas[entry.pool].tensor(held.slot, host.stores[entry.precision].record_bytes)
        predicted = active_set(host.modules[entry.layer], layout.header(record), x, self.pairings[entry.precision],
                               self.cfg.theta)
        held.predicted = predicted
        need = self.to_read(held.neurons, predicted)
        if bool(need.any()):
            held.row_job, held.row_mask = self._rows_job(entry.layer, host.stores[entry.precision],
                                                         host.arenas[entry.pool], held.slot, entry.expert, need,
                                                         PREFETCH)

    def advance(self) -> None:
        """After a layer's compute: predicted experts whose header has landed get their neuron rows prefetched."""
        if not self._pending:
            return
        self.host.reap()  # headers that have landed become resident (they are prefetches like any other)
        still = []
        for entry, x in self._pending:
            if entry.payload is None:
                continue
            if entry.in_flight:
                still.append((entry, x))
            else:
                self._predict_rows(entry, x)
        self._pending = still

    def stats(self, predictors: list) -> dict:
        """Experts computed on the neuron path, their active and computed share, rows read, whole and partial
        reads, and the predictor's accuracy at expert and neuron level."""
        c = self.counts
        experts = next((p.stats() for p in predictors if p.name == "neuron_gates"), None)
        return c | {
            "theta": self.cfg.theta, "crossover": self.cfg.crossover, "compute": self.cfg.compute,
            "trust_prediction": self.cfg.trust_prediction,
            "active_share": c["active"] / c["neurons"] if c["neurons"] else None,
            "computed_share": c["computed"] / c["neurons"] if c["neurons"] else None,
            # of the neurons active at a predicted expert, the share the prediction named
            "neuron_recall": c["predicted_active"] / c["active_predicted"] if c["active_predicted"] else None,
            # of the neurons the prediction named, the share that were active
            "neuron_precision": c["predicted_active"] / c["predicted_rows"] if c["predicted_rows"] else None,
            "expert_prediction": experts,
        }
