"""How far the prepared model's next-token distributions are from its source's, on held-out text, with error bars.

Per predicted position: KL(source || prepared) in nats, whether the two top tokens agree, and each model's negative
log-likelihood of the token that follows. Over a run: the mean KL, its 99th and 99.9th percentiles, the share of
agreeing top tokens, the perplexity of each model and their ratio. Each has a 95% interval from a percentile
bootstrap over sequences (tokens of one sequence are not independent, sequences are), bias-corrected and accelerated, as llama.cpp's
``perplexity --kl-divergence`` reports its figures with uncertainties. Far cheaper than the suites and far more
sensitive: a mean KL of a thousandth of a nat is resolved on a few thousand tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

LEVEL = 0.95
RESAMPLES = 2000
QUANTILES = {"kl_p99": 0.99, "kl_p999": 0.999}
STATS = ("mean_kl", "kl_p99", "kl_p999", "top_token_agreement", "ppl_source", "ppl_prepared", "ppl_ratio")
_CHUNK = 64  # positions per float64 softmax: bounded memory on a large vocabulary


@dataclass(frozen=True)
class SequenceDivergence:
    """One sequence's per-position figures (numpy arrays of one length: the predicted positions)."""

    kl: np.ndarray
    agree: np.ndarray
    nll_source: np.ndarray
    nll_prepared: np.ndarray


@torch.no_grad()
def token_divergence(source_logits: torch.Tensor, prepared_logits: torch.Tensor,
                     tokens: torch.Tensor) -> SequenceDivergence:
    """The figures of one sequence from both models' logits [T, V] over its tokens [T]: position t predicts t + 1.
    Computed in float64 so that a KL of 1e-6 is not rounding noise."""
    if source_logits.shape != prepared_logits.shape or source_logits.shape[0] != tokens.shape[0]:
        raise ValueError(f"logits {tuple(source_logits.shape)} and {tuple(prepared_logits.shape)} do not match "
                         f"{tokens.shape[0]} tokens")
    parts: list[tuple] = []
    targets = tokens[1:].to(torch.long).view(-1, 1).cpu()
    for start in range(0, tokens.shape[0] - 1, _CHUNK):
        end = min(start + _CHUNK, tokens.shape[0] - 1)
        src = torch.log_softmax(source_logits[start:end].cpu().double(), -1)
        got = torch.log_softmax(prepared_logits[start:end].cpu().double(), -1)
        kl = (src.exp() * (src - got)).sum(-1).clamp_min(0.0)  # >= 0 exactly; float error can dip below
        target = targets[start:end]
        parts.append((kl, src.argmax(-1) == got.argmax(-1), -src.gather(1, target)[:, 0], -got.gather(1, target)[:, 0]))
    kl, agree, nll_s, nll_p = (torch.cat(column).numpy() for column in zip(*parts, strict=True))
    return SequenceDivergence(kl, agree, nll_s, nll_p)


