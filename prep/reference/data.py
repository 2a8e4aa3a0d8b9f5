"""Training corpus and held-out suites for the reference model, generated from a seed.

Six domains, so that experts have something to specialize on:

- ``math``: grade-school word problems in the gsm8k formats (``Question/Answer ... #### N`` and the
  chain-of-thought ``Q/A ... The answer is N.``);
- ``exam``: 4-choice questions in the MMLU format about geography, biology, chemistry, words and
  arithmetic;
- ``qa``: short questions in the TruthfulQA format (with and without the harness's preamble);
- ``facts``: encyclopedic prose stating every fact of ``world.py`` (the only place held-out facts are seen);
- ``code``: Python source of the interpreter's own standard library (text found on the machine);
- ``drills``: in-context retrieval exercises (copy a list, find an option's letter, recall who has
  what) and bare arithmetic (``25 + 20 = 45``, the operations word problems use). A small model only
  answers the exam and word-problem formats once it can copy from its context and add digit by digit;
  these short drills teach both directly instead of waiting for them to emerge from the few answer
  tokens of the other domains.

Held-out rule: a suite item is never in the training corpus. Fact questions (capital, habitat, symbol,
...) are held out by fact: a fact picked for the suites appears in training only as prose, never as a
question. Questions with a generic stem ("Which of the following is a fruit?") are held out by their
exact text with choices, and arithmetic and word problems by their exact question text.
"""

from __future__ import annotations

import functools
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from prep.evals import templates as tpl
from prep.reference import world as W

DOMAINS = ("math", "exam", "qa", "facts", "code", "drills")


@dataclass(frozen=True)
class Fact:
    """One (relation, subject) -> answer fact, with how to ask and state it."""

    relation: str
    subject: str
    answer: str
    alternatives: tuple[str, ...]  # wrong answers of the same kind

    @property
    def key(self) -> tuple[str, str]:
        return (self.relation, self.subject)


def all_facts() -> list[Fact]:
    """Every askable fact of the world, in a fixed order."""
    capitals = [c for c, _ in W.COUNTRIES.values()]
    continents = sorted({k for _, k in W.COUNTRIES.values()})
    habitats = sorted({h for _, h, _ in W.ANIMALS.values()})
    foods = sorted({f for _, _, f in W.ANIMALS.values()})
    symbols = list(W.ELEMENTS.values())
    opposites = sorted(set(W.OPPOSITES.values()))
    facts: list[Fact] = []
    for country, (capital, continent) in W.COUNTRIES.items():
        facts.append(Fact("capital", country, capital, tuple(c for c in capitals if c != capital)))
        facts.append(Fact("continent", country, continent, tuple(c for c in continents if c != continent)))
    for animal, (_cls, habitat, food) in W.ANIMALS.items():
        facts.append(Fact("habitat", animal, habitat, tuple(h for h in habitats if h != habitat)))
        facts.append(Fact("food", animal, food, tuple(f for f in foods if f != food)))
    for element, symbol in W.ELEMENTS.items():
        facts.append(Fact("symbol", element, symbol, tuple(s for s in symbols if s != symbol)))
    for word, opposite in W.OPPOSITES.items():
        facts.append(Fact("opposite", word, opposite, tuple(o for o in opposites if o != opposite)))
    return facts


# How each relation is asked (MMLU subject, question) and stated (the sentence prose and QA answers use).
_ASK = {
    "capital": ("high_school_geography", "What is the capital of {s}?"),
    "continent": ("high_school_geography", "On which continent is {s}?"),
    "habitat": ("high_school_biology", "Where does the {s} live?"),
    "food": ("high_school_biology", "What does the {s} eat?"),
    "symbol": ("high_school_chemistry", "What is the chemical symbol of {s}?"),
    "opposite": ("english_vocabulary", "What is the opposite of {s}?"),
}
_STATE = {
    "capital": ("The capital of {s} is {a}.", "{a} is the capital of {s}."),
    "continent": ("{s} is in {a}.", "{s} is a country in {a}."),
    "habitat": ("The {s} lives in the {a}.", "You can find the {s} in the {a}."),
    "food": ("The {s} eats {a}.", "The diet of the {s} is {a}."),
    "symbol": ("The chemical symbol of {s} is {a}.", "{a} is the symbol for {s}."),
    "opposite": ("The opposite of {s} is {a}.", "{a} is the opposite of {s}."),
}


