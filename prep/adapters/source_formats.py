"""Released checkpoints' quantized weight formats, read exactly: MXFP4 experts and block-scaled FP8 weights.

- **MXFP4** (OCP Microscaling, as gpt-oss ships its experts): a tensor ``W`` of shape [..., rows, cols] is stored
  as ``W_blocks`` uint8 [..., rows, cols/32, 16] and ``W_scales`` uint8 [..., rows, cols/32]. Each byte of a
  block holds two FP4 (E2M1) codes, the low nibble first; a group of 32 consecutive weights along ``cols``
  shares the scale ``2 ** (scale - 127)`` (E8M0; 255 is NaN). A weight is ``FP4_E2M1[code] * 2 ** (scale - 127)``:
  exact in float32 and in bfloat16 (two significant bits).
- **FP8 with block scales** (Qwen3-*-FP8, DeepSeek-V3): ``W`` float8_e4m3fn [rows, cols] and ``W_scale_inv``
  float32 [ceil(rows/b0), ceil(cols/b1)]; a weight is ``W * scale_inv`` of its block (``quantization_config.
  weight_block_size``, [128, 128] by default).

The MXFP4 table and decode are the loader's (``loader/codec.py``), which stores MXFP4 records. Both dequantize to
float32 (then the model's dtype, once); a malformed tensor (wrong shape or dtype, a NaN or
non-positive scale) is one ``MoeprepError`` naming the tensor and its shard.
"""

from __future__ import annotations

import torch

from loader.codec import E8M0_BIAS, FP4_E2M1, MX_GROUP, decode_mxfp4
from prep.errors import MoeprepError

MX_BLOCK_BYTES = MX_GROUP // 2
E8M0_NAN = 255
FP8_BLOCK = (128, 128)
BLOCKS_SUFFIX, SCALES_SUFFIX, SCALE_INV_SUFFIX = "_blocks", "_scales", "_scale_inv"


def _bad(tensor: str, shard: str, problem: str, fix: str = "re-download that shard") -> MoeprepError:
    return MoeprepError(f"tensor {tensor} in shard {shard}: {problem}; {fix}")


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, tensor: str, shard: str) -> None:
    """Refuse blocks and scales that are not one MXFP4 tensor: dtypes, the 16-byte blocks, one scale per block,
    no NaN scale (``tensor``: the weight's name, without the suffixes)."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != MX_BLOCK_BYTES:
        raise _bad(f"{tensor}{BLOCKS_SUFFIX}", shard, f"MXFP4 blocks must be uint8 [..., groups, "
                   f"{MX_BLOCK_BYTES}], got {str(blocks.dtype).removeprefix('torch.')} {list(blocks.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise _bad(f"{tensor}{SCALES_SUFFIX}", shard, f"MXFP4 scales must be uint8 {list(blocks.shape[:-1])} (one "
                   f"per block of {tensor}{BLOCKS_SUFFIX}), got {str(scales.dtype).removeprefix('torch.')} "
                   f"{list(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        where = (scales == E8M0_NAN).nonzero()[0].tolist()
        raise _bad(f"{tensor}{SCALES_SUFFIX}", shard, f"scale at {where} is 255, the E8M0 NaN")


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, tensor: str = "?", shard: str = "?") -> torch.Tensor:
    """float32 [..., rows, cols] of MXFP4 ``blocks`` [..., rows, cols/32, 16] and ``scales`` [..., rows, cols/32]."""
    check_mxfp4(blocks, scales, tensor, shard)
    return decode_mxfp4(blocks.flatten(-2), scales)  # the loader's decode of an mxfp4 record


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``weight`` [..., cols] (cols a multiple of 32) in MXFP4: per group of 32 the shared
    exponent ``floor(log2(max |w|)) - 2`` (E2M1's largest exponent), each weight ``w / 2**e`` rounded to the
    nearest E2M1 value (ties to the even code) and clamped to +-6; a group of zeros gets exponent -127."""
    if weight.shape[-1] % MX_GROUP:
        raise MoeprepError(f"MXFP4 needs rows whose length is a multiple of {MX_GROUP}, got {weight.shape[-1]}")
    w = weight.detach().to(torch.float32).unflatten(-1, (-1, MX_GROUP))  # [..., groups, 32]
    amax = w.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))) - 2,
                           torch.full_like(amax, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(w, -exponent.unsqueeze(-1))
    magnitudes = torch.tensor(FP4_E2M1[:8], dtype=torch.float32, device=w.device)
    distance = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - magnitudes).abs()  # [..., groups, 32, 8]
    best = distance.min(-1, keepdim=True).values
    ties = distance == best
    # nearest magnitude; between two, the even code (E2M1's mantissa bit 0)
    even = ties & (torch.arange(8, device=w.device) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))
    code = torch.where(torch.signbit(scaled), code + 8, code).to(torch.uint8)  # -0.0 keeps its sign bit
    code = code.unflatten(-1, (MX_BLOCK_BYTES, 2))
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()


