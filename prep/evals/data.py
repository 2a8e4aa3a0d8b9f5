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


def _is_text(x) -> bool:
    return isinstance(x, str)


def _is_targets(x) -> bool:
    return (isinstance(x, dict) and isinstance(x.get("choices"), list) and isinstance(x.get("labels"), list)
            and len(x["choices"]) == len(x["labels"]) > 0 and all(map(_is_text, x["choices"]))
            and all(label in (0, 1) and not isinstance(label, float) for label in x["labels"]))


# the fields each kind of item needs, and what each must be
_SCHEMAS = {
    "gsm8k": {"question": _is_text, "answer": _is_text},
    "gsm8k_cot": {"question": _is_text, "cot": _is_text},
    "mmlu": {"question": _is_text, "subject": _is_text,
             "choices": lambda x: isinstance(x, list) and len(x) == 4 and all(map(_is_text, x)),
             "answer": lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 4},
    "truthfulqa": {"question": _is_text, "mc1_targets": _is_targets, "mc2_targets": _is_targets},
}
_SHAPES = {"gsm8k": "{question: str, answer: str}", "gsm8k_cot": "{question: str, cot: str}",
           "mmlu": "{question: str, subject: str, choices: 4 str, answer: 0-3}",
           "truthfulqa": "{question: str, mc1_targets and mc2_targets: {choices: [str], labels: [0|1]}}"}


def check_items(items: list[dict], kind: str, source: str | Path, allow_empty: bool = False) -> list[dict]:
    """``items`` of ``kind`` (a key of ``_SCHEMAS``) read from ``source``; a MoeprepError names the first
    bad item (1-based, counting items, not blank lines) and the fields it needs."""
    if not items and not allow_empty:
        raise MoeprepError(f"{source} holds no items; add some, or drop the suite from --suites")
    for number, item in enumerate(items, 1):
        bad = [k for k, ok in _SCHEMAS[kind].items() if not isinstance(item, dict) or not ok(item.get(k))]
        if bad:
            raise MoeprepError(f"{source}: item {number} has a missing or malformed {', '.join(bad)}; a {kind} "
                               f"item is {_SHAPES[kind]}")
    return items


def _mmlu_csv(path: Path, subject: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise MoeprepError(f"{path} is not a UTF-8 CSV file ({e})") from None
    start = 1
    if rows and rows[0][:2] == ["question", "choice0"]:
        rows, start = rows[1:], 2
    items = []
    for number, row in enumerate(rows, start):
        if len(row) != 6:
            raise MoeprepError(f"{path}:{number}: {len(row)} fields, 6 expected (question, 4 choices, answer)")
        answer = row[5].strip()
        if answer and answer in "ABCD":
            index = "ABCD".index(answer)
        elif answer in ("0", "1", "2", "3"):
            index = int(answer)
        else:
            raise MoeprepError(f"{path}:{number}: answer {answer!r} is not A-D or 0-3")
        items.append({"question": row[0], "subject": subject, "choices": row[1:5], "answer": index})
    return items


def _truthfulqa_mc_task(path: Path) -> list[dict]:
    """mc_task.json (answers as dict keys) -> HF multiple_choice schema, keeping the key order."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise MoeprepError(f"{path} is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(rows, list):
        raise MoeprepError(f"{path} must hold a list of questions")
    items = []
    for number, row in enumerate(rows, 1):
        if (not isinstance(row, dict) or not isinstance(row.get("question"), str)
                or not isinstance(row.get("mc1_targets"), dict) or not isinstance(row.get("mc2_targets"), dict)):
            raise MoeprepError(f"{path}: question {number} must be {{question, mc1_targets: {{answer: 0|1}}, "
                               "mc2_targets: {answer: 0|1}}")
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
        data.items[suite] = check_items(read_jsonl(path), suite, path)
    for name, kind, attr in (("gsm8k_fewshot.jsonl", "gsm8k", "gsm8k_shots"),
                             ("gsm8k_cot_fewshot.jsonl", "gsm8k_cot", "gsm8k_cot_shots")):
        if (root / name).is_file():
            setattr(data, attr, check_items(read_jsonl(root / name), kind, root / name, allow_empty=True))
    if (root / "mmlu_dev.jsonl").is_file():
        path = root / "mmlu_dev.jsonl"
        for item in check_items(read_jsonl(path), "mmlu", path, allow_empty=True):
            data.mmlu_dev.setdefault(item["subject"], []).append(item)
    return data


def _load_original_layout(root: Path, suites: tuple[str, ...]) -> BenchmarkData:
    data = BenchmarkData(str(root), "original")
    if "gsm8k" in suites:
        test = root / "gsm8k" / "test.jsonl"
        if not test.is_file():
            raise MoeprepError(f"{test} is missing; the original layout needs gsm8k/test.jsonl")
        data.items["gsm8k"] = check_items(read_jsonl(test), "gsm8k", test)
        if (train := root / "gsm8k" / "train.jsonl").is_file():  # the harness takes the first five
            data.gsm8k_shots = check_items(read_jsonl(train)[:5], "gsm8k", train, allow_empty=True)
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
        check_items(data.items["mmlu"], "mmlu", root / "mmlu" / "test")
    if "truthfulqa" in suites:
        path = root / "truthfulqa" / "mc_task.json"
        if not path.is_file():
            raise MoeprepError(f"{path} is missing; the original layout needs truthfulqa/mc_task.json")
        data.items["truthfulqa"] = check_items(_truthfulqa_mc_task(path), "truthfulqa", path)
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
    for suite, items in data.items.items():
        check_items(items, suite, f"{source} ({suite})")
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
