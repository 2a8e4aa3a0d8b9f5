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
GSM8K_COT_STOP = ("Q:", "</s>", "<|im_end|>")

# The eight fixed chain-of-thought exemplars the harness's gsm8k_cot task uses (Wei et al., 2022).
GSM8K_COT_EXEMPLARS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
     "The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
     "The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
)


def gsm8k_cot_fewshot_prompt(question: str, shots: list[tuple[str, str]]) -> str:
    """``Q: .. A: .. The answer is N.`` exemplars, each followed by a blank line, then the question."""
    prefix = "".join(f"{gsm8k_cot_prompt(q)} {a}\n\n" for q, a in shots)
    return prefix + gsm8k_cot_prompt(question)


def mmlu_fewshot_prompt(item: dict, shots: list[dict]) -> str:
    """The subject header, solved dev questions separated by blank lines, then the question."""
    solved = "".join(f"{mmlu_question(s['question'], s['choices'])} {LETTERS[s['answer']]}\n\n" for s in shots)
    return mmlu_header(item["subject"]) + solved + mmlu_question(item["question"], item["choices"])


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


# MMLU's 57 subjects in the four categories lm-evaluation-harness reports; anything else is "other".
_MMLU_GROUPS = {
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
            "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
            "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
            "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                  "prehistory professional_law world_religions",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
                       "high_school_macroeconomics high_school_microeconomics high_school_psychology "
                       "human_sexuality professional_psychology public_relations security_studies sociology "
                       "us_foreign_policy",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
}
MMLU_CATEGORY = {subject: group for group, names in _MMLU_GROUPS.items() for subject in names.split()}


def mmlu_category(subject: str) -> str:
    """The harness's category of an MMLU subject (stem, humanities, social_sciences, other)."""
    return MMLU_CATEGORY.get(subject, "other")


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
