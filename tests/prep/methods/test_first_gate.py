"""AdapMoE's first-layer gate: the causal pairing learns a next-token routing the printed slicing cannot,
pairs stay inside sequences, the loss is KL(teacher || student), and the metrics match brute force."""

from __future__ import annotations

import math

import pytest
import torch

from prep.errors import MoeprepError
from prep.methods.first_gate import (
    first_gate_data,
    gate_pairs,
    kl_teacher_student,
    marginal_logits,
    prediction_metrics,
    train_first_gate,
)
from tests.helpers.tiny_models import ARCHITECTURES

H, E = 16, 8


def _synthetic(num_sequences: int, length: int, seed: int):
    """Sequences where the first layer's routing at p + 1 is a sharp linear function of the input at p
    (and the input at p + 1 is fresh noise, so it says nothing about the routing at p)."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(E, H, generator=torch.Generator().manual_seed(99)) * 3
    inputs, teachers = [], []
    for _ in range(num_sequences):
        x = torch.randn(length, H, generator=gen)
        teacher = torch.empty(length, E)
        teacher[0] = torch.randn(E, generator=gen)
        teacher[1:] = x[:-1] @ mixing.T
        inputs.append(x)
        teachers.append(teacher)
    return inputs, teachers


def test_the_causal_pairing_trains_to_near_zero_and_the_printed_slicing_does_not():
    train_in, train_teacher = _synthetic(24, 48, seed=0)
    held_in, held_teacher = _synthetic(6, 48, seed=1)
    results = {}
    for pairing in ("causal", "as_printed"):
        x, y = gate_pairs(train_in, train_teacher, pairing)
        hx, hy = gate_pairs(held_in, held_teacher, pairing)
        results[pairing] = train_first_gate(x, y, hx, hy, k=2, lr=3e-2, batch_size=256, max_epochs=150, patience=15)
    causal, printed = results["causal"], results["as_printed"]
    assert causal.held_out["kl"] < 0.05 and causal.held_out["top1"] > 0.95
    assert printed.held_out["kl"] > 20 * causal.held_out["kl"]
    assert printed.held_out["top1"] < 0.5  # no better than guessing from a constant
    assert causal.held_out["top2_recall"] > causal.marginal["top2_recall"]


def test_pairs_never_cross_a_sequence_boundary():
    a = torch.arange(4.0).view(4, 1).expand(4, 3)
    b = 10 + torch.arange(3.0).view(3, 1).expand(3, 3)
    ta, tb = 100 + a[:, :2], 100 + b[:, :2]
    x, y = gate_pairs([a, b], [ta, tb])
    assert x[:, 0].tolist() == [0, 1, 2, 10, 11]  # inputs at p
    assert y[:, 0].tolist() == [101, 102, 103, 111, 112]  # teachers at p + 1, same sequence
    x, y = gate_pairs([a, b], [ta, tb], "as_printed")
    assert x[:, 0].tolist() == [1, 2, 3, 11, 12] and y[:, 0].tolist() == [100, 101, 102, 110, 111]


def test_the_loss_is_kl_of_teacher_against_student():
    gen = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(5, E, generator=gen), torch.randn(5, E, generator=gen)
    expected = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist(), strict=True):
        zs, zt = sum(math.exp(v) for v in s_row), sum(math.exp(v) for v in t_row)
        p = [math.exp(v) / zt for v in t_row]
        q = [math.exp(v) / zs for v in s_row]
        expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert float(kl_teacher_student(student, teacher)) == pytest.approx(expected / 5, rel=1e-5)


def test_metrics_match_brute_force():
    gen = torch.Generator().manual_seed(4)
    student, teacher = torch.randn(50, E, generator=gen), torch.randn(50, E, generator=gen)
    got = prediction_metrics(student, teacher, k=3)
    top1 = sum(max(range(E), key=lambda e: s[e]) == max(range(E), key=lambda e: t[e])
               for s, t in zip(student.tolist(), teacher.tolist(), strict=True)) / 50
    recall = 0.0
    for s, t in zip(student.tolist(), teacher.tolist(), strict=True):
        ps = set(sorted(range(E), key=lambda e: -s[e])[:3])
        ts = set(sorted(range(E), key=lambda e: -t[e])[:3])
        recall += len(ps & ts) / 3
    assert got["top1"] == pytest.approx(top1) and got["top3_recall"] == pytest.approx(recall / 50)
    baseline = marginal_logits(teacher, 4)
    assert torch.allclose(baseline.exp().sum(-1), torch.ones(4))  # a distribution per row
    assert torch.equal(baseline[0], baseline[3])  # the same for every row


def test_training_keeps_its_best_held_out_weights():
    train_in, train_teacher = _synthetic(8, 32, seed=5)
    held_in, held_teacher = _synthetic(2, 32, seed=6)
    x, y = gate_pairs(train_in, train_teacher)
    hx, hy = gate_pairs(held_in, held_teacher)
    seen = []
    gate = train_first_gate(x, y, hx, hy, k=2, lr=5e-2, max_epochs=30, patience=3,
                            on_epoch=lambda epoch, kl: seen.append(kl))
    assert gate.held_out["kl"] == pytest.approx(min([float(kl_teacher_student(hx @ torch.zeros(E, H).T, hy)), *seen]),
                                                rel=1e-5)
    assert gate.weight.shape == (E, H) and gate.epochs == len(seen) and gate.init == "zeros"
    again = train_first_gate(x, y, hx, hy, k=2, init=gate.weight, lr=5e-2, max_epochs=2)
    assert again.init == "given" and again.held_out["kl"] <= gate.held_out["kl"] + 1e-6


def test_bad_input_is_one_clear_error():
    x = torch.zeros(4, H)
    with pytest.raises(MoeprepError, match="pairing 'reversed' unknown"):
        gate_pairs([x], [torch.zeros(4, E)], "reversed")
    with pytest.raises(MoeprepError, match="same T"):
        gate_pairs([x], [torch.zeros(3, E)])
    with pytest.raises(MoeprepError, match="init weights must be"):
        train_first_gate(x, torch.zeros(4, E), x, torch.zeros(4, E), k=2, init=torch.zeros(E, H + 1))
    with pytest.raises(MoeprepError, match="k must be in"):
        prediction_metrics(torch.zeros(2, E), torch.zeros(2, E), k=E + 1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_training_data_is_what_the_head_reads_and_the_first_router_decides(arch):
    from prep.adapters import get_adapter
    from tests.helpers.tiny_models import build_tiny_model, random_sequences

    model = build_tiny_model(arch).eval()
    adapter = get_adapter(model)
    sequences = random_sequences(2, 9, seed=7)
    inputs, teachers = first_gate_data(model, adapter, sequences)
    block = adapter.moe_block(model, adapter.moe_layers[0])
    seen = []
    hook = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        with torch.no_grad():
            for seq, x, teacher in zip(sequences, inputs, teachers, strict=True):
                logits = model(input_ids=seq.view(1, -1), use_cache=False).logits[0]
                assert x.shape == (len(seq), model.config.hidden_size) and teacher.shape == (len(seq), adapter.num_experts)
                head = model.get_output_embeddings()
                assert torch.allclose(head(x), logits, atol=1e-5)  # the head's input: final-normed
                routed, ids, _ = adapter.route(model, adapter.moe_layers[0], seen[-1])
                assert torch.allclose(teacher, routed.float(), atol=1e-5)
                assert torch.equal(adapter.select_experts(teacher)[0].long().sort(-1).values, ids.sort(-1).values)
    finally:
        hook.remove()
