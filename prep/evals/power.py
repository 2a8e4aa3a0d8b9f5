"""What a paired accuracy check can resolve: the resolution of n items, the items a difference needs, and the
tolerance stated as a paired test.

An item-by-item comparison of two models is a paired design: only the items one model gets right and the other
wrong (the flips) carry information about the difference, so McNemar's test on the flips is the test, and the
number of items needed to tell a difference of ``d`` from none depends on the flip rate f (the share of items that
flip either way), not on the accuracies: with the normal approximation of Connor (1987),

    n = (z_{1 - alpha/2} sqrt(f) + z_{1 - beta} sqrt(f - d^2))^2 / d^2.

A device team reads these beside each delta in report.md: at n = 20 one item is 5 points, and a delta of one item
says nothing.
"""

from __future__ import annotations

import math
from statistics import NormalDist

ALPHA = 0.05
POWER = 0.8


def resolution_points(n: int) -> float:
    """Points of accuracy one item moves on a suite of ``n`` items."""
    return 100.0 / n if n else math.inf


def items_to_resolve(flip_rate: float, difference: float = 0.01, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Items a paired comparison needs for McNemar's test (two-sided ``alpha``) to find a true accuracy difference of
    ``difference`` (a share: 0.01 is one point) with probability ``power``, at ``flip_rate``; None when no flips
    were seen (the rate is unknown, not zero: the suite cannot say how noisy the pair is)."""
    if not 0 < difference <= 1:
        raise ValueError(f"difference is a share of items in (0, 1], got {difference}")
    if flip_rate <= 0:
        return None
    f = max(flip_rate, difference)  # a difference of d needs at least d of the items to flip
    z = NormalDist()
    root = z.inv_cdf(1 - alpha / 2) * math.sqrt(f) + z.inv_cdf(power) * math.sqrt(f - difference ** 2)
    return math.ceil(root ** 2 / difference ** 2)


def paired_verdict(delta: float, flips: dict, n: int, mcnemar_p: float, tolerance_points: float | None,
                   alpha: float = ALPHA) -> dict:
    """The tolerance as a paired test on one suite: the delta within ``tolerance_points`` of none (None: no tolerance
    stated), McNemar's p on the flips, whether the difference is detectable at ``alpha``, the resolution of the
    suite and the items a one-point difference would need at the flip rate measured here."""
    flipped = flips["right_to_wrong"] + flips["wrong_to_right"]
    flip_rate = flipped / n if n else 0.0
    return {"delta_points": 100 * delta,
            "within_tolerance": None if tolerance_points is None else abs(100 * delta) <= tolerance_points + 1e-9,
            "tolerance_points": tolerance_points, "mcnemar_p": mcnemar_p, "significant": mcnemar_p < alpha,
            "resolution_points": resolution_points(n), "flip_rate": flip_rate,
            "items_for_one_point": items_to_resolve(flip_rate, 0.01, alpha)}
