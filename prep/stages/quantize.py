"""Stage ``quantize``: every expert packed at the recipe's precision, one record per expert.

Needs the model only (no traces, no calibration data), so its key covers the quantize section and the
model fingerprint and nothing else. Work is written one MoE layer at a time (``layer-<l>.safetensors``,
atomically), so an interrupted run resumes at the first layer not yet written; HQQ on CPU is
deterministic, so a resumed run yields the same bytes as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save
from tqdm import tqdm

from loader.files import write_bytes_atomic
from loader.format import expert_key
from prep.quant.hqq_codec import encode_expert
from prep.recipe import QuantizeSection
from prep.stages import Stage, StageResult

VERSION = 1


@dataclass(frozen=True)
class PackedExperts(StageResult):
    precision: str
    group_size: int
    layout: list  # RecordLayout.to_json()
    record_bytes: int
    layers: list  # model layer indices of the MoE layers
    num_experts: int
    files: list  # one per MoE layer: layer-<l>.safetensors

    def records(self, directory: Path) -> Mapping[str, bytes]:
        """Every record, keyed ``layers.{l}.experts.{e}`` in layer then expert order, read lazily."""
        return _StoredRecords(Path(directory), self)


class _StoredRecords(Mapping):
    """The records of a finished quantize stage, read one layer file at a time (never all in memory)."""

    def __init__(self, directory: Path, packed: PackedExperts) -> None:
        self.directory, self.packed = directory, packed

    def __iter__(self) -> Iterator[str]:
        return (expert_key(layer, e) for layer in self.packed.layers for e in range(self.packed.num_experts))

    def __len__(self) -> int:
        return len(self.packed.layers) * self.packed.num_experts

    def __getitem__(self, key: str) -> bytes:
        layer = int(key.split(".")[1])
        with safe_open(str(self.directory / f"layer-{layer}.safetensors"), "pt") as f:
            return f.get_tensor(key).numpy().tobytes()

    def items(self) -> Iterator[tuple[str, bytes]]:  # one open per layer file
        for layer, name in zip(self.packed.layers, self.packed.files, strict=True):
            with safe_open(str(self.directory / name), "pt") as f:
                for e in range(self.packed.num_experts):
                    key = expert_key(layer, e)
                    yield key, f.get_tensor(key).numpy().tobytes()


def expert_tensors(adapter, model, layer: int, expert: int) -> tuple[dict, bool]:
    """One expert's tensors in the experts module's own per-expert layout, and whether it is transposed."""
    module = adapter.experts(model, layer)
    tensors = {name: p[expert].detach() for name, p in module.named_parameters(recurse=False)}
    return tensors, bool(getattr(module, "is_transposed", False))


def quantize_experts(model, adapter, cfg: QuantizeSection, work: Path) -> PackedExperts:
    """Write ``work/layer-<l>.safetensors`` for every MoE layer; returns the layout and file list."""
    layout = None
    files = []
    units = [(layer, e) for layer in adapter.moe_layers for e in range(adapter.num_experts)]
    bar = tqdm(total=len(units), desc=f"quantize {cfg.precision}", unit="expert")
    for layer in adapter.moe_layers:
        path = work / f"layer-{layer}.safetensors"
        files.append(path.name)
        if path.is_file():  # finished before an interruption
            bar.update(adapter.num_experts)
            if layout is None:
                tensors, transposed = expert_tensors(adapter, model, layer, 0)
                layout, _ = encode_expert(tensors, cfg.precision, cfg.group_size, transposed)
            continue
        records = {}
        for expert in range(adapter.num_experts):
            tensors, transposed = expert_tensors(adapter, model, layer, expert)
            layout, record = encode_expert(tensors, cfg.precision, cfg.group_size, transposed)
            records[expert_key(layer, expert)] = record
            bar.update(1)
        write_bytes_atomic(path, save(records))
    bar.close()
    return PackedExperts(precision=cfg.precision, group_size=cfg.group_size, layout=layout.to_json(),
                         record_bytes=layout.nbytes, layers=list(adapter.moe_layers),
                         num_experts=adapter.num_experts, files=files)


STAGE = Stage(
    name="quantize", version=VERSION, config=QuantizeSection, result=PackedExperts,
    needs=frozenset({"model"}),
    run=lambda inputs: quantize_experts(inputs.model, inputs.adapter, inputs.config, inputs.work),
)
