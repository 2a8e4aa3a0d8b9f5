"""Train the reference MoE: a small Mixtral that really knows things, so accuracy deltas are real.

``build_reference(out_dir)`` generates the suites and the corpus (``data.py``), trains a byte-level BPE
tokenizer on the corpus, trains a ``MixtralForCausalLM`` from scratch with the router load-balancing
loss (so every expert stays in use), and writes, each atomically:

- ``model/``: Hugging Face format (float32 safetensors, config, tokenizer);
- ``suites/``: held-out ``gsm8k.jsonl``, ``mmlu.jsonl``, ``truthfulqa.jsonl`` and the few-shot pools
  ``gsm8k_fewshot.jsonl``, ``gsm8k_cot_fewshot.jsonl``, ``mmlu_dev.jsonl`` (training-distribution
  examples, as the harness draws gsm8k shots from train and MMLU shots from dev);
- ``training.json``: the spec, data sizes per domain, loss curve, wall time, device.

Everything is seeded; on the same machine and device the result is the same.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from prep.errors import MoeprepError
from prep.reference import data as D


@dataclass(frozen=True)
class ReferenceSpec:
    """Everything that decides the reference model; stored with it."""

    seed: int = 1234
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 384
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    context: int = 1024  # the model's max_position_embeddings
    train_context: int = 1024  # rows trained on; shorter rows give more optimizer steps per second
    answer_loss_weight: float = 1.0  # extra weight on multiple-choice answer letters (see ``pack``)
    batch_size: int = 4
    steps: int = 1100
    lr: float = 2e-3
    warmup: int = 40
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.02
    rope_theta: float = 10000.0
    docs: dict = field(default_factory=lambda: {"math": 7000, "exam": 11000, "qa": 2300, "facts": 10000, "code": 600, "drills": 4500})
    suites: dict = field(default_factory=lambda: {"gsm8k": 300, "mmlu": 400, "truthfulqa": 200})


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE that splits digits one by one (arithmetic needs stable number pieces).

    Encoding adds ``<s>`` in front, as documents start in training.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=1024)


def answer_positions(ids: list[int], tokenizer) -> list[int]:
    """Positions of multiple-choice answer letters: a `` A``..`` D`` token right after ``Answer:``."""
    letters = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(f" {x}"))[0] for x in "ABCD"}
    prefix = tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    n = len(prefix)
    return [i for i in range(n, len(ids)) if ids[i] in letters and ids[i - n:i] == prefix]


def pack(docs: list[str], tokenizer, context: int, answer_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents as ``<s> doc </s>`` concatenated and cut into rows of ``context`` tokens.

    Returns (tokens [N, context], loss weights [N, context]): 1 everywhere except ``answer_weight`` on
    the answer letters of multiple-choice items, which are one token in forty of an exam item. (Weighting
    them x10 alone did not make letter binding emerge within the CPU budget; the default keeps the plain
    loss.)
    """
    stream: list[int] = []
    weights: list[float] = []
    eos = tokenizer.eos_token_id
    for text in docs:
        ids = tokenizer(text)["input_ids"] + [eos]
        w = [1.0] * len(ids)
        for i in answer_positions(ids, tokenizer):
            w[i] = answer_weight
        stream += ids
        weights += w
    n = len(stream) // context
    return (torch.tensor(stream[: n * context], dtype=torch.long).view(n, context),
            torch.tensor(weights[: n * context]).view(n, context))


