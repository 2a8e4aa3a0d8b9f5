"""Streaming preparation: the source model with its experts read from the shards a layer at a time.

The reference everywhere is transformers' ``from_pretrained`` of the same directory, loaded whole.
The slow tests prepare generated models with 1.5 GB of experts (float32, and 1.8 GB once dequantized from an MXFP4
release) and check the peak RSS of ``moeprep prepare``
against dense weights + one MoE layer + the process's own footprint.

Logits of a streamed and a whole model are compared bit for bit under ``one_thread``: the weights are equal, and
at one thread both forwards add in one order on any CPU (at two, a CPU's kernels may split a sum differently).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prep.adapters import get_adapter, load_model
from prep.errors import MoeprepError
from prep.methods.trace import RoutingRecorder, open_trace, record_traces
from prep.streaming import load_streamed, stream_of
from tests.helpers.tiny_models import ARCHITECTURES, build_tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every tiny architecture saved sharded in hub naming; {arch: directory}."""
    root = tmp_path_factory.mktemp("streamed")
    out = {}
    for arch in ARCHITECTURES:
        build_tiny_model(arch).save_pretrained(root / arch, max_shard_size="40KB")
        out[arch] = root / arch
    return out


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, vocab, (3, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("resident", [None, 0])
def test_streamed_model_equals_from_pretrained(arch, resident, checkpoints, one_thread):
    whole = load_model(checkpoints[arch], dtype="auto")
    streamed = load_streamed(checkpoints[arch], resident_bytes=resident)
    adapter = get_adapter(streamed)
    stream = stream_of(streamed, adapter)
    ids = _ids(whole.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, whole(input_ids=ids).logits)
    # one batched forward reads each MoE layer once; with 0 resident bytes none stays
    assert stream.reads == len(adapter.moe_layers)
    assert len(stream.resident) == (len(adapter.moe_layers) if resident is None else 0)
    dense = {n: t for n, t in whole.state_dict().items() if ".experts." not in n}
    got = streamed.state_dict()
    assert all(torch.equal(got[n], t) for n, t in dense.items())
    layer = adapter.moe_layers[-1]
    for e in range(adapter.num_experts):  # get_expert of a layer that is not resident reads the shards
        a, b = adapter.get_expert(whole, layer, e), adapter.get_expert(streamed, layer, e)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values(), strict=True))


def test_set_expert_on_a_streamed_model_acts_like_the_whole_model(checkpoints, one_thread):
    whole = load_model(checkpoints["mixtral"], dtype="auto")
    streamed = load_streamed(checkpoints["mixtral"], resident_bytes=0)
    adapter = get_adapter(whole)
    stream = stream_of(streamed, adapter)
    original = adapter.get_expert(whole, 1, 2)
    changed = type(original)(original.gate * -2, original.up, original.down)
    adapter.set_expert(whole, 1, 2, changed)
    adapter.set_expert(streamed, 1, 2, changed)
    assert set(stream.overrides) == {(1, 2)}
    ids = _ids(whole.config.vocab_size, seed=1)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, whole(input_ids=ids).logits)
    adapter.set_expert(streamed, 1, 2, original)  # back to the shards' bytes: nothing held any more
    assert stream.overrides == {}
    assert torch.equal(adapter.get_expert(streamed, 1, 2).gate, original.gate)


def test_use_source_and_preserved(checkpoints):
    streamed = load_streamed(checkpoints["olmoe"])
    adapter = get_adapter(streamed)
    stream = stream_of(streamed, adapter)
    ids = _ids(streamed.config.vocab_size, seed=2)
    with torch.no_grad():
        before = streamed(input_ids=ids).logits
        with stream.preserved():
            stream.use_source(lambda layer, e: _halved(stream.checkpoint_expert(layer, e)))
            assert not stream.resident  # the resident layers held the old source's weights
            halved = streamed(input_ids=ids).logits
            assert torch.equal(adapter.get_expert(streamed, adapter.moe_layers[0], 1).up,
                               stream.checkpoint_expert(adapter.moe_layers[0], 1).up * 0.5)
        after = streamed(input_ids=ids).logits
    assert not torch.allclose(halved, before)
    assert torch.equal(after, before)


