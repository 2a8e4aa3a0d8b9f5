"""Held forms (loader/forms.py): every form against the decoded-weights model, one form per slot sized by the
form alone, forms made on the reader threads (a hit never decodes), the form fixed before the run (three
loads, one cache), the budget with the staging buffers counted, and no leak from a failed load."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from loader import kernels
from loader.budget import ALIGN
from loader.codec import RecordLayout
from loader.forms import (
    FORMS,
    DecodedForm,
    Int4PackForm,
    Int4Weights,
    KernelError,
    choose_form,
    int4pack_available,
    int4pack_fits,
)
from loader.runtime import LoaderError, load, minimum_budget
from prep.quant.hqq_codec import encode_expert
from tests.helpers.cpu_kernels import needs_int4pack, needs_kernel_layout
from tests.helpers.tiny_models import (
    CONFIGS,
    build_tiny_model,
    decoded_reference,
    tiny_artifact,
    tiny_recipe,
    tiny_tokenizer,
)

CPU = torch.device("cpu")


def _ids(seed=0, tokens=11):
    torch.manual_seed(seed)
    return torch.randint(4, 60, (2, tokens))


@pytest.mark.parametrize("precision,group,meta", [("int4", 16, 0), ("int2", 16, 4), ("int8", 32, 2), ("int3", 16, 0),
                                                  ("mxfp4", 32, 0)])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_decoded_form_equals_the_record_decoding(precision, group, meta, transposed):
    torch.manual_seed(0)
    tensors = {"gate_up_proj": torch.randn(64, 32), "down_proj": torch.randn(32, 32), "down_proj_bias": torch.randn(32)}
    if transposed:
        tensors = {"gate_up_proj": torch.randn(32, 64), "down_proj": torch.randn(32, 32)}
    layout, record = encode_expert(tensors, precision, group, transposed, meta)
    expected = layout.decode(record)
    for dtype in (torch.float32, torch.bfloat16):
        form = DecodedForm(layout, dtype)
        region = torch.full((form.nbytes + 64,), 0xAB, dtype=torch.uint8)
        views = form.make(record, region)
        assert set(views) == set(expected)
        for name, want in expected.items():
            assert views[name].shape == want.shape and views[name].dtype == dtype
            # float32: bit for bit; bfloat16: the float32 values rounded once
            assert torch.equal(views[name], want.to(dtype)), (name, dtype)
        assert bool((region[form.nbytes:] == 0xAB).all())  # nothing written past the form


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
    form = Int4PackForm(layout)
    region = torch.full((form.nbytes + 64,), 0xAB, dtype=torch.uint8)
    weights = form.make(record, region)
    assert isinstance(weights, Int4Weights) and bool((region[form.nbytes:] == 0xAB).all())
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
    """A tiny ``arch`` with expert matrices every form takes (intermediate 32, groups of 32), prepared at int4."""
    from prep.pipeline import prepare

    config = CONFIGS[arch]()
    config.intermediate_size = 32
    model = build_tiny_model(arch, config=config)
    model.save_pretrained(root / "model")
    tiny_tokenizer(config.vocab_size).save_pretrained(root / "model")
    prepare(tiny_recipe("int4", group_size=32), root=root, output=root / "artifact")
    return model, root / "artifact"


@pytest.fixture(scope="module")
def every_form_artifact(tmp_path_factory):
    return _int4pack_artifact(tmp_path_factory.mktemp("forms"), "mixtral")


# The tolerance of each form against the decoded-weights model, through 2 MoE layers, as a share of the
# logits' spread: the record and float32 compute the decoded float32 matrices (only the summation order
# differs); bfloat16/float16 round the weights and the products' inputs (relative 2^-9 / 2^-11 each);
# int4pack also rounds scale and zero' to bfloat16 (the kernel test above); qdot rounds the activations to int8 per block
# (tests/loader/test_qdot.py: its own bound).
FORM_TOLERANCE = {"record": 1e-6, "float32": 1e-6, "bfloat16": 0.02, "float16": 0.01, "int4pack": 0.03,
                  "qdot": 0.03}


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_computes_the_decoded_model_within_its_tolerance(every_form_artifact, name):
    """A new form is one FORMS entry plus its tolerance here. Unlimited (every expert cached in the form) and
    the form's minimum budget (evictions: a slot reused by another expert makes that expert's form again)."""
    assert set(FORMS) == set(FORM_TOLERANCE)
    model, artifact = every_form_artifact
    if FORMS[name](RecordLayout.from_json(_layout(artifact)), CPU) is None:
        pytest.skip(f"{name} does not apply on this machine (no kernel)")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(6, tokens=16)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    dtype = "packed" if name == "record" else name
    spread = float(expected.abs().max())
    for budget in ("unlimited", minimum_budget(artifact, expert_dtype=dtype)):
        loaded = load(artifact, memory_budget=budget, expert_dtype=dtype)
        assert loaded.budget["expert_dtype"] == {"int4": name}
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        stats, b = loaded.stats(), loaded.budget
        loaded.close()
        err = float((got - expected).abs().max())
        assert err <= FORM_TOLERANCE[name] * spread, (name, budget, err, spread)
        assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"] if b["limit_bytes"] else True


def _layout(artifact):
    import json

    return json.loads((artifact / "manifest.json").read_text())["stores"]["int4"]["layout"]


def test_a_slot_holds_the_form_alone_and_a_hit_never_decodes(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    ids = _ids(3)
    packed = load(artifact, memory_budget="unlimited", expert_dtype="packed")
    held = load(artifact, memory_budget="unlimited", expert_dtype="float32")
    layout = RecordLayout.from_json(held.runtime.layouts["int4"].to_json())
    form_bytes = DecodedForm(layout, torch.float32).nbytes
    assert held.budget["expert_dtype"] == {"int4": "float32"} and packed.budget["expert_dtype"] == {"int4": "record"}
    assert held.budget["slot_bytes"]["int4"] == -(-form_bytes // ALIGN) * ALIGN  # the form, no record beside it
    store = packed.runtime.stores["int4"]
    assert packed.budget["slot_bytes"]["int4"] == (store.stride if store.direct_io else -(-store.record_bytes // 64) * 64)
    assert held.budget["staging_bytes"] == 2 * store.stride and packed.budget["staging_bytes"] == 0
    with torch.no_grad():
        for loaded in (packed, held):
            loaded.model(input_ids=ids)
    first = {name: m.stats() for name, m in (("packed", packed), ("held", held))}
    assert first["held"]["compute"]["decodes"] == first["held"]["misses"]  # once per miss, on a reader thread
    assert first["packed"]["compute"]["decodes"] == first["packed"]["hits"] + first["packed"]["misses"]  # every use
    with torch.no_grad():
        for loaded in (packed, held):
            loaded.model(input_ids=ids)  # everything is cached now: all hits
    again = {name: m.stats() for name, m in (("packed", packed), ("held", held))}
    assert again["held"]["misses"] == first["held"]["misses"] and again["held"]["hits"] > first["held"]["hits"]
    assert again["held"]["compute"]["decodes"] == first["held"]["compute"]["decodes"]  # hits use the form
    assert again["packed"]["compute"]["decodes"] > first["packed"]["compute"]["decodes"]
    packed.close()
    held.close()


def test_the_form_is_made_on_a_reader_thread(tmp_path_factory, monkeypatch):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    makers = []
    real = DecodedForm.make

    def spy(self, record, region):
        makers.append(threading.current_thread().name)
        return real(self, record, region)

    monkeypatch.setattr(DecodedForm, "make", spy)
    loaded = load(artifact, memory_budget="unlimited", expert_dtype="float32")
    with torch.no_grad():
        loaded.model(input_ids=_ids(2))
    loaded.close()
    assert makers and all(name.startswith("moeprep-read-") for name in makers)


def test_one_budget_gives_one_cache_across_loads(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    seen = []
    for _ in range(3):
        loaded = load(artifact, memory_budget=minimum_budget(artifact) + 3 * 4096)
        b = loaded.budget
        seen.append((b["pools"], b["slot_bytes"], b["cache_slots"], b["expert_dtype"], b["staging_bytes"]))
        loaded.close()
    assert seen[0] == seen[1] == seen[2]


def test_the_budget_holds_with_the_staging_buffers_counted(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "qwen3_moe", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(4)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    minimum = minimum_budget(artifact, expert_dtype="float32")
    assert minimum > minimum_budget(artifact, expert_dtype="packed")  # a float32 form is larger than the record
    with pytest.raises(LoaderError, match="minimum"):
        load(artifact, memory_budget=minimum - 1, expert_dtype="float32")
    loaded = load(artifact, memory_budget=minimum, expert_dtype="float32")  # one expert per layer: evictions
    with torch.no_grad():
        got = torch.cat([loaded.model(input_ids=ids[:, :t]).logits[:, -1:] for t in range(1, ids.shape[1] + 1)], 1)
    stats, b = loaded.stats(), loaded.budget
    loaded.close()
    assert stats["misses"] > loaded.runtime.num_layers
    assert b["staging_bytes"] > 0 and b["buffer_bytes"] >= b["staging_bytes"]
    assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
    assert stats["peak_expert_bytes"] >= b["staging_bytes"]  # the staging buffers are on the meter
    # a slot reused by another expert makes that expert's form again: a stale form would change the logits
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_form_is_fixed_by_rule_plan_environment_and_argument(monkeypatch):
    torch.manual_seed(0)
    tensors = {"gate_up_proj": torch.randn(64, 32), "down_proj": torch.randn(32, 32)}
    quantized, _ = encode_expert(tensors, "int4", 32)
    small_groups, _ = encode_expert(tensors, "int4", 16)
    plain, _ = encode_expert(tensors, "passthrough", 16)
    monkeypatch.delenv("MOEPREP_EXPERT_DTYPE")
    # the device rule: qdot where the compiled kernels run, else int4pack where torch's CPU kernel takes the record,
    # else bfloat16; plain records as they are
    compiled = kernels.available()
    want = "qdot" if compiled else "int4pack" if int4pack_available(CPU) else "bfloat16"
    assert choose_form("auto", quantized, CPU).name == want
    assert choose_form("auto", small_groups, CPU).name == ("qdot" if compiled else "bfloat16")  # no int4pack at 16
    assert choose_form("auto", plain, CPU).name == "record"
    assert choose_form("auto", quantized, CPU, neuron=True).name == "record"
    assert choose_form("auto", quantized, CPU, planned="float16").name == "float16"  # the plan's choice
    assert choose_form("float32", plain, CPU).name == "record"  # float32 of float32 matrices: the record itself
    assert choose_form("bfloat16", plain, CPU).name == "bfloat16"
    monkeypatch.setenv("MOEPREP_EXPERT_DTYPE", "bfloat16")
    assert choose_form("auto", quantized, CPU, planned="float16").name == "bfloat16"  # the device team's pin
    assert choose_form("float32", quantized, CPU).name == "float32"  # an explicit choice wins
    assert choose_form("packed", quantized, CPU).name == "record"
    assert choose_form("int4pack", small_groups, CPU).name == "bfloat16"  # where int4pack does not apply
    monkeypatch.setenv("MOEPREP_EXPERT_DTYPE", "fp8")
    with pytest.raises(KernelError, match="MOEPREP_EXPERT_DTYPE='fp8' unknown"):
        choose_form("auto", quantized, CPU)
    with pytest.raises(KernelError, match="expert dtype 'int5' unknown"):
        choose_form("int5", quantized, CPU)


def test_the_plan_names_the_form(tmp_path_factory, monkeypatch):
    import dataclasses

    from loader.plan import Plan, read_plan

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    monkeypatch.delenv("MOEPREP_EXPERT_DTYPE")
    plan = dataclasses.replace(read_plan(artifact), forms=(("int4", "float16"),))
    assert Plan.from_json(plan.to_json()) == plan
    loaded = load(artifact, memory_budget="unlimited", plan=plan)
    assert loaded.budget["expert_dtype"] == {"int4": "float16"}
    loaded.close()


def test_an_unknown_expert_dtype_is_one_clear_error(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    with pytest.raises(LoaderError, match="expert dtype 'half' unknown; use one of auto, float32"):
        load(artifact, expert_dtype="half")


def test_auto_decodes_per_use_where_the_form_does_not_fit(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    small = minimum_budget(artifact)  # auto: the record form's minimum
    assert small == minimum_budget(artifact, expert_dtype="packed") < minimum_budget(artifact, expert_dtype="float32")
    loaded = load(artifact, memory_budget=small)
    assert loaded.budget["expert_dtype"] == {"int4": "record"}
    loaded.close()
    loaded = load(artifact, memory_budget=minimum_budget(artifact, expert_dtype="float32"))
    assert loaded.budget["expert_dtype"] == {"int4": "float32"}  # the pinned "auto" of the suite
    loaded.close()


def test_auto_falls_back_one_store_at_a_time_so_a_store_that_fits_keeps_its_form(tmp_path):
    """A mixed-precision artifact (an int4 pool and an int2 pool): as the budget grows from the record form's
    minimum, the forms go from every store decoded per use, through the int2 store alone decoded per use (the
    int4 pool keeps its made form: before, one store that did not fit sent every store to the record form), to
    every store's made form; the mixed step decodes the same logits as the others."""
    from loader.budget import cache_layout
    from tests.helpers.tiny_models import prepare_tiny_artifact

    recipe = tiny_recipe("int4", quantize={"also": ["int2"]}, bitwidth={"method": "random", "share": 0.5, "low": "int2"})
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=recipe)
    low, high = minimum_budget(artifact), minimum_budget(artifact, expert_dtype="float32")
    seen = []
    for budget in range(low, high + 64 * 4096, 4096):
        forms = cache_layout(artifact, budget).forms
        if not seen or seen[-1][1] != forms:
            seen.append((budget, forms))
    steps = [forms for _, forms in seen]
    assert steps[0] == {"int4": "record", "int2": "record"}
    assert {"int4": "float32", "int2": "record"} in steps  # the int2 pool (a third of the budget) holds its float32 form last
    assert steps[-1] == {"int4": "float32", "int2": "float32"}
    ids = _ids()
    outs = []
    for budget, forms in seen:
        loaded = load(artifact, memory_budget=budget)
        assert loaded.budget["expert_dtype"] == forms
        with torch.no_grad():
            outs.append(loaded.model(input_ids=ids).logits)
        loaded.close()
    for out in outs[1:]:
        assert torch.allclose(out, outs[0], atol=1e-4)


