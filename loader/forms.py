"""Held forms: what a cached expert is computed from, and one expert's forward in each form.

A cache slot holds exactly one form of its expert, nothing else. A read lands in a staging buffer of the
reader thread, and the reader thread makes the form from it into the slot (``HeldForm.make``), so the
compute thread only computes and a hit never decodes. The ``record`` form is the record itself: reads land
in the slot directly and nothing is made.

The forms (``FORMS``: name -> factory(layout, device) -> form, or None where it does not apply):

- ``record``: the record as stored. Plain matrices (passthrough) compute from views of it; a quantized
  record is decoded on every use (``packed``: the smallest slot, the slowest compute);
- ``float32`` / ``bfloat16`` / ``float16`` (``DecodedForm``): the matrices decoded once, in that dtype;
- ``int4pack``: torch's CPU int4 weight-only kernel (``_weight_int4pack_mm_for_cpu``), which reads the codes
  packed; scale and zero' per group in bfloat16 and activations in bfloat16. A record stored in the kernel
  layout (``loader/codec.py``, the packager's choice for int4 on a CPU target) is the form itself
  (``Int4KernelForm``: a read lands in the slot ready to compute, nothing is made); from a plain record of at
  most 4 bits with groups of 32-256 and output sizes that are multiples of 16 the reader makes it
  (``Int4PackForm``). The codec's ``(code - zero) * scale`` is the kernel's ``(code - 8) * scale + zero'``
  with ``zero' = (8 - zero) * scale``.
- ``qdot``: the record as stored, computed from its bits by the compiled kernels (``loader/kernels``: int2, int3,
  int4, int8 and MXFP4, activations rounded to int8 per block): a read lands in the slot ready to compute, nothing is
  made or decoded, and a low-bit expert takes its stored size in the cache.

The form is fixed before the run (``choose_form``): from ``load(expert_dtype=...)``, else the environment
variable ``MOEPREP_EXPERT_DTYPE`` (a device team pins it once; the test suite pins float32 so its parity
tolerances are float32's), else the plan's ``forms``, else a fixed rule per device: on a CPU with the compiled
kernels, ``qdot`` where they take every matrix, else with torch's int4 kernel ``int4pack`` where it fits; otherwise
``bfloat16`` for a quantized store; ``record`` for plain matrices. Never a timing taken at load: one artifact,
budget and device always give one cache.

A new form is one class with ``name``, ``nbytes``, ``staged``, ``make`` and ``forward``, one ``FORMS``
entry, and a row in the parametrized parity test (``tests/loader/test_forms.py``).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loader import kernels
from loader.codec import (
    INT4PACK_GROUPS,
    RecordLayout,
    decode_matrix,
    kernel_parts,
    kernel_scales,
    pack_int4pack,
    unpack_codes,
)
from loader.errors import LoaderError
from loader.vocab import BITS, EXPERT_DTYPES

ENV = "MOEPREP_EXPERT_DTYPE"
ALIGN = 64


class KernelError(LoaderError):
    """An unknown expert dtype or held form."""


class HeldForm(Protocol):
    """What a cache slot holds for one expert of a store."""

    name: str
    nbytes: int  # bytes the form takes (a slot or read buffer holds at least this)
    staged: bool  # a read lands in a staging buffer and ``make`` writes the form; False: the record is the form

    def make(self, record: torch.Tensor, region: torch.Tensor) -> object:
        """The form of ``record`` written into ``region`` (uint8, >= nbytes); returns the weights object
        ``forward`` takes. Runs on a reader thread."""

    def forward(self, module, weights, x: torch.Tensor) -> torch.Tensor:
        """One expert's output for tokens ``x`` [T, H] in the form's compute dtype."""


def check_expert_dtype(name: str) -> str:
    if name not in EXPERT_DTYPES:
        raise KernelError(f"expert dtype {name!r} unknown; use one of {', '.join(EXPERT_DTYPES)}")
    return name


def needs_decoding(layout: RecordLayout) -> bool:
    """Whether computing from a record means decoding it (any quantized matrix)."""
    return any(spec.precision != "passthrough" for spec in layout.matrices)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def matrices_forward(module, weights: dict, x: torch.Tensor) -> torch.Tensor:
    """transformers' eager expert with the module's own gate function: ``weights`` in the module's parameter
    layout (gate_up_proj, down_proj, optional biases)."""
    x = x.to(weights["gate_up_proj"].dtype)
    if module.is_transposed:
        gate_up = x @ weights["gate_up_proj"]
        if "gate_up_proj_bias" in weights:
            gate_up = gate_up + weights["gate_up_proj_bias"]
        y = module._apply_gate(gate_up) @ weights["down_proj"]
    else:
        gate_up = F.linear(x, weights["gate_up_proj"], weights.get("gate_up_proj_bias"))
        y = F.linear(module._apply_gate(gate_up), weights["down_proj"])
    if "down_proj_bias" in weights:
        y = y + weights["down_proj_bias"]
    return y


# ------------------------------------------------------------------------------------------ record


@dataclass(frozen=True)
class RecordForm:
    """The record as stored: plain matrices are views of it; a quantized record decodes on every use."""

    layout: RecordLayout
    name = "record"
    staged = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @functools.cached_property
    def packed(self) -> bool:
        return needs_decoding(self.layout)

    def make(self, record: torch.Tensor, region: torch.Tensor | None = None):
        return record if self.packed else self.layout.decode(record)

    def forward(self, module, weights, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            weights = self.layout.decode(weights)
        return matrices_forward(module, weights, x)


# ------------------------------------------------------------------------------------------ decoded


@dataclass(frozen=True)
class DecodedForm:
    """The matrices decoded once into the slot, in ``dtype``."""

    layout: RecordLayout
    dtype: torch.dtype
    staged = True

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @functools.cached_property
    def offsets(self) -> list[tuple[str, tuple[int, ...], int]]:
        out, offset = [], 0
        for spec in self.layout.matrices:
            shape = spec.shape[::-1] if spec.transposed else spec.shape
            out.append((spec.name, shape, offset))
            offset += _aligned(_numel(shape) * self.dtype.itemsize)
        return out

    @functools.cached_property
    def nbytes(self) -> int:
        name, shape, offset = self.offsets[-1]
        return offset + _aligned(_numel(shape) * self.dtype.itemsize)

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        size = self.dtype.itemsize
        return {name: region[offset:offset + _numel(shape) * size].view(self.dtype).view(shape)
                for name, shape, offset in self.offsets}

    def make(self, record: torch.Tensor, region: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = self.layout.split(record)
        views = self.views(region)
        for spec in self.layout.matrices:
            decode_matrix(spec, parts, out=views[spec.name])
        return views

    def forward(self, module, weights, x: torch.Tensor) -> torch.Tensor:
        return matrices_forward(module, weights, x)


# ------------------------------------------------------------------------------------------ int4pack


class Int4Weights:
    """An expert in torch's CPU int4 form: per quantized matrix [out, in] its packed codes and bfloat16
    (scale, zero') per group; biases in bfloat16."""

    def __init__(self, matrices: dict, vectors: dict) -> None:
        self.matrices = matrices  # name -> (packed [N, K/2] uint8, scales_and_zeros [K/g, N, 2], group)
        self.vectors = vectors

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        packed, scales_zeros, group = self.matrices[name]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
        bias = self.vectors.get(f"{name}_bias")
        return y if bias is None else y + bias


def int4pack_available(device: torch.device) -> bool:
    """Whether this torch build has the CPU int4 weight-only kernel (and the device is a CPU)."""
    return device.type == "cpu" and _int4pack_works()


@functools.cache
def _int4pack_works() -> bool:
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 2)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 32,
                                                   torch.zeros(1, 16, 2, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError):
        return False


