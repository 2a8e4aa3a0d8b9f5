"""The simulator validates its traces as the loader validates an artifact.

A small real trace is written the way the pipeline writes one (``write_routing_trace`` for imported routing,
``record_traces`` on a tiny model for one with router logits) and the real Mixtral JSONL format
(``tests/helpers/mixtral_traces.synthetic_traces``); each row of the tables damages one field (NaN / inf gating values,
top_k -1 / 0 / 1.5 / inf, hidden size -1, fractional and out-of-range expert ids, an empty trace, 10**12
experts, a zero record size) and ``moeprep simulate`` must exit 1 with ONE clear error naming the file, the
field and the fix: no traceback, no silent success.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from loader.errors import MoeError
from prep.cli import main
from prep.errors import MoeprepError
from prep.methods.trace import (
    MAX_EXPERTS,
    RECORD_AGAIN,
    RoutingTrace,
    open_trace,
    read_mixtral_traces,
    write_routing_trace,
)
from prep.sim import load_replay, replay_from_routing, simulate_trace
from tests.helpers.mixtral_traces import synthetic_traces

SIMULATE = ["--policy", "lru", "--capacity", "2"]
FIX = "moeprep prepare --force trace"  # the fix every damaged project trace names (RECORD_AGAIN)
JSONL_FIX = "fetch the Mixtral traces again"


def _routing(gen: torch.Generator, tokens: int, layers: int = 2, experts: int = 8) -> RoutingTrace:
    probs = torch.softmax(torch.randn(tokens, layers, experts, generator=gen), dim=-1)
    weights, ids = probs.topk(2, dim=-1)
    return RoutingTrace(ids, weights / weights.sum(-1, keepdim=True), tuple(range(layers)))


@pytest.fixture(scope="module")
def routing_trace(tmp_path_factory) -> Path:
    """A routing-only project trace (what ``trace.recorded`` imports): 2 sequences, 2 layers, 8 experts, top-2,
    two shards."""
    gen = torch.Generator().manual_seed(0)
    return write_routing_trace([_routing(gen, 6), _routing(gen, 5)], tmp_path_factory.mktemp("routing") / "trace",
                               layers=[0, 1], num_experts=8, architecture="mixtral", source={"test": True},
                               shard_tokens=8)


@pytest.fixture(scope="module")
def model_trace(tmp_path_factory) -> Path:
    """A trace recorded from a tiny model's forward (router logits included; hidden_size in the index)."""
    from prep.methods.trace import record_traces
    from tests.helpers.tiny_models import build_tiny_model, random_sequences

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return record_traces(build_tiny_model("mixtral"), random_sequences(2, 5, seed=1),
                             tmp_path_factory.mktemp("model") / "trace", record_hidden=False)
    finally:
        torch.set_num_threads(threads)


def _copy(trace: Path, tmp_path: Path, index=None, shard=None) -> Path:
    """A copy of ``trace`` with ``index(dict)`` applied to its index and ``shard(tensors)`` to its first shard."""
    out = tmp_path / "damaged"
    shutil.copytree(trace, out)
    if index is not None:
        raw = json.loads((out / "index.json").read_text())
        index(raw)
        (out / "index.json").write_text(json.dumps(raw))  # NaN and Infinity as Python's json writes them
    if shard is not None:
        file = out / "shard-00000.safetensors"
        tensors = load_file(file)
        shard(tensors)
        save_file(tensors, file)
    return out


def _set(key, value):
    return lambda raw: raw.__setitem__(key, value)


def _poke(name, row, col, value):
    def edit(tensors):
        tensors[name][row, col] = value
    return edit


def _as_float(name, offset):
    def edit(tensors):
        tensors[name] = tensors[name].double() + offset
    return edit


def _empty(raw):
    raw.update(sequence_tokens=[], total_tokens=0, shards=[])


