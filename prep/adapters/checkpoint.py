"""Lazy, by-name access to the tensors of a safetensors checkpoint directory.

Reading one expert of Mixtral-8x7B must not load 90 GB. A checkpoint directory holds one or more
`*.safetensors` shards, with `model.safetensors.index.json` mapping tensor names to shards when
there are several; this module finds the shard holding a name (from the index, or by reading the
shard headers, which costs a few KB each) and reads only the requested tensor, or only one slice
of it along dim 0, through `safetensors.safe_open`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from prep.errors import MoeprepError

INDEX_NAME = "model.safetensors.index.json"


class CheckpointTensors:
    """The tensor names of a checkpoint directory and where each one lives; reads on demand."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.dir = Path(checkpoint_dir)
        if not self.dir.is_dir():
            raise MoeprepError(f"checkpoint directory {self.dir} does not exist")
        self.files = self._weight_map()

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
            with safe_open(shard, framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), shard.name))
        return weight_map

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called `name`."""
        return name in self.files

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self.files)

    def _open(self, name: str):
        if name not in self.files:
            raise MoeprepError(f"checkpoint {self.dir} has no tensor {name}")
        shard = self.dir / self.files[name]
        if not shard.is_file():
            raise MoeprepError(
                f"checkpoint {self.dir}: tensor {name} should be in missing shard {shard.name}"
            )
        return safe_open(shard, framework="pt")

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only its slice `[index]` along dim 0 (reads just those bytes)."""
        with self._open(name) as f:
            if index is None:
                return f.get_tensor(name)
            return f.get_slice(name)[index]

    def dtype_of(self, name: str) -> str:
        """The stored dtype of tensor `name` as safetensors writes it (e.g. "BF16"), without reading it."""
        with self._open(name) as f:
            return f.get_slice(name).get_dtype()
