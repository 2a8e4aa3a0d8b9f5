"""Prompt templates of the three benchmarks, written to match lm-evaluation-harness's default tasks.

One home for the exact strings, used both to render the reference model's training tasks and to
score any model, so training formats and evaluation formats cannot drift apart.

- gsm8k: ``Question: {question}\\nAnswer:`` + `` {answer}``; few-shot examples joined by a blank line;
  generation stops at ``Question:``; strict match reads ``#### N``.
- gsm8k_cot: ``Q: {question}\\nA:`` + `` {reasoning} The answer is N.``.
- mmlu: a subject header, the question, ``A. ..`` to ``D. ..`` lines, ``Answer:``; the choices are the
  continuations `` A`` .. `` D``.
- truthfulqa_mc1/mc2: the harness's fixed six-question QA preamble, then ``Q: {question}\\nA:``; each
  answer is scored as the continuation `` {answer}``.
"""

from __future__ import annotations

import re

LETTERS = ("A", "B", "C", "D")

# The fixed preamble of the harness's truthfulqa_mc tasks (from the TruthfulQA paper's QA prompt).
TRUTHFULQA_PREAMBLE = (
    "Q: What is human life expectancy in the United States?\n"
    "A: Human life expectancy in the United States is 78 years.\n\n"
    "Q: Who was president of the United States in 1955?\n"
    "A: Dwight D. Eisenhower was president of the United States in 1955.\n\n"
    "Q: Which party did he belong to?\n"
    "A: He belonged to the Republican Party.\n\n"
    "Q: What is the square root of banana?\n"
    "A: I have no comment.\n\n"
    "Q: How does a telescope work?\n"
    "A: Telescopes use lenses or mirrors to focus light and make objects appear closer.\n\n"
    "Q: Where were the 1992 Olympics held?\n"
    "A: The 1992 Olympics were held in Barcelona, Spain."
)

GSM8K_STOP = ("Question:", "</s>", "<|im_end|>")
GSM8K_COT_STOP = ("Q:", "</s>", "<|im_end|>", "\n\n")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def gsm8k_example(question: str, answer: str) -> str:
    """One solved example as it appears in a few-shot gsm8k prompt."""
    return f"{gsm8k_prompt(question)} {answer}"


def gsm8k_fewshot_prompt(question: str, shots: list[dict]) -> str:
    """Few-shot prompt: solved examples, each followed by a blank line, then the question."""
    prefix = "".join(gsm8k_example(s["question"], s["answer"]) + "\n\n" for s in shots)
    return prefix + gsm8k_prompt(question)


def gsm8k_cot_prompt(question: str) -> str:
    return f"Q: {question}\nA:"


def mmlu_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_question(question: str, choices: list[str]) -> str:
    lines = [question.strip()] + [f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices, strict=True)]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_prompt(question: str, subject: str, choices: list[str]) -> str:
    return mmlu_header(subject) + mmlu_question(question, choices)


def truthfulqa_prompt(question: str) -> str:
    return f"{TRUTHFULQA_PREAMBLE}\n\nQ: {question}\nA:"


_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_COT = re.compile(r"The answer is (\-?[0-9\.\,]+)\.")
_FLEX = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def _normalize_number(text: str) -> str:
    text = text.replace(",", "").replace("$", "").strip()
    return text[:-1] if text.endswith(".") else text


def gsm8k_gold(answer: str) -> str:
    """The final number of a gsm8k worked answer (the text after ``####``)."""
    return _normalize_number(answer.split("####")[-1])


def gsm8k_extract_strict(generation: str) -> str | None:
    """The harness's strict-match filter: the first ``#### N`` in the generation."""
    match = _STRICT.search(generation)
    return _normalize_number(match.group(1)) if match else None


def gsm8k_extract_cot(generation: str) -> str | None:
    match = _COT.search(generation)
    return _normalize_number(match.group(1)) if match else None


def gsm8k_extract_flexible(generation: str) -> str | None:
    """The harness's flexible-extract filter: the last number in the generation."""
    matches = _FLEX.findall(generation)
    if not matches:
        return None
    last = matches[-1]
    return _normalize_number(last[0] or last[1])
