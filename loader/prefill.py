"""Prefill: a prompt through the offloaded model in chunks, each MoE layer reading each needed expert once per
chunk, inside the memory budget.

A long prompt is run as chunks of at most the plan's ``prefill.chunk`` tokens, each one forward with the KV cache
of the chunks before it. Within a chunk every MoE layer reads each expert its tokens need once, computes all of
that expert's tokens, and reads the next experts while it computes (``loader/step.py``): a larger chunk shares
each read among more tokens, a smaller one bounds the activations.

The budget counts the activations (``prefill_reserve``): the working memory of one chunk attending to the plan's
``prefill.context`` tokens (at most the model's context), plus the read buffers of the prefill forms. The chunk is
the plan's ``prefill.chunk`` where its activations take at most ``RESERVE_SHARE`` of the budget's room for experts,
else the largest that does (at least one token): a small budget keeps its cache and prefills in smaller chunks. A
chunk later in a long prompt attends to more tokens; it is cut to fit the reserve (``chunk_sizes``), and a prompt
whose next token alone no longer fits is refused before anything runs, with the numbers.

The prefill form (``PrefillForm``): at a large token count the held form may not be the fastest kernel (torch's
int4pack product on a CPU is slower per token than a float32 product of the decoded matrices past a few dozen
tokens). The planner compares the forms on the device profile (``moeprep profile-device``) and writes, per
precision, a form and the tokens of one expert from which it pays (``plan.prefill.forms``); a miss of a prefill
chunk with that many tokens is read into a prefill buffer in that form, used for the chunk, not cached. Hits
compute with their held form. Nothing is timed at load: the same plan gives the same choice on every load.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

from loader.errors import BudgetError

DEFAULT_CHUNK = 512  # tokens per prefill chunk where the plan does not say (the budget may cut it)
DEFAULT_CONTEXT = 2048  # the context a chunk's reserve is sized for where the plan does not say
SCORE_BYTES = 4  # attention scores, float32
SCORE_BLOCK = 512  # keys per block of torch's fused CPU attention (its scores never span the whole context)
STREAM_COPIES = 4  # live [T, H] tensors of the residual stream at a layer's peak: residual, normed, output, sum
RESERVE_SHARE = 1 / 8  # the most of the room for experts a prefill chunk's activations take (below the plan's chunk)


@dataclass(frozen=True)
class ActivationShape:
    """What the activation arithmetic needs to know of a model."""

    hidden: int
    intermediate: int  # one expert's intermediate width
    heads: int
    q_width: int  # heads x head_dim
    kv_width: int  # key-value heads x head_dim
    vocab: int
    top_k: int
    dtype_bytes: int
    max_context: int = 0  # the model's context (0: not stated)
    eager: bool = False  # attention materializes every score ("eager"), not torch's fused kernel ("sdpa")

    def context(self, wanted: int) -> int:
        """``wanted`` tokens of context, at most the model's."""
        return min(wanted, self.max_context) if self.max_context else wanted


def activation_shape(config: dict, intermediate: int, top_k: int, dtype_bytes: int) -> ActivationShape:
    """From a model's ``config.json`` (its text config where it has one), one expert's intermediate width (from the
    store's record layout), top-k and the activations' element size."""
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    context = text.get("max_position_embeddings")
    attention = config.get("_attn_implementation") or config.get("attn_implementation") or "sdpa"
    return ActivationShape(hidden, int(intermediate), heads, heads * head_dim, kv_heads * head_dim,
                           int(text.get("vocab_size") or 0), int(top_k), int(dtype_bytes),
                           context if isinstance(context, int) and context > 0 else 0, attention == "eager")


def activation_bytes(shape: ActivationShape, chunk: int, context: int) -> int:
    """An upper estimate of the working memory of one forward of ``chunk`` new tokens attending to ``context``
    tokens (KV cache excluded, as for decode): the residual stream, then the larger of the attention step (queries,
    keys, values, output, the causal mask, and the scores: every head's over the whole context for eager
    attention, one block of keys per query for the fused kernel) and the MoE step (router, one expert's
    intermediate for every token, its output), and the last token's logits."""
    t, d = chunk, shape.dtype_bytes
    stream = STREAM_COPIES * t * shape.hidden * d
    scores = 2 * t * shape.heads * context * SCORE_BYTES if shape.eager else t * min(context, SCORE_BLOCK) * SCORE_BYTES
    attention = t * (2 * shape.q_width + 2 * shape.kv_width) * d + t * context + scores
    moe = t * shape.top_k * 16 + t * (3 * shape.intermediate + shape.hidden) * d
    return stream + max(attention, moe) + shape.vocab * 4


