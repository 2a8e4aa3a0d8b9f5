"""The source model with its experts swapped for their decoded records: measuring a precision map in-process.

The sensitivity and bitwidth stages score configurations (which expert at which precision) by running
the source model with each expert's weights replaced by the decoded record the artifact would ship,
which is exactly what the loader computes with (the parity tests pin that). The pipeline shares one
model object between stages, so every change is made inside ``original_experts``, which puts the
source weights back however the block ends.

Work units (``prep/executor.py``) read their token sequences from a file rather than through the driver:
``save_sequences`` writes it, ``load_sequences`` reads it back with a digest that keys what a worker derives
from them (the source model's log-probabilities, kept in ``UnitContext.cache``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from loader.codec import RecordLayout
from loader.format import expert_key
from prep.errors import MoeprepError
from prep.methods.sensitivity import kl_sum, next_token_logprobs_of
from prep.streaming import stream_of


class DecodedExperts:
    """Decoded expert weights of a finished quantize stage (``prep.stages.quantize.PackedExperts``)."""

    def __init__(self, directory: Path, packed) -> None:
        self.directory, self.packed = Path(directory), packed
        self.layouts = {p: RecordLayout.from_json(s["layout"]) for p, s in packed.stores.items()}
        self.files = {p: dict(zip(packed.layers, s["files"], strict=True)) for p, s in packed.stores.items()}

    def tensors(self, precision: str, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Expert ``expert`` of model layer ``layer`` at ``precision``, in the experts module's parameter layout."""
        if precision not in self.layouts:
            raise MoeprepError(f"the quantize stage wrote no {precision} records (it wrote {sorted(self.layouts)}); "
                               f"add {precision} to quantize.also")
        with safe_open(str(self.directory / precision / self.files[precision][layer]), "pt") as f:
            record = f.get_tensor(expert_key(layer, expert))
        return self.layouts[precision].decode(record)

    def weights(self, adapter, precision: str, layer: int, expert: int):
        """The same expert as ``ExpertWeights`` (plain matrices)."""
        return adapter.expert_from_params(self.tensors(precision, layer, expert))

    def apply(self, model, adapter, precision_of: Callable[[int, int], str]) -> None:
        """Write every expert's decoded weights into ``model``: (MoE position, expert) -> precision. A streamed
        model (``prep/streaming.py``) reads them from here as each layer runs instead."""
        stream = stream_of(model, adapter)
        if stream is not None:
            position = {layer: pos for pos, layer in enumerate(adapter.moe_layers)}
            stream.use_source(lambda layer, e: self.weights(adapter, precision_of(position[layer], e), layer, e))
            return
        with torch.no_grad():
            for pos, layer in enumerate(adapter.moe_layers):
                module = adapter.experts(model, layer)
                for expert in range(adapter.num_experts):
                    for name, tensor in self.tensors(precision_of(pos, expert), layer, expert).items():
                        getattr(module, name)[expert].copy_(tensor)


@contextmanager
def original_experts(model, adapter) -> Iterator[None]:
    """Run the block, then put every expert parameter back exactly as it was (also on errors)."""
    stream = stream_of(model, adapter)
    if stream is not None:
        with stream.preserved():
            yield
        return
    saved = {(layer, name): p.detach().clone() for layer in adapter.moe_layers
             for name, p in adapter.experts(model, layer).named_parameters(recurse=False)}
    try:
        yield
    finally:
        with torch.no_grad():
            for (layer, name), tensor in saved.items():
                getattr(adapter.experts(model, layer), name).copy_(tensor)


@torch.no_grad()
def next_token_logprobs(model, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Log-probabilities [T-1, V] (float32) of every next token of every sequence."""
    device = next(model.parameters()).device
    return [next_token_logprobs_of(model(input_ids=seq.view(1, -1).to(device), use_cache=False).logits[0].cpu())
            for seq in sequences]


@torch.no_grad()
def mean_kl(reference: list[torch.Tensor], model, sequences: list[torch.Tensor]) -> float:
    """Mean over predicted positions of KL(reference || model) of the next-token distributions, in nats."""
    got = next_token_logprobs(model, sequences)
    total = sum(kl_sum(ref, g) for ref, g in zip(reference, got, strict=True))
    return total / max(sum(ref.shape[0] for ref in reference), 1)


def save_sequences(path: str | Path, sequences: list[torch.Tensor]) -> None:
    """Token sequences (1-D int64) to ``path`` as safetensors ``"0"``, ``"1"``, ..., written through a temporary
    sibling renamed into place, so a file there is complete."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({str(i): s.contiguous() for i, s in enumerate(sequences)}, str(tmp))
    tmp.replace(path)


def load_sequences(path: str | Path) -> tuple[list[torch.Tensor], str]:
    """(the sequences ``save_sequences`` wrote, sha256 of the file): the digest names their content, so state a
    process derives from them is never reused for other tokens."""
    from safetensors.torch import load

    data = Path(path).read_bytes()
    tokens = load(data)
    return [tokens[str(i)] for i in range(len(tokens))], hashlib.sha256(data).hexdigest()
