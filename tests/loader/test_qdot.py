"""The compiled kernels (``loader/kernels``) and the qdot held form: each stored precision's product against the
float reference (the decoded matrix times the activations rounded as the kernel rounds them, and the exact product
within the rounding's own bound), the AVX2 and portable paths and the thread split agreeing, a cached expert taking
its stored size in the budget as ``moeload plan`` counts it, and the loader without the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loader import kernels
from loader.codec import MatrixSpec, decode_matrix
from prep.quant.hqq_codec import encode_matrix, matrix_spec
from tests.helpers.tiny_models import tiny_artifact

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are unavailable (no C compiler)")

REPO = Path(__file__).resolve().parents[2]


def _matrix(precision: str, group: int, meta: int, n: int, k: int, seed: int = 0):
    """(spec, record parts) of a random [n, k] matrix stored at ``precision``."""
    gen = torch.Generator().manual_seed(seed)
    if precision == "mxfp4":
        spec = MatrixSpec("m", (n, k), "mxfp4", "float32", 32)
        return spec, {"m.codes": torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=gen),
                      "m.scales": torch.randint(120, 130, (n * k // 32,), dtype=torch.uint8, generator=gen)}
    spec = matrix_spec("m", torch.randn(n, k, generator=gen), precision, group, False, meta)
    return spec, encode_matrix(spec, torch.randn(n, k, generator=gen))


def _block(precision: str, group: int) -> int:
    """The activations' rounding block the kernel uses (qdot.c ``block_of``)."""
    if precision == "int2" or group % 32:
        return 16
    return 32 if group % 64 else 64