@dataclass(frozen=True)
class PrefillForm:
    """A precision's prefill form: ``form`` (a held form name) for an expert given at least ``from_tokens`` tokens
    in one chunk."""

    form: str
    from_tokens: int

    def to_json(self) -> dict:
        return {"form": self.form, "from_tokens": self.from_tokens}


@dataclass(frozen=True)
class PrefillSpec:
    """The plan's prefill values (``Plan.prefill``): the chunk, the context its reserve is sized for, and the
    prefill forms per precision."""

    chunk: int = DEFAULT_CHUNK
    context: int = DEFAULT_CONTEXT
    forms: tuple = ()  # ((precision, PrefillForm), ...)

    def form_for(self, precision: str) -> PrefillForm | None:
        return dict(self.forms).get(precision)

    def to_json(self) -> dict:
        return {"chunk": self.chunk, "context": self.context,
                "forms": {p: f.to_json() for p, f in self.forms}}


MAX_CHUNK = 1 << 20


def parse_prefill(raw, bad, precisions, form_names) -> PrefillSpec:
    """The plan's ``prefill`` object checked (``bad(what)`` makes the plan's error)."""
    if not isinstance(raw, dict) or not set(raw) <= {"chunk", "context", "forms"}:
        raise bad("prefill must be {chunk, context, forms}")

    def count(key, default):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHUNK:
            raise bad(f"prefill.{key} must be a number of tokens from 1 to {MAX_CHUNK}, got {value!r}")
        return value

    chunk, context = count("chunk", DEFAULT_CHUNK), count("context", DEFAULT_CONTEXT)
    forms = raw.get("forms", {})
    if not isinstance(forms, dict):
        raise bad("prefill.forms must map precisions to {form, from_tokens}")
    out = []
    for p, f in sorted(forms.items()):
        if (p not in precisions or not isinstance(f, dict) or set(f) != {"form", "from_tokens"}
                or f["form"] not in form_names or isinstance(f["from_tokens"], bool)
                or not isinstance(f["from_tokens"], int) or not 1 <= f["from_tokens"] <= MAX_CHUNK):
            raise bad(f"prefill.forms[{p!r}] must be {{form: one of {list(form_names)}, from_tokens: 1 to "
                      f"{MAX_CHUNK}}} for a precision of {list(precisions)}")
        out.append((p, PrefillForm(f["form"], f["from_tokens"])))
    return PrefillSpec(chunk, context, tuple(out))


def reserve_context(shape: ActivationShape, spec: PrefillSpec) -> int:
    """The context a chunk's reserve is sized for: the plan's, at most the model's."""
    return shape.context(spec.context)


def smallest_reserve(shape: ActivationShape, spec: PrefillSpec) -> int:
    """The activations of a one-token chunk at the reserve's context: what the smallest budget keeps."""
    return activation_bytes(shape, 1, reserve_context(shape, spec))


def prefill_reserve(shape: ActivationShape, spec: PrefillSpec, allowance: float) -> tuple[int, int]:
    """(chunk, bytes): the largest chunk up to the plan's whose activations at the reserve's context take at most
    ``allowance`` bytes (inf: unlimited), at least one token, and those activations' bytes. The budget allows
    ``RESERVE_SHARE`` of its room for experts, less what the pools need (``loader.budget.capacities``)."""
    context = reserve_context(shape, spec)
    lo, hi = 1, spec.chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if activation_bytes(shape, mid, context) <= allowance else (lo, mid - 1)
    return lo, activation_bytes(shape, lo, context)


