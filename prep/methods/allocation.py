"""Cache allocation across layers (AdapMoE section 4.4, eqs. 10-15): how many records each cache cell holds.

A *cell* is one eviction group of the loader's cache that holds records of one size: a (layer, pool)
pair of a per-layer pool. Each cell has a cost curve ``f(t)``, t = 0..n records (n: the experts the
cell can ever hold), and a record size. ``allocate`` picks one t per cell minimising the summed cost
with the summed bytes within a capacity: a knapsack solved exactly over the Pareto frontier of
(bytes, cost), so cells with different record sizes are weighed in bytes. With equal record sizes it
is AdapMoE's DP ``F[i][j] = min_k F[i-1][j-k] + f_i(k)``.

Two cost models feed it:

- ``closed_form_curve``: the paper's eqs. 10-15, from a layer's single-expert share alpha and its
  prefetch accuracy beta, assuming uniformly random top-2 routing and one prefetch per layer;
- measured curves: the simulator replaying the calibration traces through the loader's own cache,
  policy and predictors (``prep.stages.allocate_cache``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prep.errors import MoeprepError


def closed_form_curve(alpha: float, beta: float, num_experts: int) -> list[float]:
    """Expected on-demand loads per token of one layer holding t = 0..N experts (AdapMoE eqs. 10-15).

    alpha: the share of tokens the layer computes with one expert; beta: the accuracy of its single
    prefetch. Routing is assumed uniform over the N experts, with no reuse between tokens.
    """
    n = num_experts
    if n < 2:
        raise MoeprepError(f"the closed-form cost needs at least 2 experts per layer, got {n}")
    if not (0 <= alpha <= 1 and 0 <= beta <= 1):
        raise MoeprepError(f"alpha {alpha} and beta {beta} must lie in [0, 1]")
    out = []
    for t in range(n + 1):
        both_miss = max((n - t) * (n - t - 1) / (n * (n - 1)), 0.0)
        one_hits = 2 * t * (n - t) / (n * (n - 1))
        single = (1 - t / n) * (1 - beta)
        pair = 2 * both_miss * (1 - beta) + both_miss * beta + one_hits * (1 - beta)
        out.append(alpha * single + (1 - alpha) * pair)
    return out


def allocate(curves: Sequence[Sequence[float]], record_bytes: Sequence[int], capacity: float,
             min_slots: Sequence[int] | None = None,
             tiebreak: Sequence[Sequence[float]] | None = None) -> tuple[tuple[int, ...], float]:
    """The slots per cell minimising ``sum_c curves[c][t_c]`` with ``sum_c t_c * record_bytes[c] <= capacity``.

    ``curves[c]`` lists the cost of cell c at t = 0..n_c records, so no cell is ever given more than
    n_c; a cost of ``math.inf`` marks a t the cell cannot take. ``min_slots[c]``: the fewest records
    cell c may get. ``tiebreak[c][t]``: a second cost, compared only between allocations of equal cost
    (within 1e-12): modelled seconds are flat where every read hides behind compute, and the bytes read
    then still say which allocation is better. Returns (slots per cell, total cost); exact: the frontier
    keeps every allocation not beaten in both bytes and (cost, tiebreak). Ties go to fewer bytes, then to
    the earlier cells.
    """
    if len(curves) != len(record_bytes):
        raise MoeprepError(f"{len(curves)} cost curves but {len(record_bytes)} record sizes")
    if tiebreak is not None and [len(c) for c in tiebreak] != [len(c) for c in curves]:
        raise MoeprepError("the tie-break curves must have the cost curves' lengths")
    lows = list(min_slots) if min_slots is not None else [0] * len(curves)
    second = tiebreak if tiebreak is not None else [[0.0] * len(c) for c in curves]
    # (bytes, cost, tie-break, slots)
    frontier: list[tuple[float, float, float, tuple[int, ...]]] = [(0, 0.0, 0.0, ())]
    for c, (curve, nbytes) in enumerate(zip(curves, record_bytes, strict=True)):
        if nbytes <= 0:
            raise MoeprepError(f"cell {c}: record bytes must be positive, got {nbytes}")
        grown = [(b + t * nbytes, cost + curve[t], tie + second[c][t], slots + (t,))
                 for b, cost, tie, slots in frontier
                 for t in range(lows[c], len(curve))
                 if math.isfinite(curve[t]) and b + t * nbytes <= capacity]
        if not grown:
            raise MoeprepError(f"no allocation fits {capacity:,.0f} bytes: cell {c} needs at least {lows[c]} "
                               f"record(s) of {nbytes:,} bytes beyond the others' minimum; raise the budget")
        grown.sort(key=lambda s: (s[0], s[1], s[2], tuple(-t for t in s[3])))
        frontier, best = [], (math.inf, math.inf)
        for state in grown:
            if _better((state[1], state[2]), best):
                frontier.append(state)
                best = (state[1], state[2])
    _, cost, _, slots = frontier[-1]  # the frontier improves with every byte added: its last state is the best
    return slots, cost


def _better(cost: tuple[float, float], best: tuple[float, float]) -> bool:
    """``cost`` beats ``best``: lower by more than 1e-12, or equal within it and a lower tie-break."""
    if cost[0] < best[0] - 1e-12:
        return True
    return abs(cost[0] - best[0]) <= 1e-12 and cost[1] < best[1]
