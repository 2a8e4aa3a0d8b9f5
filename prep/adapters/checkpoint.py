"""Lazy, by-name access to the tensors of a safetensors checkpoint directory.

Reading one expert of Mixtral-8x7B must not load 90 GB. A checkpoint directory holds one or more
`*.safetensors` shards, with `model.safetensors.index.json` mapping tensor names to shards when
there are several; this module finds the shard holding a name (from the index, or by reading the
shard headers, which costs a few KB each) and reads only the requested tensor, or only one slice
of it along dim 0, through `safetensors.safe_open`. ``get_float`` reads a weight as the model computes with it:
an FP8 weight with block scales (``prep/adapters/source_formats.py``) dequantized, anything else as stored. A
shard that cannot be read (truncated, not safetensors) is one error naming the tensor and the shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from prep.adapters.source_formats import FP8_BLOCK, SCALE_INV_SUFFIX, fp8_dequantize
from prep.errors import MoeprepError

INDEX_NAME = "model.safetensors.index.json"


class CheckpointTensors:
    """The tensor names of a checkpoint directory and where each one lives; reads on demand."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.dir = Path(checkpoint_dir)
        if not self.dir.is_dir():
            raise MoeprepError(f"checkpoint directory {self.dir} does not exist")
        self.files = self._weight_map()
        self.block = _fp8_block(self.dir)

    def _weight_map(self) -> dict[str, str]:
        # name -> shard file name, from the index when present (what save_pretrained writes for
        # sharded checkpoints), else from the headers of every shard.
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError) as e:
                raise MoeprepError(
                    f"{index} is not a valid safetensors index ({e}); re-save the checkpoint"
                ) from e
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise MoeprepError(
                f"{self.dir} has no *.safetensors files; pass a directory holding the model weights"
            )
        weight_map = {}
        for shard in shards:
            try:
                with safe_open(shard, framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), shard.name))
            except Exception as e:  # safetensors' own error types
                raise MoeprepError(f"checkpoint {self.dir}: shard {shard.name} cannot be read ({e}); is it complete? "
                                   "re-download it") from None
        return weight_map

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called `name`."""
        return name in self.files

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self.files)

    def shard_of(self, name: str) -> str:
        """The shard file name holding tensor ``name`` (for messages)."""
        return self.files.get(name, "?")

    def _read(self, name: str, read):
        if name not in self.files:
            raise MoeprepError(f"checkpoint {self.dir} has no tensor {name}")
        shard = self.dir / self.files[name]
        if not shard.is_file():
            raise MoeprepError(
                f"checkpoint {self.dir}: tensor {name} should be in missing shard {shard.name}"
            )
        try:
            with safe_open(shard, framework="pt") as f:
                return read(f)
        except MoeprepError:
            raise
        except Exception as e:  # safetensors' own errors: a truncated shard, a header that lies
            raise MoeprepError(f"checkpoint {self.dir}: tensor {name} in shard {shard.name} cannot be read ({e}); "
                               "is the shard complete? re-download it") from None

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only its slice `[index]` along dim 0 (reads just those bytes)."""
        return self._read(name, lambda f: f.get_tensor(name) if index is None else f.get_slice(name)[index])

    def get_float(self, name: str, index: int | None = None) -> torch.Tensor:
        """``get``, but an FP8 weight stored with block scales (``{name}_scale_inv`` beside it) comes dequantized
        to float32: the value the model computes with."""
        scales = f"{name}{SCALE_INV_SUFFIX}"
        value = self.get(name, index)
        if not value.is_floating_point() or value.element_size() != 1 or not self.has(scales):
            return value
        return fp8_dequantize(value, self.get(scales, index), self.block, name, self.shard_of(name))

    def dtype_of(self, name: str) -> str:
        """The stored dtype of tensor `name` as safetensors writes it (e.g. "BF16"), without reading it."""
        return self._read(name, lambda f: f.get_slice(name).get_dtype())


def _fp8_block(directory: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of the checkpoint's config.json, else [128, 128]."""
    try:
        block = json.loads((directory / "config.json").read_text()).get("quantization_config", {}).get(
            "weight_block_size")
    except (OSError, ValueError, AttributeError):
        return FP8_BLOCK
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return tuple(block)
    return FP8_BLOCK
