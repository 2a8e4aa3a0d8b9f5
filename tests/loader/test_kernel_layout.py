"""Records stored in a kernel's layout (``loader/codec.py``, int4pack): for a ``cpu-int4pack`` target the packager
writes int4 stores so, and a miss read from disk lands in its slot ready to compute. Nothing is made on any thread (counted),
the model computes exactly what the form made from the plain record computes, and a flipped byte is refused when
the record is read and by ``verify``."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import loader.forms as forms
from loader.artifact import open_artifact, store_offsets
from loader.codec import RecordLayout
from loader.errors import ArtifactError
from loader.forms import Int4KernelForm, Int4PackForm, int4pack_available
from loader.runtime import load, minimum_budget
from loader.verify import verify
from tests.helpers.cpu_kernels import needs_kernel_layout
from tests.helpers.tiny_models import (
    CONFIGS,
    build_tiny_model,
    decoded_reference,
    tiny_recipe,
    tiny_tokenizer,
)

pytestmark = [pytest.mark.skipif(not int4pack_available(torch.device("cpu")),
                                 reason="this torch build has no CPU int4 weight-only kernel"),
              pytest.mark.xdist_group("test_kernel_layout")]  # one worker builds the module-scoped fixtures


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(model, artifact for a cpu-int4pack target: int4 in the kernel layout, the same recipe for a CUDA target: plain
    records). Hidden 64 and intermediate 32, so every expert matrix has a multiple of 64 rows."""
    from prep.pipeline import prepare

    root = tmp_path_factory.mktemp("kernel")
    config = CONFIGS["mixtral"]()
    config.hidden_size, config.intermediate_size = 64, 32
    model = build_tiny_model("mixtral", config=config)
    model.save_pretrained(root / "model")
    tiny_tokenizer(config.vocab_size).save_pretrained(root / "model")
    prepare(tiny_recipe("int4", group_size=32, package={"targets": ["cpu-int4pack"]}), root=root, output=root / "cpu")
    prepare(tiny_recipe("int4", group_size=32, package={"targets": ["cuda"]}), root=root, output=root / "cuda")
    return model, root / "cpu", root / "cuda"


def _layout(artifact) -> RecordLayout:
    return RecordLayout.from_json(json.loads((artifact / "manifest.json").read_text())["stores"]["int4"]["layout"])


def _ids(tokens=12):
    torch.manual_seed(3)
    return torch.randint(4, 60, (1, tokens))


def test_the_cpu_int4pack_target_stores_int4_in_the_kernel_layout_the_cuda_target_does_not(artifacts):
    _, cpu, cuda = artifacts
    kernel, plain = _layout(cpu), _layout(cuda)
    assert {s.kernel for s in kernel.matrices} == {"int4pack"} and plain.kernel == ""
    assert kernel == plain.in_kernel_layout()
    assert kernel.nbytes == Int4PackForm(plain).nbytes  # the record is the form the reader used to make
    assert verify(cpu) == [] and verify(cuda) == []


def test_where_this_cpus_int4pack_layout_differs_a_kernel_layout_record_is_held_decoded(artifacts, monkeypatch):
    """On a CPU whose torch packs int4pack another way (AVX2 only), a kernel-layout record cannot be the form: the
    loader holds it decoded (bfloat16) and computes what the same experts' plain records held decoded compute. Run
    on every CPU by pretending the layouts differ. Within bfloat16's rounding, not bit for bit: the kernel layout
    holds each group's scale and zero in bfloat16 (what the kernel reads), the plain record at its own precision,
    so the decoded weights differ by up to 2^-8 of a weight and these logits by about 1e-2."""
    _, cpu, cuda = artifacts
    monkeypatch.setattr(forms, "_nibble_repack_matches", lambda: False)
    ids, logits = _ids(), []
    for artifact, asked in ((cpu, "int4pack"), (cuda, "bfloat16")):
        loaded = load(artifact, memory_budget="unlimited", expert_dtype=asked)
        try:
            assert loaded.budget["expert_dtype"] == {"int4": "bfloat16"}
            with torch.no_grad():
                logits.append(loaded.model(input_ids=ids).logits)
        finally:
            loaded.close()
    torch.testing.assert_close(logits[0], logits[1], atol=5e-2, rtol=2e-2)


