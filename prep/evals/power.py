"""What a paired accuracy check can resolve: the resolution of n items, the items a difference needs, and the
tolerance stated as a paired test.

An item-by-item comparison of two models is a paired design: only the items one model gets right and the other
wrong (the flips) carry information about the difference, so McNemar's test on the flips is the test, and the
number of items needed to tell a difference of ``d`` from none depends on the flip rate f (the share of items that
flip either way), not on the accuracies: with the normal approximation of Connor (1987),

    n = (z_{1 - alpha/2} sqrt(f) + z_{1 - beta} sqrt(f - d^2))^2 / d^2.

A device team reads these beside each delta in report.md: at n = 20 one item is 5 points, and a delta of one item
says nothing. ``paired_interval`` bounds the delta itself: a 95% interval from the same flips, so "within one point"
is a statement about the interval, not about the point estimate.
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


def detectable_difference(flip_rate: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest accuracy difference (a share) that ``n`` paired items find with ``power`` at ``flip_rate``: the
    inverse of ``items_to_resolve``, what a suite capped at ``n`` items resolves. None when no flips were seen (the
    noise is unknown) or when ``n`` is too few items to find even a difference of every item."""
    if flip_rate <= 0 or items_to_resolve(flip_rate, 1.0, alpha, power) > n:
        return None
    low, high = 0.0, 1.0  # items_to_resolve falls as the difference grows: bisect on it
    for _ in range(60):
        middle = (low + high) / 2
        if items_to_resolve(flip_rate, middle, alpha, power) <= n:
            high = middle
        else:
            low = middle
    return high


def paired_interval(right_to_wrong: int, wrong_to_right: int, n: int, confidence: float = 1 - ALPHA
                    ) -> tuple[float, float]:
    """The ``confidence`` interval (shares, low and high) of a paired difference of two proportions, prepared minus
    original, (wrong_to_right - right_to_wrong) / n, from the flips of ``n`` paired items.

    Method: the Wald interval on the paired difference with the Agresti-Min adjustment (Agresti and Min 2005,
    "Simple improved confidence intervals for comparing matched proportions", Statistics in Medicine 24:729-740):
    add one half to each of the four cells of the 2x2 table (b, c flips; n + 2 items), then
    d = (c - b) / (n + 2) and var = ((b + c + 1) - (c - b)^2 / (n + 2)) / (n + 2)^2. Unlike the plain Wald interval
    it keeps its coverage near the nominal level when flips are few (a plain Wald interval from zero flips has width
    zero), and it is clipped to [-1, 1]."""
    if n < 1 or right_to_wrong < 0 or wrong_to_right < 0 or right_to_wrong + wrong_to_right > n:
        raise ValueError(f"flips {right_to_wrong} + {wrong_to_right} must be non-negative counts of n = {n} >= 1 items")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence is a probability in (0, 1), got {confidence}")
    b, c, m = right_to_wrong + 0.5, wrong_to_right + 0.5, n + 2
    difference = (c - b) / m
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(max((b + c) - (c - b) ** 2 / m, 0.0)) / m
    return max(-1.0, difference - half), min(1.0, difference + half)


def mean_difference_interval(differences, confidence: float = 1 - ALPHA) -> tuple[float, float]:
    """The ``confidence`` interval of the mean of paired per-item differences (prepared minus original) of a continuous
    score (TruthfulQA MC2's true-answer mass): the mean plus or minus z times the standard error. The suites hold
    hundreds of items, where the normal approximation is close; a single item gives an interval of width zero."""
    values = [float(d) for d in differences]
    if not values:
        raise ValueError("no differences")
    n = len(values)
    mean = sum(values) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * spread / math.sqrt(n)
    return mean - half, mean + half


def suite_interval(suite: dict, alpha: float = ALPHA) -> tuple[float, float]:
    """A suite's delta interval (shares): its own ``delta_interval`` where the scoring measured one (a continuous
    score), else from its flips (``paired_interval``)."""
    if suite.get("delta_interval") is not None:
        low, high = suite["delta_interval"]
        return float(low), float(high)
    flips = suite["flips"]
    return paired_interval(flips["right_to_wrong"], flips["wrong_to_right"], suite["n"], 1 - alpha)


def paired_verdict(delta: float, flips: dict, n: int, mcnemar_p: float, tolerance_points: float | None,
                   alpha: float = ALPHA, interval: tuple[float, float] | None = None) -> dict:
    """The tolerance as a paired test on one suite: the delta within ``tolerance_points`` of none (None: no tolerance
    stated), McNemar's p on the flips, whether the difference is detectable at ``alpha``, the resolution of the
    suite, the items a one-point difference would need at the flip rate measured here, and the delta's
    ``1 - alpha`` interval (``interval`` where given, shares: for TruthfulQA MC2, whose delta is a mean of probability
    masses, the interval of the mean per-item difference; else from the flips, ``paired_interval``) with
    ``resolved_to_one_point`` when the whole interval lies within one point of none. (MC2's McNemar p counts the items
    whose true-answer mass crosses one half.)"""
    flipped = flips["right_to_wrong"] + flips["wrong_to_right"]
    flip_rate = flipped / n if n else 0.0
    low, high = interval if interval is not None else paired_interval(flips["right_to_wrong"],
                                                                      flips["wrong_to_right"], n, 1 - alpha)
    return {"delta_points": 100 * delta,
            "within_tolerance": None if tolerance_points is None else abs(100 * delta) <= tolerance_points + 1e-9,
            "tolerance_points": tolerance_points, "mcnemar_p": mcnemar_p, "significant": mcnemar_p < alpha,
            "resolution_points": resolution_points(n), "flip_rate": flip_rate,
            "items_for_one_point": items_to_resolve(flip_rate, 0.01, alpha),
            "interval_points": [100 * low, 100 * high],
            "resolved_to_one_point": -1 - 1e-9 <= 100 * low and 100 * high <= 1 + 1e-9}
