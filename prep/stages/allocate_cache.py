"""Stage ``allocate_cache``: how many records each cache cell holds, per budget (AdapMoE section 4.4).

A cell is one (layer, pool) of a per-layer pool, or a whole global pool. Its cost curve f_c(t),
t = 0..n_c records, is either

- ``measured``: the simulator replays the calibration traces through the loader's own cache with the
  plan's policy (per-layer LRU; ``tune_policy`` runs next, on the allocated plan) and predictors. One baseline run holds every cell
  full; then, per pool and t, one run holds that pool's cells at t (the others full), and f_c(t) is the
  cell's layer cost above the baseline (a global pool: on a grid of t, interpolated). The same runs give each
  cell's demand bytes per token, the DP's tie-break: where every read hides behind compute the modelled
  seconds are flat, and the budget still goes to the records that spare the most reads;
- ``closed_form``: AdapMoE's eqs. 10-15 per layer, from the gating stage's single-expert share (0 when
  off) and the predict stage's top-1 accuracy for that layer (next-layer gate at distance 1; the
  first-layer gate for layer 0; 0 without them), in loads, times the cost of one read of the cell.

``prep.methods.allocation.allocate`` then solves the DP in bytes (slot bytes as the knapsack weights) at the
plan's default budget (the plan's pools, and an operating point) and at each operating point
(``plan.points``: budgets holding that share of the shipped experts), and each result is simulated
against the plan without an allocation (pools split by expert bytes, layers equal) and the closed-form
allocation. The operating points go into the plan, so the loader takes the allocation made for the budget
it is given, and into report.json with their modelled tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tqdm import tqdm

from loader.budget import Capacities, ModelSizes, buffer_bytes, resolve_budget
from loader.errors import MoeError
from loader.plan import OperatingPoint, Plan, Pool
from prep.errors import MoeprepError
from prep.methods.allocation import allocate, closed_form_curve
from prep.stages import Stage, StageResult
from prep.stages.operating_points import OPERATING_POINTS, point_figures
from prep.stages.planning import PlanSection, draft_from_inputs, with_prefill

VERSION = 7  # 7: prefill forms chosen on the device profile, the prefill reserve in the sizes; 6: equal modelled seconds go to fewer bytes read (a budget left empty where reads hid behind compute); 3: slots in the held form's size (the loader's), the sizes kept in the result; 4: kernel-layout int4 on a CPU; 5: prefetches gated
GLOBAL_GRID = 9  # measured points of a global pool's curve


@dataclass(frozen=True)
class CacheAllocation(StageResult):
    """The cells, their curves, the allocation at the default budget and at each operating point."""

    cost: str  # "measured" or "closed_form"
    unit: str
    cells: list  # [{"pool", "layer" (int or "global"), "experts", "slot_bytes"}]
    curves: list  # [C][t] the cost curve each allocation minimised
    points: list  # [{"share", "budget_bytes", "slots", "pools", "allocated", "uniform", "closed_form"}]
    inputs: dict  # the closed form's alpha and beta per layer
    tolerance: float | None  # plan.tolerance: points of accuracy an operating point may lose (evaluate checks)
    sizes: dict  # the ``ModelSizes`` the allocation was solved with (slots in the held forms' sizes)
    read_depth: int | None = None  # the device profile's best reads in flight (None: no profile, or one without)
    tiebreak: list | None = None  # [C][t] demand bytes per token above full, between equal costs (measured curves)
    prefill: dict | None = None  # the prefill values chosen on the device profile (``planning.prefill_choice``)

    def apply(self, plan: Plan, context) -> Plan:
        """``plan`` with its own pools allocated for its default budget and the operating points. The default
        budget is solved with the sizes the points were (the package stage's context knows only the records)."""
        sizes = ModelSizes(**self.sizes)
        def pools(raw):
            return tuple(Pool.from_json(p, "allocation", plan.num_layers) for p in raw)

        budget = int(min(resolve_budget(None, plan, sizes), 2**62))
        raw = {p["budget_bytes"]: p["pools"] for p in self.points}
        try:
            own = pools_of(plan, self.cells, solve(plan, sizes, self.cells, self.curves, budget, self.tiebreak))
            raw[budget] = own  # the default budget is a point too
        except MoeError:  # a default budget that holds no record: the smallest point's pools
            own = raw[min(raw)]
        points = tuple(OperatingPoint(b, pools(raw[b])) for b in sorted(raw))
        return dataclasses.replace(plan, pools=pools(own), operating_points=points,
                                   read_depth=self.read_depth or plan.read_depth, prefill=with_prefill(plan, self.prefill))

    def report(self, entries: dict) -> dict:
        """report.json's ``planning`` (the allocation's inputs) and ``operating_points``: per budget the allocated
        plan's modelled figures beside the plan without an allocation and the closed-form allocation, all three with
        the plan's default policy (tune_policy rescores the first with its own; evaluate fills ``accuracy_delta``)."""
        points = [{"budget_bytes": p["budget_bytes"], "share": p["share"], "slots": p["slots"],
                   **point_figures(p["allocated"]), "allocated_default_policy": p["allocated"], "uniform": p["uniform"],
                   "closed_form": p["closed_form"], "accuracy_delta": None} for p in self.points]
        return entries | {"planning": {"allocate_cache": {"cost": self.cost, "unit": self.unit, "inputs": self.inputs,
                                                          "cells": self.cells}, "tolerance": self.tolerance},
                          "operating_points": points}

    REPORT_OFF = {"planning": None, "operating_points": []}
    REPORT_SECTIONS = (OPERATING_POINTS,)


def solve(plan: Plan, sizes: ModelSizes, cells: list[dict], curves: list, budget: float,
          tiebreak: list | None = None) -> tuple[int, ...]:
    """The DP's records per cell for ``budget`` bytes (less the dense weights and the read buffers); equal
    costs go to the fewer bytes read per token (``tiebreak``)."""
    room = budget - sizes.dense_bytes - buffer_bytes(plan, sizes)
    return allocate(curves, [c["slot_bytes"] for c in cells], room, tiebreak=tiebreak)[0]


def with_points(plan: Plan, points: list[dict]) -> Plan:
    """``plan`` with operating points only (its own pools unchanged): what one point's score replays."""
    return dataclasses.replace(plan, operating_points=tuple(
        OperatingPoint(p["budget_bytes"], tuple(Pool.from_json(q, "allocation", plan.num_layers) for q in p["pools"]))
        for p in points))


def cells_of(plan: Plan) -> list[dict]:
    """The cache cells of ``plan``: (pool, layer) of a per-layer pool, or (pool, "global"), with the number
    of experts each can ever hold: a pool's experts are those planned at its precision (dynamic precision's low
    copies take slots of those pools, so they add no cell)."""
    out = []
    for pool in plan.pools:
        counts = [sum(p == pool.precision for p in row) for row in plan.expert_precision]
        if pool.group == "global":
            if sum(counts):
                out.append({"pool": pool.name, "layer": "global", "experts": sum(counts)})
        else:
            out += [{"pool": pool.name, "layer": layer, "experts": n} for layer, n in enumerate(counts) if n]
    return out


def _caps(draft, plan: Plan, cells: list[dict], slots: list[int]) -> Capacities:
    """Byte capacities holding ``slots[c]`` records in cell c (nothing in a pool's other groups)."""
    pools: dict = {p.name: ({"global": 0} if p.group == "global" else dict.fromkeys(range(plan.num_layers), 0))
                   for p in plan.pools}
    for cell, t in zip(cells, slots, strict=True):
        pools[cell["pool"]][cell["layer"]] = t * cell["slot_bytes"]
    return Capacities(math.inf, draft.sizes.dense_bytes, buffer_bytes(plan, draft.sizes), pools)


def _layer_of(cell) -> int | None:
    return cell["layer"] if cell["layer"] != "global" else None


def measured_curves(draft, plan: Plan, cells: list[dict], sequences,
                    progress: bool = True) -> tuple[list[list[float]], list[list[float]]]:
    """f_c(t) for t = 0..n_c: each cell's cost above the all-full baseline (module docstring), and the same
    curves in demand bytes read per token (the DP's tie-break where modelled seconds are flat)."""
    full = [c["experts"] for c in cells]

    def run(slots) -> tuple[list[float], float, list[float], float]:
        result = draft.simulate(plan, _caps(draft, plan, cells, slots), sequences)
        demand = [r.demand_bytes / result.tokens for r in result.layers]
        return draft.layer_costs(result), draft.cost(result), demand, sum(demand)

    jobs = []
    for pool in plan.pools:
        members = [i for i, c in enumerate(cells) if c["pool"] == pool.name]
        if not members:
            continue
        top = max(full[i] for i in members)
        grid = (sorted({round(top * k / (GLOBAL_GRID - 1)) for k in range(GLOBAL_GRID)})
                if pool.group == "global" and top >= GLOBAL_GRID else list(range(top + 1)))
        jobs += [(pool.name, members, t) for t in grid if t < top]
    bar = tqdm(total=len(jobs) + 1, desc="allocate_cache curves", unit="run", disable=not progress, leave=False)
    base = run(full)
    bar.update(1)
    seen: list[dict[int, dict[int, float]]] = [{i: {full[i]: 0.0} for i in range(len(cells))} for _ in range(2)]
    for _pool, members, t in jobs:
        got = run([min(t, full[i]) if i in members else full[i] for i in range(len(cells))])
        bar.update(1)
        for i in members:
            if t >= full[i]:
                continue
            layer = _layer_of(cells[i])
            for k, (layers, total) in enumerate((got[:2], got[2:])):
                above = layers[layer] - base[2 * k][layer] if layer is not None else total - base[2 * k + 1]
                seen[k][i][t] = max(0.0, above)
    bar.close()
    return _interpolated(seen[0], full), _interpolated(seen[1], full)


def _interpolated(seen: dict[int, dict[int, float]], full: list[int]) -> list[list[float]]:
    """Each cell's curve at t = 0..n_c, linear between its measured points (a global pool's grid)."""
    curves = []
    for i, n in enumerate(full):
        known = sorted(seen[i].items())
        curve = []
        for t in range(n + 1):
            lo = max((k, v) for k, v in known if k <= t)
            hi = min((k, v) for k, v in known if k >= t)
            curve.append(lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (t - lo[0]) / (hi[0] - lo[0]))
        curves.append(curve)
    return curves


def closed_form_inputs(plan: Plan, gating, prediction) -> dict:
    """alpha (single-expert share) and beta (top-1 prefetch accuracy) per layer, from the upstream stages."""
    num_layers = plan.num_layers
    alpha = [row["single"] for row in gating.per_layer] if gating is not None else [0.0] * num_layers
    beta = [0.0] * num_layers
    if prediction is not None:
        stats = prediction.to_json()
        for row in (stats.get("next_gates") or {}).get("layers", []):
            if row["distance"] == 1 and 0 <= row["target"] < num_layers:
                beta[row["target"]] = row["gate"]["top1"]
        if stats.get("first_gate"):
            beta[0] = stats["first_gate"]["held_out"]["top1"]
    return {"alpha": [float(a) for a in alpha], "beta": [float(b) for b in beta]}


def closed_form_curves(draft, plan: Plan, cells: list[dict], inputs: dict) -> list[list[float]]:
    """The paper's expected loads for each cell's share of its layer, times the cost of one read."""
    curves = []
    for cell in cells:
        n, pool = cell["experts"], next(p for p in plan.pools if p.name == cell["pool"])
        read = draft.read_bytes[pool.precision]
        one = draft.profile.read_seconds(read) if draft.profile is not None else read
        if cell["layer"] == "global":
            alpha = sum(inputs["alpha"]) / plan.num_layers
            beta = sum(inputs["beta"]) / plan.num_layers
        else:
            alpha, beta = inputs["alpha"][cell["layer"]], inputs["beta"][cell["layer"]]
        loads = closed_form_curve(alpha, beta, n) if n >= 2 else [1 - beta, 0.0]
        scale = min(1.0, n / plan.num_experts) * (plan.num_layers if cell["layer"] == "global" else 1)
        curves.append([v * scale * one for v in loads])
    return curves


def pools_of(plan: Plan, cells: list[dict], slots) -> list[dict]:
    """The plan's pools holding ``slots`` per cell: shares by bytes, per-layer splits by bytes."""
    held = {p.name: 0 for p in plan.pools}
    layers = {p.name: [0.0] * plan.num_layers for p in plan.pools}
    for cell, t in zip(cells, slots, strict=True):
        held[cell["pool"]] += t * cell["slot_bytes"]
        if cell["layer"] != "global":
            layers[cell["pool"]][cell["layer"]] = float(t * cell["slot_bytes"])
    total = sum(held.values())
    if total == 0:
        raise MoeprepError("the budget holds no expert record at all; raise the budget or the plan.points")
    out = []
    for p in plan.pools:
        raw = {"name": p.name, "precision": p.precision, "share": held[p.name] / total, "group": p.group}
        if p.group == "layer" and any(layers[p.name]):
            raw["layers"] = layers[p.name]
        out.append(raw)
    return out


def score_plan(draft, plan: Plan, budget: int, sequences) -> dict | None:
    """Cost, demand misses and reads per token, modelled tokens/s of ``plan`` at ``budget`` (None: refused)."""
    try:
        caps = draft.capacities(plan, budget)
        result = draft.simulate(plan, caps, sequences)
    except MoeError as e:
        return {"refused": str(e)}
    cost = draft.cost(result)
    prefill = draft.modeled_prefill(plan, caps)  # a prompt of the calibration traces, in the budget's chunks
    return {"cost": cost, "misses_per_token": result.misses / result.tokens, "miss_rate": result.miss_rate,
            "demand_bytes_per_token": sum(r.demand_bytes for r in result.layers) / result.tokens,
            "modeled_tokens_per_s": (1 / cost if draft.profile is not None and cost > 0 else None),
            "modeled_prefill": prefill.to_json() if prefill is not None else None}


def allocate_plan(draft, cfg: PlanSection, gating=None, prediction=None, progress: bool = True) -> CacheAllocation:
    """Curves, then the DP at each operating point, each scored against the unallocated and the closed-form plan."""
    plan = draft.plan
    sequences = slice(0, cfg.num_sequences) if cfg.num_sequences is not None else None
    cells = [c | {"slot_bytes": draft.sizes.record_bytes[next(p.precision for p in plan.pools if p.name == c["pool"])]}
             for c in cells_of(plan)]
    if not cells:
        raise MoeprepError("the plan has no cache cell to allocate (no pool holds an expert)")
    inputs = closed_form_inputs(plan, gating, prediction)
    closed = closed_form_curves(draft, plan, cells, inputs)
    curves, tiebreak = (measured_curves(draft, plan, cells, sequences, progress) if cfg.allocate.cost == "measured"
                        else (closed, None))
    points = []
    for share in sorted(cfg.points):
        budget = draft.budget_for_share(share)
        slots = solve(plan, draft.sizes, cells, curves, budget, tiebreak)
        room = budget - draft.sizes.dense_bytes - buffer_bytes(plan, draft.sizes)
        if not any(slots) and room >= min(c["slot_bytes"] for c in cells):
            raise MoeprepError(  # a DP that leaves room unused: say what it saw, for whoever reads the error
                f"allocate_cache: the allocation at share {share} holds no record though {room:,} bytes are free "
                f"for experts; first cell's cost curve {curves[0][:4]}..., bytes read {(tiebreak or [[]])[0][:4]}...; "
                "the device profile's times may be degenerate: measure it again with `moeprep profile-device`")
        pools = pools_of(plan, cells, slots)
        allocated = with_points(plan, [{"budget_bytes": budget, "pools": pools}])
        closed_slots = solve(plan, draft.sizes, cells, closed, budget)
        closed_plan = with_points(plan, [{"budget_bytes": budget, "pools": pools_of(plan, cells, closed_slots)}])
        points.append({"share": share, "budget_bytes": budget, "slots": list(slots), "pools": pools,
                       "closed_form_slots": list(closed_slots),
                       "allocated": score_plan(draft, allocated, budget, sequences),
                       "closed_form": score_plan(draft, closed_plan, budget, sequences),
                       "uniform": score_plan(draft, plan, budget, sequences)})
    return CacheAllocation(cost=cfg.allocate.cost, unit=draft.unit, cells=cells, curves=curves, tiebreak=tiebreak,
                           points=points,
                           inputs=inputs, tolerance=cfg.tolerance, sizes=dataclasses.asdict(draft.sizes),
                           read_depth=draft.profile.read_depth if draft.profile is not None else None,
                           prefill=draft.prefill)


def _run(inputs) -> CacheAllocation:

    cfg = inputs.config
    draft = draft_from_inputs(inputs, cfg.device)
    gating = inputs.upstream("gating", optional=True)
    prediction = inputs.upstream("predict", optional=True)
    return allocate_plan(draft, cfg, gating[1] if gating else None, prediction[1] if prediction else None)


STAGE = Stage(
    name="allocate_cache", version=VERSION, config=PlanSection, result=CacheAllocation,
    reads=("trace", "quantize", "bitwidth", "predict", "gating", "dynamic_precision", "cache_routing"),
    needs=frozenset({"model"}), files=lambda recipe: [recipe.plan.device] if recipe.plan.device else [],
    enabled=lambda recipe: recipe.plan.allocate.enabled, run=_run,
    section="plan",
)
