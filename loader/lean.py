"""The one-token decode step of a decoder layer without transformers' per-module Python.

Why: a decode step's layer is mostly small operations, and transformers adds module calls, wrappers and reshapes
around each (on mixtral-shape with every expert cached, the lean step decodes 1.14x as fast: about 0.37 ms less per
layer on this project's 2-core VM; loader/README.md, "The lean decode step"). A ``LeanLayer`` replaces
a supported decoder layer's ``forward``; for one token with no attention mask (transformers passes none at a decode
step without padding or a full sliding window) it runs the same operations in the same order, with the same
functions for the rotary embedding and the attention, so its output equals transformers' bit for bit:

- the two norms as transformers' own formula, called as functions, not modules;
- the query, key and value projections as one product where the dense weights are int8 (``loader/dense.py``:
  the three ``Int8Linear`` become row views of one stored matrix, and each row is computed as before);
- the MoE block's router called as its module (the routing policies' and predictors' hooks run), then the
  engine's layer step directly (``ExpertEngine.run_layer``), where the block is a plain router-then-experts one.

Any other call (a prompt, a mask, ``output_attentions``, a forward hook on a module the step does not call, a layer
type not listed) runs transformers' own forward.
``MOEPREP_LEAN=off`` keeps transformers' forward everywhere (an A/B check; ``stats()["budget"]["decode_path"]``
says which ran).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

ENV = "MOEPREP_LEAN"
# decoder-layer parts whose forward a LeanLayer repeats exactly: the attention classes (Llama-style projections, an
# optional per-head q/k norm, rotary, the KV cache, the attention interface), RMSNorm classes with transformers'
# T5 formula, and MoE blocks that are a router then the experts
ATTENTION = {"MixtralAttention", "Qwen2MoeAttention", "Qwen3MoeAttention"}
NORMS = {"MixtralRMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm"}
PLAIN_BLOCKS = {"MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock"}


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm of the ``NORMS`` classes, as one function: the same operations in the same order."""
    dtype = x.dtype
    y = x.to(torch.float32)
    variance = y.pow(2).mean(-1, keepdim=True)
    y = y * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * y.to(dtype)


