"""Loading Hugging Face MoE models and configs for moeprep, with errors a user can act on.

A model is named by a local directory (config.json + *.safetensors) or a hub id. The hub is tried
only for names that cannot be a local path; when it fails (no network, private repo, typo) the
error says so and asks for a local directory. `inspect_model` builds the model on the meta device,
so describing Mixtral-8x7B costs seconds and no memory.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from prep.errors import MoeprepError

from .checkpoint import CheckpointTensors, read_config_json
from .source_formats import check_quantization_config


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be meant as a path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _resolve(model: str | Path) -> str:
    """A local model directory as a string, or the hub id when `model` cannot be a local path."""
    name = str(model)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise MoeprepError(f"{path} is a file; pass the model directory (the one holding config.json)")
        if not (path / "config.json").is_file():
            raise MoeprepError(f"{path} is not a model directory: it has no config.json")
        return str(path)
    if isinstance(model, Path) or _looks_like_path(name):
        raise MoeprepError(f"model directory {path} does not exist")
    return name


def _hub_error(name: str, err: Exception) -> MoeprepError:
    return MoeprepError(
        f"could not load model {name!r}: it is not a local directory and fetching it from the Hugging Face hub "
        f"failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Without network "
        "access, download the model on another machine and pass its local directory."
    )


def load_config(model: str | Path):
    """The transformers config of a model directory or hub id (text config for multimodal wrappers)."""
    from transformers import AutoConfig

    name = _resolve(model)
    if Path(name).is_dir():  # a quantization_config of the wrong type is a traceback inside transformers
        check_quantization_config(read_config_json(Path(name)))
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        if Path(name).is_dir():
            raise MoeprepError(f"cannot read the config of {name} ({type(e).__name__}: {e}); fix its config.json or "
                               "re-download it") from None
        if not isinstance(e, OSError | ValueError | KeyError):
            raise
        raise _hub_error(name, e) from e
    check_quantization_config(config)  # the hub's too
    return config


def load_model(
    model: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    experts_implementation: str | None = None,
) -> nn.Module:
    """Load a causal-LM MoE model from a directory or hub id, in eval mode.

    experts_implementation: transformers' experts kernel ("eager", "grouped_mm", ...); None keeps
    transformers' default. Returns the `*ForCausalLM` module.
    """
    from transformers import AutoModelForCausalLM

    name = _resolve(model)
    kwargs = {"dtype": dtype, "device_map": device}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    try:
        loaded = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if Path(name).is_dir():
            raise MoeprepError(f"cannot load the model in {name}: {e}") from e
        raise _hub_error(name, e) from e
    return loaded.eval()


def build_skeleton(config) -> nn.Module:
    """The `*ForCausalLM` of `config` on the meta device: every module and shape, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _checkpoint_summary(directory: Path) -> dict:
    # What the safetensors headers say, without reading any tensor data.
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return {}
    tensors = CheckpointTensors(directory)
    dtypes = Counter(tensors.dtype_of(name) for name in tensors.names())
    return {
        "checkpoint_files": len(files),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "checkpoint_dtypes": dict(dtypes.most_common()),
        "checkpoint_tensors": sum(dtypes.values()),
    }