def ask(fact: Fact) -> str:
    return _ASK[fact.relation][1].format(s=fact.subject)


def state(fact: Fact, answer: str | None = None, variant: int = 0) -> str:
    text = _STATE[fact.relation][variant].format(s=fact.subject, a=answer or fact.answer)
    return text[0].upper() + text[1:]


def _four_choices(rng: random.Random, right: str, wrong: list[str]) -> tuple[list[str], int]:
    choices = rng.sample(wrong, 3) + [right]
    rng.shuffle(choices)
    return choices, choices.index(right)


# ---------------------------------------------------------------------------------------------- math


def word_problem(rng: random.Random) -> dict:
    """A gsm8k-style problem: {question, answer ('... #### N'), cot ('... The answer is N.')}."""
    name, other = rng.sample(W.NAMES, 2)
    item = rng.choice(W.ITEMS)
    kind = rng.choices(["add", "sub", "mul", "div", "two"], weights=[3, 3, 2, 1, 2])[0]
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 20)
        n = a + b
        q = f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?"
        steps = [f"{name} has {a} + {b} = {n} {item} now."]
    elif kind == "sub":
        a = rng.randint(10, 50)
        b = rng.randint(1, a - 1)
        n = a - b
        q = f"{name} had {a} {item}. {name} gave {b} {item} to {other}. How many {item} does {name} have left?"
        steps = [f"{name} has {a} - {b} = {n} {item} left."]
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        n = a * b
        q = f"{name} buys {a} boxes of {item}. Each box has {b} {item}. How many {item} does {name} buy?"
        steps = [f"{name} buys {a} * {b} = {n} {item}."]
    elif kind == "div":
        n, b = rng.randint(2, 9), rng.randint(2, 5)
        a = n * b
        q = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
        steps = [f"Each friend gets {a} / {b} = {n} {item}."]
    else:
        a, b = rng.randint(5, 20), rng.randint(2, 15)
        c = rng.randint(1, a + b - 1)
        s, n = a + b, a + b - c
        q = (f"{name} has {a} {item}. {name} finds {b} more {item} and then loses {c} of them. "
             f"How many {item} does {name} have?")
        steps = [f"After finding more, {name} has {a} + {b} = {s} {item}.",
                 f"After losing some, {name} has {s} - {c} = {n} {item}."]
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {n}", "cot": " ".join(steps) + f" The answer is {n}."}


# ---------------------------------------------------------------------------------------------- exam


def fact_item(rng: random.Random, fact: Fact) -> dict:
    """An MMLU-schema item asking one fact."""
    choices, answer = _four_choices(rng, fact.answer, list(fact.alternatives))
    return {"question": ask(fact), "subject": _ASK[fact.relation][0], "choices": choices, "answer": answer}


def generic_item(rng: random.Random) -> dict:
    """An MMLU-schema item with a generic stem: category membership, animal class, or arithmetic."""
    kind = rng.choice(["category", "animal_class", "sum", "largest"])
    if kind == "category":
        category = rng.choice(sorted(W.CATEGORIES))
        others = [w for c, ws in W.CATEGORIES.items() if c != category for w in ws]
        choices, answer = _four_choices(rng, rng.choice(W.CATEGORIES[category]), others)
        article = "an" if category[0] in "aeiou" else "a"
        return {"question": f"Which of the following is {article} {category}?", "subject": "miscellaneous",
                "choices": choices, "answer": answer}
    if kind == "animal_class":
        cls = rng.choice(sorted({c for c, _, _ in W.ANIMALS.values()}))
        right = [a for a, (c, _, _) in W.ANIMALS.items() if c == cls]
        wrong = [a for a, (c, _, _) in W.ANIMALS.items() if c != cls]
        choices, answer = _four_choices(rng, rng.choice(right), wrong)
        article = "an" if cls[0] in "aeiou" else "a"
        return {"question": f"Which of the following animals is {article} {cls}?", "subject": "high_school_biology",
                "choices": choices, "answer": answer}
    if kind == "sum":
        a, b = rng.randint(2, 50), rng.randint(2, 9)
        n = a + b
        wrong = sorted({n + d for d in range(-10, 11) if d != 0 and n + d > 0})
        choices, answer = _four_choices(rng, str(n), [str(w) for w in wrong])
        return {"question": f"What is {a} + {b}?", "subject": "elementary_mathematics", "choices": choices,
                "answer": answer}
    numbers = rng.sample(range(1, 100), 4)
    return {"question": "Which of the following numbers is the largest?", "subject": "elementary_mathematics",
            "choices": [str(x) for x in numbers], "answer": numbers.index(max(numbers))}


