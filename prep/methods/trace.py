"""Routing traces: what the router of every MoE layer saw and decided, token by token.

Every later stage feeds on these. Path statistics, cache-policy tuning and the allocator need only
the routing (which experts, with what weights); the next-layer-gate prefetcher needs the router
inputs; the first-layer predictive gate (AdapMoE) needs each token's last-layer hidden state.

- `RoutingTrace`: the in-memory routing of one sequence, expert_ids / expert_weights [T, L, K].
- `RoutingRecorder`: forward hooks on the adapter's router modules (and the last decoder layer)
  that capture one forward pass; nothing in the model is patched.
- `record_traces`: runs a model over token sequences and streams the captures to a trace
  directory: safetensors shards of a fixed number of token rows plus `index.json`. The directory is
  built under a temporary name and renamed when complete; the index is written last, so a trace
  directory with an index is complete. Its two halves serve the stage's work units too: `capture_batch`
  (one forward's rows; a unit per forward, split by `batch_ranges`) and `write_trace` (the rows, in
  sequence order, cut into shards).
- `RecordedTrace` (`open_trace`): reads a trace directory back, the routing as RoutingTrace
  objects, hidden states and logits one layer at a time. Everything it reads is validated in one home, as the
  loader validates an artifact (``loader/format.py``): ``check_index`` types and bounds every key of the index
  before anything is allocated (at most ``MAX_EXPERTS`` experts per layer, 1 <= top_k <= experts, a positive
  hidden size, at least one token, shards that add up), and ``check_shard_tensor`` each routing tensor as a
  shard is read (int64 expert ids in [0, E), finite float32 weights and logits, [rows, K] / [rows, E]). Every
  failure is one ``MoeprepError`` naming the file, the field and the fix (``RECORD_AGAIN``).
- `read_mixtral_traces`: the real Mixtral-8x7B GSM8K decode traces of `../shared/data/traces` as
  RoutingTrace objects; every record is checked (whole ids in range, finite gating probabilities, one K)
  and a bad one is a ``MoeprepError`` naming the file and line.

"Last-layer hidden state" is the output of the last decoder layer BEFORE the model's final norm
(the raw residual stream): it carries strictly more information than the normed state, which is a
fixed per-token function of it, and a gate trained on it can learn the scale itself.

Shard tensors, per token row (rows of all sequences concatenated in order; a sequence may span
shards): `token_ids` [T] int64, `last_hidden` [T, H], and for every MoE layer l (model layer index)
`layers.{l}.router_input` [T, H], `layers.{l}.router_logits` [T, E] float32, `layers.{l}.expert_ids`
[T, K] int64, `layers.{l}.expert_weights` [T, K] float32, and `head_input` [T, H]: the LM head's input (the
final-normed last hidden state, what the first-layer gate reads at run time; traces recorded before it
was added lack it). Hidden states are float32 or float16.

Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from loader.io import building_directory, write_json_atomic
from prep.adapters import MoeAdapter, get_adapter
from prep.errors import MoeprepError

TRACE_FORMAT = "moeprep-trace"
TRACE_VERSION = 1
INDEX_NAME = "index.json"
LAST_HIDDEN = "pre_final_norm"  # which hidden state `last_hidden` is, recorded in the index
# Bounds on what an index may declare, checked before anything proportional to them is allocated: the largest
# released MoE models have a few hundred experts per layer (DeepSeek-V3 256, Qwen3 128), so 65536 leaves room for
# any fine-grained design while refusing a damaged count (10**12) that would allocate per-expert tables.
MAX_EXPERTS = 65536  # experts per MoE layer
MAX_HIDDEN = 1 << 20  # hidden size
MAX_INDEX_BYTES = 256 << 20  # an index.json larger than this is not one moeprep wrote
RECORD_AGAIN = "record the trace again (`moeprep prepare --force trace --until trace` rewrites stages/trace-*/trace)"


@dataclass(frozen=True)
class RoutingTrace:
    """The routing of one token sequence.

    expert_ids: [T, L, K] int64, the selected experts of each token at each traced layer, heaviest
    first (``canonical_order``). expert_weights: [T, L, K] float32, their combination weights.
    layers: the model layer index of each of the L traced layers (None when unknown).
    """

    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.expert_ids.dim() != 3 or self.expert_ids.shape != self.expert_weights.shape:
            raise ValueError(
                f"expert_ids and expert_weights must both be [T, L, K], got "
                f"{tuple(self.expert_ids.shape)} and {tuple(self.expert_weights.shape)}"
            )
        if self.expert_ids.dtype != torch.int64 or self.expert_weights.dtype != torch.float32:
            raise ValueError("expert_ids must be int64 and expert_weights float32")
        if self.layers is not None and len(self.layers) != self.expert_ids.shape[1]:
            raise ValueError(f"{len(self.layers)} layer ids for {self.expert_ids.shape[1]} traced layers")

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[2]


# --- capturing --------------------------------------------------------------------------------


def canonical_order(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, weights [..., K] with each row's selections heaviest first, equal weights by expert id. A router's
    own slot order is not a decision (DeepSeek-V2 takes ``topk(sorted=False)``, whose order differs between
    CPU and CUDA), so a trace records this one and is the same on every device."""
    by_id = ids.argsort(dim=-1, stable=True)
    ids, weights = ids.gather(-1, by_id), weights.gather(-1, by_id)
    by_weight = weights.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, by_weight), weights.gather(-1, by_weight)


