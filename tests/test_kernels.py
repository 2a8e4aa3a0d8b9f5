"""The compute path (loader/kernels.py): decoded copies held in the cache, counted in its bytes, decoded once
per miss; the dtype they are held in, chosen by measurement."""

from __future__ import annotations

import pytest
import torch

from loader import kernels
from loader.codec import RecordLayout
from loader.kernels import (
    DecodedLayout,
    Int4PackLayout,
    Int4Weights,
    KernelError,
    held_layout,
    int4pack_available,
    int4pack_fits,
    pick_form,
)
from loader.runtime import LoaderError, load, minimum_budget
from prep.quant.hqq_codec import encode_expert
from tests.tiny_models import (
    CONFIGS,
    build_tiny_model,
    decoded_reference,
    tiny_artifact,
    tiny_recipe,
    tiny_tokenizer,
)

needs_int4pack = pytest.mark.skipif(not int4pack_available(torch.device("cpu")),
                                    reason="this torch build has no CPU int4 weight-only kernel")


def _ids(seed=0):
    torch.manual_seed(seed)
    return torch.randint(4, 60, (2, 11))


@pytest.mark.parametrize("precision,group,meta", [("int4", 16, 0), ("int2", 16, 4), ("int8", 32, 2), ("int3", 16, 0)])
@pytest.mark.parametrize("transposed", [False, True])
def test_decode_into_a_slot_equals_the_record_decoding(precision, group, meta, transposed):
    torch.manual_seed(0)
    tensors = {"gate_up_proj": torch.randn(64, 32), "down_proj": torch.randn(32, 32), "down_proj_bias": torch.randn(32)}
    if transposed:
        tensors = {"gate_up_proj": torch.randn(32, 64), "down_proj": torch.randn(32, 32)}
    layout, record = encode_expert(tensors, precision, group, transposed, meta)
    expected = layout.decode(record)
    for dtype in (torch.float32, torch.bfloat16):
        decoded = DecodedLayout(layout, dtype)
        region = torch.full((decoded.nbytes + 64,), 0xAB, dtype=torch.uint8)
        views = decoded.fill(record, region)
        assert set(views) == set(expected)
        for name, want in expected.items():
            assert views[name].shape == want.shape and views[name].dtype == dtype
            # float32: bit for bit; bfloat16: the float32 values rounded once
            assert torch.equal(views[name], want.to(dtype)), (name, dtype)
        assert bool((region[decoded.nbytes:] == 0xAB).all())  # nothing written past the decoded region