def int4pack_fits(layout: RecordLayout) -> bool:
    """Whether every matrix of the layout can take the int4 form: stored in the int4pack kernel layout, or
    quantized 2-D matrices of at most 4 bits with a supported group and an output size that is a multiple of
    16; and 1-D biases."""
    for spec in layout.matrices:
        if len(spec.shape) == 1 and spec.precision == "passthrough":
            continue
        if spec.kernel == "int4pack":
            continue
        if spec.precision not in BITS or BITS[spec.precision] > 4 or spec.rows or len(spec.shape) != 2 \
                or spec.kernel or spec.group_size not in INT4PACK_GROUPS or spec.shape[0] % 16 \
                or spec.shape[1] % spec.group_size:
            return False
    return True


@functools.cache
def _nibble_repack_matches() -> bool:
    """Whether this torch build's int4pack layout is the codec's (``loader.codec.pack_int4pack``), checked once
    against the convert op on a random 128 x 64 matrix. A build with another layout makes the form with the
    convert op, and computes a kernel-layout record from its decoded matrices."""
    if not _int4pack_works():
        return False
    codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    return torch.equal(pack_int4pack(codes), want)


@dataclass(frozen=True)
class Int4PackForm:
    """Where each matrix's int4 form lives inside the slot; made from a plain record on a reader thread."""

    layout: RecordLayout
    name = "int4pack"
    staged = True

    @functools.cached_property
    def offsets(self) -> list[tuple[str, int, int, int]]:
        """(matrix name, offset, packed bytes, scales bytes); a 1-D bias has packed bytes 0."""
        out, offset = [], 0
        for spec in self.layout.matrices:
            if len(spec.shape) == 1:
                out.append((spec.name, offset, 0, spec.numel * 2))
                offset += _aligned(spec.numel * 2)
                continue
            n, k = spec.shape
            packed, scales = n * k // 2, k // spec.group_size * n * 2 * 2
            out.append((spec.name, offset, packed, scales))
            offset += _aligned(packed) + _aligned(scales)
        return out

    @functools.cached_property
    def nbytes(self) -> int:
        name, offset, packed, scales = self.offsets[-1]
        return offset + _aligned(packed) + _aligned(scales)

    def make(self, record: torch.Tensor, region: torch.Tensor) -> Int4Weights:
        parts = self.layout.split(record)
        specs = {spec.name: spec for spec in self.layout.matrices}
        matrices, vectors = {}, {}
        for name, offset, packed_bytes, scale_bytes in self.offsets:
            spec = specs[name]
            if packed_bytes == 0:
                vectors[name] = region[offset:offset + scale_bytes].view(torch.bfloat16).copy_(
                    decode_matrix(spec, parts))
                continue
            n, k = spec.shape
            groups = k // spec.group_size
            packed = region[offset:offset + packed_bytes].view(n, k // 2)
            start = offset + _aligned(packed_bytes)
            scales_zeros = region[start:start + scale_bytes].view(torch.bfloat16).view(groups, n, 2)
            if n % 64 == 0 and _nibble_repack_matches():
                kernel_parts(spec, parts, packed, scales_zeros)
            else:
                codes = unpack_codes(parts[f"{name}.codes"], BITS[spec.precision], spec.numel).view(n, k)
                packed.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2))
                kernel_scales(spec, parts, scales_zeros)
            matrices[name] = (packed, scales_zeros, spec.group_size)
        return Int4Weights(matrices, vectors)

    def forward(self, module, weights: Int4Weights, x: torch.Tensor) -> torch.Tensor:
        return int4_forward(module, weights, x)


