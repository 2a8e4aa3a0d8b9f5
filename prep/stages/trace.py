"""Stage ``trace``: calibration routing traces (router inputs, logits, selections, last hidden state).

Needs the model and the calibration data; reads no other stage. The traces go to ``trace/`` in the
stage directory (``prep.methods.trace.open_trace`` reads them); the result holds the token count and each MoE
layer's expert shares.

The work units are the forwards: one per batch of ``trace.batch`` calibration sequences (``batches/batch-<i>``,
the captured rows of that forward, written by the executor in this process or on Ray workers that read the
tokens from ``batches/sequences.safetensors``); the stage then cuts their rows, in sequence order, into the
trace's shards and removes them. So an interrupted trace resumes with the forwards already written, and the
trace is the same bytes however the forwards were spread (each computed with one torch thread).

With ``trace.recorded`` the routing is imported instead: the real Mixtral-8x7B GSM8K decode decisions
(``gsm8k_routing.jsonl``), for a model of Mixtral's shape whose random weights do not decide its routing (the
bench's ``mixtral-shape-techniques``). Such a trace holds the routing only (expert ids and weights), so every
stage that needs no more (gating with a given sensitivity, dynamic precision, path statistics, the cache
allocation and the policy search) makes the decision Mixtral would make on those tokens; a stage that needs
hidden states or logits says so when it runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prep.errors import MoeprepError
from prep.executor import Unit
from prep.integrity import notice, seal_tree, tree_damage
from prep.methods.decoded import save_sequences
from prep.methods.trace import (
    INDEX_NAME,
    batch_ranges,
    capture_batch,
    open_trace,
    read_mixtral_traces,
    write_routing_trace,
    write_trace,
)
from prep.stages import Stage, StageResult

VERSION = 3  # 2: the trace holds head_input; 3: its forwards are units computed with one torch thread
HIDDEN_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
UNITS = "batches"  # the units' files and the tokens they read, in the work directory until merged
SEQUENCES = "sequences.safetensors"


@dataclass(frozen=True)
class TraceSection:
    """``batch``: calibration sequences per forward. With the model streamed a layer at a time (a model
    bigger than ``--expert-memory``), one batch of all sequences reads every layer once; 1 reads it once
    per sequence. Each forward is one work unit. Batching changes float rounding, so it is part of the key."""

    hidden_dtype: str = "float16"
    shard_tokens: int = 4096
    batch: int = 1
    recorded: str | None = None  # a recorded routing file (gsm8k_routing.jsonl) imported instead of a forward pass
    problems: tuple[int, ...] | None = None  # which recorded problems (positions in problem-id order); null: all

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= 4096:
            raise MoeprepError(f"trace.batch is sequences per forward, from 1 to 4096; got {self.batch}")
        if not 1 <= self.shard_tokens <= 1 << 24:
            raise MoeprepError(f"trace.shard_tokens is tokens per trace shard, from 1 to {1 << 24}; got "
                               f"{self.shard_tokens}")
        if self.hidden_dtype not in ("float16", "bfloat16", "float32"):
            raise MoeprepError(f"trace.hidden_dtype {self.hidden_dtype!r} unknown; use float16, bfloat16 or float32")
        if self.problems is not None:
            if self.recorded is None:
                raise MoeprepError("trace.problems picks recorded problems; it needs trace.recorded (a "
                                   "gsm8k_routing.jsonl file)")
            if not self.problems or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in self.problems):
                raise MoeprepError(f"trace.problems is a non-empty list of problem positions (0, 1, ...), got "
                                   f"{list(self.problems)}")


@dataclass(frozen=True)
class RoutingTraces(StageResult):
    tokens: int
    layers: list  # model layer indices of the MoE layers, len L
    expert_share: list  # [L][E]: share of the routed slots each expert took

    @staticmethod
    def path(directory: Path) -> Path:
        """The trace directory inside the stage directory."""
        return Path(directory) / "trace"


def import_recorded(adapter, cfg: TraceSection, root: Path, work: Path, fingerprint: str) -> Path:
    """Write the recorded problems ``cfg.problems`` of ``cfg.recorded`` as this model's trace: its first L layers
    (a model with fewer MoE layers than Mixtral's 32 takes the first ones), checked against its experts and top-k."""
    file = root / cfg.recorded
    if not file.is_file():
        raise MoeprepError(f"trace.recorded: {file} is not a file; name the recorded routing file "
                           "(../shared/data/traces/mixtral-8x7b/gsm8k_routing.jsonl)")
    recorded = read_mixtral_traces(file)
    picked = list(cfg.problems) if cfg.problems is not None else list(range(len(recorded)))
    if bad := [p for p in picked if p >= len(recorded)]:
        raise MoeprepError(f"trace.problems {bad}: {file} holds {len(recorded)} problems (positions 0-"
                           f"{len(recorded) - 1})")
    layers = list(adapter.moe_layers)
    first = recorded[0]
    if first.num_layers < len(layers) or first.top_k != adapter.top_k:
        raise MoeprepError(f"{file} records {first.num_layers} layers of top-{first.top_k} routing; the model has "
                           f"{len(layers)} MoE layers of top-{adapter.top_k}")
    chosen = [recorded[p] for p in picked]
    if (most := max(int(t.expert_ids.max()) for t in chosen)) >= adapter.num_experts:
        raise MoeprepError(f"{file} names expert {most}; the model has {adapter.num_experts} per layer")
    chosen = [type(t)(t.expert_ids[:, :len(layers)].contiguous(), t.expert_weights[:, :len(layers)].contiguous(),
                      tuple(layers)) for t in chosen]
    return write_routing_trace(chosen, RoutingTraces.path(work), layers=layers, num_experts=adapter.num_experts,
                               architecture=adapter.model_type, fingerprint=fingerprint,
                               shard_tokens=cfg.shard_tokens,
                               source={"file": str(cfg.recorded), "problems": picked,
                                       "tokens": [t.num_tokens for t in chosen]})


def trace_batch(context, out: Path, *, sequences: str, start: int, stop: int, hidden_dtype: str) -> None:
    """One unit: the forward over calibration sequences [start, stop) (read from the file ``sequences``), its
    captured rows written to ``out`` with the sequence lengths and the tensor names in capture order (the
    trace's index lists them in that order; safetensors keeps its own)."""
    with safe_open(sequences, "pt") as f:
        group = [f.get_tensor(str(i)) for i in range(start, stop)]
    rows = capture_batch(context.model, context.adapter, group, hidden_dtype=HIDDEN_DTYPES[hidden_dtype])
    save_file(rows, str(out), metadata={"names": json.dumps(list(rows)),
                                        "lengths": json.dumps([s.numel() for s in group])})


def _read_batch(path: Path) -> tuple[list[int], dict]:
    """(sequence lengths, rows in capture order) of a unit's file: what ``write_trace`` takes per forward."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        return json.loads(meta["lengths"]), {name: f.get_tensor(name) for name in json.loads(meta["names"])}


def trace_units(sequences: list[torch.Tensor], cfg: TraceSection, work: Path) -> list[Unit]:
    """One unit per forward ``record_traces`` would run (``batch_ranges``), writing ``batches/batch-<i>``; the
    tokens go to ``batches/sequences.safetensors`` for the units to read (a worker gets paths, not tensors)."""
    ranges = batch_ranges(sequences, cfg.batch)  # refuses an empty sequence before any unit runs
    directory = work / UNITS
    directory.mkdir(parents=True, exist_ok=True)
    tokens = directory / SEQUENCES
    save_sequences(tokens, [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences])
    return [Unit(name=f"batch-{i}", output=f"{UNITS}/batch-{i:05d}.safetensors", fn=trace_batch,
                 args={"sequences": str(tokens.resolve()), "start": start, "stop": stop,
                       "hidden_dtype": cfg.hidden_dtype})
            for i, (start, stop) in enumerate(ranges)]


MERGED_SEAL = ".trace.seal.json"  # in the work directory: the merged trace's files, for a resumed run


def _merged_damage(path: Path, work: Path) -> str | None:
    """None when a trace merged before an interruption may be reused; "absent" when there is none; else why not."""
    if not (path / INDEX_NAME).is_file():
        return "absent"
    return tree_damage(path, work / MERGED_SEAL)


def record_routing(inputs) -> RoutingTraces:
    """Trace the calibration sequences into ``work/trace`` through the run's executor (or import
    ``trace.recorded``); returns the token count and expert shares."""
    cfg, work, adapter = inputs.config, Path(inputs.work), inputs.adapter
    path = RoutingTraces.path(work)
    if cfg.recorded is not None:
        import_recorded(adapter, cfg, Path(inputs.root), work, inputs.model_fingerprint)
    elif (problem := _merged_damage(path, work)) is not None:  # else merged and sealed before an interruption
        if problem != "absent":
            notice(f"stage trace: the merged trace in {work} is not reused: {problem}; merging it again")
            shutil.rmtree(path, ignore_errors=True)
        for stale in work.glob(f".{path.name}.tmp-*"):  # a merge a killed driver left half built
            shutil.rmtree(stale, ignore_errors=True)
        units = trace_units(inputs.sequences, cfg, work)
        inputs.map_units(units, desc="trace")
        write_trace(path, (_read_batch(work / u.output) for u in units), adapter=adapter,
                    shard_tokens=cfg.shard_tokens, hidden_dtype=HIDDEN_DTYPES[cfg.hidden_dtype],
                    fingerprint=inputs.model_fingerprint)
        seal_tree(path, work / MERGED_SEAL)
    shutil.rmtree(work / UNITS, ignore_errors=True)
    routing = open_trace(path).routing()
    ids = torch.cat([r.expert_ids for r in routing])  # [T, L, K]
    shares = [
        (torch.bincount(ids[:, i].flatten(), minlength=adapter.num_experts).float() / ids[:, i].numel()).tolist()
        for i in range(ids.shape[1])
    ]
    return RoutingTraces(tokens=int(ids.shape[0]), layers=list(adapter.moe_layers),
                         expert_share=[[round(x, 5) for x in row] for row in shares])


STAGE = Stage(
    name="trace", version=VERSION, config=TraceSection, result=RoutingTraces,
    needs=frozenset({"model", "calibration"}),
    run=record_routing,
    files=lambda recipe: [recipe.trace.recorded] if recipe.trace.recorded else [],
    units=lambda recipe, num_layers: 0 if recipe.trace.recorded else -(-recipe.calibration.num_sequences
                                                                        // recipe.trace.batch),
    section="trace",
)
