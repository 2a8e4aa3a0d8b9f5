"""The one module that imports hqq: half-quadratic quantization of expert matrices.

``encode_matrix`` turns a float matrix into the packed parts ``loader/codec.py`` defines (codes packed
by our own scheme in ``prep/quant/records.py``; per group a scale and a zero, as float16 or, with a
``meta_group``, as 8-bit codes), using hqq only for the optimisation of scale and zero; decoding never
needs hqq. ``fake_quantize`` is the round trip, for accuracy measurements.
"""

from __future__ import annotations

import torch
from hqq.core.quantize import Quantizer

from loader.codec import BITS, META_BITS, CodecError, MatrixSpec, RecordLayout, decode_matrix, dtype_name
from prep.adapters.source_formats import mxfp4_quantize
from prep.errors import MoeprepError
from prep.quant.records import join_record, pack_codes

SUPPORTED_BITS = tuple(sorted(BITS.values(), reverse=True))


def matrix_spec(name: str, weight: torch.Tensor, precision: str, group_size: int,
                transposed: bool = False, meta_group: int = 0) -> MatrixSpec:
    """The storage spec of ``weight`` at ``precision``; refuses mismatched group sizes up front.

    Biases and other 1-D tensors always stay in their source precision. ``transposed``: the tensor is
    laid out [in, out] (gpt-oss); it is quantized as its transpose so groups run along the input.
    ``meta_group``: 0 stores scale and zero as float16, > 0 as 8-bit codes (see ``loader/codec.py``).
    """
    if weight.ndim != 2 and precision != "passthrough":
        precision, group_size = "passthrough", 0
    quantized = precision != "passthrough"
    shape = tuple(weight.T.shape) if transposed and quantized else tuple(weight.shape)
    spec = MatrixSpec(name, shape, precision, dtype_name(weight.dtype), group_size if quantized else 0,
                      transposed and quantized, meta_group if quantized else 0)
    try:
        spec.check()
    except CodecError as e:
        raise MoeprepError(f"cannot quantize {name} of shape {tuple(weight.shape)} to {precision}: {e}; choose "
                           "a group size that divides the input dimension and a meta group >= 0") from None
    return spec


