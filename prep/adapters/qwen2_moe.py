"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen3-MoE routing plus one sigmoid-gated shared expert.

`Qwen2MoeSparseMoeBlock` adds `sigmoid(shared_expert_gate(x)) * shared_expert(x)` to the routed
output; the shared expert is a dense MLP of width `shared_expert_intermediate_size`.
"""

import torch

from .qwen3_moe import Qwen3MoeAdapter


class Qwen2MoeAdapter(Qwen3MoeAdapter):
    model_type = "qwen2_moe"
    architecture = "Qwen2-MoE"
    shared_attr = "shared_expert"

    @property
    def num_shared_experts(self):
        return 1

    @property
    def shared_intermediate_size(self):
        return self.config.shared_expert_intermediate_size

    def shared_output(self, model, layer, hidden):
        hidden = hidden.reshape(-1, self.hidden_size)
        gate = self.moe_block(model, layer).shared_expert_gate  # Linear(H, 1)
        return torch.sigmoid(gate(hidden)) * super().shared_output(model, layer, hidden)
