"""How long ``moeprep eval`` takes on a real model: the tokens each suite runs through a model, and a wall-time
floor per model and device from them (the README's table, ``moeprep inspect-model --table --data DIR``).

Tokens come from the benchmark files and the prompts ``moeprep eval`` builds (its templates and default shot
counts), at ``CHARS_PER_TOKEN`` characters per token, the usual ratio of English text under these models'
32k-200k BPE vocabularies (an estimate: the real tokenizers are not shipped). Per suite:

- GSM8K (chain of thought, 8-shot): the prompt once, then one decode step per generated token, as many as the
  gold solution has (capped at the 256 ``eval`` allows);
- MMLU (5-shot): one row per answer letter, each the whole prompt;
- TruthfulQA (MC1 and MC2, 0-shot): one row per answer of each target set, prompt plus answer.

Time for one model = rows' tokens x 2 x active parameters / the device's sustained FLOP/s, plus per decode step
the larger of that compute and the active weights' bytes over its memory bandwidth. ``eval`` runs the
original and the prepared model, so a suite costs twice that. It is a floor: every weight resident and no
time for offloading reads, tokenization or Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from prep.evals import templates as tpl
from prep.evals.data import BenchmarkData

CHARS_PER_TOKEN = 4.0
GSM8K_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class Device:
    """A device's sustained rates for the floor: matmul FLOP/s at the model's dtype and memory bandwidth."""

    name: str
    flops: float
    bandwidth: float
    source: str


DEVICES = (
    # `moeprep`'s 2-core CI VM, bfloat16 [512, 4096] x [4096, 4096] products and [1, 4096] x [4096, 4096] (torch 2.13)
    Device("2 CPU cores (this VM)", 387e9, 7.6e9, "measured: bfloat16 GEMM 387 GFLOP/s, GEMV 7.6 GB/s"),
    # 40% of the H100 SXM's 989 TFLOP/s dense bfloat16, 60% of its 3.35 TB/s HBM3
    Device("H100", 0.4 * 989e12, 0.6 * 3.35e12, "assumed: 40% of peak bfloat16 FLOP/s, 60% of peak bandwidth"),
)


def _tokens(text: str) -> float:
    return len(text) / CHARS_PER_TOKEN


def suite_workloads(data: BenchmarkData) -> dict[str, dict]:
    """Per suite in ``data``: {items, row_tokens (tokens run through the model in batched rows), decode_steps}."""
    out = {}
    if "gsm8k" in data.items:
        pool = ([(s["question"], s["cot"]) for s in data.gsm8k_cot_shots] if data.gsm8k_cot_shots is not None
                else list(tpl.GSM8K_COT_EXEMPLARS))[:8]
        items = data.items["gsm8k"]
        out["gsm8k"] = {"items": len(items),
                        "row_tokens": sum(_tokens(tpl.gsm8k_cot_fewshot_prompt(i["question"], pool)) for i in items),
                        "decode_steps": sum(min(GSM8K_MAX_NEW_TOKENS, _tokens(i["answer"])) for i in items)}
    if "mmlu" in data.items:
        items = data.items["mmlu"]
        prompts = (tpl.mmlu_fewshot_prompt(i, data.mmlu_dev.get(i["subject"], [])[:5]) for i in items)
        out["mmlu"] = {"items": len(items), "row_tokens": sum(4 * (_tokens(p) + 1) for p in prompts),
                       "decode_steps": 0}
    if "truthfulqa" in data.items:
        items = data.items["truthfulqa"]
        rows = 0.0
        for i in items:
            prompt = _tokens(tpl.truthfulqa_prompt(i["question"]))
            for targets in ("mc1_targets", "mc2_targets"):
                rows += sum(prompt + _tokens(" " + c) for c in i[targets]["choices"])
        out["truthfulqa"] = {"items": len(items), "row_tokens": rows, "decode_steps": 0}
    return out


def suite_seconds(work: dict, active_params: int, device: Device, bytes_per_param: int = 2) -> float:
    """The floor, in seconds, of one suite for both models of ``eval`` (see the module docstring)."""
    per_token = 2 * active_params / device.flops
    per_step = max(per_token, active_params * bytes_per_param / device.bandwidth)
    return 2 * (work["row_tokens"] * per_token + work["decode_steps"] * per_step)
