"""The bench's kernel table: each held form's product of one expert matrix with one token, on 1 and 2 threads, as a
share of the read bandwidth at the same thread count: the faster of every byte of a 512 MB buffer read once
(``loader.kernels.read_bytes``) and torch's float products of the table. At one token a product reads every byte of its weights once, so that share is how close the form
comes to the memory's speed; the issue's goal is 0.6 of one core's.

The forms: ``qdot`` at each stored precision (the compiled kernels, ``loader/kernels``), torch's ``int4pack``
(where this torch build has it), and the decoded ``bfloat16`` and ``float32`` matrices (``x @ W.T``). The matrix is
one of Mixtral's expert matrices (14336 x 4096), random codes with valid scales: the speed does not depend on
the values.
"""

from __future__ import annotations

import torch

from loader.forms import median_seconds

SHAPE = (14336, 4096)  # (out, in): Mixtral-8x7B's w1
QUICK_SHAPE = (1024, 1024)
BANDWIDTH_BYTES = 512 << 20
QDOT_FORMATS = {"int8": (64, 256), "int4": (64, 256), "int3": (64, 256), "int2": (16, 128), "mxfp4": (32, 0)}


def _stored(precision: str, shape: tuple[int, int], gen: torch.Generator):
    """A random stored matrix of ``precision`` (codes, and scales that are valid float16) and its bytes."""
    from loader import kernels
    from loader.codec import MatrixSpec, RecordLayout

    group, meta = QDOT_FORMATS[precision]
    spec = MatrixSpec("m", shape, precision, "bfloat16", group, meta_group=meta)
    layout = RecordLayout((spec,))
    record = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
    for _name, dtype, offset, size in layout.parts():
        if dtype == "float16":
            record[offset:offset + size] = (torch.rand(size // 2, generator=gen) * 0.01).half().view(torch.uint8)
    return kernels.stored_matrix(spec, layout.split(record)), layout.nbytes


def _products(shape: tuple[int, int], gen: torch.Generator) -> dict:
    """form name -> (product of one token on ``threads``, bytes it reads)."""
    from loader import kernels
    from loader.forms import int4pack_available

    n, k = shape
    out = {}
    if kernels.available():
        for precision in QDOT_FORMATS:
            stored, nbytes = _stored(precision, shape, gen)
            x = torch.randn(1, k, generator=gen)
            out[f"qdot {precision}"] = ((lambda t, s=stored, x=x: s.matmul(x, threads=t)), nbytes)
    if int4pack_available(torch.device("cpu")):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 2)
        scales = torch.randn(k // 64, n, 2, generator=gen).to(torch.bfloat16)
        xb = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        out["int4pack int4"] = ((lambda t: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 64, scales)),
                                n * k // 2 + scales.numel() * 2)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(1, k, generator=gen).to(dtype)
        out[f"{str(dtype).removeprefix('torch.')}"] = ((lambda t, w=w, x=x: x @ w.T), w.numel() * w.element_size())
    return out


def kernel_table(quick: bool = False, threads: tuple[int, ...] = (1, 2)) -> dict:
    """{"shape", "bandwidth_gb_s": {threads: GB/s}, "rows": [{"form", "bytes", "threads": {t: {"us", "gb_s",
    "share"}}}]}: each form's one-token product against the read bandwidth at the same thread count."""
    from loader import kernels

    shape = QUICK_SHAPE if quick else SHAPE
    repeats = 3 if quick else 10
    gen = torch.Generator().manual_seed(0)
    products = _products(shape, gen)
    own = torch.get_num_threads()
    bandwidth = {}
    rows = [{"form": name, "bytes": nbytes, "threads": {}} for name, (_fn, nbytes) in products.items()]
    try:
        for t in threads:
            torch.set_num_threads(t)
            if kernels.available():
                buffer = torch.ones(BANDWIDTH_BYTES if not quick else 64 << 20, dtype=torch.uint8)
                bandwidth[t] = buffer.numel() / median_seconds(lambda b=buffer, t=t: kernels.read_bytes(b, t), 5) / 1e9
                del buffer
            for row, (fn, _nbytes) in zip(rows, products.values(), strict=True):
                seconds = median_seconds(lambda fn=fn, t=t: fn(t), repeats)
                row["threads"][t] = {"us": seconds * 1e6, "gb_s": row["bytes"] / seconds / 1e9}
            # torch's float products read several rows at once and can outrun the one-pass probe: the bandwidth is
            # the faster of the two, so no share is flattered by a slow probe
            fastest = max(row["threads"][t]["gb_s"] for row in rows if row["form"] in ("float32", "bfloat16"))
            bandwidth[t] = max(bandwidth.get(t, 0.0), fastest)
            for row in rows:
                row["threads"][t]["share"] = row["threads"][t]["gb_s"] / bandwidth[t]
    finally:
        torch.set_num_threads(own)
    return {"shape": list(shape), "bandwidth_gb_s": bandwidth, "rows": rows,
            "simd": bool(kernels.available() and _simd(shape, gen))}


def _simd(shape, gen) -> bool:
    stored, _ = _stored("int4", shape, gen)
    return stored.simd()


def kernel_lines(table: dict | None) -> list[str]:
    """bench.md's kernel table."""
    if not table or not table.get("rows"):
        return []
    threads = sorted(table["bandwidth_gb_s"] or {1: None}, key=int)
    bw = ", ".join(f"{t} thread{'s' if int(t) > 1 else ''} {v:.1f} GB/s" for t, v in table["bandwidth_gb_s"].items())
    n, k = table["shape"]
    head = " | ".join(f"{t} thr. us | GB/s | share" for t in threads)
    lines = [f"Kernels: one token times one {n} x {k} expert matrix in each held form (`prep/studies/bench/kernels.py`"
             f"; {'AVX2' if table.get('simd') else 'portable'} path); read bandwidth {bw} (the faster of a one-pass "
             "read of a large buffer and torch's float products); share = GB/s of the form's bytes over that bandwidth:", "",
             f"| form | MB | {head} |", "| --- | ---: |" + " ---: | ---: | ---: |" * len(threads)]
    for row in table["rows"]:
        cells = []
        for t in threads:
            m = row["threads"].get(t) or row["threads"].get(str(t)) or {}
            share = m.get("share")
            cells.append(f"{m.get('us', 0):.0f} | {m.get('gb_s', 0):.1f} | {'' if share is None else f'{share:.2f}'}")
        lines.append(f"| {row['form']} | {row['bytes'] / 1e6:.1f} | {' | '.join(cells)} |")
    return lines + [""]
