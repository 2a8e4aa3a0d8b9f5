"""CORM's neuron-level loading: the neuron-major record layout, partial reads, the neuron cache's
union rule, the budget with partial records, the neuron_gates predictor, and the neuron stage."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from loader.codec import NeuronLayout, RecordLayout
from loader.format import ArtifactError, read_manifest
from loader.neuron import NeuronConfig, active_set, neuron_forward
from loader.plan import read_plan
from loader.runtime import LoaderError, load, minimum_budget
from loader.store import DEMAND, ExpertStore, Reader, ReadJob, SlotArena
from loader.verify import verify
from prep.adapters import get_adapter
from prep.errors import MoeprepError
from prep.methods.neuron import dropped_neurons
from prep.quant.hqq_codec import encode_neuron_expert
from prep.quant.records import write_aligned_records
from tests.helpers.tiny_models import ARCHITECTURES, prepare_tiny_artifact, tiny_recipe

NEURON = {"layout": "neuron", "enabled": True, "theta": 0.0, "crossover": 1.0}
PROMPT = [5, 9, 13, 20, 7, 11]


def neuron_artifact(root, arch: str = "mixtral", precision: str = "passthrough", **knobs):
    return prepare_tiny_artifact(root, arch, precision, recipe=tiny_recipe(precision, neuron=NEURON | knobs))


def save_wide_mixtral(directory):
    """A Mixtral with hidden 128 and 512 neurons per expert: float32 rows of 1 KiB, so an O_DIRECT read of
    whole 4 KiB blocks can still skip rows (a tiny model's whole record fits one block)."""
    from transformers import MixtralConfig

    from tests.helpers.tiny_models import COMMON, build_tiny_model, tiny_tokenizer

    config = MixtralConfig(num_hidden_layers=2, intermediate_size=512, num_local_experts=4, num_experts_per_tok=2,
                           **(COMMON | {"hidden_size": 128}))
    model = build_tiny_model("mixtral", config=config)
    model.save_pretrained(directory)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return model


@torch.no_grad()
def decode(artifact, neuron, budget="unlimited", steps: int = 5, stepwise: bool = False, predictors=None,
           device: str = "cpu", store: str = "disk", **options):
    """Greedy decode through the loader: (logits of every step [steps + 1, V], the tokens, stats). ``stepwise``
    feeds the prompt one token per call, so every call is a decode step."""
    lm = load(artifact, memory_budget=budget, neuron=neuron, predictors=predictors, device=device, store=store,
              **options)
    try:
        ids = torch.tensor([PROMPT], device=device)
        chunks = [ids[:, i:i + 1] for i in range(ids.shape[1])] if stepwise else [ids]
        past, logits = None, []
        for chunk in chunks:
            out = lm.model(chunk, past_key_values=past, use_cache=True)
            past = out.past_key_values
        logits.append(out.logits[0, -1])
        tokens = []
        for _ in range(steps):
            tok = logits[-1].argmax().view(1, 1)
            tokens.append(int(tok))
            out = lm.model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
        return torch.stack(logits).cpu(), tokens, lm.stats()
    finally:
        lm.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_theta_zero_neuron_path_equals_whole_expert_path(arch, tmp_path):
    """theta 0 reads (nearly) every neuron row by row and computes through the neuron layout: the logits equal
    the whole-expert path's within 1e-5 (float32), and the source model's dense forward within 1e-4."""
    model, artifact = neuron_artifact(tmp_path, arch)
    whole, tokens, _ = decode(artifact, False)
    sparse, sparse_tokens, stats = decode(artifact, NeuronConfig(theta=0.0, crossover=1.0))
    assert stats["neuron"]["experts"] > 0  # the neuron path computed
    assert sparse_tokens == tokens
    assert (whole - sparse).abs().max() <= 1e-5
    prefill, _, stats = decode(artifact, NeuronConfig(theta=0.0, crossover=1.0, prefill=True))
    assert stats["neuron"]["partial_reads"] > 0  # every read went row by row
    assert (whole - prefill).abs().max() <= 1e-5
    with torch.no_grad():
        dense = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:]
    assert (dense - whole).abs().max() <= 1e-4


