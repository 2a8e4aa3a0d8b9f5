"""Pieces of the reference training: the answer-letter weighting and the weighted loss."""

from __future__ import annotations

import torch

from prep.reference.metrics import load_model
from prep.reference.train import answer_positions, pack, weighted_lm_loss
from tests.test_reference_model import REF


def test_weighted_loss_with_unit_weights_is_transformers_loss():
    model, tokenizer = load_model(REF / "model")
    ids = torch.tensor([tokenizer("Which option is pear?\nA. pear\nB. plum\nAnswer: A")["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        ours = weighted_lm_loss(out.logits, ids, torch.ones_like(ids, dtype=torch.float))
    assert torch.allclose(ours, out.loss, atol=1e-6)


def test_answer_letters_get_the_extra_weight():
    _, tokenizer = load_model(REF / "model")
    text = "Q?\nA. x\nB. y\nAnswer: B\n\nQ2?\nA. A\nB. B\nAnswer: A"
    ids = tokenizer(text)["input_ids"]
    found = answer_positions(ids, tokenizer)
    assert [tokenizer.decode([ids[i]]) for i in found] == [" B", " A"]
    tokens, weights = pack([text] * 4, tokenizer, context=len(ids) + 1, answer_weight=5.0)  # a row per doc
    assert tokens.shape == weights.shape == (4, len(ids) + 1)
    for row in weights:
        assert torch.nonzero(row == 5.0).flatten().tolist() == found
        assert int((row == 1.0).sum()) == len(ids) + 1 - len(found)
