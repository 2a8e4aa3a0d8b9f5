"""The bench tests' shared build: the quick mixtral-shape subject (its model, passthrough and int4 artifacts),
built once per run and copied into each test's bench output, where ``mixtral_shape_subject`` reuses what is current
instead of preparing it again (``prep/studies/bench/subjects.py``). What a test then measures is its own."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.shared import shared_store, writable_copy

QUICK_HOME = "mixtral-shape-quick"


def seed_quick_shape(tmp_path_factory, output: Path) -> Path:
    """``output`` holding a copy of the shared quick mixtral-shape subject; returns ``output``."""
    from prep.studies.bench.subjects import mixtral_shape_subject

    def build(directory: Path) -> None:
        mixtral_shape_subject(directory, None, True, 4, 4)  # no traces: nothing beside the model and artifacts

    built = shared_store(tmp_path_factory).get("bench-quick-shape", build)
    output.mkdir(parents=True, exist_ok=True)
    writable_copy(built / QUICK_HOME, output / QUICK_HOME)
    return output
