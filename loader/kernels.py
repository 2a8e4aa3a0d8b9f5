"""The compute form of a cached expert, and one expert's forward in each form.

Decoding a quantized record (unpack the codes, apply scale and zero per group) costs several times the
one-token products it feeds (``loader/README.md``, "Compute path", has this machine's figures from
``moeprep kernel-study``), so a cached expert of a quantized store keeps a *held form* beside its record,
in the same cache slot, made once when the expert is first used after its read; the slot's bytes count
both. Stores of plain matrices (passthrough) are computed from the record as it is. The forms:

- a decoded copy (``DecodedLayout``) in float32, bfloat16 or float16;
- ``int4pack`` (``Int4PackLayout``): the codes repacked for torch's CPU int4 weight-only kernel
  (``_weight_int4pack_mm_for_cpu``), which reads them packed; scale and zero per group in bfloat16 and
  activations in bfloat16. It takes records of at most 4 bits with groups of 32-256 and output sizes that
  are multiples of 16. The codec's ``(code - zero) * scale`` is the kernel's ``(code - 8) * scale + zero'``
  with ``zero' = (8 - zero) * scale``.

``expert_dtype`` (a ``load`` argument) picks the form:
- ``auto``: per store, the fastest of the forms that apply for one-token products on this device,
  measured once per process (``pick_form``); within ``TIE`` of the fastest the smallest slot wins;
- ``float32`` / ``bfloat16`` / ``float16``: a decoded copy in that dtype; ``int4pack``: that form where
  it applies, else a bfloat16 copy;
- ``packed``: no held form: the record is decoded on every use (the smallest slot).

The environment variable ``MOEPREP_EXPERT_DTYPE`` (one of the names above but ``auto``) replaces what
``auto`` would measure: a device team pins the form once, and the test suite pins float32 so that its
parity tolerances are float32's (``tests/conftest.py``).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loader.codec import BITS, RecordLayout, decode_matrix, dtype_of, group_params, unpack_codes
from loader.errors import MoeError

EXPERT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int4pack", "packed")
ENV = "MOEPREP_EXPERT_DTYPE"
TIE = 1.15  # forms within this factor of the fastest count as equally fast: the smallest slot wins
ALIGN = 64
INT4PACK_GROUPS = (32, 64, 128, 256)
# Above this many tokens for one expert (a prefill) the int4 kernel loses to decoding the record for that use:
# at 256 tokens it took about 3x a bfloat16 product here, while at 1-16 tokens it is the fastest form
# (``moeprep kernel-study``); decoding costs ~4 ms once, which a bfloat16 product saves back by ~64 tokens.
INT4PACK_MAX_TOKENS = 64


class KernelError(MoeError):
    """An unknown expert dtype."""


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


# ------------------------------------------------------------------------------------------ the forward


def expert_forward(module, weights, x: torch.Tensor) -> torch.Tensor:
    """One expert's output for tokens ``x`` [T, H] (in the weights' compute dtype): ``weights`` is a dict of
    matrices in the module's parameter layout (a record's decoding or a decoded copy) or ``Int4Weights``."""
    if isinstance(weights, Int4Weights):
        x = x.to(torch.bfloat16)
        gate_up = weights.linear("gate_up_proj", x)
        y = weights.linear("down_proj", module._apply_gate(gate_up))
        return y
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


# ------------------------------------------------------------------------------------------ decoded copies


@dataclass(frozen=True)
class DecodedLayout:
    """Where each matrix of a record's decoded copy lives inside the held region of a slot."""

    layout: RecordLayout
    dtype: torch.dtype

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

    @property
    def nbytes(self) -> int:
        name, shape, offset = self.offsets[-1]
        return offset + _aligned(_numel(shape) * self.dtype.itemsize)

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoded matrices as views into ``region`` (uint8, at least ``nbytes``)."""
        size = self.dtype.itemsize
        return {name: region[offset:offset + _numel(shape) * size].view(self.dtype).view(shape)
                for name, shape, offset in self.offsets}

    def fill(self, record: torch.Tensor, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Decode ``record`` into ``region`` and return the views (what a miss does once)."""
        parts = self.layout.split(record)
        views = self.views(region)
        for spec in self.layout.matrices:
            decode_matrix(spec, parts, out=views[spec.name])
        return views


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
    if device.type != "cpu":
        return False
    return _int4pack_works()


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
    """Whether every matrix of the layout can take the int4 form: quantized 2-D matrices of at most 4 bits
    with a supported group and an output size that is a multiple of 16, and 1-D biases."""
    for spec in layout.matrices:
        if len(spec.shape) == 1 and spec.precision == "passthrough":
            continue
        if spec.precision not in BITS or BITS[spec.precision] > 4 or spec.rows or len(spec.shape) != 2 \
                or spec.group_size not in INT4PACK_GROUPS or spec.shape[0] % 16 or spec.shape[1] % spec.group_size:
            return False
    return True


