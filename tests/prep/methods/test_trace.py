"""Routing traces: recording parity on all seven architectures, streaming shards, and the real Mixtral traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prep.adapters import get_adapter
from prep.errors import MoeprepError
from prep.methods.trace import (
    RoutingRecorder,
    RoutingTrace,
    canonical_order,
    open_trace,
    read_mixtral_traces,
    record_traces,
)
from tests.helpers.tiny_models import ARCHITECTURES, build_tiny_model, random_sequences

TRACES_ROOT = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_trace_parity(arch, tmp_path):
    """Every MoE block's output is recomputed from the recorded trace to 1e-5."""
    model = build_tiny_model(arch)
    adapter = get_adapter(model)
    sequences = random_sequences(2, 9, seed=3)
    blocks = {}  # layer -> list of (input [T, H], output [T, H]) per forward

    def hook(layer):
        def capture(module, args, output):
            out = adapter.block_output(output)
            blocks.setdefault(layer, []).append(
                (args[0].reshape(-1, out.shape[-1]), out.reshape(-1, out.shape[-1]))
            )

        return capture

    handles = [
        adapter.moe_block(model, layer).register_forward_hook(hook(layer)) for layer in adapter.moe_layers
    ]
    try:
        record_traces(model, sequences, tmp_path / "trace", shard_tokens=7, hidden_dtype=torch.float32)
    finally:
        for h in handles:
            h.remove()

    trace = open_trace(tmp_path / "trace")
    routing = trace.routing()
    assert [r.num_tokens for r in routing] == [len(s) for s in sequences]
    for i, layer in enumerate(adapter.moe_layers):
        block_in = torch.cat([x for x, _ in blocks[layer]])
        block_out = torch.cat([y for _, y in blocks[layer]])
        hidden = trace.router_inputs(layer)
        assert torch.equal(hidden, block_in)  # the router sees exactly the MoE block input
        ids = torch.cat([r.expert_ids[:, i] for r in routing])
        weights = torch.cat([r.expert_weights[:, i] for r in routing])
        recomputed = adapter.reference_moe_output(model, layer, hidden, ids, weights)
        assert (recomputed - block_out).abs().max() <= 1e-5
        # route() reproduces the recorded decision.
        logits, r_ids, r_weights = adapter.route(model, layer, hidden)
        r_ids, r_weights = canonical_order(r_ids, r_weights.float())
        assert torch.equal(r_ids, ids)
        torch.testing.assert_close(r_weights.float(), weights, rtol=0, atol=1e-6)
        torch.testing.assert_close(logits.float(), trace.router_logits(layer), rtol=0, atol=1e-6)


def test_last_hidden_is_before_final_norm(tmp_path):
    model = build_tiny_model("mixtral")
    seq = random_sequences(1, 12)[0]
    record_traces(model, [seq], tmp_path / "t", hidden_dtype=torch.float32)
    trace = open_trace(tmp_path / "t")
    assert trace.index["last_hidden"] == "pre_final_norm"
    with torch.no_grad():
        final = model.model(seq.view(1, -1), use_cache=False).last_hidden_state[0]
        normed = model.model.norm(trace.last_hidden())
    torch.testing.assert_close(normed, final, rtol=0, atol=1e-6)
    assert torch.equal(trace.token_ids(), seq)


def test_streaming_shards_read_back_equal(tmp_path, one_thread):
    model = build_tiny_model("qwen2_moe")
    adapter = get_adapter(model)
    sequences = random_sequences(3, 10, seed=5)  # 10 + 11 + 12 = 33 tokens
    out = record_traces(model, sequences, tmp_path / "t", shard_tokens=8, fingerprint="tiny-qwen2")

    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "moeprep-trace" and index["version"] == 1
    assert index["model_fingerprint"] == "tiny-qwen2" and index["layers"] == adapter.moe_layers == [0, 2]
    assert index["sequence_tokens"] == [10, 11, 12] and index["total_tokens"] == 33
    assert [s["tokens"] for s in index["shards"]] == [8, 8, 8, 8, 1]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["index.json"] + [s["file"] for s in index["shards"]]
    )
    assert index["tensors"]["layers.0.router_input"] == {"shape": [adapter.hidden_size], "dtype": "float16"}
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary directory was renamed

    # Reading back equals an in-memory capture of the same forward passes.
    expected = []
    with RoutingRecorder(model, hidden_dtype=torch.float16) as rec, torch.no_grad():
        for seq in sequences:
            model(input_ids=seq.view(1, -1), use_cache=False)
            expected.append(rec.pop())
    trace = open_trace(out)
    routing = trace.routing()
    for s, (rows, got) in enumerate(zip(expected, routing, strict=True)):
        assert got.layers == (0, 2)
        for name, got_tensor in (("expert_ids", got.expert_ids), ("expert_weights", got.expert_weights)):
            want = torch.stack([rows[f"layers.{layer}.{name}"] for layer in (0, 2)], dim=1)  # [T, L, K]
            assert torch.equal(got_tensor, want)
        part = trace.sequence_slices()[s]
        assert torch.equal(trace.router_inputs(2)[part], rows["layers.2.router_input"])
        assert torch.equal(trace.router_logits(0)[part], rows["layers.0.router_logits"])
        assert torch.equal(trace.last_hidden()[part], rows["last_hidden"])
    assert trace.last_hidden().dtype == torch.float16


