"""gpt-oss: biased router, softmax over the top-k logits, clamped SwiGLU experts with biases.

transformers 5 `GptOssTopKRouter`: logits = x W^T + b, top-k of the logits, softmax over those k
values. `GptOssExperts` stores experts transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H])
with gate and up interleaved column by column, plus biases, and computes
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out = (up + 1) * gate * sigmoid(alpha * gate)
with alpha = `swiglu_alpha` (1.702) and limit = `swiglu_limit` (7.0); `hidden_act` is not used.
Released checkpoints store the experts MXFP4-quantized (`*_blocks`, `*_scales`), read as they ship
(`MoeAdapter.read_expert`, `source_codes`); bf16 checkpoints (and save_pretrained of a dequantized model)
use the fused names.
"""

import torch

from .base import FusedLayout, MoeAdapter


class GptOssAdapter(MoeAdapter):
    model_type = "gpt_oss"
    architecture = "gpt-oss"
    num_experts_key = "num_local_experts"
    intermediate_key = "intermediate_size"
    router_attr = "router"
    layout = FusedLayout(transposed=True, interleaved=True, has_bias=True)

    def routing_weights(self):
        return {"function": "softmax_selected", "renormalize": True, "scale": 1.0, "jitter_eps": 0.0}

    def select_experts(self, logits):
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype)

    def glu(self, gate, up):
        limit, alpha = self.config.swiglu_limit, self.config.swiglu_alpha
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