def check_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], tensor: str, shard: str) -> None:
    """Refuse an FP8 weight and block scales that do not fit: dtypes, one scale per block, finite positive scales."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or weight.dim() != 2:
        raise _bad(tensor, shard, f"a block-scaled FP8 weight must be a 2-D float8_e4m3fn matrix, got "
                   f"{str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}")
    want = [-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])]
    if not scale_inv.is_floating_point() or list(scale_inv.shape) != want:
        raise _bad(f"{tensor}{SCALE_INV_SUFFIX}", shard, f"block scales of a {list(weight.shape)} weight in "
                   f"{block[0]}x{block[1]} blocks must be a float {want} tensor, got "
                   f"{str(scale_inv.dtype).removeprefix('torch.')} {list(scale_inv.shape)}",
                   "re-download that shard, or set quantization_config.weight_block_size in config.json to the "
                   "block the checkpoint uses")
    bad = ~torch.isfinite(scale_inv) | (scale_inv <= 0)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise _bad(f"{tensor}{SCALE_INV_SUFFIX}", shard, f"block scale at {where} is {scale_inv[tuple(where)].item()}, "
                   "not a finite positive number")


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                   tensor: str = "?", shard: str = "?") -> torch.Tensor:
    """float32 [rows, cols] of an FP8 ``weight`` times the ``scale_inv`` of its ``block``."""
    check_fp8(weight, scale_inv, block, tensor, shard)
    rows, cols = weight.shape
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.to(torch.float32) * scale


def source_format(config) -> str:
    """How the checkpoint a config describes stores its weights: ``mxfp4`` (the experts), ``fp8`` (block-scaled
    linear weights) or ``float`` (as the model's dtype), from its ``quantization_config.quant_method``."""
    quant = getattr(config, "quantization_config", None)
    method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None))
    method = str(getattr(method, "value", method) or "").lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8":
        return "fp8"
    if method:
        raise MoeprepError(f"the checkpoint's quantization_config.quant_method is {method!r}; moeprep reads float, "
                           "mxfp4 and fp8 (block-scaled) checkpoints: dequantize it with transformers and "
                           "save_pretrained a float copy")
    return "float"


def stored_bytes(fmt: str, shape: tuple[int, ...], float_bytes: int, linear: bool,
                 block: tuple[int, int] = FP8_BLOCK) -> int:
    """Bytes a checkpoint in format ``fmt`` stores for one weight of ``shape``: an expert matrix (``linear``) in
    MXFP4 is 4.25 bits a weight; a linear weight in FP8 one byte plus a float32 scale per block; anything else
    ``float_bytes`` a value."""
    n = 1
    for s in shape:
        n *= s
    if linear and len(shape) >= 2 and fmt == "mxfp4" and shape[-1] % MX_GROUP == 0:
        return n // 2 + n // MX_GROUP
    if linear and len(shape) == 2 and fmt == "fp8":
        return n + 4 * (-(-shape[0] // block[0])) * (-(-shape[1] // block[1]))
    return n * float_bytes
