"""Scoring of the three suites with the harness's templates; per-item results so models can be paired.

Items use the Hugging Face schemas: gsm8k {question, answer}, mmlu {question, subject, choices, answer},
truthfulqa {question, mc1_targets {choices, labels}, mc2_targets {choices, labels}}.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

from prep.evals import templates as tpl
from prep.evals.scoring import greedy_generate, loglikelihoods


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def score_mmlu(model, tokenizer, items: list[dict], progress: bool = True) -> list[dict]:
    """0-shot MMLU: the choice letter with the highest log-likelihood after ``Answer:``."""
    results = []
    for item in tqdm(items, desc="mmlu", disable=not progress):
        prompt = tpl.mmlu_prompt(item["question"], item["subject"], item["choices"])
        scores = loglikelihoods(model, tokenizer, prompt, [f" {letter}" for letter in tpl.LETTERS])
        pred = max(range(4), key=scores.__getitem__)
        results.append({"pred": pred, "correct": pred == item["answer"]})
    return results


def score_truthfulqa(model, tokenizer, items: list[dict], progress: bool = True) -> list[dict]:
    """MC1 (is the true answer the most likely one) and MC2 (probability mass on the true answers)."""
    results = []
    for item in tqdm(items, desc="truthfulqa", disable=not progress):
        prompt = tpl.truthfulqa_prompt(item["question"])
        mc1 = item["mc1_targets"]
        s1 = loglikelihoods(model, tokenizer, prompt, [f" {c}" for c in mc1["choices"]])
        pred = max(range(len(s1)), key=s1.__getitem__)
        mc2 = item["mc2_targets"]
        s2 = loglikelihoods(model, tokenizer, prompt, [f" {c}" for c in mc2["choices"]])
        top = max(s2)
        probs = [math.exp(s - top) for s in s2]
        true_mass = sum(p for p, label in zip(probs, mc2["labels"], strict=True) if label)
        results.append({"pred": pred, "correct": mc1["labels"][pred] == 1, "mc2": true_mass / sum(probs),
                        "chance": 1.0 / len(mc1["choices"])})
    return results


def score_gsm8k(model, tokenizer, items: list[dict], shots: list[dict], max_new_tokens: int = 96,
                progress: bool = True) -> list[dict]:
    """k-shot gsm8k by greedy generation; strict match reads ``#### N``, flexible the last number."""
    results = []
    for item in tqdm(items, desc="gsm8k", disable=not progress):
        prompt = tpl.gsm8k_fewshot_prompt(item["question"], shots)
        text = greedy_generate(model, tokenizer, prompt, max_new_tokens, tpl.GSM8K_STOP)
        gold = tpl.gsm8k_gold(item["answer"])
        strict = tpl.gsm8k_extract_strict(text)
        flexible = tpl.gsm8k_extract_flexible(text)
        results.append({"generation": text, "gold": gold, "correct": strict == gold,
                        "flexible_correct": flexible == gold})
    return results


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
