"""A released checkpoint is trusted for nothing it says: its numbers are checked where they are dequantized, every
quantized weight must come with its scales (and every scale with its weight), its shard index cannot name a file
outside the model directory, and a config of the wrong type is one clear error.

The checkpoints are ``tests/helpers/tiny_models.py``'s releases (``save_mxfp4_gpt_oss``, ``save_fp8_qwen3``), built
once per module and copied per test, then damaged one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import prep.adapters.checkpoint as checkpoint
from loader.codec import FP4_E2M1
from prep.adapters import get_adapter, load_config
from prep.adapters.checkpoint import INDEX_NAME, CheckpointTensors
from prep.adapters.source_formats import fp8_dequantize, mxfp4_dequantize
from prep.errors import MoeprepError
from prep.streaming import load_streamed
from tests.helpers.tiny_models import save_fp8_qwen3, save_mxfp4_gpt_oss

MX_BLOCKS = "model.layers.1.mlp.experts.down_proj_blocks"
MX_SCALES = "model.layers.1.mlp.experts.down_proj_scales"
ATTENTION = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """{"mx": an MXFP4 gpt-oss, "mx-shards": the same as shards with an index, "fp8": an FP8 Qwen3-MoE}."""
    base = tmp_path_factory.mktemp("releases")
    save_mxfp4_gpt_oss(base / "mx")
    save_mxfp4_gpt_oss(base / "mx-shards", shards=True)
    save_fp8_qwen3(base / "fp8")
    return base


def _copy(releases: Path, name: str, to: Path) -> Path:
    shutil.copytree(releases / name, to / name)
    return to / name


def _rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _forward(directory: Path) -> None:
    """What ``prepare``'s stages do with a checkpoint: stream it and run the model over every MoE layer."""
    model = load_streamed(directory, resident_bytes=0)
    with torch.no_grad():
        model(input_ids=torch.arange(12).view(1, 12) % model.config.vocab_size)


# --- numbers: checked where they are dequantized -------------------------------------------------------------------


def test_mxfp4_refuses_exactly_the_codes_and_scales_whose_value_overflows_float32():
    # the reference: code * 2**(scale - 127) computed in float64 against float32's largest value
    limit = torch.finfo(torch.float32).max
    for scale in range(250, 255):
        for code in range(16):
            blocks = torch.full((1, 1, 16), code | code << 4, dtype=torch.uint8)
            scales = torch.full((1, 1), scale, dtype=torch.uint8)
            if abs(math.ldexp(FP4_E2M1[code], scale - 127)) > limit:
                with pytest.raises(MoeprepError, match=r"tensor w_blocks in shard s: block \[0, 0\] dequantizes to"):
                    mxfp4_dequantize(blocks, scales, "w", "s")
            else:
                assert torch.isfinite(mxfp4_dequantize(blocks, scales, "w", "s")).all()


def test_an_overflowing_mxfp4_block_is_refused_naming_the_tensor_the_shard_and_the_block(releases, tmp_path):
    model = _copy(releases, "mx-shards", tmp_path)

    def overflow(t):  # expert 2, row 5, group 0: scale 2**127 times the code 6.0 is past float32
        t[MX_SCALES][2, 5, 0] = 254
        t[MX_BLOCKS][2, 5, 0, 3] = 0x77

    _rewrite(model / "model-experts-1.safetensors", overflow)
    said = (rf"tensor {MX_BLOCKS} in shard model-experts-1.safetensors: block \[2, 5, 0\] dequantizes to inf "
            r"\(its code 6.0 times the block's scale 2\*\*127")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(MoeprepError, match=said):
        warnings.simplefilter("always")
        _forward(model)  # the streamed model every stage and the divergence read runs
    assert not [w for w in caught if "hook" in str(w.message)]  # the one error, no second one from the hooks
    adapter = get_adapter(load_config(model))
    adapter.read_expert(model, 1, 1)  # the other experts of the layer are fine
    with pytest.raises(MoeprepError, match=said):
        adapter.read_expert(model, 1, 2)


def test_an_fp8_value_that_is_not_finite_is_refused_naming_its_block(releases, tmp_path):
    model = _copy(releases, "fp8", tmp_path)
    _rewrite(model / "model.safetensors", lambda t: t[ATTENTION].__setitem__((17, 3), float("nan")))
    with pytest.raises(MoeprepError, match=rf"tensor {ATTENTION} in shard model.safetensors: block \[1, 0\] "
                                           "dequantizes to nan"):
        _forward(model)
    shutil.rmtree(model)
    model = _copy(releases, "fp8", tmp_path)

    def overflow(t):  # a finite positive scale, but 448 times it is past float32
        t[f"{EXPERT}_scale_inv"][0, 1] = 1e38
        t[EXPERT][2, 20] = 448.0

    _rewrite(model / "model.safetensors", overflow)
    with pytest.raises(MoeprepError, match=rf"tensor {EXPERT} in shard model.safetensors: block \[0, 1\] "
                                           "dequantizes to -?inf"):
        get_adapter(load_config(model)).read_expert(model, 1, 3)