# (row id, which trace, index edit, shard edit, file the message names, what it must say)
PROJECT_ROWS = [
    ("nan weight", "routing", None, _poke("layers.0.expert_weights", 1, 0, math.nan), "shard-00000.safetensors",
     "layers.0.expert_weights holds non-finite gating weights (nan"),
    ("inf weight", "routing", None, _poke("layers.1.expert_weights", 0, 1, math.inf), "shard-00000.safetensors",
     "layers.1.expert_weights holds non-finite gating weights (inf"),
    ("-inf weight", "routing", None, _poke("layers.0.expert_weights", 0, 0, -math.inf), "shard-00000.safetensors",
     "non-finite gating weights (-inf"),
    ("nan logit", "model", None, _poke("layers.0.router_logits", 2, 1, math.nan), "shard-00000.safetensors",
     "layers.0.router_logits holds non-finite router logits"),
    ("top_k -1", "routing", _set("top_k", -1), None, "index.json", "top_k must be a whole number"),
    ("top_k 0", "routing", _set("top_k", 0), None, "index.json", "top_k must be a whole number"),
    ("top_k 1.5", "routing", _set("top_k", 1.5), None, "index.json", "got 1.5"),
    ("top_k inf", "routing", _set("top_k", math.inf), None, "index.json", "top_k must be a whole number"),
    ("top_k nan", "routing", _set("top_k", math.nan), None, "index.json", "got NaN"),
    ("top_k true", "routing", _set("top_k", True), None, "index.json", "got true"),
    ("top_k > experts", "routing", _set("top_k", 9), None, "index.json", "from 1 to num_experts (8), got 9"),
    ("top_k not the tensors'", "routing", _set("top_k", 3), None, "index.json", "not [top_k] = [3]"),
    ("hidden_size -1", "model", _set("hidden_size", -1), None, "index.json", "hidden_size must be null or"),
    ("hidden_size 0", "model", _set("hidden_size", 0), None, "index.json", "hidden_size must be null or"),
    ("hidden_size 1.5", "routing", _set("hidden_size", 1.5), None, "index.json", "hidden_size must be null or"),
    ("hidden_size inf", "routing", _set("hidden_size", math.inf), None, "index.json", "got Infinity"),
    ("expert id 2.5", "routing", None, _as_float("layers.0.expert_ids", 0.5), "shard-00000.safetensors",
     "layers.0.expert_ids holds fractional expert ids"),
    ("expert ids as floats", "routing", None, _as_float("layers.1.expert_ids", 0.0), "shard-00000.safetensors",
     "layers.1.expert_ids holds dtype torch.float64"),
    ("expert id = E", "routing", None, _poke("layers.0.expert_ids", 0, 0, 8), "shard-00000.safetensors",
     "names expert 8, outside [0, 8)"),
    ("expert id -1", "model", None, _poke("layers.0.expert_ids", 3, 1, -1), "shard-00000.safetensors",
     "names expert -1, outside [0, 4)"),
    ("empty index", "routing", _empty, None, "index.json", "the trace holds no tokens"),
    ("all sequences empty", "routing", lambda raw: raw.update(sequence_tokens=[0, 0], total_tokens=0),
     None, "index.json", "the trace holds no tokens"),
    ("10**12 experts", "routing", _set("num_experts", 10**12), None, "index.json",
     f"num_experts must be a whole number of experts per layer from 1 to {MAX_EXPERTS}, got 1000000000000"),
    ("0 experts", "routing", _set("num_experts", 0), None, "index.json", "num_experts must be a whole number"),
    ("experts 8.0", "routing", _set("num_experts", 8.0), None, "index.json", "got 8.0"),
    ("layers empty", "routing", _set("layers", []), None, "index.json", "layers must be a non-empty list"),
    ("total_tokens off", "routing", _set("total_tokens", 12), None, "index.json", "is not the sum of sequence_tokens"),
    ("shard rows off", "routing", lambda raw: raw["shards"][0].update(tokens=7), None, "index.json",
     "the shards hold 10 token rows, total_tokens says 11"),
    ("shard outside", "routing", lambda raw: raw["shards"][0].update(file="../../etc/passwd"), None, "index.json",
     "must be a plain file name inside the trace directory"),
    ("no format", "routing", lambda raw: raw.clear(), None, "index.json", "format null version null is not"),
]


@pytest.mark.parametrize(("source", "index", "shard", "file", "said"), [row[1:] for row in PROJECT_ROWS],
                         ids=[row[0] for row in PROJECT_ROWS])
def test_a_damaged_project_trace_is_one_clear_error(routing_trace, model_trace, tmp_path, source, index, shard,
                                                    file, said):
    trace = _copy(routing_trace if source == "routing" else model_trace, tmp_path, index, shard)
    result = CliRunner().invoke(main, ["simulate", "--trace", str(trace), *SIMULATE])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    message = result.stderr
    assert message.startswith("error: ") and message.count("error: ") == 1, message
    assert str(trace / file) in message and said in message and FIX in message, message
    with pytest.raises(MoeprepError, match="record the trace again"):  # the Python entry says the same
        load_replay(trace)


