"""`moeprep inspect-model`: the adapter's view of saved tiny models, and clean errors for bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from prep.adapters import describe
from prep.cli import main
from tests.helpers.tiny_models import ARCHITECTURES, build_tiny_model, tiny_llama

EXPECTED = {  # (moe_layers, num_experts, top_k, num_shared_experts) by construction of tests/helpers/tiny_models.py
    "mixtral": ([0, 1], 4, 2, 0),
    "qwen2_moe": ([0, 2], 6, 2, 1),
    "qwen3_moe": ([0, 1], 8, 2, 0),
    "olmoe": ([0, 1], 8, 2, 0),
    "phimoe": ([0, 1], 4, 2, 0),
    "deepseek_v2": ([1, 2], 8, 3, 2),
    "gpt_oss": ([0, 1], 4, 2, 0),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every tiny model saved with save_pretrained; returns {arch: (dir, model)}."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ARCHITECTURES:
        model = build_tiny_model(arch)
        model.save_pretrained(root / arch)
        out[arch] = (root / arch, model)
    tiny_llama().save_pretrained(root / "llama")
    out["llama"] = (root / "llama", None)
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_inspect_model_json(arch, saved):
    path, model = saved[arch]
    result = CliRunner().invoke(main, ["inspect-model", str(path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    moe_layers, experts, top_k, shared = EXPECTED[arch]
    assert info["model_type"] == arch
    assert (info["moe_layers"], info["num_experts"], info["top_k"], info["num_shared_experts"]) == (
        moe_layers,
        experts,
        top_k,
        shared,
    )
    assert info["num_moe_layers"] == len(moe_layers)
    # Built on the meta device from config.json, it agrees with the loaded model in every count.
    assert {k: v for k, v in info.items() if k in describe(model)} == describe(model)
    assert info["checkpoint_files"] == 1 and info["checkpoint_dtypes"] == {"F32": info["checkpoint_tensors"]}


def test_inspect_model_table(saved):
    result = CliRunner().invoke(main, ["inspect-model", str(saved["deepseek_v2"][0])])
    assert result.exit_code == 0, result.output
    assert "DeepSeek-V2" in result.stdout and "num_shared_experts" in result.stdout


def test_inspect_model_unknown_architecture(saved):
    result = CliRunner().invoke(main, ["inspect-model", str(saved["llama"][0])])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: unsupported architecture 'llama'")
    assert "Mixtral" in result.stderr and "gpt-oss" in result.stderr
    assert "Traceback" not in result.output


def test_inspect_model_missing_path(tmp_path):
    result = CliRunner().invoke(main, ["inspect-model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert result.stderr == f"error: model directory {tmp_path / 'nope'} does not exist\n"


def test_inspect_model_hub_id_without_network(monkeypatch):
    # No network in tests: stand in for the hub failing the way it does offline.
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    result = CliRunner().invoke(main, ["inspect-model", "mistralai/Mixtral-8x7B-v0.1"])
    assert result.exit_code == 1
    assert "pass its local directory" in result.stderr
