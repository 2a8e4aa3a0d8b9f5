"""The one module that imports hqq: half-quadratic quantization of expert matrices.

For now it offers fake quantization (quantize then dequantize back to float), which is what the
reference model's quality check and the sensitivity sweep need to measure accuracy loss.
"""

from __future__ import annotations

import torch
from hqq.core.quantize import Quantizer

from prep.errors import MoeprepError

SUPPORTED_BITS = (8, 4, 3, 2)


def fake_quantize(weight: torch.Tensor, nbits: int, group_size: int) -> torch.Tensor:
    """``weight`` [out, in] quantized with HQQ to ``nbits`` in groups of ``group_size`` along the input
    dimension, and dequantized back to ``weight``'s dtype."""
    if nbits not in SUPPORTED_BITS:
        raise MoeprepError(f"unsupported bit-width {nbits}; use one of {SUPPORTED_BITS}")
    if weight.numel() % group_size or weight.shape[-1] % group_size:
        raise MoeprepError(
            f"group size {group_size} does not divide the matrix of shape {tuple(weight.shape)}; "
            "pick a group size that divides its input dimension"
        )
    w_q, meta = Quantizer.quantize(weight.detach().float().cpu(), nbits=nbits, group_size=group_size, axis=1,
                                   optimize=True, bitpack=True, compute_dtype=torch.float32, device="cpu")
    return Quantizer.dequantize(w_q, meta).reshape(weight.shape).to(weight.dtype)
