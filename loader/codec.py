"""Packed expert formats: bit packing, record layout, and decoding back to float matrices.

A quantized matrix [out, in] is stored as codes (unsigned ints of ``bits`` bits, ``group_size``
consecutive weights of a row share one scale and one zero), packed into bytes, plus a scale and a zero
per group: ``W = (code - zero) * scale``. With ``meta_group`` 0 the scale and zero are float16 (32 bits
per group, 1 bit per weight at int2 g16). With ``meta_group`` > 0 they are themselves quantized, as in
HQQ: 8-bit codes, with a float16 step and offset per ``meta_group`` consecutive groups (row-major,
the last meta group may be partial): ``scale = q * step + offset``. The offset form (not hqq's
``(q - zero) * step``) keeps float16 exact enough when the values' range is small next to their size.
Passthrough matrices are stored as their raw bytes. An ``mxfp4`` matrix (OCP MXFP4, the format gpt-oss ships its
experts in) is stored as the format itself: ``codes``, two E2M1 codes per byte along the row, the low nibble
first, and ``scales``, one E8M0 byte per 32 weights: ``W = FP4_E2M1[code] * 2 ** (scale - 127)``, exact in
bfloat16. A source already in MXFP4 is kept byte for byte (``prep/adapters/source_formats.py``).

A matrix with ``kernel`` set is stored in the layout a compute kernel reads as it is, so a record read from
disk is ready to compute with no decode on any thread. ``int4pack`` (``KERNELS``) is torch's CPU int4
weight-only kernel (``_weight_int4pack_mm_for_cpu``): codes of an [N, K] int4 matrix, N a multiple of 64,
as ``pack_int4pack`` lays them out (per block of 64 rows and per input column k, 32 bytes: row j's code in
the low nibble, row j + 32's in the high one), then per group a bfloat16 (scale, zero') pair laid out
[K/g, N, 2], with ``W = (code - 8) * scale + zero'``. ``kernel_parts`` converts a plain int4 matrix's parts
into it (``zero' = (8 - zero) * scale``), so the kernel form computes exactly what the loader's made
``int4pack`` form of the plain record computes.

A matrix with ``rows`` set is *row-interleaved*: row j's codes, scale and zero (and, with meta
quantization, its one meta group) are contiguous, so any set of rows is a set of byte ranges. The neuron
layout (CORM) uses it: see ``NeuronLayout``.

One expert is one *record*: all its tensors back to back in one byte string, in an order given by a
``RecordLayout`` that is the same for every expert of a store, so a cache miss is one read and one
copy. This module is the decoding side, shared by the loader and ``prep``; it needs nothing but torch.
The encoding side (packing codes, joining parts into a record, writing stores) lives in
``prep/quant/records.py`` and ``prep/quant/hqq_codec.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loader.errors import MoeError
from loader.vocab import BITS, MX

# (group_size, meta_group) per precision, as mixtral-offloading/CORM configure hqq: 2 bits needs small
# groups to stay usable, and 8-bit metadata then keeps them from costing 2 bits per weight.
DEFAULT_FORMATS = {"int8": (64, 256), "int4": (64, 256), "int3": (64, 256), "int2": (16, 128)}
KERNELS = ("int4pack",)  # record layouts a compute kernel reads in place (``MatrixSpec.kernel``)
INT4PACK_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
META_BITS = 8
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


# MXFP4: E2M1 code -> value (sign, two exponent bits, one mantissa bit), 32 weights per E8M0 scale (bias 127)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32
E8M0_BIAS = 127


def decode_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., n * 32] of MXFP4 ``codes`` uint8 [..., n * 16] (low nibble first) and ``scales`` uint8 [..., n]."""
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=codes.device)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)
    exponent = (scales.to(torch.int32) - E8M0_BIAS).to(torch.float32)
    return torch.ldexp(values.unflatten(-1, (-1, MX_GROUP)), exponent.unsqueeze(-1)).flatten(-2)