def quantize_meta(values: torch.Tensor, meta_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group values [G] -> (uint8 codes [G], float16 (step, offset) per meta group [M, 2], their
    float32 decoding [G], exactly as ``loader.codec.group_params`` computes it): min-max affine codes."""
    n = values.numel()
    v = values.float().reshape(-1)
    v = torch.cat([v, v[-1:].expand(-n % meta_group)]).view(-1, meta_group)  # last value pads: same min, max
    offset = v.min(1).values.half()
    step = ((v.max(1).values - offset.float()) / (2**META_BITS - 1)).clamp(min=0).half()
    s, o = step.float()[:, None], offset.float()[:, None]
    q = torch.where(s > 0, (v - o) / s.clamp(min=1e-30), 0)  # a constant meta group: all codes 0
    q = q.round().clamp(0, 2**META_BITS - 1)
    return q.reshape(-1)[:n].to(torch.uint8), torch.stack([step, offset], 1), (q * s + o).reshape(-1)[:n]


def encode_matrix(spec: MatrixSpec, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` as the record parts of ``spec`` (see ``MatrixSpec.parts``).

    With a meta group, hqq's scale is quantized to 8 bits; then each group's zero is refitted by least
    squares for hqq's codes and that scale (it absorbs part of the scale's error), quantized, and the
    codes are rounded again against the stored scale and zero, as hqq itself rounds against its final
    ones. Without the second rounding int8 loses 15-35% MSE to its 8-bit zero; with it every precision
    stays within a few percent of float16 metadata (``tests/loader/test_codec.py`` measures it).
    """
    if spec.transposed:
        weight = weight.T
    if tuple(weight.shape) != spec.shape:
        raise MoeprepError(f"{spec.name}: shape {tuple(weight.shape)} does not match the layout {spec.shape}")
    if spec.precision == "passthrough":
        return {spec.name: weight.detach().contiguous().cpu()}
    if spec.precision == "mxfp4":  # not HQQ: the format's own rounding (``mxfp4_quantize``)
        blocks, scales = mxfp4_quantize(weight.detach().float().cpu())
        return {f"{spec.name}.codes": blocks.reshape(-1), f"{spec.name}.scales": scales.reshape(-1)}
    bits = BITS[spec.precision]
    w = weight.detach().float().cpu()
    w_q, meta = Quantizer.quantize(w, nbits=bits, group_size=spec.group_size, axis=1, optimize=True,
                                   bitpack=False, compute_dtype=torch.float32, device="cpu")
    if not spec.meta_group:
        return {
            f"{spec.name}.codes": pack_codes(w_q.to(torch.int32), bits),
            f"{spec.name}.scale": meta["scale"].reshape(-1).to(torch.float16),
            f"{spec.name}.zero": meta["zero"].reshape(-1).to(torch.float16),
        }
    groups = w.reshape(-1, spec.group_size)  # [groups, group_size]
    scale_q, scale_meta, scale = quantize_meta(meta["scale"], spec.meta_group)
    zero = w_q.reshape(groups.shape).float().mean(1) - groups.mean(1) / scale  # argmin_z |w - (codes-z)scale|²
    zero_q, zero_meta, zero = quantize_meta(zero, spec.meta_group)
    codes = (groups / scale[:, None] + zero[:, None]).round().clamp(0, 2**bits - 1)
    return {
        f"{spec.name}.codes": pack_codes(codes.to(torch.int32), bits),
        f"{spec.name}.scale.q": scale_q, f"{spec.name}.scale.meta": scale_meta,
        f"{spec.name}.zero.q": zero_q, f"{spec.name}.zero.meta": zero_meta,
    }


def encode_expert(tensors: dict[str, torch.Tensor], precision: str, group_size: int,
                  transposed: bool = False, meta_group: int = 0,
                  keep: dict | None = None) -> tuple[RecordLayout, torch.Tensor]:
    """One expert's named tensors -> (its record layout, its packed uint8 record). ``keep``: {matrix name:
    (codes, scales)} already in ``precision``'s format (an MXFP4 source's own), stored as they are."""
    specs = tuple(matrix_spec(name, t, precision, group_size, transposed, meta_group)
                  for name, t in tensors.items())
    layout = RecordLayout(specs)
    parts: dict[str, torch.Tensor] = {}
    for spec in specs:
        if keep and spec.name in keep and spec.precision == "mxfp4":
            codes, scales = keep[spec.name]
            if codes.numel() * 2 != spec.numel or scales.numel() * 32 != spec.numel:
                raise MoeprepError(f"{spec.name}: the source's MXFP4 codes ({list(codes.shape)}) do not fit the "
                                   f"matrix {spec.shape}")
            parts[f"{spec.name}.codes"], parts[f"{spec.name}.scales"] = codes.reshape(-1), scales.reshape(-1)
        else:
            parts.update(encode_matrix(spec, tensors[spec.name]))
    return layout, join_record(layout, parts)


def fake_quantize(weight: torch.Tensor, nbits: int, group_size: int, meta_group: int = 0) -> torch.Tensor:
    """``weight`` [out, in] through the codec at ``nbits`` (and ``meta_group``) and back, in its dtype."""
    if nbits not in SUPPORTED_BITS:
        raise MoeprepError(f"unsupported bit-width {nbits}; use one of {SUPPORTED_BITS}")
    if weight.ndim != 2 or weight.shape[-1] % group_size:
        raise MoeprepError(
            f"group size {group_size} does not divide the matrix of shape {tuple(weight.shape)}; "
            "pick a group size that divides its input dimension"
        )
    spec = matrix_spec("w", weight, f"int{nbits}", group_size, meta_group=meta_group)
    return decode_matrix(spec, encode_matrix(spec, weight))


def encode_rows(spec: MatrixSpec, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` as a row-interleaved matrix (``spec.rows``): encoded part after part, then each row's
    slices of every part joined, so row j is one contiguous run of ``spec.row_bytes`` bytes."""
    rows = spec.shape[0]
    parts = encode_matrix(spec.plain(), weight)
    slices = [parts[name].contiguous().reshape(-1).view(torch.uint8).view(rows, -1) for name, _d, _s in spec.row_parts()]
    return {f"{spec.name}.rows": torch.cat(slices, 1).reshape(-1)}


def _neuron_matrices(weights, precision: str, group_size: int, meta_group: int) -> tuple[RecordLayout, dict]:
    """(the neuron layout, {matrix name: tensor}) of one expert; the layout reads shapes and dtypes only."""
    hidden = weights.gate.shape[1]
    quantized = precision != "passthrough"
    if quantized and hidden % group_size:
        raise MoeprepError(f"the neuron layout quantizes along the hidden dimension {hidden}; group size {group_size} "
                           "does not divide it: choose one that does")
    tensors = {"gate": weights.gate}
    for name in ("gate_bias", "up_bias", "down_bias"):
        if getattr(weights, name) is not None:
            tensors[name] = getattr(weights, name)
    neurons = torch.cat([weights.up, weights.down.T], 1).contiguous()
    specs = [matrix_spec(name, t, precision, group_size, meta_group=meta_group) for name, t in tensors.items()]
    per_row = neurons.shape[1] // group_size if quantized else 0
    rows = MatrixSpec("neurons", tuple(neurons.shape), precision if quantized else "passthrough",
                      dtype_name(neurons.dtype), group_size if quantized else 0, False,
                      per_row if quantized and meta_group else 0, rows=True)
    rows.check()
    return RecordLayout((*specs, rows)), {**tensors, "neurons": neurons}


def neuron_layout(weights, precision: str, group_size: int, meta_group: int = 0) -> RecordLayout:
    """The neuron layout of an expert of these shapes and dtypes, without encoding it: views on the meta device
    (a streamed model's experts) do, so a stage can describe its store before any record is written."""
    return _neuron_matrices(weights, precision, group_size, meta_group)[0]


def encode_neuron_expert(weights, precision: str, group_size: int, meta_group: int = 0
                         ) -> tuple[RecordLayout, torch.Tensor]:
    """One expert (``prep.adapters.base.ExpertWeights``) -> (its neuron layout, record): see
    ``loader.codec.NeuronLayout``. Groups run along the hidden dimension for W1, W3 and W2 alike (W2 is
    stored transposed, one down column per neuron row); with a meta group, the gate matrix keeps the
    store's meta group and each neuron row gets one meta group of its own."""
    layout, tensors = _neuron_matrices(weights, precision, group_size, meta_group)
    *specs, rows = layout.matrices
    parts: dict[str, torch.Tensor] = {}
    for spec in specs:
        parts.update(encode_matrix(spec, tensors[spec.name]))
    parts.update(encode_rows(rows, tensors["neurons"]))
    return layout, join_record(layout, parts)
