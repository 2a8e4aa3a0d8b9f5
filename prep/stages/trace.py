"""Stage ``trace``: calibration routing traces (router inputs, logits, selections, last hidden state).

Needs the model and the calibration data; reads no other stage. The traces go to ``trace/`` in the
stage directory (``prep.methods.trace.open_trace`` reads them); the result holds the token count and each MoE
layer's expert shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prep.errors import MoeprepError
from prep.methods.trace import open_trace, record_traces
from prep.stages import Stage, StageResult

VERSION = 2  # 2: the trace holds head_input


@dataclass(frozen=True)
class TraceSection:
    """``batch``: calibration sequences per forward. With the model streamed a layer at a time (a model
    bigger than ``--expert-memory``), one batch of all sequences reads every layer once; 1 reads it once
    per sequence. Batching changes float rounding, so it is part of the key."""

    hidden_dtype: str = "float16"
    shard_tokens: int = 4096
    batch: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= 4096:
            raise MoeprepError(f"trace.batch is sequences per forward, from 1 to 4096; got {self.batch}")
        if not 1 <= self.shard_tokens <= 1 << 24:
            raise MoeprepError(f"trace.shard_tokens is tokens per trace shard, from 1 to {1 << 24}; got "
                               f"{self.shard_tokens}")
        if self.hidden_dtype not in ("float16", "bfloat16", "float32"):
            raise MoeprepError(f"trace.hidden_dtype {self.hidden_dtype!r} unknown; use float16, bfloat16 or float32")


@dataclass(frozen=True)
class RoutingTraces(StageResult):
    tokens: int
    layers: list  # model layer indices of the MoE layers, len L
    expert_share: list  # [L][E]: share of the routed slots each expert took

    @staticmethod
    def path(directory: Path) -> Path:
        """The trace directory inside the stage directory."""
        return Path(directory) / "trace"


def record_routing(model, adapter, sequences: list[torch.Tensor], cfg: TraceSection, work: Path,
                   fingerprint: str) -> RoutingTraces:
    """Trace ``sequences`` into ``work/trace``; returns the token count and expert shares."""
    dtype = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.hidden_dtype]
    path = record_traces(model, sequences, RoutingTraces.path(work), adapter=adapter, shard_tokens=cfg.shard_tokens,
                         hidden_dtype=dtype, fingerprint=fingerprint, overwrite=True, progress=True,
                         batch=cfg.batch)
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
    run=lambda inputs: record_routing(inputs.model, inputs.adapter, inputs.sequences, inputs.config, inputs.work,
                                      inputs.model_fingerprint),
    section="trace",
)
