"""The bench's llama.cpp baseline (prep/studies/bench/llama.py): the GGUF conversion's pieces, its logits against
transformers where the optional extra is installed, and the bench's llama.cpp rows or its skip note."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prep.cli import main
from prep.studies.bench import llama

HAVE_LLAMA = llama.missing() is None


def test_rotary_rows_interleave_each_heads_halves():
    heads, head_dim, cols = 3, 8, 5
    weight = torch.arange(heads * head_dim * cols, dtype=torch.float32).view(heads * head_dim, cols)
    out = llama._rotary_rows(weight, heads)
    half = head_dim // 2
    for h in range(heads):
        for j in range(half):  # llama.cpp pairs (j, j + half) of transformers' rotate-half layout as (2j, 2j+1)
            assert torch.equal(out[h * head_dim + 2 * j], weight[h * head_dim + j])
            assert torch.equal(out[h * head_dim + 2 * j + 1], weight[h * head_dim + half + j])


def test_the_vocabulary_names_every_id_once():
    tokens, types = llama._vocabulary(128)
    assert len(tokens) == len(types) == 128 and len(set(tokens)) == 128
    assert tokens[:4] == [b"<unk>", b"<s>", b"</s>", b"<pad>"] and types[:4] == [2, 3, 3, 3]
    assert tokens[4] == "\u2581".encode() and tokens[5] == b"!"  # a space is SentencePiece's U+2581
    assert b"<0x0A>" in tokens  # llama.cpp looks the newline byte up


def test_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it fails
    reason = llama.missing()
    assert reason.startswith("llama.cpp skipped") and ".[llama]" in reason


@pytest.mark.skipif(not HAVE_LLAMA, reason=llama.missing() or "")
def test_the_gguf_conversion_gives_transformers_logits(tmp_path):
    from prep.studies.bench.subjects import QUICK_SHAPE, _build_mixtral_shape

    model_dir = tmp_path / "model"
    _build_mixtral_shape(model_dir, QUICK_SHAPE)
    files = llama.prepare_gguf(model_dir, tmp_path / "gguf")
    ids = torch.randint(4, 128, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    assert llama.logit_check(files["f32"], model_dir, ids) < 1e-4
    assert files[llama.QUANT].stat().st_size < files["f32"].stat().st_size / 4


def test_the_bench_runs_llama_cpp_in_a_cgroup_or_says_why_not(tmp_path, quick_shape_built, monkeypatch,
                                                            forked_workers):
    import prep.studies.bench.measure as bench_measure

    # one resident candidate: the choice among them is tests/studies/test_bench.py's, not this test's
    monkeypatch.setattr(bench_measure, "RESIDENT_DTYPES", ("float32",))
    monkeypatch.setattr(bench_measure, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm",))
    result = CliRunner().invoke(main, ["bench", "--quick", "--subject", "mixtral-shape-own", "--budgets", "25%",
                                       "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert {"resident", "naive", "moeprep"} <= set(rows)
    assert report["subjects"]["mixtral-shape-own"]["routing"].startswith("the model's own routers")
    if not HAVE_LLAMA:
        assert "llama.cpp" not in rows and any(n.startswith("llama.cpp skipped") for n in report["notes"])
        return
    row = rows["llama.cpp"]
    assert not row.get("error"), row
    assert row["decode_tokens_per_s"] > 0
    assert 0 <= row["budget_bytes"] + llama.CGROUP_HEADROOM - row["cgroup_limit_bytes"] < 4096  # whole pages
    assert row["cgroup_peak_bytes"] <= row["cgroup_limit_bytes"]
    assert report["subjects"]["mixtral-shape-own"]["llama_cpp"]["f32_logit_max_abs_diff"] < 1e-3
    assert not list(Path(llama.CGROUP_ROOT).glob("moeprep-bench-*"))  # the cgroup went with the run
