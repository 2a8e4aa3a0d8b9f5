"""Mixtral (Mixtral-8x7B, 8x22B): softmax over all experts, top-k, renormalised; no shared experts.

transformers 5 `MixtralTopKRouter`: softmax of the logits in float32, top-k, divide by the sum of
the top-k; the weights stay float32. Hub checkpoints name experts
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down).
"""

from .base import HubExpertNames, MoeAdapter, softmax_topk


class MixtralAdapter(MoeAdapter):
    model_type = "mixtral"
    architecture = "Mixtral"
    num_experts_key = "num_local_experts"
    intermediate_key = "intermediate_size"
    hub_names = HubExpertNames(
        prefix="model.layers.{layer}.block_sparse_moe.experts.{expert}",
        gate="w1.weight",
        up="w3.weight",
        down="w2.weight",
    )

    def routing_weights(self):
        return {"function": "softmax", "renormalize": True, "scale": 1.0, "jitter_eps": 0.0}

    def select_experts(self, logits):
        return softmax_topk(logits, self.top_k, normalize=True, cast_back=False)
