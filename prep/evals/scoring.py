"""Model-agnostic scoring primitives: continuation log-likelihoods and greedy generation with stops.

Both follow lm-evaluation-harness: a continuation's tokens are what encoding ``context + continuation``
adds after the tokens of ``context``, its score is the sum of their log-probabilities; generation is
greedy and cut at the first stop string.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


@torch.no_grad()
def loglikelihoods(model, tokenizer, context: str, continuations: list[str]) -> list[float]:
    """Sum of log-probabilities of each continuation after ``context`` (one padded batch)."""
    context_ids = _encode(tokenizer, context)
    rows, spans = [], []
    for continuation in continuations:
        whole = _encode(tokenizer, context + continuation)
        split = len(context_ids)
        if whole[:split] != context_ids:  # the join merged tokens across the boundary
            split = max(i for i in range(len(context_ids) + 1) if whole[:i] == context_ids[:i])
        rows.append(whole)
        spans.append((split, len(whole)))
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    logprobs = F.log_softmax(logits, dim=-1)
    scores = []
    for i, (start, end) in enumerate(spans):
        targets = ids[i, start:end].to(device)
        scores.append(logprobs[i, start - 1 : end - 1].gather(-1, targets[:, None]).sum().item())
    return scores


@torch.no_grad()
def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int, stop: tuple[str, ...]) -> str:
    """Greedy continuation of ``prompt``, cut before the first stop string."""
    device = next(model.parameters()).device
    ids = torch.tensor([_encode(tokenizer, prompt)], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, stop_strings=list(stop), tokenizer=tokenizer,
                         pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    return text[:cut]
