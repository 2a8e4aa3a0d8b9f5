"""The ordered stage table, cache keys, resume, ``--until`` and ``--force``.

``prepare(recipe)`` walks ``STAGES`` in order. Each stage's key covers its name and version, its
recipe section, the keys of the stages before it, and the model and calibration-data fingerprints
(see ``prep/store.py``); a stage whose key already has a complete result is skipped. ``force`` reruns
the named stage and every stage after it; ``until`` stops after the named stage.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from prep.errors import MoeprepError
from prep.recipe import Recipe
from prep.stages import evaluate, package, quantize, trace
from prep.store import StageStore, stage_key


@dataclass(frozen=True)
class Stage:
    name: str
    version: int
    section: str  # the recipe section that configures it


STAGES = (
    Stage("trace", trace.VERSION, "trace"),
    Stage("quantize", quantize.VERSION, "quantize"),
    Stage("package", package.VERSION, "package"),
    Stage("evaluate", evaluate.VERSION, "evaluate"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


FULL_HASH_BYTES = 1 << 30  # safetensors files up to this size are hashed whole
SAMPLED_BLOCKS = 64  # bigger ones: their header and this many evenly spaced blocks
BLOCK_BYTES = 1 << 16


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the content of every safetensors file.

    Files up to ``FULL_HASH_BYTES`` are hashed whole (a retrained model keeps its shapes, so names, sizes
    and headers alone would reuse stale cached stages); bigger ones by size, header and evenly spaced
    blocks, so that fingerprinting a 90 GB checkpoint stays cheap while any retraining still shows.
    """
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(path.name.encode() + str(size).encode())
        with open(path, "rb") as f:
            if size <= FULL_HASH_BYTES:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
                continue
            head = f.read(8)
            digest.update(f.read(int.from_bytes(head, "little")) if len(head) == 8 else b"")
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()


def _check_stage(name: str | None, what: str) -> None:
    if name is not None and name not in STAGE_NAMES:
        raise MoeprepError(f"{what} {name!r} is not a stage; stages in order: {', '.join(STAGE_NAMES)}")


def prepare(recipe: Recipe, root: str | Path = ".", output: str | Path | None = None,
            until: str | None = None, force: str | None = None) -> dict:
    """Run the pipeline for ``recipe``; returns {stage: {key, seconds, cached}} and the artifact path."""
    from prep.adapters import get_adapter, load_model
    from prep.calibration import calibration_sequences, fingerprint_sequences

    _check_stage(until, "--until")
    _check_stage(force, "--force")
    root = Path(root)
    model_ref = recipe.model_path(root)
    model_dir = Path(model_ref)
    if not model_dir.is_dir():
        raise MoeprepError(f"model {recipe.model.path!r} is not a local directory (looked in {root}); "
                           "download it first and set model.path to its directory")
    work_root = root / "artifacts" / recipe.name
    store = StageStore(work_root / "stages")
    out_dir = Path(output) if output else work_root / "artifact"

    from transformers import AutoTokenizer

    model = load_model(model_dir, dtype="auto")
    adapter = get_adapter(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sequences = calibration_sequences(recipe.calibration, tokenizer, root)
    fingerprints = {"model": model_fingerprint(model_dir), "data": fingerprint_sequences(sequences)}
    source = {"path": recipe.model.path, "revision": recipe.model.revision, "fingerprint": fingerprints["model"]}
    sections = recipe.to_dict()

    forced = False
    upstream: dict[str, str] = {}
    summary: dict = {}
    timings: dict = {}
    for stage in tqdm(STAGES, desc="prepare", unit="stage", leave=False):
        config = {"section": sections[stage.section], "calibration": sections["calibration"]}
        if stage.name == "package":
            config["output"] = str(out_dir)
        key = stage_key(stage.name, stage.version, config, dict(upstream), fingerprints)
        forced = forced or stage.name == force
        if forced:
            store.discard(stage.name, key)
        if stage.name == "evaluate" and not recipe.evaluate.enabled:
            summary[stage.name] = {"key": key[:16], "seconds": 0.0, "cached": False, "skipped": True}
            continue
        cached = store.is_complete(stage.name, key)
        if stage.name == "package":  # its real output lives outside the stage cache: it must still exist
            cached = cached and (out_dir / "manifest.json").is_file()
        if stage.name == "evaluate":  # its summary lives in the artifact's report.json: it must be there
            report = out_dir / "report.json"
            cached = cached and report.is_file() and "eval" in json.loads(report.read_text())
        started = time.perf_counter()
        if not cached:
            work = store.work_dir(stage.name, key)
            if stage.name == "trace":
                result = trace.record_routing(model, adapter, sequences, recipe.trace, work, fingerprints["model"])
            elif stage.name == "quantize":
                result = quantize.quantize_experts(model, adapter, recipe.quantize, work)
            elif stage.name == "evaluate":
                result = evaluate.check_accuracy(out_dir, model_dir, recipe.evaluate, work, root)
            else:
                q_key = upstream["quantize"]
                result = package.package_artifact(
                    model, adapter, tokenizer, recipe, source, store.final_dir("quantize", q_key),
                    store.result("quantize", q_key), out_dir, key)
            result["recipe"] = sections
            store.commit(stage.name, key, work, result)
        seconds = round(time.perf_counter() - started, 3)
        timings[stage.name] = seconds
        summary[stage.name] = {"key": key[:16], "seconds": seconds, "cached": cached}
        upstream[stage.name] = key
        if stage.name == until:
            break
    summary["artifact"] = str(out_dir) if "package" in upstream else None
    return summary


def describe_stages() -> str:
    return json.dumps([asdict(s) for s in STAGES])
