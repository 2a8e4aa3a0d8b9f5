"""Qwen3-MoE: softmax over all experts, top-k, renormalised only when `norm_topk_prob`; no shared experts.

Dense MLP layers where `mlp_only_layers` or `decoder_sparse_step` say so. This adapter is also the
base of OLMoE and Qwen2-MoE, which route the same way. Hub checkpoints name experts
`mlp.experts.{e}.gate_proj/up_proj/down_proj`.
"""

from .base import PROJ_EXPERT_NAMES, MoeAdapter, softmax_topk


class Qwen3MoeAdapter(MoeAdapter):
    model_type = "qwen3_moe"
    architecture = "Qwen3-MoE"
    num_experts_key = "num_experts"
    intermediate_key = "moe_intermediate_size"
    hub_names = PROJ_EXPERT_NAMES

    def is_moe_layer(self, layer):
        # Same rule as Qwen3MoeDecoderLayer.__init__.
        dense_layers = getattr(self.config, "mlp_only_layers", None) or []
        step = getattr(self.config, "decoder_sparse_step", 1)
        return layer not in dense_layers and self.num_experts > 0 and (layer + 1) % step == 0

    def routing_weights(self):
        return {"function": "softmax", "renormalize": bool(self.config.norm_topk_prob), "scale": 1.0, "jitter_eps": 0.0}

    def select_experts(self, logits):
        # Softmax in float32, weights cast back to the logits dtype.
        return softmax_topk(logits, self.top_k, normalize=bool(self.config.norm_topk_prob), cast_back=True)
