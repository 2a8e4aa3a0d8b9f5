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
float32 (then the model's dtype, once); a malformed tensor (wrong shape or dtype, a NaN or non-positive scale) or a
value that dequantizes to inf or NaN (an E8M0 scale of 254 times a code of 2 overflows float32; an FP8 NaN code) is
one ``MoeprepError`` naming the tensor, its shard and the block. ``unpaired`` refuses, from the names alone, a
quantized weight without its scales or scales without their weight. The ``quantization_config`` of a config
(``source_format``, ``fp8_block``) is checked for its types: a wrong one is one error, not a traceback.
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


def _check_finite(values: torch.Tensor, block: tuple[int, ...], tensor: str, shard: str, index: int | None,
                  what) -> None:
    """Refuse dequantized ``values`` holding inf or NaN, naming the first such value's block (``block``: the size
    of a block along each of the last dims; ``index``: the slice along dim 0 the values were read from, so the
    block is named in the stored tensor's coordinates); ``what(position)`` says what made it."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    position = bad.nonzero()[0].tolist()
    lead = len(position) - len(block)
    where = position[:lead] + [p // b for p, b in zip(position[lead:], block, strict=True)]
    where = ([] if index is None else [index]) + where
    raise _bad(tensor, shard, f"block {where} dequantizes to {values[tuple(position)].item()} "
               f"({what(position)}), not a finite number", "re-download that shard; if it persists, the release "
               "itself holds that value and cannot be prepared as it is")


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


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, tensor: str = "?", shard: str = "?",
                     index: int | None = None) -> torch.Tensor:
    """float32 [..., rows, cols] of MXFP4 ``blocks`` [..., rows, cols/32, 16] and ``scales`` [..., rows, cols/32]
    (``index``: the slice along dim 0 of the stored tensors they are, for messages); a value that is not finite
    is refused, naming its block."""
    check_mxfp4(blocks, scales, tensor, shard)
    values = decode_mxfp4(blocks.flatten(-2), scales)  # the loader's decode of an mxfp4 record

    def what(position):
        group, within = divmod(position[-1], MX_GROUP)
        byte = int(blocks[tuple(position[:-1]) + (group, within // 2)])
        code = FP4_E2M1[byte >> 4 if within % 2 else byte & 0x0F]
        scale = int(scales[tuple(position[:-1]) + (group,)])
        return f"its code {code} times the block's scale 2**{scale - E8M0_BIAS} overflows float32"

    _check_finite(values, (1, MX_GROUP), f"{tensor}{BLOCKS_SUFFIX}", shard, index, what)
    return values


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
        raise _bad(tensor, shard, f"it has block scales {tensor}{SCALE_INV_SUFFIX} beside it, so it must be a 2-D "
                   f"float8_e4m3fn matrix (its scales would be ignored otherwise), got "
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
                   tensor: str = "?", shard: str = "?", index: int | None = None) -> torch.Tensor:
    """float32 [rows, cols] of an FP8 ``weight`` times the ``scale_inv`` of its ``block`` (``index``: the slice
    along dim 0 of the stored tensors they are, for messages); a value that is not finite (an FP8 NaN code, a
    product past float32) is refused, naming its block."""
    check_fp8(weight, scale_inv, block, tensor, shard)
    rows, cols = weight.shape
    b0, b1 = min(block[0], rows), min(block[1], cols)  # a block past the matrix is one scale: repeat no further
    scale = scale_inv.to(torch.float32).repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    values = weight.to(torch.float32) * scale

    def what(position):
        return (f"the stored value {weight[tuple(position)].float().item()} times the block's scale "
                f"{scale[tuple(position)].item()}")

    _check_finite(values, block, tensor, shard, index, what)
    return values


def unpaired(names, mxfp4: bool) -> tuple[str, str] | None:
    """The first tensor of ``names`` (a checkpoint's) that is half of a quantized weight, and what is wrong with
    it: block scales ``W_scale_inv`` without their weight ``W``; MXFP4 ``W_blocks`` without ``W_scales`` or beside
    a plain ``W`` (which of the two is the weight?); and, in an ``mxfp4`` checkpoint, ``W_scales`` without
    ``W_blocks``. None: every quantized weight is whole. (An FP8 weight without its scales shows only in its
    dtype: ``CheckpointTensors.get_float`` refuses it.)"""
    names = set(names)
    for name in sorted(names):
        if name.endswith(SCALE_INV_SUFFIX) and name.removesuffix(SCALE_INV_SUFFIX) not in names:
            return name, f"block scales without their weight {name.removesuffix(SCALE_INV_SUFFIX)}"
        if name.endswith(BLOCKS_SUFFIX):
            weight = name.removesuffix(BLOCKS_SUFFIX)
            if f"{weight}{SCALES_SUFFIX}" not in names:
                return name, f"MXFP4 blocks without their scales {weight}{SCALES_SUFFIX}"
            if weight in names:
                return weight, (f"a plain weight beside the MXFP4 weight {name} and {weight}{SCALES_SUFFIX}: "
                                "the checkpoint holds the weight twice")
        if mxfp4 and name.endswith(SCALES_SUFFIX) and f"{name.removesuffix(SCALES_SUFFIX)}{BLOCKS_SUFFIX}" not in names:
            return name, f"MXFP4 scales without their blocks {name.removesuffix(SCALES_SUFFIX)}{BLOCKS_SUFFIX}"
    return None


def _quantization(config) -> tuple[object, str]:
    """(``quantization_config``, its ``quant_method`` in lower case) of a transformers config or of config.json's
    dict; (None, "") for a float checkpoint. A section that is not an object with a string ``quant_method`` is
    refused."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                        None)
    if quant is None:
        return None, ""
    if not isinstance(quant, dict) and not hasattr(quant, "quant_method"):
        raise MoeprepError(f"the checkpoint's config.json has a quantization_config of type {type(quant).__name__}, "
                           "not an object with a quant_method; fix config.json (a float checkpoint has none)")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if not isinstance(method, str) or not method:
        raise MoeprepError(f"the checkpoint's quantization_config.quant_method is {method!r}, not the name of a "
                           "quantization method (mxfp4, fp8); fix config.json (a float checkpoint has no "
                           "quantization_config)")
    return quant, method.lower()


def quant_method(config) -> str:
    """The ``quantization_config.quant_method`` of a config (lower case; "" for none), whatever it is."""
    return _quantization(config)[1]


def fp8_block(config) -> tuple[int, int]:
    """The block of an ``fp8`` checkpoint's scales: ``quantization_config.weight_block_size``, [128, 128] when it
    states none (as transformers reads it). Two positive integers, or one error."""
    quant, method = _quantization(config)
    if method != "fp8":
        return FP8_BLOCK
    block = quant.get("weight_block_size") if isinstance(quant, dict) else getattr(quant, "weight_block_size", None)
    if block is None:
        return FP8_BLOCK
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MoeprepError(f"the checkpoint's quantization_config.weight_block_size is {block!r}, not two positive "
                           "integers [rows, cols]; fix config.json (the FP8 releases state [128, 128])")
    return int(block[0]), int(block[1])


def check_quantization_config(config) -> None:
    """Refuse a ``quantization_config`` of the wrong type (not an object, a quant_method that is not a string, an
    fp8 block size that is not two positive integers), whatever its method; a method this reader cannot
    dequantize is ``source_format``'s to refuse."""
    fp8_block(config)


def source_format(config) -> str:
    """How the checkpoint a config describes stores its weights: ``mxfp4`` (the experts), ``fp8`` (block-scaled
    linear weights) or ``float`` (as the model's dtype), from its ``quantization_config.quant_method``; the fp8
    block size is checked here too, so a run and its dry run refuse the same config."""
    method = quant_method(config)
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8":
        fp8_block(config)
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
