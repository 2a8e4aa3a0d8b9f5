"""``moeprep kernel-study``: what one expert costs in each compute form on this machine (loader/forms.py).

For an expert of the given shape (gate_up [2I, H], down [H, I], SiLU-gated), with random weights quantized
by the project's own codec, it times (median of ``repeats``, after warm-up):
- ``decode``: turning a record into float matrices (what a miss costs once with decoded copies, and what
  every use costs with ``packed``), per precision, into float32 and into bfloat16;
- ``forward``: one expert's products for 1 token and for a prefill batch, from float32, bfloat16 and
  float16 matrices, and from packed weights with torch's weight-only low-bit kernels where this build has
  them (``_weight_int8pack_mm``: int8 per output channel; ``_weight_int4pack_mm_for_cpu``: int4 in groups
  of 64), the options that read packed weights directly;
- per precision, what one use of a cached expert costs in the ``packed`` form (decode + float32 forward)
  against a decoded copy.

The table it writes is the one ``loader/README.md`` quotes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from loader.codec import DEFAULT_FORMATS
from loader.forms import DecodedForm, Int4PackForm, int4pack_fits, median_seconds
from loader.io import write_bytes_atomic
from loader.vocab import BITS
from prep.quant.hqq_codec import encode_expert

PRECISIONS = tuple(BITS)  # the quantized precisions, highest first


def _forward(x, gate_up, down):
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


def _int4pack(w: torch.Tensor, group: int = 64):
    """torch's CPU int4 weight-only form of ``w`` [N, K]: packed codes and bfloat16 (scale, zero) per group."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    zero = lo + 8 * scale  # the kernel computes (code - 8) * scale + zero
    return packed, torch.stack([scale.T, zero.T], -1).to(torch.bfloat16).contiguous()


