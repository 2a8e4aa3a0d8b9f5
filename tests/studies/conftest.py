"""The bench tests' fixtures (``tests/helpers/bench_builds.py`` builds what they share)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bench_builds import forked_worker, seed_quick_shape


@pytest.fixture
def quick_shape_built(tmp_path, tmp_path_factory) -> Path:
    """``tmp_path`` seeded with the quick mixtral-shape subject (``seed_quick_shape``): a quick bench with
    ``--output tmp_path`` reuses its model and artifacts instead of preparing them."""
    return seed_quick_shape(tmp_path_factory, tmp_path)


@pytest.fixture
def forked_workers(monkeypatch):
    """The bench's measurements forked from this process instead of fresh interpreters (``forked_worker``)."""
    import prep.studies.bench.measure as bench_measure

    monkeypatch.setattr(bench_measure, "_run_worker", forked_worker)
