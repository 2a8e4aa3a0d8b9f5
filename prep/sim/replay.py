"""Routing to replay: every token's chosen experts at every MoE layer, from a trace on disk.

The simulator needs only which experts each token used at each MoE layer, so a trace is turned into
plain Python tuples once (``Replay``), which keeps the replay loop free of tensor indexing. Two
sources are read:

- a project trace directory written by ``prep.methods.trace.record_traces`` (any architecture): one
  sequence per recorded sequence, layers are the traced MoE layers in order, E from its index;
- the real Mixtral-8x7B GSM8K decode traces (``prep.methods.trace.read_mixtral_traces``: the
  ``gsm8k_routing.jsonl`` file, its directory or the traces root): one sequence per problem, 32
  layers, E = 8. Each problem's layers are trimmed to its shortest layer (see that function).

Layers are positions 0..L-1 among the model's MoE layers, as everywhere in the cache and the plan.
Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from prep.errors import MoeprepError
from prep.methods.trace import INDEX_NAME, MAX_EXPERTS, open_trace, read_mixtral_traces

MIXTRAL_EXPERTS = 8


@dataclass(frozen=True)
class Replay:
    """Recorded routing of one or more sequences.

    sequences[s][t][l] is the tuple of experts token t of sequence s used at MoE layer l, in the
    router's slot order (K of them, no repeats). weights[s][t][l], when recorded, are their combination
    weights in the same order (what routing and miss policies decide on).
    """

    sequences: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]  # [S][T][L] -> K experts
    num_layers: int
    num_experts: int
    top_k: int
    source: str = ""
    weights: tuple | None = None  # [S][T][L] -> K floats, aligned with sequences
    logits: tuple | None = None  # per sequence the router logits [T, L, E] (project traces hold them)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq) for seq in self.sequences)

    @property
    def requests(self) -> int:
        """Expert requests: one per (token, layer, distinct chosen expert)."""
        return sum(len(experts) for seq in self.sequences for token in seq for experts in token)


def replay_from_routing(traces: Sequence, num_experts: int | None = None, source: str = "") -> Replay:
    """A ``Replay`` from ``prep.methods.trace.RoutingTrace`` objects (expert_ids [T, L, K]) of one model.

    num_experts: E of the model (a whole number from 1 to ``MAX_EXPERTS``); None takes the largest expert id
    seen + 1. The sequences are routing already checked by their reader (``open_trace``, ``read_mixtral_traces``);
    what is checked here is what a caller can get wrong: the expert count, ids in range, finite weights.
    """
    where = source or "the trace"
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                    or not 1 <= num_experts <= MAX_EXPERTS):
        raise MoeprepError(f"{where}: num_experts {num_experts!r} must be a whole number of experts per layer from "
                           f"1 to {MAX_EXPERTS}")
    if not traces:
        raise MoeprepError(f"no routed sequences in {source or 'the trace'}; record a trace with tokens in it")
    shapes = {(t.num_layers, t.top_k) for t in traces}
    if len(shapes) != 1:
        raise MoeprepError(f"the sequences of {source or 'the trace'} disagree on (layers, top-k): {sorted(shapes)}")
    num_layers, top_k = shapes.pop()
    sequences, weights = [], []
    seen_max = -1
    for trace in traces:
        if not torch.isfinite(trace.expert_weights).all():
            raise MoeprepError(f"{where} holds non-finite gating weights (NaN or inf); record the trace again")
        rows = trace.expert_ids.tolist()  # [T][L][K]
        seq = tuple(tuple(tuple(dict.fromkeys(int(e) for e in experts)) for experts in token) for token in rows)
        mass = trace.expert_weights.tolist()
        weights.append(tuple(tuple(tuple(w[:len(experts)]) for experts, w in zip(token, m, strict=True))
                             for token, m in zip(seq, mass, strict=True)) if seq else ())
        for token in seq:
            for experts in token:
                seen_max = max(seen_max, *experts) if experts else seen_max
        if min((min(experts) for token in seq for experts in token if experts), default=0) < 0:
            raise MoeprepError(f"{source or 'the trace'} has a negative expert id; record the trace again")
        if seq:
            sequences.append(seq)
        else:
            weights.pop()
    if not sequences:
        raise MoeprepError(f"every sequence of {source or 'the trace'} is empty; nothing to replay")
    if num_experts is None:
        num_experts = seen_max + 1
        if num_experts > MAX_EXPERTS:
            raise MoeprepError(f"{where} names expert {seen_max}, more than the {MAX_EXPERTS} experts per layer a "
                               "trace may have; record the trace again")
    elif seen_max >= num_experts:
        raise MoeprepError(f"{source or 'the trace'} names expert {seen_max} but the model has {num_experts} experts")
    return Replay(tuple(sequences), num_layers, int(num_experts), top_k, source, tuple(weights))


def load_replay(path: str | Path) -> Replay:
    """The routing of a project trace directory (with ``index.json``) or of the real Mixtral traces.

    path: a trace directory written by ``record_traces``; or ``gsm8k_routing.jsonl``, its directory, or
    the traces root holding ``mixtral-8x7b/``. Raises ``MoeprepError`` when nothing is there.
    """

    path = Path(path)
    if not path.exists():
        raise MoeprepError(f"trace {path} does not exist; pass a trace directory written by `moeprep prepare` "
                           "(stages/trace-*/trace) or the real Mixtral traces (../shared/data/traces)")
    try:
        return _read_replay(path)
    except MoeprepError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, RuntimeError,
            SafetensorError) as e:  # a damaged trace: its files are data from outside, parsed here
        raise MoeprepError(f"trace {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); record it again "
                           "(`moeprep prepare` writes stages/trace-*/trace) or fetch the Mixtral traces again") from None


def _read_replay(path: Path) -> Replay:
    if path.is_dir() and (path / INDEX_NAME).is_file():
        trace = open_trace(path)
        replay = replay_from_routing(trace.routing(), int(trace.index["num_experts"]), str(path))
        if f"layers.{trace.layers[0]}.router_logits" not in trace.index["tensors"]:
            return replay  # an imported routing trace (trace.recorded): decisions and weights only
        logits = torch.stack([trace.router_logits(layer) for layer in trace.layers], dim=1)  # [N, L, E]
        per_sequence = tuple(logits[s] for s in trace.sequence_slices() if s.stop > s.start)
        return dataclasses.replace(replay, logits=per_sequence) if len(per_sequence) == len(replay.sequences) else replay
    return replay_from_routing(read_mixtral_traces(path, MIXTRAL_EXPERTS), MIXTRAL_EXPERTS, str(path))
