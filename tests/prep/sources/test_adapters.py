"""Architecture adapters against the transformers modules they describe, on tiny models of all seven architectures.

Routing, expert get/set, expert_forward and read_expert are checked against what the model itself
computes and stores; describe() against parameter counts computed by hand from the config.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from prep.adapters import (
    ExpertWeights,
    build_skeleton,
    describe,
    get_adapter,
    load_model,
    read_expert,
)
from prep.errors import MoeprepError
from tests.helpers.tiny_models import (
    ARCHITECTURES,
    build_tiny_model,
    deepseek_v2_config,
    mixtral_config,
    tiny_llama,
)

_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


def tiny(arch: str):
    """One shared tiny model per architecture; tests that modify weights work on a deepcopy."""
    if arch not in _MODELS:
        _MODELS[arch] = build_tiny_model(arch)
    return _MODELS[arch]


def random_hidden(adapter, tokens=24, seed=0):
    return torch.randn(tokens, adapter.hidden_size, generator=torch.Generator().manual_seed(seed))


def assert_same_expert(a: ExpertWeights, b: ExpertWeights):
    assert a.tensors().keys() == b.tensors().keys()
    for name, t in a.tensors().items():
        assert torch.equal(t, b.tensors()[name]), name


# --- structure ------------------------------------------------------------------------------


EXPECTED_MOE_LAYERS = {"qwen2_moe": [0, 2], "deepseek_v2": [1, 2]}


def test_moe_layers_match_modules(arch):
    model = tiny(arch)
    adapter = get_adapter(model)
    with_experts = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert adapter.moe_layers == with_experts
    assert adapter.moe_layers == EXPECTED_MOE_LAYERS.get(arch, list(range(model.config.num_hidden_layers)))
    experts = adapter.experts(model, adapter.moe_layers[0])
    assert experts.num_experts == adapter.num_experts
    # The adapter's fused layout is what transformers' experts decorator declares.
    assert adapter.layout.transposed == experts.is_transposed
    assert adapter.layout.interleaved == (not experts.is_concatenated)
    assert adapter.layout.has_bias == experts.has_bias


def test_dense_layer_is_rejected():
    model = tiny("deepseek_v2")
    with pytest.raises(MoeprepError, match="layer 0 is not an MoE layer"):
        get_adapter(model).moe_block(model, 0)


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(MoeprepError) as err:
        get_adapter(tiny_llama())
    assert "'llama'" in str(err.value)
    for name in ("Mixtral", "Qwen2-MoE", "Qwen3-MoE", "OLMoE", "Phi-MoE", "DeepSeek-V2", "gpt-oss"):
        assert name in str(err.value)


# --- routing ----------------------------------------------------------------------------------


def test_route_matches_router_module(arch):
    model = tiny(arch)
    adapter = get_adapter(model)
    for layer in adapter.moe_layers:
        hidden = random_hidden(adapter, seed=layer)
        with torch.no_grad():
            logits, ids, weights = adapter.unpack_router_output(adapter.router(model, layer)(hidden))
        r_logits, r_ids, r_weights = adapter.route(model, layer, hidden)
        assert r_ids.dtype == torch.int64 and r_ids.shape == (hidden.shape[0], adapter.top_k)
        assert torch.equal(r_ids, ids)
        torch.testing.assert_close(r_logits, logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(r_weights, weights, rtol=0, atol=1e-6)


def test_deepseek_group_limit_changes_routing():
    # Without the group limit (plain greedy top-k) some tokens would pick other experts.
    model = tiny("deepseek_v2")
    adapter = get_adapter(model)
    logits, ids, _ = adapter.route(model, 1, random_hidden(adapter, tokens=64))
    greedy = torch.topk(logits.softmax(-1), adapter.top_k, dim=-1).indices
    assert not torch.equal(ids.sort(-1).values, greedy.sort(-1).values)


def test_phimoe_sparsemixer_masks_some_tokens_not_others():
    model = tiny("phimoe")
    adapter = get_adapter(model)
    _, _, weights = adapter.route(model, 0, random_hidden(adapter, tokens=64))
    first = weights[:, 0]
    assert (first == 1).any() and (first < 0.99).any()


def test_gpt_oss_clamp_is_active():
    model = tiny("gpt_oss")
    adapter = get_adapter(model)
    w = adapter.get_expert(model, 0, 0)
    gate = torch.nn.functional.linear(random_hidden(adapter), w.gate, w.gate_bias)
    assert (gate > model.config.swiglu_limit).any()


# --- expert weights -------------------------------------------------------------------------


def test_expert_forward_matches_experts_module(arch):
    # Route every token to one expert with weight 1: the experts module then computes expert e alone.
    model = tiny(arch)
    adapter = get_adapter(model)
    layer = adapter.moe_layers[-1]
    x = random_hidden(adapter)
    for expert in range(adapter.num_experts):
        ids = torch.full((x.shape[0], 1), expert)
        with torch.no_grad():
            want = adapter.experts(model, layer)(x, ids, torch.ones(x.shape[0], 1))
        got = adapter.expert_forward(adapter.get_expert(model, layer, expert), x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_set_expert_changes_output_as_predicted(arch):
    model = copy.deepcopy(tiny(arch))
    adapter = get_adapter(model)
    layer = adapter.moe_layers[-1]
    block = adapter.moe_block(model, layer)
    x = random_hidden(adapter, tokens=32)
    _, ids, weights = adapter.route(model, layer, x)
    expert = int(ids[0, 0])
    old = adapter.get_expert(model, layer, expert)
    gen = torch.Generator().manual_seed(1)
    new = ExpertWeights(
        **{k: t * 1.5 + 0.1 * torch.randn(t.shape, generator=gen) for k, t in old.tensors().items()}
    )

    with torch.no_grad():
        before = adapter.block_output(block(x.unsqueeze(0)))[0]
        adapter.set_expert(model, layer, expert, new)
        after = adapter.block_output(block(x.unsqueeze(0)))[0]
    # Only the tokens routed to `expert` change, by weight * (new(x) - old(x)).
    rows, slot = torch.where(ids == expert)
    predicted = before.clone()
    delta = adapter.expert_forward(new, x[rows]) - adapter.expert_forward(old, x[rows])
    predicted.index_add_(0, rows, delta * weights[rows, slot, None])
    torch.testing.assert_close(after, predicted, rtol=0, atol=1e-5)
    assert not torch.allclose(after, before)
    assert_same_expert(adapter.get_expert(model, layer, expert), new)
    # Other experts are untouched.
    other = (expert + 1) % adapter.num_experts
    assert_same_expert(
        adapter.get_expert(model, layer, other), get_adapter(tiny(arch)).get_expert(tiny(arch), layer, other)
    )


def test_set_expert_rejects_wrong_shapes():
    model = copy.deepcopy(tiny("mixtral"))
    adapter = get_adapter(model)
    w = adapter.get_expert(model, 0, 0)
    with pytest.raises(MoeprepError, match="expected shape"):
        adapter.set_expert(model, 0, 0, ExpertWeights(w.gate.T, w.up, w.down))
    with pytest.raises(MoeprepError, match="out of range"):
        adapter.get_expert(model, 0, adapter.num_experts)


# --- reading checkpoints ------------------------------------------------------------------


def test_read_expert_from_save_pretrained(arch, tmp_path):
    # save_pretrained writes per-expert hub names where transformers has a conversion mapping
    # (all but gpt-oss) and fused names otherwise; a small shard size forces an index.json.
    model = tiny(arch)
    adapter = get_adapter(model)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            assert_same_expert(read_expert(tmp_path, layer, expert), adapter.get_expert(model, layer, expert))


def test_read_expert_fused_names(arch, tmp_path):
    # The transformers 5 in-memory names (what a checkpoint of the fused parameters holds), unsharded.
    model = tiny(arch)
    adapter = get_adapter(model)
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    layer = adapter.moe_layers[-1]
    assert_same_expert(adapter.read_expert(tmp_path, layer, 1), adapter.get_expert(model, layer, 1))


@pytest.mark.parametrize(
    "arch, names",
    [
        ("mixtral", "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"),
        ("qwen3_moe", "model.layers.{l}.mlp.experts.{e}.{w}.weight"),
    ],
)
def test_read_expert_hub_names(arch, names, tmp_path):
    # Hand-written per-expert checkpoint, as hub checkpoints of Mixtral and Qwen name their experts.
    model = tiny(arch)
    adapter = get_adapter(model)
    suffix = {"gate": "w1", "up": "w3", "down": "w2"} if arch == "mixtral" else {
        "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # fmt: skip
    tensors = {}
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            w = adapter.get_expert(model, layer, expert)
            for part, stem in suffix.items():
                tensors[names.format(l=layer, e=expert, w=stem)] = getattr(w, part)
    model.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in tensors or arch != "mixtral"
    for expert in range(adapter.num_experts):
        assert_same_expert(read_expert(tmp_path, 1, expert), adapter.get_expert(model, 1, expert))


def test_read_expert_missing_tensor_is_named(tmp_path):
    model = tiny("mixtral")
    model.config.save_pretrained(tmp_path)
    w = get_adapter(model).get_expert(model, 0, 0)
    save_file(
        {
            "model.layers.0.block_sparse_moe.experts.0.w1.weight": w.gate,
            "model.layers.0.block_sparse_moe.experts.0.w3.weight": w.up,
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(MoeprepError, match=r"experts\.0\.w2\.weight"):
        read_expert(tmp_path, 0, 0)
    with pytest.raises(MoeprepError, match=r"no tensor model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        read_expert(tmp_path, 1, 0)


def test_read_expert_names_what_an_mxfp4_layout_lacks(tmp_path):
    model = tiny("gpt_oss")
    model.config.save_pretrained(tmp_path)
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 2)}, str(tmp_path / "x.safetensors")
    )  # released MXFP4 names, without the scales (tests/prep/sources/test_source_formats.py reads the whole layout)
    with pytest.raises(MoeprepError, match="blocks without their scales model.layers.0.mlp.experts.gate_up_proj_scales"):
        read_expert(tmp_path, 0, 0)


def test_read_expert_bad_index(tmp_path):
    tiny("mixtral").config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(MoeprepError, match="not a valid safetensors index"):
        read_expert(tmp_path, 0, 0)


# --- loading ----------------------------------------------------------------------------------


def test_load_model_round_trip(tmp_path):
    model = tiny("qwen2_moe")
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, experts_implementation="eager")
    assert not loaded.training
    adapter = get_adapter(loaded)
    for layer in adapter.moe_layers:
        assert_same_expert(adapter.get_expert(loaded, layer, 2), adapter.get_expert(model, layer, 2))


def test_load_model_errors(tmp_path):
    with pytest.raises(MoeprepError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(MoeprepError, match="no config.json"):
        load_model(tmp_path)


# --- describe -------------------------------------------------------------------------------


def _mixtral_counts(c):
    """Parameter counts of a Mixtral config by hand: (total, per expert)."""
    h, i, e, v = c.hidden_size, c.intermediate_size, c.num_local_experts, c.vocab_size
    kv = c.num_key_value_heads * (c.head_dim or h // c.num_attention_heads)
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o (no biases)
    expert = 3 * h * i
    layer = attention + e * h + e * expert + 2 * h  # + router + experts + two norms
    total = v * h * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * layer + h
    return total, expert


def test_describe_mixtral_by_hand():
    model = tiny("mixtral")
    c = model.config
    total, expert = _mixtral_counts(c)
    info = describe(model)
    assert info["total_params"] == total
    assert info["expert_params"] == expert and info["expert_bytes_bf16"] == 2 * expert
    assert (
        info["active_params"]
        == total - c.num_hidden_layers * (c.num_local_experts - c.num_experts_per_tok) * expert
    )
    assert (info["num_layers"], info["num_moe_layers"], info["num_experts"], info["top_k"]) == (2, 2, 4, 2)
    assert info["num_shared_experts"] == 0


def test_describe_mixtral_8x7b_on_meta_device():
    # The published sizes of Mixtral-8x7B: 46.7B parameters, 12.9B active per token.
    config = mixtral_config().__class__()  # the MixtralConfig defaults are Mixtral-8x7B
    info = describe(build_skeleton(config))
    assert info["total_params"] == _mixtral_counts(config)[0] == 46_702_792_704
    assert info["active_params"] == 12_879_925_248
    assert info["expert_bytes_bf16"] == 2 * 3 * 4096 * 14336


def test_describe_deepseek_v2_by_hand():
    model = tiny("deepseek_v2")
    c = deepseek_v2_config()
    h, v, heads = c.hidden_size, c.vocab_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attention = (
        h * heads * qk  # q_proj (no q LoRA)
        + h * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv_a_proj_with_mqa
        + c.kv_lora_rank  # kv_a_layernorm
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj
        + heads * c.v_head_dim * h  # o_proj
    )
    expert = 3 * h * c.moe_intermediate_size
    shared = 3 * h * c.moe_intermediate_size * c.n_shared_experts
    dense_mlp = 3 * h * c.intermediate_size
    moe_mlp = c.n_routed_experts * h + c.n_routed_experts * expert + shared
    n_dense, n_moe = c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace
    total = 2 * v * h + h + c.num_hidden_layers * (attention + 2 * h) + n_dense * dense_mlp + n_moe * moe_mlp
    info = describe(model)
    assert info["total_params"] == total
    assert info["expert_params"] == expert
    assert info["num_shared_experts"] == 2 and info["shared_intermediate_size"] == 2 * c.moe_intermediate_size
    assert info["moe_layers"] == [1, 2]
    # Active: everything but the (E - K) unused routed experts of each MoE layer; shared ones stay.
    assert info["active_params"] == total - n_moe * (c.n_routed_experts - c.num_experts_per_tok) * expert


def test_describe_counts_gpt_oss_biases():
    model = tiny("gpt_oss")
    c = model.config
    info = describe(model)
    per_expert = 3 * c.hidden_size * c.intermediate_size + 2 * c.intermediate_size + c.hidden_size
    assert info["expert_params"] == per_expert
    assert get_adapter(model).get_expert(model, 0, 0).num_params() == per_expert
