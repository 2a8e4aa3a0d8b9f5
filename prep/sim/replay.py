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
from pathlib import Path

import torch
from safetensors import SafetensorError

from loader.simulate import Replay, replay_from_routing  # noqa: F401  (the cost model's; re-exported here)
from prep.errors import MoeprepError
from prep.methods.trace import INDEX_NAME, open_trace, read_mixtral_traces

MIXTRAL_EXPERTS = 8


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