def test_the_decoded_region_is_counted_in_the_slot_and_a_hit_never_decodes(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    ids = _ids(3)
    packed = load(artifact, memory_budget="unlimited", expert_dtype="packed")
    held = load(artifact, memory_budget="unlimited", expert_dtype="float32")
    layout = RecordLayout.from_json(held.runtime.layouts["int4"].to_json())
    decoded_bytes = DecodedLayout(layout, torch.float32).nbytes
    assert held.budget["expert_dtype"] == {"int4": "float32"} and packed.budget["expert_dtype"] == {"int4": "record"}
    assert held.budget["slot_bytes"]["int4"] >= packed.budget["slot_bytes"]["int4"] + decoded_bytes
    with torch.no_grad():
        for loaded in (packed, held):
            loaded.model(input_ids=ids)
    first = {name: m.stats() for name, m in (("packed", packed), ("held", held))}
    assert first["held"]["compute"]["decodes"] == first["held"]["misses"]  # once per miss
    assert first["packed"]["compute"]["decodes"] == first["packed"]["hits"] + first["packed"]["misses"]  # every use
    with torch.no_grad():
        for loaded in (packed, held):
            loaded.model(input_ids=ids)  # everything is cached now: all hits
    again = {name: m.stats() for name, m in (("packed", packed), ("held", held))}
    assert again["held"]["misses"] == first["held"]["misses"]
    assert again["held"]["compute"]["decodes"] == first["held"]["compute"]["decodes"]  # hits use the copy
    assert again["packed"]["compute"]["decodes"] > first["packed"]["compute"]["decodes"]
    packed.close()
    held.close()


def test_decoded_copies_stay_inside_a_small_budget_and_give_the_same_logits(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "qwen3_moe", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(4)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    minimum = minimum_budget(artifact, expert_dtype="float32")
    assert minimum > minimum_budget(artifact, expert_dtype="packed")  # a slot holds the copy too
    with pytest.raises(LoaderError, match="minimum"):
        load(artifact, memory_budget=minimum - 1, expert_dtype="float32")
    loaded = load(artifact, memory_budget=minimum, expert_dtype="float32")  # one expert per layer: evictions
    with torch.no_grad():
        got = torch.cat([loaded.model(input_ids=ids[:, :t]).logits[:, -1:] for t in range(1, ids.shape[1] + 1)], 1)
    stats, b = loaded.stats(), loaded.budget
    loaded.close()
    assert stats["misses"] > loaded.runtime.num_layers
    assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
    # a slot reused by another expert decodes that expert again: a stale copy would change the logits
    assert torch.allclose(got, expected, atol=1e-5)


def test_bfloat16_copies_are_within_bfloat16_rounding_of_the_decoded_model(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(5)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        loaded = load(artifact, memory_budget="unlimited", expert_dtype="bfloat16")
        got = loaded.model(input_ids=ids).logits
    loaded.close()
    # Tolerance of the kernel: weights and the expert products' inputs rounded to bfloat16 (8-bit mantissa,
    # relative error 2^-9 each) through 2 MoE layers: 2% of the logits' spread.
    spread = float(expected.abs().max())
    err = float((got - expected).abs().max())
    assert err <= 0.02 * spread, (err, spread)
    assert err > 0  # the products really ran in bfloat16


def test_auto_takes_the_fastest_form_and_the_smallest_slot_on_a_near_tie(monkeypatch):
    times = {}
    monkeypatch.setattr(kernels, "time_linear", lambda rows, cols, form, device, group: times[form])
    for f32, bf16, pack, want in ((1.0, 3.0, 5.0, "float32"), (1.0, 0.5, 5.0, "bfloat16"),
                                  (1.0, 1.1, 5.0, "bfloat16"), (1.0, 1.3, 5.0, "float32"),
                                  (1.0, 0.4, 0.2, "int4pack"), (1.0, 0.4, 0.45, "int4pack"), (1.0, 0.2, 0.4, "bfloat16")):
        pick_form.cache_clear()
        times.update({"float32": f32, "bfloat16": bf16, "int4pack": pack})
        form, seconds = pick_form("float32", ((64, 32),), True, 32, "cpu")
        assert form == want, (f32, bf16, pack)
        assert seconds == {"int4pack": pack, "bfloat16": bf16, "float32": f32}
    pick_form.cache_clear()
    times.update({"float32": 1.0, "bfloat16": 2.0, "int4pack": 0.1})
    assert pick_form("float32", ((64, 32),), False, 32, "cpu")[0] == "float32"  # int4pack not a candidate
    pick_form.cache_clear()


def test_auto_passthrough_and_the_environment(monkeypatch):
    torch.manual_seed(0)
    tensors = {"gate_up_proj": torch.randn(64, 32), "down_proj": torch.randn(32, 32)}
    quantized, _ = encode_expert(tensors, "int4", 16)
    plain, _ = encode_expert(tensors, "passthrough", 16)
    cpu = torch.device("cpu")
    assert held_layout("auto", plain, cpu) is None  # a plain record is computed as it is
    assert held_layout("packed", quantized, cpu) is None
    monkeypatch.setenv("MOEPREP_EXPERT_DTYPE", "bfloat16")
    assert held_layout("auto", quantized, cpu).dtype == torch.bfloat16
    assert held_layout("float32", quantized, cpu).dtype == torch.float32  # an explicit choice wins
    # groups of 16 do not fit torch's int4 kernel: a bfloat16 copy instead
    assert not int4pack_fits(quantized) and held_layout("int4pack", quantized, cpu).name == "bfloat16"
    monkeypatch.setenv("MOEPREP_EXPERT_DTYPE", "fp8")
    with pytest.raises(KernelError, match="MOEPREP_EXPERT_DTYPE='fp8' unknown"):
        held_layout("auto", quantized, cpu)
    monkeypatch.delenv("MOEPREP_EXPERT_DTYPE")
    measured = pick_form("float32", ((64, 32), (32, 32)), False, 16, "cpu")[0]
    assert held_layout("auto", quantized, cpu).name == measured
    with pytest.raises(KernelError, match="expert dtype 'int5' unknown"):
        held_layout("int5", quantized, cpu)


@needs_int4pack
@pytest.mark.parametrize("precision,transposed", [("int4", False), ("int3", False), ("int4", True)])
def test_int4pack_products_equal_the_decoded_matrices_within_bfloat16(precision, transposed):
    torch.manual_seed(1)
    tensors = {"gate_up_proj": torch.randn(64, 96) * 0.1, "down_proj": torch.randn(32, 64) * 0.1,
               "down_proj_bias": torch.randn(32)}
    if transposed:  # gpt-oss keeps [in, out]
        tensors = {"gate_up_proj": torch.randn(96, 64) * 0.1, "down_proj": torch.randn(64, 32) * 0.1}
    layout, record = encode_expert(tensors, precision, 32, transposed, 0)
    assert int4pack_fits(layout)
    held = Int4PackLayout(layout)
    region = torch.full((held.nbytes + 64,), 0xAB, dtype=torch.uint8)
    weights = held.fill(record, region)
    assert isinstance(weights, Int4Weights) and bool((region[held.nbytes:] == 0xAB).all())
    decoded = layout.decode(record)
    for spec in layout.matrices:
        if len(spec.shape) == 1:
            continue
        w = decoded[spec.name].T if transposed else decoded[spec.name]  # [out, in]
        x = torch.randn(5, w.shape[1])
        got = weights.linear(spec.name, x.to(torch.bfloat16)).float()
        want = x @ w.T + (decoded[f"{spec.name}_bias"] if f"{spec.name}_bias" in decoded else 0)
        # Tolerance of the kernel: scale, zero' and the activations in bfloat16 (relative 2^-9 each),
        # accumulated over the input: 1% of the output's norm.
        assert float((got - want).norm() / want.norm()) < 1e-2, spec.name


def _int4pack_artifact(root, arch: str):
    """A tiny ``arch`` with expert matrices int4pack takes (intermediate 32, groups of 32), prepared at int4."""
    from prep.pipeline import prepare

    config = CONFIGS[arch]()
    config.intermediate_size = 32
    model = build_tiny_model(arch, config=config)
    model.save_pretrained(root / "model")
    tiny_tokenizer(config.vocab_size).save_pretrained(root / "model")
    prepare(tiny_recipe("int4", group_size=32), root=root, output=root / "artifact")
    return model, root / "artifact"


@needs_int4pack
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_the_loader_computes_int4pack_experts_within_the_kernels_tolerance(tmp_path, arch):
    model, artifact = _int4pack_artifact(tmp_path, arch)
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(6)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    for budget in ("unlimited", minimum_budget(artifact, expert_dtype="int4pack")):
        loaded = load(artifact, memory_budget=budget, expert_dtype="int4pack")
        assert loaded.budget["expert_dtype"] == {"int4": "int4pack"}
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        stats = loaded.stats()
        loaded.close()
        assert stats["compute"]["decodes"] == stats["misses"]  # repacked once per miss
        # Tolerance of the kernel (see above) through 2 MoE layers: 3% of the logits' spread.
        spread = float(expected.abs().max())
        assert 0 < float((got - expected).abs().max()) <= 0.03 * spread, budget


def test_an_unknown_expert_dtype_is_one_clear_error(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    with pytest.raises(LoaderError, match="expert dtype 'half' unknown; use one of auto, float32"):
        load(artifact, expert_dtype="half")


def test_auto_decodes_per_use_where_a_decoded_copy_does_not_fit(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    small = minimum_budget(artifact)  # auto: the packed form's minimum
    assert small == minimum_budget(artifact, expert_dtype="packed") < minimum_budget(artifact, expert_dtype="float32")
    loaded = load(artifact, memory_budget=small)
    assert loaded.budget["expert_dtype"] == {"int4": "record"}
    loaded.close()
    loaded = load(artifact, memory_budget=minimum_budget(artifact, expert_dtype="float32"))
    assert loaded.budget["expert_dtype"] == {"int4": "float32"}  # the pinned "auto" of the suite
    loaded.close()


def test_the_cli_offers_every_form():
    from loader.cli import generate_command
    from loader.kernels import EXPERT_DTYPES

    option = next(p for p in generate_command.params if p.name == "expert_dtype")
    assert tuple(option.type.choices) == EXPERT_DTYPES


def _decode_logits(loaded, ids: torch.Tensor, prompt: int = 4) -> torch.Tensor:
    """Prefill ``prompt`` tokens, then one-token decode steps; the last position's logits of each call."""
    device = next(p.device for p in loaded.model.parameters() if p.device.type != "meta")
    ids = ids.to(device)
    with torch.no_grad():
        out = loaded.model(input_ids=ids[:, :prompt], use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            out = loaded.model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1).cpu()


def test_cpu_misses_always_needs_a_gpu_and_the_host_store(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    with pytest.raises(LoaderError, match="needs device='cuda' and store='host'"):
        load(artifact, cpu_misses="always")
    with pytest.raises(LoaderError, match="cpu_misses 'sometimes' unknown"):
        load(artifact, cpu_misses="sometimes")
    loaded = load(artifact, store="host")  # auto on a CPU: nothing to switch
    assert loaded.stats()["compute"]["cpu_misses"] == "never"
    loaded.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_held_forms_and_cpu_misses_give_the_decoded_models_logits(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(7)[:1]
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[:, 3:]
    small = minimum_budget(artifact, store="host", device="cuda", expert_dtype="float32")
    for budget, store, cpu in (("unlimited", "disk", "never"), (small, "host", "never"), (small, "host", "always")):
        loaded = load(artifact, device="cuda", memory_budget=budget, store=store, expert_dtype="float32",
                      cpu_misses=cpu)
        got = _decode_logits(loaded, ids)
        stats = loaded.stats()
        loaded.close()
        assert stats["compute"]["expert_dtype"] == {"int4": "float32"}
        assert torch.allclose(got, expected, atol=1e-4), (budget, store, cpu)
        if cpu == "always":  # decode-step misses ran on the CPU: nothing copied for them
            assert stats["compute"]["cpu_computed"] > 0
        else:
            assert stats["compute"]["cpu_computed"] == 0
    loaded = load(artifact, device="cuda", store="host")  # auto: measured, and int4pack is CPU-only
    compute = loaded.stats()["compute"]
    loaded.close()
    assert compute["expert_dtype"]["int4"] in ("bfloat16", "float32")
    costs = compute["miss_costs"]
    assert costs["cpu_seconds"]["int4"] > 0 and costs["gpu_seconds"]["int4"] > 0
    assert (compute["cpu_misses"] == "auto") == (costs["cpu_seconds"]["int4"] < costs["gpu_seconds"]["int4"])


@needs_int4pack
def test_a_long_prefill_decodes_the_record_instead_of_the_int4_kernel(tmp_path, monkeypatch):
    import loader.runtime as runtime

    model, artifact = _int4pack_artifact(tmp_path, "mixtral")
    reference = decoded_reference(model, artifact, "int4")
    torch.manual_seed(8)
    ids = torch.randint(4, 60, (2, 40))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    spread = float(expected.abs().max())
    for limit in (0, 10**6):  # every call above the limit (float32 decode per use), or none (the int4 kernel)
        monkeypatch.setattr(runtime, "INT4PACK_MAX_TOKENS", limit)
        loaded = load(artifact, memory_budget="unlimited", expert_dtype="int4pack")
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        stats = loaded.stats()
        loaded.close()
        assert stats["compute"]["decodes"] == stats["misses"]  # one decode per use here: each expert used once
        if limit == 0:  # the record decoded in float32: the float32 model, no held form made
            assert torch.allclose(got, expected, atol=1e-5)
        else:
            assert 0 < float((got - expected).abs().max()) <= 0.03 * spread
