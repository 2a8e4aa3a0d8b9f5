"""Pieces of the reference training: the answer-letter weighting, the weighted loss and the attention hints."""

from __future__ import annotations

from pathlib import Path

import torch

from prep.reference.metrics import gaussian_noise, load_model, perturb_experts, quantize_all_experts
from prep.reference.train import (
    ARITHMETIC_HINTS,
    HINTS,
    ReferenceSpec,
    answer_positions,
    attention_hints,
    hint_loss,
    learning_rate,
    pack,
    query_log_attention,
    weighted_lm_loss,
)
from tests.helpers.tiny_models import tiny_mixtral

REF = Path(__file__).resolve().parents[3] / "recipes" / "reference"


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
    packed = pack([text] * 4, tokenizer, context=len(ids) + 1, answer_weight=5.0)  # a row per doc
    tokens, weights = packed["tokens"], packed["weights"]
    assert tokens.shape == weights.shape == (4, len(ids) + 1)
    for row in weights:
        assert torch.nonzero(row == 5.0).flatten().tolist() == found
        assert int((row == 1.0).sum()) == len(ids) + 1 - len(found)


def test_result_digits_get_the_digit_weight():
    _, tokenizer = load_model(REF / "model")
    text = "Tom has 5 + 17 = 22 cards.\n7 * 8 = 56"
    ids = tokenizer(text)["input_ids"]
    row = pack([text], tokenizer, context=len(ids) + 1, digit_weight=4.0)["weights"][0]
    heavy = [tokenizer.decode([ids[i]]) for i in torch.nonzero(row == 4.0).flatten().tolist()]
    assert heavy == ["2", "2", "5", "6"]  # the digits after "=", nothing else
    assert int((row == 1.0).sum()) == len(ids) + 1 - 4


ITEM = ("About chemistry.\n\nWhat is the chemical symbol of copper?\nA. Pb\nB. Si\nC. salamander\nD. Ar\nAnswer: C\n\n"
        "A. pear\nB. fig tree\nC. x\nD. y\nWhich option is fig tree?\nAnswer: B")


def _hinted(tokenizer, text: str) -> dict[str, dict[str, list[str]]]:
    """hint -> {token at the query (with its index): the tokens of its target span}."""
    ids, spans = attention_hints(text, tokenizer)
    toks = tokenizer.convert_ids_to_tokens(ids)
    return {name: {f"{i}{toks[i]}": toks[lo:hi] for i, (lo, hi) in enumerate(spans[name]) if lo >= 0}
            for name in HINTS}


def test_choice_hints_point_at_the_letter_the_question_and_the_right_option():
    _, tokenizer = load_model(REF / "model")
    hinted = _hinted(tokenizer, ITEM)
    ids = tokenizer(ITEM)["input_ids"]
    assert attention_hints(ITEM, tokenizer)[0] == ids
    toks = tokenizer.convert_ids_to_tokens(ids)
    first_colon, second_colon = [f"{i}:" for i, t in enumerate(toks) if t == ":"]
    marks = [f"{i}?" for i, t in enumerate(toks) if t == "?"]
    assert hinted["answer"] == {first_colon: ["Ġsalamander"], second_colon: ["Ġf", "ig", "Ġt", "re", "e"]}
    assert hinted["question"] == {first_colon: ["?"], second_colon: ["?"]}
    assert hinted["subject"] == {marks[0]: ["Ġcopper"], marks[1]: ["e"]}
    letters = {k: v for k, v in hinted["letter"].items()}
    assert [v for k, v in letters.items() if k.endswith("Pb") or k.endswith("salamander")] == [["A"], ["C"]]
    assert sum(v == ["B"] for v in letters.values()) == 1 + 5  # "Si", and the five pieces of "fig tree"
    assert len(letters) == 4 + 8
    # option words look at the question's "?" only where the question comes first
    assert len(hinted["option"]) == 4 and all(v == ["?"] for v in hinted["option"].values())


def test_no_hints_without_a_full_block_or_an_answer():
    _, tokenizer = load_model(REF / "model")
    assert all(not v for v in _hinted(tokenizer, "Q?\nA. x\nB. y\nAnswer: B").values())  # two options
    hinted = _hinted(tokenizer, "Q?\nA. w\nB. x\nC. y\nD. z\nAnswer:")  # a prompt: options, no answer
    assert len(hinted["letter"]) == 4 and not hinted["answer"] and not hinted["question"]


