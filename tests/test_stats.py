"""Confidence intervals against hand-computed values (hkrag/stats.py)."""

import pytest

from hkrag.stats import bootstrap_interval, paired_bootstrap, wilson_interval


def test_wilson_8_of_10_by_hand():
    # z = 1.959964, z^2 = 3.841459, n = 10, p = 0.8
    # denominator = 1 + 0.3841459 = 1.3841459
    # center = (0.8 + 0.1920729) / 1.3841459 = 0.716738
    # half = 1.959964 * sqrt(0.016 + 0.0096036) / 1.3841459 = 1.959964 * 0.1600113 / 1.3841459 = 0.226577
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.716738 - 0.226577, abs=1e-5)  # 0.490161
    assert high == pytest.approx(0.716738 + 0.226577, abs=1e-5)  # 0.943315


def test_wilson_zero_successes_is_not_empty():
    # p = 0: center = half = (z^2 / 2n) / (1 + z^2 / n), so the interval is [0, (z^2/n) / (1 + z^2/n)].
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(0.3841459 / 1.3841459, abs=1e-6)  # 0.277533


def test_wilson_rejects_bad_counts():
    with pytest.raises(ValueError, match="n=0"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="got 11"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(5, 10, confidence=1.5)


def test_bootstrap_of_a_constant_is_a_point():
    assert bootstrap_interval([0.7] * 20) == pytest.approx((0.7, 0.7))


def test_bootstrap_matches_the_normal_approximation_and_is_seeded():
    values = [1.0] * 50 + [0.0] * 50  # mean 0.5, standard error sqrt(0.25 / 100) = 0.05: about 0.5 +- 0.098
    low, high = bootstrap_interval(values, seed=1)
    assert low == pytest.approx(0.402, abs=0.02)
    assert high == pytest.approx(0.598, abs=0.02)
    spread = [float(i % 7) for i in range(30)]  # non-binary values, so the quantiles move with the seed
    assert bootstrap_interval(spread, seed=1) == bootstrap_interval(spread, seed=1)
    assert bootstrap_interval(spread, seed=1) != bootstrap_interval(spread, seed=2)


def test_paired_bootstrap_constant_shift():
    a = [0.2, 0.5, 0.9, 0.4]
    result = paired_bootstrap([x + 0.1 for x in a], a)
    assert result["diff"] == pytest.approx(0.1)
    assert (result["low"], result["high"]) == pytest.approx((0.1, 0.1))
    assert result["p_value"] == 0.0


def test_paired_bootstrap_identical_runs():
    result = paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1])
    assert result == {"diff": 0.0, "low": 0.0, "high": 0.0, "p_value": 1.0}


def test_paired_interval_is_narrower_than_an_unpaired_one():
    a = [1.0] * 50 + [0.0] * 50
    b = [0.0] * 5 + [1.0] * 45 + [0.0] * 50  # b loses 5 of a's correct answers: diff 0.05
    result = paired_bootstrap(a, b)
    assert result["diff"] == pytest.approx(0.05)
    assert 0 < result["low"] < 0.05 < result["high"] <= 0.1
    unpaired_width = bootstrap_interval(a)[1] - bootstrap_interval(a)[0]
    assert result["high"] - result["low"] < unpaired_width / 2


def test_paired_bootstrap_needs_the_same_queries():
    with pytest.raises(ValueError, match="len\\(a\\)=3 != len\\(b\\)=2"):
        paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_interval([])