def chunk_sizes(shape: ActivationShape, reserve: int, cap: int, prompt: int, past: int = 0) -> list[int]:
    """The chunks of a ``prompt``-token forward after ``past`` cached tokens: each the largest up to ``cap`` whose
    activations fit ``reserve`` bytes. A position where one token alone does not fit is a BudgetError with the
    numbers (raised before anything runs)."""
    sizes, done = [], past
    while done < past + prompt:
        if activation_bytes(shape, 1, done + 1) > reserve:
            raise BudgetError(
                f"the prompt of {prompt} tokens does not fit the memory budget: at token {done + 1} even a chunk of "
                f"one token needs {activation_bytes(shape, 1, done + 1):,} bytes of activations (attending to "
                f"{done + 1} tokens) and the budget keeps {reserve:,} bytes for them (the plan's prefill context is "
                "smaller); shorten the prompt or raise the memory budget")
        lo, hi = 1, min(cap, past + prompt - done)
        while lo < hi:  # the largest chunk that fits (activations grow with the chunk)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if activation_bytes(shape, mid, done + mid) <= reserve else (lo, mid - 1)
        sizes.append(lo)
        done += lo
    return sizes


@dataclass
class PrefillResult:
    """One prefill: the logits (the last token's [1, V], or every token's [T, V]), the KV cache to decode from, its
    seconds (the time to the first token's logits) and its chunks."""

    logits: object  # torch.Tensor
    cache: object
    seconds: float
    chunks: list

    @property
    def tokens(self) -> int:
        return sum(self.chunks)

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "chunks": len(self.chunks), "largest_chunk": max(self.chunks)}


def prefill(loaded, ids, chunk: int | None = None, all_logits: bool = False) -> PrefillResult:
    """Run the prompt ``ids`` [1, T] through ``loaded`` (``loader.runtime.LoadedModel``) in chunks of at most
    ``chunk`` tokens (None: the plan's), starting a new sequence. The chunks are fixed (and a prompt that cannot fit
    refused) before the first runs."""
    import torch
    from transformers import DynamicCache

    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise BudgetError(f"prefill takes one prompt of at least one token as [1, T] ids, got {tuple(ids.shape)}")
    engine = loaded.runtime
    cap = chunk if chunk is not None else engine.prefill_chunk
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise BudgetError(f"prefill chunk {chunk!r} must be a positive number of tokens")
    if engine.activation_shape is None:
        sizes = [min(cap, ids.shape[1] - start) for start in range(0, ids.shape[1], cap)]
    else:
        sizes = chunk_sizes(engine.activation_shape, engine.activation_reserve, cap, ids.shape[1])
    cache = DynamicCache(config=loaded.model.config)
    # transformers 5.24 names the KV cache ``cache``, earlier versions ``past_key_values``
    name = "cache" if "cache" in inspect.signature(loaded.model.forward).parameters else "past_key_values"
    kept, done = [], 0
    start = time.perf_counter()
    engine.prefilling = True
    try:
        with torch.no_grad():
            for size in sizes:
                out = loaded.model(input_ids=ids[:, done:done + size], use_cache=True,
                                   logits_to_keep=0 if all_logits else 1, **{name: cache})
                cache = getattr(out, name)
                kept.append(out.logits[0] if all_logits else out.logits[0, -1:])
                done += size
    finally:
        engine.prefilling = False
    logits = torch.cat(kept) if all_logits else kept[-1]
    result = PrefillResult(logits, cache, time.perf_counter() - start, sizes)
    loaded.last_prefill = result
    return result


def decode(loaded, ids, max_new_tokens: int, streamer=None) -> tuple[list[int], float]:
    """Greedy generation: the prompt prefilled in chunks (``LoadedModel.prefill``: the first token from its
    logits), then ``generate`` from its KV cache. Returns the new token ids and the seconds after the first."""
    import torch

    with torch.no_grad():
        result = loaded.prefill(ids)
        first = result.logits[-1].argmax().view(1, 1).to(ids.device)
        if streamer is not None:
            streamer.next_tokens_are_prompt = False
            streamer.put(first[0])
            streamer.next_tokens_are_prompt = True  # generate's first put is the prompt again: skipped
        eos = loaded.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        if max_new_tokens == 1 or first.item() in eos:
            if streamer is not None:
                streamer.end()
            return [first.item()], 0.0
        whole = torch.cat([ids, first], dim=1)
        start = time.perf_counter()
        out = loaded.model.generate(input_ids=whole, attention_mask=torch.ones_like(whole), do_sample=False,
                                    max_new_tokens=max_new_tokens - 1, streamer=streamer,
                                    pad_token_id=loaded.tokenizer.pad_token_id, **{cache_argument(loaded.model): result.cache})
        seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds


def cache_argument(model) -> str:
    """The name the model's forward gives its KV cache: ``cache`` (transformers 5.24), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
