"""Expert sensitivity: how much the model suffers when one expert alone drops to a lower precision.

EdgeMoE (section 3.2, Fig. 7(a)) orders experts by the damage of moving each one alone to INT2 while all
others stay at the base precision; the bit-width search lowers the least sensitive first. Per-expert task
accuracy is mostly noise, so the damage here is a continuous, low-noise proxy on calibration tokens:

- ``kl_sweep``: the mean KL(p_base || p_modified) of next-token distributions, one run per expert.
  Lowering expert (p, e) changes nothing before decoder layer ``moe_layers[p]``, so the residual
  stream entering that layer is cached from the base model once and each run replays only the layers
  from there on (about half the cost of full forwards). Resumable per MoE layer.
- ``trace_prerank``: ours, not in EdgeMoE (a cheap stand-in for its sweep), no forward pass: each expert's
  output error on the recorded router inputs, weighted by the squared routing weights. Cheap enough for
  thousands of experts.
- ``spearman``: the rank correlation between two such profiles (how well the pre-rank predicts).

Shape legend: T tokens, L layers (MoE layers, by position p), E experts, K top-k, H hidden, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_map

from prep.adapters.base import ExpertWeights, MoeAdapter
from prep.errors import MoeprepError

LowWeights = Callable[[int, int], ExpertWeights]  # (model layer, expert) -> that expert at some precision


# --- layer-local replay ----------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by a capture hook to end a forward pass once the wanted layer output is recorded."""


def _clone(output):
    # Decoder layers return a tensor in transformers 5 (a tuple in 4.x): clone whatever it is, so
    # that a later layer working in place on its input cannot corrupt the cache.
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, output)


class _Replay(nn.Module):
    """Stands in for a decoder layer before the replay start: returns the cached output of the layer
    just before the start, in the format that layer returned, and computes nothing.

    Every skipped layer returns the same cached object; only the last one's output reaches the first
    real layer. The model's own forward still builds the masks and rotary embeddings.
    """

    def __init__(self) -> None:
        super().__init__()
        self.output = None

    def forward(self, *args, **kwargs):
        return _clone(self.output)


class _LayerLocal:
    """Runs one sequence through `model` from decoder layer `start`, the layers before it replaced by a
    cached output, optionally recording (and stopping after) the output of decoder layer `capture`."""

    def __init__(self, model: nn.Module, adapter: MoeAdapter) -> None:
        self.model = model
        self.layers = adapter.decoder_layers(model)
        self.replay = _Replay()
        self.device = next(model.parameters()).device

    @contextmanager
    def starting_at(self, start: int):
        """Replace decoder layers [0, start) by the replay stub; put them back however the block ends."""
        originals = [self.layers[i] for i in range(start)]
        try:
            for i in range(start):
                self.layers[i] = self.replay
            yield
        finally:
            for i, layer in enumerate(originals):
                self.layers[i] = layer

    def run(self, seq: torch.Tensor, cached, *, capture: int | None = None, stop: bool = False):
        """One forward of `seq` (the replay stub, if installed, returns `cached`).

        Returns (logits [T, V] or None when stopped, the output of layer `capture` or None).
        """
        self.replay.output = cached
        seen = []

        def hook(module, args, output):
            seen.append(_clone(output))
            if stop:
                raise _Stop

        handle = self.layers[capture].register_forward_hook(hook) if capture is not None else None
        try:
            logits = self.model(input_ids=seq.view(1, -1).to(self.device), use_cache=False).logits[0]
        except _Stop:
            logits = None
        finally:
            self.replay.output = None
            if handle is not None:
                handle.remove()
        return logits, (seen[0] if seen else None)


