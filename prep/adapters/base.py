"""The shared half of every architecture adapter: what an MoE layer looks like to the rest of moeprep.

Every stage (trace, sensitivity, quantize, package) and every check needs the same few facts about
a Hugging Face MoE model: which decoder layers are MoE, where the router and the experts live, how
the router turns logits into (experts, weights), how one expert's weights sit inside the fused 3-D
parameters transformers 5 uses, and how one expert computes. This module holds everything those
facts have in common; each per-architecture module (`mixtral.py`, `deepseek_v2.py`, ...) is a small
subclass of `MoeAdapter` that only states what differs, as class attributes plus tiny functions.

Everything here mirrors the transformers 5 source (`models/<arch>/modeling_<arch>.py` and
`integrations/moe.py`) in eval mode; the tests check it against the model's own modules.

Shape legend (used in every comment of the adapters): T tokens, L layers, E experts, K top-k,
H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from prep.errors import MoeprepError

from .checkpoint import CheckpointTensors
from .source_formats import BLOCKS_SUFFIX, SCALES_SUFFIX, check_mxfp4, mxfp4_dequantize


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert as plain 2-D matrices, in `nn.Linear` orientation (out_features, in_features).

    gate, up: [I, H]; down: [H, I]; biases (only gpt-oss has them): gate_bias, up_bias [I], down_bias [H].
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors by field name (biases left out when absent)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def num_params(self) -> int:
        """Number of scalars in this expert (weights and biases)."""
        return sum(t.numel() for t in self.tensors().values())

    def to(self, dtype: torch.dtype) -> ExpertWeights:
        """A copy with every tensor cast to `dtype`."""
        return ExpertWeights(**{name: t.to(dtype) for name, t in self.tensors().items()})

    def contiguous(self) -> ExpertWeights:
        """The same expert with every tensor contiguous (views into fused tensors are strided)."""
        return ExpertWeights(**{name: t.contiguous() for name, t in self.tensors().items()})


@dataclass(frozen=True)
class FusedLayout:
    """How transformers 5 packs all experts of a layer into `gate_up_proj` and `down_proj`.

    Default (Mixtral, Qwen, OLMoE, Phi, DeepSeek): gate_up_proj [E, 2I, H] = [gate; up] stacked on
    dim 1, down_proj [E, H, I]. gpt-oss: transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]),
    gate and up interleaved column by column (gate = [..., 0::2], up = [..., 1::2]), plus biases
    gate_up_proj_bias [E, 2I] (same interleaving) and down_proj_bias [E, H].
    """

    transposed: bool = False
    interleaved: bool = False
    has_bias: bool = False

    def split(
        self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias=None, down_bias=None
    ) -> ExpertWeights:
        """One expert's slices of the fused tensors -> ExpertWeights (views where possible).

        gate_up: [2I, H] (or [H, 2I] transposed); down: [H, I] (or [I, H] transposed).
        """
        if self.transposed:
            gate_up, down = gate_up.transpose(0, 1), down.transpose(0, 1)  # -> [2I, H], [H, I]
        gate, up = self._halves(gate_up)
        gate_b = up_b = None
        if self.has_bias:
            gate_b, up_b = self._halves(gate_up_bias)
        return ExpertWeights(gate, up, down, gate_b, up_b, down_bias if self.has_bias else None)

    def _halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Split along dim 0 (the 2I axis) into the gate and up parts.
        if self.interleaved:
            return t[0::2], t[1::2]
        half = t.shape[0] // 2
        return t[:half], t[half:]


@dataclass(frozen=True)
class HubExpertNames:
    """Per-expert tensor names of checkpoints written before transformers 5 fused the experts.

    `prefix` is formatted with layer and expert; gate/up/down are the suffixes, e.g. Mixtral:
    `model.layers.{layer}.block_sparse_moe.experts.{expert}` + `w1.weight` (gate), `w3.weight` (up),
    `w2.weight` (down). Biases are not covered: no architecture with per-expert names has them.
    """

    prefix: str
    gate: str
    up: str
    down: str


# The per-expert names of Qwen-style checkpoints (Qwen-MoE, OLMoE, DeepSeek-V2): ``mlp.experts.{e}.*_proj``.
PROJ_EXPERT_NAMES = HubExpertNames(
    prefix="model.layers.{layer}.mlp.experts.{expert}",
    gate="gate_proj.weight",
    up="up_proj.weight",
    down="down_proj.weight",
)


def softmax_topk(
    logits: torch.Tensor, k: int, *, normalize: bool, cast_back: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The common router: softmax in float32 over all experts, top-k, optional renormalisation.

    Takes logits [T, E]; returns (expert_ids [T, K] int64, weights [T, K]). `cast_back` casts the
    weights to the logits dtype (Qwen/OLMoE do, Mixtral keeps float32).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cast_back:
        weights = weights.to(logits.dtype)
    return ids, weights


class MoeAdapter:
    """One architecture's MoE layout, bound to a model config.

    Subclasses set the class attributes below and override the few methods whose math differs.
    Methods that touch weights take the loaded model (a `*ForCausalLM` or its base model).
    """

    # --- plain data every subclass states -------------------------------------------------
    model_type: ClassVar[str]  # config.model_type
    architecture: ClassVar[str]  # human-readable name
    num_experts_key: ClassVar[str]  # config attribute holding E
    intermediate_key: ClassVar[str]  # config attribute holding I
    router_attr: ClassVar[str] = "gate"  # attribute of the MoE block holding the router
    experts_attr: ClassVar[str] = "experts"
    shared_attr: ClassVar[str | None] = None  # attribute of the shared-expert MLP, if any
    layout: ClassVar[FusedLayout] = FusedLayout()
    # Checkpoint names: transformers 5 fused names, and the per-expert names of hub checkpoints.
    fused_prefix: ClassVar[str] = "model.layers.{layer}.mlp.experts"
    hub_names: ClassVar[HubExpertNames | None] = None

    def __init__(self, config) -> None:
        self.config = getattr(config, "text_config", None) or config
        if getattr(self.config, "model_type", None) != self.model_type:
            raise MoeprepError(
                f"{type(self).__name__} handles model_type {self.model_type!r}, got "
                f"{getattr(self.config, 'model_type', None)!r}"
            )

    # --- static facts from the config ----------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_experts(self) -> int:
        """E: routed experts per MoE layer."""
        return getattr(self.config, self.num_experts_key)

    @property
    def top_k(self) -> int:
        """K: routed experts selected per token."""
        return self.config.num_experts_per_tok

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def expert_intermediate_size(self) -> int:
        """I: intermediate width of one routed expert."""
        return getattr(self.config, self.intermediate_key)

    @property
    def num_shared_experts(self) -> int:
        """Shared (always-on) experts per MoE layer; 0 when the architecture has none."""
        return 0

    @property
    def shared_intermediate_size(self) -> int:
        """Total intermediate width of the shared-expert MLP of a layer (0 when none)."""
        return 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (default: every layer)."""
        return True

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers whose MLP is a sparse MoE block."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def _check_moe_layer(self, layer: int) -> None:
        if not (0 <= layer < self.num_layers and self.is_moe_layer(layer)):
            raise MoeprepError(
                f"layer {layer} is not an MoE layer of this {self.architecture} model; MoE layers: {self.moe_layers}"
            )

    def _check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.num_experts:
            raise MoeprepError(
                f"expert {expert} out of range: this model has {self.num_experts} experts per layer"
            )

    # --- modules ------------------------------------------------------------------------
    @staticmethod
    def decoder_layers(model: nn.Module) -> nn.ModuleList:
        """The decoder layers of a `*ForCausalLM` (or of its base model)."""
        return model.base_model.layers

    def moe_block(self, model: nn.Module, layer: int) -> nn.Module:
        """The sparse MoE block of decoder layer `layer` (the module the decoder calls as `mlp`)."""
        self._check_moe_layer(layer)
        return self.decoder_layers(model)[layer].mlp

    def router(self, model: nn.Module, layer: int) -> nn.Module:
        """The router module of MoE layer `layer`; its forward returns (logits, weights, expert_ids)."""
        return getattr(self.moe_block(model, layer), self.router_attr)

    def experts(self, model: nn.Module, layer: int) -> nn.Module:
        """The fused experts module of MoE layer `layer` (holds gate_up_proj / down_proj)."""
        return getattr(self.moe_block(model, layer), self.experts_attr)

    def module_paths(self, model: nn.Module) -> dict:
        """Dotted module paths in ``model`` that the loader hooks into, so it never guesses names.

        Returns {"experts_modules": [str] (one per MoE layer), "router_modules": [str] (one per MoE
        layer), "last_decoder_layer": str}.
        """
        names = {id(m): n for n, m in model.named_modules()}
        return {
            "experts_modules": [names[id(self.experts(model, layer))] for layer in self.moe_layers],
            "router_modules": [names[id(self.router(model, layer))] for layer in self.moe_layers],
            "last_decoder_layer": names[id(self.decoder_layers(model)[-1])],
        }

    @staticmethod
    def block_output(output) -> torch.Tensor:
        """The hidden-state output of an MoE block's forward (gpt-oss also returns router scores)."""
        return output[0] if isinstance(output, tuple) else output

    @staticmethod
    def unpack_router_output(output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A router forward's output -> (logits [T, E], expert_ids [T, K] int64, weights [T, K]).

        Every transformers 5 router returns (logits, weights, ids), in that order.
        """
        logits, weights, ids = output
        return logits, ids.long(), weights

    # --- routing -------------------------------------------------------------------------
    def router_logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the MoE block input) -> router logits [T, E]."""
        return F.linear(hidden, router.weight, getattr(router, "bias", None))

    def select_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (expert_ids [T, K] int64, weights [T, K]), as the model does in eval mode."""
        raise NotImplementedError

    def routing_weights(self) -> dict:
        """How this router weighs a chosen set of experts, as ``loader.routing.selection_weights`` reads it
        (the manifest records it; cache-conditional routing weighs a re-ranked choice with it):
        {function: softmax | softmax_selected | sparsemixer, renormalize, scale, jitter_eps}."""
        raise NotImplementedError

    def route(self, model: nn.Module, layer: int, hidden: torch.Tensor):
        """Route hidden [T, H] through MoE layer `layer` exactly as the model does (eval mode).

        Returns (router_logits [T, E], expert_ids [T, K] int64, expert_weights [T, K]).
        """
        logits = self.router_logits(self.router(model, layer), hidden.reshape(-1, self.hidden_size))
        ids, weights = self.select_experts(logits)
        return logits, ids.long(), weights

    # --- one expert's weights -----------------------------------------------------------
    def _fused_params(self, experts: nn.Module) -> tuple[torch.Tensor, ...]:
        # (gate_up [E, 2I, H] or [E, H, 2I], down, gate_up_bias | None, down_bias | None)
        bias = self.layout.has_bias
        return (
            experts.gate_up_proj,
            experts.down_proj,
            experts.gate_up_proj_bias if bias else None,
            experts.down_proj_bias if bias else None,
        )

    def expert_from_params(self, tensors: dict[str, torch.Tensor]) -> ExpertWeights:
        """One expert's slices of the fused parameters, by parameter name (as a quantize record decodes
        them: ``gate_up_proj``, ``down_proj`` and, with biases, ``gate_up_proj_bias``, ``down_proj_bias``)."""
        return self.layout.split(tensors["gate_up_proj"], tensors["down_proj"], tensors.get("gate_up_proj_bias"),
                                 tensors.get("down_proj_bias")).contiguous()

    def _expert_views(self, model: nn.Module, layer: int, expert: int) -> ExpertWeights:
        # Views into the live parameters: reading them clones, writing them copies in place.
        return self.module_views(self.experts(model, layer), expert)

    def module_views(self, experts: nn.Module, expert: int) -> ExpertWeights:
        """Views of expert ``expert`` into the fused parameters of the experts module ``experts``."""
        self._check_expert(expert)
        gate_up, down, gate_up_b, down_b = self._fused_params(experts)
        return self.layout.split(
            gate_up[expert],
            down[expert],
            gate_up_b[expert] if gate_up_b is not None else None,
            down_b[expert] if down_b is not None else None,
        )

    @staticmethod
    def _stream(experts: nn.Module):
        # a streamed model's experts (prep/streaming.py) are on meta until their layer is resident
        return getattr(experts, "expert_stream", None)

    @torch.no_grad()
    def get_expert(self, model: nn.Module, layer: int, expert: int) -> ExpertWeights:
        """A copy of routed expert `expert` of MoE layer `layer` as 2-D matrices (see ExpertWeights)."""
        self._check_moe_layer(layer)
        self._check_expert(expert)
        stream = self._stream(self.experts(model, layer))
        if stream is not None and not stream.is_resident(layer):
            return stream.expert(layer, expert)
        views = self._expert_views(model, layer, expert)
        return ExpertWeights(
            **{
                name: t.detach().clone(memory_format=torch.contiguous_format)
                for name, t in views.tensors().items()
            }
        )

    @torch.no_grad()
    def set_expert(self, model: nn.Module, layer: int, expert: int, weights: ExpertWeights) -> None:
        """Write `weights` into routed expert `expert` of MoE layer `layer`, in place, in the model's dtype."""
        self._check_moe_layer(layer)
        self._check_expert(expert)
        stream = self._stream(self.experts(model, layer))
        views = self._expert_views(model, layer, expert)  # on meta for a streamed layer: shapes only
        new = weights.tensors()
        if set(new) != set(views.tensors()):
            raise MoeprepError(
                f"{self.architecture} experts have tensors {sorted(views.tensors())}, got {sorted(new)}"
            )
        for name, view in views.tensors().items():
            if tuple(new[name].shape) != tuple(view.shape):
                raise MoeprepError(
                    f"expert tensor {name}: expected shape {tuple(view.shape)}, got {tuple(new[name].shape)}"
                )
            if stream is None:
                view.copy_(new[name])
        if stream is not None:
            stream.set_expert(layer, expert, weights)

    # --- computation -------------------------------------------------------------------
    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation between up- and down-projection: act(gate) * up, act from the config."""
        from transformers.activations import ACT2FN

        return ACT2FN[self.config.hidden_act](gate) * up

    def expert_forward(self, weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        """One expert's MLP on x [T, H] -> [T, H], as the model computes it."""
        gate = F.linear(x, weights.gate, weights.gate_bias)  # [T, I]
        up = F.linear(x, weights.up, weights.up_bias)  # [T, I]
        return F.linear(self.glu(gate, up), weights.down, weights.down_bias)  # [T, H]

    def shared_output(self, model: nn.Module, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared-expert contribution of MoE layer `layer` for hidden [T, H] -> [T, H], or None."""
        if self.shared_attr is None:
            return None
        shared = getattr(self.moe_block(model, layer), self.shared_attr)
        return shared(hidden.reshape(-1, self.hidden_size))

    @torch.no_grad()
    def reference_moe_output(
        self,
        model: nn.Module,
        layer: int,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        expert_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Recompute an MoE block's output from a routing decision, one expert at a time.

        The obviously-right reference for checks: hidden [T, H], expert_ids [T, K], expert_weights
        [T, K] -> sum_k weight_k * expert_k(hidden) + shared experts, [T, H].
        """
        hidden = hidden.reshape(-1, self.hidden_size)
        out = torch.zeros_like(hidden)
        for expert in expert_ids.unique().tolist():
            rows, slot = torch.where(expert_ids == expert)
            y = self.expert_forward(self.get_expert(model, layer, expert), hidden[rows])
            out.index_add_(0, rows, (y * expert_weights[rows, slot, None]).to(out.dtype))
        shared = self.shared_output(model, layer, hidden)
        return out if shared is None else out + shared

    # --- checkpoints on disk -------------------------------------------------------------
    def read_expert(self, checkpoint_dir: str | Path, layer: int, expert: int,
                    tensors: CheckpointTensors | None = None) -> ExpertWeights:
        """Read one routed expert from a directory of safetensors shards, without building the model.

        Reads only that expert's slices. Understands the transformers 5 fused names and the
        per-expert names of hub checkpoints (`hub_names`). A missing tensor -> MoeprepError.
        ``tensors``: the directory's already opened index (saves re-reading it per expert).
        """
        self._check_moe_layer(layer)
        self._check_expert(expert)
        tensors = tensors or CheckpointTensors(checkpoint_dir)
        fused = self.fused_prefix.format(layer=layer)
        if tensors.has(f"{fused}.gate_up_proj"):
            return self._read_fused(tensors, fused, expert)
        if tensors.has(f"{fused}.gate_up_proj{BLOCKS_SUFFIX}"):
            return self._read_mxfp4(tensors, fused, expert)
        if self.hub_names is not None:
            prefix = self.hub_names.prefix.format(layer=layer, expert=expert)
            names = [f"{prefix}.{s}" for s in (self.hub_names.gate, self.hub_names.up, self.hub_names.down)]
            if any(tensors.has(n) for n in names):
                return ExpertWeights(*(tensors.get_float(n) for n in names))
            hint = f" or {names[0]}"
        else:
            hint = ""
        self._unreadable_expert_hint(tensors, fused)
        raise MoeprepError(
            f"checkpoint {checkpoint_dir} has no tensor {fused}.gate_up_proj{hint} "
            f"(layer {layer}, expert {expert}); is it a {self.architecture} checkpoint?"
        )

    def source_codes(self, tensors: CheckpointTensors, layer: int, expert: int) -> dict | None:
        """One expert's MXFP4 codes as the checkpoint stores them, by the experts module's parameter name:
        {"gate_up_proj": (blocks [2I, H/32, 16], scales [2I, H/32]), "down_proj": ([H, I/32, 16], [H, I/32])},
        rows being the matrices' outputs (the record layout of a transposed module's matrix); None for a
        checkpoint whose experts are not MXFP4."""
        fused = self.fused_prefix.format(layer=layer)
        if not tensors.has(f"{fused}.gate_up_proj{BLOCKS_SUFFIX}"):
            return None
        return {n: self._mxfp4_parts(tensors, f"{fused}.{n}", expert) for n in ("gate_up_proj", "down_proj")}

    def _mxfp4_parts(self, tensors: CheckpointTensors, name: str, expert: int):
        blocks, scales = (tensors.get(f"{name}{s}", expert) for s in (BLOCKS_SUFFIX, SCALES_SUFFIX))
        check_mxfp4(blocks, scales, name, tensors.shard_of(f"{name}{BLOCKS_SUFFIX}"))
        return blocks, scales

    def _read_mxfp4(self, tensors: CheckpointTensors, fused: str, expert: int) -> ExpertWeights:
        # blocks hold rows as outputs ([2I, H/32, 16], [H, I/32, 16]) whatever the bf16 layout's orientation
        gate_up, down = (mxfp4_dequantize(*self._mxfp4_parts(tensors, f"{fused}.{n}", expert), f"{fused}.{n}",
                                          tensors.shard_of(f"{fused}.{n}{BLOCKS_SUFFIX}"), expert)
                         for n in ("gate_up_proj", "down_proj"))
        bias = self.layout.has_bias
        return replace(self.layout, transposed=False).split(
            gate_up, down,
            tensors.get_float(f"{fused}.gate_up_proj_bias", expert) if bias else None,
            tensors.get_float(f"{fused}.down_proj_bias", expert) if bias else None,
        ).contiguous()

    def _unreadable_expert_hint(self, tensors: CheckpointTensors, fused: str) -> None:
        """Raise a specific MoeprepError for known checkpoint formats we cannot read (default: none)."""

    def _read_fused(self, tensors: CheckpointTensors, fused: str, expert: int) -> ExpertWeights:
        bias = self.layout.has_bias
        return self.layout.split(  # get_float: FP8 fused experts with per-expert block scales come dequantized
            tensors.get_float(f"{fused}.gate_up_proj", expert),
            tensors.get_float(f"{fused}.down_proj", expert),
            tensors.get_float(f"{fused}.gate_up_proj_bias", expert) if bias else None,
            tensors.get_float(f"{fused}.down_proj_bias", expert) if bias else None,
        ).contiguous()

    # --- summary -----------------------------------------------------------------------
    def expert_params(self, model: nn.Module) -> int:
        """Scalars in one routed expert (weights and biases)."""
        experts = self.experts(model, self.moe_layers[0])
        return sum(p.numel() for p in self._fused_params(experts) if p is not None) // self.num_experts

    def describe(self, model: nn.Module) -> dict:
        """The adapter's view of `model` (works on the meta device) as a JSON-ready dict.

        Keys: architecture, model_type, num_layers, moe_layers, num_moe_layers, num_experts, top_k,
        num_shared_experts, hidden_size, expert_intermediate_size, shared_intermediate_size,
        expert_params, expert_bytes_bf16, total_params, expert_params_total, active_params.
        active_params = everything that is not a routed expert + top_k routed experts per MoE layer.
        """
        n_moe = len(self.moe_layers)
        per_expert = self.expert_params(model)
        total = sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once
        routed_total = n_moe * self.num_experts * per_expert
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "moe_layers": self.moe_layers,
            "num_moe_layers": n_moe,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_shared_experts": self.num_shared_experts,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "expert_params": per_expert,
            "expert_bytes_bf16": 2 * per_expert,
            "total_params": total,
            "expert_params_total": routed_total,
            "active_params": total - routed_total + n_moe * self.top_k * per_expert,
        }