def int4_forward(module, weights: Int4Weights, x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.bfloat16)
    gate_up = weights.linear("gate_up_proj", x)
    return weights.linear("down_proj", module._apply_gate(gate_up))


@dataclass(frozen=True)
class Int4KernelForm:
    """A record stored in the int4pack kernel layout (``loader/codec.py``): the record is the form. A read lands
    in the slot ready to compute; ``make`` only takes views of it (no decode, no copy), on the reader thread."""

    layout: RecordLayout
    name = "int4pack"
    staged = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def make(self, record: torch.Tensor, region: torch.Tensor | None = None) -> Int4Weights:
        parts = self.layout.split(record)
        matrices, vectors = {}, {}
        for spec in self.layout.matrices:
            if not spec.kernel:  # a bias: bfloat16 like the kernel's output (a copy of one row)
                vectors[spec.name] = decode_matrix(spec, parts).to(torch.bfloat16)
                continue
            n, k = spec.shape
            matrices[spec.name] = (parts[f"{spec.name}.packed"].view(n, k // 2),
                                   parts[f"{spec.name}.scales_zeros"].view(torch.bfloat16).view(
                                       k // spec.group_size, n, 2), spec.group_size)
        return Int4Weights(matrices, vectors)

    def forward(self, module, weights: Int4Weights, x: torch.Tensor) -> torch.Tensor:
        return int4_forward(module, weights, x)


def _int4pack(layout: RecordLayout, device: torch.device):
    """The int4 form where the kernel runs here: the record itself when stored in the kernel layout (and this
    torch build reads that layout), else made from the record; None where it does not apply."""
    if not int4pack_available(device) or not int4pack_fits(layout):
        return None
    if layout.kernel == "int4pack":
        return Int4KernelForm(layout) if _nibble_repack_matches() else None
    return Int4PackForm(layout)


# ------------------------------------------------------------------------------------------ qdot


class QdotWeights:
    """An expert as the compiled kernels compute it: per quantized matrix its ``StoredMatrix`` (addresses into the
    record), biases in float32."""

    def __init__(self, matrices: dict, vectors: dict) -> None:
        self.matrices = matrices
        self.vectors = vectors

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self.matrices[name].matmul(x)
        bias = self.vectors.get(f"{name}_bias")
        return y if bias is None else y + bias


@dataclass(frozen=True)
class QdotForm:
    """The record as stored, computed from its bits by the compiled kernels (``loader/kernels``) with activations
    rounded to int8 per block: a low-bit expert takes its stored size in the cache, and nothing is decoded, on a read
    or on a use. Its parity with the float reference is the int8 rounding's bound, not float32's."""

    layout: RecordLayout
    name = "qdot"
    staged = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def make(self, record: torch.Tensor, region: torch.Tensor | None = None) -> QdotWeights:
        parts = self.layout.split(record)
        matrices, vectors = {}, {}
        for spec in self.layout.matrices:
            if len(spec.shape) == 1:
                vectors[spec.name] = decode_matrix(spec, parts).to(torch.float32)
            else:
                matrices[spec.name] = kernels.stored_matrix(spec, parts)
        return QdotWeights(matrices, vectors)

    def forward(self, module, weights: QdotWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = weights.linear("gate_up_proj", x)
        return weights.linear("down_proj", module._apply_gate(gate_up))


def qdot_fits(layout: RecordLayout) -> bool:
    """Whether the kernels compute every matrix of the layout from its bits (biases aside): quantized 2-D matrices
    in the codec's own parts (``loader.kernels.takes``), named as the expert modules' parameters."""
    names = {spec.name for spec in layout.matrices if len(spec.shape) == 2}
    return names == {"gate_up_proj", "down_proj"} and all(
        kernels.takes(spec) if len(spec.shape) == 2 else spec.precision == "passthrough" for spec in layout.matrices)


def _qdot(layout: RecordLayout, device: torch.device):
    """The qdot form on a CPU where the compiled kernels run and take every matrix; None elsewhere."""
    if device.type != "cpu" or not qdot_fits(layout) or not kernels.available():
        return None
    return QdotForm(layout)


# ------------------------------------------------------------------------------------------ registry


def _decoded(dtype: torch.dtype):
    return lambda layout, device: DecodedForm(layout, dtype)


FORMS = {
    "record": lambda layout, device: RecordForm(layout),
    "float32": _decoded(torch.float32),
    "bfloat16": _decoded(torch.bfloat16),
    "float16": _decoded(torch.float16),
    "int4pack": _int4pack,
    "qdot": _qdot,
}


def _pinned() -> str | None:
    name = os.environ.get(ENV)
    if not name:
        return None
    if name == "auto" or name not in EXPERT_DTYPES:
        raise KernelError(f"{ENV}={name!r} unknown; set it to one of {', '.join(EXPERT_DTYPES[1:])} or unset it")
    return name


def choose_form(expert_dtype: str, layout: RecordLayout, device: torch.device, planned: str | None = None,
                neuron: bool = False) -> HeldForm:
    """The form a store's cached experts are held in (see the module docstring for the order of choice).
    A neuron-layout store keeps its records (its rows are read and decoded a few at a time); a decoded form
    in the record's own dtype of plain matrices is the record itself; int4pack where it does not apply is a
    bfloat16 copy."""
    check_expert_dtype(expert_dtype)
    if neuron:
        return RecordForm(layout)
    name = expert_dtype if expert_dtype != "auto" else (_pinned() or planned or _default_form(layout, device))
    if name == "packed":
        name = "record"
    if name not in FORMS:
        raise KernelError(f"held form {name!r} unknown; use one of {', '.join(FORMS)}")
    plain = not needs_decoding(layout)
    if plain and name != "record" and all(spec.dtype == name for spec in layout.matrices):
        name = "record"  # decoding plain matrices into their own dtype would only copy them
    if plain and expert_dtype == "auto" and name == "int4pack":
        name = "record"
    form = FORMS[name](layout, device)
    if form is None and name == "qdot":  # no compiled kernels here, or a matrix they do not take: today's default
        form = FORMS[_default_form(layout, device)](layout, device)
    return form if form is not None else FORMS["bfloat16"](layout, device)


def _default_form(layout: RecordLayout, device: torch.device) -> str:
    if not needs_decoding(layout):
        return "record"
    if FORMS["qdot"](layout, device) is not None:
        return "qdot"
    if FORMS["int4pack"](layout, device) is not None:
        return "int4pack"
    return "bfloat16"


# ------------------------------------------------------------------------------------------ timing


def median_seconds(fn, repeats: int = 20) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs, after 3 warm-up runs (the studies and the
    device profile time forms with it; the loader never times at load)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
