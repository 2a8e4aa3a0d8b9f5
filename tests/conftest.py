"""Session guard: tests must not write into the repository (they use tmp_path). The loader's "auto" held
form is pinned to float32 (``loader/forms.py``): the parity tolerances of the suite are float32's, the same
on every machine; ``tests/loader/test_forms.py`` tests every form and the device rule at their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ["MOEPREP_EXPERT_DTYPE"] = "float32"  # before any test (and any worker it starts) loads
_IGNORED = {".venv", ".git", ".pytest_cache", ".ruff_cache", "__pycache__", ".gpu"}


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
    """A prepare root holding a tiny Qwen3-MoE under ``model/`` (``tests.tiny_models.tiny_recipe`` finds it)."""
    from tests.tiny_models import save_tiny_model

    save_tiny_model("qwen3_moe", tmp_path / "model")
    return tmp_path


@pytest.fixture(scope="session", autouse=True)
def repository_is_left_untouched():
    before = _tree()
    yield
    after = _tree()
    changed = sorted(k for k in after if before.get(k) != after[k])
    assert not changed, f"tests wrote into the repository: {changed[:10]}"