def _fuse_int8(modules: list) -> object | None:
    """One stored matrix over the rows of the ``Int8Linear`` ``modules`` (same input width and group), each
    module's parts re-pointed to its rows of it (nothing held twice); None where they are not all int8."""
    from loader.dense import Int8Linear
    from loader.kernels import StoredMatrix

    if not all(type(m) is Int8Linear for m in modules):
        return None
    groups = {m.matrix.qmat.group for m in modules}
    if len(groups) != 1 or len({m.in_features for m in modules}) != 1:
        return None
    parts = {name: torch.cat([m.parts[name] for m in modules]) for name in ("codes", "scale", "zero")}
    rows = 0
    for m in modules:
        own = {name: t[rows:rows + m.out_features] for name, t in parts.items()}
        m.parts = own
        m.matrix = StoredMatrix(8, (m.out_features, m.in_features), m.matrix.qmat.group, 0, own)
        rows += m.out_features
    return StoredMatrix(8, (rows, modules[0].in_features), groups.pop(), 0, parts)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A ``Linear``'s product without the module call (an ``Int8Linear``'s own forward)."""
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module.forward(x)


class LeanLayer:
    """A decoder layer's one-token step (module docstring); ``forward`` takes the layer's call as transformers
    makes it."""

    def __init__(self, layer: torch.nn.Module) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.layer, attn = layer, layer.self_attn
        self.attn = attn
        self.original = layer.forward
        family = sys.modules[type(attn).__module__]
        self.rotary = family.apply_rotary_pos_emb
        impl = attn.config._attn_implementation
        self.attention = family.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qkv = _fuse_int8([attn.q_proj, attn.k_proj, attn.v_proj])
        self.widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.biases = [m.bias for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        plain = type(mlp).__name__ in PLAIN_BLOCKS and getattr(experts, "_moeprep", None) is not None
        self.router, self.experts = (mlp.gate, experts) if plain else (None, None)
        # the modules a lean step computes without calling them: a hook on any sends the step to transformers
        skipped = [layer.input_layernorm, layer.post_attention_layernorm, attn, attn.q_proj, attn.k_proj,
                   attn.v_proj, attn.o_proj, self.q_norm, self.k_norm] + ([mlp, experts] if plain else [])
        self.skipped = [m for m in skipped if m is not None]

    def hooked(self) -> bool:
        """Whether a forward hook (global, or on a module the lean step does not call) asks for transformers' path."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.skipped)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        if (hidden_states.shape[1] != 1 or hidden_states.shape[0] != 1 or attention_mask is not None or cache is None
                or position_embeddings is None or self.layer.training or kwargs.get("output_attentions")
                or self.hooked()):
            return self.original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 cache=cache, position_embeddings=position_embeddings, **kwargs)
        layer, attn = self.layer, self.attn
        residual = hidden_states
        h = rms_norm(layer.input_layernorm, hidden_states)
        q, k, v = self._project(h)
        head = attn.head_dim
        q, k, v = q.view(1, 1, -1, head), k.view(1, 1, -1, head), v.view(1, 1, -1, head)
        if self.q_norm is not None:
            q, k = rms_norm(self.q_norm, q), rms_norm(self.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self.rotary(q, k, cos, sin)
        kwargs = {"position_ids": position_ids, **kwargs}  # what transformers' attention passes on
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        out, _ = self.attention(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling,
                                sliding_window=self.sliding_window, **kwargs)
        out = _linear(attn.o_proj, out.reshape(1, 1, -1).contiguous())
        hidden_states = residual + out
        residual = hidden_states
        h = rms_norm(layer.post_attention_layernorm, hidden_states)
        return residual + self._moe(h)

    def _project(self, h: torch.Tensor):
        attn = self.attn
        if self.qkv is None:
            return _linear(attn.q_proj, h), _linear(attn.k_proj, h), _linear(attn.v_proj, h)
        y = self.qkv.matmul(h.reshape(1, -1))
        outs = []
        for part, bias in zip(y.split(self.widths, dim=1), self.biases, strict=True):
            if bias is not None:
                part = part + bias.to(torch.float32)
            outs.append(part.to(h.dtype).view(1, 1, -1))
        return outs

    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.layer.mlp
        if self.router is None:
            return mlp(h)
        flat = h.view(-1, h.shape[-1])
        _, weights, index = self.router(flat)
        out = self.experts._moeprep.forward(self.experts, flat, index, weights)
        return out.reshape(h.shape)


def lean_problem(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` cannot take a ``LeanLayer`` (None: it can)."""
    names = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
    if not all(hasattr(layer, n) for n in names):
        return f"{type(layer).__name__} is not a norm-attention-norm-MoE layer"
    if type(layer.self_attn).__name__ not in ATTENTION:
        return f"no lean step for {type(layer.self_attn).__name__}"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [n for n in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)) if n]
    odd = [type(n).__name__ for n in norms if type(n).__name__ not in NORMS]
    if odd:
        return f"no lean step for {odd[0]}"
    return None


def install_lean(model: torch.nn.Module, device: torch.device) -> dict:
    """Give each supported decoder layer of ``model`` (on a CPU) its lean one-token step; returns what was done,
    for ``budget["decode_path"]``."""
    if os.environ.get(ENV, "").lower() == "off":
        return {"path": "transformers", "why": f"{ENV}=off"}
    if device.type != "cpu":
        return {"path": "transformers", "why": f"the lean step is for CPUs, not {device.type}"}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return {"path": "transformers", "why": f"{type(model).__name__} has no model.layers"}
    problems = [lean_problem(layer) for layer in layers]
    if any(problems):
        return {"path": "transformers", "why": next(p for p in problems if p)}
    plain = 0
    for layer in layers:
        lean = LeanLayer(layer)
        layer.forward = lean.forward
        layer._moeprep_lean = lean
        plain += lean.router is not None
    return {"path": "lean", "layers": len(layers), "direct_moe_layers": plain}
