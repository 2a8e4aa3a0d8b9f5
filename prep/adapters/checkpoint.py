"""Lazy, by-name access to the tensors of a safetensors checkpoint directory.

Reading one expert of Mixtral-8x7B must not load 90 GB. A checkpoint directory holds one or more
`*.safetensors` shards, with `model.safetensors.index.json` mapping tensor names to shards when
there are several; this module finds the shard holding a name (from the index, or by reading the
shard headers, which costs a few KB each) and reads only the requested tensor, or only one slice
of it along dim 0, through `safetensors.safe_open`. ``get_float`` reads a weight as the model computes with it:
an FP8 weight with block scales (``prep/adapters/source_formats.py``) dequantized, anything else as stored. A
shard that cannot be read (truncated, not safetensors) is one error naming the tensor and the shard.

What the checkpoint says is checked before any shard is read: the index's shard names are plain relative paths
inside the directory (``../x.safetensors`` or ``/etc/passwd`` is refused; a hub cache's shard, a symlink into its
``blobs/``, is fine: the name is checked, not where the link points), every quantized weight has its scales and
every scale its weight (``source_formats.unpaired``), and config.json's ``quantization_config`` has the right
types.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from prep.adapters.source_formats import SCALE_INV_SUFFIX, fp8_block, fp8_dequantize, quant_method, unpaired
from prep.errors import MoeprepError

INDEX_NAME = "model.safetensors.index.json"


class CheckpointTensors:
    """The tensor names of a checkpoint directory and where each one lives; reads on demand."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.dir = Path(checkpoint_dir)
        if not self.dir.is_dir():
            raise MoeprepError(f"checkpoint directory {self.dir} does not exist")
        config = read_config_json(self.dir)
        self.block = fp8_block(config)
        self.files = self._weight_map()
        half = unpaired(self.files, quant_method(config) == "mxfp4")
        if half is not None:
            raise MoeprepError(f"checkpoint {self.dir}: tensor {half[0]} in shard {self.shard_of(half[0])} is "
                               f"{half[1]}; is every shard complete? re-download the checkpoint")

    def _weight_map(self) -> dict[str, str]:
        # name -> shard file name, from the index when present (what save_pretrained writes for
        # sharded checkpoints), else from the headers of every shard.
        index = self.dir / INDEX_NAME
        if index.is_file():
            return _index_weight_map(index)
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise MoeprepError(
                f"{self.dir} has no *.safetensors files; pass a directory holding the model weights"
            )
        weight_map = {}
        for shard in shards:
            if not shard.is_file():  # a directory or a FIFO named *.safetensors: opening it may hang
                raise MoeprepError(f"checkpoint {self.dir}: {shard.name} is not a file; remove it or re-download "
                                   "the checkpoint")
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
        to float32: the value the model computes with. A weight beside scales that is not FP8 (a float16 one,
        whose scales would be ignored), an FP8 weight without its scales, a tensor that is not a float (a uint8
        where a weight belongs), or a value that is not finite is one error naming it."""
        scales = f"{name}{SCALE_INV_SUFFIX}"
        value = self.get(name, index)
        if self.has(scales):
            return fp8_dequantize(value, self.get(scales, index), self.block, name, self.shard_of(name), index)
        where = f"checkpoint {self.dir}: tensor {name} in shard {self.shard_of(name)}"
        dtype = str(value.dtype).removeprefix("torch.")
        if value.is_floating_point() and value.element_size() == 1:
            raise MoeprepError(f"{where} is {dtype} without its block scales {scales}; is every shard complete? "
                               "re-download the checkpoint")
        if not value.is_floating_point():
            raise MoeprepError(f"{where} is {dtype}, not a float weight; is the checkpoint the model its config.json "
                               "describes? re-download it")
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            position = bad.nonzero()[0].tolist()
            raise MoeprepError(f"{where} holds {value[tuple(position)].item()} at "
                               f"{([] if index is None else [index]) + position}, not a finite number; re-download "
                               "that shard")
        return value

    def dtype_of(self, name: str) -> str:
        """The stored dtype of tensor `name` as safetensors writes it (e.g. "BF16"), without reading it."""
        return self._read(name, lambda f: f.get_slice(name).get_dtype())


def read_config_json(directory: Path) -> dict:
    """config.json of ``directory`` as a dict ({} where there is none: a bare directory of shards)."""
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MoeprepError(f"{path} cannot be read as JSON ({type(e).__name__}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise MoeprepError(f"{path} holds a {type(config).__name__}, not a JSON object; fix or re-download it")
    return config


def _index_weight_map(index: Path) -> dict[str, str]:
    """{tensor name: shard name} of a ``model.safetensors.index.json``: a dict of strings to shard names that are
    plain relative paths inside its directory (checked by name only, before any shard is opened)."""
    fix = "re-download the checkpoint or re-save it with save_pretrained"
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MoeprepError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); {fix}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else raw
    if not isinstance(raw, dict) or not isinstance(weight_map, dict):
        got = (f"the file holds a {type(raw).__name__}" if not isinstance(raw, dict) else "it has no weight_map"
               if weight_map is None else f"its weight_map is a {type(weight_map).__name__}")
        raise MoeprepError(f"{index} is not a valid safetensors index: it needs a weight_map object of tensor names "
                           f"to shard file names, but {got}; {fix}")
    wrong = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if wrong is not None:
        raise MoeprepError(f"{index}: weight_map maps tensor {wrong[0]} to {wrong[1]!r}, not a shard file name; {fix}")
    for name, shard in weight_map.items():
        parts = PurePosixPath(shard).parts
        if (not shard or "\\" in shard or "\0" in shard or PurePosixPath(shard).is_absolute()
                or PureWindowsPath(shard).drive or ".." in parts or not shard.endswith(".safetensors")):
            raise MoeprepError(f"{index}: tensor {name} names shard {shard!r}, which is not a .safetensors file "
                               f"inside {index.parent}; moeprep reads shards only from the model directory; {fix}")
    return weight_map
