"""A loaded model split the way an artifact stores it: the expert parameters (records) and every other
tensor (the dense weights)."""

from __future__ import annotations

import torch


def expert_parameters(model, adapter) -> tuple[set[str], list]:
    """(the state-dict names of every expert parameter, the experts modules in MoE-layer order)."""
    paths = adapter.module_paths(model)
    experts = [adapter.experts(model, layer) for layer in adapter.moe_layers]
    return ({f"{path}.{p}" for path, m in zip(paths["experts_modules"], experts, strict=True)
             for p, _ in m.named_parameters(recurse=False)}, experts)


def dense_state(model, expert_params: set[str]) -> dict[str, torch.Tensor]:
    """Every non-expert tensor once (a tied lm_head is left to the loader to tie again)."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if name in expert_params:
            continue
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().contiguous().cpu()
    return out
