"""Recipes and the resumable pipeline: strict keys, overrides, caching, --force/--until, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from prep import pipeline
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.fingerprint import model_fingerprint
from prep.pipeline import prepare
from prep.recipe import load_recipe, recipe_from_dict
from prep.stages import quantize as quantize_stage
from tests.helpers.interrupt import interrupted, uninterrupted
from tests.helpers.tiny_models import file_hashes, tiny_recipe

REPO = Path(__file__).resolve().parents[3]




def test_shipped_recipes_load():
    for path in (REPO / "recipes").glob("*.yaml"):
        recipe = load_recipe(path)
        assert recipe.name == path.stem
    assert load_recipe(REPO / "recipes/reference.yaml", ("quantize.group_size=32",)).quantize.group_size == 32


def test_unknown_key_names_key_and_allowed(tmp_path):
    with pytest.raises(MoeprepError, match=r"unknown key 'bits' in quantize; allowed keys: precision, group_size"):
        load_recipe(REPO / "recipes/reference.yaml", ("quantize.bits=3",))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: x}\nquantise: {precision: int4}\n")
    with pytest.raises(MoeprepError, match="unknown key 'quantise'"):
        load_recipe(bad)
    with pytest.raises(MoeprepError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(MoeprepError, match="precision"):
        recipe_from_dict({"model": {"path": "m"}, "name": "x", "quantize": {"precision": "int5"}})
    with pytest.raises(MoeprepError, match="must be int"):
        recipe_from_dict({"model": {"path": "m"}, "name": "x", "quantize": {"group_size": "big"}})
    for section, key, value, hint in (("trace", "hidden_dtype", "float8", "float16"),
                                      ("calibration", "source", "web", "reference"),
                                      ("evaluate", "suites", ["hellaswag"], "gsm8k")):
        with pytest.raises(MoeprepError, match=f"{section}.{key}.*{hint}"):
            recipe_from_dict({"model": {"path": "m"}, "name": "x", section: {key: value}})


def test_cli_errors_are_clean(tmp_path):
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(REPO / "recipes/reference.yaml"),
                                          "--set", "trace.colour=red"])
    assert result.exit_code == 1 and "unknown key 'colour' in trace" in result.output
    assert "Traceback" not in result.output
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: no/such/model}\n")
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(recipe)])
    assert result.exit_code == 1 and "no/such/model" in result.output


def test_rerun_is_cached_and_force_reruns_from_stage(root):
    first = prepare(tiny_recipe(), root=root)
    assert not any(first[s]["cached"] for s in ("trace", "quantize", "package"))
    second = prepare(tiny_recipe(), root=root)
    assert all(second[s]["cached"] for s in ("trace", "quantize", "package"))
    forced = prepare(tiny_recipe(), root=root, force="quantize")
    assert forced["trace"]["cached"] and not forced["quantize"]["cached"] and not forced["package"]["cached"]
    changed = prepare(tiny_recipe(group_size=8), root=root)
    assert changed["trace"]["cached"] and not changed["quantize"]["cached"]
    partial = prepare(tiny_recipe(precision="int8"), root=root, until="quantize")
    assert "package" not in partial and partial["artifact"] is None
    with pytest.raises(MoeprepError, match="not a stage"):
        prepare(tiny_recipe(), root=root, until="bake")


def test_retrained_weights_of_the_same_shapes_are_not_served_from_cache(root, monkeypatch):
    """A retrained model keeps names, shapes and header; only its weights change, and that must show."""
    from safetensors.torch import load_file, save_file

    first = prepare(tiny_recipe(), root=root)
    shards = sorted((root / "model").glob("*.safetensors"))
    before = model_fingerprint(root / "model")
    tensors = load_file(shards[0])
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, shards[0], metadata={"format": "pt"})
    after = model_fingerprint(root / "model")
    assert after != before
    rerun = prepare(tiny_recipe(), root=root)
    assert not rerun["trace"]["cached"] and rerun["trace"]["key"] != first["trace"]["key"]
    # the sampled path for big files sees the change too
    monkeypatch.setattr("prep.fingerprint.FULL_HASH_BYTES", 0)
    monkeypatch.setattr("prep.fingerprint.BLOCK_BYTES", 64)
    monkeypatch.setattr("prep.fingerprint.SAMPLED_BLOCKS", shards[0].stat().st_size // 64 + 1)
    sampled = model_fingerprint(root / "model")
    tensors[name] = tensors[name] - 1e-3
    save_file(tensors, shards[0], metadata={"format": "pt"})
    assert model_fingerprint(root / "model") != sampled


def test_killed_quantize_resumes_to_identical_artifact(root, tmp_path_factory, monkeypatch):
    clean_root, _ = uninterrupted(tmp_path_factory, tiny_recipe())
    # the tiny model has 8 experts per layer: layer one done, layer two not
    with interrupted(monkeypatch, quantize_stage, "encode_expert", on_call=11):
        prepare(tiny_recipe(), root=root)
    assert not (root / "artifacts/tiny/artifact").exists()
    work = next((root / "artifacts/tiny/stages").glob(".work-quantize-*"))
    assert [p.name for p in work.glob("int4/layer-*.safetensors")] == ["layer-0.safetensors"]

    resumed = prepare(tiny_recipe(), root=root)
    assert resumed["trace"]["cached"] and not resumed["quantize"]["cached"]
    assert file_hashes(root / "artifacts/tiny/artifact") == file_hashes(clean_root / "artifacts/tiny/artifact")


def test_manifest_is_schema_2(root):
    """The manifest carries what the loader needs without guessing (CONTRACT: schema_version 5)."""
    import json

    from xxhash import xxh3_64_intdigest

    from loader.format import read_record_offsets
    from loader.plan import Plan

    summary = prepare(tiny_recipe(), root=root)
    artifact = Path(summary["artifact"])
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == 5 and manifest["format"] == "moeprep-artifact"
    assert len(manifest["package_key"]) == 64 and manifest["package_key"].startswith(summary["package"]["key"])
    moe = manifest["moe"]
    assert moe["router_modules"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert moe["experts_modules"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert moe["last_decoder_layer"] == "model.layers.1"
    assert moe["source_expert_bytes"] == 2 * 8 * 3 * 16 * 32 * 4  # L x E x (gate, up, down) x I x H x float32
    store = manifest["stores"]["int4"]
    offsets, record_bytes, _ = read_record_offsets(artifact / store["file"])
    assert set(store["xxh3"]) == set(offsets) and len(offsets) == 16
    with open(artifact / store["file"], "rb") as f:
        for key, offset in offsets.items():
            f.seek(offset)
            assert xxh3_64_intdigest(f.read(record_bytes)) == store["xxh3"][key]
    plan = Plan.from_json(json.loads((artifact / "plan.json").read_text()))
    assert plan == Plan.default(2, 8, "int4", default_budget="50%")
    assert set(manifest["files"]) == {p.name for p in artifact.iterdir()} - {"manifest.json"}


def test_changing_a_setting_and_back_serves_the_right_artifact(root):
    """A setting changed and changed back: int4 -> int8 -> int4 must not serve the int8 artifact as "cached"."""
    import json

    first = prepare(tiny_recipe(), root=root)
    int4 = file_hashes(Path(first["artifact"]))
    prepare(tiny_recipe(precision="int8"), root=root)
    back = prepare(tiny_recipe(), root=root)
    assert back["quantize"]["cached"] and not back["package"]["cached"]  # rebuilt from the cached quantize
    artifact = Path(back["artifact"])
    assert file_hashes(artifact) == int4
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert list(manifest["stores"]) == ["int4"] and manifest["package_key"].startswith(back["package"]["key"])
    assert prepare(tiny_recipe(), root=root)["package"]["cached"]


def test_keys_cover_only_what_a_stage_declares(root):
    base = prepare(tiny_recipe(), root=root)
    # trace settings and calibration data are not inputs of quantize; they are of package, whose artifact carries
    # the trace's first sequences as its routing sample (``moeload plan`` predicts with it)
    for change in ({"trace": {"hidden_dtype": "float32"}}, {"calibration": {"seed": 7}}):
        recipe = recipe_from_dict(tiny_recipe().to_dict() | change | {
            "calibration": tiny_recipe().to_dict()["calibration"] | change.get("calibration", {})})
        rerun = prepare(recipe, root=root)
        assert not rerun["trace"]["cached"], change
        assert rerun["quantize"]["cached"] and rerun["quantize"]["key"] == base["quantize"]["key"], change
        assert not rerun["package"]["cached"] and rerun["package"]["key"] != base["package"]["key"], change
    # the package section is not an input of quantize
    rerun = prepare(recipe_from_dict(tiny_recipe().to_dict() | {"package": {"cache_fraction": 0.25}}), root=root)
    assert rerun["quantize"]["cached"] and not rerun["package"]["cached"]


def test_fully_cached_run_loads_no_model(root, monkeypatch):

    prepare(tiny_recipe(), root=root)

    def refuse(*args, **kwargs):
        raise AssertionError("a fully cached run loaded the model")

    monkeypatch.setattr(pipeline, "load_streamed", refuse)  # the name the pipeline calls
    again = prepare(tiny_recipe(), root=root)
    assert all(again[s]["cached"] for s in ("trace", "quantize", "package"))
    with pytest.raises(AssertionError, match="loaded the model"):  # a stage that needs it does load it
        prepare(tiny_recipe(group_size=8), root=root)


def test_a_stage_is_one_table_entry_and_gets_only_what_it_declares(root, monkeypatch):
    """A new stage: a module-level Stage and one entry in STAGES; prepare() needs no change."""
    from dataclasses import dataclass

    from prep.stages import Stage, StageResult
    from prep.stages.trace import TraceSection

    @dataclass(frozen=True)
    class Count(StageResult):
        records: int

    def count_records(inputs):
        directory, packed = inputs.upstream("quantize")
        return Count(records=len(packed.records(directory)))

    counting = Stage(name="count", version=1, config=TraceSection, section="trace", result=Count, reads=("quantize",),
                     run=count_records)
    monkeypatch.setattr(pipeline, "STAGES", (*pipeline.STAGES, counting))
    monkeypatch.setattr(pipeline, "STAGE_NAMES", (*pipeline.STAGE_NAMES, "count"))
    first = prepare(tiny_recipe(), root=root)
    assert not first["count"]["cached"]
    stage_dir = next((root / "artifacts/tiny/stages").glob("count-*"))
    assert Count.load(stage_dir) == Count(records=16)
    assert prepare(tiny_recipe(), root=root)["count"]["cached"]

    def peeks(inputs):
        return Count(records=inputs.model.config.num_experts)

    sneaky = Stage(name="sneaky", version=1, config=TraceSection, section="trace", result=Count, run=peeks)
    monkeypatch.setattr(pipeline, "STAGES", (*pipeline.STAGES, sneaky))
    with pytest.raises(TypeError, match="does not declare it in needs"):
        prepare(tiny_recipe(), root=root)


def test_stage_results_round_trip(tmp_path):
    import torch

    for stage in pipeline.STAGES:
        assert issubclass(stage.result, pipeline.StageResult) and stage.result.__dataclass_params__.frozen
    from prep.stages.trace import RoutingTraces

    result = RoutingTraces(tokens=3, layers=[0, 1], expert_share=[[0.5, 0.5], [1.0, 0.0]])
    result.save(tmp_path, tensors={"x": torch.arange(4)}, stage="trace")
    assert RoutingTraces.load(tmp_path) == result
    assert RoutingTraces.load_tensors(tmp_path)["x"].tolist() == [0, 1, 2, 3]


def test_prepare_has_no_per_stage_branch():
    import inspect

    source = inspect.getsource(pipeline._run_stages) + inspect.getsource(pipeline.prepare)
    for stage in pipeline.STAGE_NAMES:
        assert f'"{stage}"' not in source and f"'{stage}'" not in source
    assert not hasattr(pipeline, "describe_stages")


def test_calibration_sources_are_a_registry(tmp_path):
    import ast

    from prep import calibration

    tree = ast.parse(Path(calibration.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not any(m and m.startswith("prep.reference") for m in imported)
    assert {"reference", "files", "dataset"} <= set(calibration.SOURCES)
    calibration.register_calibration_source("constant", lambda section, root: iter(["a b c d"] * 100))
    try:
        recipe = recipe_from_dict({"name": "x", "model": {"path": "m"},
                                   "calibration": {"source": "constant", "num_sequences": 2, "sequence_length": 4}})

        class Tok:
            eos_token_id = 0

            def __call__(self, text):
                return {"input_ids": [1, 2, 3, 4]}

        seqs = calibration.calibration_sequences(recipe.calibration, Tok(), tmp_path)
        assert [s.tolist() for s in seqs] == [[1, 2, 3, 4], [0, 1, 2, 3]]
    finally:
        del calibration.SOURCES["constant"]


def test_a_failed_stage_leaves_no_scratch_directory(root, monkeypatch):
    """A stage that fails (an error, not an interruption) leaves no ``.work-*`` directory in the stage cache; an
    interruption keeps its units to resume from (``test_killed_quantize_resumes_to_identical_artifact``)."""
    def fails(*args, **kwargs):
        raise MoeprepError("this expert cannot be encoded")

    monkeypatch.setattr(quantize_stage, "encode_expert", fails)
    with pytest.raises(MoeprepError, match="cannot be encoded"):
        prepare(tiny_recipe(), root=root)
    assert not list((root / "artifacts/tiny/stages").glob(".work-*"))
