"""The committed reference model: its shape, its suites, its held-out rule, and its metrics re-scored."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from prep.evals import suites as S
from prep.evals import templates as tpl
from prep.reference import data as D
from prep.reference.metrics import NOISE_LEVELS, TARGETS, load_model, quantize_all_experts
from prep.reference.train import ReferenceSpec

REF = Path(__file__).resolve().parents[3] / "recipes" / "reference"


@pytest.fixture(scope="module")
def reference():
    return load_model(REF / "model")


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((REF / "metrics.json").read_text())


@pytest.fixture(scope="module")
def suites() -> dict[str, list[dict]]:
    return {name: S.read_jsonl(REF / "suites" / f"{name}.jsonl") for name in ("gsm8k", "mmlu", "truthfulqa")}


def test_model_shape_and_size(reference):
    model, tokenizer = reference
    cfg = model.config
    assert type(model).__name__ == "MixtralForCausalLM"
    assert cfg.num_hidden_layers >= 4 and cfg.num_local_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.max_position_embeddings >= 1024
    weights = sum(p.stat().st_size for p in (REF / "model").glob("*.safetensors"))
    assert weights <= 50 * 2**20
    assert not list((REF / "model").glob("*.bin")) and not list((REF / "model").glob("*.pt"))
    assert tokenizer("Answer: A")["input_ids"][0] == tokenizer.bos_token_id


def test_suites_follow_hf_schemas(suites):
    for item in suites["gsm8k"]:
        assert set(item) == {"question", "answer"} and "####" in item["answer"]
    for item in suites["mmlu"]:
        assert set(item) == {"question", "subject", "choices", "answer"}
        assert len(item["choices"]) == 4 and item["answer"] in range(4)
    for item in suites["truthfulqa"]:
        assert set(item) == {"question", "mc1_targets", "mc2_targets"}
        assert item["mc1_targets"]["labels"].count(1) == 1
        assert len(item["mc2_targets"]["choices"]) == len(item["mc2_targets"]["labels"])
    assert all(len(rows) >= 200 for rows in suites.values())


def test_suites_are_regenerated_exactly_and_never_in_training(suites):
    """The committed suites are what the seed makes, and no suite item occurs in the training corpus."""
    spec = ReferenceSpec(**json.loads((REF / "training.json").read_text())["spec"])
    regenerated, split = D.make_suites(spec.seed, spec.suites)
    assert regenerated == suites
    docs = D.training_documents(spec.seed, split, spec.docs)
    corpus = "\n".join(text for domain, text in docs if domain != "code")
    for item in suites["gsm8k"]:
        assert item["question"] not in corpus
    fact_stems = {D.ask(f) for f in D.all_facts()}
    for item in suites["mmlu"]:
        if item["question"] in fact_stems or item["question"].startswith("What is "):
            assert f"{item['question']}\n" not in corpus, item["question"]
        else:
            assert D.mmlu_text(item, answer=False) not in corpus
    for item in suites["truthfulqa"]:
        assert item["question"] not in corpus
    # a reserved fact is still taught, as prose
    reserved = next(f for f in D.all_facts() if f.key in split.suite_facts)
    assert D.state(reserved) in corpus


def test_committed_model_was_trained_with_the_default_spec():
    """``make reference-model`` (the default ``ReferenceSpec``) is the recipe of the committed model."""
    from dataclasses import asdict

    committed = json.loads((REF / "training.json").read_text())["spec"]
    assert json.loads(json.dumps(asdict(ReferenceSpec()))) == committed


def test_drill_arithmetic_is_right_and_never_a_suite_sum(suites):
    """Every bare arithmetic line of the drills is correct, and none is a sum the mmlu suite asks."""
    spec = ReferenceSpec()
    _, split = D.make_suites(spec.seed, spec.suites)
    docs = D.training_documents(spec.seed, split, {**{d: 0 for d in D.DOMAINS}, "drills": 400})
    sums = [re.fullmatch(r"What is (\d+) \+ (\d+)\?", item["question"]) for item in suites["mmlu"]]
    asked = {(int(m[1]), int(m[2])) for m in sums if m}
    assert asked
    lines = [m.groups() for _, text in docs for m in re.finditer(r"(?m)^(\d+) ([-+*/]) (\d+) = (\d+)$", text)]
    assert len(lines) > 500
    for a, op, b, n in lines:
        a, b, n = int(a), int(b), int(n)
        expected = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        assert n == expected, (a, op, b, n)
        assert not (op == "+" and (a, b) in asked), (a, b)
    assert {op for _, op, _, _ in lines} == set("+-*/")


# Targets the committed model does not reach yet (still open work). Strict: once a retrained
# model meets one, its xfail turns into a failure and must be removed from this set.
NOT_YET_MET = {"int2_mmlu_drop"}


@pytest.mark.parametrize("key", sorted(TARGETS))
def test_metric_meets_target(metrics, key):
    if key in NOT_YET_MET:
        pytest.xfail(reason=f"target not met yet: {key} = {metrics[key]:.3f}, target {TARGETS[key]}")
    assert metrics[key] >= TARGETS[key], f"{key} = {metrics[key]} below {TARGETS[key]}"


def test_not_yet_met_targets_are_really_unmet(metrics):
    """Keeps NOT_YET_MET honest: a target the model reaches must be asserted, not excused."""
    met = sorted(k for k in NOT_YET_MET if metrics[k] >= TARGETS[k])
    assert not met, f"these targets are met now; remove them from NOT_YET_MET: {met}"


def test_every_mmlu_item_has_a_kind_and_kinds_add_up_to_the_accuracy(suites, metrics):
    """Each suite item's kind matches how it was made, and the per-kind accuracies (fp and INT2) are a
    partition of the overall ones."""
    spec = ReferenceSpec()
    _, split = D.make_suites(spec.seed, spec.suites)
    reserved = {D.ask(f) for f in D.all_facts() if f.key in split.suite_facts}
    kinds = [D.item_kind(item) for item in suites["mmlu"]]
    for item, kind in zip(suites["mmlu"], kinds, strict=True):
        assert (kind == "fact") == (item["question"] in reserved), item
        if kind in ("sum", "largest"):
            assert item["subject"] == "elementary_mathematics"
    counts = {k: kinds.count(k) for k in set(kinds)}
    assert set(counts) == {"fact", "category", "animal_class", "sum", "largest"}
    for overall, by_kind in (("mmlu_acc", "mmlu_acc_by_kind"), ("int2_mmlu_acc", "int2_mmlu_acc_by_kind")):
        total = sum(metrics[by_kind][k] * n for k, n in counts.items()) / len(kinds)
        assert total == pytest.approx(metrics[overall], abs=1e-9)


def test_routing_is_alive(metrics):
    layers = metrics["expert_share_per_layer"]
    assert min(min(row) for row in layers) >= 0.03
    assert max(metrics["domain_js_divergence_mean_over_layers"].values()) > 0.01


def test_mmlu_rests_on_the_experts_but_not_on_their_precision(reference, suites, metrics):
    """Why ``int2_mmlu_drop`` is hard to reach: without its experts the model is near chance (re-scored
    here with the MoE blocks silenced by hooks, not through ``perturb_experts``), yet expert noise larger
    than INT2's own error costs little."""
    model, tokenizer = reference
    hooks = [layer.mlp.register_forward_hook(
        lambda _m, _a, out: (torch.zeros_like(out[0]), *out[1:]) if isinstance(out, tuple) else torch.zeros_like(out))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            silenced = S.mean(r["correct"] for r in S.score_mmlu(model, tokenizer, suites["mmlu"], progress=False))
    finally:
        for h in hooks:
            h.remove()
    assert silenced == pytest.approx(metrics["experts_zeroed_mmlu_acc"], abs=1e-9)
    assert silenced <= metrics["mmlu_acc"] - 0.1
    assert set(metrics["expert_noise_mmlu_acc"]) == {str(s) for s in NOISE_LEVELS}
    assert 0.2 < metrics["int2_expert_relative_error"] < 0.4


# The sample ``make test`` re-scores item by item against ``metrics.json``'s ``correct_items``. Each item of a suite
# goes through the same scoring function (one template, one batch shape per item), so the first items exercise
# every line the whole suite does; the full re-scoring (every item, and the committed means) is ``make test-full``.
# 12 GSM8K items hold right and wrong answers of the plain model, and 40 MMLU and TruthfulQA items every subject.
SAMPLE = {"mmlu": 40, "truthfulqa": 40, "gsm8k": 12}


def _rescored(model, tokenizer, suites: dict, n: dict) -> dict[str, str]:
    """The per-item record (``item_record``) of the first ``n[suite]`` items of each suite."""
    from prep.reference.metrics import item_record

    shots = S.read_jsonl(REF / "suites" / "gsm8k_fewshot.jsonl")
    with torch.no_grad():
        return item_record(S.score_mmlu(model, tokenizer, suites["mmlu"][:n["mmlu"]], progress=False),
                           S.score_truthfulqa(model, tokenizer, suites["truthfulqa"][:n["truthfulqa"]],
                                              progress=False),
                           S.score_gsm8k(model, tokenizer, suites["gsm8k"][:n["gsm8k"]], *S.gsm8k_plain(shots),
                                         max_new_tokens=96, progress=False))


def test_the_committed_item_results_are_the_committed_accuracies(suites, metrics):
    """``correct_items`` holds one entry per suite item, and its means are the committed accuracies (fp and INT2)."""
    for which, prefix in (("fp", ""), ("int2", "int2_")):
        record = metrics["correct_items"][which]
        assert {name: len(v) for name, v in record.items()} == {name: len(rows) for name, rows in suites.items()}
        assert set("".join(record.values())) <= {"0", "1"}
        for suite, key in (("mmlu", "mmlu_acc"), ("truthfulqa", "truthfulqa_mc1"), ("gsm8k", "gsm8k_exact_match")):
            assert record[suite].count("1") / len(record[suite]) == pytest.approx(metrics[prefix + key], abs=1e-9)
    sample = metrics["correct_items"]["fp"]["gsm8k"][:SAMPLE["gsm8k"]]
    assert "0" in sample and "1" in sample  # the GSM8K sample scores right and wrong answers both


def test_a_sample_rescored_independently_equals_the_committed_items(reference, suites, metrics):
    """Plain transformers with the harness templates gives the committed result on every sampled item."""
    model, tokenizer = reference
    got = _rescored(model, tokenizer, suites, SAMPLE)
    assert got == {suite: metrics["correct_items"]["fp"][suite][:n] for suite, n in SAMPLE.items()}


def test_an_int2_sample_rescored_independently_equals_the_committed_items(reference, suites, metrics):
    """Every routed expert through the HQQ INT2 g16 round trip, then the sample re-scored: the committed INT2 result
    on every sampled item but at most one per suite, the slack of the full check (HQQ's optimizer runs on whatever
    CPU kernels this machine has)."""
    model, tokenizer = reference
    quantized = copy.deepcopy(model)
    assert quantize_all_experts(quantized, nbits=2, group_size=16) == pytest.approx(
        metrics["int2_expert_relative_error"], rel=1e-3)
    got = _rescored(quantized, tokenizer, suites, SAMPLE)
    for suite, n in SAMPLE.items():
        want = metrics["correct_items"]["int2"][suite][:n]
        assert sum(a != b for a, b in zip(got[suite], want, strict=True)) <= 1, (suite, got[suite], want)


@pytest.mark.slow
@pytest.mark.full
def test_metrics_rescored_independently(reference, suites, metrics):
    """Plain transformers with the harness templates reproduces the committed accuracies."""
    model, tokenizer = reference
    with torch.no_grad():
        mmlu = S.score_mmlu(model, tokenizer, suites["mmlu"], progress=False)
        tqa = S.score_truthfulqa(model, tokenizer, suites["truthfulqa"], progress=False)
    assert S.mean(r["correct"] for r in mmlu) == pytest.approx(metrics["mmlu_acc"], abs=1e-9)
    assert S.mean(r["correct"] for r in tqa) == pytest.approx(metrics["truthfulqa_mc1"], abs=1e-9)
    shots = S.read_jsonl(REF / "suites" / "gsm8k_fewshot.jsonl")
    gsm = S.score_gsm8k(model, tokenizer, suites["gsm8k"], *S.gsm8k_plain(shots), max_new_tokens=96,
                        progress=False)
    assert S.mean(r["correct"] for r in gsm) == pytest.approx(metrics["gsm8k_exact_match"], abs=1e-9)
    from prep.reference.metrics import item_record

    assert item_record(mmlu, tqa, gsm) == metrics["correct_items"]["fp"]  # and item by item


@pytest.mark.slow
@pytest.mark.full
def test_int2_metrics_rescored_independently(reference, suites, metrics):
    """Every routed expert through the HQQ INT2 g16 round trip, then the suites re-scored: the committed
    INT2 figures (MMLU, TruthfulQA, GSM8K) are what the quantized model scores. One item of slack, as
    HQQ's optimizer runs on whatever CPU kernels this machine has."""
    model, tokenizer = reference
    quantized = copy.deepcopy(model)
    assert quantize_all_experts(quantized, nbits=2, group_size=16) == pytest.approx(
        metrics["int2_expert_relative_error"], rel=1e-3)
    shots = S.read_jsonl(REF / "suites" / "gsm8k_fewshot.jsonl")
    with torch.no_grad():
        mmlu = S.score_mmlu(quantized, tokenizer, suites["mmlu"], progress=False)
        tqa = S.score_truthfulqa(quantized, tokenizer, suites["truthfulqa"], progress=False)
        gsm = S.score_gsm8k(quantized, tokenizer, suites["gsm8k"], *S.gsm8k_plain(shots), max_new_tokens=96,
                            progress=False)
    for results, key, n in ((mmlu, "int2_mmlu_acc", len(suites["mmlu"])),
                            (tqa, "int2_truthfulqa_mc1", len(suites["truthfulqa"])),
                            (gsm, "int2_gsm8k_exact_match", len(suites["gsm8k"]))):
        assert S.mean(r["correct"] for r in results) == pytest.approx(metrics[key], abs=1.01 / n), key


def test_gsm8k_prompt_matches_harness_format(suites):
    shots = S.read_jsonl(REF / "suites" / "gsm8k_fewshot.jsonl")
    prompt = tpl.gsm8k_fewshot_prompt(suites["gsm8k"][0]["question"], shots)
    assert prompt.count("Question: ") == len(shots) + 1
    assert prompt.endswith("\nAnswer:") and "\n\nQuestion: " in prompt


def test_greedy_generate_equals_a_plain_argmax_loop(reference, suites):
    """generate() with a KV cache and stop strings gives the argmax-per-step text, cut at the stop."""
    from prep.evals.scoring import greedy_generate

    model, tokenizer = reference
    shots = S.read_jsonl(REF / "suites" / "gsm8k_fewshot.jsonl")[:2]
    prompt = tpl.gsm8k_fewshot_prompt(suites["gsm8k"][1]["question"], shots)
    got = greedy_generate(model, tokenizer, prompt, 40, tpl.GSM8K_STOP)
    ids = tokenizer(prompt)["input_ids"]
    start = len(ids)
    with torch.no_grad():
        for _ in range(40):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            ids.append(nxt)
            if "Question:" in tokenizer.decode(ids[start:]):
                break
    expected = tokenizer.decode(ids[start:], skip_special_tokens=True).split("Question:")[0]
    assert got == expected
    assert "####" in got
