"""Prefill in chunks (loader/prefill.py): the chunked prompt gives the one-shot resident logits, each expert is read
at most once per layer per chunk, the prefill form comes from the plan (three loads, one choice), the budget counts
a chunk's activations, and a prompt that cannot fit is refused with the numbers before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loader.errors import BudgetError
from loader.forms import int4pack_available
from loader.plan import Plan, PlanError, read_plan
from loader.prefill import (
    RESERVE_SHARE,
    ActivationShape,
    PrefillForm,
    PrefillSpec,
    activation_bytes,
    chunk_sizes,
    prefill_reserve,
)
from loader.runtime import load, minimum_budget
from tests.helpers.tiny_models import decoded_reference, tiny_artifact

SHAPE = ActivationShape(hidden=64, intermediate=96, heads=4, q_width=64, kv_width=32, vocab=300, top_k=2,
                        dtype_bytes=4, max_context=1024)


def _prompt(tokens: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(4, 60, (1, tokens))


def _reads_per_step(loaded) -> list[dict]:
    """Every read the engine submits, grouped by MoE layer call: [{key: reads}] (an independent count)."""
    engine, steps = loaded.runtime, []
    submit, run_layer = engine.reader.submit, engine.run_layer

    def counting_submit(job):
        steps[-1][job.key] = steps[-1].get(job.key, 0) + 1
        return submit(job)

    def counting_layer(*args, **kwargs):
        steps.append({})
        return run_layer(*args, **kwargs)

    engine.reader.submit = counting_submit
    engine.run_layer = counting_layer
    return steps


@pytest.mark.parametrize("chunk", [1, 7, None])
@pytest.mark.parametrize("budget", ["unlimited", "minimum"])
def test_chunked_prefill_gives_the_one_shot_resident_logits(tmp_path_factory, chunk, budget):
    """Every token's logits of a chunked prefill against one forward of the resident model over the whole prompt
    (the record form computes the stored float32 matrices: only summation order differs)."""
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    ids = _prompt(40)
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0]
    size = minimum_budget(artifact) if budget == "minimum" else budget
    loaded = load(artifact, memory_budget=size)
    cap = ids.shape[1] if chunk is None else chunk
    if budget == "minimum":
        cap = min(cap, loaded.runtime.prefill_chunk)  # the smallest budget keeps room for small chunks only
    result = loaded.prefill(ids, chunk=cap, all_logits=True)
    stats = loaded.stats()
    loaded.close()
    assert result.chunks == [min(cap, 40 - i) for i in range(0, 40, cap)]
    assert result.logits.shape == expected.shape
    assert torch.allclose(result.logits, expected, atol=1e-4, rtol=1e-4), float((result.logits - expected).abs().max())
    if budget == "minimum":
        assert stats["misses"] > loaded.runtime.num_layers  # the prompt's experts streamed through the cache
    assert stats["prefill"]["tokens"] == 40 and stats["prefill"]["chunks"] == len(result.chunks)


@pytest.mark.skipif(not int4pack_available(torch.device("cpu")), reason="needs torch's CPU int4 kernel")
def test_chunked_prefill_of_a_quantized_artifact_matches_its_decoded_model(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "qwen3_moe", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _prompt(30, seed=3)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
    loaded = load(artifact, memory_budget=minimum_budget(artifact))
    result = loaded.prefill(ids, chunk=min(7, loaded.runtime.prefill_chunk), all_logits=True)
    loaded.close()
    spread = float(expected.abs().max())
    assert float((result.logits - expected).abs().max()) <= 0.03 * spread  # the held form's parity tolerance


@pytest.mark.parametrize("chunk", [1, 7])
def test_each_expert_is_read_at_most_once_per_layer_per_chunk(tmp_path_factory, chunk):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    loaded = load(artifact, memory_budget=minimum_budget(artifact) + 2 * 4096)
    steps = _reads_per_step(loaded)
    ids = _prompt(35, seed=1)
    result = loaded.prefill(ids, chunk=min(chunk, loaded.runtime.prefill_chunk))
    stats = loaded.stats()
    loaded.close()
    layers = loaded.runtime.num_layers
    assert len(steps) == layers * len(result.chunks)  # one MoE layer call per layer per chunk
    assert sum(sum(s.values()) for s in steps) > 0
    assert max(n for s in steps for n in s.values()) == 1  # counted outside the engine
    assert stats["prefill_timing"]["most_reads_per_layer_step"] == 1  # and by the engine
    assert stats["prefill_timing"]["reads"] == sum(sum(s.values()) for s in steps)


def _budget_for_chunk(artifact, plan: Plan, chunk: int) -> int:
    """The smallest budget (in 4 KiB steps above the minimum) whose prefill reserve fits ``chunk`` tokens."""
    from loader.budget import cache_layout

    budget = minimum_budget(artifact, plan=plan)
    while cache_layout(artifact, budget, plan=plan).capacities.prefill_chunk < chunk:
        budget += 4096
    return budget


def _with_prefill_form(artifact, form: str, from_tokens: int) -> Plan:
    plan = read_plan(artifact)
    return dataclasses.replace(plan, prefill=PrefillSpec(forms=(("int4", PrefillForm(form, from_tokens)),)))


def test_the_prefill_form_comes_from_the_plan_and_three_loads_agree(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "qwen3_moe", "int4")
    reference = decoded_reference(model, artifact, "int4")
    ids = _prompt(30, seed=5)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
    plan = _with_prefill_form(artifact, "float32", 2)
    budget = _budget_for_chunk(artifact, plan, 10)
    seen = []
    for _ in range(3):
        loaded = load(artifact, memory_budget=budget, plan=plan, expert_dtype="bfloat16")
        seen.append((loaded.budget["expert_dtype"], loaded.budget["prefill_forms"], loaded.budget["prefill_form_bytes"]))
        result = loaded.prefill(ids, chunk=min(10, loaded.runtime.prefill_chunk), all_logits=True)
        stats = loaded.stats()
        loaded.close()
        assert stats["prefill_timing"]["prefill_form_computes"] > 0, (stats["prefill_timing"], loaded.budget["expert_dtype"], loaded.budget["prefill_forms"], stats["misses"], stats["hits"])  # misses of 2+ tokens computed in float32
        assert stats["prefill_timing"]["most_reads_per_layer_step"] == 1
        assert stats["peak_expert_bytes"] <= loaded.budget["limit_bytes"] - loaded.budget["dense_bytes"]
        # misses compute the decoded matrices in float32, hits in bfloat16: within bfloat16's tolerance
        assert float((result.logits - expected).abs().max()) <= 0.03 * float(expected.abs().max())
    assert seen[0] == seen[1] == seen[2]
    assert seen[0][0] == {"int4": "bfloat16"} and seen[0][1] == {"int4": {"form": "float32", "from_tokens": 2}}
    assert seen[0][2] > 0  # its read buffers are in the budget
    assert minimum_budget(artifact, plan=plan, expert_dtype="bfloat16") > minimum_budget(artifact, expert_dtype="bfloat16")

    never = _with_prefill_form(artifact, "float32", 10_000)  # no expert gets that many tokens in a chunk
    loaded = load(artifact, memory_budget=budget, plan=never, expert_dtype="bfloat16")
    loaded.prefill(ids, chunk=min(10, loaded.runtime.prefill_chunk))
    assert loaded.stats()["prefill_timing"]["prefill_form_computes"] == 0
    loaded.close()


def test_the_plan_checks_its_prefill_values():
    plan = Plan.default(2, 4, "int4").to_json()
    for bad in ({"chunk": 0}, {"chunk": True}, {"context": "long"}, {"forms": {"int4": {"form": "fast", "from_tokens": 2}}},
                {"forms": {"int4": {"form": "float32"}}}, {"forms": {"int9": {"form": "float32", "from_tokens": 2}}},
                {"shards": 2}):
        with pytest.raises(PlanError, match="prefill"):
            Plan.from_json(plan | {"prefill": bad})
    good = Plan.from_json(plan | {"prefill": {"chunk": 64, "forms": {"int4": {"form": "float32", "from_tokens": 48}}}})
    assert Plan.from_json(good.to_json()) == good and good.prefill.form_for("int4") == PrefillForm("float32", 48)


def test_a_prompt_whose_activations_cannot_fit_is_refused_with_the_numbers(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    plan = dataclasses.replace(read_plan(artifact), prefill=PrefillSpec(chunk=1, context=4))  # sized for 4 tokens
    loaded = load(artifact, memory_budget=minimum_budget(artifact, plan=plan), plan=plan)
    assert loaded.runtime.prefill_chunk == 1
    loaded.prefill(_prompt(4))  # fits: one token per chunk
    before = loaded.stats()["tokens"]
    with pytest.raises(BudgetError, match=r"prompt of 200 tokens does not fit.*needs [\d,]+ bytes.*keeps [\d,]+ bytes"):
        loaded.prefill(_prompt(200))
    assert loaded.stats()["tokens"] == before  # refused before any chunk ran
    loaded.close()


def test_chunks_are_the_largest_that_fit_as_a_scan_finds():
    for reserve in (40_000, 90_000, 300_000):
        for past in (0, 100, 900):
            sizes = chunk_sizes(SHAPE, reserve, 64, 150, past)
            assert sum(sizes) == 150
            done = past
            for size in sizes:
                fits = [c for c in range(1, min(64, past + 150 - done) + 1) if activation_bytes(SHAPE, c, done + c) <= reserve]
                assert size == max(fits)
                done += size


def test_the_reserve_takes_at_most_its_share_of_the_room_and_the_whole_chunk_when_unlimited():
    spec = PrefillSpec(chunk=256, context=512)
    chunk, nbytes = prefill_reserve(SHAPE, spec, float("inf"))
    assert chunk == 256 and nbytes == activation_bytes(SHAPE, 256, 512)
    for allowance in (1e3, 1e5, 1e6, 4e6):
        chunk, nbytes = prefill_reserve(SHAPE, spec, allowance)
        assert nbytes == activation_bytes(SHAPE, chunk, 512)
        assert nbytes <= allowance or chunk == 1
        assert chunk == 256 or activation_bytes(SHAPE, chunk + 1, 512) > allowance


def test_a_budget_counts_a_chunks_activations(tmp_path_factory):
    from loader.budget import cache_layout

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    minimum = minimum_budget(artifact)
    chunks = []
    for budget in (minimum, 2 * minimum, 4 * minimum, "unlimited"):
        caps = cache_layout(artifact, budget).capacities
        chunks.append(caps.prefill_chunk)
        assert caps.prefill_chunk >= 1 and caps.prefill_bytes > 0
        if caps.limit_bytes != float("inf"):
            held = sum(sum(groups.values()) for groups in caps.pools.values())
            assert caps.dense_bytes + caps.buffer_bytes + caps.prefill_bytes + held <= caps.limit_bytes
            room = caps.limit_bytes - caps.dense_bytes - caps.buffer_bytes
            assert caps.prefill_bytes <= RESERVE_SHARE * room or caps.prefill_chunk == 1
    assert chunks == sorted(chunks) and chunks[0] == 1 and chunks[-1] == read_plan(artifact).prefill.chunk
