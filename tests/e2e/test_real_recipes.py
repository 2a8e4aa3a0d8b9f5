"""The seven real-model recipes: each one prepares a tiny checkpoint of its architecture saved in the
hub's naming, and the artifact's loader logits equal transformers' for that checkpoint.

The tiny checkpoints are written by ``save_pretrained`` with a small shard size: sharded safetensors with an
index, per-expert tensor names wherever the hub uses them (transformers converts its fused experts back to
the hub names on save), fused names for gpt-oss (as its hub checkpoint has them). The reference is
``from_pretrained`` of that directory with each expert replaced by the record the plan ships, decoded.
Only the calibration data and the sizes that cannot fit a tiny model are overridden.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from loader.routing import RoutingPolicy
from loader.runtime import load
from loader.vocab import BITS
from prep.adapters import get_adapter, load_model
from prep.cli import main
from prep.recipe import load_recipe
from tests.helpers.tiny_models import (
    build_tiny_model,
    planned_reference,
    save_fp8_qwen3,
    save_mxfp4_gpt_oss,
    tiny_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {  # recipe -> the architecture of its model
    "mixtral-8x7b": "mixtral",
    "phi-3.5-moe": "phimoe",
    "qwen1.5-moe-a2.7b": "qwen2_moe",
    "qwen3-30b-a3b": "qwen3_moe",
    "deepseek-v2-lite": "deepseek_v2",
    "olmoe-1b-7b": "olmoe",
    "gpt-oss-20b": "gpt_oss",
    "qwen3-30b-a3b-fp8": "qwen3_moe",
}
RELEASED_AS = {"gpt-oss-20b": save_mxfp4_gpt_oss, "qwen3-30b-a3b-fp8": save_fp8_qwen3}  # quantized releases
TINY = [  # calibration from a local file, and sizes a tiny model can take; everything else is the recipe's
    "calibration.source=files", "calibration.num_sequences=8", "calibration.sequence_length=16",
    "trace.batch=4", "quantize.group_size=16", "bitwidth.num_sequences=2", "gating.num_sequences=2",
    "divergence.num_sequences=8", "divergence.sequence_length=16", "divergence.text.source=files",
]


def save_hub_checkpoint(name: str, directory: Path):
    """A tiny model of recipe ``name``'s architecture saved as the hub ships it: sharded, with an index and hub
    tensor names; a quantized release (``RELEASED_AS``) in its own layout (gpt-oss's MXFP4 experts, Qwen3's FP8)."""
    if name in RELEASED_AS:
        return RELEASED_AS[name](directory, shards=True)[0]
    model = build_tiny_model(RECIPES[name])
    model.save_pretrained(directory, max_shard_size="40KB")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_names_its_model_and_config(name):
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert recipe.name == name and recipe.model.path is None and "/" in recipe.model.hub_id
    config = json.loads((ROOT / recipe.model.config).read_text())
    assert recipe.model.config == f"recipes/{name}/config.json"
    assert config["model_type"] == RECIPES[name]
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    assert f"https://huggingface.co/{recipe.model.hub_id}/blob/main/config.json" in text  # the config's source


def prepare_recipe(name: str, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(tiny hub checkpoint, artifact): ``recipes/<name>.yaml`` prepared by the CLI, one layer at a time."""
    arch = RECIPES[name]
    checkpoint = tmp_path / "checkpoint"
    save_hub_checkpoint(name, checkpoint)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    per_expert = any(".experts.0." in n for n in index)
    assert per_expert == (arch != "gpt_oss"), sorted(index)[:8]  # the hub's naming: per expert but for gpt-oss
    (tmp_path / "calibration.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "held-out.txt").write_text(" ".join(f"line {i} of other text" for i in range(200)))
    monkeypatch.chdir(tmp_path)  # the CLI writes artifacts/<name>/ under the working directory
    sets = [f"model.path={checkpoint}", f"calibration.files=[{tmp_path / 'calibration.txt'}]",
            f"divergence.text.files=[{tmp_path / 'held-out.txt'}]", *TINY]
    result = CliRunner().invoke(main, ["prepare", "--recipe", str(ROOT / "recipes" / f"{name}.yaml"),
                                       "--expert-memory", "0", "--output", str(tmp_path / "artifact"),
                                       *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    return checkpoint, tmp_path / "artifact"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_prepares_a_hub_checkpoint_to_transformers_logits(name, tmp_path, monkeypatch):
    checkpoint, artifact = prepare_recipe(name, tmp_path, monkeypatch)
    divergence = json.loads((artifact / "report.json").read_text())["divergence"]  # on in every recipe
    assert divergence["held_out"]["source"] == "files" and divergence["tokens"] == 8 * 15
    assert 0 <= divergence["stats"]["mean_kl"]["low"] <= divergence["stats"]["mean_kl"]["high"]

    source = load_model(checkpoint, dtype="auto")  # transformers' own reading of the hub names
    reference = planned_reference(source, artifact)
    ids = torch.randint(4, source.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    plan = json.loads((artifact / "plan.json").read_text())
    quantized = any(p in BITS for row in plan["expert_precision"] for p in row)
    assert plan.get("dense", "float") == ("int8" if quantized else "float")  # package.dense "auto"
    # the dense weights as stored: the test holds the experts to transformers (tests/loader/test_dense.py: int8)
    loaded = load(artifact, memory_budget="unlimited", routing=RoutingPolicy(), predictors=[], dense="float")
    try:
        with torch.no_grad():
            got, expected = loaded.model(input_ids=ids).logits, reference(input_ids=ids).logits
    finally:
        loaded.close()
    assert torch.allclose(got, expected, atol=1e-4), (name, float((got - expected).abs().max()))
    # the shipped records are the source's experts, quantized: each decoded expert is nearest to its own source
    # expert (no index or gate/up mix-up in the streamed reads), and not equal to it; gpt-oss's MXFP4 release kept
    # at mxfp4 is its own codes, equal
    lossless = load_recipe(ROOT / "recipes" / f"{name}.yaml").quantize.precision == "mxfp4"
    adapter = get_adapter(source)
    for layer in adapter.moe_layers:
        src = [adapter.get_expert(source, layer, e) for e in range(adapter.num_experts)]
        for e in range(adapter.num_experts):
            dec = adapter.get_expert(reference, layer, e)
            distance = [sum(float((a - b).norm()) for a, b in zip(dec.tensors().values(), s.tensors().values(),
                                                                    strict=True)) for s in src]
            assert min(range(len(src)), key=distance.__getitem__) == e, (name, layer, e, distance)
            if lossless:
                assert all(torch.equal(a.float(), b.float()) for a, b in zip(dec.tensors().values(),
                                                                           src[e].tensors().values(), strict=True))
                continue
            assert (dec.gate - src[e].gate).norm() < (dec.gate - src[e].up).norm()
            assert 0 < (dec.gate - src[e].gate).norm() < 0.5 * src[e].gate.norm()


SHARED = ROOT.parent / "shared" / "data" / "benchmarks"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/benchmarks (the real benchmark files) is absent")
def test_eval_on_the_real_benchmarks(tmp_path, monkeypatch):
    # the accuracy check of a real recipe's artifact on the real GSM8K, MMLU and TruthfulQA files, the original
    # model streamed one layer at a time
    _, artifact = prepare_recipe("qwen3-30b-a3b", tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["eval", "--artifact", str(artifact), "--data", str(SHARED), "--limit", "2",
                                       "--num-fewshot", "0", "--expert-memory", "0",
                                       # the divergence at the recipe's tiny sizes (TINY), not 64 windows of 256
                                       "--divergence-sequences", "8", "--divergence-length", "16",
                                       "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["data_layout"] == "original" and Path(report["data"]) == SHARED
    assert set(report["suites"]) == {"gsm8k", "mmlu", "truthfulqa_mc1", "truthfulqa_mc2"}
    assert all(s["n"] == 2 for s in report["suites"].values())
    merged = json.loads((artifact / "report.json").read_text())
    assert set(merged["eval"]["suites"]) == set(report["suites"])


def test_readme_tables_are_generated_and_current(tmp_path):
    from prep.inspect import EVAL_MARKERS, MARKERS, eval_time_table, models_table, update_readme

    recipes = sorted(str(p) for p in (ROOT / "recipes").glob("*.yaml"))
    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    table = models_table(recipes, root=ROOT)
    assert table.count("\n") == 2 + len(RECIPES)  # the reference recipes ship no config and are left out
    assert not update_readme(copy, table, MARKERS), "README.md's models table is stale: run the command in its marker"
    if SHARED.is_dir():
        assert not update_readme(copy, eval_time_table(recipes, SHARED, root=ROOT), EVAL_MARKERS), \
            "README.md's eval wall times are stale: run the command in its marker"


def test_a_model_that_is_not_here_gets_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["prepare", "--recipe", str(ROOT / "recipes" / "olmoe-1b-7b.yaml")])
    assert result.exit_code != 0
    message = " ".join(result.output.split())
    assert "hf download allenai/OLMoE-1B-7B-0924 --local-dir models/olmoe-1b-7b" in message
    assert "MODEL_PATH=models/olmoe-1b-7b" in message and "model.path" in message
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").rglob("manifest.json"))


def test_the_hub_cache_copy_is_found_without_a_path(tmp_path, monkeypatch):
    # the hub cache's layout: models--org--name/{refs/main, snapshots/<commit>/...}
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--allenai--OLMoE-1B-7B-0924"
    save_hub_checkpoint("olmoe-1b-7b", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(ROOT / "recipes" / "olmoe-1b-7b.yaml")
    assert Path(recipe.model_path(tmp_path)) == repo / "snapshots" / commit


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_needs_no_weights(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(ROOT)  # model.config is relative to the repository root
    result = CliRunner().invoke(main, ["prepare", "--recipe", f"recipes/{name}.yaml", "--dry-run"])
    # everything is estimated from the shipped config, and the run's one refusal is said: the weights are not here
    assert result.exit_code == 1 and "is not here" in result.output and "hf download" in result.output, result.output
    config = json.loads((ROOT / "recipes" / name / "config.json").read_text())
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    assert f"x {experts} experts" in result.output and "stages: trace, quantize" in result.output
    assert f"experts per layer cached at {load_recipe(ROOT / 'recipes' / f'{name}.yaml').quantize.precision}" \
        in result.output
    fmt = {"gpt-oss-20b": "MXFP4 experts", "qwen3-30b-a3b-fp8": "FP8 linear weights"}.get(name, "float weights")
    assert f"source: {fmt}" in result.output and "a pass over the checkpoint reads" in result.output
    assert ("dequantize-first instead" in result.output) == (name in RELEASED_AS)
    assert not (ROOT / "artifacts" / name).exists()  # nothing prepared, nothing written
