"""What the studies share: a fresh calibration trace (text the predictors were not fitted on), and the study's
own outputs (study.json, study.md, study.png). A study merges its section into an artifact through
``prep.report.merge_section``."""

from __future__ import annotations

import io
from pathlib import Path

from loader.io import write_bytes_atomic, write_json_atomic, write_text_atomic
from prep.adapters import get_adapter, load_model
from prep.calibration import calibration_sequences, fingerprint_sequences
from prep.errors import MoeprepError
from prep.fingerprint import model_fingerprint
from prep.methods.trace import open_trace, record_traces
from prep.recipe import load_recipe


def figure_png(fig, dpi: int = 110) -> bytes:
    """A matplotlib figure laid out, as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    plt.close(fig)
    return png.getvalue()


def write_outputs(output: Path, study: dict, markdown: str, png: bytes | None = None) -> None:
    """``study.json``, ``study.md`` and (with a plot) ``study.png`` under ``output``, each atomically."""
    write_json_atomic(output / "study.json", study)
    write_text_atomic(output / "study.md", markdown)
    if png is not None:
        write_bytes_atomic(output / "study.png", png)


def fresh_trace(recipe_path: str | Path, root: Path, output: Path, seed: int, sequences: int) -> Path:
    """A trace of ``sequences`` calibration sequences drawn with ``seed`` under ``output`` (reused while the
    model, the calibration settings and the seed are unchanged)."""
    import torch


    recipe = load_recipe(recipe_path, (f"calibration.seed={seed}", f"calibration.num_sequences={sequences}"))
    if seed == load_recipe(recipe_path).calibration.seed:
        raise MoeprepError(f"--seed {seed} is the recipe's own calibration seed; pick another so the predictors "
                           "are measured on text they were not fitted on")
    model_dir = Path(recipe.model_path(root))
    if not (model_dir / "config.json").is_file():
        raise MoeprepError(f"model {model_dir} not found; set model.path in {recipe_path}")
    from transformers import AutoTokenizer

    seqs = calibration_sequences(recipe.calibration, AutoTokenizer.from_pretrained(model_dir), root)
    key = f"{model_fingerprint(model_dir)}:{fingerprint_sequences(seqs)}"
    path = output / f"trace-seed{seed}"
    if (path / "index.json").is_file():
        try:
            if open_trace(path).index.get("model_fingerprint") == key:
                return path
        except MoeprepError:
            pass
    model = load_model(model_dir, dtype="auto")
    return record_traces(model, seqs, path, adapter=get_adapter(model), hidden_dtype=torch.float16,
                         fingerprint=key, overwrite=True, progress=True)