class RoutingRecorder:
    """Context manager capturing the routing of every MoE layer during forward passes.

    Registers forward hooks on the adapter's router modules (input = the MoE block input, output
    = logits, weights, experts) and on the last decoder layer. After one or more forward passes,
    `pop()` returns and clears what was captured, tokens in row-major (batch, position) order.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: MoeAdapter | None = None,
        *,
        record_hidden: bool = True,
        hidden_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.adapter = adapter or get_adapter(model)
        self.record_hidden = record_hidden
        self.hidden_dtype = hidden_dtype
        self._handles: list = []
        self._captured: dict[str, list[torch.Tensor]] = defaultdict(list)

    def _keep(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self._captured[name].append(tensor.detach().to("cpu", dtype=dtype or tensor.dtype))

    def _router_hook(self, layer: int):
        hidden_size = self.adapter.hidden_size

        def hook(module, args, output):
            logits, ids, weights = self.adapter.unpack_router_output(output)
            ids, weights = canonical_order(ids, weights)
            if self.record_hidden:
                self._keep(
                    f"layers.{layer}.router_input", args[0].reshape(-1, hidden_size), self.hidden_dtype
                )
            self._keep(f"layers.{layer}.router_logits", logits.reshape(-1, logits.shape[-1]), torch.float32)
            self._keep(f"layers.{layer}.expert_ids", ids.reshape(-1, ids.shape[-1]), torch.int64)
            self._keep(
                f"layers.{layer}.expert_weights", weights.reshape(-1, weights.shape[-1]), torch.float32
            )

        return hook

    def _last_layer_hook(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        self._keep("last_hidden", hidden.reshape(-1, hidden.shape[-1]), self.hidden_dtype)

    def _head_hook(self, module, args):
        self._keep("head_input", args[0].reshape(-1, args[0].shape[-1]), self.hidden_dtype)

    def _norm_hook(self, module, args, output):
        self._keep("head_input", output.reshape(-1, output.shape[-1]), self.hidden_dtype)

    @property
    def final_norm(self) -> nn.Module | None:
        """The base model's final norm, whose output is the LM head's input at every position (None where the
        model has no ``norm``): hooking it lets a forward skip the logits (``logits_to_keep=1``)."""
        norm = getattr(self.model.base_model, "norm", None)
        return norm if isinstance(norm, nn.Module) else None

    def __enter__(self) -> RoutingRecorder:
        for layer in self.adapter.moe_layers:
            router = self.adapter.router(self.model, layer)
            self._handles.append(router.register_forward_hook(self._router_hook(layer)))
        if self.record_hidden:
            last = self.adapter.decoder_layers(self.model)[-1]
            self._handles.append(last.register_forward_hook(self._last_layer_hook))
            if self.final_norm is not None:
                self._handles.append(self.final_norm.register_forward_hook(self._norm_hook))
            else:
                self._handles.append(self.model.get_output_embeddings().register_forward_pre_hook(self._head_hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def pop(self) -> dict[str, torch.Tensor]:
        """The captured tensors by shard tensor name (see module docstring), cleared afterwards."""
        out = {name: torch.cat(parts) for name, parts in self._captured.items()}
        self._captured.clear()
        return out


# --- writing ---------------------------------------------------------------------------------


class _ShardWriter:
    """Buffers token rows and writes them as shards of exactly `shard_tokens` rows (the last one shorter)."""

    def __init__(self, directory: Path, shard_tokens: int) -> None:
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.buffer: dict[str, torch.Tensor] = {}
        self.shards: list[dict] = []

    def _rows(self) -> int:
        return next(iter(self.buffer.values())).shape[0] if self.buffer else 0

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        if self.buffer and set(rows) != set(self.buffer):
            raise MoeprepError("trace capture changed tensors between sequences")
        self.buffer = {
            name: torch.cat([self.buffer[name], t]) if self.buffer else t for name, t in rows.items()
        }
        while self._rows() >= self.shard_tokens:
            self._write(self.shard_tokens)

    def _write(self, n: int) -> None:
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file({k: v[:n].contiguous() for k, v in self.buffer.items()}, str(self.directory / name))
        self.shards.append({"file": name, "tokens": n})
        self.buffer = {k: v[n:] for k, v in self.buffer.items()}

    def finish(self) -> list[dict]:
        if self._rows():
            self._write(self._rows())
        return self.shards


def _write_json_atomic(path: Path, obj: dict) -> None:
    write_json_atomic(path, obj)


def _batches(sequences: Iterable[torch.Tensor], batch: int):
    """Lists of up to ``batch`` consecutive sequences of equal length (1-D int64 tensors)."""
    if batch < 1:
        raise MoeprepError(f"trace.batch must be at least 1, got {batch}")
    group: list[torch.Tensor] = []
    for i, seq in enumerate(sequences):
        seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        if seq.numel() == 0:
            raise MoeprepError(f"sequence {i} is empty")
        if group and (len(group) == batch or seq.numel() != group[0].numel()):
            yield group
            group = []
        group.append(seq)
    if group:
        yield group


def batch_ranges(sequences: list[torch.Tensor], batch: int) -> list[tuple[int, int]]:
    """The [start, stop) of each forward ``record_traces`` runs over ``sequences`` (its batching rule), so work
    split by these ranges runs the very forwards one ``record_traces`` call runs."""
    ranges, start = [], 0
    for group in _batches(sequences, batch):
        ranges.append((start, start + len(group)))
        start += len(group)
    return ranges


@torch.no_grad()
def capture_batch(model: nn.Module, adapter: MoeAdapter, group: list[torch.Tensor], *, record_hidden: bool = True,
                  hidden_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One forward of ``group`` (sequences of one length): the shard tensors of its token rows, in (sequence,
    position) order, ``token_ids`` last."""
    model.eval()
    device = next(model.parameters()).device
    recorder = RoutingRecorder(model, adapter, record_hidden=record_hidden, hidden_dtype=hidden_dtype)
    with recorder:
        # logits over the vocabulary ([batch, T, V] float32, GBs for a big batch) are not traced
        skip_logits = {"logits_to_keep": 1} if recorder.final_norm is not None else {}
        model(input_ids=torch.stack(group).to(device), use_cache=False, **skip_logits)
        rows = recorder.pop()  # (batch, position) order: the sequences one after another
    rows["token_ids"] = torch.cat(group).cpu()
    return rows


