"""The bench's subjects registry (``prep/studies/bench/subjects.py``): each subject declared once, the plan asks it.

A made-up subject registered by one entry runs with no other change; the steps after the registry compare no
subject name; an unknown subject or system is one error naming the known ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prep.studies.bench.subjects as subjects
from prep.errors import MoeprepError
from prep.studies.bench.plan import plan_bench
from prep.studies.bench.prefill import PREFILL_SUBJECTS
from prep.studies.bench.subjects import (
    LLAMA,
    PREDICTOR_SYSTEMS,
    SUBJECTS,
    TECHNIQUES,
    Subject,
    SubjectEntry,
    known_systems,
    subject_entries,
)
from prep.studies.bench.worker import TUNED

STEPS = ("run", "plan", "measure", "model", "bound")  # the bench's steps: none may name a subject


def test_every_subject_declares_its_systems_and_how_it_is_prepared():
    assert list(SUBJECTS) == ["reference", "reference-lossless", "reference-neuron", "mixtral-shape",
                              "mixtral-shape-own", "mixtral-shape-techniques"]
    for name, entry in SUBJECTS.items():
        assert entry.name == name and entry.systems and entry.preparing, name
        assert "resident" not in entry.systems, name  # resident and the floors run on every subject
        assert len(set(entry.systems)) == len(entry.systems), name
    assert PREFILL_SUBJECTS == ("mixtral-shape", "mixtral-shape-own")
    assert SUBJECTS["mixtral-shape-techniques"].systems == ("naive", *TECHNIQUES, TUNED)
    assert known_systems() == {"resident", "accelerate", "naive", "moeprep", "naive+neuron", LLAMA,
                               *PREDICTOR_SYSTEMS, *TECHNIQUES, TUNED}


def test_an_unknown_subject_is_one_error_naming_the_known_ones():
    assert [e.name for e in subject_entries("all")] == list(SUBJECTS)
    assert [e.name for e in subject_entries("mixtral-shape-own, reference")] == ["mixtral-shape-own", "reference"]
    for text in ("mixtral", "reference,nope", " , "):
        with pytest.raises(MoeprepError, match="unknown; use all, or a comma-separated subset of reference, "
                                               "reference-lossless, reference-neuron, mixtral-shape, "
                                               "mixtral-shape-own, mixtral-shape-techniques"):
            subject_entries(text)


def test_a_subject_is_one_entry_and_the_plan_asks_the_registry(tmp_path, monkeypatch):
    """A toy subject: its notes (declared, then learned while building) go into the plan, it runs its systems at
    each budget beside resident and the floors, and a system it lacks (llama.cpp without its GGUF) is dropped."""
    said = []

    def build(context, name):
        said.append(("built", name, context.quick, context.traces))
        return Subject(name, tmp_path, tmp_path, [1], [2], None, "its own routers"), ["learned while building"]

    toy = SubjectEntry("toy", build, ("naive", "moeprep", LLAMA), "(a toy)", notes=("declared",))
    monkeypatch.setattr(subjects, "SUBJECTS", {"toy": toy})
    plan = plan_bench("toy", "25%,50%", True, "cpu", tmp_path / "out", None, tmp_path, said.append, None, "auto",
                      None, None, True)
    assert said == ["preparing subject toy (a toy)", ("built", "toy", True, None)]
    assert plan.notes == ["declared", "learned while building"]
    assert plan.runs == {"toy": [("resident", "100%"), ("naive@unlimited", "unlimited"),
                                 ("moeprep@unlimited", "unlimited"), ("naive", "25%"), ("moeprep", "25%"),
                                 ("naive", "50%"), ("moeprep", "50%")]}
    with pytest.raises(MoeprepError, match="--subject 'reference' unknown; use all, or a comma-separated subset of toy"):
        plan_bench("reference", "25%", True, "cpu", tmp_path / "out", None, tmp_path, said.append, None, "auto",
                   None, None, True)
    # a subject that needs the real traces: skipped with a note in "all", an error when named
    needs = SubjectEntry("needs", build, ("naive",), "(needs traces)", traces="routing.jsonl")
    monkeypatch.setattr(subjects, "SUBJECTS", {"toy": toy, "needs": needs})
    plan = plan_bench("all", "25%", True, "cpu", tmp_path / "out", tmp_path / "none", tmp_path, said.append, None,
                      "auto", None, None, True)
    assert [s.name for s in plan.subjects] == ["toy"]
    assert plan.notes[-1] == (f"needs skipped: the real Mixtral traces are not in {tmp_path / 'none'} (pass --traces "
                             "DIR holding routing.jsonl)")
    with pytest.raises(MoeprepError, match="needs skipped: the real Mixtral traces are not in"):
        plan_bench("needs", "25%", True, "cpu", tmp_path / "out", tmp_path / "none", tmp_path, said.append, None,
                   "auto", None, None, True)


def test_the_steps_after_the_registry_name_no_subject():
    """Which subject runs what is the registry's: the bench's steps hold no subject name in their code."""
    package = Path(subjects.__file__).parent
    for step in STEPS:
        tree = ast.parse((package / f"{step}.py").read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        named = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and id(node) not in docstrings
                 and isinstance(node.value, str) and node.value.strip() in SUBJECTS]
        assert named == [], step
