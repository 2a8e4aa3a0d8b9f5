"""What the paired accuracy check can resolve (``prep.evals.power``), against an exact computation: the power of
McNemar's exact test enumerated over every outcome of n paired items."""

from __future__ import annotations

import math

import pytest

from prep.evals.compare import mcnemar_p
from prep.evals.power import items_to_resolve, paired_verdict, resolution_points


def exact_power(n: int, right_to_wrong: float, wrong_to_right: float, alpha: float = 0.05) -> float:
    """P(McNemar's exact p < alpha) when each item flips right->wrong with probability ``right_to_wrong`` and
    wrong->right with ``wrong_to_right``: every (discordant count, split) weighted by its multinomial probability."""
    flip = right_to_wrong + wrong_to_right
    share = right_to_wrong / flip
    total = 0.0
    for m in range(n + 1):
        p_m = math.comb(n, m) * flip ** m * (1 - flip) ** (n - m)
        if p_m < 1e-15:
            continue
        for b in range(m + 1):
            if mcnemar_p(b, m - b) < alpha:
                total += p_m * math.comb(m, b) * share ** b * (1 - share) ** (m - b)
    return total


@pytest.mark.parametrize("flip_rate, difference", [(0.10, 0.05), (0.20, 0.08), (0.06, 0.04)])
def test_the_items_it_names_give_mcnemars_exact_test_the_power_asked_for(flip_rate, difference):
    n = items_to_resolve(flip_rate, difference)
    r2w, w2r = (flip_rate + difference) / 2, (flip_rate - difference) / 2  # a loss of `difference`, `flip_rate` flips
    power = exact_power(n, r2w, w2r)
    assert 0.72 <= power <= 0.9, (n, power)  # the normal approximation, against the exact (conservative) test
    assert exact_power(n // 3, r2w, w2r) < 0.55  # a third of the items cannot


def test_one_point_needs_more_items_the_noisier_the_pair():
    counts = [items_to_resolve(f) for f in (0.02, 0.05, 0.1, 0.2)]
    assert counts == sorted(counts) and counts[0] > 100
    assert items_to_resolve(0.0) is None  # no flips seen: the noise is unknown, not zero
    assert resolution_points(20) == 5.0 and resolution_points(400) == 0.25
    with pytest.raises(ValueError):
        items_to_resolve(0.1, 0.0)


def test_the_tolerance_is_a_paired_test_per_suite():
    flips = {"right_to_wrong": 9, "wrong_to_right": 1}
    v = paired_verdict(-0.02, flips, 400, mcnemar_p(9, 1), tolerance_points=1.0)
    assert v["delta_points"] == pytest.approx(-2.0) and v["within_tolerance"] is False
    assert v["significant"] and v["mcnemar_p"] == pytest.approx(mcnemar_p(9, 1))
    assert v["resolution_points"] == 0.25 and v["flip_rate"] == pytest.approx(10 / 400)
    assert v["items_for_one_point"] == items_to_resolve(10 / 400)
    same = paired_verdict(0.0, {"right_to_wrong": 1, "wrong_to_right": 1}, 20, 1.0, tolerance_points=5.0)
    assert same["within_tolerance"] and not same["significant"]
    assert paired_verdict(0.0, flips, 20, 1.0, None)["within_tolerance"] is None


def test_the_interval_of_a_mean_difference_is_the_normal_one_computed_by_hand():
    """TruthfulQA MC2's delta is a mean of per-item differences of probability masses: its interval is the mean plus
    or minus 1.96 standard errors (sample standard deviation over the square root of n)."""
    from statistics import NormalDist, stdev

    from prep.evals.power import mean_difference_interval, paired_verdict, suite_interval

    diffs = [0.1, -0.05, 0.0, 0.2, -0.1, 0.05, 0.0, 0.15]
    mean, se = sum(diffs) / 8, stdev(diffs) / 8 ** 0.5
    z = NormalDist().inv_cdf(0.975)
    low, high = mean_difference_interval(diffs)
    assert low == pytest.approx(mean - z * se) and high == pytest.approx(mean + z * se)
    suite = {"n": 8, "delta": mean, "flips": {"right_to_wrong": 3, "wrong_to_right": 0}, "delta_interval": [low, high]}
    assert suite_interval(suite) == (low, high)  # its own interval, not one from the flips
    verdict = paired_verdict(mean, suite["flips"], 8, 0.25, None, interval=(low, high))
    assert verdict["interval_points"] == [pytest.approx(100 * low), pytest.approx(100 * high)]
    assert suite_interval({k: v for k, v in suite.items() if k != "delta_interval"})[0] < 0  # 3 losses from flips