# --- a quantized weight and its scales come together --------------------------------------------------------------


@pytest.mark.parametrize("weight", [ATTENTION, EXPERT], ids=["attention", "expert"])
def test_an_fp8_weight_without_its_scales_is_refused_by_name(releases, tmp_path, weight):
    model = _copy(releases, "fp8", tmp_path)
    _rewrite(model / "model.safetensors", lambda t: t.pop(f"{weight}_scale_inv"))
    with pytest.raises(MoeprepError, match=rf"tensor {weight} in shard model.safetensors is float8_e4m3fn without "
                                           rf"its block scales {weight}_scale_inv"):
        _forward(model)


@pytest.mark.parametrize("weight", [ATTENTION, EXPERT], ids=["attention", "expert"])
def test_a_float16_weight_beside_block_scales_is_refused_not_read_as_plain_float(releases, tmp_path, weight):
    model = _copy(releases, "fp8", tmp_path)
    _rewrite(model / "model.safetensors", lambda t: t.__setitem__(weight, t[weight].float().half()))
    with pytest.raises(MoeprepError, match=rf"tensor {weight} in shard model.safetensors: it has block scales "
                                           rf"{weight}_scale_inv beside it.*got float16"):
        _forward(model)


@pytest.mark.parametrize("weight", [ATTENTION, EXPERT], ids=["attention", "expert"])
def test_block_scales_without_their_weight_are_refused_by_name(releases, tmp_path, weight):
    model = _copy(releases, "fp8", tmp_path)
    _rewrite(model / "model.safetensors", lambda t: t.pop(weight))
    with pytest.raises(MoeprepError, match=rf"tensor {weight}_scale_inv in shard model.safetensors is block scales "
                                           rf"without their weight {weight};"):
        CheckpointTensors(model)


@pytest.mark.parametrize("damage, named, says", [
    (lambda t: t.pop(MX_SCALES), MX_BLOCKS, f"MXFP4 blocks without their scales {MX_SCALES}"),
    (lambda t: t.pop(MX_BLOCKS), MX_SCALES, f"MXFP4 scales without their blocks {MX_BLOCKS}"),
    (lambda t: t.__setitem__(MX_BLOCKS.removesuffix("_blocks"), torch.zeros(4, 32, 32)),
     MX_BLOCKS.removesuffix("_blocks"), "a plain weight beside the MXFP4 weight"),
], ids=["blocks-without-scales", "scales-without-blocks", "plain-beside-blocks"])
def test_mxfp4_blocks_and_scales_come_in_pairs(releases, tmp_path, damage, named, says):
    model = _copy(releases, "mx", tmp_path)
    _rewrite(model / "model.safetensors", damage)
    with pytest.raises(MoeprepError, match=rf"tensor {named} in shard model.safetensors is {says}"):
        load_streamed(model, resident_bytes=0)  # refused from the names, before any expert is read


# --- shards: named inside the model directory ---------------------------------------------------------------------


@pytest.fixture
def opened(monkeypatch):
    """The files ``CheckpointTensors`` opens."""
    files = []

    def spy(path, *args, **kwargs):
        files.append(str(path))
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", spy)
    return files


@pytest.mark.parametrize("shard", ["../outside/x.safetensors", "sub/../../outside/x.safetensors", "ABSOLUTE",
                                   "/etc/passwd", "", "C:\\outside\\x.safetensors"])