def test_partial_read_returns_exactly_those_neurons_bytes(tmp_path):
    """A read of random neuron sets fills exactly those neurons' byte ranges of the slot (and the header)."""
    torch.manual_seed(0)
    from prep.adapters.base import ExpertWeights

    layout, _ = encode_neuron_expert(ExpertWeights(torch.randn(40, 32), torch.randn(40, 32), torch.randn(32, 40)),
                                     "int4", 16, 0)
    neuron = NeuronLayout(layout)
    rng = random.Random(0)
    records = {f"layers.0.experts.{e}": bytes(rng.randrange(1, 256) for _ in range(layout.nbytes)) for e in range(3)}
    path = tmp_path / "store.safetensors"
    write_aligned_records(path, records, layout.nbytes)
    store = ExpertStore(path, "int4")
    arena = SlotArena(1, store.stride, torch.device("cpu"))
    reader = Reader(2)
    try:
        for trial in range(20):
            key = rng.choice(list(records))
            rows = torch.rand(neuron.intermediate) < rng.choice([0.05, 0.3, 0.7, 1.0])
            arena.data.zero_()
            ranges = [(0, neuron.rows_offset), *neuron.ranges(rows)]
            reader.submit(ReadJob(store, key, (arena, 0), DEMAND, ranges)).wait()
            got = bytes(arena.tensor(0, layout.nbytes).numpy())
            want = bytearray(layout.nbytes)
            want[:neuron.rows_offset] = records[key][:neuron.rows_offset]
            for j in rows.nonzero().flatten().tolist():
                start = neuron.rows_offset + j * neuron.row_bytes
                want[start:start + neuron.row_bytes] = records[key][start:start + neuron.row_bytes]
            if not store.direct_io:  # O_DIRECT reads whole 4 KiB blocks: the header's block may hold rows too
                assert got == bytes(want), trial
            for j in rows.nonzero().flatten().tolist():
                start = neuron.rows_offset + j * neuron.row_bytes
                assert got[start:start + neuron.row_bytes] == records[key][start:start + neuron.row_bytes]
            assert got[:neuron.rows_offset] == records[key][:neuron.rows_offset]
            assert sum(n for _s, n in neuron.ranges(rows)) == int(rows.sum()) * neuron.row_bytes
    finally:
        reader.close()
        store.close()


def test_union_rule_on_a_hand_made_sequence(tmp_path):
    """Three decode tokens for one expert: its neuron cache grows as the union of their active sets, each step
    reads exactly the active rows it lacked, and the output is the expert over every resident neuron."""
    _, artifact = neuron_artifact(tmp_path, "mixtral", "int4")
    lm = load(artifact, memory_budget="unlimited", neuron=True)
    try:
        rt = lm.runtime
        precision = rt.plan.expert_precision[0][0]
        step = rt.neuron  # the neuron layer step (loader.neuron.NeuronStep)
        layout = step.layouts[precision]
        store = rt.stores[precision]
        buffer = SlotArena(1, store.stride, torch.device("cpu"))  # page-aligned, as an O_DIRECT read needs
        store.read_into("layers.0.experts.0", buffer.host_view(0))
        record = buffer.tensor(0, store.record_bytes).clone()
        header = layout.header(record)
        module = rt.modules[0]
        torch.manual_seed(3)
        xs = [torch.randn(1, layout.hidden) for _ in range(3)]
        from loader.neuron import activity, gate_projection

        acts = torch.cat([activity(module, gate_projection(header, x), step.pairings[precision]) for x in xs])
        theta = float(acts.median())
        step.cfg = NeuronConfig(theta=theta, crossover=1.0)
        # what a read brings: exactly the rows asked for, or with O_DIRECT every row of the 4 KiB blocks read
        def brought(ranges):
            return layout.covered(store.spans(ranges))

        union = brought([(0, layout.rows_offset)])  # the header's read
        for x in xs:
            wanted = active_set(module, header, x, step.pairings[precision], theta)
            assert 0 < int(wanted.sum()) < layout.intermediate  # a real subset
            before = step.counts["rows_read"]
            out = rt.run_layer(0, module, x, torch.tensor([[0]]), torch.tensor([[1.0]]))
            new = wanted & ~union
            read = (new | brought(layout.ranges(new))) if bool(new.any()) else new
            union |= read
            entry = rt.cache.find(0, 0, precision)
            assert torch.equal(entry.payload.neurons, union) and bool((union & wanted).eq(wanted).all())
            assert step.counts["rows_read"] - before == int(read.sum())
            expected = neuron_forward(module, layout, record, step.pairings[precision], x, union.nonzero().flatten())
            assert torch.allclose(out, expected, atol=1e-6)
        assert store.direct_io or not bool(union.all())  # some rows were never read
    finally:
        lm.close()