def test_the_undamaged_traces_replay(routing_trace, model_trace):
    for trace in (routing_trace, model_trace):
        result = CliRunner().invoke(main, ["simulate", "--trace", str(trace), *SIMULATE, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["requests"] > 0
    assert FIX in RECORD_AGAIN


def test_every_reader_of_the_trace_gets_the_check(routing_trace, model_trace, tmp_path):
    """The checks live where a trace is opened and its shards read, so the stages that read traces (gating, path
    statistics, ...) refuse the same damage the simulator does."""
    with pytest.raises(MoeprepError, match="num_experts must be"):
        open_trace(_copy(routing_trace, tmp_path, index=_set("num_experts", 10**12)))
    damaged = _copy(model_trace, tmp_path / "logits", shard=_poke("layers.0.router_logits", 0, 0, math.inf))
    trace = open_trace(damaged)  # the index is sound; the shard is refused when the logits are read
    trace.routing()
    with pytest.raises(MoeprepError, match="non-finite router logits"):
        trace.router_logits(0)


def test_a_huge_expert_count_is_refused_before_anything_is_allocated(routing_trace, tmp_path, monkeypatch):
    """10**12 experts: refused from the index, before a shard is opened or a per-expert table built."""
    import prep.methods.trace as trace_module

    trace = _copy(routing_trace, tmp_path, index=_set("num_experts", 10**12))

    def no_read(*args, **kwargs):
        raise AssertionError("a shard was opened")

    monkeypatch.setattr(trace_module, "safe_open", no_read)
    with pytest.raises(MoeprepError, match=f"from 1 to {MAX_EXPERTS}"):
        simulate_trace(trace, policies="lru", capacity=2)
    with pytest.raises(MoeError, match=f"from 1 to {MAX_EXPERTS}"):  # the cost model's own check (loader/simulate.py)
        replay_from_routing([_routing(torch.Generator().manual_seed(0), 3)], 10**12)


# ------------------------------------------------------------------------------------- JSONL traces


def _jsonl(tmp_path: Path, edit=None) -> Path:
    """The real Mixtral format, 2 problems x 2 layers, with ``edit(records)`` applied to its parsed records."""
    file = synthetic_traces(tmp_path / "traces", tokens=(4, 3), layers=2) / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    if edit is not None:
        records = [json.loads(line) for line in file.read_text().splitlines()]
        edit(records)
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
    return file


def _record(i, key, value):
    return lambda records: records[i].__setitem__(key, value)


JSONL_ROWS = [
    ("nan gating", _record(3, "gating_probs", [math.nan, 0.5]), ":4:", "non-finite gating value nan"),
    ("inf gating", _record(0, "gating_probs", [0.5, math.inf]), ":1:", "non-finite gating value inf"),
    ("gating beyond float32", _record(0, "gating_probs", [1e300, 0.5]), ":1:", "non-finite gating value"),
    ("gating a string", _record(1, "gating_probs", ["0.5", 0.5]), ":2:", "gating_probs holds \"0.5\", not a number"),
    ("one gating value", _record(1, "gating_probs", [1.0]), ":2:", "gating_probs must be a list of 2 numbers"),
    ("expert id 2.5", _record(2, "experts", [2.5, 1]), ":3:", "fractional expert id 2.5"),
    ("expert id 8", _record(5, "experts", [8, 1]), ":6:", "names expert 8, outside [0, 8)"),
    ("expert id -1", _record(5, "experts", [0, -1]), ":6:", "names expert -1, outside [0, 8)"),
    ("expert id 10**12", _record(0, "experts", [10**12, 1]), ":1:", "names expert 1000000000000"),
    ("expert id true", _record(0, "experts", [True, 1]), ":1:", "experts holds true"),
    ("no experts", _record(0, "experts", []), ":1:", "experts must be a non-empty list"),
    ("top_k changes", _record(4, "experts", [1, 2, 3]), ":5:", "lists 3 experts where earlier records list 2"),
    ("layer 1.5", _record(0, "layer", 1.5), ":1:", "layer must be a whole number >= 0, got 1.5"),
    ("token_idx missing", lambda records: records[0].pop("token_idx"), ":1:", "the key 'token_idx' is missing"),
    ("empty file", lambda records: records.clear(), "gsm8k_routing.jsonl", "holds no routing records"),
]


@pytest.mark.parametrize(("edit", "where", "said"), [row[1:] for row in JSONL_ROWS], ids=[row[0] for row in JSONL_ROWS])
def test_a_damaged_jsonl_trace_is_one_clear_error(tmp_path, edit, where, said):
    file = _jsonl(tmp_path, edit)
    result = CliRunner().invoke(main, ["simulate", "--trace", str(file), *SIMULATE])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    message = result.stderr
    assert message.startswith("error: ") and message.count("error: ") == 1, message
    assert f"{file}{where}" in message or (where == file.name and str(file) in message), message
    assert said in message and JSONL_FIX in message, message


def test_the_importer_checks_ids_against_the_model_not_mixtrals_eight(tmp_path):
    """``read_mixtral_traces`` bounds ids by its ``num_experts`` (the simulator passes Mixtral's 8; the recorded
    routing importer checks them against its model itself), always by MAX_EXPERTS."""
    file = _jsonl(tmp_path, _record(0, "experts", [12, 1]))
    assert int(read_mixtral_traces(file)[0].expert_ids.max()) == 12
    with pytest.raises(MoeprepError, match=r":1: experts names expert 12, outside \[0, 8\)"):
        read_mixtral_traces(file, num_experts=8)


# ------------------------------------------------------------------------------------- CLI bounds


@pytest.mark.parametrize("record_bytes", ["0", "-1", str(2**41)])
def test_a_record_size_outside_its_bounds_is_one_clear_error(routing_trace, record_bytes):
    result = CliRunner().invoke(main, ["simulate", "--trace", str(routing_trace), *SIMULATE,
                                       "--record-bytes", record_bytes])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--record-bytes {record_bytes} must be a whole number of bytes from 1" in result.stderr, result.output
    with pytest.raises(MoeprepError, match="--record-bytes 0 must be"):  # 0 used to mean the default
        simulate_trace(routing_trace, policies="lru", capacity=2, record_bytes=0)
