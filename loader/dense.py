"""The dense weights' held form: float as stored, or int8 computed by the compiled kernels (``loader/kernels``).

Why: with every expert cached, a decode step reads the attention projections, the shared experts and the LM head
every token, in float32 four times the bytes of int8; torch's float kernels reach a fraction of the memory
bandwidth at one token. ``dense="int8"`` (the plan's ``dense``, which ``package.dense`` sets, or ``load``'s
``dense``) replaces each such ``torch.nn.Linear`` by an ``Int8Linear``: its weight rounded once at load to uint8
codes with a float16 scale and an integer zero per group of 64 inputs (32 or 16 where the width asks), computed
by ``qdot`` from those codes with the activations rounded to int8 per block, so a layer reads a quarter of the
bytes. Left as they are: the routers (custom modules, not ``Linear``; routing decisions stay exact), embeddings,
norms, and matrices too small to matter (fewer than ``MIN_OUTPUTS`` outputs, such as a shared expert's gate).

The budget keeps counting the dense weights at their stored size (``loader.budget.dense_bytes``): int8 holds less,
so the budget stays an upper bound.
"""

from __future__ import annotations

import torch

from loader.errors import LoaderError
from loader.vocab import DENSE_FORMS

MIN_OUTPUTS = 16  # outputs below which a matrix stays float: a scalar gate reads next to nothing
GROUPS = (64, 32, 16)  # weights per scale, the first that divides the input width


def check_dense(dense) -> None:
    """``load``'s ``dense``: None (the plan's), or one of ``DENSE_FORMS``."""
    if dense is not None and dense not in DENSE_FORMS:
        raise LoaderError(f"dense {dense!r} unknown; use 'int8' (attention, shared experts and the LM head computed "
                          "from int8 codes by the compiled kernels), 'float' (as stored) or None (the plan's)")


def quantize_int8(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """``weight`` [N, K] as the codec's int8 parts: ``codes`` uint8 [N, K], ``scale`` and ``zero`` float16
    [N, K / group] with ``w ~ (code - zero) * scale``. Asymmetric per group (min to max over 255 steps); the zero
    is an integer, so float16 holds it exactly, and codes are rounded with the float16 scale they are read with."""
    n, k = weight.shape
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)  # 0 stays representable: a zero weight stays 0
    # rounded up to float16 (a step rounded down would clip the group's ends), at least float16's smallest normal
    # (a group of zeros gets a usable step; 1e-8 would round to 0 and be divided by)
    step_wanted = (high - low) / 255 * (1 + 2.0 ** -10)
    scale = step_wanted.clamp(min=torch.finfo(torch.float16).tiny).to(torch.float16)
    step = scale.to(torch.float32)
    zero = torch.round(-low / step).clamp(0, 255)
    codes = torch.round(w / step[..., None] + zero[..., None]).clamp(0, 255).to(torch.uint8)
    return {"codes": codes.reshape(n, k).contiguous(), "scale": scale.contiguous(),
            "zero": zero.to(torch.float16).contiguous()}


def decode_int8(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 [N, K] weight the parts stand for: the reference ``Int8Linear`` is held to."""
    codes, scale, zero = parts["codes"], parts["scale"].float(), parts["zero"].float()
    n, k = codes.shape
    w = (codes.reshape(n, scale.shape[1], -1).float() - zero[..., None]) * scale[..., None]
    return w.reshape(n, k)


class Int8Linear(torch.nn.Module):
    """A ``Linear`` whose weight is held as int8 codes and computed by ``qdot`` (the kernels' int8 path); the bias
    stays float. Output in the input's dtype, as the ``Linear`` it replaces."""

    def __init__(self, linear: torch.nn.Linear, group: int) -> None:
        from loader.kernels import StoredMatrix

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = quantize_int8(linear.weight, group)
        self.bias = linear.bias
        self.matrix = StoredMatrix(8, (self.out_features, self.in_features), group, 0, self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matrix.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y += self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 groups of {self.matrix.qmat.group}"


def _group(linear: torch.nn.Linear) -> int | None:
    return next((g for g in GROUPS if linear.in_features % g == 0), None)


def hold_dense_int8(model: torch.nn.Module, keep_float: tuple[str, ...] = ()) -> dict:
    """Replace every ``torch.nn.Linear`` of ``model`` (not under a path of ``keep_float``) that the kernels take by
    an ``Int8Linear``; returns what was done: ``{"form", "matrices", "float_bytes", "int8_bytes", "kept"}``.
    Call it on a CPU model whose weights are loaded (a tied LM head keeps the embedding it shares in float)."""
    from loader.kernels import available

    if not available():  # the kernels said why, once (``KernelNotice``)
        return {"form": "float", "matrices": 0, "why": "the compiled kernels are unavailable"}
    chosen = []
    kept = 0
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or any(name == p or name.startswith(p + ".") for p in keep_float):
            continue
        if module.weight.device.type != "cpu" or module.out_features < MIN_OUTPUTS or _group(module) is None:
            kept += 1
            continue
        chosen.append(name)
    float_bytes = int8_bytes = 0
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, leaf)
        held = Int8Linear(linear, _group(linear))
        float_bytes += linear.weight.numel() * linear.weight.element_size()
        int8_bytes += held.nbytes
        setattr(parent, leaf, held)
    return {"form": "int8", "matrices": len(chosen), "kept_float": kept, "float_bytes": float_bytes,
            "int8_bytes": int8_bytes}
