"""Stage ``sensitivity``: EdgeMoE's expert importance profile (EdgeMoE section 3.2, Fig. 7(a)), read by
``bitwidth: edgemoe``.

For every expert, the damage of moving it alone from ``quantize.precision`` to ``sensitivity.precision``
(INT2 by default) while every other expert stays at the base precision:

- ``sweep``: the mean KL of next-token distributions against the all-base configuration on the first
  ``num_sequences`` calibration sequences, re-evaluated layer-locally (``prep.methods.sensitivity.kl_sweep``).
  Each finished MoE layer is written at once (``layer-<p>.json``), so an interrupted sweep resumes at
  the first layer not yet written.
- ``prerank``: the trace-only output error (ours, not in EdgeMoE: a cheap stand-in for its sweep), no forward
  pass; always computed, and with a sweep its Spearman rank correlation to it is reported.

``ranking`` is the score the bit-width stage orders by (least sensitive first).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loader.io import write_json_atomic
from loader.vocab import PRECISIONS
from prep.errors import MoeprepError
from prep.executor import Unit
from prep.methods.decoded import DecodedExperts, original_experts, save_sequences
from prep.methods.sensitivity import check_sequences, kl_sweep, spearman, trace_prerank
from prep.methods.trace import open_trace
from prep.stages import Stage, StageResult
from prep.stages.quantize import PackedExperts
from prep.stages.trace import RoutingTraces

VERSION = 2  # 2: units (one per MoE layer) computed with one torch thread: the KL rows change in the 6th digit
METRIC = "mean next-token KL(base || one expert low), nats, calibration sequences"


SENSITIVITY_METHODS = ("sweep", "prerank")


@dataclass(frozen=True)
class SensitivitySection:
    """EdgeMoE's expert importance profile: the damage of moving one expert alone to ``precision``.

    ``method``: ``sweep`` (mean KL of next-token distributions against the base configuration, layer-local
    re-evaluation, one run per expert) or ``prerank`` (trace-only output error, no forward pass; the fast path
    for thousands of experts). The pre-rank is always computed too, with its rank correlation to the sweep.
    """

    method: str = "sweep"
    precision: str = "int2"
    num_sequences: int | None = 8  # calibration sequences the sweep evaluates (None: all)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MoeprepError(f"sensitivity.precision: precision {self.precision!r} unknown; use one of {PRECISIONS}")
        if self.method not in SENSITIVITY_METHODS:
            raise MoeprepError(f"sensitivity.method {self.method!r} unknown; use one of {SENSITIVITY_METHODS}")
        if self.num_sequences is not None and self.num_sequences <= 0:
            raise MoeprepError("sensitivity.num_sequences must be positive (or null for all)")


@dataclass(frozen=True)
class SensitivityProfile(StageResult):
    method: str
    metric: str
    base: str
    precision: str
    sequences: int
    ranking: list  # [L][E], the score used to order experts (sweep or prerank)
    sweep: list | None  # [L][E] KL, None for method prerank
    prerank: list  # [L][E] trace-only output error
    spearman: float | None  # rank correlation of prerank and sweep
    seconds: dict  # sweep, prerank, one calibration forward pass over the same sequences

    def problem(self) -> str | None:
        """A KL or an output error is never negative, and a rank correlation lies in [-1, 1]: a cached profile
        outside them (resealed by hand) would reorder the experts the bit-width search moves."""
        for name in ("ranking", "sweep", "prerank"):
            rows = getattr(self, name)
            if rows is not None and not (isinstance(rows, list) and all(
                    isinstance(row, list) and all(isinstance(v, (int, float)) and v >= 0 for v in row) for row in rows)):
                return f"{name} holds a value that is not a number >= 0"
        if self.spearman is not None and not (isinstance(self.spearman, (int, float)) and -1 <= self.spearman <= 1):
            return f"spearman {self.spearman} is outside [-1, 1]"
        return None


SEQUENCES = "sequences.safetensors"  # the sweep's calibration tokens, for the units to read (removed at the end)


def _layer_file(pos: int) -> str:
    return f"layer-{pos}.json"


def sweep_layer(context, out: Path, *, position: int, quantize_dir: str, packed: dict, low: str,
                sequences: str) -> None:
    """One unit: the sweep's row of MoE layer position ``position`` (every expert of it alone at ``low``), written
    to ``out`` (the row only: no timing, so a unit's file is the same bytes wherever it ran). Reads the quantized records and the calibration tokens from their
    paths. A process running several units keeps the base pass (``UnitContext.cache``), which changes no row."""
    from safetensors.torch import load_file

    model, adapter = context.model, context.adapter
    packed = PackedExperts.from_json(packed)
    decoded = DecodedExperts(Path(quantize_dir), packed)
    tokens = load_file(sequences)
    seqs = [tokens[str(i)] for i in range(len(tokens))]
    state = context.cache(f"sweep {quantize_dir} {packed.precision} {sequences}")
    with original_experts(model, adapter):
        decoded.apply(model, adapter, lambda pos, e: packed.precision)
        (row,) = kl_sweep(model, adapter, seqs, lambda layer, e: decoded.weights(adapter, low, layer, e),
                          positions=[position], state=state, progress=False)
    write_json_atomic(out, row)


def profile_sensitivity(inputs, quantize_dir: Path, packed, trace_dir: Path, cfg: SensitivitySection,
                        work: Path) -> SensitivityProfile:
    """The profile: the trace-only pre-rank here, then (method ``sweep``) one unit per MoE layer through the
    run's executor (``inputs.map_units``), merged in layer order."""
    adapter = inputs.adapter
    decoded = DecodedExperts(quantize_dir, packed)
    base, low = packed.precision, cfg.precision

    def weights_at(precision):
        return lambda layer, expert: decoded.weights(adapter, precision, layer, expert)

    started = time.perf_counter()
    trace = open_trace(RoutingTraces.path(trace_dir))
    routing = trace.routing()
    router_inputs, ids, gates = [], [], []
    for pos, layer in enumerate(adapter.moe_layers):
        router_inputs.append(trace.router_inputs(layer))
        ids.append(torch.cat([r.expert_ids[:, pos] for r in routing]))
        gates.append(torch.cat([r.expert_weights[:, pos] for r in routing]))
    prerank = trace_prerank(adapter, weights_at(base), weights_at(low), router_inputs, ids, gates)
    seconds = {"prerank": round(time.perf_counter() - started, 3)}

    sweep, rho, count = None, None, 0
    if cfg.method == "sweep":
        sequences = inputs.sequences
        seqs = check_sequences(sequences if cfg.num_sequences is None else sequences[:cfg.num_sequences])
        count = len(seqs)
        tokens = work / SEQUENCES  # the units read the tokens from here, not through the driver
        save_sequences(tokens, seqs)
        units = [Unit(name=f"layer-{pos}", output=_layer_file(pos), fn=sweep_layer,
                      args={"position": pos, "quantize_dir": str(Path(quantize_dir).resolve()),
                            "packed": packed.to_json(), "low": low, "sequences": str(tokens.resolve())})
                 for pos in range(len(adapter.moe_layers))]
        started = time.perf_counter()
        inputs.map_units(units, desc=f"sensitivity {base}->{low}")
        seconds["sweep"] = round(time.perf_counter() - started, 3)
        sweep = [json.loads((work / u.output).read_text()) for u in units]
        tokens.unlink(missing_ok=True)
        rho = spearman(prerank, sweep)
        rho = None if math.isnan(rho) else round(rho, 4)  # undefined when either profile is constant
    return SensitivityProfile(
        method=cfg.method, metric=METRIC if sweep is not None else "trace-only output error (sum w^2 ||f - fq||^2)",
        base=base, precision=low, sequences=count, ranking=sweep if sweep is not None else prerank,
        sweep=sweep, prerank=prerank, spearman=rho,
        seconds=seconds)


def _run(inputs) -> SensitivityProfile:
    quantize_dir, packed = inputs.upstream("quantize")
    trace_dir, _ = inputs.upstream("trace")
    return profile_sensitivity(inputs, quantize_dir, packed, trace_dir, inputs.config, inputs.work)


STAGE = Stage(
    name="sensitivity", version=VERSION, config=SensitivitySection, result=SensitivityProfile,
    reads=("trace", "quantize"), needs=frozenset({"model", "calibration"}),
    run=_run,
    enabled=lambda recipe: recipe.bitwidth.method == "edgemoe",
    units=lambda recipe, num_layers: num_layers if recipe.sensitivity.method == "sweep" else 0,
    section="sensitivity",
)
