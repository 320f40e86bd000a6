"""Confidence intervals against hand-computed values (hkrag/stats.py)."""

import numpy as np
import pytest

from hkrag.stats import (
    bootstrap_interval,
    hierarchical_bootstrap,
    hierarchical_means,
    hierarchical_paired_bootstrap,
    paired_bootstrap,
    wilson_interval,
)


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


def test_hierarchical_bootstrap_with_identical_seeds_is_the_query_bootstrap():
    per_query = [0.0, 0.2, 0.5, 0.9, 1.0, 0.3, 0.7]
    result = hierarchical_bootstrap([per_query] * 4, n_resamples=1000, seed=3)
    assert result["mean"] == pytest.approx(sum(per_query) / len(per_query))
    assert (result["low"], result["high"]) == pytest.approx(bootstrap_interval(per_query, n_resamples=1000, seed=3))


def test_hierarchical_resamples_of_two_seeds_and_one_query_by_hand():
    # Seeds score 0 and 1 on one query: a resample draws (0,0), (0,1), (1,0) or (1,1), so its mean is
    # 0, ½ or 1 with probabilities ¼, ½, ¼; the 30 % and 70 % quantiles are both ½.
    means = hierarchical_means(np.array([[0.0], [1.0]]), n_resamples=8000, seed=0)
    assert set(np.unique(means)) == {0.0, 0.5, 1.0}
    assert [np.mean(means == v) for v in (0.0, 0.5, 1.0)] == pytest.approx([0.25, 0.5, 0.25], abs=0.02)
    result = hierarchical_bootstrap([[0.0], [1.0]], confidence=0.4, n_resamples=8000)
    assert result == {"mean": 0.5, "low": 0.5, "high": 0.5}


def test_hierarchical_interval_includes_the_seed_variance_the_query_bootstrap_leaves_out():
    rng = np.random.default_rng(0)
    queries = rng.uniform(size=40)
    scores = queries + np.array([[-0.2], [0.0], [0.2]])  # the seeds shift every query alike
    hierarchical = hierarchical_bootstrap(scores, seed=1)
    low, high = bootstrap_interval(scores.mean(axis=0), seed=1)
    assert hierarchical["high"] - hierarchical["low"] > 1.5 * (high - low)


def test_hierarchical_paired_difference_of_identical_runs_is_zero():
    scores = np.random.default_rng(1).uniform(size=(5, 30))
    assert hierarchical_paired_bootstrap(scores, scores) == {"diff": 0.0, "low": 0.0, "high": 0.0, "p_value": 1.0}


def test_hierarchical_paired_difference_of_a_constant_shift_is_that_shift():
    scores = np.random.default_rng(2).uniform(size=(3, 20))
    result = hierarchical_paired_bootstrap(scores + 0.1, scores)
    assert (result["diff"], result["low"], result["high"]) == pytest.approx((0.1, 0.1, 0.1))
    assert result["p_value"] == 0.0


def test_hierarchical_bootstrap_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"scores must be a finite \(seeds, queries\) matrix"):
        hierarchical_bootstrap([1.0, 2.0])
    with pytest.raises(ValueError, match=r"a has shape \(2, 3\), b \(3, 3\)"):
        hierarchical_paired_bootstrap(np.zeros((2, 3)), np.zeros((3, 3)))
