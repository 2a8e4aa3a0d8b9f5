"""House rules of the test suite itself: a test says what behaviour it checks, never which issue asked for it
(an issue number means nothing to a reader of the code), and a test file imports no other test file (a helper
two test files share lives in a helper module under ``tests/``, so each test file runs alone)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# the word "issue", then (after spaces, "_", "#" or "-") a number, in any case
ISSUE_NUMBER = re.compile(r"issue[\s_#-]*\d+", re.IGNORECASE)


def test_the_issue_pattern_finds_the_citations_it_is_meant_to():
    n = 14  # the citations are built, so that this file names no issue number itself
    for cited in (f"(issue {n})", f"Issue #{n}:", f"issue {n}'s gate", f"def test_issue_{n}_loads", f"ISSUE-{n}"):
        assert ISSUE_NUMBER.search(cited), cited
    for plain in ("prefetches issued", 'stats["issued"] > 0', "an issue with the budget", "issues 5 reads"):
        assert not ISSUE_NUMBER.search(plain), plain


def test_no_file_under_tests_names_an_issue_number():
    found = [f"{path.relative_to(TESTS)}:{n}: {line.strip()}"
             for path in sorted(TESTS.rglob("*")) if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".json")
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if ISSUE_NUMBER.search(line)]
    assert not found, "say what the test checks instead of citing an issue:\n" + "\n".join(found)


def test_no_test_file_imports_another_test_file():
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(TESTS)}: imports {name}" for name in names
                      if name.split(".")[-1].startswith("test_") or name.split(".")[-1] == "conftest"]
    assert not found, "move what they share into a helper module under tests/:\n" + "\n".join(found)
