"""CORM's neuron-level loading, the offline side: neuron-layout records, the activation profile, the
read-cost crossover measured on this machine's disk, and the source model with inactive neurons dropped
(for choosing theta against an accuracy tolerance).

The activity rule and the expert MLP over a subset of neurons are the loader's (``loader/neuron.py``),
called here on the source model's own experts modules, so prep and loader agree on what "active" means.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from loader.codec import NeuronLayout, RecordLayout
from loader.neuron import activity, pair
from loader.store import ExpertStore, SlotArena
from prep.quant.records import write_aligned_records


def pairing_of(adapter) -> str:
    """How the experts module fuses gate and up: "interleaved" (gpt-oss) or "halves"."""
    return "interleaved" if adapter.layout.interleaved else "halves"


@torch.no_grad()
def activity_profile(model, adapter, trace, thetas: list[float]) -> dict:
    """Per MoE layer, the share of the selected experts' neurons active (|act(W1 x)| > theta) for each theta,
    over the traced tokens: {"thetas": [...], "layers": [[share per theta] per layer], "mean": [...]}."""
    pairing = pairing_of(adapter)
    out = []
    for layer in adapter.moe_layers:
        module = adapter.experts(model, layer)
        x = trace.router_inputs(layer).float()
        ids = trace.tensor(f"layers.{layer}.expert_ids")
        counts = torch.zeros(len(thetas))
        total = 0
        for expert in ids.unique().tolist():
            tokens = (ids == expert).any(-1).nonzero().flatten()
            weights = adapter.get_expert(model, layer, expert)
            gate = x[tokens].to(weights.gate.dtype) @ weights.gate.T
            if weights.gate_bias is not None:
                gate = gate + weights.gate_bias
            act = activity(module, gate, pairing).flatten()
            counts += torch.tensor([float((act > t).sum()) for t in thetas])
            total += act.numel()
        out.append((counts / max(total, 1)).tolist())
    mean = [sum(row[i] for row in out) / len(out) for i in range(len(thetas))]
    return {"thetas": list(thetas), "layers": out, "mean": mean}


@contextmanager
def dropped_neurons(model, adapter, theta: float):
    """The source model with every expert computing only each token's active neurons (|act(W1 x)| > theta), as
    the loader's neuron path does in decode with ``compute: active``: the accuracy bound of a theta."""
    pairing = pairing_of(adapter)
    handles = []

    def hook_for(layer: int):
        experts = {}

        def hook(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            out = torch.zeros_like(hidden)
            for expert in index.unique().tolist():
                if expert < 0:
                    continue
                tokens, slot = torch.where(index == expert)
                w = experts.get(expert)
                if w is None:
                    w = experts[expert] = adapter.get_expert(model, layer, expert)
                x = hidden[tokens]
                gate = x @ w.gate.T.to(x.dtype) + (w.gate_bias.to(x.dtype) if w.gate_bias is not None else 0)
                up = x @ w.up.T.to(x.dtype) + (w.up_bias.to(x.dtype) if w.up_bias is not None else 0)
                mask = activity(module, gate, pairing) > theta
                y = (module._apply_gate(pair(gate, up, pairing)) * mask) @ w.down.T.to(x.dtype)
                if w.down_bias is not None:
                    y = y + w.down_bias.to(x.dtype)
                out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
            return out

        return hook

    for layer in adapter.moe_layers:
        handles.append(adapter.experts(model, layer).register_forward_hook(hook_for(layer), with_kwargs=True))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def measure_crossover(records: dict[str, bytes], layout: RecordLayout, fractions: list[float],
                      repeats: int = 24, seed: int = 0, directory: Path | None = None) -> dict:
    """CORM's 75% rule measured on this disk: for each active share f, the time to read a record's header
    plus f of its neuron rows at random (one range per run of neurons) against the header plus every row
    (one range), through the loader's own store reads (O_DIRECT where the filesystem allows, each range
    widened to whole 4 KiB blocks and merged where they touch: ``ExpertStore.spans``). The crossover is
    the smallest f whose partial read is no faster than the whole one (1.0 when none)."""

    neuron = NeuronLayout(layout)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "probe.safetensors"
        write_aligned_records(path, records, layout.nbytes)
        store = ExpertStore(path, "probe")
        arena = SlotArena(1, store.stride, torch.device("cpu"))
        keys = list(records)

        def timed(ranges) -> float:  # as the loader reads them: O_DIRECT spans of whole blocks, merged
            key = rng.choice(keys)
            start = time.perf_counter()
            for s, n in store.spans(ranges):
                store.read_into(key, arena.host_view(0)[s:], s, n)
            return time.perf_counter() - start

        header = (0, neuron.rows_offset)
        whole_rows = (neuron.rows_offset, neuron.intermediate * neuron.row_bytes)
        try:
            timed([header, whole_rows])  # warm the code path
            whole = statistics.median(timed([header, whole_rows]) for _ in range(repeats))
            partial = {}
            for f in fractions:
                k = max(1, round(f * neuron.intermediate))
                times = []
                for _ in range(repeats):
                    rows = torch.zeros(neuron.intermediate, dtype=torch.bool)
                    rows[rng.sample(range(neuron.intermediate), k)] = True
                    times.append(timed([header, *neuron.ranges(rows)]))
                partial[f] = statistics.median(times)
        finally:
            store.close()
    crossover = next((f for f in fractions if partial[f] >= whole), 1.0)
    return {"crossover": crossover, "whole_seconds": whole, "partial_seconds": {str(f): t for f, t in partial.items()},
            "direct_io": store.direct_io, "record_bytes": layout.nbytes, "repeats": repeats}