def write_trace(out_dir: str | Path, captures: Iterable[tuple[list[int], dict[str, torch.Tensor]]], *,
                adapter: MoeAdapter, shard_tokens: int = 4096, record_hidden: bool = True,
                hidden_dtype: torch.dtype = torch.float16, fingerprint: str | None = None) -> Path:
    """Write a trace directory from ``captures``: (the sequence lengths, ``capture_batch``'s rows) per forward,
    in sequence order. The shards cut the concatenated rows every ``shard_tokens`` rows wherever the forwards
    ended, so the files depend on the rows only, not on how the forwards were split or where they ran."""
    out_dir = Path(out_dir)
    if shard_tokens < 1:
        raise MoeprepError(f"shard_tokens must be positive, got {shard_tokens}")
    with building_directory(out_dir) as tmp:
        writer = _ShardWriter(tmp, shard_tokens)
        lengths: list[int] = []
        for group_lengths, rows in captures:
            lengths += group_lengths
            writer.add(rows)
        if not lengths:
            raise MoeprepError("no sequences to trace")
        tensors = {
            name: {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in writer.buffer.items()
        }
        shards = writer.finish()
        index = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "model_fingerprint": fingerprint,
            "architecture": adapter.model_type,
            "layers": adapter.moe_layers,
            "num_experts": adapter.num_experts,
            "top_k": adapter.top_k,
            "hidden_size": adapter.hidden_size,
            "hidden_dtype": str(hidden_dtype).removeprefix("torch.") if record_hidden else None,
            "last_hidden": LAST_HIDDEN if record_hidden else None,
            "tensors": tensors,  # name -> shape per token row, dtype
            "sequence_tokens": lengths,
            "total_tokens": sum(lengths),
            "shards": shards,
        }
        _write_json_atomic(tmp / INDEX_NAME, index)  # last: its presence marks a complete trace
    return out_dir