def test_pack_keeps_hint_spans_within_their_row():
    _, tokenizer = load_model(REF / "model")
    ids, spans = attention_hints(ITEM, tokenizer)
    n = len(ids) + 1
    one_row = pack([ITEM] * 2, tokenizer, context=n)
    for name in HINTS:
        want = torch.tensor([lo for lo, _ in spans[name]] + [-1])
        assert torch.equal(one_row[f"{name}_lo"][1], want)
        assert torch.equal(one_row[f"{name}_hi"][1], torch.tensor([hi for _, hi in spans[name]] + [-1]))
    # rows of n - 3 tokens: row 1 starts at the last ``:`` of the first copy, whose targets lie in row 0,
    # then holds the second copy from index 3 on, whose targets keep their offsets (+3)
    shifted = pack([ITEM] * 2, tokenizer, context=n - 3)
    colon = len(ids) - 2
    assert tokenizer.convert_ids_to_tokens(int(shifted["tokens"][1, 0])) == ":" and spans["answer"][colon][0] >= 0
    assert shifted["answer_lo"][1, 0] == shifted["question_lo"][1, 0] == shifted["answer_hi"][1, 0] == -1
    mark = next(i for i, (lo, _) in enumerate(spans["subject"]) if lo >= 0)
    assert shifted["subject_lo"][1, mark + 3] == mark - 1 + 3


def test_arithmetic_hints_point_at_operand_digits_and_operators():
    _, tokenizer = load_model(REF / "model")
    hinted = _hinted(tokenizer, "Sam has 45 - 7 = 38 cards.\n3 * 8 = 24\nWhat is 37 + 8?")
    assert all(not v for name, v in hinted.items() if name not in ARITHMETIC_HINTS)
    ops = {k: v for k, v in hinted["operand_last"].items()}
    assert [(k[-1], v) for k, v in ops.items()] == [("-", ["5"]), ("=", ["7"]), ("*", ["3"]), ("=", ["8"])]
    assert [(k[-1], v) for k, v in hinted["operand_first"].items()] == [("-", ["4"])]  # the others have one digit
    # the tokens that predict a digit of the result: the space after "=", then every digit but the last
    assert [k[-1] for k in hinted["left_operand"]] == ["Ġ", "3", "Ġ", "2"]
    assert [v for v in hinted["left_operand"].values()] == [["Ġ-"], ["Ġ-"], ["Ġ*"], ["Ġ*"]]
    assert all(v == ["Ġ="] for v in hinted["right_operand"].values()) and len(hinted["right_operand"]) == 4


def test_query_log_attention_is_the_model_attention():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           attn_implementation="eager")
    model = MixtralForCausalLM(config).eval()
    seen = {}
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda _m, _a, kw: seen.update(x=(kw["hidden_states"], *kw["position_embeddings"])), with_kwargs=True)
    queries = (torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 5, 2, 3, 8]))
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (2, 9)), output_attentions=True)
        for head in range(4):
            ours = query_log_attention(model.model.layers[1].self_attn, *seen["x"], head, queries).exp()
            assert torch.allclose(ours, out.attentions[1][:, head][queries], atol=1e-6)


def test_learning_rate_warms_up_then_anneals_to_the_floor():
    spec = ReferenceSpec(lr=1e-3, warmup=10, steps=110, lr_floor=0.0)
    rates = [learning_rate(s, spec) for s in range(spec.steps)]
    assert rates[0] == 1e-4 and rates[9] == 1e-3 and rates[10] == 1e-3
    assert all(a >= b for a, b in zip(rates[10:], rates[11:], strict=False))
    assert 0 < rates[-1] < 1e-6 and abs(rates[60] - 0.5e-3) < 1e-12  # halfway down the cosine
    assert abs(learning_rate(109, ReferenceSpec(lr=1e-3, warmup=10, steps=110, lr_floor=0.1)) - 1e-4) < 1e-6


def test_hint_loss_is_minus_log_mass_in_the_span():
    logp = torch.randn(2, 5).log_softmax(-1)
    p = logp.exp()
    want = -(torch.log(p[0, 1:3].sum()) + torch.log(p[1, 0])) / 2
    assert torch.allclose(hint_loss(logp, torch.tensor([1, 0]), torch.tensor([3, 1])), want)


def test_zeroed_experts_make_every_moe_block_output_zero():
    model = tiny_mixtral()
    assert perturb_experts(model, torch.zeros_like) == 1.0
    outputs = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, 7)))
    assert len(outputs) == 2 and all(float(o.abs().max()) == 0.0 for o in outputs)


def test_gaussian_noise_has_the_asked_relative_size_and_is_seeded():
    model, again = tiny_mixtral(), tiny_mixtral()
    before = [p.clone() for p in model.parameters()]
    rel = perturb_experts(model, gaussian_noise(0.5, seed=3))
    assert abs(rel - 0.5) < 0.05  # |noise| / |w| = scale * std(w) / rms(w), and these weights are centred
    perturb_experts(again, gaussian_noise(0.5, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    changed = [name for (name, p), b in zip(model.named_parameters(), before, strict=True) if not torch.equal(p, b)]
    assert changed and all(".experts." in name for name in changed)


def test_int2_round_trip_error_is_what_quantize_all_experts_reports():
    from prep.quant.hqq_codec import fake_quantize

    model = tiny_mixtral()
    w = model.model.layers[0].mlp.experts.down_proj[1].detach().clone()
    rel = quantize_all_experts(model, nbits=2, group_size=16)
    assert 0.05 < rel < 0.6
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj[1], fake_quantize(w, 2, 16))
