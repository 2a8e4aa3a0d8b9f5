"""OLMoE: routes like Qwen3-MoE (softmax, top-k, `norm_topk_prob`), every layer MoE, no shared experts."""

from .qwen3_moe import Qwen3MoeAdapter


class OlmoeAdapter(Qwen3MoeAdapter):
    model_type = "olmoe"
    architecture = "OLMoE"
    intermediate_key = "intermediate_size"

    def is_moe_layer(self, layer):
        return True