def test_a_shard_index_naming_a_file_outside_the_model_directory_is_refused_before_any_read(
        releases, tmp_path, opened, shard):
    model = _copy(releases, "mx-shards", tmp_path)
    (tmp_path / "outside").mkdir()  # a complete shard there: read, it would load without a word
    shutil.copy(model / "model-experts-1.safetensors", tmp_path / "outside" / "x.safetensors")
    shard = str(tmp_path / "outside" / "x.safetensors") if shard == "ABSOLUTE" else shard
    index = json.loads((model / INDEX_NAME).read_text())
    index["weight_map"] = {n: shard if s == "model-experts-1.safetensors" else s for n, s in index["weight_map"].items()}
    (model / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(MoeprepError, match=rf"names shard {re.escape(repr(shard))}, which is not a .safetensors file inside"):
        _forward(model)
    assert opened == []


def test_a_hub_caches_symlinked_shards_stay_readable(releases, tmp_path, opened):
    # the hub cache's layout: snapshots/<commit>/<file> are symlinks to ../../blobs/<hash>
    repo = tmp_path / "cache" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in (releases / "mx-shards").iterdir():
        shutil.copy(file, repo / "blobs" / f"blob-{file.name}")
        os.symlink(f"../../blobs/blob-{file.name}", snapshot / file.name)
    tensors = CheckpointTensors(snapshot)
    assert torch.equal(tensors.get(MX_SCALES), load_file(str(releases / "mx-shards" / "model-experts-1.safetensors"))[
        MX_SCALES])
    assert opened == [str(snapshot / "model-experts-1.safetensors")]
    _forward(snapshot)


@pytest.mark.parametrize("text, says", [
    ('["weight_map"]', "the file holds a list"),
    ('{"metadata": {}}', "it has no weight_map"),
    ('{"weight_map": ["model.safetensors"]}', "its weight_map is a list"),
    ('{"weight_map": {"lm_head.weight": 3}}', "maps tensor lm_head.weight to 3, not a shard file name"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ("{not json", "JSONDecodeError"),
], ids=["list", "no-weight-map", "weight-map-list", "shard-not-a-string", "deep", "not-json"])
def test_a_shard_index_of_the_wrong_type_is_one_clear_error(releases, tmp_path, opened, text, says):
    model = _copy(releases, "mx-shards", tmp_path)
    (model / INDEX_NAME).write_text(text)
    with pytest.raises(MoeprepError, match=rf"{INDEX_NAME}.*{says}"):
        CheckpointTensors(model)
    assert opened == []


# --- configs of the wrong type: one error, in the run and its dry run ------------------------------------------------

RECIPE = """name: tiny
model: {path: fp8}
calibration: {num_sequences: 2, sequence_length: 16}
quantize: {precision: int4, group_size: 16}
"""


@pytest.mark.parametrize("quant, says", [
    ([1, 2], "quantization_config of type list, not an object with a quant_method"),
    ("fp8", "quantization_config of type str"),
    ({"weight_block_size": [16, 16]}, "quant_method is None, not the name of a quantization method"),
    ({"quant_method": 8}, "quant_method is 8, not the name"),
    ({"quant_method": "fp8", "weight_block_size": "16x16"}, "weight_block_size is '16x16', not two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [16, 0]}, r"weight_block_size is \[16, 0\]"),
    ({"quant_method": "fp8", "weight_block_size": [16]}, r"weight_block_size is \[16\]"),
    ({"quant_method": "fp8", "weight_block_size": [16, True]}, r"weight_block_size is \[16, True\]"),
    ({"quant_method": "fp8", "weight_block_size": {"rows": 16}}, "weight_block_size is {'rows': 16}"),
], ids=["list", "str", "no-method", "method-int", "block-str", "block-zero", "block-one", "block-bool", "block-dict"])
def test_a_quantization_config_of_the_wrong_type_is_one_error_in_the_run_and_the_dry_run(
        releases, tmp_path, monkeypatch, quant, says):
    from prep.cli import main as moeprep

    model = _copy(releases, "fp8", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    for run in (lambda: load_config(model), lambda: CheckpointTensors(model),
                lambda: load_streamed(model, resident_bytes=0)):
        with pytest.raises(MoeprepError, match=says):
            run()
    (tmp_path / "tiny.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", "tiny.yaml", "--dry-run"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and len([line for line in result.output.splitlines()
                                                     if line.startswith("error:")]) == 1, result.output
    assert re.search(says, result.output), result.output


def test_an_fp8_block_larger_than_the_matrix_is_one_scale_for_all_of_it():
    weight = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    want = weight.float() * 3.0
    for block in [(2, 3), (128, 128), (10**30, 2**40)]:  # the last repeated as it says would overflow int64
        assert torch.equal(fp8_dequantize(weight, torch.tensor([[3.0]]), block), want)


@pytest.mark.parametrize("release, name, damage, says", [
    ("mx", "model.layers.0.self_attn.k_proj.weight", lambda x: x.index_fill(0, torch.tensor([3]), float("nan")),
     r"holds nan at \[3, 0\], not a finite number"),
    ("mx", "model.layers.1.mlp.experts.gate_up_proj_bias", lambda x: x.index_fill(1, torch.tensor([5]), float("-inf")),
     r"holds -inf at \[0, 5\], not a finite number"),
    ("mx", "model.layers.1.self_attn.k_proj.weight", lambda x: x.to(torch.uint8), "is uint8, not a float weight"),
    ("fp8", "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv", lambda x: x.to(torch.int32),
     "block scales of a .* must be a float"),
], ids=["nan-attention", "inf-expert-bias", "uint8-weight", "int-scales"])
def test_a_stored_float_that_is_not_finite_or_not_a_float_is_refused_naming_it(releases, tmp_path, release, name,
                                                                                damage, says):
    model = _copy(releases, release, tmp_path)
    _rewrite(model / "model.safetensors", lambda t: t.__setitem__(name, damage(t[name]).contiguous()))
    with pytest.raises(MoeprepError, match=rf"tensor {name.removesuffix('_scale_inv')}.* in shard model.safetensors.*{says}"):
        _forward(model)