def _halved(weights):
    return type(weights)(weights.gate, weights.up * 0.5, weights.down)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_bfloat16_and_tied_embeddings_load_as_from_pretrained_does(arch, tmp_path, one_thread):
    # bfloat16 weights (DeepSeek-V2 keeps its router in float32: _keep_in_fp32_modules_strict), one embedding
    # matrix shared with the LM head
    from tests.helpers.tiny_models import CONFIGS

    config = CONFIGS[arch]()
    config.tie_word_embeddings = True
    model = build_tiny_model(arch, config=config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    whole = load_model(tmp_path, dtype="auto")
    streamed = load_streamed(tmp_path, resident_bytes=0)
    assert streamed.get_output_embeddings().weight is streamed.get_input_embeddings().weight
    want = {n: t.dtype for n, t in whole.state_dict().items()}
    got = {n: t.dtype for n, t in streamed.state_dict().items()}
    assert got == want
    assert (torch.float32 in set(got.values())) == (arch == "deepseek_v2")
    ids = _ids(whole.config.vocab_size, seed=5)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, whole(input_ids=ids).logits)


def test_set_expert_on_a_resident_layer_and_get_expert_copies(checkpoints, one_thread):
    streamed = load_streamed(checkpoints["qwen3_moe"])  # every layer stays resident
    adapter = get_adapter(streamed)
    stream = stream_of(streamed, adapter)
    ids = _ids(streamed.config.vocab_size, seed=6)
    with torch.no_grad():
        before = streamed(input_ids=ids).logits
    assert len(stream.resident) == len(adapter.moe_layers)
    layer = adapter.moe_layers[0]
    original = adapter.get_expert(streamed, layer, 3)
    adapter.set_expert(streamed, layer, 3, _halved(original))
    got = adapter.get_expert(streamed, layer, 3)
    got.up.zero_()  # what get_expert returns is a copy, not the model's weights
    assert torch.equal(adapter.get_expert(streamed, layer, 3).up, original.up * 0.5)
    stream.drop_all()  # read again from the shards: the override survives
    assert torch.equal(adapter.get_expert(streamed, layer, 3).up, original.up * 0.5)
    adapter.set_expert(streamed, layer, 3, original)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, before)


def test_an_error_inside_a_forward_unpins_its_layer_and_is_the_error_seen(checkpoints):
    streamed = load_streamed(checkpoints["mixtral"], resident_bytes=0)
    adapter = get_adapter(streamed)
    stream = stream_of(streamed, adapter)
    experts = adapter.experts(streamed, adapter.moe_layers[1])

    def fail(*args):
        raise RuntimeError("out of memory, say")

    handle = experts.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="out of memory"), stream.preserved(), torch.no_grad():
        stream.use_source(lambda layer, e: _halved(stream.checkpoint_expert(layer, e)))
        streamed(input_ids=_ids(streamed.config.vocab_size))
    handle.remove()
    assert not any(stream.pins.values()) and stream.source == stream.checkpoint_expert


def test_fisher_on_a_streamed_model_equals_the_whole_model(checkpoints):
    # backward recomputes each checkpointed layer (its experts read again) instead of keeping them all
    from prep.methods.fisher import fisher_sensitivity

    whole = load_model(checkpoints["deepseek_v2"], dtype="auto")
    streamed = load_streamed(checkpoints["deepseek_v2"], resident_bytes=0)
    sequences = list(_ids(whole.config.vocab_size, seed=7))
    a = fisher_sensitivity(whole, get_adapter(whole), sequences)
    b = fisher_sensitivity(streamed, get_adapter(streamed), sequences)
    assert a.positions == b.positions
    assert a.sensitivity == pytest.approx(b.sensitivity, rel=1e-6)
    moe = len(get_adapter(streamed).moe_layers)
    assert stream_of(streamed, get_adapter(streamed)).reads == 2 * moe * len(sequences)  # forward + recompute


