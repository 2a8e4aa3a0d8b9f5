"""Stage ``quantize``: every expert packed at each precision the recipe names, one record per expert.

Needs the model only (no traces, no calibration data), so its key covers the quantize section and the
model fingerprint and nothing else. Every precision gets its own directory; work is written one MoE
layer at a time (``<precision>/layer-<l>.safetensors``, atomically), so an interrupted run resumes at the
first layer not yet written; HQQ on CPU is deterministic, so a resumed run yields the same bytes as an
uninterrupted one. Which expert ships at which precision is the ``bitwidth`` stage's choice; this stage
writes every expert at every listed precision so that choice never needs quantizing again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from tqdm import tqdm

from loader.codec import DEFAULT_FORMATS, RecordLayout
from loader.format import expert_key
from loader.vocab import PRECISIONS
from prep.errors import MoeprepError
from prep.quant.hqq_codec import encode_expert, matrix_spec
from prep.quant.records import write_record_file
from prep.stages import Stage, StageResult
from prep.streaming import resident_layer

VERSION = 2


@dataclass(frozen=True)
class QuantizeSection:
    """Expert precisions: ``passthrough`` keeps the source dtype; intN is HQQ with ``group_size`` weights per
    scale/zero and, with ``meta_group`` > 0, those scales and zeros themselves stored in 8 bits per
    ``meta_group`` groups (0: float16). None takes each precision's default (``loader.codec.DEFAULT_FORMATS``).
    ``precision`` is the base every expert is quantized at; ``also`` lists more precisions every expert is
    quantized at, for the ``sensitivity`` and ``bitwidth`` stages to choose from."""

    precision: str = "int4"
    group_size: int | None = None
    meta_group: int | None = None
    also: tuple[str, ...] = ()

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision the stage writes, base first."""
        return tuple(dict.fromkeys((self.precision, *self.also)))

    def format_of(self, precision: str) -> tuple[int, int]:
        """(group_size, meta_group) of ``precision`` (0, 0 for passthrough)."""
        if precision == "passthrough":
            return 0, 0
        group, meta = DEFAULT_FORMATS[precision]
        return (group if self.group_size is None else self.group_size,
                meta if self.meta_group is None else self.meta_group)

    def __post_init__(self) -> None:
        for where, precision in [("quantize.precision", self.precision), *(("quantize.also", p) for p in self.also)]:
            if precision not in PRECISIONS:
                raise MoeprepError(f"{where}: precision {precision!r} unknown; use one of {PRECISIONS}")
        if self.group_size is not None and self.group_size <= 0:
            raise MoeprepError("quantize.group_size must be positive (or left out for each precision's default)")
        if self.meta_group is not None and self.meta_group < 0:
            raise MoeprepError("quantize.meta_group must be 0 (float16 scales) or positive (or left out)")


@dataclass(frozen=True)
class PackedExperts(StageResult):
    precision: str  # the base precision
    stores: dict  # precision -> {group_size, meta_group, layout (RecordLayout.to_json()), record_bytes, files}
    layers: list  # model layer indices of the MoE layers
    num_experts: int

    def layout(self, precision: str) -> RecordLayout:
        return RecordLayout.from_json(self.stores[precision]["layout"])

    def records(self, directory: Path, precision: str | None = None, keep=None) -> Mapping[str, bytes]:
        """The records at ``precision`` (default: the recipe's ``quantize.precision``) of the experts (l, e)
        with ``keep(l, e)`` (by default all), keyed ``layers.{l}.experts.{e}`` in layer then expert order,
        read lazily."""
        precision = precision or self.precision
        return _StoredRecords(Path(directory) / precision, self, self.stores[precision]["files"], keep)


class _StoredRecords(Mapping):
    """The records of a finished quantize stage, read one layer file at a time (never all in memory)."""

    def __init__(self, directory: Path, packed: PackedExperts, files: list, keep=None) -> None:
        self.directory, self.packed = directory, packed
        self.files = dict(zip(packed.layers, files, strict=True))
        self.units = [(layer, e) for layer in packed.layers for e in range(packed.num_experts)
                      if keep is None or keep(layer, e)]

    def __iter__(self) -> Iterator[str]:
        return (expert_key(layer, e) for layer, e in self.units)

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, key: str) -> bytes:
        layer = int(key.split(".")[1])
        with safe_open(str(self.directory / self.files[layer]), "pt") as f:
            return f.get_tensor(key).numpy().tobytes()

    def items(self) -> Iterator[tuple[str, bytes]]:  # one open per layer file
        for layer, name in self.files.items():
            experts = [e for unit_layer, e in self.units if unit_layer == layer]
            if not experts:
                continue
            with safe_open(str(self.directory / name), "pt") as f:
                for e in experts:
                    key = expert_key(layer, e)
                    yield key, f.get_tensor(key).numpy().tobytes()


def expert_tensors(adapter, model, layer: int, expert: int) -> tuple[dict, bool]:
    """One expert's tensors in the experts module's own per-expert layout, and whether it is transposed."""
    module = adapter.experts(model, layer)
    tensors = {name: p[expert].detach() for name, p in module.named_parameters(recurse=False)}
    return tensors, bool(getattr(module, "is_transposed", False))


def _encoded(model, adapter, layer: int, precision: str, group: int, meta: int, bar):
    """The records of every expert of ``layer``, one at a time (what the layer file is written from)."""
    for expert in range(adapter.num_experts):
        tensors, transposed = expert_tensors(adapter, model, layer, expert)
        yield encode_expert(tensors, precision, group, transposed, meta_group=meta)[1]
        bar.update(1)


def quantize_experts(model, adapter, cfg: QuantizeSection, work: Path) -> PackedExperts:
    """Write ``work/<precision>/layer-<l>.safetensors`` for every precision and MoE layer."""
    stores = {}
    for precision in cfg.precisions:
        group, meta = cfg.format_of(precision)
        directory = work / precision
        directory.mkdir(exist_ok=True)
        tensors, transposed = expert_tensors(adapter, model, adapter.moe_layers[0], 0)  # shapes only (meta if streamed)
        layout = RecordLayout(tuple(matrix_spec(name, t, precision, group, transposed, meta_group=meta)
                                    for name, t in tensors.items()))
        files = []
        bar = tqdm(total=len(adapter.moe_layers) * adapter.num_experts, desc=f"quantize {precision}", unit="expert")
        for layer in adapter.moe_layers:
            path = directory / f"layer-{layer}.safetensors"
            files.append(path.name)
            if path.is_file():  # finished before an interruption
                bar.update(adapter.num_experts)
                continue
            with resident_layer(model, adapter, layer):  # a streamed model reads this layer from the shards
                write_record_file(path, [expert_key(layer, e) for e in range(adapter.num_experts)], layout.nbytes,
                                  _encoded(model, adapter, layer, precision, group, meta, bar))
        bar.close()
        stores[precision] = {"group_size": group, "meta_group": meta, "layout": layout.to_json(),
                             "record_bytes": layout.nbytes, "files": files}
    return PackedExperts(precision=cfg.precision, stores=stores, layers=list(adapter.moe_layers),
                         num_experts=adapter.num_experts)


STAGE = Stage(
    name="quantize", version=VERSION, config=QuantizeSection, result=PackedExperts,
    needs=frozenset({"model"}),
    run=lambda inputs: quantize_experts(inputs.model, inputs.adapter, inputs.config, inputs.work),
    section="quantize",
)