def record_traces(
    model: nn.Module,
    sequences: Iterable[torch.Tensor],
    out_dir: str | Path,
    *,
    adapter: MoeAdapter | None = None,
    shard_tokens: int = 4096,
    record_hidden: bool = True,
    hidden_dtype: torch.dtype = torch.float16,
    fingerprint: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    batch: int = 1,
) -> Path:
    """Run `model` over token sequences and write their routing traces to `out_dir`.

    model: a loaded MoE `*ForCausalLM` (eval mode is enforced). sequences: 1-D LongTensors of token
    ids, run ``batch`` at a time (no KV cache); consecutive sequences of one length share a forward. A
    streamed model (``prep/streaming.py``) reads each MoE layer once per forward, so a batch of every
    sequence runs the model layer by layer with the activations held between layers. shard_tokens: token rows per shard, which bounds
    memory. record_hidden: also store router inputs and last-layer hidden states (in hidden_dtype).
    fingerprint: an identifier of the model, copied into the index. Returns the trace directory.
    The stage ``trace`` runs the same forwards as work units (``capture_batch`` each, ``write_trace`` merging).
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise MoeprepError(f"trace directory {out_dir} already exists; remove it or pass overwrite=True")
    adapter = adapter or get_adapter(model)
    groups = tqdm(_batches(sequences, batch), desc="trace", unit="batch", disable=not progress)
    captures = (([seq.numel() for seq in group], capture_batch(model, adapter, group, record_hidden=record_hidden,
                                                              hidden_dtype=hidden_dtype)) for group in groups)
    return write_trace(out_dir, captures, adapter=adapter, shard_tokens=shard_tokens, record_hidden=record_hidden,
                       hidden_dtype=hidden_dtype, fingerprint=fingerprint)


def write_routing_trace(traces: list[RoutingTrace], out_dir: str | Path, *, layers: list[int], num_experts: int,
                        architecture: str, source: dict, fingerprint: str | None = None,
                        shard_tokens: int = 4096) -> Path:
    """A trace directory holding only routing (``layers.{l}.expert_ids`` / ``expert_weights``), one sequence per
    RoutingTrace: recorded decisions imported instead of a forward pass (the real Mixtral traces on a model of
    Mixtral's shape whose random weights do not decide its routing). ``source`` (what was imported) goes into the
    index; readers of hidden states or logits get ``RecordedTrace``'s clear error, since none are recorded."""
    out_dir = Path(out_dir)
    if not traces:
        raise MoeprepError("no recorded sequences to write")
    with building_directory(out_dir) as tmp:
        writer = _ShardWriter(tmp, shard_tokens)
        for trace in traces:
            if trace.num_layers != len(layers):
                raise MoeprepError(f"a recorded sequence has {trace.num_layers} layers, the trace {len(layers)}")
            ids, weights = canonical_order(trace.expert_ids, trace.expert_weights)
            rows = {}
            for i, layer in enumerate(layers):
                rows[f"layers.{layer}.expert_ids"] = ids[:, i].contiguous()
                rows[f"layers.{layer}.expert_weights"] = weights[:, i].contiguous()
            writer.add(rows)
        tensors = {name: {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}
                   for name, t in rows.items()}
        shards = writer.finish()
        lengths = [t.num_tokens for t in traces]
        _write_json_atomic(tmp / INDEX_NAME, {
            "format": TRACE_FORMAT, "version": TRACE_VERSION, "model_fingerprint": fingerprint,
            "architecture": architecture, "layers": list(layers), "num_experts": num_experts,
            "top_k": traces[0].top_k, "hidden_size": None, "hidden_dtype": None, "last_hidden": None,
            "tensors": tensors, "sequence_tokens": lengths, "total_tokens": sum(lengths), "shards": shards,
            "recorded": source})
    return out_dir


# --- validation ------------------------------------------------------------------------------


def _whole(x) -> bool:
    """A JSON whole number: an int that is not a bool (1.0, 1.5, Infinity and true are not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _shown(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_index(index, path: str | Path) -> dict:
    """The index of a trace directory, every key typed and bounded before anything is allocated from it.

    path: the ``index.json`` (named in messages). Checks: format and version; ``layers`` a non-empty list of
    distinct layer indices; ``num_experts`` a whole number 1..MAX_EXPERTS; ``top_k`` a whole number
    1..num_experts; ``hidden_size`` null or a whole number 1..MAX_HIDDEN; ``tensors`` a mapping of name to
    {shape, dtype}, with ``layers.{l}.expert_ids`` / ``expert_weights`` of shape [top_k] for every layer;
    ``sequence_tokens`` whole numbers >= 0 adding up to ``total_tokens`` >= 1; ``shards`` a non-empty list of
    {file: a plain file name, tokens: >= 1} adding up to ``total_tokens``. Returns the index.
    """
    path = Path(path)

    def fail(what: str) -> MoeprepError:
        return MoeprepError(f"{path}: {what}; {RECORD_AGAIN}")

    if not isinstance(index, dict):
        raise fail(f"the index must be a JSON object, got {_shown(index)}")
    if index.get("format") != TRACE_FORMAT or index.get("version") != TRACE_VERSION:
        raise MoeprepError(
            f"{path}: format {_shown(index.get('format'))} version {_shown(index.get('version'))} is not "
            f"{TRACE_FORMAT!r} version {TRACE_VERSION}, which this moeprep reads; {RECORD_AGAIN}"
        )
    for key in ("layers", "num_experts", "top_k", "tensors", "sequence_tokens", "total_tokens", "shards"):
        if key not in index:
            raise fail(f"the key {key!r} is missing")
    layers = index["layers"]
    if not isinstance(layers, list) or not layers or not all(_whole(x) and x >= 0 for x in layers) \
            or len(set(layers)) != len(layers):
        raise fail(f"layers must be a non-empty list of distinct layer indices (whole numbers >= 0), got "
                   f"{_shown(layers)}")
    experts = index["num_experts"]
    if not _whole(experts) or not 1 <= experts <= MAX_EXPERTS:
        raise fail(f"num_experts must be a whole number of experts per layer from 1 to {MAX_EXPERTS}, got "
                   f"{_shown(experts)}")
    top_k = index["top_k"]
    if not _whole(top_k) or not 1 <= top_k <= experts:
        raise fail(f"top_k must be a whole number of experts per token from 1 to num_experts ({experts}), got "
                   f"{_shown(top_k)}")
    hidden = index.get("hidden_size")
    if hidden is not None and (not _whole(hidden) or not 1 <= hidden <= MAX_HIDDEN):
        raise fail(f"hidden_size must be null or a whole number from 1 to {MAX_HIDDEN}, got {_shown(hidden)}")
    tensors = index["tensors"]
    if not isinstance(tensors, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)
            for v in tensors.values()):
        raise fail("tensors must map each tensor name to {shape: [...], dtype: ...}")
    for layer in layers:
        for name in (f"layers.{layer}.expert_ids", f"layers.{layer}.expert_weights"):
            if name not in tensors:
                raise fail(f"tensors lacks {name!r}, the routing of traced layer {layer}")
            if tensors[name]["shape"] != [top_k]:
                raise fail(f"tensors[{name!r}] has shape {_shown(tensors[name]['shape'])} per token, not "
                           f"[top_k] = [{top_k}]")
    lengths, total = index["sequence_tokens"], index["total_tokens"]
    if not isinstance(lengths, list) or not all(_whole(n) and n >= 0 for n in lengths):
        raise fail(f"sequence_tokens must be a list of token counts (whole numbers >= 0), got {_shown(lengths)}")
    if not _whole(total) or total != sum(lengths):
        raise fail(f"total_tokens {_shown(total)} is not the sum of sequence_tokens ({sum(lengths)})")
    if total < 1:
        raise fail("the trace holds no tokens (sequence_tokens is empty or all zero): there is nothing to read")
    shards = index["shards"]
    if not isinstance(shards, list) or not shards:
        raise fail(f"shards must be a non-empty list, got {_shown(shards)}")
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) or not _whole(shard.get("tokens")) \
                or shard["tokens"] < 1:
            raise fail(f"shards[{i}] must be {{file: a file name, tokens: a whole number >= 1}}, got {_shown(shard)}")
        file = shard["file"]
        if not file or file != Path(file).name or file in (".", "..") or "\\" in file:
            raise fail(f"shards[{i}].file {_shown(file)} must be a plain file name inside the trace directory")
    if (rows := sum(s["tokens"] for s in shards)) != total:
        raise fail(f"the shards hold {rows} token rows, total_tokens says {total}")
    return index


def check_shard_tensor(name: str, tensor: torch.Tensor, file: str | Path, index: dict, rows: int) -> None:
    """One shard's part of tensor ``name`` as read: ``rows`` token rows, and for the routing tensors their
    content. ``layers.{l}.expert_ids``: int64 [rows, top_k], every id in [0, num_experts) (a float tensor is
    fractional ids); ``layers.{l}.expert_weights``: float32 [rows, top_k], all finite; ``layers.{l}.router_logits``:
    [rows, num_experts], all finite. ``file`` is the shard, named in messages."""

    def fail(what: str) -> MoeprepError:
        return MoeprepError(f"{file}: {name} {what}; {RECORD_AGAIN}")

    if tensor.dim() == 0 or tensor.shape[0] != rows:
        raise fail(f"has shape {list(tensor.shape)}, but the index gives this shard {rows} token rows")
    kind = name.rsplit(".", 1)[-1] if name.startswith("layers.") else None
    if kind not in ("expert_ids", "expert_weights", "router_logits"):
        return
    width = index["num_experts"] if kind == "router_logits" else index["top_k"]
    if tensor.shape != (rows, width):
        raise fail(f"has shape {list(tensor.shape)}, not [{rows}, {width}] "
                   f"({'num_experts' if kind == 'router_logits' else 'top_k'} {width} per token)")
    if kind == "expert_ids":
        if tensor.is_floating_point():
            bad = tensor[tensor != tensor.round()] if tensor.numel() else tensor
            what = f"fractional expert ids (e.g. {bad[0].item()})" if bad.numel() else f"dtype {tensor.dtype}"
            raise fail(f"holds {what}; expert ids are whole numbers (int64)")
        if tensor.dtype != torch.int64:
            raise fail(f"has dtype {str(tensor.dtype).removeprefix('torch.')}, not int64")
        if tensor.numel() and not 0 <= int(tensor.min()) <= int(tensor.max()) < index["num_experts"]:
            out = tensor[(tensor < 0) | (tensor >= index["num_experts"])][0].item()
            raise fail(f"names expert {out}, outside [0, {index['num_experts']}) (num_experts {index['num_experts']})")
        return
    if not tensor.is_floating_point() or (kind == "expert_weights" and tensor.dtype != torch.float32):
        raise fail(f"has dtype {str(tensor.dtype).removeprefix('torch.')}, not float32")
    if not torch.isfinite(tensor).all():
        finite = torch.isfinite(tensor)
        row = int((~finite).any(dim=1).nonzero()[0])
        value = tensor[row][~finite[row]][0].item()
        what = "gating weights" if kind == "expert_weights" else "router logits"
        raise fail(f"holds non-finite {what} ({value} at row {row} of the shard); every value must be a finite number")


# --- reading ---------------------------------------------------------------------------------


class RecordedTrace:
    """A trace directory written by `record_traces`; tensors are read from the shards on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            raise MoeprepError(
                f"{self.path} is not a complete trace directory (no {INDEX_NAME}); record it again"
            )
        try:
            if (size := index_path.stat().st_size) > MAX_INDEX_BYTES:
                raise MoeprepError(f"{index_path} is {size:,} bytes, more than any trace index; {RECORD_AGAIN}")
            index = json.loads(index_path.read_bytes())
        except OSError as e:
            raise MoeprepError(f"cannot read {index_path} ({e.strerror or e}); {RECORD_AGAIN}") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise MoeprepError(f"{index_path} is not valid JSON ({str(e)[:120]}); {RECORD_AGAIN}") from None
        self.index = check_index(index, index_path)

    @property
    def layers(self) -> list[int]:
        """Model layer indices of the traced MoE layers."""
        return list(self.index["layers"])

    @property
    def sequence_tokens(self) -> list[int]:
        """Token count of each recorded sequence, in order."""
        return list(self.index["sequence_tokens"])

    def sequence_slices(self) -> list[slice]:
        """Row range of each sequence in the concatenated per-token tensors."""
        bounds = [0]
        for n in self.sequence_tokens:
            bounds.append(bounds[-1] + n)
        return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    def tensor(self, name: str) -> torch.Tensor:
        """Shard tensor `name` over all recorded tokens, concatenated: [N, ...] with N = total tokens."""
        if name not in self.index["tensors"]:
            raise MoeprepError(
                f"trace {self.path} has no tensor {name!r} (recorded: {sorted(self.index['tensors'])})"
            )
        parts = []
        for shard in self.index["shards"]:
            file = self.path / shard["file"]
            if not file.is_file():
                raise MoeprepError(f"{file} is missing: {self.path / INDEX_NAME} lists it as a shard; {RECORD_AGAIN}")
            try:
                with safe_open(file, framework="pt") as f:
                    if name not in f.keys():
                        raise MoeprepError(f"{file} has no tensor {name!r}, which {INDEX_NAME} lists; {RECORD_AGAIN}")
                    part = f.get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise MoeprepError(f"{file} cannot be read ({type(e).__name__}: {str(e)[:160]}); {RECORD_AGAIN}") \
                    from None
            check_shard_tensor(name, part, file, self.index, shard["tokens"])
            parts.append(part)
        return torch.cat(parts)

    def router_inputs(self, layer: int) -> torch.Tensor:
        """MoE block (router) inputs of model layer `layer`, [N, H]."""
        return self.tensor(f"layers.{layer}.router_input")

    def router_logits(self, layer: int) -> torch.Tensor:
        """Router logits of model layer `layer`, [N, E] float32."""
        return self.tensor(f"layers.{layer}.router_logits")

    def last_hidden(self) -> torch.Tensor:
        """Each token's last decoder layer output before the final norm, [N, H]."""
        return self.tensor("last_hidden")

    def token_ids(self) -> torch.Tensor:
        """The recorded token ids, [N] int64."""
        return self.tensor("token_ids")

    def routing(self) -> list[RoutingTrace]:
        """The routing of every recorded sequence."""
        ids = torch.stack(
            [self.tensor(f"layers.{layer}.expert_ids") for layer in self.layers], dim=1
        )  # [N, L, K]
        weights = torch.stack([self.tensor(f"layers.{layer}.expert_weights") for layer in self.layers], dim=1)
        layers = tuple(self.layers)
        return [RoutingTrace(ids[s], weights[s], layers) for s in self.sequence_slices()]


def open_trace(path: str | Path) -> RecordedTrace:
    """Open a trace directory written by `record_traces`."""
    return RecordedTrace(path)


# --- real Mixtral traces -------------------------------------------------------------------------

MIXTRAL_TRACE_FILE = "gsm8k_routing.jsonl"


def _find_mixtral_file(path: Path) -> Path:
    for candidate in (path, path / MIXTRAL_TRACE_FILE, path / "mixtral-8x7b" / MIXTRAL_TRACE_FILE):
        if candidate.is_file():
            return candidate
    raise MoeprepError(
        f"no Mixtral routing trace at {path} (looked for {MIXTRAL_TRACE_FILE} in it and in mixtral-8x7b/)"
    )


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # a larger gating value would be read as inf
MIXTRAL_FIX = "fetch the Mixtral traces again (../shared/data/traces) or remove the record"


def _mixtral_record(r, num_experts: int, top_k: int | None) -> tuple[int, int, int, list[int], list[float]] | str:
    """(problem, layer, token, experts, gating probabilities) of one JSONL record, or what is wrong with it."""
    if not isinstance(r, dict):
        return f"a record must be a JSON object, got {_shown(r)}"
    for key in ("problem_id", "layer", "token_idx", "experts", "gating_probs"):
        if key not in r:
            return f"the key {key!r} is missing"
    for key in ("problem_id", "layer", "token_idx"):
        if not _whole(r[key]) or r[key] < 0:
            return f"{key} must be a whole number >= 0, got {_shown(r[key])}"
    experts, probs = r["experts"], r["gating_probs"]
    if not isinstance(experts, list) or not experts:
        return f"experts must be a non-empty list of expert ids, got {_shown(experts)}"
    for e in experts:
        if isinstance(e, float) and math.isfinite(e) and e != int(e):
            return f"experts holds the fractional expert id {e}; expert ids are whole numbers"
        if not _whole(e):
            return f"experts holds {_shown(e)}, not a whole-number expert id"
        if not 0 <= e < num_experts:
            return f"experts names expert {e}, outside [0, {num_experts})"
    if top_k is not None and len(experts) != top_k:
        return f"experts lists {len(experts)} experts where earlier records list {top_k} (one top-k per file)"
    if not isinstance(probs, list) or len(probs) != len(experts):
        return f"gating_probs must be a list of {len(experts)} numbers (one per expert), got {_shown(probs)}"
    for w in probs:
        if not isinstance(w, int | float) or isinstance(w, bool):
            return f"gating_probs holds {_shown(w)}, not a number"
        if not math.isfinite(w) or abs(w) > FLOAT32_MAX:
            return f"gating_probs holds the non-finite gating value {w}; every value must be a finite number"
    return r["problem_id"], r["layer"], r["token_idx"], experts, [float(w) for w in probs]


def read_mixtral_traces(path: str | Path, num_experts: int = MAX_EXPERTS) -> list[RoutingTrace]:
    """The real Mixtral-8x7B GSM8K decode routing as one RoutingTrace per problem (by problem id).

    path: the `gsm8k_routing.jsonl` file, its directory, or the traces root holding `mixtral-8x7b/`.
    The file has one JSON record per (problem, layer, generated token). Known defect (SOURCES.md):
    records whose two weights were exactly 0.5/0.5 were dropped and token_idx renumbered per layer,
    so layers of one problem have 0-2 tokens fewer than others. Alignment choice: each layer's
    records are ordered by token_idx and aligned by position, and every layer is truncated to the
    shortest layer of that problem, so T is the same for all layers and no sentinel values exist.
    This loses the last 0-2 tokens per problem, and positions after a drop are off by one across
    layers, which cross-layer statistics must tolerate (per-layer ones are exact up to the tail).
    Every record is checked: whole-number ids >= 0, expert ids in [0, num_experts) (the simulator passes
    Mixtral's 8), one top-k per file, finite gating probabilities; a bad one is a MoeprepError naming its line.
    Returns RoutingTraces with layers 0..31 and K = 2.
    """
    file = _find_mixtral_file(Path(path))
    records: dict[int, dict[int, list[tuple[int, list[int], list[float]]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    top_k = None
    try:
        with file.open() as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise MoeprepError(f"{file}:{line_no}: not a routing record ({str(e)[:120]}); {MIXTRAL_FIX}") \
                        from None
                got = _mixtral_record(r, num_experts, top_k)
                if isinstance(got, str):
                    raise MoeprepError(f"{file}:{line_no}: {got}; {MIXTRAL_FIX}")
                problem, layer, token, experts, probs = got
                top_k = len(experts)
                records[problem][layer].append((token, experts, probs))
    except UnicodeDecodeError as e:
        raise MoeprepError(f"{file} is not UTF-8 text ({str(e)[:120]}); {MIXTRAL_FIX}") from None
    if not records:
        raise MoeprepError(f"{file} holds no routing records; {MIXTRAL_FIX}")
    traces = []
    for problem in sorted(records):
        by_layer = records[problem]
        layers = sorted(by_layer)
        if layers != list(range(len(layers))):
            raise MoeprepError(
                f"{file}: problem {problem} has layers {layers}, expected 0..{len(layers) - 1}"
            )
        n = min(len(by_layer[layer]) for layer in layers)
        ids, weights = [], []
        for layer in layers:
            rows = sorted(by_layer[layer], key=lambda rec: rec[0])[:n]
            ids.append(torch.tensor([rec[1] for rec in rows], dtype=torch.int64))  # [T, K]
            weights.append(torch.tensor([rec[2] for rec in rows], dtype=torch.float32))
        traces.append(RoutingTrace(torch.stack(ids, dim=1), torch.stack(weights, dim=1), tuple(layers)))
    return traces