def test_record_without_hidden_and_errors(tmp_path):
    model = build_tiny_model("olmoe")
    out = record_traces(model, random_sequences(1, 5), tmp_path / "t", record_hidden=False)
    trace = open_trace(out)
    assert not any("router_input" in name or name == "last_hidden" for name in trace.index["tensors"])
    with pytest.raises(MoeprepError, match="no tensor 'last_hidden'"):
        trace.last_hidden()
    with pytest.raises(MoeprepError, match="already exists"):
        record_traces(model, random_sequences(1, 5), out)
    # A failing run leaves neither the target nor its temporary directory behind.
    with pytest.raises(MoeprepError, match="empty"):
        record_traces(model, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], tmp_path / "bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    with pytest.raises(MoeprepError, match="not a complete trace"):
        open_trace(tmp_path)


def test_routing_trace_validates_shapes():
    with pytest.raises(ValueError):
        RoutingTrace(torch.zeros(3, 2, 2, dtype=torch.int64), torch.zeros(3, 2, 1))
    with pytest.raises(ValueError):
        RoutingTrace(torch.zeros(3, 2, 2, dtype=torch.int64), torch.zeros(3, 2, 2), layers=(0,))


def _lru_misses(sequence: torch.Tensor, capacity: int) -> int:
    """Misses of one LRU cache of `capacity` experts over a [T, K] sequence of expert ids."""
    cache: list[int] = []
    misses = 0
    for token in sequence.tolist():
        for expert in token:
            if expert in cache:
                cache.remove(expert)
            else:
                misses += 1
                if len(cache) == capacity:
                    cache.pop(0)
            cache.append(expert)
    return misses


def test_read_mixtral_traces():
    if not (TRACES_ROOT / "mixtral-8x7b" / "gsm8k_routing.jsonl").is_file():
        pytest.skip(f"real Mixtral traces not found under {TRACES_ROOT}")
    traces = read_mixtral_traces(TRACES_ROOT)
    assert len(traces) == 2
    # Truncated to the shortest layer of each problem (SOURCES.md: 167 and 79 generated tokens).
    assert [t.num_tokens for t in traces] == [166, 78]
    for t in traces:
        assert t.num_layers == 32 and t.top_k == 2 and t.layers == tuple(range(32))
        assert t.expert_ids.min() >= 0 and t.expert_ids.max() <= 7
        assert (t.expert_ids[..., 0] != t.expert_ids[..., 1]).all()
        torch.testing.assert_close(t.expert_weights.sum(-1), torch.ones(t.num_tokens, 32), rtol=0, atol=1e-5)
        assert (t.expert_weights[..., 0] >= t.expert_weights[..., 1]).all()  # ordered by weight
    # SOURCES.md: per-layer LRU with 4 of 8 experts cached misses 42.9% over both problems.
    misses = sum(_lru_misses(t.expert_ids[:, layer], 4) for t in traces for layer in range(32))
    accesses = sum(t.expert_ids.numel() for t in traces)
    assert misses / accesses == pytest.approx(0.429, abs=0.003)  # truncation moves it by < 0.1 point


def test_read_mixtral_traces_missing(tmp_path):
    with pytest.raises(MoeprepError, match="no Mixtral routing trace"):
        read_mixtral_traces(tmp_path)


def test_the_canonical_order_is_heaviest_first_then_by_expert_id():
    """Against Python's sort of (-weight, id) per row, for rows given in any slot order (as DeepSeek-V2's
    ``topk(sorted=False)`` gives them, differently on CPU and CUDA), ties included."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 6)
        experts = rng.sample(range(16), k)
        weights = [rng.choice([0.125, 0.25, 0.5]) for _ in experts]  # few exact values: ties are common
        want = sorted(zip(experts, weights, strict=True), key=lambda p: (-p[1], p[0]))
        for _ in range(3):
            slots = list(range(k))
            rng.shuffle(slots)
            ids = torch.tensor([[experts[i] for i in slots]])
            w = torch.tensor([[weights[i] for i in slots]])
            got_ids, got_w = canonical_order(ids, w)
            assert got_ids[0].tolist() == [e for e, _ in want]
            assert got_w[0].tolist() == [x for _, x in want]