def test_the_budget_is_never_exceeded_with_partial_records(tmp_path):
    from prep.pipeline import prepare

    save_wide_mixtral(tmp_path / "model")
    prepare(tiny_recipe("passthrough", neuron=NEURON | {"theta": 0.15, "predictor": True}), root=tmp_path,
            output=tmp_path / "artifact")
    artifact = tmp_path / "artifact"
    budget = minimum_budget(artifact) + 4096
    for predictors in (None, []):
        _, _, stats = decode(artifact, None, budget=budget, steps=8, predictors=predictors)
        assert stats["peak_expert_bytes"] <= budget - stats["budget"]["dense_bytes"]
        assert stats["neuron"]["partial_reads"] > 0
        assert stats["neuron"]["rows_read"] < stats["neuron"]["experts"] * 512  # partial records were held


def test_loader_with_compute_active_matches_the_source_model_with_inactive_neurons_dropped(tmp_path):
    """compute: active decodes the expert over each token's own active neurons: what prep's emulation (used to
    choose theta) computes on the source model. The neuron_gates predictor changes nothing there."""
    model, artifact = neuron_artifact(tmp_path, "olmoe", "passthrough", predictor=True)
    cfg = NeuronConfig(theta=0.2, crossover=1.0, compute="active")
    with_pred, tokens, stats = decode(artifact, cfg, stepwise=True)
    without, tokens_off, stats_off = decode(artifact, cfg, stepwise=True, predictors=[])
    assert torch.equal(with_pred, without) and tokens == tokens_off
    assert stats["neuron"]["predicted_experts"] > 0 and stats_off["neuron"]["predicted_experts"] == 0
    assert stats["neuron"]["expert_prediction"]["chosen"] > 0
    assert 0 <= stats["neuron"]["neuron_recall"] <= 1 and stats["neuron"]["computed"] < stats["neuron"]["neurons"]
    adapter = get_adapter(model)
    with torch.no_grad(), dropped_neurons(model, adapter, 0.2):
        past = None
        for t in PROMPT + tokens:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[0, -1]
            if t == PROMPT[-1]:
                first = last
    assert (first - with_pred[0]).abs().max() <= 1e-4 and (last - with_pred[-1]).abs().max() <= 1e-4
    # with prefill on, a prompt reads the union of its tokens' active rows and each token computes its own
    prefill, prefill_tokens, _ = decode(artifact, NeuronConfig(theta=0.2, crossover=1.0, compute="active", prefill=True))
    with torch.no_grad(), dropped_neurons(model, adapter, 0.2):
        dense = model(torch.tensor([PROMPT + prefill_tokens])).logits[0, len(PROMPT) - 1:]
    assert (dense - prefill).abs().max() <= 1e-4


