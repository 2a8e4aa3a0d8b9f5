"""Phi-MoE (Phi-3.5-MoE): the sparsemixer router, always two experts; no shared experts.

Eval-mode `sparsemixer` (transformers 5 `phimoe`): the first expert is the argmax of the logits;
its weight is its softmax over the logits that lie within a relative distance 2*jitter_eps of the
max (the rest masked to -inf). The second expert is the argmax with the first masked out, weighted
the same way with the second max as reference. jitter_eps is `router_jitter_noise` (0.01 for
Phi-3.5-MoE): in eval mode it is not noise but this masking threshold. The two weights are not
renormalised. Hub checkpoints name experts `block_sparse_moe.experts.{e}.w1/w3/w2` like Mixtral.
"""

import torch

from .base import HubExpertNames, MoeAdapter


def _sparsemixer_pick(scores: torch.Tensor, candidates: torch.Tensor, eps: float):
    """One sparsemixer step: scores [T, E] (raw logits), candidates [T, E] (logits, picked ones -inf).

    Returns (expert [T, 1], weight [T, 1]).
    """
    top, expert = candidates.max(dim=-1, keepdim=True)
    # The relative distance uses the raw logits, as in transformers, also in the second step.
    factor = scores.abs().clamp(min=top)
    far = ((top - scores) / factor) > (2 * eps)
    weight = torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1).gather(-1, expert)
    return expert, weight


class PhimoeAdapter(MoeAdapter):
    model_type = "phimoe"
    architecture = "Phi-MoE"
    num_experts_key = "num_local_experts"
    intermediate_key = "intermediate_size"
    router_attr = "router"
    hub_names = HubExpertNames(
        prefix="model.layers.{layer}.block_sparse_moe.experts.{expert}",
        gate="w1.weight",
        up="w3.weight",
        down="w2.weight",
    )

    @property
    def top_k(self):
        # sparsemixer is written for exactly two experts and ignores num_experts_per_tok.
        return 2

    def routing_weights(self):
        return {"function": "sparsemixer", "renormalize": False, "scale": 1.0,
                "jitter_eps": float(self.config.router_jitter_noise)}

    def select_experts(self, logits):
        eps = self.config.router_jitter_noise
        first, w_first = _sparsemixer_pick(logits, logits, eps)
        second, w_second = _sparsemixer_pick(logits, logits.scatter(-1, first, float("-inf")), eps)
        return torch.cat([first, second], dim=-1), torch.cat([w_first, w_second], dim=-1)
