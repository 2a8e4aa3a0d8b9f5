"""The suite's session rules.

- Tests must not write into the repository (they use tmp_path).
- The loader's "auto" held form is pinned to float32 (``loader/forms.py``): the parity tolerances of the suite are
  float32's, the same on every machine; ``tests/loader/test_forms.py`` tests every form and the device rule at
  their own.
- Threads: ``MOEPREP_TEST_THREADS`` sets torch's thread count for the tests and every process they start
  (``OMP_NUM_THREADS``). Unset, an xdist worker takes one thread (two workers fill two cores without
  oversubscribing them) and a serial run the machine's count. No test depends on it: a test that compares two
  different computations bit for bit fixes its own thread count (``one_thread``) or states a tolerance.
- Durations: ``--times DIR`` writes every test's and fixture's time (``tests/helpers/timing.py``).
- Shared builds: prepared artifacts, models and traces are built once per run and read-only to the tests
  (``tests/helpers/shared.py``; ``tiny_artifact``, ``uninterrupted``, ``reference_lossless_artifact``,
  ``prepared_root``, the bench's quick subject): a test that changes one fails at its teardown.
- ``alone`` marks a test that measures memory or time and needs the machine to itself: ``make test`` runs those
  after the parallel part, one at a time. A test that bounds a child process's own peak RSS (its VmHWM) does not
  need it: other processes cannot raise that figure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.shared import store_in_use
from tests.helpers.timing import pytest_addoption  # noqa: F401  (the --times option)
from tests.helpers.timing import pytest_configure as _configure_timing

REPO = Path(__file__).resolve().parents[1]
os.environ["MOEPREP_EXPERT_DTYPE"] = "float32"  # before any test (and any worker it starts) loads
_IGNORED = {".venv", ".git", ".pytest_cache", ".ruff_cache", "__pycache__", ".gpu", "test-times"}


def pytest_configure(config):
    threads = os.environ.get("MOEPREP_TEST_THREADS") or ("1" if hasattr(config, "workerinput") else None)
    if threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
        os.environ["MOEPREP_TEST_THREADS"] = threads
        torch.set_num_threads(int(threads))
    _configure_timing(config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker by naming them ``<id>@<group>`` on
    the workers, through ``item._nodeid``, which pytest 9 no longer reads (``Node.nodeid`` is ``str(item._id)``):
    without this every group is ignored and its tests spread over the workers. The same suffix, where it is lost."""
    if not getattr(config.option, "loadgroup", False):  # set on a loadgroup run's workers only
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # a pytest that reads ``_nodeid`` (before 9) or names ids otherwise: nothing to restore here
        return

    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


def _tree() -> dict[str, float]:
    out = {}
    for path in REPO.rglob("*"):
        if _IGNORED.intersection(path.relative_to(REPO).parts) or path.suffix == ".egg-info":
            continue
        if path.is_file() and ".egg-info" not in str(path):
            out[str(path.relative_to(REPO))] = path.stat().st_mtime
    return out


@pytest.fixture
def root(tmp_path):
    """A prepare root holding a tiny Qwen3-MoE under ``model/`` (``tests.helpers.tiny_models.tiny_recipe`` finds it)."""
    from tests.helpers.tiny_models import save_tiny_model

    save_tiny_model("qwen3_moe", tmp_path / "model")
    return tmp_path


@pytest.fixture
def prepared_root(tmp_path, tmp_path_factory):
    """``root`` after ``prepare(tiny_recipe(), root=root)``, for the tests of what happens after a prepare: a
    writable copy of one shared build (``tests.helpers.interrupt.uninterrupted``), whose stage cache makes the
    same prepare return at once."""
    from tests.helpers.interrupt import uninterrupted
    from tests.helpers.shared import writable_copy
    from tests.helpers.tiny_models import tiny_recipe

    clean, _ = uninterrupted(tmp_path_factory, tiny_recipe())
    return writable_copy(clean, tmp_path / "prepared")


@pytest.fixture
def one_thread():
    """torch at one thread for the test, restored after: two different computations (a streamed and a resident
    forward, say) then add in one order and may be compared bit for bit on any CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference_lossless_artifact(tmp_path_factory) -> Path:
    """The reference-lossless artifact, prepared once per run (``tests.helpers.reference_builds``)."""
    from tests.helpers.reference_builds import reference_lossless

    return reference_lossless(tmp_path_factory) / "artifacts" / "reference-lossless" / "artifact"


@pytest.fixture(autouse=True)
def shared_builds_are_left_untouched(request):
    """Fails the test that changed a shared build, at its own teardown (sizes and modification times)."""
    yield
    store = store_in_use()
    changed = store.changed() if store else []
    if changed:
        store.acknowledge()  # this test fails; the next ones are judged by their own changes
    assert not changed, (f"{request.node.nodeid} changed the shared builds (copy them first: writable_copy): "
                         f"{changed[:10]}")


@pytest.fixture(scope="session", autouse=True)
def shared_builds_hash_as_built():
    """At the end of the run, every shared build's files hash as they did when it was built."""
    yield
    store = store_in_use()
    changed = store.rehashed() if store else []
    assert not changed, f"a test changed the shared builds (copy them first: writable_copy): {changed[:10]}"


@pytest.fixture(scope="session", autouse=True)
def repository_is_left_untouched():
    before = _tree()
    yield
    after = _tree()
    changed = sorted(k for k in after if before.get(k) != after[k])
    assert not changed, f"tests wrote into the repository: {changed[:10]}"
