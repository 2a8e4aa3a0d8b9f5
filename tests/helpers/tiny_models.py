"""Tiny float32 MoE models of the seven supported architectures, built from configs (no downloads).

Each builder returns a `*ForCausalLM` in eval mode with a fixed seed: hidden 32, 2-3 decoder
layers, 4-8 experts, top-2 (top-3 for DeepSeek-V2), vocab 64, and the eager experts implementation (the reference loop of
transformers, so recomputations match to float32 rounding). Weights are re-drawn larger than the
default init (std 0.02 would make every router near-uniform and every expert output ~1e-4), so
routing is decisive and errors are visible. Each architecture's special case is switched on:
Qwen2-MoE's gated shared expert and a dense layer, DeepSeek-V2's dense first layer, shared experts
and group-limited routing with a scaling factor, gpt-oss's biases and a SwiGLU clamp low enough to
bite, Phi-MoE's sparsemixer threshold (jitter eps 0.3 instead of 0.01, so that with decisive router logits
some tokens still mix several experts into the masked softmax and others do not).

Use `build_tiny_model(arch)` or the per-architecture functions; `ARCHITECTURES` lists the names.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

VOCAB = 64
HIDDEN = 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def mixtral_config():
    return MixtralConfig(
        num_hidden_layers=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **COMMON
    )


def qwen2_moe_config():
    # Layer 1 is dense (mlp_only_layers) so the MoE-layer list is not simply "all layers".
    return Qwen2MoeConfig(
        num_hidden_layers=3,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        **COMMON,
    )


def qwen3_moe_config():
    return Qwen3MoeConfig(
        num_hidden_layers=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=8,
        **COMMON,
    )


def olmoe_config():
    return OlmoeConfig(
        num_hidden_layers=2,
        intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        **COMMON,
    )


def phimoe_config():
    return PhimoeConfig(
        num_hidden_layers=2,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.3,
        **COMMON,
    )


def deepseek_v2_config():
    # 8 experts in 4 groups, top-3 inside the best 2 groups: with topk_group < top_k the group
    # limit changes the selection (as in DeepSeek-V2: top-6 inside 3 of 8 groups).
    return DeepseekV2Config(
        num_hidden_layers=3,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        **{**COMMON, "num_key_value_heads": 4},  # MLA: one latent KV per attention head
    )


def gpt_oss_config():
    # swiglu_limit low enough that the clamp is active for a share of the activations.
    return GptOssConfig(
        num_hidden_layers=2,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        swiglu_limit=0.5,
        # Its default YaRN rope expects a long context; keep the config consistent to avoid a warning.
        **{**COMMON, "max_position_embeddings": 131072},
    )


def llama_config():
    """A dense model: for the "unsupported architecture" paths."""
    return LlamaConfig(num_hidden_layers=1, intermediate_size=16, **COMMON)


CONFIGS = {
    "mixtral": mixtral_config,
    "qwen2_moe": qwen2_moe_config,
    "qwen3_moe": qwen3_moe_config,
    "olmoe": olmoe_config,
    "phimoe": phimoe_config,
    "deepseek_v2": deepseek_v2_config,
    "gpt_oss": gpt_oss_config,
}
ARCHITECTURES = tuple(CONFIGS)


def _decisive(model, seed: int):
    """Re-draw the parameters so that routing is decisive and outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue  # keep norms at their init (ones)
            # Routers (`.gate.weight`, `.router.weight`, gpt-oss router bias) get std 1: logit gaps of
            # several units. Everything else std 0.2 (biases included, which gpt-oss inits to zero).
            router = name.endswith((".gate.weight", ".router.weight", ".router.bias"))
            std = 1.0 if router else 0.2
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def build_tiny_model(arch: str, seed: int = 0, config=None):
    """A tiny float32 `*ForCausalLM` of architecture `arch` (see ARCHITECTURES), eval mode, eager experts."""
    config = config if config is not None else CONFIGS[arch]()
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _decisive(model, seed).eval()


def tiny_mixtral(seed: int = 0):
    return build_tiny_model("mixtral", seed)


def tiny_qwen2_moe(seed: int = 0):
    return build_tiny_model("qwen2_moe", seed)


def tiny_qwen3_moe(seed: int = 0):
    return build_tiny_model("qwen3_moe", seed)


def tiny_olmoe(seed: int = 0):
    return build_tiny_model("olmoe", seed)


