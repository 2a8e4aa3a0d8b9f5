"""prep.methods.sensitivity against obviously-right references on tiny models.

The layer-local sweep must give the KL a full forward per expert gives, on every architecture (the
replay stubs stand in for the decoder layers before the lowered expert, so any format or mask slip
shows up as a difference); the model must come back bit-identical however the sweep ends; resume
must skip finished layers. The pre-rank is checked against a per-token loop and spearman against
ranks counted by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from prep.adapters import ExpertWeights, get_adapter
from prep.errors import MoeprepError
from prep.methods.sensitivity import kl_sweep, spearman, trace_prerank
from prep.methods.trace import RoutingRecorder
from tests.helpers.tiny_models import ARCHITECTURES, build_tiny_model, random_sequences

_MODELS: dict[str, torch.nn.Module] = {}


def tiny(arch: str):
    """One shared tiny model per architecture (the sweep must leave it untouched, which is tested)."""
    if arch not in _MODELS:
        _MODELS[arch] = build_tiny_model(arch)
    return _MODELS[arch]


def coarse(weights: ExpertWeights) -> ExpertWeights:
    """A stand-in for a low precision: every value rounded to a grid of 0.25."""
    return ExpertWeights(**{k: (t * 4).round() / 4 for k, t in weights.tensors().items()})


def low_of(model, adapter):
    originals = {(layer, e): adapter.get_expert(model, layer, e)
                 for layer in adapter.moe_layers for e in range(adapter.num_experts)}
    return lambda layer, e: coarse(originals[layer, e])


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_identical(model, before, layers_before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    layers = get_adapter(model).decoder_layers(model)
    assert all(a is b for a, b in zip(layers, layers_before, strict=True))


def brute_force(model, adapter, seqs, low):
    """drop[p][e] from full forwards of a copy of the model with the one expert lowered."""

    def logprobs(m):
        return [torch.log_softmax(m(input_ids=s.view(1, -1), use_cache=False).logits[0, :-1].float(), -1)
                for s in seqs]

    with torch.no_grad():
        base = logprobs(model)
        count = sum(b.shape[0] for b in base)
        drop = []
        for layer in adapter.moe_layers:
            row = []
            for e in range(adapter.num_experts):
                m = copy.deepcopy(model)
                adapter.set_expert(m, layer, e, low(layer, e))
                total = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(base, logprobs(m), strict=True))
                row.append(total / count)
            drop.append(row)
    return drop


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_local_sweep_equals_full_forwards(arch):
    model = tiny(arch)
    adapter = get_adapter(model)
    seqs = random_sequences(3, 9, seed=1)
    low = low_of(model, adapter)
    before, layers_before = snapshot(model), list(adapter.decoder_layers(model))
    got = kl_sweep(model, adapter, seqs, low)
    assert_identical(model, before, layers_before)
    want = brute_force(model, adapter, seqs, low)
    assert len(got) == len(adapter.moe_layers) and all(len(r) == adapter.num_experts for r in got)
    for p, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-7), f"MoE layer position {p}"
    assert max(max(r) for r in got) > 1e-3  # the stand-in precision does damage, so the check has teeth


def test_expert_runs_skip_the_layers_before():
    model = tiny("deepseek_v2")  # decoder layer 0 is dense, MoE layers are 1 and 2
    adapter = get_adapter(model)
    layers = adapter.decoder_layers(model)
    calls = [0] * len(layers)
    hooks = [layer.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(layers)]
    n, experts = 2, adapter.num_experts
    try:
        kl_sweep(model, adapter, random_sequences(n, 6), low_of(model, adapter))
    finally:
        for h in hooks:
            h.remove()
    # Layer 0: the base pass and the pass that caches its output, never again. Layer 1: the base pass,
    # the expert runs of its own position and the pass that caches its output. Layer 2: every run.
    assert calls == [2 * n, (1 + experts + 1) * n, (1 + 2 * experts) * n]

def test_base_weights_give_zero():
    model = tiny("deepseek_v2")
    adapter = get_adapter(model)
    got = kl_sweep(model, adapter, random_sequences(2, 7), lambda layer, e: adapter.get_expert(model, layer, e))
    assert got == [[0.0] * adapter.num_experts for _ in adapter.moe_layers]


@pytest.mark.parametrize("where", ["low", "on_layer"])
def test_model_restored_after_an_error(where):
    model = tiny("qwen2_moe")  # layers 0 and 2 are MoE: the second layer runs with a replay stub
    adapter = get_adapter(model)
    good = low_of(model, adapter)
    before, layers_before = snapshot(model), list(adapter.decoder_layers(model))
    calls = []

    def low(layer, e):
        calls.append((layer, e))
        if where == "low" and (layer, e) == (adapter.moe_layers[1], 3):
            raise RuntimeError("boom")
        return good(layer, e)

    def on_layer(p, row):
        if where == "on_layer" and p == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        kl_sweep(model, adapter, random_sequences(2, 6), low, on_layer=on_layer)
    assert len(calls) > adapter.num_experts  # it failed inside the second layer, not before
    assert_identical(model, before, layers_before)


def test_resume_skips_done_layers():
    model = tiny("deepseek_v2")
    adapter = get_adapter(model)
    seqs = random_sequences(2, 7, seed=2)
    good = low_of(model, adapter)
    full = kl_sweep(model, adapter, seqs, good)
    done_row = [float(i) for i in range(adapter.num_experts)]
    asked, reported = set(), []

    def low(layer, e):
        asked.add(layer)
        return good(layer, e)

    got = kl_sweep(model, adapter, seqs, low, done={0: done_row}, on_layer=lambda p, row: reported.append((p, row)))
    assert asked == {adapter.moe_layers[1]}
    assert reported == [(1, full[1])]
    assert got == [done_row, full[1]]
    # Everything done: no forward pass, no low() at all.
    assert kl_sweep(model, adapter, seqs, None, done={0: full[0], 1: full[1]}) == full


def test_sweep_rejects_bad_input():
    model = tiny("mixtral")
    adapter = get_adapter(model)
    low = low_of(model, adapter)
    for seqs in ([], [torch.tensor([], dtype=torch.long)], [torch.tensor([5])], [torch.zeros(2, 3).long()]):
        with pytest.raises(MoeprepError):
            kl_sweep(model, adapter, seqs, low)
    with pytest.raises(MoeprepError, match="does not fit"):
        kl_sweep(model, adapter, random_sequences(1, 5), low, done={0: [0.0]})


# --- trace pre-rank ------------------------------------------------------------------------------


def recorded(model, adapter, seqs):
    """Per MoE layer position: lists of per-sequence router inputs, expert ids, expert weights."""
    inputs, ids, weights = ([[] for _ in adapter.moe_layers] for _ in range(3))
    with RoutingRecorder(model, adapter) as rec, torch.no_grad():
        for s in seqs:
            model(input_ids=s.view(1, -1), use_cache=False)
            got = rec.pop()
            for p, layer in enumerate(adapter.moe_layers):
                inputs[p].append(got[f"layers.{layer}.router_input"])
                ids[p].append(got[f"layers.{layer}.expert_ids"])
                weights[p].append(got[f"layers.{layer}.expert_weights"])
    return inputs, ids, weights


@pytest.mark.parametrize("arch", ["deepseek_v2", "gpt_oss"])
def test_trace_prerank_equals_token_loop(arch):
    model = tiny(arch)
    adapter = get_adapter(model)
    inputs, ids, weights = recorded(model, adapter, random_sequences(2, 8, seed=3))
    base = lambda layer, e: adapter.get_expert(model, layer, e)  # noqa: E731
    low = low_of(model, adapter)
    got = trace_prerank(adapter, base, low, inputs, ids, weights)
    want = [[0.0] * adapter.num_experts for _ in adapter.moe_layers]
    for p, layer in enumerate(adapter.moe_layers):
        x, i, w = (torch.cat(v[p]) for v in (inputs, ids, weights))
        for t in range(x.shape[0]):
            for k in range(i.shape[1]):
                e = int(i[t, k])
                d = adapter.expert_forward(base(layer, e), x[t:t + 1]) - adapter.expert_forward(low(layer, e), x[t:t + 1])
                want[p][e] += float(w[t, k]) ** 2 * float((d ** 2).sum())
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-9)
    assert max(max(r) for r in got) > 0
    # Tensors per layer work as well as lists, and low == base scores zero.
    cat = [[torch.cat(v[p]) for p in range(len(adapter.moe_layers))] for v in (inputs, ids, weights)]
    assert trace_prerank(adapter, base, low, *cat) == got
    assert trace_prerank(adapter, base, base, *cat) == [[0.0] * adapter.num_experts for _ in adapter.moe_layers]
    with pytest.raises(MoeprepError):
        trace_prerank(adapter, base, low, cat[0][:1], cat[1][:1], cat[2][:1])


# --- spearman ------------------------------------------------------------------------------------


def brute_spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):  # 1 + number below + half the number of others equal
        return [1 + sum(y < x for y in v) + (sum(y == x for y in v) - 1) / 2 for x in v]

    ra, rb = torch.tensor(ranks(a), dtype=torch.float64), torch.tensor(ranks(b), dtype=torch.float64)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def test_spearman_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        # Few distinct values: many ties.
        a = torch.randint(0, 4 if trial % 2 else 1000, (3, 5), generator=gen).double()
        b = (a + torch.randint(0, 3, (3, 5), generator=gen)).double()
        if a.unique().numel() < 2 or b.unique().numel() < 2:
            continue
        assert spearman(a.tolist(), b.tolist()) == pytest.approx(brute_spearman(a.flatten().tolist(),
                                                                                b.flatten().tolist()), abs=1e-12)
    # Without ties: the textbook 1 - 6 sum d^2 / (n (n^2 - 1)).
    a, b = [[3.0, 1.0], [2.0, 5.0]], [[1.0, 2.0], [3.0, 4.0]]
    d2 = sum(d * d for d in (3 - 1, 1 - 2, 2 - 3, 4 - 4))
    assert spearman(a, b) == pytest.approx(1 - 6 * d2 / (4 * 15))
    assert spearman([[1, 2, 3]], [[10, 20, 30]]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(MoeprepError):
        spearman([[1, 2], [3]], [[1], [2, 3]])
