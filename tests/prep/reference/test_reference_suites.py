"""More held-out items for the reference model (``moeprep reference-suites``): none of them in its training corpus
or its shipped suites, checked here by reading the regenerated corpus text itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.errors import MoeprepError
from prep.evals.data import load_benchmarks
from prep.reference import data as D

REFERENCE = Path(__file__).resolve().parents[3] / "recipes" / "reference"
SPEC = json.loads((REFERENCE / "training.json").read_text())["spec"]


def _choice_sets_after(corpus: str, question: str) -> set[frozenset]:
    """Every exam item in the corpus text that asks ``question``: the set of its four choices."""
    found = set()
    for m in re.finditer(re.escape(question) + r"\nA\. (.*)\nB\. (.*)\nC\. (.*)\nD\. (.*)\n", corpus):
        found.add(frozenset(m.groups()))
    return found


@pytest.fixture(scope="module")
def extended():
    made, stats = D.extend_suites(SPEC["seed"], SPEC["suites"], SPEC["docs"], 77,
                                  {"gsm8k": 40, "mmlu": 60, "truthfulqa": 20})
    shipped, split = D.make_suites(SPEC["seed"], SPEC["suites"])
    corpus = "\n".join(text for _, text in D.training_documents(SPEC["seed"], split, SPEC["docs"]))
    return made, stats, shipped, corpus


def test_no_added_item_is_in_the_training_text_or_the_shipped_suites(extended):
    made, stats, shipped, corpus = extended
    assert {k: len(v) for k, v in made.items()} == {"gsm8k": 40, "mmlu": 60, "truthfulqa": 20}
    assert all(stats[k]["made"] == len(made[k]) for k in made)
    shipped_questions = {i["question"] for i in shipped["gsm8k"]}
    for item in made["gsm8k"]:
        assert item["question"] not in corpus and item["question"] not in shipped_questions
    shipped_exam = {(i["question"], frozenset(i["choices"])) for i in shipped["mmlu"]}
    for item in made["mmlu"]:
        choices = frozenset(item["choices"])
        assert (item["question"], choices) not in shipped_exam
        assert choices not in _choice_sets_after(corpus, item["question"])
        if item["question"].startswith("What is "):  # a sum: nor its equation in a drill
            a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", item["question"]).groups()
            assert f"{a} + {b} =" not in corpus
        elif not item["question"].startswith("Which of the following"):  # a reserved fact: never asked in training
            assert item["question"] not in corpus
    generic = [i for i in made["mmlu"] if i["question"].startswith("Which of the following")]
    assert generic and all(_choice_sets_after(corpus, i["question"]) for i in generic)  # the stems are trained on
    shipped_qa = {(i["question"], frozenset(i["mc1_targets"]["choices"])) for i in shipped["truthfulqa"]}
    for item in made["truthfulqa"]:
        assert item["question"] not in corpus
        assert (item["question"], frozenset(item["mc1_targets"]["choices"])) not in shipped_qa
    assert len({i["question"] for i in made["gsm8k"]}) == 40  # no item twice


def test_the_extension_is_seeded_and_refuses_the_training_seed(extended):
    made, _, _, _ = extended
    again, _ = D.extend_suites(SPEC["seed"], SPEC["suites"], SPEC["docs"], 77, {"gsm8k": 40, "mmlu": 60,
                                                                                "truthfulqa": 20})
    assert again == made
    with pytest.raises(ValueError, match="training seed"):
        D.extend_suites(SPEC["seed"], SPEC["suites"], SPEC["docs"], SPEC["seed"], {"gsm8k": 1})


def test_the_command_writes_suites_eval_reads_with_the_shipped_items_first(tmp_path):
    out = tmp_path / "suites"
    result = CliRunner().invoke(main, ["reference-suites", "--dir", str(REFERENCE), "--out", str(out), "--seed", "5",
                                       "--gsm8k", "7", "--mmlu", "9", "--truthfulqa", "3"])
    assert result.exit_code == 0, result.output
    data = load_benchmarks(out)
    shipped = load_benchmarks(REFERENCE / "suites")
    for name, added in (("gsm8k", 7), ("mmlu", 9), ("truthfulqa", 3)):
        assert len(data.items[name]) == len(shipped.items[name]) + added
        assert data.items[name][:len(shipped.items[name])] == shipped.items[name]
    assert json.loads((out / "extension.json").read_text())["added"]["mmlu"]["made"] == 9
    refused = CliRunner().invoke(main, ["reference-suites", "--dir", str(REFERENCE), "--out", str(tmp_path / "x"),
                                        "--seed", str(SPEC["seed"])])
    assert refused.exit_code != 0 and "training seed" in refused.output
    assert not (tmp_path / "x").exists()
    with pytest.raises(MoeprepError):
        from prep.reference.train import write_extended_suites

        write_extended_suites(tmp_path / "nowhere", tmp_path / "y", 5, {"gsm8k": 1})


def test_the_shipped_suites_and_the_working_directory_are_never_replaced_without_being_asked(tmp_path, monkeypatch):
    """``--out .`` crashed, and ``--out recipes/reference/suites`` replaced the shipped suites without a word."""
    before = {p.name: p.read_bytes() for p in (REFERENCE / "suites").iterdir()}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    cases = [(".", "the current directory"), (str(REFERENCE / "suites"), "shipped held-out suites"),
             (str(REFERENCE), "would replace"), ("mine", "holds files this command did not write")]
    for out, says in cases:
        result = CliRunner().invoke(main, ["reference-suites", "--dir", str(REFERENCE), "--out", out, "--gsm8k", "1",
                                           "--mmlu", "0", "--truthfulqa", "0"])
        assert result.exit_code == 1 and says in result.output, (out, result.output)
        assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    assert {p.name: p.read_bytes() for p in (REFERENCE / "suites").iterdir()} == before
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    too_many = CliRunner().invoke(main, ["reference-suites", "--dir", str(REFERENCE), "--out", "x", "--gsm8k", "10**9"])
    assert too_many.exit_code == 2 and not (tmp_path / "x").exists()
