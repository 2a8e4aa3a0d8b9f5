"""Recorded Mixtral-8x7B routing for tests: the real GSM8K traces of ``../shared/data/traces`` when present, else
synthetic ones in the same format (``gsm8k_routing.jsonl``: one record per problem, layer and token, and
``adapmoe_sensitivity.json`` beside it), so the code paths that import recorded routing run everywhere and the
figures that need the real decisions skip with a reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

REAL_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
REAL_FILE = REAL_ROOT / "mixtral-8x7b" / "gsm8k_routing.jsonl"
REAL_SENSITIVITY = REAL_ROOT / "mixtral-8x7b" / "adapmoe_sensitivity.json"


def real_traces() -> Path | None:
    """The real traces root, or None where the shared data is absent (or MOEPREP_TESTS_SYNTHETIC_TRACES=1 asks
    for what CI runs)."""
    if os.environ.get("MOEPREP_TESTS_SYNTHETIC_TRACES") == "1":
        return None
    return REAL_ROOT if REAL_FILE.is_file() and REAL_SENSITIVITY.is_file() else None


def synthetic_traces(root: Path, tokens=(40, 24), layers: int = 32, experts: int = 8, seed: int = 0) -> Path:
    """Write Mixtral-format routing of ``len(tokens)`` problems (top-2 of softmax over random logits,
    renormalized) and a sensitivity file (S falling with depth, as AdapMoE's) under ``root/mixtral-8x7b``."""
    gen = torch.Generator().manual_seed(seed)
    home = Path(root) / "mixtral-8x7b"
    home.mkdir(parents=True, exist_ok=True)
    lines = []
    for problem, n in enumerate(tokens):
        for layer in range(layers):
            probs = torch.softmax(2.0 * torch.randn(n, experts, generator=gen), dim=-1)
            top, ids = probs.topk(2, dim=-1)
            top = top / top.sum(-1, keepdim=True)
            for t in range(n):
                lines.append(json.dumps({"problem_id": problem, "layer": layer, "token_idx": t,
                                         "experts": ids[t].tolist(), "gating_probs": top[t].tolist()}))
    (home / "gsm8k_routing.jsonl").write_text("\n".join(lines) + "\n")
    (home / "adapmoe_sensitivity.json").write_text(json.dumps({
        "model": "synthetic", "threshold_T": 0.005, "source": "tests/helpers/mixtral_traces.py",
        "S": [40.0 * 0.8 ** layer for layer in range(layers)]}))
    return Path(root)


def traces_root(tmp_path: Path) -> Path:
    """The real traces where present, else synthetic ones under ``tmp_path``."""
    return real_traces() or synthetic_traces(tmp_path / "traces")