class CodecError(MoeError):
    """A record or matrix that does not match its declared layout."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise CodecError(f"unsupported dtype {dtype}")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}") from None


# ---------------------------------------------------------------------------------------- bit packing


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Flat uint8 bytes -> ``count`` codes as uint8, little-endian within a byte (``prep.quant.records.pack_codes``
    is the inverse): 8, 4 and 2 bits hold 1, 2 and 4 codes per byte; 3 bits hold 8 codes in 3 bytes.
    4 and 2 bits are unpacked with uint8 shifts (a quarter of the memory traffic of int32 ones): this runs
    on every cache miss."""
    data = packed.reshape(-1)
    if bits == 8:
        codes = data
    elif bits in (4, 2):
        mask = (1 << bits) - 1
        codes = torch.stack([(data >> (bits * i)) & mask for i in range(8 // bits)], dim=1).reshape(-1)
    elif bits == 3:
        triples = data.to(torch.int32).view(-1, 3)
        word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        codes = torch.stack([(word >> (3 * i)) & 7 for i in range(8)], dim=1).reshape(-1).to(torch.uint8)
    else:
        raise CodecError(f"unsupported bit-width {bits}")
    if codes.numel() < count:
        raise CodecError(f"packed data holds {codes.numel()} codes, {count} expected")
    return codes[:count]


def packed_nbytes(count: int, bits: int) -> int:
    return count * bits // 8


def pack_int4pack(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit codes [N, K] (uint8 < 16, N a multiple of 64) -> the int4pack kernel layout [N, K/2]: per block of
    64 rows and per column k, 32 bytes, byte j holding row j's code (low nibble) and row j + 32's (high)."""
    n, k = codes.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8, device=codes.device) if out is None else out
    rows = codes.view(n // 64, 2, 32, k)
    torch.bitwise_or(rows[:, 0].transpose(1, 2), rows[:, 1].transpose(1, 2) << 4, out=out.view(n // 64, k, 32))
    return out


def pack_int4pack_nibbles(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``pack_int4pack`` of codes still packed two per byte along a row (``packed`` [N, K/2], the codec's int4
    packing) into ``out`` [N, K/2], by byte shuffles without unpacking (the loader's int4pack form of a plain
    int4 record makes it on every miss)."""
    n, half = packed.shape
    blocks = packed.view(n // 64, 2, 32, half)
    low_rows, high_rows = blocks[:, 0], blocks[:, 1]  # [B, 32, K/2]: rows j and j + 32 of each block
    target = out.view(n // 64, half, 2, 32)  # [B, K/2, (even k, odd k), j]
    torch.bitwise_or(low_rows & 15, high_rows << 4, out=target[:, :, 0, :].transpose(1, 2))
    torch.bitwise_or(low_rows >> 4, high_rows & 0xF0, out=target[:, :, 1, :].transpose(1, 2))
    return out


def unpack_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4pack``: [N, K/2] in the kernel layout -> codes [N, K] uint8."""
    n, half = packed.shape
    k = half * 2
    blocks = packed.reshape(n // 64, k, 32)
    codes = torch.empty(n // 64, 2, 32, k, dtype=torch.uint8, device=packed.device)
    codes[:, 0] = (blocks & 15).transpose(1, 2)
    codes[:, 1] = (blocks >> 4).transpose(1, 2)
    return codes.view(n, k)


# ---------------------------------------------------------------------------------------- matrices


@dataclass(frozen=True)
class MatrixSpec:
    """How one matrix of an expert is stored: shape, precision and (for intN) group and meta group sizes."""

    name: str  # gate, up, down, gate_bias, ...
    shape: tuple[int, ...]
    precision: str  # "passthrough" or intN
    dtype: str  # the source dtype, also the decode dtype
    group_size: int = 0
    transposed: bool = False  # stored as its transpose, so groups run along the input dimension
    meta_group: int = 0  # 0: float16 scale and zero; >0: 8-bit, float16 step and offset per this many groups
    rows: bool = False  # row-interleaved: each row's parts contiguous (meta_group 0 or one meta group per row)
    kernel: str = ""  # "int4pack": stored in that kernel's layout (``KERNELS``); "": the codec's own parts

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def plain(self, num_rows: int | None = None) -> MatrixSpec:
        """The same matrix (or its first ``num_rows`` rows) stored part after part, not row-interleaved."""
        shape = (num_rows if num_rows is not None else self.shape[0], *self.shape[1:])
        return MatrixSpec(self.name, shape, self.precision, self.dtype, self.group_size, self.transposed,
                          self.meta_group)

    def row_parts(self) -> list[tuple[str, str, int]]:
        """(part name, dtype name, bytes per row) of one row of a row-interleaved matrix."""
        rows = self.shape[0]
        return [(name, dtype, size // rows) for name, dtype, size in self.plain(rows).parts()]

    @property
    def row_bytes(self) -> int:
        return sum(size for _n, _d, size in self.row_parts())

    def parts(self) -> list[tuple[str, str, int]]:
        """(part name, dtype name, byte size) of this matrix's pieces inside a record."""
        if self.rows:
            return [(f"{self.name}.rows", "uint8", self.shape[0] * self.row_bytes)]
        if self.precision == "passthrough":
            return [(self.name, self.dtype, self.numel * dtype_of(self.dtype).itemsize)]
        if self.precision in MX:
            return [(f"{self.name}.codes", "uint8", self.numel // 2),
                    (f"{self.name}.scales", "uint8", self.numel // MX_GROUP)]
        if self.kernel == "int4pack":
            n, k = self.shape
            return [(f"{self.name}.packed", "uint8", n * k // 2),
                    (f"{self.name}.scales_zeros", "bfloat16", k // self.group_size * n * 2 * 2)]
        codes = (f"{self.name}.codes", "uint8", packed_nbytes(self.numel, BITS[self.precision]))
        groups = self.numel // self.group_size
        if not self.meta_group:
            return [codes] + [(f"{self.name}.{kind}", "float16", groups * 2) for kind in ("scale", "zero")]
        metas = -(-groups // self.meta_group)
        return [codes] + [part for kind in ("scale", "zero") for part in (
            (f"{self.name}.{kind}.q", "uint8", groups),  # one 8-bit code per group
            (f"{self.name}.{kind}.meta", "float16", metas * 4),  # (step, offset) per meta group
        )]

    def check(self) -> None:
        if self.kernel:
            if self.kernel not in KERNELS:
                raise CodecError(f"{self.name}: kernel layout {self.kernel!r} unknown; known: {KERNELS}")
            if (self.precision != "int4" or len(self.shape) != 2 or self.rows or self.meta_group
                    or self.group_size not in INT4PACK_GROUPS or self.shape[0] % 64 or self.shape[1] % self.group_size):
                raise CodecError(f"{self.name}: the int4pack layout holds int4 2-D matrices with group size in "
                                 f"{INT4PACK_GROUPS} dividing the input, output rows a multiple of 64, float scales "
                                 "(meta group 0), not row-interleaved")
        if self.meta_group < 0 or (self.meta_group and self.precision == "passthrough"):
            raise CodecError(f"{self.name}: meta group {self.meta_group} must be 0, or > 0 when quantized")
        if self.rows:
            per_row = self.shape[-1] // self.group_size if self.group_size else 0
            if len(self.shape) != 2 or self.transposed or self.meta_group not in (0, per_row):
                raise CodecError(f"{self.name}: a row-interleaved matrix is 2-D, not transposed, with meta group 0 "
                                 f"or one meta group per row ({per_row} groups)")
        if self.precision == "passthrough":
            return
        if self.precision in MX:
            if len(self.shape) != 2 or self.group_size != MX_GROUP or self.shape[1] % MX_GROUP or self.meta_group \
                    or self.rows or self.kernel:
                raise CodecError(f"{self.name}: an {self.precision} matrix is 2-D with rows a multiple of {MX_GROUP} "
                                 f"long, group size {MX_GROUP}, no meta group, not row-interleaved; got shape "
                                 f"{self.shape}, group {self.group_size}")
            return
        if self.precision not in BITS:
            raise CodecError(f"unknown precision {self.precision!r}; use passthrough or one of "
                             f"{sorted(BITS) + sorted(MX)}")
        if len(self.shape) != 2:
            raise CodecError(f"{self.name}: only 2-D matrices are quantized, got shape {self.shape}")
        if self.group_size <= 0 or self.shape[1] % self.group_size:
            raise CodecError(
                f"{self.name}: group size {self.group_size} does not divide the input dimension {self.shape[1]}"
            )
        if (self.numel * BITS[self.precision]) % 8 or (BITS[self.precision] == 3 and self.numel % 8):
            raise CodecError(f"{self.name}: {self.numel} weights do not pack into whole bytes")


def group_params(spec: MatrixSpec, parts: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """The float32 ``kind`` ("scale" or "zero") of every group of ``spec`` [groups], from its record parts."""
    if not spec.meta_group:
        return parts[f"{spec.name}.{kind}"].view(torch.float16).float()
    q = parts[f"{spec.name}.{kind}.q"].float()
    meta = parts[f"{spec.name}.{kind}.meta"].view(torch.float16).float().view(-1, 2)  # [metas, (step, offset)]
    step, offset = meta.repeat_interleave(spec.meta_group, dim=0)[: q.numel()].unbind(1)
    return q * step + offset


def decode_rows(spec: MatrixSpec, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a row-interleaved matrix: ``rows`` [n, row_bytes] uint8 (any n of its rows) -> [n, cols] floats."""
    parts, start = {}, 0
    for name, _dtype, size in spec.row_parts():
        parts[name] = rows[:, start:start + size].contiguous().reshape(-1)
        start += size
    return decode_matrix(spec.plain(rows.shape[0]), parts)


def decode_matrix(spec: MatrixSpec, parts: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The float matrix of ``spec`` from its record parts (as produced by ``RecordLayout.split``).

    ``out``: a tensor of ``spec``'s shape (any float dtype) to write into instead of a new one in the source
    dtype; the values are computed in float32 and rounded once to ``out``'s dtype (the loader's decoded
    forms, ``loader/forms.py``)."""
    if spec.rows:
        w = decode_rows(spec, parts[f"{spec.name}.rows"].view(spec.shape[0], spec.row_bytes))
        return w if out is None else out.copy_(w)
    out_dtype = dtype_of(spec.dtype)
    if spec.precision == "passthrough":
        w = parts[spec.name].view(out_dtype).reshape(spec.shape)
        return w if out is None else out.copy_(w)
    if spec.precision in MX:
        w = decode_mxfp4(parts[f"{spec.name}.codes"], parts[f"{spec.name}.scales"]).view(spec.shape)
        w = w.T if spec.transposed else w
        if out is not None:
            return out.copy_(w)
        return w if out_dtype == torch.float32 else w.to(out_dtype)
    if spec.kernel == "int4pack":
        n, k = spec.shape
        groups = k // spec.group_size
        codes = unpack_int4pack(parts[f"{spec.name}.packed"].view(n, k // 2))
        scale_zero = parts[f"{spec.name}.scales_zeros"].view(torch.bfloat16).view(groups, n, 2).float()
        w = codes.view(n, groups, spec.group_size).to(torch.float32).sub_(8)
        w.mul_(scale_zero[..., 0].T[..., None]).add_(scale_zero[..., 1].T[..., None])
        w = w.view(spec.shape)
        w = w.T if spec.transposed else w
        if out is not None:
            return out.copy_(w)
        return w if out_dtype == torch.float32 else w.to(out_dtype)
    codes = unpack_codes(parts[f"{spec.name}.codes"], BITS[spec.precision], spec.numel)
    scale, zero = (group_params(spec, parts, kind)[:, None] for kind in ("scale", "zero"))
    w = codes.view(-1, spec.group_size).to(torch.float32)  # in place from here: one float32 buffer
    w.sub_(zero).mul_(scale)
    w = w.view(spec.shape)
    w = w.T if spec.transposed else w
    if out is not None:
        return out.copy_(w)
    return w if out_dtype == torch.float32 else w.to(out_dtype)


def int4pack_applies(spec: MatrixSpec) -> bool:
    """Whether ``spec`` (plain parts) can be stored in, or made into, the int4pack layout: a quantized 2-D matrix
    of at most 4 bits, a kernel group size, output rows a multiple of 64 (the layout's blocks)."""
    return (spec.precision in BITS and BITS[spec.precision] <= 4 and len(spec.shape) == 2 and not spec.rows
            and not spec.kernel and spec.group_size in INT4PACK_GROUPS and spec.shape[0] % 64 == 0
            and spec.shape[1] % spec.group_size == 0)


def kernel_parts(spec: MatrixSpec, parts: dict[str, torch.Tensor], packed: torch.Tensor,
                 scales_zeros: torch.Tensor) -> None:
    """The int4pack parts of the plain quantized matrix ``spec`` written into ``packed`` (uint8 [N, K/2]) and
    ``scales_zeros`` (bfloat16 [K/g, N, 2]): the one conversion the packager and the loader's made form share."""
    n, k = spec.shape
    if BITS[spec.precision] == 4:
        pack_int4pack_nibbles(parts[f"{spec.name}.codes"].view(n, k // 2), packed)
    else:
        pack_int4pack(unpack_codes(parts[f"{spec.name}.codes"], BITS[spec.precision], spec.numel).view(n, k), packed)
    kernel_scales(spec, parts, scales_zeros)


def kernel_scales(spec: MatrixSpec, parts: dict[str, torch.Tensor], scales_zeros: torch.Tensor) -> None:
    """The kernel's bfloat16 (scale, zero') per group [K/g, N, 2] of the plain quantized matrix ``spec``, with
    ``zero' = (8 - zero) * scale`` (the codec's ``(code - zero) * scale`` is the kernel's ``(code - 8) * scale +
    zero'``)."""
    n, k = spec.shape
    groups = k // spec.group_size
    scale = group_params(spec, parts, "scale").view(n, groups)
    zero = (8 - group_params(spec, parts, "zero").view(n, groups)) * scale
    scales_zeros.copy_(torch.stack([scale.T, zero.T], -1))


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RecordLayout:
    """The byte layout shared by every expert record of one store."""

    matrices: tuple[MatrixSpec, ...]

    def parts(self) -> list[tuple[str, str, int, int]]:
        """(part name, dtype, offset, size) in record order; every part starts 16-byte aligned."""
        out, offset = [], 0
        for spec in self.matrices:
            for name, dtype, size in spec.parts():
                out.append((name, dtype, offset, size))
                offset += (size + 15) // 16 * 16
        return out

    @property
    def nbytes(self) -> int:
        name, dtype, offset, size = self.parts()[-1]
        return (offset + size + 15) // 16 * 16

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: every record byte (codes, metadata, biases, alignment) over every weight."""
        return self.nbytes * 8 / sum(spec.numel for spec in self.matrices)

    def split(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """One uint8 record -> its parts (views, no copies)."""
        if record.numel() < self.nbytes:
            raise CodecError(f"record has {record.numel()} bytes, layout needs {self.nbytes}")
        return {name: record[offset : offset + size] for name, _d, offset, size in self.parts()}

    def decode(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """One record -> {matrix name: float tensor}."""
        parts = self.split(record)
        return {spec.name: decode_matrix(spec, parts) for spec in self.matrices}

    def to_json(self) -> list[dict]:
        return [{"name": s.name, "shape": list(s.shape), "precision": s.precision, "dtype": s.dtype,
                 "group_size": s.group_size, "transposed": s.transposed, "meta_group": s.meta_group}
                | ({"rows": True} if s.rows else {}) | ({"kernel": s.kernel} if s.kernel else {})
                for s in self.matrices]

    @classmethod
    def from_json(cls, data: list[dict]) -> RecordLayout:
        """Accepts layouts written before ``meta_group`` existed (they mean 0)."""
        return cls(tuple(MatrixSpec(d["name"], tuple(d["shape"]), d["precision"], d["dtype"], d["group_size"],
                                    d.get("transposed", False), d.get("meta_group", 0), d.get("rows", False),
                                    d.get("kernel", ""))
                         for d in data))

    @property
    def kernel(self) -> str:
        """The kernel layout its quantized matrices are stored in ("" for the codec's own parts)."""
        return next((spec.kernel for spec in self.matrices if spec.kernel), "")

    def in_kernel_layout(self, kernel: str = "int4pack") -> RecordLayout | None:
        """This layout with every quantized matrix in ``kernel``'s layout (biases as they are), or None where a
        matrix does not fit it (only int4 is stored that way: a lower precision would grow to 4 bits)."""
        quantized = [s for s in self.matrices if s.precision != "passthrough"]
        if kernel != "int4pack" or not quantized or any(s.precision != "int4" or not int4pack_applies(s)
                                                         for s in quantized):
            return None
        return RecordLayout(tuple(replace(s, kernel=kernel, meta_group=0) if s.precision != "passthrough" else s
                                  for s in self.matrices))

    def to_kernel(self, kernel_layout: RecordLayout, record: torch.Tensor) -> torch.Tensor:
        """One record of this layout -> the same expert's record in ``kernel_layout`` (``in_kernel_layout``)."""
        parts = self.split(record)
        out = torch.zeros(kernel_layout.nbytes, dtype=torch.uint8)
        target = kernel_layout.split(out)
        for spec, kspec in zip(self.matrices, kernel_layout.matrices, strict=True):
            if not kspec.kernel:
                target[spec.name].copy_(parts[spec.name])
                continue
            n, k = spec.shape
            kernel_parts(spec, parts, target[f"{spec.name}.packed"].view(n, k // 2),
                         target[f"{spec.name}.scales_zeros"].view(torch.bfloat16).view(k // spec.group_size, n, 2))
        return out


# ---------------------------------------------------------------------------------------- neuron layout

NEURON_MATRICES = ("gate", "gate_bias", "up_bias", "down_bias", "neurons")
PAIRINGS = ("halves", "interleaved")


class NeuronLayout:
    """The neuron-major record (CORM): ``gate`` [I, H] (W1, quantized along H, read whole: it names the active
    neurons), the biases when the model has them (``gate_bias``, ``up_bias`` [I], ``down_bias`` [H]), then
    ``neurons`` [I, 2H] row-interleaved, neuron j's row being its up row and its down column, both quantized
    along H. A set of neurons is the header (everything before ``neurons``) plus one byte range per run of
    consecutive neurons."""

    def __init__(self, layout: RecordLayout) -> None:
        specs = {s.name: s for s in layout.matrices}
        if set(specs) - set(NEURON_MATRICES) or not {"gate", "neurons"} <= set(specs) \
                or layout.matrices[-1].name != "neurons" or not specs["neurons"].rows:
            raise CodecError(f"a neuron layout holds gate, optional biases and neurons (last, row-interleaved); "
                             f"got {[s.name for s in layout.matrices]}")
        self.layout = layout
        self.specs = specs
        self.intermediate, hidden2 = specs["neurons"].shape
        self.hidden = hidden2 // 2
        if specs["gate"].shape != (self.intermediate, self.hidden):
            raise CodecError(f"neuron layout: gate is {specs['gate'].shape}, neurons {specs['neurons'].shape}")
        self.rows_offset = next(off for name, _d, off, _s in layout.parts() if name == "neurons.rows")
        self.row_bytes = specs["neurons"].row_bytes

    @staticmethod
    def holds(layout: RecordLayout) -> bool:
        return any(spec.rows for spec in layout.matrices)

    def ranges(self, rows: torch.Tensor) -> list[tuple[int, int]]:
        """(start, length) byte ranges of the record holding the neurons of the bool mask ``rows`` [I],
        one per run of consecutive neurons."""
        idx = torch.nonzero(rows).flatten()
        if idx.numel() == 0:
            return []
        breaks = torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1  # where a run of consecutive neurons ends
        firsts = torch.cat([idx[:1], idx[breaks]]).tolist()
        counts = torch.diff(torch.cat([torch.zeros(1, dtype=breaks.dtype), breaks,
                                       torch.tensor([idx.numel()])])).tolist()
        return [(self.rows_offset + j * self.row_bytes, n * self.row_bytes) for j, n in zip(firsts, counts, strict=True)]

    def covered(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The neurons whose whole row lies inside the byte ranges ``spans`` (a read brings them all): bool [I]."""
        rows = torch.zeros(self.intermediate, dtype=torch.bool)
        for start, length in spans:
            first = max(0, -(-(start - self.rows_offset) // self.row_bytes))
            last = (start + length - self.rows_offset) // self.row_bytes  # exclusive
            if last > first:
                rows[first:min(last, self.intermediate)] = True
        return rows

    def header(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """The gate matrix and the biases of a record whose header is in place."""
        parts = self.layout.split(record)
        return {name: decode_matrix(spec, parts) for name, spec in self.specs.items() if name != "neurons"}

    def rows(self, record: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Decoded neuron rows ``index`` [n] -> [n, 2H] (up row, down column), read from their place in the record."""
        block = record[self.rows_offset:self.rows_offset + self.intermediate * self.row_bytes]
        return decode_rows(self.specs["neurons"], block.view(self.intermediate, self.row_bytes)[index])