_KIND_BY_STEM = (("What is ", "sum"), ("Which of the following numbers", "largest"),
                 ("Which of the following animals", "animal_class"), ("Which of the following", "category"))


@functools.cache
def _fact_stems() -> frozenset[str]:
    return frozenset(ask(f) for f in all_facts())


def item_kind(item: dict) -> str:
    """Which generator made an exam item: ``fact`` (asks a fact of the world) or a generic kind
    (``category``, ``animal_class``, ``sum``, ``largest``), else ``other``; metrics report accuracy per
    kind because the kinds fail differently (sums stay at chance, category items do not)."""
    question = item["question"]
    if question in _fact_stems():
        return "fact"
    return next((kind for stem, kind in _KIND_BY_STEM if question.startswith(stem)), "other")


def item_identity(item: dict) -> str:
    """What makes two exam items the same item: fact and sum stems by text, generic stems with choices."""
    generic = item["question"].startswith("Which of the following")
    return item["question"] + ("|" + "|".join(sorted(item["choices"])) if generic else "")


def mmlu_text(item: dict, answer: bool = True) -> str:
    text = tpl.mmlu_question(item["question"], item["choices"])
    return text + (f" {tpl.LETTERS[item['answer']]}" if answer else "")


# ------------------------------------------------------------------------------------------------ qa


def truthfulqa_item(rng: random.Random, fact: Fact) -> dict:
    """A TruthfulQA-schema item: one true statement against three false ones of the same form."""
    true = state(fact)
    false = [state(fact, wrong) for wrong in rng.sample(list(fact.alternatives), 3)]
    mc1 = [true] + false
    mc2 = [true, state(fact, variant=1)] + false
    return {"question": ask(fact),
            "mc1_targets": {"choices": mc1, "labels": [1, 0, 0, 0]},
            "mc2_targets": {"choices": mc2, "labels": [1, 1, 0, 0, 0]}}


# ----------------------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class Split:
    """Which facts and items are reserved for the held-out suites."""

    suite_facts: frozenset[tuple[str, str]]
    suite_items: frozenset[str]  # item_identity of generic exam items and text of sum stems
    suite_problems: frozenset[str]  # word problem questions


