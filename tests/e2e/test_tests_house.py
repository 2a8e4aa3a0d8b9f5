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


def _pytest(tmp_path: Path, body: str, *args: str):
    """Runs pytest with this suite's conftest as a plugin on a test file holding ``body``, in ``tmp_path``."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_subject.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MOEPREP_TEST"))}  # not this run's
    env["PYTHONPATH"] = str(TESTS.parent)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "--rootdir", str(tmp_path),
                           "--basetemp", str(tmp_path / "base"), "-q", "-p", "no:cacheprovider", *args,
                           str(tmp_path / "test_subject.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


SHARED_SUBJECT = '''
from tests.helpers.shared import shared_store


def _build(d):
    (d / "weights.bin").write_bytes(b"abc")


def test_reads(tmp_path_factory):
    assert (shared_store(tmp_path_factory).get("thing", _build) / "weights.bin").read_bytes() == b"abc"


def test_changes(tmp_path_factory):
    (shared_store(tmp_path_factory).get("thing", _build) / "weights.bin").write_bytes(b"xyz")
'''


def test_a_test_that_changes_a_shared_build_fails_loudly_naming_itself(tmp_path):
    done = _pytest(tmp_path, SHARED_SUBJECT)
    assert done.returncode == 1, done.stdout
    assert "test_subject.py::test_changes changed the shared builds" in done.stdout and "thing/weights.bin" in done.stdout
    # the writer's own check passes and it errs at its teardown, where the session's hash check errs too
    assert "2 passed, 1 error" in done.stdout and "a test changed the shared builds" in done.stdout


def test_a_shared_build_is_made_once_and_its_seal_checks_content_not_only_times(tmp_path):
    from tests.helpers.shared import Shared

    store, calls = Shared(tmp_path / "shared"), []
    build = lambda d: (calls.append(d), (d / "a.bin").write_bytes(b"12"))  # noqa: E731
    first = store.get("x", build)
    assert store.get("x", build) == first and Shared(tmp_path / "shared").get("x", build) == first and len(calls) == 1
    assert store.changed() == [] and store.rehashed() == []
    stat = (first / "a.bin").stat()
    (first / "a.bin").write_bytes(b"34")  # same size, and the old modification time put back
    import os

    os.utime(first / "a.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store.changed() == [] and store.rehashed() == ["x/a.bin"]
    (first / "b.bin").write_bytes(b"")
    assert store.changed() == ["x/b.bin"]


TIMED_SUBJECT = '''
import pytest


@pytest.fixture(scope="session")
def built():
    return 1


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each(built, n):
    assert built


@pytest.mark.slow
def test_slow():
    pass


def test_skipped():
    pytest.skip("a reason")
'''


def test_the_durations_file_names_every_test_with_its_fixtures_serial_and_on_two_workers(tmp_path):
    import json

    from tests.helpers.timing import summarize

    for workers in ((), ("-n", "2")):
        out = tmp_path / f"times{len(workers)}"
        done = _pytest(tmp_path, TIMED_SUBJECT, "--times", str(out), *workers)
        assert done.returncode == 0, done.stdout
        doc = json.loads((out / "durations.json").read_text())
        names = {f"test_subject.py::test_each[{n}]" for n in (1, 2, 3)} | {"test_subject.py::test_slow",
                                                                           "test_subject.py::test_skipped"}
        assert set(doc["tests"]) == set(doc["collected"]) == names, workers
        assert doc["tests"]["test_subject.py::test_slow"]["slow"] and doc["tests"]["test_subject.py::test_skipped"][
            "outcome"] == "skipped"
        assert any("built (session)" in e["fixtures"] for e in doc["tests"].values())
    text, findings = summarize([doc])
    assert findings == [] and "## The 30 slowest tests" in text and "`test_subject.py::test_each[1]`" in text
    doc["tests"]["test_subject.py::test_slow"] |= {"setup": 0.0, "call": 301.0, "teardown": 0.0}
    doc["tests"]["test_subject.py::test_each[1]"] |= {"setup": 0.0, "call": 61.0, "teardown": 0.0}
    doc["collected"].append("test_subject.py::test_lost")
    _, findings = summarize([doc])
    assert any("test_each[1]: 61.0 s and not marked slow" in f for f in findings)
    assert any("slow tests take 301 s together" in f for f in findings)
    assert any("test_lost: collected but missing" in f for f in findings)
