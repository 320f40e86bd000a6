"""Confidence intervals for the RAG reports: Wilson for accuracies, percentile bootstrap for means and differences.

The paper reports accuracies on a few hundred queries (ChartQA test: 150) without intervals; at n = 150 a
95 % interval is about ±8 points wide, larger than most gaps of Tables 3, 4 and 6. Every interval here is
two-sided at ``confidence`` (default 95 %); the bootstraps are seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np

CHUNK = 256
"""Bootstrap resamples drawn at once (bounds memory to CHUNK × n indices)."""


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``correct / n`` (Wilson 1927).

    ``(p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n)``; unlike the normal interval it stays inside
    [0, 1] and is not empty at p = 0 or 1.
    """
    if n <= 0:
        raise ValueError(f"a proportion needs n >= 1 samples, got n={n}")
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be in [0, n={n}], got {correct}")
    z = _z(confidence)
    p = correct / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def _resampled_means(values: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Means of ``n_resamples`` resamples with replacement of the rows of ``values`` (shape ``(n,)`` or ``(n, m)``)."""
    rng = np.random.default_rng(seed)
    n = len(values)
    means = []
    for start in range(0, n_resamples, CHUNK):
        indices = rng.integers(0, n, size=(min(CHUNK, n_resamples - start), n))
        means.append(values[indices].mean(axis=1))
    return np.concatenate(means)


def _as_array(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers, got shape {array.shape}")
    return array


def bootstrap_interval(
    values: Sequence[float], confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (e.g. per-query ANLS)."""
    _z(confidence)
    means = _resampled_means(_as_array(values, "values"), n_resamples, seed)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)


def cluster_bootstrap_interval(
    values: Sequence[float], clusters: Sequence[Hashable], confidence: float = 0.95, n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` that resamples whole clusters, not rows.

    For rows that are not independent samples: the same question evaluated in two pools (single and all)
    is one cluster, so it is drawn (or not) as a whole. Each resample draws as many clusters as there are,
    with replacement; its statistic is the mean over all rows of the drawn clusters. With every cluster of
    one row this is :func:`bootstrap_interval` (the same draws for the same seed).
    """
    _z(confidence)
    array = _as_array(values, "values")
    if len(clusters) != len(array):
        raise ValueError(f"need one cluster per value: {len(clusters)} clusters for {len(array)} values")
    index = {key: i for i, key in enumerate(dict.fromkeys(clusters))}
    members = np.array([index[key] for key in clusters])
    sums = np.bincount(members, weights=array, minlength=len(index))
    counts = np.bincount(members, minlength=len(index)).astype(float)
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, n_resamples, CHUNK):
        drawn = rng.integers(0, len(index), size=(min(CHUNK, n_resamples - start), len(index)))
        means.append(sums[drawn].sum(axis=1) / counts[drawn].sum(axis=1))
    alpha = (1 - confidence) / 2
    low, high = np.quantile(np.concatenate(means), [alpha, 1 - alpha])
    return float(low), float(high)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """The difference ``mean(a) − mean(b)`` of two configurations scored on the *same* queries, in the same order.

    Both are resampled with the same query indices, so the interval reflects the per-query differences
    (narrower than two independent intervals when the configurations agree on most queries). Returns
    ``{"diff", "low", "high", "p_value"}``; ``p_value`` is the two-sided bootstrap p-value of "no
    difference": twice the smaller share of resampled differences on either side of 0 (capped at 1).
    """
    _z(confidence)
    a_array, b_array = _as_array(a, "a"), _as_array(b, "b")
    if len(a_array) != len(b_array):
        raise ValueError(f"paired samples need the same queries: len(a)={len(a_array)} != len(b)={len(b_array)}")
    diffs = _resampled_means(a_array - b_array, n_resamples, seed)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    p_value = min(1.0, 2 * min(np.mean(diffs <= 0), np.mean(diffs >= 0)))
    return {"diff": float(a_array.mean() - b_array.mean()), "low": float(low), "high": float(high),
            "p_value": float(p_value)}


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof=1``, e.g. over training seeds); the std of one value is 0."""
    array = _as_array(values, "values")
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0
