"""The offloading loader on artifacts of the seven tiny architectures: parity, budgets, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from loader.cli import main as moeload
from loader.format import ArtifactError, read_record_offsets
from loader.plan import PlanError, parse_budget
from loader.runtime import LoaderError, load, minimum_budget
from loader.verify import verify
from tests.helpers.tiny_models import ARCHITECTURES, decoded_reference, tiny_artifact


def _ids(seed=0):
    torch.manual_seed(seed)
    return torch.randint(4, 60, (2, 11))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_passthrough_logits_equal_transformers(tmp_path_factory, arch):
    model, artifact = tiny_artifact(tmp_path_factory, arch)
    ids = _ids()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    minimum = minimum_budget(artifact)
    with pytest.raises(LoaderError, match=f"minimum of {minimum:,} bytes"):
        load(artifact, memory_budget=minimum - 1)
    for budget in ("unlimited", minimum):  # everything cached, and one record per layer
        loaded = load(artifact, memory_budget=budget)
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        assert torch.allclose(got, expected, atol=1e-5), (arch, budget, float((got - expected).abs().max()))
        slot = next(iter(loaded.budget["slot_bytes"].values()))
        per_layer = {b // slot for b in loaded.budget["pools"]["main"].values()}
        if budget == minimum:
            assert per_layer == {1}
            assert loaded.stats()["misses"] > loaded.runtime.num_layers  # experts really came and went
        else:
            assert per_layer == {loaded.runtime.num_experts}
        loaded.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int4_logits_equal_model_with_decoded_experts(tmp_path_factory, arch):
    model, artifact = tiny_artifact(tmp_path_factory, arch, "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _ids(1)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        original = model(input_ids=ids).logits
    # decoded copies in float32 and decoding per use: the same float32 values, the same products (bfloat16
    # copies: tests/loader/test_forms.py)
    for budget, form in (("unlimited", "float32"), ("unlimited", "packed"), (minimum_budget(artifact, expert_dtype="float32"), "float32"),
                         (minimum_budget(artifact, expert_dtype="packed"), "packed")):
        loaded = load(artifact, memory_budget=budget, expert_dtype=form)
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        loaded.close()
        assert torch.allclose(got, expected, atol=1e-5), (arch, budget, form)
        assert not torch.allclose(got, original, atol=1e-5)  # quantization really happened


def test_cache_never_exceeds_budget_and_host_store_agrees(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    record = json.loads((artifact / "manifest.json").read_text())["stores"]["passthrough"]["record_bytes"]
    for store in ("disk", "host"):
        minimum = minimum_budget(artifact, store=store)  # host: the store held in RAM counts too
        loaded = load(artifact, memory_budget=minimum + 4096, store=store)  # a little more than the minimum
        ids = _ids(2)
        with torch.no_grad():
            for t in range(1, ids.shape[1] + 1):
                loaded.model(input_ids=ids[:, :t])
        stats = loaded.stats()
        b = loaded.budget
        assert stats["peak_cache_bytes"] <= b["limit_bytes"] - b["dense_bytes"] - b["buffer_bytes"]
        assert stats["peak_cache_bytes"] > 0
        # counted at every change, reads in flight included: never past the budget's expert share
        assert stats["peak_cache_bytes"] < stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
        assert stats["bytes_read"] == stats["misses"] * record
        loaded.close()


def test_a_prefill_needing_every_expert_stays_inside_the_budget(tmp_path_factory):
    """A long prompt routes to every expert of a layer at once; the reads must queue behind the read
    buffers instead of all landing in memory together."""
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    minimum = minimum_budget(artifact)
    loaded = load(artifact, memory_budget=minimum)  # one slot per layer + top_k read buffers
    torch.manual_seed(64)
    ids = torch.randint(4, 60, (2, 48))
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
        expected = model(input_ids=ids).logits
    stats, b = loaded.stats(), loaded.budget
    loaded.close()
    assert torch.allclose(got, expected, atol=1e-5)
    assert max(o["misses"] for o in stats["layers"].values()) > 2  # more misses at once than buffers
    assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
    # a slot per layer + buffers, all used; the rest is the prefill activations' reserve (not expert data)
    assert stats["peak_expert_bytes"] == b["limit_bytes"] - b["dense_bytes"] - b["prefill_bytes"]


def test_budget_parsing_and_refusal(tmp_path_factory):
    assert parse_budget("1.5GiB") == ("bytes", 1.5 * 2**30)
    assert parse_budget("25%") == ("fraction", 0.25)
    assert parse_budget(1000) == ("bytes", 1000.0)
    assert parse_budget("unlimited")[0] == "unlimited"
    for bad in ("lots", "-5%", "0", 0, -3, "12 parsecs"):
        with pytest.raises(PlanError):
            parse_budget(bad)
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    with pytest.raises(LoaderError, match="below the minimum"):
        load(artifact, memory_budget="1KiB")
    with pytest.raises(LoaderError, match="store='host' holds the whole expert store"):
        load(artifact, memory_budget=minimum_budget(artifact), store="host")
    for device in ("gpu", "mps", "meta", "cuda:x"):
        with pytest.raises(LoaderError, match="not supported"):
            load(artifact, device=device)
    if not torch.cuda.is_available():
        with pytest.raises(LoaderError, match="no CUDA GPU"):
            load(artifact, device="cuda")


def _copy(artifact, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(artifact, dst)
    return dst


def test_verify_names_each_flipped_file(tmp_path_factory, tmp_path):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    assert verify(artifact) == []
    names = [p.name for p in artifact.iterdir() if p.name != "manifest.json"]
    for name in names:
        copy = _copy(artifact, tmp_path / name)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (copy / name).write_bytes(bytes(data))
        bad = verify(copy)
        assert len(bad) == 1 and bad[0].startswith(f"{name}:"), bad
        result = CliRunner().invoke(moeload, ["verify", str(copy)])
        assert result.exit_code == 1 and name in result.output
        result = CliRunner().invoke(moeload, ["verify", "--json", str(copy)])
        report = json.loads(result.output)
        assert result.exit_code == 1 and not report["ok"] and report["bad"] == bad
    result = CliRunner().invoke(moeload, ["verify", "--json", str(artifact)])
    assert result.exit_code == 0 and json.loads(result.output) == {"artifact": str(artifact), "ok": True, "bad": []}


def test_truncated_store_and_unknown_schema_are_refused(tmp_path_factory, tmp_path):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    copy = _copy(artifact, tmp_path / "trunc")
    store = next(copy.glob("experts-*.safetensors"))
    store.write_bytes(store.read_bytes()[:-5000])
    with pytest.raises(ArtifactError, match="truncated|damaged"):
        load(copy)
    copy = _copy(artifact, tmp_path / "schema")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        load(copy)
    result = CliRunner().invoke(moeload, ["info", str(copy)])
    assert result.exit_code == 1 and "schema_version" in result.output
    with pytest.raises(ArtifactError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_records_are_4k_aligned(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "qwen2_moe")
    offsets, _, stride = read_record_offsets(next(artifact.glob("experts-*.safetensors")))
    assert stride % 4096 == 0 and all(o % 4096 == 0 for o in offsets.values())


def test_moeload_generate_and_info_json(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "abc", "--max-new-tokens", "4",
                                          "--memory-budget", "unlimited", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert len(out["token_ids"]) == 4 and out["stats"]["tokens"] > 0
    assert set(out["stats"]["layers"]) == {str(layer) for layer in
                                           json.loads((artifact / "manifest.json").read_text())["moe"]["layers"]}
    info = json.loads(CliRunner().invoke(moeload, ["info", str(artifact), "--json"]).output)
    assert info["architecture"] == "mixtral" and info["num_experts"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("store", ["disk", "host"])
def test_cuda_offloading_matches_cpu(tmp_path_factory, store):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    ids = _ids(3)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        loaded = load(artifact, device="cuda", memory_budget=minimum_budget(artifact, store=store), store=store)
        got = loaded.model(input_ids=ids.cuda()).logits.cpu()
    loaded.close()
    assert torch.allclose(got, expected, atol=1e-4)


def test_load_is_reachable_from_the_package(tmp_path_factory):
    import loader

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    m = loader.load(artifact, memory_budget="150%")
    try:
        assert m.stats()["budget"]["requested"] == "150%"
    finally:
        m.close()


def test_the_plans_read_depth_round_trips_and_a_bad_one_is_refused(tmp_path_factory):
    import dataclasses

    from loader.plan import Plan, read_plan

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    plain = read_plan(artifact)
    assert plain.read_depth == 0 and "read_depth" not in plain.to_json()  # an old plan: not planned
    planned = dataclasses.replace(plain, read_depth=4)
    assert planned.to_json()["read_depth"] == 4 and Plan.from_json(planned.to_json()) == planned
    for bad in (0, -1, True, "4", 2.0, None):
        with pytest.raises(PlanError, match="read_depth must be a positive number"):
            Plan.from_json(plain.to_json() | {"read_depth": bad})


def test_auto_workers_take_the_plans_read_depth_else_two(tmp_path_factory):
    import dataclasses

    from loader.plan import read_plan

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    plain = read_plan(artifact)
    for plan, workers, threads in ((dataclasses.replace(plain, read_depth=3), "auto", 3), (plain, "auto", 2),
                                   (None, None, 2), (dataclasses.replace(plain, read_depth=3), 1, 1)):
        args = {} if workers is None else {"workers": workers}
        loaded = load(artifact, memory_budget="unlimited", plan=plan, **args)
        try:
            assert len(loaded.runtime.reader._threads) == threads, (plan, workers)
        finally:
            loaded.close()
    for bad in (0, "many", True):
        with pytest.raises(LoaderError, match="workers .* must be 'auto' or a number of reader threads from 1 to 64"):
            load(artifact, workers=bad)
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "a", "--workers", "two"])
    assert result.exit_code != 0 and "--workers 'two'" in result.output
