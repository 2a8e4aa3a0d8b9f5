"""Model-agnostic scoring primitives: continuation log-likelihoods and greedy generation with stops.

Both follow lm-evaluation-harness: a continuation's tokens are what encoding ``context + continuation``
adds after the tokens of ``context``, its score is the sum of their log-probabilities; generation is
greedy and cut at the first stop string.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import StoppingCriteria, StoppingCriteriaList


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def loglikelihoods(model, tokenizer, context: str, continuations: list[str]) -> list[float]:
    """Sum of log-probabilities of each continuation after ``context`` (one padded batch)."""
    return batch_loglikelihoods(model, tokenizer, [(context, continuations)], batch_rows=len(continuations))[0]


class _StopOnText(StoppingCriteria):
    """Stop once the decoded continuation contains a stop string.

    transformers' own ``stop_strings`` precomputes a table over the whole vocabulary and fails on some
    tokenizers (byte-level vocabularies without a clean decode of every token); decoding the few new
    tokens each step is cheap and works for any tokenizer.
    """

    def __init__(self, tokenizer, start: int, stop: tuple[str, ...]):
        self.tokenizer, self.start, self.stop = tokenizer, start, stop

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        done = [any(s in t for s in self.stop) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int, stop: tuple[str, ...]) -> str:
    """Greedy continuation of ``prompt``, cut before the first stop string."""
    device = next(model.parameters()).device
    ids = torch.tensor([_encode(tokenizer, prompt)], device=device)
    criteria = StoppingCriteriaList([_StopOnText(tokenizer, ids.shape[1], stop)]) if stop else None
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, stopping_criteria=criteria, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    return text[:cut]


@torch.no_grad()
def batch_loglikelihoods(model, tokenizer, requests: list[tuple[str, list[str]]], batch_rows: int = 16
                         ) -> list[list[float]]:
    """``loglikelihoods`` for many (context, continuations) requests, several items per forward pass.

    Rows (one per continuation) are sorted by length and padded on the right in batches of
    ``batch_rows``; scores come back in request order.
    """
    rows = []  # (request index, choice index, token ids, continuation start)
    for r, (context, continuations) in enumerate(requests):
        context_ids = _encode(tokenizer, context)
        for c, continuation in enumerate(continuations):
            whole = _encode(tokenizer, context + continuation)
            split = len(context_ids)
            if whole[:split] != context_ids:
                split = max(i for i in range(len(context_ids) + 1) if whole[:i] == context_ids[:i])
            rows.append((r, c, whole, split))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][2]))
    scores = [[0.0] * len(conts) for _, conts in requests]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_rows):
        chunk = [rows[i] for i in order[start : start + batch_rows]]
        width = max(len(row[2]) for row in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (_, _, tokens, _) in enumerate(chunk):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            mask[i, : len(tokens)] = 1
        logprobs = F.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), -1)
        for i, (r, c, tokens, split) in enumerate(chunk):
            targets = ids[i, split : len(tokens)].to(device)
            scores[r][c] = logprobs[i, split - 1 : len(tokens) - 1].gather(-1, targets[:, None]).sum().item()
    return scores