@needs_kernel_layout
def test_a_miss_lands_ready_to_compute_with_nothing_made(artifacts, monkeypatch):
    """The gate: at a budget that misses, every read lands as the form itself. No form is made and nothing is
    decoded on any thread (the made form's conversion is never called); the views are taken on the reader threads;
    and the logits equal those of the form made from the plain records, bit for bit."""
    model, cpu, cuda = artifacts
    calls = {"kernel_parts": 0, "unpack_codes": 0, "views": []}
    real_make = Int4KernelForm.make

    def views(self, record, region=None):
        calls["views"].append(threading.current_thread().name)
        return real_make(self, record, region)

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Int4KernelForm, "make", views)
    monkeypatch.setattr(forms, "kernel_parts", counted("kernel_parts", forms.kernel_parts))
    monkeypatch.setattr(forms, "unpack_codes", counted("unpack_codes", forms.unpack_codes))
    ids = _ids()
    budget = minimum_budget(cpu, expert_dtype="int4pack")
    loaded = load(cpu, memory_budget=budget, expert_dtype="int4pack")
    try:
        assert loaded.budget["expert_dtype"] == {"int4": "int4pack"}
        assert loaded.budget["staging_bytes"] == 0  # nothing is made, so no staging buffer is held
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
            for _ in range(4):  # decode steps: one token each, the cache at its minimum keeps missing
                ids = torch.cat([ids, got[:, -1:].argmax(-1)], 1)
                got = loaded.model(input_ids=ids).logits
        stats = loaded.stats()
    finally:
        loaded.close()
    assert stats["misses"] > 0 and stats["reads"]["records"] >= stats["misses"]
    assert stats["compute"]["decodes"] == 0 and stats["reads"]["forms_made"] == 0
    assert stats["reads"]["make_seconds"] == 0.0
    assert calls["kernel_parts"] == 0 and calls["unpack_codes"] == 0
    assert calls["views"] and all(name.startswith("moeprep-read") for name in calls["views"])
    assert len(calls["views"]) == stats["reads"]["records"]

    monkeypatch.undo()
    made = load(cuda, memory_budget=minimum_budget(cuda, expert_dtype="int4pack"), expert_dtype="int4pack")
    try:
        assert isinstance(made.runtime.forms["int4"], Int4PackForm)
        with torch.no_grad():
            want = made.model(input_ids=ids).logits
        assert made.stats()["compute"]["decodes"] > 0  # the plain records' form is made on every read
    finally:
        made.close()
    assert torch.equal(got, want)


def test_other_forms_decode_the_kernel_layout(artifacts):
    """A device without the kernel (or a pinned form) decodes the kernel-layout record: float32 computes the
    dequantized matrices the kernel uses (the decoded-weights model), within float32 rounding."""
    model, cpu, _ = artifacts
    reference = decoded_reference(model, cpu, "int4")
    ids = _ids()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    loaded = load(cpu, memory_budget="unlimited", expert_dtype="float32")
    try:
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
    finally:
        loaded.close()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def _flip(artifact, key="layers.0.experts.1", at=100) -> None:
    manifest = open_artifact(artifact)
    path = manifest.path(manifest.stores["int4"].file)
    offset = store_offsets(manifest, "int4")[key] + at
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_kernel_layout_record_fails_at_load_and_in_verify(artifacts, tmp_path):
    import shutil

    _, cpu, _ = artifacts
    damaged = tmp_path / "damaged"
    shutil.copytree(cpu, damaged)
    _flip(damaged)
    assert any("experts-int4.safetensors" in line and "layers.0.experts.1" in line for line in verify(damaged))
    for store in ("disk", "host"):
        loaded = load(damaged, memory_budget="unlimited", expert_dtype="int4pack", store=store)
        try:
            with pytest.raises(ArtifactError, match=r"record layers\.0\.experts\.1 of .* is damaged \(xxh3_64"):
                with torch.no_grad():
                    for token in range(4, 60):  # until the router picks expert 1 of layer 0
                        loaded.model(input_ids=torch.tensor([[token, token + 1]]))
        finally:
            loaded.close()