def test_an_mxfp4_checkpoint_streams_and_a_malformed_block_is_named_when_its_layer_is_read(tmp_path):
    # the released layout loads (its dense weights; tests/prep/sources/test_source_formats.py reads it whole); blocks of the
    # wrong shape are one error naming the tensor and its shard, at the first read of their layer
    model = build_tiny_model("gpt_oss")
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if ".experts." not in k}
    for layer in range(model.config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        state[f"{p}.gate_up_proj_blocks"] = torch.zeros(4, 2, dtype=torch.uint8)
        state[f"{p}.gate_up_proj_scales"] = torch.zeros(4, dtype=torch.uint8)
    save_file(state, str(tmp_path / "model.safetensors"))
    streamed = load_streamed(tmp_path, resident_bytes=0)
    with pytest.raises(MoeprepError, match=r"gate_up_proj_blocks in shard model.safetensors: MXFP4 blocks must be"):
        streamed(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_a_checkpoint_missing_a_dense_tensor_is_named(tmp_path):
    model = build_tiny_model("mixtral")
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(MoeprepError, match=r"lacks 1 tensor.*model\.norm\.weight"):
        load_streamed(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_without_a_gpu_is_one_clear_error(checkpoints):
    with pytest.raises(MoeprepError, match="no CUDA GPU"):
        load_streamed(checkpoints["mixtral"], device="cuda")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_trace_equals_one_sequence_at_a_time(arch, checkpoints, tmp_path):
    model = load_streamed(checkpoints[arch], resident_bytes=0)
    sequences = list(_ids(model.config.vocab_size, seed=3))
    one = open_trace(record_traces(model, sequences, tmp_path / "one", batch=1))
    many = open_trace(record_traces(model, sequences, tmp_path / "many", batch=3))
    assert one.sequence_tokens == many.sequence_tokens == [12, 12, 12]
    for a, b in zip(one.routing(), many.routing(), strict=True):
        assert torch.equal(a.expert_ids, b.expert_ids)
        assert torch.allclose(a.expert_weights, b.expert_weights, atol=1e-5)
    # head_input, hooked on the final norm (the forward skips the vocabulary logits), is the LM head's input
    captured = []
    head = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        model(input_ids=sequences[0].view(1, -1))
    head.remove()
    assert torch.allclose(many.tensor("head_input")[:12].float(), captured[0][0].float(), atol=2e-3)
    assert RoutingRecorder(model).final_norm is not None


# --- peak memory of prepare on a model whose experts are far larger than the rest -------------------------

BIG = dict(hidden_size=1024, intermediate_size=3072, num_local_experts=8, num_hidden_layers=5,
           num_attention_heads=8, num_key_value_heads=4, vocab_size=512, num_experts_per_tok=2,
           max_position_embeddings=256)


def write_big_checkpoint(directory: Path) -> dict:
    """A Mixtral-shaped float32 checkpoint with 1.5 GB of experts and 67 MB of everything else, written one
    layer per shard in the hub's per-expert naming without ever holding more than one layer. Returns sizes."""
    from transformers import MixtralConfig

    config = MixtralConfig(**BIG, dtype="float32", tie_word_embeddings=False)
    directory.mkdir()
    config.save_pretrained(directory)
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)  # k/v projection rows

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    weight_map, dense_bytes, expert_bytes = {}, 0, 0
    shards = {"model-dense.safetensors": {"model.embed_tokens.weight": rnd(config.vocab_size, h),
                                          "lm_head.weight": rnd(config.vocab_size, h),
                                          "model.norm.weight": torch.ones(h)}}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        shards["model-dense.safetensors"] |= {
            f"{p}.self_attn.q_proj.weight": rnd(h, h), f"{p}.self_attn.k_proj.weight": rnd(kv, h),
            f"{p}.self_attn.v_proj.weight": rnd(kv, h), f"{p}.self_attn.o_proj.weight": rnd(h, h),
            f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
            f"{p}.block_sparse_moe.gate.weight": rnd(config.num_local_experts, h)}
    for name, tensors in shards.items():
        save_file(tensors, str(directory / name))
        weight_map |= dict.fromkeys(tensors, name)
        dense_bytes += sum(t.numel() * 4 for t in tensors.values())
    shards.clear()
    for layer in range(config.num_hidden_layers):
        tensors = {}
        for e in range(config.num_local_experts):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            tensors |= {f"{p}.w1.weight": rnd(i, h), f"{p}.w3.weight": rnd(i, h), f"{p}.w2.weight": rnd(h, i)}
        name = f"model-layer-{layer}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map |= dict.fromkeys(tensors, name)
        expert_bytes += sum(t.numel() * 4 for t in tensors.values())
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"dense_bytes": dense_bytes, "expert_bytes": expert_bytes,
            "layer_bytes": expert_bytes // config.num_hidden_layers}


# VmHWM, not ru_maxrss: the latter survives exec, so a child forked from a big pytest process would report the
# parent's size; VmHWM belongs to the new address space
PEAK_RSS = """
{imports}
from pathlib import Path
status = Path("/proc/self/status").read_text()
print("PEAK_RSS_KB", next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""


def _peak_rss(code: str, cwd: Path) -> int:
    """Run ``code`` in a fresh interpreter; returns its peak resident set in bytes (stdout's last report)."""
    out = subprocess.run([sys.executable, "-c", PEAK_RSS.format(imports=code)], cwd=cwd, capture_output=True,
                         text=True, env=os.environ | {"TQDM_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split("PEAK_RSS_KB")[-1].split()[0]) * 1024


def _prepare_peak(tmp_path: Path, sizes: dict, model_type: str, **sections) -> tuple[int, int, int, dict]:
    """(peak, baseline, bound, report) of ``moeprep prepare --expert-memory 0`` on the checkpoint at ``big/``, with
    eight 64-token calibration sequences from a file and the recipe ``sections``: the peak RSS of the prepare, the
    process's own footprint (the same interpreter with everything prepare imports, and no model), and the bound
    dense + two layers + 256 MiB above it."""
    (tmp_path / "calibration.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    recipe = {"name": "big", "model": {"path": str(tmp_path / "big")},
              "calibration": {"source": "files", "files": [str(tmp_path / "calibration.txt")],
                              "num_sequences": 8, "sequence_length": 64},
              "trace": {"batch": 8}, **sections}
    (tmp_path / "big.yaml").write_text(json.dumps(recipe))
    baseline = _peak_rss("import torch, transformers, hqq\nimport prep.pipeline, prep.streaming, prep.methods.trace\n"
                         f"import transformers.models.{model_type}.modeling_{model_type}", tmp_path)
    peak = _peak_rss("from prep.cli import main\n"
                     "main(['prepare', '--recipe', 'big.yaml', '--expert-memory', '0'], standalone_mode=False)",
                     tmp_path)
    bound = baseline + sizes["dense_bytes"] + 2 * sizes["layer_bytes"] + 256 * 2**20
    report = {"peak_rss": peak, "baseline_rss": baseline, "bound": bound, **sizes}
    print("STREAMING", model_type, json.dumps(report))
    return peak, baseline, bound, report


@pytest.mark.slow  # not `alone`: the peak is the prepare process's own VmHWM, which other processes cannot raise
def test_prepare_peak_rss_is_dense_plus_one_layer(tmp_path):
    sizes = write_big_checkpoint(tmp_path / "big")
    assert sizes["expert_bytes"] > 1.5e9 and sizes["expert_bytes"] > 20 * sizes["dense_bytes"]
    peak, baseline, bound, report = _prepare_peak(
        tmp_path, sizes, "mixtral", quantize={"precision": "passthrough"},
        gating={"enabled": True, "num_sequences": 2},  # Fisher: a backward through every layer
        # the divergence stage streams the source and loads the artifact as at its default size, over 8 windows of
        # 64 tokens instead of 64 of 256 (as the MXFP4 test below): its weights, not its tokens, set the peak
        divergence={"num_sequences": 8, "sequence_length": 64})
    assert json.loads((tmp_path / "artifacts" / "big" / "artifact" / "report.json").read_text())["gating"]
    assert peak <= bound, report
    assert peak - baseline < 0.5 * sizes["expert_bytes"], report  # far from holding the model


BIG_MXFP4 = dict(hidden_size=1024, intermediate_size=3072, num_local_experts=8, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=512, num_experts_per_tok=2,
                 max_position_embeddings=256)


def write_big_mxfp4_checkpoint(directory: Path) -> dict:
    """A gpt-oss checkpoint in the released MXFP4 layout whose experts are 1.8 GB once dequantized to float32 (241
    MB as stored), one layer of blocks and scales per shard, written a layer at a time. Returns sizes: the dense
    bytes (float32) and the dequantized experts' bytes."""
    from transformers import GptOssConfig

    config = GptOssConfig(**BIG_MXFP4, dtype="float32", tie_word_embeddings=False)
    directory.mkdir()
    raw = config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (directory / "config.json").write_text(json.dumps(raw))
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    h, i, e = config.hidden_size, config.intermediate_size, config.num_local_experts
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    dense = {"model.embed_tokens.weight": rnd(config.vocab_size, h), "lm_head.weight": rnd(config.vocab_size, h),
             "model.norm.weight": torch.ones(h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        dense |= {f"{p}.self_attn.q_proj.weight": rnd(q, h), f"{p}.self_attn.q_proj.bias": torch.zeros(q),
                  f"{p}.self_attn.k_proj.weight": rnd(kv, h), f"{p}.self_attn.k_proj.bias": torch.zeros(kv),
                  f"{p}.self_attn.v_proj.weight": rnd(kv, h), f"{p}.self_attn.v_proj.bias": torch.zeros(kv),
                  f"{p}.self_attn.o_proj.weight": rnd(h, q), f"{p}.self_attn.o_proj.bias": torch.zeros(h),
                  f"{p}.self_attn.sinks": torch.zeros(config.num_attention_heads),
                  f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                  f"{p}.mlp.router.weight": rnd(e, h), f"{p}.mlp.router.bias": torch.zeros(e),
                  f"{p}.mlp.experts.gate_up_proj_bias": torch.zeros(e, 2 * i),
                  f"{p}.mlp.experts.down_proj_bias": torch.zeros(e, h)}
    save_file(dense, str(directory / "model-dense.safetensors"))
    weight_map = dict.fromkeys(dense, "model-dense.safetensors")
    dense_bytes = sum(t.numel() * 4 for t in dense.values())
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        tensors = {}
        for name, (rows, cols) in {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}.items():
            tensors[f"{p}.{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8,
                                                          generator=gen)
            tensors[f"{p}.{name}_scales"] = torch.randint(118, 122, (e, rows, cols // 32), dtype=torch.uint8,
                                                          generator=gen)
        name = f"model-layer-{layer}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map |= dict.fromkeys(tensors, name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    layer_bytes = e * 3 * h * i * 4
    return {"dense_bytes": dense_bytes, "expert_bytes": layer_bytes * config.num_hidden_layers,
            "layer_bytes": layer_bytes}


@pytest.mark.slow  # not `alone`: the peak is the prepare process's own VmHWM, which other processes cannot raise
def test_prepare_of_an_mxfp4_release_peaks_at_dense_plus_one_dequantized_layer(tmp_path):
    # as the float32 test above measures it: the process's own footprint, then prepare's peak, of a release whose
    # experts are dequantized a layer at a time and kept as the release's own codes (mxfp4)
    sizes = write_big_mxfp4_checkpoint(tmp_path / "big")
    assert sizes["expert_bytes"] > 10 * sizes["dense_bytes"]
    peak, baseline, bound, report = _prepare_peak(tmp_path, sizes, "gpt_oss", quantize={"precision": "mxfp4"},
                                                  divergence={"num_sequences": 8, "sequence_length": 64})
    manifest = json.loads((tmp_path / "artifacts" / "big" / "artifact" / "manifest.json").read_text())
    assert list(manifest["stores"]) == ["mxfp4"]
    assert peak <= bound, report
    assert peak - baseline < 0.5 * sizes["expert_bytes"], report  # far from holding the dequantized model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_prepare_on_cuda_gives_the_cpu_artifact(arch, tmp_path):
    # --device cuda: the forwards (trace, the KL sweeps and checks, Fisher) run on the GPU; HQQ stays on the
    # CPU, so the records are the same bytes and the routing the same decisions
    from prep.methods.trace import open_trace
    from prep.pipeline import prepare
    from tests.helpers.tiny_models import save_tiny_model, tiny_recipe

    save_tiny_model(arch, tmp_path / "model")
    sections = {"quantize": {"also": ["int2"]}, "sensitivity": {"method": "sweep", "num_sequences": 2},
                "bitwidth": {"method": "edgemoe", "tolerance": 0.05, "low": "int2", "num_sequences": 2},
                "gating": {"enabled": True, "num_sequences": 2},
                "predict": {"predictors": ["next_gates", "path_stats", "first_gate"]}}
    results = {}
    for device in ("cpu", "cuda"):
        recipe = tiny_recipe("int4", **sections)
        root = tmp_path / device
        root.mkdir()
        (root / "model").symlink_to(tmp_path / "model")
        results[device] = prepare(recipe, root=root, output=root / "artifact", device=device, expert_memory=0)
    traces = {d: open_trace(next((tmp_path / d / "artifacts" / "tiny" / "stages").glob("trace-*/trace")))
              for d in results}
    for a, b in zip(traces["cpu"].routing(), traces["cuda"].routing(), strict=True):
        # the same set of experts per (token, layer): a different set is a routing difference under CUDA
        same_set = (a.expert_ids.sort(-1).values == b.expert_ids.sort(-1).values).all(-1)
        assert same_set.float().mean() > 0.99
        # and, traces being recorded heaviest first, the same order where the sets agree
        assert (a.expert_ids == b.expert_ids).all(-1)[same_set].float().mean() > 0.99
    quantized = {d: sorted((tmp_path / d / "artifacts" / "tiny" / "stages").glob("quantize-*/int4/*.safetensors"))
                 for d in results}
    assert [p.read_bytes() for p in quantized["cpu"]] == [p.read_bytes() for p in quantized["cuda"]]
    for device in results:
        assert (tmp_path / device / "artifact" / "manifest.json").is_file()