def next_token_logprobs_of(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> log-probabilities [T-1, V] float32 of the tokens each position predicts."""
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def kl_sum(base: torch.Tensor, other: torch.Tensor) -> float:
    """Sum over positions of KL(base || other), both log-probabilities [T, V]; 0 * log 0 counts as 0."""
    p = base.exp()
    terms = torch.where(p > 0, p * (base - other), torch.zeros_like(p))
    return float(terms.sum(dtype=torch.float64))


def check_sequences(sequences) -> list[torch.Tensor]:
    """The calibration sequences as 1-D int64 tensors; one clear error for an empty, flat or non-integer set."""
    seqs = []
    for i, seq in enumerate(sequences):
        seq = torch.as_tensor(seq)
        if seq.dim() != 1 or seq.dtype not in (torch.int64, torch.int32):
            raise MoeprepError(f"calibration sequence {i} must be a 1-D integer tensor, got {seq.dtype} "
                               f"of shape {tuple(seq.shape)}")
        if seq.numel() == 0:
            raise MoeprepError(f"calibration sequence {i} is empty; drop it or regenerate the calibration data")
        seqs.append(seq.long())
    if not seqs:
        raise MoeprepError("no calibration sequences to measure sensitivity on; set calibration.num_sequences > 0")
    if sum(s.numel() - 1 for s in seqs) == 0:
        raise MoeprepError("every calibration sequence has a single token, so no next token is predicted; "
                           "use sequences of at least 2 tokens")
    return seqs


def _check_done(done: Mapping[int, Sequence[float]] | None, num_layers: int, num_experts: int) -> dict:
    rows = {}
    for pos, row in (done or {}).items():
        if not (isinstance(pos, int) and 0 <= pos < num_layers) or len(row) != num_experts:
            raise MoeprepError(f"resumed sensitivity row for MoE layer position {pos!r} does not fit this model "
                               f"({num_layers} MoE layers x {num_experts} experts); delete the partial results")
        rows[pos] = [float(v) for v in row]
    return rows


@torch.no_grad()
def kl_sweep(
    model: nn.Module,
    adapter: MoeAdapter,
    sequences: Sequence[torch.Tensor],
    low: LowWeights,
    *,
    done: Mapping[int, Sequence[float]] | None = None,
    on_layer: Callable[[int, list[float]], None] | None = None,
    desc: str = "sensitivity",
    positions: Sequence[int] | None = None,
    state: dict | None = None,
    progress: bool = True,
) -> list[list[float]]:
    """The damage of lowering each expert alone: drop[p][e], in nats.

    model: a transformers MoE `*ForCausalLM` whose experts hold the base-precision weights (the
    reference). sequences: 1-D token tensors. low(layer, expert): that expert (model layer index) at
    the low precision. drop[p][e] is the mean over all predicted positions of all sequences of
    KL(p_base || p_modified) of the next-token distributions, with expert e of MoE layer
    ``adapter.moe_layers[p]`` alone set to ``low``. Each expert is restored exactly after its run and
    the model is left bit-identical, also on errors.

    done: rows already computed, by MoE layer position, which are skipped (resume); on_layer(p, row) is
    called as each remaining layer position finishes (so a caller can save it). Returns [L][E] floats.

    positions: compute only these layer positions (one work unit of a distributed sweep) and return their
    rows, in that order. state: a dict kept by the caller between calls on the same model, base weights and
    sequences, in which the base pass and the cached layer input are kept (a worker running several units
    computes the base pass once); a row is the same with or without it.
    """
    seqs = check_sequences(sequences)
    moe_layers = adapter.moe_layers
    rows = _check_done(done, len(moe_layers), adapter.num_experts)
    wanted = range(len(moe_layers)) if positions is None else sorted(positions)
    pending = [p for p in wanted if p not in rows]
    if not pending:
        return [rows[p] for p in (range(len(moe_layers)) if positions is None else positions)]
    count = sum(s.numel() - 1 for s in seqs)  # predicted positions
    runner = _LayerLocal(model, adapter)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout would turn the KL into noise
    from tqdm import tqdm

    state = {} if state is None else state
    try:
        with tqdm(total=len(pending) * adapter.num_experts, desc=desc, unit="expert", disable=not progress) as bar:
            # The base pass: reference log-probs (kept on the CPU: T x V per sequence is the big item).
            if "base" not in state:
                state["base"] = [next_token_logprobs_of(runner.run(s, None)[0]).cpu() for s in seqs]
                state["start"], state["cached"] = 0, [None] * len(seqs)
            base = state["base"]
            cached, start = state["cached"], state["start"]  # cached[i]: output of decoder layer start-1 for seqs[i]
            for p in pending:
                layer = moe_layers[p]
                if layer < start:  # a layer before the cached one: replay from the embeddings
                    cached, start = [None] * len(seqs), 0
                if layer > start:  # advance the cache to the input of `layer`, running only the layers between
                    with runner.starting_at(start):
                        cached = [runner.run(s, c, capture=layer - 1, stop=True)[1]
                                  for s, c in zip(seqs, cached, strict=True)]
                    start = layer
                row = []
                with runner.starting_at(start):
                    for e in range(adapter.num_experts):
                        row.append(_expert_kl(runner, adapter, layer, e, low, seqs, cached, base) / count)
                        bar.update()
                rows[p] = row
                state["start"], state["cached"] = start, cached
                if on_layer is not None:
                    on_layer(p, list(row))
    finally:
        for module, training in modes:
            module.training = training
    return [rows[p] for p in (range(len(moe_layers)) if positions is None else positions)]


def _expert_kl(runner: _LayerLocal, adapter: MoeAdapter, layer: int, expert: int, low: LowWeights,
               seqs: list[torch.Tensor], cached: list, base: list[torch.Tensor]) -> float:
    """Summed KL over all predicted positions with one expert lowered; the expert is restored after."""
    weights = low(layer, expert)
    original = adapter.get_expert(runner.model, layer, expert)
    try:
        adapter.set_expert(runner.model, layer, expert, weights)
        total = 0.0
        for seq, c, ref in zip(seqs, cached, base, strict=True):
            logits, _ = runner.run(seq, c)
            got = next_token_logprobs_of(logits)
            total += kl_sum(ref.to(got.device), got)
        return total
    finally:
        adapter.set_expert(runner.model, layer, expert, original)


# --- trace-only pre-rank ---------------------------------------------------------------------------


def _as_rows(part, what: str, pos: int) -> torch.Tensor:
    # One layer position's recorded rows: a tensor, or a list of per-shard/per-sequence tensors.
    if isinstance(part, torch.Tensor):
        return part
    parts = list(part)
    if not parts:
        raise MoeprepError(f"no recorded {what} for MoE layer position {pos}")
    return torch.cat([torch.as_tensor(t) for t in parts])


@torch.no_grad()
def trace_prerank(
    adapter: MoeAdapter,
    base: LowWeights,
    low: LowWeights,
    router_inputs: Sequence,
    expert_ids: Sequence,
    expert_weights: Sequence,
) -> list[list[float]]:
    """A trace-only pre-rank for EdgeMoE's ordering (ours, not in the paper): err[p][e], no forward pass.

    err[p][e] = sum over recorded tokens t routed to e at MoE layer p of
    w_{t,e}^2 * ||f_base_e(x_t) - f_low_e(x_t)||^2, with f the adapter's expert MLP (in float32).
    router_inputs, expert_ids, expert_weights: one entry per MoE layer position, each [T, H], [T, K],
    [T, K] (a tensor or a list of tensors to concatenate, e.g. from ``prep.methods.trace.RecordedTrace``).
    base(layer, e) / low(layer, e): the expert (model layer index) at each precision; an expert no
    recorded token chose scores 0 and is not fetched. Returns [L][E] floats.
    """
    moe_layers = adapter.moe_layers
    lengths = {len(router_inputs), len(expert_ids), len(expert_weights)}
    if lengths != {len(moe_layers)}:
        raise MoeprepError(f"trace pre-rank needs router inputs, expert ids and weights for each of the "
                           f"{len(moe_layers)} MoE layers, got {len(router_inputs)}, {len(expert_ids)}, "
                           f"{len(expert_weights)}; record the trace with router inputs (record_hidden)")
    errors = []
    for pos, layer in enumerate(moe_layers):
        x = _as_rows(router_inputs[pos], "router inputs", pos).float()  # [T, H]
        ids = _as_rows(expert_ids[pos], "expert ids", pos).long()  # [T, K]
        gates = _as_rows(expert_weights[pos], "expert weights", pos).float()  # [T, K]
        if ids.shape != gates.shape or ids.dim() != 2 or x.shape != (ids.shape[0], adapter.hidden_size):
            raise MoeprepError(f"MoE layer position {pos}: router inputs {tuple(x.shape)}, expert ids "
                               f"{tuple(ids.shape)} and weights {tuple(gates.shape)} do not match [T, H], [T, K]")
        row = []
        for e in range(adapter.num_experts):
            tokens, slot = torch.where(ids == e)
            if tokens.numel() == 0:
                row.append(0.0)
                continue
            xs = x[tokens]  # [n, H]
            diff = (adapter.expert_forward(base(layer, e).to(torch.float32), xs)
                    - adapter.expert_forward(low(layer, e).to(torch.float32), xs))  # [n, H]
            w2 = gates[tokens, slot].double() ** 2
            row.append(float((w2 * diff.double().pow(2).sum(-1)).sum()))
        errors.append(row)
    return errors


# --- rank correlation --------------------------------------------------------------------------------


def _flatten(values, path: str = "") -> tuple[list[float], object]:
    # Nested lists -> (flat values, shape signature), so two profiles can be checked for equal shapes.
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (list, tuple)):
        flat, shape = [], []
        for v in values:
            f, s = _flatten(v)
            flat.extend(f)
            shape.append(s)
        return flat, tuple(shape)
    return [float(values)], None


def _average_ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a, b) -> float:
    """Spearman rank correlation of two equally shaped nested lists (ties get average ranks).

    It says how well one sensitivity profile (the pre-rank) orders experts like another (the sweep),
    which is all the bit-width search uses. NaN when either side is constant (undefined).
    """
    fa, sa = _flatten(a)
    fb, sb = _flatten(b)
    if sa != sb:
        raise MoeprepError("spearman needs two profiles of the same shape")
    if len(fa) < 2:
        raise MoeprepError(f"spearman needs at least 2 values, got {len(fa)}")
    ra, rb = _average_ranks(fa), _average_ranks(fb)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return math.nan
    return cov / math.sqrt(va * vb)