def tiny_phimoe(seed: int = 0):
    return build_tiny_model("phimoe", seed)


def tiny_deepseek_v2(seed: int = 0):
    return build_tiny_model("deepseek_v2", seed)


def tiny_gpt_oss(seed: int = 0):
    return build_tiny_model("gpt_oss", seed)


def tiny_llama(seed: int = 0):
    """A tiny dense Llama (not MoE), for unsupported-architecture tests."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()


def random_sequences(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """`n` random token sequences (1-D LongTensors) of varying lengths around `length`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length + i,), generator=gen) for i in range(n)]


def tiny_tokenizer(vocab_size: int):
    """A character-level fast tokenizer that fits a tiny model's vocabulary (unknown characters -> <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)][: vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def save_tiny_model(arch: str, directory, seed: int = 0):
    """Save a tiny model of ``arch`` with a character tokenizer to ``directory``; returns the model."""
    model = build_tiny_model(arch, seed)
    model.save_pretrained(directory)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return model


# ------------------------------------------------------------------------------ tiny artifacts


def tiny_recipe(precision: str = "int4", group_size: int = 16, **sections):
    """The tests' recipe: the model at ``model/`` beside the prepare root, two 16-token calibration
    sequences, experts at ``precision``, the divergence on four 16-token windows, the dense weights as stored (the
    tests hold the experts to a dense forward; ``tests/loader/test_dense.py`` covers the int8 dense form);
    ``sections`` add recipe sections (``quantize`` and ``package`` ones merge)."""
    from prep.recipe import recipe_from_dict

    quantize = {"precision": precision, "group_size": group_size} | sections.pop("quantize", {})
    package = {"dense": "float"} | sections.pop("package", {})
    return recipe_from_dict({"name": "tiny", "model": {"path": "model"},
                             "calibration": {"num_sequences": 2, "sequence_length": 16},
                             "quantize": quantize, "divergence": {"num_sequences": 4, "sequence_length": 16},
                             "package": package, **sections})


def sweep_recipe(**executor):
    """``tiny_recipe`` at int4 with int2 also quantized and the edgemoe bit-width search on, so the sensitivity
    sweep runs; ``executor`` fills the recipe's executor section."""
    return tiny_recipe("int4", quantize={"also": ["int2"]}, bitwidth={"method": "edgemoe", "tolerance": 0.02},
                       **({"executor": executor} if executor else {}))


def prepare_tiny_artifact(root: Path, arch: str = "mixtral", precision: str = "passthrough", until: str | None = None,
                          recipe=None):
    """(source model, artifact dir): a tiny ``arch`` saved under ``root/model`` and prepared to ``root/artifact``
    (with ``recipe``, by default ``tiny_recipe(precision)``)."""
    from prep.pipeline import prepare

    model = save_tiny_model(arch, root / "model")
    prepare(recipe or tiny_recipe(precision), root=root, output=root / "artifact", until=until)
    return model, root / "artifact"


def tiny_artifact(tmp_path_factory, arch: str = "mixtral", precision: str = "passthrough"):
    """``prepare_tiny_artifact`` built once per run per (arch, precision) and shared read-only
    (``tests.helpers.shared``): (a fresh copy of the source model, the artifact directory)."""
    from tests.helpers.shared import shared_store

    root = shared_store(tmp_path_factory).get(f"tiny-{arch}-{precision}",
                                              lambda d: prepare_tiny_artifact(d, arch, precision))
    return build_tiny_model(arch), root / "artifact"


def mixed_precision_artifact(tmp_path_factory, tmp_path):
    """A passthrough artifact of the tiny Mixtral with the int4 store of the same model added, and a plan
    that puts half of each layer's experts at int4 (records of two sizes, two pools: one per layer, one
    global): (source model, mixed artifact, passthrough artifact, int4 artifact)."""
    import json
    import shutil

    from loader.format import sha256_file, write_manifest
    from loader.plan import Plan, Pool

    model, full = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    _, low = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    art = tmp_path / "mixed"
    shutil.copytree(full.resolve(), art)
    manifest = json.loads((art / "manifest.json").read_text())
    low_manifest = json.loads((low / "manifest.json").read_text())
    store = low_manifest["stores"]["int4"]
    shutil.copy(low / store["file"], art / store["file"])
    manifest["stores"]["int4"] = store
    n_layers, n_experts = len(manifest["moe"]["layers"]), manifest["moe"]["num_experts"]
    plan = Plan(n_layers, n_experts,
                tuple(tuple("int4" if e % 2 else "passthrough" for e in range(n_experts)) for _ in range(n_layers)),
                (Pool("high", "passthrough", 0.6, "layer"), Pool("low", "int4", 0.4, "global")))
    (art / "plan.json").write_text(json.dumps(plan.to_json()))
    for name in (store["file"], "plan.json"):
        manifest["files"][name] = {"bytes": (art / name).stat().st_size, "sha256": sha256_file(art / name)}
    write_manifest(art, manifest)
    return model, art, full, low


