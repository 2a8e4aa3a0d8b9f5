"""The compute form of a cached expert: the packed record decoded once into the slot, and the dtype to hold it in.

Decoding a quantized record (unpack the codes, apply scale and zero per group) costs several times the
one-token matrix products it feeds (``loader/README.md``, "Compute path", has this machine's figures from
``moeprep kernel-study``), so a cached expert of a quantized store keeps a *decoded copy* beside its
record, in the same cache slot, and the slot's bytes count both: a miss decodes once, a hit only
multiplies. Stores that are already plain matrices (passthrough) are computed from the record as it is.

``expert_dtype`` (a ``load`` argument) picks the form:
- ``auto``: a decoded copy in the faster of the model's dtype and bfloat16 for one-token products on
  this device, measured once per process (``pick_dtype``); bfloat16 wins a near tie, since it holds twice
  the experts in the same bytes;
- ``float32`` / ``bfloat16`` / ``float16``: a decoded copy in that dtype;
- ``packed``: no decoded copy, the record is decoded on every use (the smallest slot).

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

from loader.codec import RecordLayout, decode_matrix, dtype_of
from loader.errors import MoeError

EXPERT_DTYPES = ("auto", "float32", "bfloat16", "float16", "packed")
ENV = "MOEPREP_EXPERT_DTYPE"
TIE = 1.15  # bfloat16 is taken while it is at most this much slower than the model's dtype: twice the experts
ALIGN = 64


class KernelError(MoeError):
    """An unknown expert dtype."""


def check_expert_dtype(name: str) -> str:
    if name not in EXPERT_DTYPES:
        raise KernelError(f"expert dtype {name!r} unknown; use one of {', '.join(EXPERT_DTYPES)}")
    return name


def needs_decoding(layout: RecordLayout) -> bool:
    """Whether computing from a record means decoding it (any quantized matrix)."""
    return any(spec.precision != "passthrough" for spec in layout.matrices)


@dataclass(frozen=True)
class DecodedLayout:
    """Where each matrix of a record's decoded copy lives inside the decoded region of a slot."""

    layout: RecordLayout
    dtype: torch.dtype

    @functools.cached_property
    def offsets(self) -> list[tuple[str, tuple[int, ...], int]]:
        out, offset = [], 0
        for spec in self.layout.matrices:
            out.append((spec.name, spec.shape[::-1] if spec.transposed else spec.shape, offset))
            offset += -(-spec.numel * self.dtype.itemsize // ALIGN) * ALIGN
        return out

    @property
    def nbytes(self) -> int:
        name, shape, offset = self.offsets[-1]
        return offset + -(-_numel(shape) * self.dtype.itemsize // ALIGN) * ALIGN

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoded matrices as views into ``region`` (uint8, at least ``nbytes``)."""
        size = self.dtype.itemsize
        return {name: region[offset:offset + _numel(shape) * size].view(self.dtype).view(shape)
                for name, shape, offset in self.offsets}

    def decode_into(self, record: torch.Tensor, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """Decode ``record`` into ``region`` and return the views (what a miss does once)."""
        parts = self.layout.split(record)
        views = self.views(region)
        for spec in self.layout.matrices:
            decode_matrix(spec, parts, out=views[spec.name])
        return views


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def time_linear(rows: int, cols: int, dtype: torch.dtype, device: torch.device, tokens: int = 1,
                repeats: int = 20) -> float:
    """Median seconds of ``tokens`` rows through one [rows, cols] weight in ``dtype`` on ``device``."""
    w = torch.randn(rows, cols, device=device).to(dtype)
    x = torch.randn(tokens, cols, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@functools.cache
def pick_dtype(model_dtype: str, shapes: tuple, device: str = "cpu") -> tuple[str, dict]:
    """(dtype name, {dtype: seconds}) for ``auto``: the faster of the model's dtype and bfloat16 for one token
    through an expert's matrices (``shapes``, each [out, in]), bfloat16 winning within ``TIE``."""
    dev = torch.device(device)
    candidates = [model_dtype] if model_dtype == "bfloat16" else [model_dtype, "bfloat16"]
    seconds = {name: sum(time_linear(rows, cols, dtype_of(name), dev) for rows, cols in shapes) for name in candidates}
    if len(candidates) == 1 or seconds["bfloat16"] <= TIE * seconds[model_dtype]:
        return "bfloat16", seconds
    return model_dtype, seconds


def matrix_shapes(layout: RecordLayout) -> tuple:
    """The [out, in] shapes of a record's 2-D matrices as the products use them."""
    return tuple(tuple(spec.shape) for spec in layout.matrices if len(spec.shape) == 2)


def decoded_dtype(expert_dtype: str, layout: RecordLayout, device: torch.device) -> torch.dtype | None:
    """The dtype a store's cached experts are held in decoded, or None (computed from the record)."""
    check_expert_dtype(expert_dtype)
    if expert_dtype == "auto" and os.environ.get(ENV):
        expert_dtype = os.environ[ENV]
        if expert_dtype == "auto" or expert_dtype not in EXPERT_DTYPES:
            raise KernelError(f"{ENV}={expert_dtype!r} unknown; set it to one of "
                              f"{', '.join(EXPERT_DTYPES[1:])} or unset it")
    if expert_dtype == "packed" or not needs_decoding(layout):
        return None
    if expert_dtype != "auto":
        return dtype_of(expert_dtype)
    name, _ = pick_dtype(layout.matrices[0].dtype, matrix_shapes(layout), str(device))
    return dtype_of(name)
