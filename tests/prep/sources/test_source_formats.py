"""Released quantized checkpoints read as they ship: gpt-oss's MXFP4 experts and block-scaled FP8 weights.

The references are independent of ``prep/adapters/source_formats.py``: transformers' own MXFP4 dequantization
(``convert_moe_packed_tensors``, which runs on the CPU) and, for FP8, the format's definition written in
``tests/helpers/tiny_models.py`` (weight times its block's scale).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from prep.adapters import get_adapter
from prep.adapters.checkpoint import CheckpointTensors
from prep.adapters.source_formats import fp8_dequantize, mxfp4_dequantize, mxfp4_quantize
from prep.errors import MoeprepError
from prep.streaming import load_streamed
from tests.helpers.tiny_models import save_fp8_qwen3, save_mxfp4_gpt_oss


def test_mxfp4_dequantization_equals_transformers_on_every_code_and_scale():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # every byte, every scale whose values all fit float32 (253 and 254 overflow for the large codes: refused,
    # tests/prep/sources/test_checkpoint_trust.py)
    n = 253
    blocks = torch.arange(256, dtype=torch.uint8).repeat(n, 1).view(n, 16, 16)
    scales = torch.arange(n, dtype=torch.uint8).view(n, 1).repeat(1, 16)
    ours = mxfp4_dequantize(blocks.view(1, n, 16, 16), scales.view(1, n, 16))[0]  # [rows, cols]
    theirs = convert_moe_packed_tensors(blocks.view(1, n, 16, 16), scales.view(1, n, 16), dtype=torch.float32)[0]
    assert torch.equal(ours.T, theirs)  # theirs is [cols, rows], as GptOssExperts holds it
    assert torch.equal(ours.bfloat16().T, convert_moe_packed_tensors(blocks.view(1, n, 16, 16),
                                                                     scales.view(1, n, 16), dtype=torch.bfloat16)[0])


def test_mxfp4_quantize_rounds_to_the_nearest_code_and_round_trips_its_own_grid():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen) * 0.05
    blocks, scales = mxfp4_quantize(w)
    back = mxfp4_dequantize(blocks.view(8, 2, 16), scales)
    grid = mxfp4_dequantize(torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(8, 16, 16).reshape(8, 16, 16),
                            scales[:, :1].expand(8, 16).contiguous())  # every value of each row's first scale
    for r in range(8):  # brute force: each weight of the first group is the nearest value on its scale's grid
        values = grid[r].unique()
        nearest = values[(w[r, :32, None] - values).abs().argmin(1)]
        assert torch.equal(back[r, :32].abs(), nearest.abs())
    blocks2, scales2 = mxfp4_quantize(back)
    assert torch.equal(blocks2, blocks) and torch.equal(scales2, scales)  # values on the grid keep their codes


def test_fp8_dequantization_equals_the_format_definition(tmp_path, one_thread):
    model, quantized = save_fp8_qwen3(tmp_path / "fp8")
    tensors = CheckpointTensors(tmp_path / "fp8")
    assert tensors.block == (16, 16)
    for name, (q, scale_inv) in list(quantized.items())[:6]:
        full = scale_inv.repeat_interleave(16, 0)[:q.shape[0]].repeat_interleave(16, 1)[:, :q.shape[1]]
        assert torch.equal(tensors.get_float(name), q.float() * full)
    source = load_streamed(tmp_path / "fp8", resident_bytes=0)
    adapter = get_adapter(source)
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            got = adapter.read_expert(tmp_path / "fp8", layer, expert, tensors=tensors)
            want = adapter.get_expert(model, layer, expert)
            assert torch.equal(got.gate, want.gate) and torch.equal(got.up, want.up) and torch.equal(got.down,
                                                                                                   want.down)
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(source(input_ids=x).logits, model(input_ids=x).logits)


def test_mxfp4_checkpoint_streams_as_transformers_dequantizes_it(tmp_path, one_thread):
    model, _ = save_mxfp4_gpt_oss(tmp_path / "mx")
    source = load_streamed(tmp_path / "mx", resident_bytes=0)
    adapter = get_adapter(source)
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            got = adapter.read_expert(tmp_path / "mx", layer, expert)
            want = adapter.get_expert(model, layer, expert)
            for a, b in zip(got.tensors().values(), want.tensors().values(), strict=True):
                assert torch.equal(a.float(), b.float())
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(source(input_ids=x).logits, model(input_ids=x).logits)


def test_preparing_mxfp4_at_mxfp4_keeps_the_release_bytes_and_runs_bit_identical(tmp_path, one_thread):
    from loader.codec import RecordLayout
    from loader.format import expert_key
    from loader.runtime import load
    from prep.pipeline import prepare
    from prep.recipe import recipe_from_dict

    model, codes = save_mxfp4_gpt_oss(tmp_path / "model")
    recipe = recipe_from_dict({"name": "tiny", "model": {"path": "model"},
                               "calibration": {"num_sequences": 2, "sequence_length": 16},
                               "quantize": {"precision": "mxfp4", "also": ["int4"], "group_size": 32},
                               "divergence": {"num_sequences": 4, "sequence_length": 16}})
    prepare(recipe, root=tmp_path, output=tmp_path / "artifact")
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    store = manifest["stores"]["mxfp4"]
    layout = RecordLayout.from_json(store["layout"])
    assert {s.name: s.precision for s in layout.matrices} == {"gate_up_proj": "mxfp4", "gate_up_proj_bias":
                                                              "passthrough", "down_proj": "mxfp4",
                                                              "down_proj_bias": "passthrough"}
    with safe_open(tmp_path / "artifact" / store["file"], framework="pt") as f:
        for layer in range(model.config.num_hidden_layers):
            for expert in range(model.config.num_local_experts):
                parts = layout.split(f.get_tensor(expert_key(layer, expert)))
                for name in ("gate_up_proj", "down_proj"):
                    prefix = f"model.layers.{layer}.mlp.experts.{name}"
                    assert torch.equal(parts[f"{name}.codes"], codes[f"{prefix}_blocks"][expert].reshape(-1))
                    assert torch.equal(parts[f"{name}.scales"], codes[f"{prefix}_scales"][expert].reshape(-1))
    loaded = load(tmp_path / "artifact", memory_budget="unlimited", expert_dtype="float32")
    x = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=x).logits, model(input_ids=x).logits)
    loaded.close()
    divergence = json.loads((tmp_path / "artifact" / "report.json").read_text())["divergence"]
    assert divergence["stats"]["mean_kl"]["value"] == 0.0  # the float32 form: the source's own values
    matrices = [s for s in layout.matrices if s.precision == "mxfp4"]  # 4 bits a weight and 8 per 32
    assert sum(size for s in matrices for _n, _d, size in s.parts()) * 8 == 4.25 * sum(s.numel for s in matrices)


def _rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


BLOCKS = "model.layers.1.mlp.experts.down_proj_blocks"
SCALES = "model.layers.1.mlp.experts.down_proj_scales"


@pytest.mark.parametrize("damage, names", [
    (lambda t: t.__setitem__(BLOCKS, t[BLOCKS][..., :8].contiguous()), [BLOCKS, "16"]),
    (lambda t: t.__setitem__(SCALES, t[SCALES][:, :, :0].contiguous()), [SCALES, "one per block"]),
    (lambda t: t[SCALES].__setitem__((2, 5, 0), 255), [SCALES, "NaN"]),
])
def test_a_malformed_mxfp4_tensor_is_one_error_naming_it_and_its_shard(tmp_path, damage, names):
    save_mxfp4_gpt_oss(tmp_path / "mx")
    _rewrite(tmp_path / "mx" / "model.safetensors", damage)
    adapter = get_adapter(load_streamed(tmp_path / "mx", resident_bytes=0))
    with pytest.raises(MoeprepError) as e:
        for expert in range(adapter.num_experts):
            adapter.read_expert(tmp_path / "mx", 1, expert)
    assert all(n in str(e.value) for n in [*names, "model.safetensors"]), str(e.value)


def test_a_malformed_fp8_tensor_is_one_error_naming_it_and_its_shard(tmp_path):
    save_fp8_qwen3(tmp_path / "fp8")
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    _rewrite(tmp_path / "fp8" / "model.safetensors", lambda t: t[f"{name}_scale_inv"].__setitem__((0, 0), float("nan")))
    with pytest.raises(MoeprepError, match=rf"{name}_scale_inv in shard model.safetensors.*nan"):
        CheckpointTensors(tmp_path / "fp8").get_float(name)
    save_fp8_qwen3(tmp_path / "fp8")
    _rewrite(tmp_path / "fp8" / "model.safetensors",
             lambda t: t.__setitem__(f"{name}_scale_inv", t[f"{name}_scale_inv"][:, :1].contiguous()))
    with pytest.raises(MoeprepError, match=rf"{name}_scale_inv in shard model.safetensors.*block scales"):
        CheckpointTensors(tmp_path / "fp8").get_float(name)
    with pytest.raises(MoeprepError, match="float8_e4m3fn"):
        fp8_dequantize(torch.zeros(4, 4), torch.ones(1, 1), tensor="w", shard="s")


def test_a_truncated_shard_is_one_error_naming_the_tensor_and_the_shard(tmp_path):
    save_mxfp4_gpt_oss(tmp_path / "mx")
    shard = tmp_path / "mx" / "model.safetensors"
    index = {"metadata": {}, "weight_map": {}}
    with safe_open(shard, framework="pt") as f:
        index["weight_map"] = dict.fromkeys(f.keys(), "model.safetensors")
    (tmp_path / "mx" / "model.safetensors.index.json").write_text(json.dumps(index))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(MoeprepError, match=r"tensor \S+ in shard model.safetensors cannot be read"):
        load_streamed(tmp_path / "mx", resident_bytes=0)


def test_the_bit_width_search_takes_mxfp4_as_one_more_precision(tmp_path):
    # EdgeMoE's bounds over int8, mxfp4 and int2 on the MXFP4 release: mxfp4 is its own codes, so its bound is
    # exactly 0 (the decoded records are the source's values), and it is the search's upper precision
    from prep.pipeline import prepare
    from prep.recipe import recipe_from_dict

    save_mxfp4_gpt_oss(tmp_path / "model")
    recipe = recipe_from_dict({"name": "tiny", "model": {"path": "model"},
                               "calibration": {"num_sequences": 4, "sequence_length": 16},
                               "quantize": {"precision": "mxfp4", "also": ["int8", "int2"], "group_size": 32},
                               "sensitivity": {"method": "sweep", "precision": "int2"},
                               "bitwidth": {"method": "edgemoe", "tolerance": 0.0, "num_sequences": 2},
                               "divergence": {"enabled": False}})
    prepare(recipe, root=tmp_path, output=tmp_path / "artifact")
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    chosen = json.loads((tmp_path / "artifact" / "report.json").read_text())["bitwidth"]
    bounds = chosen["bounds"]
    assert set(bounds) == {"int8", "mxfp4", "int2"}
    assert bounds["mxfp4"] == 0.0 and bounds["int8"] > 0 and bounds["int2"] > bounds["int8"]
    # within a zero tolerance: the release's codes, and int2 only for experts the held-out tokens never reach
    assert chosen["b_hi"] == "mxfp4" and chosen["loss"] == 0.0 and chosen["experts"]["mxfp4"] >= 1
    assert set(manifest["stores"]) <= {"mxfp4", "int2"} and "mxfp4" in manifest["stores"]


def test_a_device_profile_without_mxfp4_times_it_as_its_bfloat16_form():
    # an mxfp4 record is held decoded in bfloat16 (loader/forms.py's rule for a quantized store), so a profile measured
    # before the precision existed prices its compute as bfloat16's and the making of its form as int4's decode
    from loader.device import DeviceProfile, ModelingError

    profile = DeviceProfile(2e9, 1e-4, {"bfloat16": 3e-4, "int4": 5e-4}, "cpu", make_seconds={"int4": 2e-3})
    assert profile.compute("mxfp4") == 3e-4 and profile.make("mxfp4") == 2e-3
    assert DeviceProfile(2e9, 1e-4, {"bfloat16": 3e-4, "mxfp4": 4e-4}, "cpu").compute("mxfp4") == 4e-4
    with pytest.raises(ModelingError, match="no compute time for precision 'int3'"):
        profile.compute("int3")


def test_a_quantization_this_reader_cannot_dequantize_is_refused_before_any_read(tmp_path):
    model, _ = save_mxfp4_gpt_oss(tmp_path / "mx")
    raw = json.loads((tmp_path / "mx" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(MoeprepError, match="quant_method is 'gptq'.*mxfp4 and fp8"):
        load_streamed(tmp_path / "mx", resident_bytes=0)