def decoded_reference(model, artifact: Path, precision: str):
    """A copy of ``model`` whose experts are the artifact's decoded ``precision`` records (what the loader
    must compute with), built by reading the store file directly."""
    import json

    from loader.codec import RecordLayout
    from loader.format import expert_key, read_record_offsets
    from prep.adapters import get_adapter

    store = json.loads((artifact / "manifest.json").read_text())["stores"][precision]
    layout = RecordLayout.from_json(store["layout"])
    offsets, record_bytes, _ = read_record_offsets(artifact / store["file"])
    raw = (artifact / store["file"]).read_bytes()
    adapter = get_adapter(model)
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in adapter.moe_layers:
            module = adapter.experts(reference, layer)
            for e in range(adapter.num_experts):
                off = offsets[expert_key(layer, e)]
                record = torch.frombuffer(bytearray(raw[off:off + record_bytes]), dtype=torch.uint8)
                for name, tensor in layout.decode(record).items():
                    getattr(module, name)[e].copy_(tensor)
    return reference


def planned_reference(model, artifact: Path):
    """``model`` with every expert replaced by its record decoded from the store of its planned precision."""
    import json

    from loader.codec import RecordLayout
    from loader.format import expert_key, read_record_offsets

    manifest = json.loads((artifact / "manifest.json").read_text())
    plan = json.loads((artifact / "plan.json").read_text())
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    stores = {}
    for precision, store in manifest["stores"].items():
        offsets, record_bytes, _ = read_record_offsets(artifact / store["file"])
        stores[precision] = (offsets, record_bytes, RecordLayout.from_json(store["layout"]),
                             (artifact / store["file"]).read_bytes())
    with torch.no_grad():
        for pos, (layer, path) in enumerate(zip(manifest["moe"]["layers"], manifest["moe"]["experts_modules"],
                                                strict=True)):
            module = reference.get_submodule(path)
            for e, precision in enumerate(plan["expert_precision"][pos]):
                offsets, size, layout, raw = stores[precision]
                off = offsets[expert_key(layer, e)]
                record = torch.frombuffer(bytearray(raw[off:off + size]), dtype=torch.uint8)
                for name, tensor in layout.decode(record).items():
                    getattr(module, name)[e].copy_(tensor)
    return reference


def file_hashes(directory: Path) -> dict[str, str]:
    """{file name: sha256} of every file in ``directory``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def write_tiny_suites(directory: Path) -> None:
    """Small GSM8K, MMLU and TruthfulQA files in the reference layout (what `moeprep eval --data` reads)."""
    import json

    directory.mkdir()
    rows = {
        "gsm8k.jsonl": [{"question": f"WHAT IS {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
                        for i in range(3)],
        "mmlu.jsonl": [{"question": f"PICK {i}", "subject": "TEST", "choices": ["A1", "B2", "C3", "D4"],
                        "answer": i % 4} for i in range(6)],
        "mmlu_dev.jsonl": [{"question": "DEV", "subject": "TEST", "choices": ["1", "2", "3", "4"], "answer": 2}] * 5,
        "truthfulqa.jsonl": [{"question": f"Q{i}", "mc1_targets": {"choices": ["YES.", "NO."], "labels": [1, 0]},
                              "mc2_targets": {"choices": ["NO.", "YES.", "YES!"], "labels": [0, 1, 1]}}
                             for i in range(4)],
        "gsm8k_cot_fewshot.jsonl": [{"question": "WHAT IS 1 + 1?", "cot": "1 + 1 = 2. The answer is 2."}] * 8,
    }
    for name, items in rows.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in items))


# ------------------------------------------------------------------------------ released quantized layouts


def _save_state(state: dict, directory, shards: bool) -> None:
    """``state`` as one model.safetensors, or (``shards``) as a release ships: an index, the dense weights in one
    shard and each layer's experts in their own."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not shards:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for name in sorted({_shard_of(n) for n in state}):
        part = {n: t for n, t in state.items() if _shard_of(n) == name}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _shard_of(name: str) -> str:
    layer = name.split(".")[2] if name.startswith("model.layers.") and ".experts." in name else None
    return f"model-experts-{layer}.safetensors" if layer is not None else "model-dense.safetensors"


