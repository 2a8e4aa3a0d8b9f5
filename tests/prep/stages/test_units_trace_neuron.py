"""The trace and neuron stages as work units: the trace's units are its forwards, merged into the very
files one ``record_traces`` call writes; the neuron stage's units pack one precision and MoE layer each, the records
``encode_neuron_expert`` makes of each expert; a driver interrupted inside either resumes with the units written;
on Ray both write the same bytes as in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import prep.stages.neuron as neuron_stage
import prep.stages.trace as trace_stage
from loader.codec import RecordLayout
from loader.format import expert_key
from prep.adapters import get_adapter
from prep.errors import MoeprepError
from prep.methods.trace import batch_ranges, record_traces
from prep.pipeline import prepare
from prep.quant.hqq_codec import encode_neuron_expert
from prep.recipe import recipe_from_dict
from tests.helpers.interrupt import interrupted, uninterrupted
from tests.helpers.tiny_models import file_hashes, save_tiny_model


def recipe(**executor):
    """Five sequences traced two per forward (3 units) into shards of 37 rows, which cut across the forwards;
    int4 and int2 packed in the neuron layout (2 precisions x 2 MoE layers = 4 units)."""
    return recipe_from_dict({"name": "tiny", "model": {"path": "model"},
                             "calibration": {"num_sequences": 5, "sequence_length": 24},
                             "trace": {"batch": 2, "shard_tokens": 37},
                             "quantize": {"precision": "int4", "group_size": 16, "also": ["int2"]},
                             "neuron": {"layout": "neuron", "crossover": 0.5},
                             **({"executor": executor} if executor else {})})


@pytest.fixture
def gpt_oss_root(tmp_path):
    """A prepare root with a tiny gpt-oss (interleaved gate/up, biases, transposed experts) under ``model/``."""
    save_tiny_model("gpt_oss", tmp_path / "model")
    return tmp_path


def stage_dir(root: Path, stage: str) -> Path:
    return next((root / "artifacts/tiny/stages").glob(f"{stage}-*"))


def stage_files(root: Path) -> dict[str, str]:
    """{stage/file: sha256} of every stage file (without the key suffix), result.json without its timings."""
    import hashlib

    out = {}
    for path in sorted((root / "artifacts/tiny/stages").rglob("*")):
        if not path.is_file() or path.name == ".seal.json":  # the seal holds result.json's hash, timings included
            continue
        data = path.read_bytes()
        if path.name == "result.json":
            raw = json.loads(data)
            for timing in ("seconds", "crossover_measured"):  # measured on this machine's clock and disk
                raw["result"].pop(timing, None)
            data = json.dumps(raw, sort_keys=True).encode()
        rel = path.relative_to(root / "artifacts/tiny/stages")
        out["/".join((rel.parts[0].rsplit("-", 1)[0], *rel.parts[1:]))] = hashlib.sha256(data).hexdigest()
    return out


# --- trace ---------------------------------------------------------------------------------------------------


def test_trace_units_write_the_files_one_record_traces_call_writes(gpt_oss_root, tmp_path_factory):
    """The reference: ``record_traces`` over the same sequences in one call (one torch thread, as a unit
    computes), on the model the pipeline loads."""
    from transformers import AutoTokenizer

    from prep.calibration import calibration_sequences
    from prep.fingerprint import model_fingerprint
    from prep.streaming import load_streamed

    root = gpt_oss_root
    summary = prepare(recipe(), root=root, until="trace")
    assert summary["trace"]["units"]["ran"] == 3 == trace_stage.STAGE.units(recipe(), 2)
    directory = stage_dir(root, "trace")
    # the units' files are gone; the seal of the stage's files (prep/integrity.py) stays
    assert sorted(p.name for p in directory.iterdir()) == [".seal.json", ".trace.seal.json", "result.json", "trace"]

    model = load_streamed(root / "model")
    sequences = calibration_sequences(recipe().calibration, AutoTokenizer.from_pretrained(root / "model"), root)
    reference = tmp_path_factory.mktemp("reference") / "trace"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        record_traces(model, sequences, reference, shard_tokens=37, batch=2, fingerprint=model_fingerprint(root / "model"))
    finally:
        torch.set_num_threads(threads)
    got = file_hashes(directory / "trace")
    assert len(got) == 5  # the index and 120 rows in 4 shards of 37: the forwards (48, 48, 24 rows) end inside shards
    assert got == file_hashes(reference)


def test_batch_ranges_are_record_traces_forwards():
    seqs = [torch.arange(n) for n in (4, 4, 4, 3, 3, 4)]
    assert batch_ranges(seqs, 2) == [(0, 2), (2, 3), (3, 5), (5, 6)]  # a forward holds sequences of one length
    assert batch_ranges(seqs, 1) == [(i, i + 1) for i in range(6)]
    assert batch_ranges(seqs, 8) == [(0, 3), (3, 5), (5, 6)]
    with pytest.raises(MoeprepError, match="sequence 2 is empty"):
        batch_ranges([torch.arange(3), torch.arange(3), torch.arange(0)], 2)


def test_a_trace_interrupted_after_one_forward_resumes_with_it(gpt_oss_root, tmp_path_factory, monkeypatch):
    clean, _ = uninterrupted(tmp_path_factory, recipe(), "gpt_oss", until="trace")
    # Ctrl-C (or a kill) of the driver while the second forward runs
    with interrupted(monkeypatch, trace_stage, "trace_batch", on_call=2):
        prepare(recipe(), root=gpt_oss_root, until="trace")
    work = next((gpt_oss_root / "artifacts/tiny/stages").glob(".work-trace-*"))
    assert sorted(p.name for p in (work / "batches").glob("batch-*")) == ["batch-00000.safetensors"]
    (work / ".trace.tmp-99999").mkdir()  # what a driver killed in the middle of the merge leaves
    (work / ".trace.tmp-99999" / "shard-00000.safetensors").write_bytes(b"half")

    resumed = prepare(recipe(), root=gpt_oss_root, until="trace")
    assert resumed["trace"]["units"] | {"seconds": 0} == {"ran": 2, "reused": 1, "retried": 0, "seconds": 0}
    assert stage_files(gpt_oss_root) == stage_files(clean)


# --- neuron --------------------------------------------------------------------------------------------------


def test_neuron_units_write_each_experts_encoded_record(gpt_oss_root):
    """The reference: ``encode_neuron_expert`` of every expert of the source model, one at a time."""
    from transformers import AutoModelForCausalLM

    root = gpt_oss_root
    summary = prepare(recipe(), root=root, until="neuron")
    assert summary["neuron"]["units"]["ran"] == 4 == neuron_stage.STAGE.units(recipe(), 2)
    directory = stage_dir(root, "neuron")
    packed = neuron_stage.NeuronChoice.load(directory).packed_experts()
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    adapter = get_adapter(model)
    assert packed.layers == adapter.moe_layers and set(packed.stores) == {"int4", "int2"}
    for precision, store in packed.stores.items():
        for layer, name in zip(packed.layers, store["files"], strict=True):
            with safe_open(str(directory / precision / name), "pt") as f:
                assert sorted(f.keys()) == sorted(expert_key(layer, e) for e in range(adapter.num_experts))
                for e in range(adapter.num_experts):
                    layout, record = encode_neuron_expert(adapter.get_expert(model, layer, e), precision,
                                                          store["group_size"], store["meta_group"])
                    assert torch.equal(f.get_tensor(expert_key(layer, e)), record)
                    # the layout the stage wrote from the shapes alone is the encoded one
                    assert RecordLayout.from_json(store["layout"]) == layout and store["record_bytes"] == layout.nbytes
    # no temporary file of a unit left: only the units' seals and the stage's (prep/integrity.py)
    assert all(p.name.endswith(".xxh3") or p.name == ".seal.json" for p in directory.rglob(".*"))


def test_neuron_packing_interrupted_resumes_with_the_layers_written(gpt_oss_root, tmp_path_factory, monkeypatch):
    clean, _ = uninterrupted(tmp_path_factory, recipe(), "gpt_oss", until="neuron")
    with interrupted(monkeypatch, neuron_stage, "pack_neuron_layer", on_call=3):
        prepare(recipe(), root=gpt_oss_root, until="neuron")
    resumed = prepare(recipe(), root=gpt_oss_root, until="neuron")
    assert resumed["trace"]["cached"] and resumed["quantize"]["cached"] and not resumed["neuron"]["cached"]
    assert resumed["neuron"]["units"] | {"seconds": 0} == {"ran": 2, "reused": 2, "retried": 0, "seconds": 0}
    assert stage_files(gpt_oss_root) == stage_files(clean)


# --- Ray -----------------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("ray")  # one Ray instance at a time on the machine
def test_trace_and_neuron_units_on_ray_write_the_bytes_of_a_local_run(tmp_path):
    """Two Ray workers (``ray.init(num_cpus=2)``) load the model from its directory and read the tokens from the
    work directory: every stage file equals the local run's."""
    ray = pytest.importorskip("ray")
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    for root in (local, on_ray):
        save_tiny_model("gpt_oss", root / "model")
    prepare(recipe(), root=local, until="neuron")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = prepare(recipe(kind="ray"), root=on_ray, until="neuron")
    finally:
        ray.shutdown()
    assert summary["trace"]["units"]["ran"] == 3 and summary["neuron"]["units"]["ran"] == 4
    assert stage_files(on_ray) == stage_files(local)
