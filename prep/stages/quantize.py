"""Stage ``quantize``: every expert packed at each precision the recipe names, one record per expert.

Needs the model only (no traces, no calibration data), so its key covers the quantize section and the
model fingerprint and nothing else. Every precision gets its own directory; the work units are one per
precision and MoE layer (``<precision>/layer-<l>.safetensors``, written atomically by the executor,
``prep/executor.py``, in this process or on Ray workers that read the layer from the checkpoint's shards), so an
interrupted run resumes with the layers already written; HQQ on CPU is deterministic, so a resumed or
distributed run yields the same bytes as an uninterrupted local one. Which expert ships at which precision is the ``bitwidth`` stage's choice; this stage
writes every expert at every listed precision so that choice never needs quantizing again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from loader.codec import DEFAULT_FORMATS, MX_GROUP, RecordLayout
from loader.format import expert_key
from loader.vocab import MX, PRECISIONS
from prep.errors import MoeprepError
from prep.executor import Unit
from prep.quant.hqq_codec import encode_expert, matrix_spec
from prep.quant.records import write_record_file
from prep.stages import Stage, StageResult
from prep.streaming import resident_layer, stream_of

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
        if precision in MX:  # the format fixes its group, and its scales are bytes
            return MX_GROUP, 0
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


def source_mxfp4(adapter, model, layer: int, expert: int, precision: str) -> dict | None:
    """The expert's own MXFP4 codes where ``precision`` is mxfp4 and the model computes with exactly what its
    checkpoint stores in MXFP4 (streamed from it, no override, no other source swapped in): kept as they are, so
    the record is the release's bytes. None: quantize the values."""
    if precision not in MX:
        return None
    stream = stream_of(model, adapter)
    if stream is None or stream.source != stream.checkpoint_expert or (layer, expert) in stream.overrides:
        return None
    return adapter.source_codes(stream.tensors, layer, expert)


def quantize_layer(context, out: Path, *, precision: str, layer: int, group: int, meta: int, record_bytes: int) -> None:
    """One unit: every expert of model layer ``layer`` at ``precision``, written to ``out`` one record at a time (a
    streamed model reads this layer from the shards for the block)."""
    model, adapter = context.model, context.adapter

    def records():
        for expert in range(adapter.num_experts):
            tensors, transposed = expert_tensors(adapter, model, layer, expert)
            yield encode_expert(tensors, precision, group, transposed, meta_group=meta,
                                keep=source_mxfp4(adapter, model, layer, expert, precision))[1]

    with resident_layer(model, adapter, layer):
        write_record_file(out, [expert_key(layer, e) for e in range(adapter.num_experts)], record_bytes, records())


def quantize_units(adapter, model, cfg: QuantizeSection) -> tuple[list[Unit], dict]:
    """(units, stores): one unit per precision and MoE layer, writing ``<precision>/layer-<l>.safetensors``; and
    each precision's store description (its layout from the expert shapes only, so no weight is read here)."""
    units, stores = [], {}
    for precision in cfg.precisions:
        group, meta = cfg.format_of(precision)
        tensors, transposed = expert_tensors(adapter, model, adapter.moe_layers[0], 0)  # shapes only (meta if streamed)
        layout = RecordLayout(tuple(matrix_spec(name, t, precision, group, transposed, meta_group=meta)
                                    for name, t in tensors.items()))
        files = [f"layer-{layer}.safetensors" for layer in adapter.moe_layers]
        units += [Unit(name=f"{precision}/layer-{layer}", output=f"{precision}/{name}", fn=quantize_layer,
                       args={"precision": precision, "layer": layer, "group": group, "meta": meta,
                             "record_bytes": layout.nbytes})
                  for layer, name in zip(adapter.moe_layers, files, strict=True)]
        stores[precision] = {"group_size": group, "meta_group": meta, "layout": layout.to_json(),
                             "record_bytes": layout.nbytes, "files": files}
    return units, stores


def _run(inputs) -> PackedExperts:
    """Declare the units, let the executor run them (``prep/executor.py``), and describe what they wrote."""
    adapter = inputs.adapter
    units, stores = quantize_units(adapter, inputs.model, inputs.config)
    inputs.map_units(units)
    return PackedExperts(precision=inputs.config.precision, stores=stores, layers=list(adapter.moe_layers),
                         num_experts=adapter.num_experts)


STAGE = Stage(
    name="quantize", version=VERSION, config=QuantizeSection, result=PackedExperts,
    needs=frozenset({"model"}),
    run=_run,
    units=lambda recipe, num_layers: len(recipe.quantize.precisions) * num_layers,
    section="quantize",
)