def _rounded(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded to int8 per block of ``block`` (scale max|x| / 127, round half to even), and the scales."""
    blocks = x.double().view(x.shape[0], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127)
    return (q * d).view_as(x), d.squeeze(-1)


# (precision, group, meta group) x shapes: odd row counts, inputs that are and are not a whole number of SIMD chunks
FORMATS = [("int4", 64, 256), ("int4", 32, 0), ("int4", 16, 0), ("int3", 64, 256), ("int3", 32, 0), ("int3", 16, 0),
           ("int2", 16, 128), ("int2", 32, 0), ("int8", 64, 256), ("int8", 32, 0), ("mxfp4", 32, 0),
           ("int4", 32, 12), ("int2", 16, 20), ("int8", 64, 5)]  # meta groups that end inside a run of 8 groups
SHAPES = [(37, 256), (64, 384), (5, 192), (3, 1024)]


@pytest.mark.parametrize("precision,group,meta", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_each_kernel_computes_the_product_of_the_rounded_activations_within_its_bound(precision, group, meta, n, k):
    if k % group:
        pytest.skip("group does not divide the input")
    spec, parts = _matrix(precision, group, meta, n, k)
    weights = decode_matrix(spec, parts).double()
    stored = kernels.stored_matrix(spec, parts)
    assert stored.problem() == 0
    for tokens in (1, 2, 7, 64):
        x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)) * 3
        got = stored.matmul(x).double()
        rounded, d = _rounded(x, _block(precision, group))
        want = rounded @ weights.T
        spread = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-5 * spread, (precision, group, tokens)  # float32 sums only
        # against the exact product: each activation is off by at most half its block's step
        bound = (d.repeat_interleave(_block(precision, group), 1) / 2) @ weights.abs().T
        assert bool(((got - x.double() @ weights.T).abs() <= bound + 1e-5 * spread).all()), (precision, tokens)


@pytest.mark.parametrize("precision,group,meta", [("int4", 64, 256), ("int3", 64, 0), ("int2", 16, 128),
                                                  ("int8", 32, 0), ("mxfp4", 32, 0)])
def test_the_simd_and_portable_paths_and_every_thread_split_agree(precision, group, meta):
    spec, parts = _matrix(precision, group, meta, 300, 512, seed=1)
    stored = kernels.stored_matrix(spec, parts)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    portable = stored.matmul(x, threads=1, simd=False)
    fast = stored.matmul(x, threads=1)
    assert float((fast - portable).abs().max()) <= 1e-5 * float(portable.abs().max())
    for threads in (2, 3, 7):  # each row is computed by one thread the same way: the same bits
        assert torch.equal(stored.matmul(x, threads=threads), fast)


def test_mxfp4_scales_at_the_ends_of_e8m0_read_the_same_on_both_paths():
    """The AVX2 path builds 2 ** (e - 128) from the scale byte's bits, and takes the two smallest (subnormal halves)
    from the table: every byte from 0 to 200 scales as the portable path's table does."""
    n, k = 201, 64
    spec = MatrixSpec("m", (n, k), "mxfp4", "float32", 32)
    gen = torch.Generator().manual_seed(3)
    parts = {"m.codes": torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=gen),
             "m.scales": torch.arange(n, dtype=torch.uint8).repeat_interleave(k // 32)}  # row r: scale byte r
    stored = kernels.stored_matrix(spec, parts)
    x = torch.randn(2, k, generator=gen)
    fast, portable = stored.matmul(x, threads=1), stored.matmul(x, threads=1, simd=False)
    assert stored.simd()
    for row in range(n):  # each row against its own magnitude (2 ** (row - 128) spans far more than float32's digits)
        spread = float(portable[:, row].abs().max())
        assert spread > 0 and torch.allclose(fast[:, row], portable[:, row], rtol=1e-5, atol=1e-5 * spread), row


def test_the_kernels_refuse_a_matrix_they_do_not_take():
    spec, parts = _matrix("int4", 32, 0, 8, 64)
    assert kernels.takes(spec)
    assert not kernels.takes(MatrixSpec("m", (8, 64), "int4", "float32", 8))  # groups of 8
    assert not kernels.takes(MatrixSpec("m", (8, 64), "int4", "float32", 32, kernel="int4pack"))
    bad = kernels.StoredMatrix(4, (8, 64), 24, 0, {"codes": parts["m.codes"], "scale": parts["m.scale"],
                                                   "zero": parts["m.zero"]})
    assert bad.problem() != 0
    with pytest.raises(RuntimeError, match="bad matrix"):
        bad.matmul(torch.randn(1, 64))


def test_a_cached_expert_takes_its_stored_size_as_moeload_plan_counts_it(tmp_path_factory, monkeypatch):
    from loader.fit import preview
    from loader.forms import ENV
    from loader.runtime import load, minimum_budget

    monkeypatch.delenv(ENV, raising=False)
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    # records in RAM (a disk store's read slot is a whole 4 KiB page, larger than these tiny experts decoded)
    budget = minimum_budget(artifact, "host", expert_dtype="bfloat16")  # one bfloat16 expert per layer
    loaded = load(artifact, memory_budget=budget, store="host")
    try:
        store = loaded.runtime.stores["int4"]
        assert loaded.budget["expert_dtype"] == {"int4": "qdot"}
        slot = loaded.budget["slot_bytes"]["int4"]
        assert slot == -(-store.record_bytes // 64) * 64 and loaded.budget["staging_bytes"] == 0  # the record alone
        with torch.no_grad():
            loaded.model(input_ids=torch.randint(4, 60, (1, 6)))
        assert loaded.stats()["misses"] > 0
    finally:
        loaded.close()
    stored, decoded = (preview(artifact, budget, store="host", expert_dtype=d)["accounting"]["pools"]["main"]
                       for d in ("auto", "bfloat16"))
    assert stored["slot_bytes"] == slot < decoded["slot_bytes"]  # moeload plan counts the slot the loader holds
    assert stored["slots"] > decoded["slots"]  # so the same budget holds more experts


def test_without_the_kernels_the_loader_runs_the_torch_forms_and_says_so_once(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    script = ("import torch, warnings\n"
              "from loader.runtime import load\n"
              f"m = load({str(artifact)!r}, memory_budget='unlimited')\n"
              "print('forms', m.budget['expert_dtype'])\n"
              "with torch.no_grad():\n"
              "    m.model(input_ids=torch.randint(4, 60, (1, 5)))\n"
              f"load({str(artifact)!r}, memory_budget='unlimited').close()\n"
              "m.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "MOEPREP_EXPERT_DTYPE"} | {kernels.ENV: "off"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "qdot" not in done.stdout and "forms {'int4':" in done.stdout
    assert done.stderr.count("compiled expert kernels are unavailable") == 1, done.stderr


@pytest.mark.parametrize("precisions", [("int4", "int4"), ("int3", "int2"), ("int8", "mxfp4"), ("int4", "int3", "int2")])
@pytest.mark.parametrize("simd", [True, False])
def test_experts_in_one_call_equal_each_experts_products_summed(precisions, simd):
    """``experts_product``: gate_up, SiLU gate, down and the weighted sum of several experts (of mixed precisions) in
    one call, equal to the separate products, the float gate and the weighted sum computed one expert at a time; on
    one thread and on two (rows are computed whole by one thread, so the threads do not change a bit)."""
    k, inter = 256, 96
    gate_up, down, weights = [], [], [0.5, 0.3, 0.2][:len(precisions)]
    for i, precision in enumerate(precisions):
        group = 16 if precision == "int2" else 32
        gate_up.append(kernels.stored_matrix(*_matrix(precision, group, 0, 2 * inter, k, seed=2 * i)))
        down.append(kernels.stored_matrix(*_matrix(precision, group, 0, k, inter, seed=2 * i + 1)))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)) * 2
    want = torch.zeros(1, k)
    for gu, dn, w in zip(gate_up, down, weights, strict=True):
        h = gu.matmul(x, simd=simd)
        want.add_(dn.matmul(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], simd=simd), alpha=w)
    for threads in (1, 2):
        got = kernels.experts_product(gate_up, down, weights, x, threads=threads, simd=simd)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max())), (precisions, threads)


def test_experts_in_one_call_refuse_matrices_that_do_not_chain():
    gu = kernels.stored_matrix(*_matrix("int4", 32, 0, 64, 128))
    wrong = kernels.stored_matrix(*_matrix("int4", 32, 0, 128, 64))  # down must take gate_up's half (32) inputs
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels.experts_product([gu], [wrong], [1.0], torch.ones(1, 128))
    with pytest.raises(ValueError, match="1 to 16 experts"):
        kernels.experts_product([], [], [], torch.ones(1, 128))


def test_a_one_token_step_computes_its_resident_experts_in_one_call(tmp_path_factory, monkeypatch):
    """With every expert cached, each one-token MoE step computes its hits in one ``experts_product`` call, and the
    logits are those of computing each expert on its own (to float32 rounding)."""
    from loader.engine import ExpertEngine
    from loader.runtime import load

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")

    def run() -> tuple[list[torch.Tensor], list[int]]:
        loaded = load(artifact, memory_budget="unlimited", dense="float", expert_dtype="qdot")
        calls = []
        real = kernels.experts_product
        monkeypatch.setattr(kernels, "experts_product", lambda gu, *a, **k: calls.append(len(gu)) or real(gu, *a, **k))
        logits = []
        with torch.no_grad():
            loaded.model(input_ids=torch.arange(64).view(1, -1) % loaded.model.config.vocab_size)  # caches every expert
            calls.clear()
            out = loaded.model(input_ids=torch.tensor([[3, 9, 27, 4]]), use_cache=True)
            for token in (5, 8, 13):
                out = loaded.model(input_ids=torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
                logits.append(out.logits[0, -1])
        loaded.close()
        monkeypatch.setattr(kernels, "experts_product", real)
        return logits, calls

    together, calls = run()
    layers = len(__import__("json").loads((artifact / "manifest.json").read_text())["moe"]["layers"])
    assert calls == [2] * (3 * layers)  # top-2, every layer of every one-token step
    monkeypatch.setattr(ExpertEngine, "compute_together", lambda self, module, ds, mix: ds)
    separate, none = run()
    assert none == []
    for a, b in zip(together, separate, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