@dataclass(frozen=True)
class Int4PackLayout:
    """Where each matrix's int4 form lives inside the held region of a slot."""

    layout: RecordLayout
    name = "int4pack"

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

    @property
    def nbytes(self) -> int:
        name, offset, packed, scales = self.offsets[-1]
        return offset + _aligned(packed) + _aligned(scales)

    def fill(self, record: torch.Tensor, region: torch.Tensor) -> Int4Weights:
        """Repack ``record`` into ``region`` (what a miss does once)."""
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
            codes = unpack_codes(parts[f"{name}.codes"], BITS[spec.precision], spec.numel).view(n, k)
            packed = region[offset:offset + packed_bytes].view(n, k // 2)
            packed.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2))
            scale = group_params(spec, parts, "scale").view(n, groups)
            zero = (8 - group_params(spec, parts, "zero").view(n, groups)) * scale
            start = offset + _aligned(packed_bytes)
            scales_zeros = region[start:start + scale_bytes].view(torch.bfloat16).view(groups, n, 2)
            scales_zeros.copy_(torch.stack([scale.T, zero.T], -1))
            matrices[name] = (packed, scales_zeros, spec.group_size)
        return Int4Weights(matrices, vectors)


# ------------------------------------------------------------------------------------------ CPU misses


CPU_MISSES = ("auto", "always", "never")


@dataclass(frozen=True)
class MissCosts:
    """Measured at load on a GPU with the store in host RAM: per precision, seconds for one decode step's
    expert on the CPU (decode + products) against copying its record to the GPU and making its held form
    there. The switch Fiddler, ktransformers and llama.cpp make: a miss is computed where it is cheaper."""

    cpu_seconds: dict
    gpu_seconds: dict

    def prefer_cpu(self, precision: str) -> bool:
        return self.cpu_seconds[precision] < self.gpu_seconds[precision]


def measure_miss_costs(module, records: dict, layouts: dict, held: dict, device: torch.device,
                       hidden: int) -> MissCosts:
    """``records``: one host record per precision. Times both ways of serving a one-token miss."""
    cpu, gpu = {}, {}
    x = torch.randn(1, hidden)
    for precision, record in records.items():
        layout = layouts[precision]
        cpu[precision] = median_seconds(lambda r=record, lay=layout: expert_forward(module, lay.decode(r), x), repeats=5)
        form = held.get(precision)
        staging = record.pin_memory() if device.type == "cuda" else record
        xd = x.to(device)

        def on_gpu(form=form, staging=staging, lay=layout, xd=xd):
            rec = staging.to(device, non_blocking=True)
            weights = form.fill(rec, torch.empty(form.nbytes, dtype=torch.uint8, device=device)) if form is not None \
                else lay.decode(rec)
            expert_forward(module, weights, xd)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        gpu[precision] = median_seconds(on_gpu, repeats=5)
    return MissCosts(cpu, gpu)


# ------------------------------------------------------------------------------------------ choosing


def median_seconds(fn, repeats: int = 20) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs, after 3 warm-up runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_linear(rows: int, cols: int, form: str, device: torch.device, group: int = 64) -> float:
    """Median seconds of one token through one [rows, cols] weight held in ``form`` on ``device``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if form == "int4pack":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (rows, cols), dtype=torch.int32), 2)
        scales = torch.rand(cols // group, rows, 2).to(torch.bfloat16)
        x = torch.randn(1, cols).to(torch.bfloat16)
        return median_seconds(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales))
    w = torch.randn(rows, cols, device=device).to(dtype_of(form))
    x = torch.randn(1, cols, device=device).to(dtype_of(form))

    def run():
        F.linear(x, w)
        sync()

    return median_seconds(run)


@functools.cache
def pick_form(model_dtype: str, shapes: tuple, int4pack: bool, group: int, device: str = "cpu") -> tuple[str, dict]:
    """(form, {form: seconds}) for ``auto``: the fastest form for one token through an expert's matrices
    (``shapes``, each [out, in]) among a decoded copy in the model's dtype, one in bfloat16, and int4pack
    (when ``int4pack``); within ``TIE`` of the fastest, the smallest slot (int4pack, bfloat16, float32)."""
    dev = torch.device(device)
    candidates = ["int4pack"] if int4pack else []
    candidates += ["bfloat16"] + ([model_dtype] if model_dtype != "bfloat16" else [])
    seconds = {form: sum(time_linear(rows, cols, form, dev, group) for rows, cols in shapes) for form in candidates}
    fastest = min(seconds.values())
    return next(form for form in candidates if seconds[form] <= TIE * fastest), seconds


def matrix_shapes(layout: RecordLayout) -> tuple:
    """The [out, in] shapes of a record's 2-D matrices as the products use them."""
    return tuple(tuple(spec.shape) for spec in layout.matrices if len(spec.shape) == 2)


def held_layout(expert_dtype: str, layout: RecordLayout, device: torch.device):
    """How a store's cached experts are held: a ``DecodedLayout``, an ``Int4PackLayout``, or None (computed
    from the record)."""
    check_expert_dtype(expert_dtype)
    if expert_dtype == "auto" and os.environ.get(ENV):
        expert_dtype = os.environ[ENV]
        if expert_dtype == "auto" or expert_dtype not in EXPERT_DTYPES:
            raise KernelError(f"{ENV}={expert_dtype!r} unknown; set it to one of "
                              f"{', '.join(EXPERT_DTYPES[1:])} or unset it")
    if expert_dtype == "packed" or not needs_decoding(layout):
        return None
    int4pack = int4pack_available(device) and int4pack_fits(layout)
    if expert_dtype == "auto":
        group = next(spec.group_size for spec in layout.matrices if spec.precision != "passthrough")
        expert_dtype, _ = pick_form(layout.matrices[0].dtype, matrix_shapes(layout), int4pack, group, str(device))
    if expert_dtype == "int4pack":
        return Int4PackLayout(layout) if int4pack else DecodedLayout(layout, torch.bfloat16)
    return DecodedLayout(layout, dtype_of(expert_dtype))