def _open_store_files(artifact) -> int:
    root = str(artifact.resolve())
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                count += 1
        except OSError:
            pass
    return count


def _readers() -> int:
    return sum(t.name.startswith("moeprep-read-") for t in threading.enumerate())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_a_failed_load_leaves_no_open_store_and_no_reader_thread(tmp_path_factory, monkeypatch):
    import loader.runtime as runtime

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    files, readers = _open_store_files(artifact), _readers()
    with pytest.raises(LoaderError, match="minimum"):  # after the stores are open
        load(artifact, memory_budget=1000)
    assert (_open_store_files(artifact), _readers()) == (files, readers)

    def broken(*args, **kwargs):
        raise LoaderError("the experts path is wrong")

    monkeypatch.setattr(runtime, "_register_implementation", broken)  # after the reader threads started
    with pytest.raises(LoaderError, match="experts path is wrong"):
        load(artifact, memory_budget="unlimited")
    assert (_open_store_files(artifact), _readers()) == (files, readers)


def test_the_cli_offers_every_form():
    from loader.cli import generate_command
    from loader.vocab import EXPERT_DTYPES

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
def test_cuda_held_forms_and_cpu_misses_give_the_decoded_models_logits(tmp_path_factory, monkeypatch):
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
    monkeypatch.delenv("MOEPREP_EXPERT_DTYPE")
    loaded = load(artifact, device="cuda", store="host")  # auto on CUDA: bfloat16 (int4pack is CPU-only)
    compute = loaded.stats()["compute"]
    loaded.close()
    assert compute["expert_dtype"]["int4"] == "bfloat16"
    costs = compute["miss_costs"]
    assert costs["cpu_seconds"]["int4"] > 0 and costs["gpu_seconds"]["int4"] > 0
    assert (compute["cpu_misses"] == "auto") == (costs["cpu_seconds"]["int4"] < costs["gpu_seconds"]["int4"])