def _weighted_quantiles(order: np.ndarray, below: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per row of ``weights`` [draws, sequences]: the smallest value whose cumulative weight reaches ``q`` of the total
    (the inverted CDF), every token weighted by how many times its sequence was drawn. ``order``: the values sorted;
    ``below[s, k]``: how many of sequence s's tokens are among the first k + 1 sorted. A binary search over k for all
    draws at once: log2(tokens) steps of draws x sequences work, not draws x tokens."""
    reach = q * (weights @ below[:, -1]) * (1 - 1e-12)
    lo, hi = np.zeros(len(weights), np.int64), np.full(len(weights), below.shape[1] - 1, np.int64)
    rows = np.arange(len(weights))
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        enough = np.einsum("ds,sd->d", weights, below[:, mid]) >= reach[rows]
        hi, lo = np.where(enough, mid, hi), np.where(enough, lo, mid + 1)
    return order[lo]


def summarize(sequences: list[SequenceDivergence], resamples: int = RESAMPLES, level: float = LEVEL,
              seed: int = 0) -> dict:
    """Each figure of ``STATS`` with its ``level`` interval: {name: {"value", "low", "high"}}, plus the tokens and
    sequences it rests on. The interval is the BCa bootstrap over sequences (``resamples`` draws, seeded)."""
    if not sequences:
        raise ValueError("no sequences to summarize")
    n = len(sequences)
    count = np.array([len(s.kl) for s in sequences], dtype=np.float64)
    sums = {"kl": [s.kl.sum() for s in sequences], "agree": [s.agree.sum() for s in sequences],
            "nll_source": [s.nll_source.sum() for s in sequences],
            "nll_prepared": [s.nll_prepared.sum() for s in sequences]}
    sums = {k: np.array(v, dtype=np.float64) for k, v in sums.items()}
    values = np.concatenate([s.kl for s in sequences])
    sort = np.argsort(values, kind="stable")
    owner = np.repeat(np.arange(n), count.astype(np.int64))[sort]
    order = values[sort]
    below = np.zeros((n, len(values)), np.int32)
    below[owner, np.arange(len(values))] = 1
    np.cumsum(below, axis=1, out=below)

    def figures(weights: np.ndarray) -> dict[str, np.ndarray]:
        """Every figure for each row of sequence weights [rows, n]."""
        tokens = weights @ count
        mean = {k: (weights @ v) / tokens for k, v in sums.items()}
        return {"mean_kl": mean["kl"], "top_token_agreement": mean["agree"],
                "ppl_source": np.exp(mean["nll_source"]), "ppl_prepared": np.exp(mean["nll_prepared"]),
                "ppl_ratio": np.exp(mean["nll_prepared"] - mean["nll_source"])} | {
            name: _weighted_quantiles(order, below, weights, q) for name, q in QUANTILES.items()}

    point = figures(np.ones((1, n)))
    rng = np.random.default_rng(seed)
    draws = figures(np.stack([np.bincount(rng.integers(0, n, n), minlength=n) for _ in range(resamples)])
                    .astype(np.float64))
    leave_out = figures(1.0 - np.eye(n)) if n > 2 else None
    out: dict = {}
    for name in STATS:
        low, high = bca_interval(draws[name], float(point[name][0]), None if leave_out is None else leave_out[name],
                                 level)
        out[name] = {"value": float(point[name][0]), "low": low, "high": high}
    return {"stats": out, "tokens": int(count.sum()), "sequences": n, "level": level, "resamples": resamples}


def bca_interval(draws: np.ndarray, point: float, jackknife: np.ndarray | None, level: float = LEVEL) -> tuple:
    """The bias-corrected and accelerated (BCa, Efron 1987) interval from bootstrap ``draws`` of a statistic whose
    estimate is ``point``; ``jackknife``: its leave-one-sequence-out values (the acceleration; None: plain percentile
    with bias correction). The plain percentile interval covers a skewed mean too rarely at 16-32 sequences."""
    normal = NormalDist()
    below = (np.sum(draws < point) + 0.5 * np.sum(draws == point)) / len(draws)
    z0 = normal.inv_cdf(min(max(below, 1 / (len(draws) + 1)), len(draws) / (len(draws) + 1)))
    accel = 0.0
    if jackknife is not None:
        spread = jackknife.mean() - jackknife
        scale = float(np.sum(spread ** 2))
        accel = float(np.sum(spread ** 3)) / (6 * scale ** 1.5) if scale > 0 else 0.0
    ends = []
    for tail in ((1 - level) / 2, (1 + level) / 2):
        z = normal.inv_cdf(tail)
        ends.append(normal.cdf(z0 + (z0 + z) / (1 - accel * (z0 + z))))
    low, high = np.quantile(draws, ends)
    return float(low), float(high)


@torch.no_grad()
def logits_of(model, sequence: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float32, on the CPU) of one sequence through ``model``: the source or the loader's model."""
    device = next(model.parameters()).device
    return model(input_ids=sequence.view(1, -1).to(device), use_cache=False).logits[0].float().cpu()


@torch.no_grad()
def final_hidden(model, sequences: list[torch.Tensor], batch: int, progress=None) -> list[torch.Tensor]:
    """The last hidden states [T, H] (on the CPU) of each sequence through ``model``'s body, ``batch`` sequences of one
    length per forward: a streamed source reads each expert layer once per forward, and these are all it keeps of
    them. ``head_logits`` turns one into its logits, as the model's own forward does."""
    device, out = next(model.parameters()).device, []
    for start in range(0, len(sequences), max(1, batch)):
        chunk = sequences[start:start + max(1, batch)]
        groups = [chunk] if len({len(seq) for seq in chunk}) == 1 else [[seq] for seq in chunk]
        for group in groups:
            hidden = model.model(input_ids=torch.stack(group).to(device), use_cache=False).last_hidden_state
            out.extend(h.clone() for h in hidden.cpu().unbind(0))
        if progress is not None:
            progress(len(out), len(sequences))
    return out


@torch.no_grad()
def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (float32, on the CPU) of one sequence's last hidden states: the causal LM's head, the step every
    supported model's forward takes after its body."""
    device = next(model.parameters()).device
    return model.lm_head(hidden.to(device)).float().cpu()


def measure(source, prepared, sequences: list[torch.Tensor], resamples: int = RESAMPLES, seed: int = 0,
            progress=None, source_hidden: list[torch.Tensor] | None = None) -> dict:
    """``summarize`` of the prepared model against the source on ``sequences``, one sequence at a time (memory stays
    two sequences' logits); ``progress(i, n)`` after each sequence. ``source_hidden``: the source's ``final_hidden``
    of each sequence, computed before (a streamed source then holds no expert while the prepared model runs); the
    source's logits are its head of them. No wall time in it: what it returns lands in files that are a function of
    their inputs."""
    per_sequence = []
    for i, seq in enumerate(sequences):
        source_logits = logits_of(source, seq) if source_hidden is None else head_logits(source, source_hidden[i])
        per_sequence.append(token_divergence(source_logits, logits_of(prepared, seq), seq))
        if progress is not None:
            progress(i + 1, len(sequences))
    summary = summarize(per_sequence, resamples=resamples, seed=seed)
    return summary