def _lowbit_forwards(gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """Forward closures over torch's weight-only low-bit kernels, for those this build has."""
    out = {}
    try:
        s1, s2 = gate_up.abs().amax(1) / 127, down.abs().amax(1) / 127
        q1 = (gate_up / s1[:, None]).round().to(torch.int8)
        q2 = (down / s2[:, None]).round().to(torch.int8)
        mm8 = torch.ops.aten._weight_int8pack_mm

        def int8(x):
            g, u = mm8(x, q1, s1).chunk(2, dim=-1)
            return mm8(F.silu(g) * u, q2, s2)

        int8(torch.zeros(1, gate_up.shape[1]))
        out["int8 weight-only (torch _weight_int8pack_mm)"] = (int8, torch.float32)
    except (RuntimeError, AttributeError):
        pass
    try:
        p1, sz1 = _int4pack(gate_up)
        p2, sz2 = _int4pack(down)
        mm4 = torch.ops.aten._weight_int4pack_mm_for_cpu

        def int4(x):
            g, u = mm4(x, p1, 64, sz1).chunk(2, dim=-1)
            return mm4(F.silu(g) * u, p2, 64, sz2)

        int4(torch.zeros(1, gate_up.shape[1], dtype=torch.bfloat16))
        out["int4 weight-only (torch _weight_int4pack_mm_for_cpu)"] = (int4, torch.bfloat16)
    except (RuntimeError, AttributeError):
        pass
    return out


def run_kernel_study(hidden: int, intermediate: int, prefill_tokens: int = 16, repeats: int = 20,
                     output: str | Path = "artifacts/kernel-study", echo=print) -> dict:

    torch.manual_seed(0)
    gate_up = torch.randn(2 * intermediate, hidden) * hidden ** -0.5
    down = torch.randn(hidden, intermediate) * intermediate ** -0.5
    study = {"hidden": hidden, "intermediate": intermediate, "prefill_tokens": prefill_tokens, "repeats": repeats,
             "threads": torch.get_num_threads(), "torch": torch.__version__, "decode_ms": {}, "forward_ms": {},
             "use_ms": {}}
    forms = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        a, b = gate_up.to(dt), down.to(dt)
        forms[name] = (lambda x, a=a, b=b: _forward(x, a, b), dt)
    forms |= _lowbit_forwards(gate_up, down)
    for name, (fn, dtype) in forms.items():
        row = {}
        for tokens in (1, prefill_tokens):
            x = torch.randn(tokens, hidden).to(dtype)
            row[str(tokens)] = median_seconds(lambda fn=fn, x=x: fn(x), repeats) * 1e3
        study["forward_ms"][name] = row
        echo(f"forward {name}: " + ", ".join(f"{t} token(s) {ms:.3f} ms" for t, ms in row.items()))
    for precision in PRECISIONS:
        group, meta = DEFAULT_FORMATS[precision]
        layout, record = encode_expert({"gate_up_proj": gate_up, "down_proj": down}, precision, group, False, meta)
        row = {"record_mb": record.numel() / 1e6}
        for dtype in (torch.float32, torch.bfloat16):
            decoded = DecodedForm(layout, dtype)
            region = torch.empty(decoded.nbytes, dtype=torch.uint8)
            row[decoded.name] = median_seconds(lambda d=decoded, r=region, rec=record: d.make(rec, r), repeats) * 1e3
            row[f"{decoded.name}_mb"] = decoded.nbytes / 1e6
        if int4pack_fits(layout) and "int4 weight-only (torch _weight_int4pack_mm_for_cpu)" in study["forward_ms"]:
            held = Int4PackForm(layout)
            region = torch.empty(held.nbytes, dtype=torch.uint8)
            row["int4pack"] = median_seconds(lambda d=held, r=region, rec=record: d.make(rec, r), repeats) * 1e3
            row["int4pack_mb"] = held.nbytes / 1e6
        study["decode_ms"][precision] = row
        one = study["forward_ms"]["float32"]["1"]
        study["use_ms"][precision] = {"packed (decode every use)": row["float32"] + one,
                                      "decoded copy, float32": one,
                                      "decoded copy, bfloat16": study["forward_ms"]["bfloat16"]["1"]}
        if "int4pack" in row:
            study["use_ms"][precision]["int4pack"] = \
                study["forward_ms"]["int4 weight-only (torch _weight_int4pack_mm_for_cpu)"]["1"]
        echo(f"decode {precision}: float32 {row['float32']:.2f} ms, bfloat16 {row['bfloat16']:.2f} ms")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output / "kernels.json", (json.dumps(study, indent=2) + "\n").encode())
    write_bytes_atomic(output / "kernels.md", markdown(study).encode())
    return study


def markdown(study: dict) -> str:
    h, i, t = study["hidden"], study["intermediate"], study["prefill_tokens"]
    lines = [f"Expert of hidden {h}, intermediate {i} (gate_up [{2 * i}, {h}], down [{h}, {i}]); torch "
             f"{study['torch']}, {study['threads']} threads; medians of {study['repeats']} runs, ms.", "",
             f"| one expert's products from | 1 token | {t} tokens |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {row['1']:.3f} | {row[str(t)]:.3f} |" for name, row in study["forward_ms"].items()]
    lines += ["", "Per precision (default format): what a miss costs once to make each held form, what one use of a "
              "cached expert costs in each form (1 token), and each held form's MB.", "",
              "| precision | record MB | make float32 | make bfloat16 | make int4pack | use: packed (decode + float32) "
              "| use: float32 | use: bfloat16 | use: int4pack | float32 MB | bfloat16 MB | int4pack MB |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p, row in study["decode_ms"].items():
        use = study["use_ms"][p]
        pack = row.get("int4pack")
        lines.append(f"| {p} | {row['record_mb']:.2f} | {row['float32']:.2f} | {row['bfloat16']:.2f} | "
                     f"{'-' if pack is None else format(pack, '.2f')} | {use['packed (decode every use)']:.2f} | "
                     f"{use['decoded copy, float32']:.3f} | {use['decoded copy, bfloat16']:.3f} | "
                     f"{'-' if 'int4pack' not in use else format(use['int4pack'], '.3f')} | {row['float32_mb']:.2f} | "
                     f"{row['bfloat16_mb']:.2f} | {'-' if pack is None else format(row['int4pack_mb'], '.2f')} |")
    return "\n".join(lines) + "\n"
