"""Measure the reference model: suite accuracies, routing health, and what INT2 experts cost.

``measure_reference(dir)`` loads ``dir/model`` with plain transformers, scores the held-out suites in
``dir/suites`` with the harness's templates, records routing over fresh documents of each domain,
repeats MMLU with every expert quantized to INT2 (HQQ, group 16), zeroed, and under seeded Gaussian
noise (to tell reliance on the experts from reliance on their precision), scores TruthfulQA and GSM8K
with the INT2 experts too, and writes ``dir/metrics.json``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from loader.io import write_json_atomic
from prep.adapters import get_adapter
from prep.evals import suites as S
from prep.quant.hqq_codec import fake_quantize
from prep.reference import data as D

# the figures the issue asks the reference model to reach
TARGETS = {"mmlu_acc": 0.5, "truthfulqa_mc1_over_chance": 2.0, "gsm8k_exact_match": 0.2,
           "min_expert_share": 0.03, "int2_mmlu_drop": 0.03}


def load_model(model_dir: str | Path):
    """The reference model and tokenizer, float32, eval mode, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def expert_usage(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """Share of top-k selections per expert at each MoE layer over ``texts``: [L, E], rows sum to 1."""
    adapter = get_adapter(model)
    layers = adapter.moe_layers
    counts = torch.zeros(len(layers), adapter.num_experts)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [adapter.moe_block(model, layer).register_forward_hook(
        lambda _m, args, _o, layer=layer: inputs.__setitem__(layer, args[0].detach()))
        for layer in layers]
    try:
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"][:1024]])
            model(input_ids=ids)
            for row, layer in enumerate(layers):
                _, experts, _ = adapter.route(model, layer, inputs[layer].reshape(-1, adapter.hidden_size))
                counts[row] += torch.bincount(experts.flatten(), minlength=adapter.num_experts).float()
    finally:
        for h in hooks:
            h.remove()
    return counts / counts.sum(dim=1, keepdim=True)


def _js_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    m = (p + q) / 2

    def kl(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a * (a.clamp_min(1e-12) / b.clamp_min(1e-12)).log()).sum())

    return (kl(p, m) + kl(q, m)) / 2 / math.log(2)


@torch.no_grad()
def perturb_experts(model, change) -> float:
    """Replace every routed expert matrix ``w`` by ``change(w)``, in place; returns the mean relative
    change ``|change(w) - w| / |w|`` over the matrices (biases and other 1-D tensors are kept)."""
    adapter = get_adapter(model)
    rel = []
    for layer in adapter.moe_layers:
        for expert in range(adapter.num_experts):
            w = adapter.get_expert(model, layer, expert)
            new = {name: change(t) if t.ndim == 2 else t for name, t in w.tensors().items()}
            rel += [float((new[name] - t).norm() / t.norm().clamp_min(1e-12))
                    for name, t in w.tensors().items() if t.ndim == 2]
            adapter.set_expert(model, layer, expert, type(w)(**new))
    return sum(rel) / len(rel)


def quantize_all_experts(model, nbits: int, group_size: int) -> float:
    """Replace every routed expert's matrices by their HQQ round trip, in place; returns the mean
    relative error."""
    return perturb_experts(model, lambda t: fake_quantize(t, nbits, group_size))


def gaussian_noise(scale: float, seed: int = 0):
    """A change for ``perturb_experts``: add seeded Gaussian noise of ``scale`` times the matrix's std."""
    g = torch.Generator().manual_seed(seed)
    return lambda t: t + scale * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)


# Expert-noise levels the metrics probe, relative to each matrix's std: INT2 g16 errs by about 0.3.
NOISE_LEVELS = (0.3, 0.5, 1.0)


def _by_kind(kinds: list[str], results: list[dict]) -> dict[str, float]:
    """MMLU accuracy per item kind (``kinds[i]`` is ``data.item_kind`` of item i)."""
    return {k: S.mean(r["correct"] for r, kind in zip(results, kinds, strict=True) if kind == k)
            for k in sorted(set(kinds))}


def item_record(mmlu: list[dict], tqa: list[dict], gsm: list[dict]) -> dict[str, str]:
    """Which items each suite got right, one character per item ("1" right, "0" wrong), in suite order: what lets
    a test re-score a sample of the items and compare item by item, instead of re-scoring every item."""
    return {name: "".join("1" if r["correct"] else "0" for r in results)
            for name, results in (("mmlu", mmlu), ("truthfulqa", tqa), ("gsm8k", gsm))}


