"""DeepSeek-V2 (V2, V2-Lite): dense first layers, shared experts, greedy or group-limited routing.

transformers 5 `DeepseekV2TopkRouter`: logits in float32, softmax; `topk_method` "greedy" takes the
top-k over all experts, "group_limited_greedy" first keeps the `topk_group` groups (of `n_group`)
with the highest max score and takes the top-k inside them. The top-k weights are multiplied by
`routed_scaling_factor` and never renormalised (the HF code ignores `norm_topk_prob`, which is
false for the released V2 models). Layers below `first_k_dense_replace` have a dense MLP; every MoE
layer adds `n_shared_experts` shared experts, fused into one MLP of width n_shared * I.
"""

import torch
import torch.nn.functional as F

from prep.errors import MoeprepError

from .base import PROJ_EXPERT_NAMES, MoeAdapter


class DeepseekV2Adapter(MoeAdapter):
    model_type = "deepseek_v2"
    architecture = "DeepSeek-V2"
    num_experts_key = "n_routed_experts"
    intermediate_key = "moe_intermediate_size"
    shared_attr = "shared_experts"
    hub_names = PROJ_EXPERT_NAMES

    def is_moe_layer(self, layer):
        return layer >= self.config.first_k_dense_replace

    @property
    def num_shared_experts(self):
        return self.config.n_shared_experts or 0

    @property
    def shared_intermediate_size(self):
        return self.num_shared_experts * self.expert_intermediate_size

    def router_logits(self, router, hidden):
        return F.linear(hidden.float(), router.weight.float())

    def routing_weights(self):
        return {"function": "softmax", "renormalize": False, "scale": float(self.config.routed_scaling_factor),
                "jitter_eps": 0.0}

    def select_experts(self, logits):
        cfg = self.config
        scores = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
        if cfg.topk_method == "group_limited_greedy":
            groups, per_group = cfg.n_group, self.num_experts // cfg.n_group
            group_scores = scores.view(-1, groups, per_group).max(dim=-1).values  # [T, groups]
            keep = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1)
            expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, per_group).reshape(-1, self.num_experts)
            scores = scores.masked_fill(~expert_mask.bool(), 0.0)
        elif cfg.topk_method != "greedy":
            raise MoeprepError(
                f"DeepSeek-V2 topk_method {cfg.topk_method!r} is not supported (greedy, group_limited_greedy)"
            )
        # sorted=False like the model, so the slot order of the experts matches it too.
        weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return ids, weights * cfg.routed_scaling_factor
