"""Stage ``trace``: calibration routing traces (router inputs, logits, selections, last hidden state)."""

from __future__ import annotations

from pathlib import Path

import torch

from prep.recipe import TraceSection
from prep.trace import open_trace, record_traces

VERSION = 1


def record_routing(model, adapter, sequences: list[torch.Tensor], cfg: TraceSection, work: Path,
                   fingerprint: str) -> dict:
    """Trace ``sequences`` into ``work/trace``; returns the result summary (tokens, expert shares)."""
    dtype = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.hidden_dtype]
    path = record_traces(model, sequences, work / "trace", adapter=adapter, shard_tokens=cfg.shard_tokens,
                         hidden_dtype=dtype, fingerprint=fingerprint, overwrite=True, progress=True)
    routing = open_trace(path).routing()
    ids = torch.cat([r.expert_ids for r in routing])  # [T, L, K]
    shares = [
        (torch.bincount(ids[:, i].flatten(), minlength=adapter.num_experts).float() / ids[:, i].numel()).tolist()
        for i in range(ids.shape[1])
    ]
    return {"tokens": int(ids.shape[0]), "layers": adapter.moe_layers,
            "expert_share": [[round(x, 5) for x in row] for row in shares]}