def test_trust_prediction_computes_the_predicted_experts_with_the_prefetched_neurons(tmp_path):
    """CORM proceeds with its prediction: a decode layer after the first computes the experts neuron_gates named
    (weighted by the router's own function), with the neurons prefetched for them; the expert-level accuracy
    is still scored against the router's own choice."""
    _, artifact = neuron_artifact(tmp_path, "olmoe", "int4", theta=0.3, predictor=True)
    fixed_logits, _, fixed = decode(artifact, NeuronConfig(theta=0.3, crossover=1.0), stepwise=True)
    cfg = NeuronConfig(theta=0.3, crossover=1.0, trust_prediction=True)
    trusted_logits, _, trusted = decode(artifact, cfg, stepwise=True)
    layers = len(trusted["layers"])
    steps = len(PROMPT) + 5
    assert trusted["routing"]["decisions"] == steps * (layers - 1)  # every decode step, every layer after the first
    assert trusted["routing"]["experts_replaced"] > 0
    accuracy = trusted["neuron"]["expert_prediction"]
    assert accuracy["named"] < accuracy["chosen"]  # scored against the router, not against itself
    assert trusted["neuron"]["predicted_experts"] > 0
    assert not torch.equal(fixed_logits, trusted_logits)
    _, _, no_predictor = decode(artifact, cfg, stepwise=True, predictors=[])
    assert no_predictor["routing"] is None  # nothing named: the router's own choice


def test_neuron_stage_packs_profiles_measures_and_plans(tmp_path):
    _, artifact = neuron_artifact(tmp_path, "gpt_oss", "int4", theta=0.3, crossover=None, tolerance=0.05,
                                  predictor=True)
    assert verify(artifact) == []
    manifest = read_manifest(artifact)
    assert all(s.neuron == {"pairing": "interleaved"} for s in manifest.stores.values())
    plan = read_plan(artifact)
    assert plan.neuron.name == "sparse" and "neuron_gates" in [p.name for p in plan.predictors]
    report = json.loads((artifact / "report.json").read_text())["neuron"]
    shares = report["profile"]["mean"]
    assert all(a >= b for a, b in zip(shares, shares[1:], strict=False)) and shares[0] <= 1
    assert report["trail"] and all(kl <= 0.05 for t, kl in report["trail"] if t == report["theta"])
    assert report["theta"] <= 0.3 and 0 <= report["crossover"] <= 1
    assert report["crossover_measured"]["whole_seconds"] > 0
    layout = RecordLayout.from_json(manifest.raw["stores"][plan.expert_precision[0][0]]["layout"])
    assert NeuronLayout.holds(layout)


def test_neuron_loading_needs_the_neuron_layout(tmp_path):
    with pytest.raises(MoeprepError, match="neuron.layout"):
        tiny_recipe("int4", neuron={"enabled": True})
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", "int4")
    with pytest.raises(LoaderError, match="neuron layout"):
        load(artifact, neuron=True)


def test_the_neuron_study_measures_every_theta_and_lands_in_report_json(tmp_path):
    import yaml

    from prep.studies.neuron import merge_into, run_study
    from tests.helpers.tiny_models import write_tiny_suites

    save_wide_mixtral(tmp_path / "model")
    write_tiny_suites(tmp_path / "suites")
    recipe_path = tmp_path / "tiny.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe("passthrough", neuron={"crossover": 0.9}).to_dict()))
    study = run_study(recipe_path, tmp_path / "study", tmp_path, thetas=(0.0, 0.3), budget="unlimited",
                      suites=("mmlu", "truthfulqa"), limit=3, data=tmp_path / "suites", sequences=2,
                      sequence_length=8, echo=lambda m: None)  # loglikelihood suites only: seconds, not minutes
    zero, high = study["points"]
    assert all(s["delta"] == 0 for s in zero["suites"].values())  # lossless; theta 0 drops only zero activations
    assert high["no_predictor"]["neuron"]["active_share"] < zero["no_predictor"]["neuron"]["active_share"]
    assert high["no_predictor"]["bytes_per_token"] < study["baseline"]["bytes_per_token"]
    assert high["predictor"]["neuron"]["expert_prediction"]["chosen"] > 0
    artifact = tmp_path / "study" / "artifact"
    merge_into(artifact, study)
    assert verify(artifact) == []
    neuron = json.loads((artifact / "report.json").read_text())["neuron"]
    assert [p["theta"] for p in neuron["study"]["points"]] == [0.0, 0.3]
    assert {"bytes_per_token", "deltas"} <= set(neuron["study"]["points"][1])
    assert "### Neuron study" in (artifact / "report.md").read_text()


