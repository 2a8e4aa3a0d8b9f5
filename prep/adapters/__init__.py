"""Architecture adapters: the only place in moeprep that knows MoE architecture names and layouts.

`get_adapter(model_or_config)` returns the adapter of a transformers 5 model by its
config.model_type. Each adapter (see `base.MoeAdapter`) answers: which layers are MoE, the MoE block,
router and experts modules, top-k, number of routed and shared experts, `route()` exactly as the
model does, get/set of one expert as 2-D matrices (`ExpertWeights`), `expert_forward`,
`shared_output`, `read_expert` from a checkpoint directory without building the model, and
`describe()`.

To add an architecture: write `prep/adapters/<arch>.py` with a `MoeAdapter` subclass that states the
differences as class attributes (plus `select_experts`, and `glu`/`shared_output` if they differ),
register it in `ADAPTERS` below, and add a tiny model to `tests/helpers/tiny_models.py`.
"""

from __future__ import annotations

from pathlib import Path

from prep.errors import MoeprepError

from .base import ExpertWeights, FusedLayout, HubExpertNames, MoeAdapter
from .deepseek_v2 import DeepseekV2Adapter
from .gpt_oss import GptOssAdapter
from .loading import _checkpoint_summary, build_skeleton, load_config, load_model
from .mixtral import MixtralAdapter
from .olmoe import OlmoeAdapter
from .phimoe import PhimoeAdapter
from .qwen2_moe import Qwen2MoeAdapter
from .qwen3_moe import Qwen3MoeAdapter

ADAPTERS: dict[str, type[MoeAdapter]] = {
    cls.model_type: cls
    for cls in (
        MixtralAdapter,
        Qwen2MoeAdapter,
        Qwen3MoeAdapter,
        OlmoeAdapter,
        PhimoeAdapter,
        DeepseekV2Adapter,
        GptOssAdapter,
    )
}


def supported_architectures() -> str:
    """The supported architectures as one human-readable string, e.g. "Mixtral (mixtral), ..."."""
    return ", ".join(f"{cls.architecture} ({model_type})" for model_type, cls in ADAPTERS.items())


def get_adapter(model_or_config) -> MoeAdapter:
    """The adapter for a loaded model or a config, chosen by config.model_type.

    Raises MoeprepError naming the supported architectures when the model type is not one of them.
    """
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise MoeprepError(
            f"unsupported architecture {model_type!r}: moeprep supports {supported_architectures()}"
        )
    return ADAPTERS[model_type](config)


def describe(model) -> dict:
    """The adapter's view of a loaded (or meta-device) model; see MoeAdapter.describe."""
    return get_adapter(model).describe(model)


def read_expert(checkpoint_dir: str | Path, layer: int, expert: int) -> ExpertWeights:
    """Read routed expert `expert` of MoE layer `layer` from a checkpoint directory, lazily.

    The architecture comes from the directory's config.json; only that expert's bytes are read.
    """
    return get_adapter(load_config(Path(checkpoint_dir))).read_expert(checkpoint_dir, layer, expert)


def inspect_model(model: str | Path) -> dict:
    """The adapter's description of a model (see MoeAdapter.describe) plus its checkpoint summary.

    ``model``: a directory, a hub id, or a ``config.json`` file. Needs only config.json and the safetensors
    headers: the model is built on the meta device.
    Returns a JSON-ready dict; raises MoeprepError for a missing path or an unsupported architecture.
    """
    if Path(str(model)).expanduser().is_file() and Path(str(model)).name == "config.json":
        model = Path(str(model)).expanduser().parent  # a shipped config.json: its directory, without weights
    config = load_config(model)
    adapter = get_adapter(config)
    info = {"model": str(model), **adapter.describe(build_skeleton(config))}
    if Path(str(model)).expanduser().is_dir():
        info.update(_checkpoint_summary(Path(str(model)).expanduser()))
    return info


__all__ = [
    "ADAPTERS",
    "ExpertWeights",
    "FusedLayout",
    "HubExpertNames",
    "MoeAdapter",
    "build_skeleton",
    "describe",
    "get_adapter",
    "inspect_model",
    "load_config",
    "load_model",
    "read_expert",
    "supported_architectures",
]