@needs_int4pack
@needs_kernel_layout
def test_the_nibble_repack_writes_torchs_int4pack_layout():
    """The repack from packed codes equals torch's convert op from the unpacked codes (on this build)."""
    from loader.codec import pack_int4pack, pack_int4pack_nibbles, unpack_codes, unpack_int4pack
    from loader.forms import _nibble_repack_matches
    from prep.quant.records import pack_codes

    assert _nibble_repack_matches()
    torch.manual_seed(5)
    for n, k in ((64, 32), (192, 256), (448, 96)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        packed = pack_codes(codes.flatten(), 4).view(n, k // 2)
        assert torch.equal(unpack_codes(packed, 4, n * k).view(n, k), codes)  # the record's own packing
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        assert torch.equal(pack_int4pack_nibbles(packed, torch.empty(n, k // 2, dtype=torch.uint8)), want), (n, k)
        assert torch.equal(pack_int4pack(codes), want), (n, k)
        assert torch.equal(unpack_int4pack(want), codes), (n, k)  # the kernel layout decodes to the same codes


@needs_kernel_layout
@pytest.mark.parametrize("meta_group,transposed,bias", [(0, False, False), (256, False, True), (0, True, False)])
def test_a_kernel_layout_record_is_the_made_int4pack_form(meta_group, transposed, bias):
    """A record stored in the int4pack kernel layout holds byte for byte what the reader makes from the plain
    record, computes from views of itself (nothing staged, nothing made) exactly as the made form does, and
    decodes (for every other form) to the matrices the kernel computes with."""
    from loader.forms import Int4KernelForm, choose_form

    torch.manual_seed(2)
    tensors = {"gate_up_proj": torch.randn(128, 128) * 0.1, "down_proj": torch.randn(64, 64) * 0.1}
    if transposed:
        tensors = {"gate_up_proj": torch.randn(128, 128) * 0.1, "down_proj": torch.randn(64, 64) * 0.1}
    if bias:
        tensors["down_proj_bias"] = torch.randn(64)
    layout, record = encode_expert(tensors, "int4", 64, transposed, meta_group)
    kernel = layout.in_kernel_layout()
    assert kernel is not None and kernel.kernel == "int4pack"
    krecord = layout.to_kernel(kernel, record)
    made_form = Int4PackForm(layout)
    region = torch.zeros(made_form.nbytes, dtype=torch.uint8)
    made = made_form.make(record, region)
    form = choose_form("int4pack", kernel, torch.device("cpu"))
    assert isinstance(form, Int4KernelForm) and not form.staged and form.nbytes == kernel.nbytes
    for spec in kernel.matrices:
        if spec.kernel:
            name, (offset, size) = spec.name, next((o, n) for p, _d, o, n in kernel.parts()
                                                   if p == f"{spec.name}.packed")
            assert torch.equal(krecord[offset:offset + size], made.matrices[name][0].flatten())
    weights = form.make(krecord)
    assert weights.matrices["gate_up_proj"][0].data_ptr() == krecord.data_ptr()  # a view of the record: no copy
    decoded = kernel.decode(krecord)
    for name in ("gate_up_proj", "down_proj"):
        w = decoded[name].T if transposed else decoded[name]  # [out, in]
        x = torch.randn(3, w.shape[1]).to(torch.bfloat16)
        assert torch.equal(weights.linear(name, x), made.linear(name, x)), name
        want = x.float() @ w.T + (decoded[f"{name}_bias"] if f"{name}_bias" in decoded else 0)
        got = weights.linear(name, x).float()
        assert float((got - want).norm() / want.norm()) < 1e-2, name
    # the plain record's decode differs from the kernel layout's only by bfloat16 (scale, zero')
    plain = layout.decode(record)
    for name in ("gate_up_proj", "down_proj"):
        assert float((plain[name] - decoded[name]).abs().max()) < 0.02 * float(plain[name].abs().max())


def test_kernel_layout_applies_to_int4_only_and_refuses_a_bad_spec():
    from loader.codec import CodecError, MatrixSpec

    tensors = {"gate_up_proj": torch.randn(128, 64), "down_proj": torch.randn(64, 64)}
    assert encode_expert(tensors, "int4", 64)[0].in_kernel_layout() is not None
    assert encode_expert(tensors, "int3", 64)[0].in_kernel_layout() is None  # would grow to 4 bits
    assert encode_expert({"w": torch.randn(96, 64)}, "int4", 64)[0].in_kernel_layout() is None  # rows % 64
    with pytest.raises(CodecError, match="int4pack layout holds int4"):
        MatrixSpec("w", (64, 64), "int3", "float32", 64, kernel="int4pack").check()
    with pytest.raises(CodecError, match="unknown"):
        MatrixSpec("w", (64, 64), "int4", "float32", 64, kernel="int9pack").check()


def test_threads_are_set_while_loaded_and_restored_on_close(tmp_path_factory):
    from loader.runtime import compute_threads

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert compute_threads(CPU, 2) == max(1, cores - 2) and compute_threads(torch.device("meta"), 2) is None
    loaded = load(artifact, memory_budget="unlimited", threads=1)
    assert torch.get_num_threads() == 1 and loaded.stats()["compute"]["torch_threads"] == 1
    loaded.close()
    assert torch.get_num_threads() == before
    loaded = load(artifact, memory_budget="unlimited", threads=None)  # None: torch's own setting, untouched
    assert torch.get_num_threads() == before
    loaded.close()
    # "auto", the default: decode steps on the cores the readers leave free, a prompt on torch's own count
    loaded = load(artifact, memory_budget="unlimited", workers=1)
    seen = []
    hook = loaded.model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, _a: seen.append(torch.get_num_threads()))
    with torch.no_grad():
        out = loaded.model(input_ids=_ids(tokens=5)[:1], use_cache=True)
        loaded.model(input_ids=torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
    hook.remove()
    assert seen == [before, compute_threads(CPU, 1)]
    loaded.close()
    assert torch.get_num_threads() == before
    with pytest.raises(LoaderError, match="threads 0 must be"):
        load(artifact, threads=0)
    assert torch.get_num_threads() == before
