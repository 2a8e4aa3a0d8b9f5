"""AdapMoE's per-layer sensitivity (AdapMoE section 4.2, eqs. 3-8): S_l, the Fisher-diagonal sum of MoE
layer l's output, which the adaptive-gating rule (1 - alpha)^2 * S_l <= T weighs a dropped expert by.

Convention (the empirical Fisher; only the ratios S_l / S_l' matter once T is calibrated, so T does not
carry over between implementations):

- labels: the calibration text's own next tokens; loss: the SUM over predicted positions of the next-token
  cross-entropy (summing keeps S independent of sequence length);
- S_l = the mean over predicted positions (every position but each sequence's last) of the squared norm of
  d loss / d O_l(position), O_l the MoE block's output, accumulated in float64.

Gradients reach activations only: every parameter is frozen for the pass (and restored), and the input
embeddings are the leaf that makes a graph exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from prep.errors import MoeprepError
from prep.streaming import stream_of

CONVENTION = ("empirical Fisher: next-token labels from the calibration text; loss summed over predicted "
              "positions; S_l = mean over predicted positions of ||d loss / d MoE output||^2")


@dataclass(frozen=True)
class FisherSensitivity:
    sensitivity: list  # [L] S_l per MoE layer position
    positions: int  # predicted positions averaged over
    convention: str = CONVENTION


class _Checkpointed(torch.nn.Module):
    """A decoder layer run under non-reentrant activation checkpointing: the graph is kept (so the MoE output's
    gradient still arrives), the tensors it saves are not, and backward recomputes the layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def fisher_sensitivity(model, adapter, sequences: list[torch.Tensor], loss_scale: float = 1.0,
                       progress=None) -> FisherSensitivity:
    """S_l of every MoE layer over ``sequences`` (1-D token tensors, each run alone). ``loss_scale`` multiplies
    the loss (S scales by its square: a check of the convention)."""
    seqs = [s for s in sequences if s.numel() >= 2]
    if not seqs:
        raise MoeprepError("Fisher sensitivity needs calibration sequences of at least 2 tokens")
    blocks = [adapter.moe_block(model, layer) for layer in adapter.moe_layers]
    outputs: list = [None] * len(blocks)

    def keep(i):
        def hook(_module, _args, output):
            if outputs[i] is not None:  # a checkpointed layer recomputed for backward: keep the first output
                return
            out = adapter.block_output(output)
            out.retain_grad()
            outputs[i] = out
        return hook

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    handles = [b.register_forward_hook(keep(i)) for i, b in enumerate(blocks)]
    layers = adapter.decoder_layers(model)
    originals = list(layers)
    if stream_of(model, adapter) is not None:
        # a streamed model: backward would keep every layer's experts alive (saved for the gradient), so each
        # decoder layer is checkpointed and recomputed, its experts read again, when backward reaches it
        for i, layer in enumerate(originals):
            layers[i] = _Checkpointed(layer)
    acc = torch.zeros(len(blocks), dtype=torch.float64)
    positions = 0
    was_training = model.training
    model.eval()
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        embed = model.get_input_embeddings()
        for i, seq in enumerate(seqs):
            ids = seq.view(1, -1).to(embed.weight.device)
            with torch.enable_grad():
                inputs = embed(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=inputs, use_cache=False).logits[0, :-1].float()
                loss = F.cross_entropy(logits, ids[0, 1:], reduction="sum") * loss_scale
                loss.backward()
            for layer, out in enumerate(outputs):
                if out is None or out.grad is None:
                    raise MoeprepError(f"MoE layer position {layer} got no gradient; the adapter's moe_block does "
                                       "not produce the layer's output")
                grad = out.grad.reshape(-1, out.shape[-1])[: ids.shape[1] - 1]
                acc[layer] += grad.double().square().sum().item()
            positions += ids.shape[1] - 1
            outputs[:] = [None] * len(blocks)
            if progress is not None:
                progress(i + 1, len(seqs))
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for handle in handles:
            handle.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    return FisherSensitivity([float(v) for v in acc / positions], positions)