def weighted_lm_loss(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, each target token weighted; equals the plain mean when weights are 1."""
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                           reduction="none")
    w = weights[:, 1:].flatten()
    return (ce * w).sum() / w.sum()


def model_config(spec: ReferenceSpec, tokenizer):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k, max_position_embeddings=spec.context, tie_word_embeddings=False,
        router_aux_loss_coef=spec.router_aux_loss_coef, output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-style load-balancing loss averaged over layers: E * sum_e f_e * P_e, per layer.

    transformers' Mixtral loss pools the tokens of all layers, so one layer can starve an expert while
    another over-uses it; balancing each layer keeps every expert of every layer alive.
    """
    losses = []
    for logits in router_logits:  # [T, E] per layer
        probs = logits.float().softmax(dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        share = torch.zeros_like(probs).scatter_(1, chosen, 1.0).mean(dim=0) / top_k  # f_e, sums to 1
        losses.append(probs.shape[-1] * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def _lr(step: int, spec: ReferenceSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; the old one is removed only after the new one is complete."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def write_suites(out_dir: str | Path, spec: ReferenceSpec) -> None:
    """Write ``out_dir/suites/``: the held-out suites and the few-shot pools (deterministic from the seed)."""
    out_dir = Path(out_dir)
    suites, split = D.make_suites(spec.seed, spec.suites)
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".suites-"))
    tmp.chmod(0o755)
    for name, rows in (suites | D.fewshot_pools(spec.seed, split)).items():
        _write_jsonl(tmp / f"{name}.jsonl", rows)
    _replace_dir(tmp, out_dir / "suites")


def build_reference(out_dir: str | Path, spec: ReferenceSpec | None = None, device: str = "auto") -> dict:
    """Generate data, train, and write ``model/``, ``suites/`` and ``training.json`` under ``out_dir``."""
    from transformers import MixtralForCausalLM

    spec = spec or ReferenceSpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoeprepError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu or auto")
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.time()

    _suites, split = D.make_suites(spec.seed, spec.suites)
    docs = D.training_documents(spec.seed, split, spec.docs)
    rng = random.Random(spec.seed)
    tokenizer = build_tokenizer([t for _, t in rng.sample(docs, min(len(docs), 8000))], spec.vocab_size)
    tokens_per_domain = {d: 0 for d in D.DOMAINS}
    for domain, text in docs:
        tokens_per_domain[domain] += len(tokenizer(text)["input_ids"]) + 1
    data, loss_weights = pack([t for _, t in docs], tokenizer, spec.train_context, spec.answer_loss_weight)
    torch.manual_seed(spec.seed)
    config = model_config(spec, tokenizer)
    config.router_aux_loss_coef = 0.0  # transformers' pooled loss off; the per-layer one is added below
    model = MixtralForCausalLM(config).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(spec.seed))
    losses = []
    bar = tqdm(range(spec.steps), desc="train reference", mininterval=5)
    for step in bar:
        rows = [order[(step * spec.batch_size + i) % len(order)] for i in range(spec.batch_size)]
        batch = data[torch.stack(rows)].to(device)
        for group in opt.param_groups:
            group["lr"] = _lr(step, spec)
        out = model(input_ids=batch, output_router_logits=True)
        loss = weighted_lm_loss(out.logits, batch, loss_weights[torch.stack(rows)].to(device))
        balance = per_layer_balance_loss(out.router_logits, spec.top_k)
        (loss + spec.router_aux_loss_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = loss.item()
        losses.append(round(lm_loss, 4))
        bar.set_postfix(loss=f"{lm_loss:.3f}", balance=f"{balance.item():.3f}")
    model.eval()
    model.config.router_aux_loss_coef = spec.router_aux_loss_coef
    train_seconds = time.time() - started

    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".model-"))
    tmp.chmod(0o755)
    model.to("cpu").save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _replace_dir(tmp, out_dir / "model")
    write_suites(out_dir, spec)
    report = {
        "spec": asdict(spec),
        "device": device,
        "threads": torch.get_num_threads(),
        "train_seconds": round(train_seconds, 1),
        "sequences": len(data),
        "tokens_trained": spec.steps * spec.batch_size * spec.train_context,
        "tokens_per_domain": tokens_per_domain,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first_last": [losses[0], sum(losses[-20:]) / len(losses[-20:])],
        "loss_every_50": losses[::50],
    }
    tmp_file = out_dir / ".training.json.tmp"
    tmp_file.write_text(json.dumps(report, indent=2) + "\n")
    tmp_file.replace(out_dir / "training.json")
    return report
