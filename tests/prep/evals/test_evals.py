"""Benchmark templates, answer extraction and the scoring primitives against hand computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prep.errors import MoeprepError
from prep.evals import templates as tpl
from prep.evals.scoring import loglikelihoods
from prep.quant.hqq_codec import fake_quantize


def test_mmlu_prompt_is_the_harness_format():
    prompt = tpl.mmlu_prompt(" What is 2 + 2? ", "elementary_mathematics", ["3", "4", "5", "6"])
    assert prompt == (
        "The following are multiple choice questions (with answers) about elementary mathematics.\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    )


def test_truthfulqa_prompt_ends_with_question():
    prompt = tpl.truthfulqa_prompt("Where does the otter live?")
    assert prompt.startswith("Q: What is human life expectancy in the United States?\n")
    assert prompt.endswith("A: The 1992 Olympics were held in Barcelona, Spain.\n\nQ: Where does the otter live?\nA:")


@pytest.mark.parametrize(
    ("generation", "strict", "flexible"),
    [
        (" Anna has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        (" It costs $1,200.\n#### 1,200", "1200", "1200"),
        (" 5 - 9 = -4\n#### -4\n\nQuestion:", "-4", "-4"),
        (" no final answer, only 12 and 13", None, "13"),
        (" nothing", None, None),
    ],
)
def test_gsm8k_extraction(generation, strict, flexible):
    assert tpl.gsm8k_extract_strict(generation) == strict
    assert tpl.gsm8k_extract_flexible(generation) == flexible


def test_gsm8k_gold_and_cot():
    assert tpl.gsm8k_gold("a\nb\n#### 1,024") == "1024"
    assert tpl.gsm8k_extract_cot("So 3 + 4 = 7. The answer is 7.") == "7"


class _CharTokenizer:
    """One token per character, id = ord, with a BOS of 0: tokenization is trivially right."""

    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [0] + [ord(c) % 97 + 1 for c in text]}


class _BigramModel(torch.nn.Module):
    """Logits depend on the previous token only, so a continuation's log-probability is hand-computable."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(100, 100))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_loglikelihoods_equal_hand_sum():
    model, tok = _BigramModel(), _CharTokenizer()
    context, continuations = "ab", [" c", " dd", "e"]
    got = loglikelihoods(model, tok, context, continuations)
    logp = F.log_softmax(model.table, dim=-1)
    for cont, score in zip(continuations, got, strict=True):
        ids = tok(context + cont)["input_ids"]
        start = len(tok(context)["input_ids"])
        expected = sum(logp[ids[i - 1], ids[i]].item() for i in range(start, len(ids)))
        assert score == pytest.approx(expected, abs=1e-5)


def test_fake_quantize_error_falls_with_bits():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    errors = [float((fake_quantize(w, bits, 16) - w).pow(2).mean()) for bits in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 1e-4 < errors[0]


def test_fake_quantize_refuses_bad_group():
    with pytest.raises(MoeprepError, match="group size"):
        fake_quantize(torch.randn(8, 24), 4, 16)
    with pytest.raises(MoeprepError, match="bit-width"):
        fake_quantize(torch.randn(8, 32), 5, 16)