NEURON_CONFIGS = (NeuronConfig(theta=0.2, crossover=1.0), NeuronConfig(theta=0.2, crossover=1.0, compute="active"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("store", ["disk", "host"])
def test_the_neuron_path_on_cuda_matches_the_cpu(tmp_path, store):
    """The same store on both sides: which rows a read brings depends on the store (see the next test)."""
    _, artifact = neuron_artifact(tmp_path, "mixtral", "int4", theta=0.2, predictor=True)
    for cfg in NEURON_CONFIGS:
        cpu, _, _ = decode(artifact, cfg, stepwise=True, store=store)
        cuda, _, stats = decode(artifact, cfg, stepwise=True, device="cuda", store=store, cpu_misses="never")
        assert stats["neuron"]["experts"] > 0
        assert (cpu - cuda).abs().max() <= 1e-4


def test_every_store_reads_the_same_rows_of_a_neuron_record(tmp_path, monkeypatch):
    """What the H100 run saw (CUDA with the host store against the CPU with the disk store: 0.20 apart) was read
    granularity: O_DIRECT widened a disk read to whole 4 KiB blocks, which bring rows nobody asked for, and
    ``compute: resident`` computes every resident row, while the host store copied exactly the rows asked for.
    A neuron store now carries a crc32 per 4 KiB block and every store reads whole blocks to check them, so the
    host store, the disk with O_DIRECT and the disk without it read the same rows and give the same logits."""
    from loader.store import ExpertStore

    artifact = _wide_neuron_artifact(tmp_path)
    resident, active = NEURON_CONFIGS
    results = {store: decode(artifact, resident, stepwise=True, store=store) for store in ("host", "disk")}
    monkeypatch.setattr(ExpertStore, "_open", lambda self: (os.open(self.path, os.O_RDONLY), False))
    results["plain"] = decode(artifact, resident, stepwise=True, store="disk")
    assert not results["plain"][2]["direct_io"] and results["host"][2]["neuron"]["partial_reads"] > 0
    for name in ("disk", "plain"):
        assert torch.equal(results[name][0], results["host"][0]), name
        assert results[name][2]["neuron"]["rows_read"] == results["host"][2]["neuron"]["rows_read"], name


@pytest.mark.parametrize("cfg", [*NEURON_CONFIGS, None])
def test_the_gpu_host_store_path_computes_the_cpu_host_store_path(tmp_path, monkeypatch, cfg):
    """The CUDA host-store logic with CPU tensors (``tests.helpers.loader_fakes.FakeLink``: copies on streams, deferred
    until waited for): neuron reads of whole checked blocks, and misses computed on the CPU from the host record
    (``cpu_misses='always'``, with neuron loading off: the neuron-layout record through its own form)."""
    from tests.helpers.loader_fakes import FakeLink

    artifact = _wide_neuron_artifact(tmp_path, predictor=True)
    expected, _, _ = decode(artifact, cfg if cfg is not None else False, stepwise=True, store="host")
    link = FakeLink()
    monkeypatch.setattr("loader.runtime.link_for", lambda device: link)
    got, _, stats = decode(artifact, cfg if cfg is not None else False, stepwise=True, store="host",
                           cpu_misses="never" if cfg is not None else "always")
    assert (got - expected).abs().max() <= 1e-5
    if cfg is not None:
        assert stats["neuron"]["partial_reads"] > 0 and link.copies > 0
    else:
        assert stats["compute"]["cpu_computed"] > 0


def test_neuron_ranges_are_the_runs_of_consecutive_neurons():
    """Against a plain loop over the neurons: one (start, length) per run, in order."""
    from prep.adapters.base import ExpertWeights

    layout, _ = encode_neuron_expert(ExpertWeights(torch.randn(40, 32), torch.randn(40, 32), torch.randn(32, 40)),
                                     "int4", 16, 0)
    neuron = NeuronLayout(layout)
    rng = random.Random(1)
    for _ in range(300):
        rows = torch.rand(neuron.intermediate) < rng.random()
        expected = []
        for j in rows.nonzero().flatten().tolist():
            start = neuron.rows_offset + j * neuron.row_bytes
            if expected and sum(expected[-1]) == start:
                expected[-1] = (expected[-1][0], expected[-1][1] + neuron.row_bytes)
            else:
                expected.append((start, neuron.row_bytes))
        assert neuron.ranges(rows) == expected


def _wide_neuron_artifact(tmp_path, **knobs):
    from prep.pipeline import prepare

    save_wide_mixtral(tmp_path / "model")
    prepare(tiny_recipe("passthrough", neuron=NEURON | {"theta": 0.15} | knobs), root=tmp_path,
            output=tmp_path / "artifact")
    return tmp_path / "artifact"


def _corrupt_rows(artifact, blocks: slice) -> list[str]:
    """Flip a byte in each of the ``blocks`` (4 KiB blocks of every neuron-layout record past its header), leaving
    the manifest as it is, as a damaged disk would; returns the record keys."""
    from loader.artifact import open_artifact, store_offsets
    from loader.hashing import BLOCK

    manifest = open_artifact(artifact)
    precision, info = next(iter(manifest.stores.items()))
    layout = NeuronLayout(RecordLayout.from_json(info.layout))
    first = -(-layout.rows_offset // BLOCK)  # the first block holding rows only
    path = manifest.path(info.file)
    data = bytearray(path.read_bytes())
    offsets = store_offsets(manifest, precision)
    for offset in offsets.values():
        for block in range(info.block_count)[blocks]:
            if block >= first:
                data[offset + block * BLOCK + 7] ^= 0xFF
    path.write_bytes(bytes(data))
    return list(offsets)


@pytest.mark.parametrize("store", ["disk", "host"])
def test_a_damaged_row_block_is_an_error_never_different_text(tmp_path, store):
    """The reproduction: rows of experts corrupted past their header, manifest untouched. Decoding at a high theta
    reads those rows in part; every partial read is checked against its block's crc32, so the run stops with an
    ArtifactError naming the record and block instead of finishing with other text. The same decode on the
    sound artifact reads in part without error, and ``verify`` names the file."""
    artifact = _wide_neuron_artifact(tmp_path)
    cfg = NeuronConfig(theta=0.3, crossover=1.0)
    _, _, stats = decode(artifact, cfg, stepwise=True, store=store)
    assert stats["neuron"]["partial_reads"] > 0 and stats["block_check_seconds"] > 0
    _corrupt_rows(artifact, slice(None))
    with pytest.raises(ArtifactError, match="damaged in its 4 KiB block"):
        decode(artifact, cfg, stepwise=True, store=store)
    assert any(line.startswith("experts-passthrough.safetensors") for line in verify(artifact))


def test_verify_checks_the_block_table(tmp_path):
    """A block table that does not match the records (hashes recomputed, as an editor would) is found by verify."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from loader.format import read_manifest, sha256_file, write_manifest

    artifact = _wide_neuron_artifact(tmp_path)
    assert verify(artifact) == []
    manifest = read_manifest(artifact)
    name = next(iter(manifest.stores.values())).blocks
    tensors = load_file(str(artifact / name))
    tensors["blocks"][0, -1] ^= np.uint64(1)
    save_file(tensors, str(artifact / name))
    raw = manifest.raw
    raw["files"][name] = {"bytes": (artifact / name).stat().st_size, "sha256": sha256_file(artifact / name)}
    write_manifest(artifact, raw)
    problems = verify(artifact)
    assert len(problems) == 1 and "block hashes" in problems[0] and "not bound to its xxh3_64" in problems[0]


def _reseal_rows(artifact, rebind: bool) -> str:
    """Rewrite the neuron rows of the first record past its header (a tenth of their bytes, so the text changes)
    consistently: the block table's row recomputed from the new bytes, its ``bound`` column recomputed as a writer
    would (from the rewritten record's own xxh3_64) with ``rebind``, else left, the sha256 of the store and of the
    block table and the manifest's digest resealed; only the manifest's xxh3_64 of the record stays as it was.
    Returns the record's key."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    from xxhash import xxh3_64_intdigest

    from loader.artifact import store_offsets
    from loader.format import block_hashes, read_manifest, sha256_file, write_manifest
    from loader.hashing import BLOCK, bound_rows

    manifest = read_manifest(artifact)
    precision, info = next(iter(manifest.stores.items()))
    layout = NeuronLayout(RecordLayout.from_json(info.layout))
    key, offset = next(iter(store_offsets(manifest, precision).items()))
    path = manifest.path(info.file)
    data = bytearray(path.read_bytes())
    start = offset + -(-layout.rows_offset // BLOCK) * BLOCK
    rows = np.frombuffer(data, dtype=np.float32, count=(offset + info.record_bytes - start) // 4, offset=start)
    data[start:start + rows.nbytes] = (rows * np.float32(10.0)).tobytes()
    path.write_bytes(bytes(data))
    record = bytes(data[offset:offset + info.record_bytes])
    tensors = load_file(str(manifest.path(info.blocks)))
    row = manifest.store_keys(precision).index(key)
    tensors["blocks"][row] = np.asarray(block_hashes(record), dtype=np.uint64)
    if rebind:
        tensors["bound"][row] = bound_rows(tensors["blocks"][row:row + 1], [xxh3_64_intdigest(record)])[0]
    save_file(tensors, str(manifest.path(info.blocks)))
    raw = manifest.raw
    for name in (info.file, info.blocks):
        raw["files"][name] = {"bytes": manifest.path(name).stat().st_size, "sha256": sha256_file(manifest.path(name))}
    write_manifest(artifact, raw)
    return key


@pytest.mark.parametrize("rebind", [True, False], ids=["rebound-to-the-new-bytes", "binding-left"])
def test_rows_rewritten_with_their_block_table_resealed_but_the_record_hash_stale_are_refused(tmp_path, rebind):
    """The rows a prompt reads in part rewritten consistently (their block hashes recomputed, every sha256 and the
    manifest's digest resealed) while the record's xxh3_64 stays stale: the block table is bound to the record hash,
    so the load refuses, naming the record, where the decode used to read the rewritten rows and print other
    tokens with exit 0. ``verify`` refuses it too."""
    artifact = _wide_neuron_artifact(tmp_path)
    cfg = NeuronConfig(theta=0.3, crossover=1.0)
    _, _, stats = decode(artifact, cfg, stepwise=True)
    assert stats["neuron"]["partial_reads"] > 0  # this prompt reads records in part
    key = _reseal_rows(artifact, rebind)
    with pytest.raises(ArtifactError, match=f"record {key} of .*not bound to its xxh3_64"):
        decode(artifact, cfg, stepwise=True)
    assert verify(artifact)
