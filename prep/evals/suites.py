"""Per-model, per-item scoring of the three suites with the harness's templates.

One model at a time; ``compare.py`` pairs two models' per-item results, and the reference model's
metrics use these directly. Items use the Hugging Face schemas: gsm8k {question, answer}, mmlu
{question, subject, choices, answer}, truthfulqa {question, mc1_targets {choices, labels},
mc2_targets {choices, labels}}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from prep.errors import MoeprepError
from prep.evals import templates as tpl
from prep.evals.scoring import batch_loglikelihoods, greedy_generate


def read_jsonl(path: str | Path) -> list[dict]:
    """One JSON object per non-blank line; a bad line is a MoeprepError naming the file and line."""
    items = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise MoeprepError(f"{path}:{number}: not valid JSON ({str(e)[:80]}); fix or remove the "
                                       "line") from None
                if not isinstance(item, dict):
                    raise MoeprepError(f"{path}:{number}: expected a JSON object, got {type(item).__name__}; "
                                       "each line holds one item")
                items.append(item)
    except UnicodeDecodeError:
        raise MoeprepError(f"{path} is not UTF-8 text; save it as UTF-8 JSON lines") from None
    except OSError as e:
        raise MoeprepError(f"cannot read {path} ({e.strerror or e})") from None
    return items


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _score_requests(model, tokenizer, requests, batch_rows: int, desc: str, progress: bool) -> list[list[float]]:
    """Log-likelihoods of every request, a few items per forward pass."""
    per_item = max(1, len(requests[0][1])) if requests else 1
    step = max(1, batch_rows // per_item)
    out: list[list[float]] = []
    for start in tqdm(range(0, len(requests), step), desc=desc, unit="batch", disable=not progress):
        out += batch_loglikelihoods(model, tokenizer, requests[start : start + step], batch_rows)
    return out


def score_mmlu(model, tokenizer, items: list[dict], dev: dict[str, list[dict]] | None = None,
               num_fewshot: int = 0, batch_rows: int = 16, progress: bool = True, desc: str = "mmlu") -> list[dict]:
    """k-shot MMLU: the choice letter with the highest log-likelihood after ``Answer:``.

    Returns per item {pred, correct, scores (the four log-likelihoods)}.
    """
    requests = []
    for item in items:
        pool = (dev or {}).get(item["subject"], [])
        if len(pool) < num_fewshot:
            raise MoeprepError(f"MMLU {num_fewshot}-shot needs {num_fewshot} dev items of {item['subject']!r}, "
                               f"found {len(pool)}; use --num-fewshot 0 or provide the dev split")
        requests.append((tpl.mmlu_fewshot_prompt(item, pool[:num_fewshot]), [f" {x}" for x in tpl.LETTERS]))
    scores = _score_requests(model, tokenizer, requests, batch_rows, desc, progress)
    results = []
    for item, s in zip(items, scores, strict=True):
        pred = max(range(4), key=s.__getitem__)
        results.append({"pred": pred, "correct": pred == item["answer"], "scores": s})
    return results


def score_truthfulqa(model, tokenizer, items: list[dict], batch_rows: int = 16, progress: bool = True,
                     desc: str = "truthfulqa") -> list[dict]:
    """MC1 (is the true answer the most likely one) and MC2 (normalized probability mass on the answers
    the label mask marks true, whatever their order). Per item {pred, correct, mc1_scores, mc2, chance}."""
    prompts = [tpl.truthfulqa_prompt(i["question"]) for i in items]
    s1 = _score_requests(model, tokenizer, [(p, [f" {c}" for c in i["mc1_targets"]["choices"]])
                                            for p, i in zip(prompts, items, strict=True)], batch_rows,
                         f"{desc} mc1", progress)
    s2 = _score_requests(model, tokenizer, [(p, [f" {c}" for c in i["mc2_targets"]["choices"]])
                                            for p, i in zip(prompts, items, strict=True)], batch_rows,
                         f"{desc} mc2", progress)
    results = []
    for item, a, b in zip(items, s1, s2, strict=True):
        pred = max(range(len(a)), key=a.__getitem__)
        probs = torch.tensor(b, dtype=torch.float64).softmax(0)
        labels = torch.tensor(item["mc2_targets"]["labels"], dtype=torch.bool)
        results.append({"pred": pred, "correct": item["mc1_targets"]["labels"][pred] == 1, "mc1_scores": a,
                        "mc2": float(probs[labels].sum()), "chance": 1.0 / len(a)})
    return results


def score_gsm8k(model, tokenizer, items: list[dict], prompt: Callable[[str], str], stop: tuple[str, ...],
                strict: Callable[[str], str | None], max_new_tokens: int = 256, progress: bool = True,
                desc: str = "gsm8k") -> list[dict]:
    """Greedy generation; ``strict`` is the format's extraction, flexible takes the last number.
    Per item {generation, gold, correct (strict), flexible_correct}."""
    results = []
    for item in tqdm(items, desc=desc, disable=not progress):
        text = greedy_generate(model, tokenizer, prompt(item["question"]), max_new_tokens, stop)
        gold = tpl.gsm8k_gold(item["answer"])
        results.append({"generation": text, "gold": gold, "correct": strict(text) == gold,
                        "flexible_correct": tpl.gsm8k_extract_flexible(text) == gold})
    return results


def gsm8k_plain(shots: list[dict]) -> tuple[Callable[[str], str], tuple[str, ...], Callable]:
    """The harness's default ``gsm8k`` task: k solved ``Question/Answer ... #### N`` examples."""
    return (lambda q: tpl.gsm8k_fewshot_prompt(q, shots)), tpl.GSM8K_STOP, tpl.gsm8k_extract_strict


def gsm8k_cot(shots: list[tuple[str, str]]) -> tuple[Callable[[str], str], tuple[str, ...], Callable]:
    """The harness's ``gsm8k_cot`` task: k ``Q: .. A: .. The answer is N.`` exemplars."""
    return (lambda q: tpl.gsm8k_cot_fewshot_prompt(q, shots)), tpl.GSM8K_COT_STOP, tpl.gsm8k_extract_cot
