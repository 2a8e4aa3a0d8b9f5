"""The reference model's prepared artifacts that many tests read, each prepared once per run (``tests.helpers.shared``)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.shared import shared_store

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "reference" / "model"


def reference_lossless(tmp_path_factory) -> Path:
    """The root of ``recipes/reference-lossless.yaml`` prepared at 8 calibration sequences (the artifact under
    ``artifacts/reference-lossless/artifact``, every stage's result under ``.../stages``). Eight, because the
    prediction stage holds out the last quarter of them to measure its recall on."""
    from prep.pipeline import prepare
    from prep.recipe import load_recipe

    def build(root: Path) -> None:
        prepare(load_recipe(REPO / "recipes/reference-lossless.yaml",
                            (f"model.path={MODEL}", "calibration.num_sequences=8")), root=root)

    return shared_store(tmp_path_factory).get("reference-lossless", build)