def save_mxfp4_gpt_oss(directory, seed: int = 0, shards: bool = False):
    """A tiny gpt-oss checkpoint in the layout openai/gpt-oss-* ships: dense weights as usual, every MoE layer's
    experts as ``gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``gate_up_proj_scales`` uint8 [E, 2I, H/32] (and
    ``down_proj_*`` [E, H, I/32, ...]) with random codes and scales near 2**-7, biases in float32, and the
    released config's ``quantization_config``; ``shards``: one file per layer's experts and an index. Returns (the model with transformers' own dequantization of those
    experts, {tensor name: blocks or scales})."""
    from pathlib import Path

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = Path(directory)
    config = gpt_oss_config()
    config.intermediate_size = 32  # MXFP4 groups of 32 along every matrix's input
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _decisive(model, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    codes = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = model.model.layers[layer].mlp.experts
        for name, (rows, cols) in {"gate_up_proj": (2 * config.intermediate_size, config.hidden_size),
                                   "down_proj": (config.hidden_size, config.intermediate_size)}.items():
            blocks = torch.randint(0, 256, (config.num_local_experts, rows, cols // 32, 16), dtype=torch.uint8,
                                   generator=gen)
            scales = torch.randint(118, 124, (config.num_local_experts, rows, cols // 32), dtype=torch.uint8,
                                   generator=gen)
            del state[f"{prefix}.{name}"]
            state[f"{prefix}.{name}_blocks"], state[f"{prefix}.{name}_scales"] = blocks, scales
            codes[f"{prefix}.{name}_blocks"], codes[f"{prefix}.{name}_scales"] = blocks, scales
            with torch.no_grad():  # transformers' dequantization: [E, in, out] as GptOssExperts holds it
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    _save_state(state, directory, shards)
    raw = config.to_dict() | {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (directory / "config.json").write_text(__import__("json").dumps(raw, indent=2))
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    return model, codes


FP8_TEST_BLOCK = [16, 16]


def save_fp8_qwen3(directory, seed: int = 0, shards: bool = False):
    """A tiny Qwen3-MoE checkpoint in the layout of the Qwen3-*-FP8 releases: every linear weight of attention and
    of the experts float8_e4m3fn with ``weight_scale_inv`` float32 per 16x16 block (``quantization_config.
    weight_block_size``), per-expert hub names, norms, embeddings, routers and head as stored. Returns (the model
    holding the dequantized weights, computed here from the format's definition, {weight name: (fp8, scale_inv)});
    ``shards``: one file per layer's experts and an index."""
    import json
    from pathlib import Path


    directory = Path(directory)
    model = build_tiny_model("qwen3_moe", seed)
    config = model.config
    block = FP8_TEST_BLOCK
    gen = torch.Generator().manual_seed(seed + 11)
    state, quantized = {}, {}

    def fp8(name: str, weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        scale_inv = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=gen) * 0.004 + 0.001
        full = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[name], state[f"{name}_scale_inv"] = q, scale_inv
        quantized[name] = (q, scale_inv)
        return q.to(torch.float32) * full  # the format's definition, what the reference model holds

    for name, t in model.state_dict().items():
        if "mlp.experts." in name:
            continue
        if name.endswith("_proj.weight") and ".self_attn." in name:
            t.copy_(fp8(name, t))
        else:
            state[name] = t.detach().contiguous()
    for layer in range(config.num_hidden_layers):
        experts = model.model.layers[layer].mlp.experts
        for e in range(config.num_experts):
            gate, up = experts.gate_up_proj[e].chunk(2, dim=0)
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            with torch.no_grad():
                experts.gate_up_proj[e] = torch.cat([fp8(f"{prefix}.gate_proj.weight", gate),
                                                     fp8(f"{prefix}.up_proj.weight", up)])
                experts.down_proj[e] = fp8(f"{prefix}.down_proj.weight", experts.down_proj[e])
    _save_state(state, directory, shards)
    raw = config.to_dict() | {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "weight_block_size": block}}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    return model, quantized