def measure_reference(ref_dir: str | Path, limit: int | None = None, progress: bool = True) -> dict:
    """Score ``ref_dir/model`` on ``ref_dir/suites`` and write ``ref_dir/metrics.json``; returns it."""
    ref_dir = Path(ref_dir)
    model, tokenizer = load_model(ref_dir / "model")
    suites = {name: S.read_jsonl(ref_dir / "suites" / f"{name}.jsonl")[:limit]
              for name in ("gsm8k", "mmlu", "truthfulqa")}
    shots = S.read_jsonl(ref_dir / "suites" / "gsm8k_fewshot.jsonl")

    def score(which_model) -> tuple[list[dict], list[dict], list[dict]]:
        """Per-item results on MMLU (0-shot), TruthfulQA and GSM8K (5-shot plain), for fp and INT2 alike."""
        return (S.score_mmlu(which_model, tokenizer, suites["mmlu"], progress=progress),
                S.score_truthfulqa(which_model, tokenizer, suites["truthfulqa"], progress=progress),
                S.score_gsm8k(which_model, tokenizer, suites["gsm8k"], *S.gsm8k_plain(shots), max_new_tokens=96,
                              progress=progress))

    mmlu, tqa, gsm = score(model)
    chance = S.mean(r["chance"] for r in tqa)
    metrics: dict = {
        "mmlu_acc": S.mean(r["correct"] for r in mmlu),
        "mmlu_acc_by_subject": {},
        "truthfulqa_mc1": S.mean(r["correct"] for r in tqa),
        "truthfulqa_mc1_chance": chance,
        "truthfulqa_mc2": S.mean(r["mc2"] for r in tqa),
        "gsm8k_exact_match": S.mean(r["correct"] for r in gsm),
        "gsm8k_flexible_match": S.mean(r["flexible_correct"] for r in gsm),
        "gsm8k_num_fewshot": len(shots),
        "items": {name: len(rows) for name, rows in suites.items()},
        "correct_items": {"fp": item_record(mmlu, tqa, gsm)},
    }
    metrics["truthfulqa_mc1_over_chance"] = metrics["truthfulqa_mc1"] / chance
    for subject in sorted({i["subject"] for i in suites["mmlu"]}):
        hits = [r["correct"] for r, i in zip(mmlu, suites["mmlu"], strict=True) if i["subject"] == subject]
        metrics["mmlu_acc_by_subject"][subject] = S.mean(hits)
    kinds = [D.item_kind(i) for i in suites["mmlu"]]
    metrics["mmlu_acc_by_kind"] = _by_kind(kinds, mmlu)

    # routing over fresh documents (a seed no training or suite document used)
    split = D.Split(frozenset(), frozenset(), frozenset())
    fresh = D.training_documents(987654, split, {d: 40 for d in D.DOMAINS})
    usage = {}
    for domain in D.DOMAINS:
        texts = [t for d, t in fresh if d == domain][: (limit or 40)]
        usage[domain] = expert_usage(model, tokenizer, texts)
    overall = sum(usage.values()) / len(usage)
    metrics["expert_share_per_layer"] = [[round(x, 4) for x in row] for row in overall.tolist()]
    metrics["min_expert_share"] = float(overall.min())
    metrics["expert_share_by_domain"] = {d: [[round(x, 4) for x in row] for row in u.tolist()]
                                         for d, u in usage.items()}
    pairs = [(a, b) for i, a in enumerate(D.DOMAINS) for b in D.DOMAINS[i + 1:]]
    metrics["domain_js_divergence_mean_over_layers"] = {
        f"{a}-{b}": round(sum(_js_divergence(usage[a][row], usage[b][row]) for row in range(len(overall)))
                          / len(overall), 4)
        for a, b in pairs
    }

    # How much MMLU rests on the experts at all (all zeroed), and how much on their precision (noise):
    # the INT2 drop can only be large if accuracy falls at noise levels near INT2's own error.
    def mmlu_with(change) -> float:
        perturbed = copy.deepcopy(model)  # the fp model, still untouched here
        perturb_experts(perturbed, change)
        return S.mean(r["correct"] for r in S.score_mmlu(perturbed, tokenizer, suites["mmlu"], progress=False))

    metrics["experts_zeroed_mmlu_acc"] = mmlu_with(torch.zeros_like)
    metrics["expert_noise_mmlu_acc"] = {str(s): mmlu_with(gaussian_noise(s)) for s in NOISE_LEVELS}

    metrics["int2_expert_relative_error"] = quantize_all_experts(model, nbits=2, group_size=16)
    mmlu_int2, tqa_int2, gsm_int2 = score(model)  # the other suites show where expert precision does matter
    metrics["int2_mmlu_acc"] = S.mean(r["correct"] for r in mmlu_int2)
    metrics["int2_mmlu_drop"] = metrics["mmlu_acc"] - metrics["int2_mmlu_acc"]
    metrics["int2_mmlu_acc_by_kind"] = _by_kind(kinds, mmlu_int2)
    metrics["int2_truthfulqa_mc1"] = S.mean(r["correct"] for r in tqa_int2)
    metrics["int2_gsm8k_exact_match"] = S.mean(r["correct"] for r in gsm_int2)
    metrics["correct_items"]["int2"] = item_record(mmlu_int2, tqa_int2, gsm_int2)
    metrics["int2_config"] = {"method": "hqq", "nbits": 2, "group_size": 16, "scope": "every routed expert"}
    metrics["targets"] = TARGETS
    metrics["meets_targets"] = {k: metrics[k] >= v for k, v in TARGETS.items()}
    metrics["mmlu_chance"] = 0.25
    if limit is None:
        write_json_atomic(ref_dir / "metrics.json", metrics)
    return metrics
