"""Benchmark data from one of three sources, detected from what is there; nothing is downloaded.

- a directory in the reference suites' layout: ``gsm8k.jsonl``, ``mmlu.jsonl``, ``truthfulqa.jsonl``
  (Hugging Face schemas), optional few-shot files ``gsm8k_fewshot.jsonl``, ``gsm8k_cot_fewshot.jsonl``
  and ``mmlu_dev.jsonl``;
- a directory in the original files' layout (as ``../shared/data/benchmarks``): ``gsm8k/test.jsonl``
  (+ ``train.jsonl`` for the 5-shot ``gsm8k`` exemplars), ``mmlu/{dev,test}/<subject>_{dev,test}.csv``,
  ``truthfulqa/mc_task.json``;
- a Hugging Face dataset id prefix is not guessed: ``hf:`` sources load ``openai/gsm8k``, ``cais/mmlu``
  and ``truthfulqa/truthful_qa`` with ``datasets`` when the hub (or its cache) is reachable.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from prep.errors import MoeprepError
from prep.evals.suites import read_jsonl

SUITES = ("gsm8k", "mmlu", "truthfulqa")


@dataclass
class BenchmarkData:
    """Test items per suite and the few-shot pools the prompts draw from."""

    source: str
    layout: str
    items: dict[str, list[dict]] = field(default_factory=dict)
    gsm8k_shots: list[dict] = field(default_factory=list)  # {question, answer} for the 5-shot gsm8k
    gsm8k_cot_shots: list[dict] | None = None  # {question, cot}; None: the harness's fixed eight
    mmlu_dev: dict[str, list[dict]] = field(default_factory=dict)  # subject -> dev items


def _mmlu_csv(path: Path, subject: str) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if rows and rows[0][:2] == ["question", "choice0"]:
        rows = rows[1:]
    items = []
    for row in rows:
        if len(row) != 6:
            raise MoeprepError(f"{path}: a row has {len(row)} fields, 6 expected (question, 4 choices, answer)")
        answer = row[5].strip()
        index = "ABCD".index(answer) if answer in "ABCD" and answer else int(answer)
        items.append({"question": row[0], "subject": subject, "choices": row[1:5], "answer": index})
    return items


def _truthfulqa_mc_task(path: Path) -> list[dict]:
    """mc_task.json (answers as dict keys) -> HF multiple_choice schema, keeping the key order."""
    items = []
    for row in json.loads(path.read_text(encoding="utf-8")):
        items.append({
            "question": row["question"],
            "mc1_targets": {"choices": list(row["mc1_targets"]), "labels": list(row["mc1_targets"].values())},
            "mc2_targets": {"choices": list(row["mc2_targets"]), "labels": list(row["mc2_targets"].values())},
        })
    return items


def _load_reference_layout(root: Path, suites: tuple[str, ...]) -> BenchmarkData:
    data = BenchmarkData(str(root), "reference")
    for suite in suites:
        path = root / f"{suite}.jsonl"
        if not path.is_file():
            raise MoeprepError(f"{root} has no {suite}.jsonl; drop {suite} from --suites or add the file")
        data.items[suite] = read_jsonl(path)
    if (root / "gsm8k_fewshot.jsonl").is_file():
        data.gsm8k_shots = read_jsonl(root / "gsm8k_fewshot.jsonl")
    if (root / "gsm8k_cot_fewshot.jsonl").is_file():
        data.gsm8k_cot_shots = read_jsonl(root / "gsm8k_cot_fewshot.jsonl")
    if (root / "mmlu_dev.jsonl").is_file():
        for item in read_jsonl(root / "mmlu_dev.jsonl"):
            data.mmlu_dev.setdefault(item["subject"], []).append(item)
    return data


def _load_original_layout(root: Path, suites: tuple[str, ...]) -> BenchmarkData:
    data = BenchmarkData(str(root), "original")
    if "gsm8k" in suites:
        test = root / "gsm8k" / "test.jsonl"
        if not test.is_file():
            raise MoeprepError(f"{test} is missing; the original layout needs gsm8k/test.jsonl")
        data.items["gsm8k"] = read_jsonl(test)
        if (root / "gsm8k" / "train.jsonl").is_file():
            data.gsm8k_shots = read_jsonl(root / "gsm8k" / "train.jsonl")[:5]  # the harness takes the first
    if "mmlu" in suites:
        tests = sorted((root / "mmlu" / "test").glob("*_test.csv"))
        if not tests:
            raise MoeprepError(f"{root / 'mmlu' / 'test'} holds no <subject>_test.csv files")
        data.items["mmlu"] = []
        for path in tests:
            subject = path.name.removesuffix("_test.csv")
            data.items["mmlu"] += _mmlu_csv(path, subject)
            dev = root / "mmlu" / "dev" / f"{subject}_dev.csv"
            if dev.is_file():
                data.mmlu_dev[subject] = _mmlu_csv(dev, subject)
    if "truthfulqa" in suites:
        path = root / "truthfulqa" / "mc_task.json"
        if not path.is_file():
            raise MoeprepError(f"{path} is missing; the original layout needs truthfulqa/mc_task.json")
        data.items["truthfulqa"] = _truthfulqa_mc_task(path)
    return data


def _load_hub(source: str, suites: tuple[str, ...]) -> BenchmarkData:
    import datasets

    data = BenchmarkData(source, "hub")
    try:
        if "gsm8k" in suites:
            data.items["gsm8k"] = list(datasets.load_dataset("openai/gsm8k", "main", split="test"))
            data.gsm8k_shots = list(datasets.load_dataset("openai/gsm8k", "main", split="train"))[:5]
        if "mmlu" in suites:
            data.items["mmlu"] = list(datasets.load_dataset("cais/mmlu", "all", split="test"))
            for item in datasets.load_dataset("cais/mmlu", "all", split="dev"):
                data.mmlu_dev.setdefault(item["subject"], []).append(item)
        if "truthfulqa" in suites:
            data.items["truthfulqa"] = list(datasets.load_dataset("truthfulqa/truthful_qa", "multiple_choice",
                                                                  split="validation"))
    except Exception as e:  # no network: datasets raises several kinds
        raise MoeprepError(f"cannot load the benchmarks from the hub ({type(e).__name__}); pass --data with a "
                           "local directory (reference layout or ../shared/data/benchmarks layout)") from None
    return data


def load_benchmarks(source: str | Path, suites: tuple[str, ...] = SUITES) -> BenchmarkData:
    """The items of ``suites`` from ``source`` (a directory, or ``hf:`` for the hub)."""
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise MoeprepError(f"unknown suite {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if str(source).startswith("hf:"):
        return _load_hub(str(source), suites)
    root = Path(source)
    if not root.is_dir():
        raise MoeprepError(f"benchmark data {root} is not a directory; pass a reference-suites directory, "
                           "a directory like ../shared/data/benchmarks, or hf: for the hub")
    if any((root / f"{s}.jsonl").is_file() for s in suites):
        return _load_reference_layout(root, suites)
    if any((root / s).is_dir() for s in suites):
        return _load_original_layout(root, suites)
    raise MoeprepError(f"{root} holds neither <suite>.jsonl files nor gsm8k/, mmlu/, truthfulqa/ folders")