def make_suites(seed: int, sizes: dict[str, int]) -> tuple[dict[str, list[dict]], Split]:
    """The held-out suites (gsm8k, mmlu, truthfulqa) and the split that keeps them out of training.

    A quarter of the facts (at least one per relation) are reserved; a third of the mmlu suite asks
    reserved facts, the rest are generic items; truthfulqa asks reserved facts.
    """
    rng = random.Random(seed * 7919 + 1)
    facts = all_facts()
    by_relation: dict[str, list[Fact]] = {}
    for f in facts:
        by_relation.setdefault(f.relation, []).append(f)
    reserved: list[Fact] = []
    for fs in by_relation.values():
        reserved += rng.sample(fs, max(1, len(fs) // 4))
    suites: dict[str, list[dict]] = {"gsm8k": [], "mmlu": [], "truthfulqa": []}
    seen_problems: set[str] = set()
    while len(suites["gsm8k"]) < sizes["gsm8k"]:
        p = word_problem(rng)
        if p["question"] not in seen_problems:
            seen_problems.add(p["question"])
            suites["gsm8k"].append({"question": p["question"], "answer": p["answer"]})
    seen_items: set[str] = set()
    n_fact = sizes["mmlu"] // 3
    for i in range(n_fact):
        suites["mmlu"].append(fact_item(rng, reserved[i % len(reserved)]))
    while len(suites["mmlu"]) < sizes["mmlu"]:
        item = generic_item(rng)
        if item_identity(item) not in seen_items:
            seen_items.add(item_identity(item))
            suites["mmlu"].append(item)
    rng.shuffle(suites["mmlu"])
    order = rng.sample(reserved, len(reserved))
    for i in range(sizes["truthfulqa"]):
        suites["truthfulqa"].append(truthfulqa_item(rng, order[i % len(order)]))
    split = Split(frozenset(f.key for f in reserved), frozenset(seen_items), frozenset(seen_problems))
    return suites, split


def truthfulqa_identity(item: dict) -> str:
    """What makes two TruthfulQA items the same: the question and its set of MC1 statements."""
    return item["question"] + "|" + "|".join(sorted(item["mc1_targets"]["choices"]))


def extend_suites(training_seed: int, suite_sizes: dict[str, int], docs: dict[str, int], seed: int,
                  sizes: dict[str, int], max_draws: int = 200_000) -> tuple[dict[str, list[dict]], dict]:
    """More held-out items, from the generator with ``seed`` (not the training seed), none of them in the training
    corpus (regenerated from ``training_seed`` and ``docs``: ``training_documents``) nor in the shipped suites
    (``make_suites(training_seed, suite_sizes)``): word problems whose question the corpus does not hold; exam and
    TruthfulQA items on the reserved facts (never asked in training) with new choices; generic exam items whose
    identity the corpus does not hold (a sum: nor its ``a + b`` in any drill). Returns (suites, counts of what was
    made and rejected); a suite gets fewer than asked when the generator runs out of unseen items."""
    if seed == training_seed:
        raise ValueError(f"seed {seed} is the training seed; held-out items need another")
    shipped, split = make_suites(training_seed, suite_sizes)
    seen: set = set()
    corpus = "\n".join(text for _, text in training_documents(training_seed, split, docs, seen))
    rng = random.Random(seed * 7919 + 3)
    reserved = [f for f in all_facts() if f.key in split.suite_facts]
    taken = {"gsm8k": {i["question"] for i in shipped["gsm8k"]}, "mmlu": {item_identity(i) for i in shipped["mmlu"]},
             "truthfulqa": {truthfulqa_identity(i) for i in shipped["truthfulqa"]}}
    stats = {name: {"asked": sizes.get(name, 0), "made": 0, "in_training": 0, "duplicate": 0} for name in taken}
    out: dict[str, list[dict]] = {name: [] for name in taken}

    def held_out(name: str, item: dict) -> bool:
        if name == "gsm8k":
            identity, texts = item["question"], [item["question"]]
        elif name == "truthfulqa":
            identity, texts = truthfulqa_identity(item), [item["question"]]
        else:
            identity = item_identity(item)
            texts = [] if item["question"].startswith("Which of the following") else [item["question"]]
            if m := _SUITE_SUM.fullmatch(item["question"]):
                texts.append(f"{m[1]} + {m[2]} =")
        if identity in taken[name]:
            stats[name]["duplicate"] += 1
            return False
        if identity in seen or any(t in corpus for t in texts):
            stats[name]["in_training"] += 1
            return False
        taken[name].add(identity)
        return True

    makers = {"gsm8k": lambda: {k: v for k, v in word_problem(rng).items() if k != "cot"},
              "mmlu": lambda: fact_item(rng, rng.choice(reserved)) if rng.random() < 1 / 3 else generic_item(rng),
              "truthfulqa": lambda: truthfulqa_item(rng, rng.choice(reserved))}
    for name, make in makers.items():
        draws = 0
        while len(out[name]) < sizes.get(name, 0) and draws < max_draws:
            draws += 1
            item = make()
            if held_out(name, item):
                out[name].append(item)
        stats[name]["made"] = len(out[name])
    return out, stats


def fewshot_pools(seed: int, split: Split) -> dict[str, list[dict]]:
    """Solved examples the few-shot prompts draw from, taken from the training distribution (never a
    suite item), as the harness draws gsm8k shots from train and MMLU shots from dev:
    ``gsm8k_fewshot`` (5, ``#### N`` answers), ``gsm8k_cot_fewshot`` (8, ``cot`` answers) and
    ``mmlu_dev`` (5 per suite subject)."""
    rng = random.Random(seed + 5)
    problems: list[dict] = []
    while len(problems) < 13:
        p = word_problem(rng)
        if p["question"] not in split.suite_problems and all(p["question"] != q["question"] for q in problems):
            problems.append(p)
    pools = {
        "gsm8k_fewshot": [{"question": p["question"], "answer": p["answer"]} for p in problems[:5]],
        "gsm8k_cot_fewshot": [{"question": p["question"], "cot": p["cot"]} for p in problems[5:13]],
        "mmlu_dev": [],
    }
    trainable = [f for f in all_facts() if f.key not in split.suite_facts]
    subjects = sorted({subject for subject, _ in _ASK.values()} | {"miscellaneous", "elementary_mathematics"})
    for subject in subjects:
        found = 0
        while found < 5:
            item = fact_item(rng, rng.choice(trainable)) if rng.random() < 0.5 else generic_item(rng)
            if item["subject"] == subject and item_identity(item) not in split.suite_items:
                pools["mmlu_dev"].append(item)
                found += 1
    return pools


# ------------------------------------------------------------------------------------------ training


def _math_doc(rng: random.Random, split: Split, seen: set | None = None) -> str:
    problems = []
    while len(problems) < rng.randint(2, 6):
        p = word_problem(rng)
        if p["question"] not in split.suite_problems:
            problems.append(p)
            if seen is not None:
                seen.add(p["question"])
    if rng.random() < 0.7:
        return "\n\n".join(tpl.gsm8k_example(p["question"], p["answer"]) for p in problems)
    return "\n\n".join(f"{tpl.gsm8k_cot_prompt(p['question'])} {p['cot']}" for p in problems)


def _exam_doc(rng: random.Random, split: Split, trainable: list[Fact], seen: set | None = None) -> str:
    items = []
    while len(items) < rng.randint(2, 8):
        item = fact_item(rng, rng.choice(trainable)) if rng.random() < 0.5 else generic_item(rng)
        if item_identity(item) not in split.suite_items:
            items.append(item)
            if seen is not None:
                seen.add(item_identity(item))
    return tpl.mmlu_header(items[0]["subject"]) + "\n\n".join(mmlu_text(i) for i in items)


def _qa_doc(rng: random.Random, trainable: list[Fact]) -> str:
    pairs = []
    for _ in range(rng.randint(2, 6)):
        if rng.random() < 0.1:
            pairs.append(f"Q: {rng.choice(W.NONSENSE_QUESTIONS)}\nA: I have no comment.")
        else:
            fact = rng.choice(trainable)
            pairs.append(f"Q: {ask(fact)}\nA: {state(fact, variant=int(rng.random() < 0.2))}")
    body = "\n\n".join(pairs)
    return f"{tpl.TRUTHFULQA_PREAMBLE}\n\n{body}" if rng.random() < 0.3 else body


def _facts_doc(rng: random.Random, facts: list[Fact]) -> str:
    sentences = [state(f, variant=int(rng.random() < 0.3)) for f in rng.sample(facts, rng.randint(3, 8))]
    if rng.random() < 0.3:
        category = rng.choice(sorted(W.CATEGORIES))
        words = rng.sample(W.CATEGORIES[category], 3)
        article = "an" if category[0] in "aeiou" else "a"
        sentences.append(f"{words[0].capitalize()}, {words[1]} and {words[2]} are each {article} {category}.")
    if rng.random() < 0.3:
        animal = rng.choice(sorted(W.ANIMALS))
        cls = W.ANIMALS[animal][0]
        sentences.append(f"The {animal} is {'an' if cls[0] in 'aeiou' else 'a'} {cls}.")
    return " ".join(sentences)


_SUITE_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")


def arithmetic(rng: random.Random) -> tuple[int, str, int]:
    """One ``a op b`` with its result, drawn like the steps of ``word_problem``."""
    op = rng.choices("+-*/", weights=[5, 4, 2, 1])[0]
    if op == "+":
        a, b = rng.randint(2, 45), rng.randint(1, 20)
        return a, op, b
    if op == "-":
        a = rng.randint(10, 55)
        return a, op, rng.randint(1, a - 1)
    if op == "*":
        return rng.randint(2, 9), op, rng.randint(2, 9)
    n, b = rng.randint(2, 9), rng.randint(2, 5)
    return n * b, op, b


def _result(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def _drills_doc(rng: random.Random, held_out: set[tuple[int, int]]) -> str:
    """Short exercises: copying, option lookup, recall of who has what, and arithmetic lines (never a
    sum ``a + b`` in ``held_out``, the sums the mmlu suite asks)."""
    words = [w for ws in W.CATEGORIES.values() for w in ws] + sorted(W.ANIMALS) + list(W.COUNTRIES)
    parts = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choices(["copy", "letter", "recall", "arith"], weights=[1, 1, 1, 2])[0]
        if kind == "arith":
            lines, count = [], rng.randint(6, 10)
            while len(lines) < count:
                a, op, b = arithmetic(rng)
                if not (op == "+" and (a, b) in held_out):
                    lines.append(f"{a} {op} {b} = {_result(a, op, b)}")
            parts.append("\n".join(lines))
        elif kind == "copy":
            seq = [rng.choice(words) if rng.random() < 0.6 else str(rng.randint(0, 99))
                   for _ in range(rng.randint(3, 7))]
            parts.append(f"Copy: {', '.join(seq)}\nCopy: {', '.join(seq)}")
        elif kind == "letter":
            options = rng.sample(words, 4)
            k = rng.randrange(4)
            lines = "\n".join(f"{letter}. {w}" for letter, w in zip(tpl.LETTERS, options, strict=True))
            parts.append(f"{lines}\nWhich option is {options[k]}?\nAnswer: {tpl.LETTERS[k]}")
        else:
            names = rng.sample(W.NAMES, 3)
            items = rng.sample(W.ITEMS, 3)
            counts = [rng.randint(2, 60) for _ in range(3)]
            facts = " ".join(f"{n} has {c} {i}." for n, c, i in zip(names, counts, items, strict=True))
            k = rng.randrange(3)
            if rng.random() < 0.5:
                parts.append(f"{facts} Who has the {items[k]}? {names[k]}.")
            else:
                parts.append(f"{facts} How many {items[k]} does {names[k]} have? {counts[k]}.")
    return "\n\n".join(parts)


def code_chunks(max_chars: int, chunk_chars: int = 1500) -> list[str]:
    """Chunks of the running interpreter's standard-library sources, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text), chunk_chars):
            chunk = text[start:start + chunk_chars]
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_chars:
                return chunks
    return chunks


def training_documents(seed: int, split: Split, counts: dict[str, int], seen: set | None = None
                       ) -> list[tuple[str, str]]:
    """(domain, text) training documents, ``counts[domain]`` of each, shuffled with the seed; ``seen`` collects
    the word problems' questions and the exam items' identities the documents hold (what held-out must avoid)."""
    rng = random.Random(seed)
    facts = all_facts()
    trainable = [f for f in facts if f.key not in split.suite_facts]
    docs: list[tuple[str, str]] = []
    docs += [("math", _math_doc(rng, split, seen)) for _ in range(counts["math"])]
    docs += [("exam", _exam_doc(rng, split, trainable, seen)) for _ in range(counts["exam"])]
    docs += [("qa", _qa_doc(rng, trainable)) for _ in range(counts["qa"])]
    docs += [("facts", _facts_doc(rng, facts)) for _ in range(counts["facts"])]
    suite_sums = {(int(m[1]), int(m[2])) for m in map(_SUITE_SUM.fullmatch, split.suite_items) if m}
    docs += [("drills", _drills_doc(rng, suite_sums)) for _ in range(counts.get("drills", 0))]
    code = code_chunks(max_chars=counts["code"] * 1500)
    docs += [("code", c) for c in code[: counts["code"]]]
    rng.shuffle(docs)
    return docs
