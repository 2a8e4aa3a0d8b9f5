"""The one module that imports hqq: half-quadratic quantization of expert matrices.

``encode_matrix`` turns a float matrix into the packed parts ``loader/codec.py`` defines (codes packed
by our own scheme in ``prep/records.py``, float16 scale and zero per group), using hqq only for the optimisation of scale and
zero; decoding never needs hqq. ``fake_quantize`` is the round trip, for accuracy measurements.
"""

from __future__ import annotations

import torch
from hqq.core.quantize import Quantizer

from loader.codec import BITS, CodecError, MatrixSpec, RecordLayout, decode_matrix, dtype_name
from prep.errors import MoeprepError
from prep.records import join_record, pack_codes

SUPPORTED_BITS = tuple(sorted(BITS.values(), reverse=True))


def matrix_spec(name: str, weight: torch.Tensor, precision: str, group_size: int,
                transposed: bool = False) -> MatrixSpec:
    """The storage spec of ``weight`` at ``precision``; refuses mismatched group sizes up front.

    Biases and other 1-D tensors always stay in their source precision. ``transposed``: the tensor is
    laid out [in, out] (gpt-oss); it is quantized as its transpose so groups run along the input.
    """
    if weight.ndim != 2 and precision != "passthrough":
        precision, group_size = "passthrough", 0
    quantized = precision != "passthrough"
    shape = tuple(weight.T.shape) if transposed and quantized else tuple(weight.shape)
    spec = MatrixSpec(name, shape, precision, dtype_name(weight.dtype), group_size if quantized else 0,
                      transposed and quantized)
    try:
        spec.check()
    except CodecError as e:
        raise MoeprepError(f"cannot quantize {name} of shape {tuple(weight.shape)} to {precision}: {e}; "
                           "choose a group size that divides the input dimension") from None
    return spec


def encode_matrix(spec: MatrixSpec, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` as the record parts of ``spec`` (see ``MatrixSpec.parts``)."""
    if spec.transposed:
        weight = weight.T
    if tuple(weight.shape) != spec.shape:
        raise MoeprepError(f"{spec.name}: shape {tuple(weight.shape)} does not match the layout {spec.shape}")
    if spec.precision == "passthrough":
        return {spec.name: weight.detach().contiguous().cpu()}
    w_q, meta = Quantizer.quantize(weight.detach().float().cpu(), nbits=BITS[spec.precision],
                                   group_size=spec.group_size, axis=1, optimize=True, bitpack=False,
                                   compute_dtype=torch.float32, device="cpu")
    return {
        f"{spec.name}.codes": pack_codes(w_q.to(torch.int32), BITS[spec.precision]),
        f"{spec.name}.scale": meta["scale"].reshape(-1).to(torch.float16),
        f"{spec.name}.zero": meta["zero"].reshape(-1).to(torch.float16),
    }


def encode_expert(tensors: dict[str, torch.Tensor], precision: str, group_size: int,
                  transposed: bool = False) -> tuple[RecordLayout, torch.Tensor]:
    """One expert's named tensors -> (its record layout, its packed uint8 record)."""
    specs = tuple(matrix_spec(name, t, precision, group_size, transposed) for name, t in tensors.items())
    layout = RecordLayout(specs)
    parts: dict[str, torch.Tensor] = {}
    for spec in specs:
        parts.update(encode_matrix(spec, tensors[spec.name]))
    return layout, join_record(layout, parts)


def fake_quantize(weight: torch.Tensor, nbits: int, group_size: int) -> torch.Tensor:
    """``weight`` [out, in] through the codec at ``nbits`` and back, in ``weight``'s dtype."""
    if nbits not in SUPPORTED_BITS:
        raise MoeprepError(f"unsupported bit-width {nbits}; use one of {SUPPORTED_BITS}")
    if weight.ndim != 2 or weight.shape[-1] % group_size:
        raise MoeprepError(
            f"group size {group_size} does not divide the matrix of shape {tuple(weight.shape)}; "
            "pick a group size that divides its input dimension"
        )
    spec = matrix_spec("w", weight, f"int{nbits}", group_size)
    return decode_matrix(spec, encode_matrix(spec, weight))
