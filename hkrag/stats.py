"""Confidence intervals for the RAG reports: Wilson for accuracies, percentile bootstrap for means and differences.

The paper reports accuracies on a few hundred queries (ChartQA test: 150) without intervals; at n = 150 a
95 % interval is about ±8 points wide, larger than most gaps of Tables 3, 4 and 6. Every interval here is
two-sided at ``confidence`` (default 95 %); the bootstraps are seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
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


def _seed_query_matrix(scores: Sequence[Sequence[float]] | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(scores, dtype=float)
    if array.ndim != 2 or 0 in array.shape or not np.isfinite(array).all():
        raise ValueError(f"{name} must be a finite (seeds, queries) matrix with at least one of each, got shape "
                         f"{array.shape}")
    return array


def _draw_counts(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``(size, n)``: how often each of ``n`` items is drawn in each of ``size`` resamples of ``n`` draws."""
    draws = rng.integers(0, n, size=(size, n)) + n * np.arange(size)[:, None]
    return np.bincount(draws.ravel(), minlength=size * n).reshape(size, n)


def hierarchical_means(scores: np.ndarray, n_resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """Means of ``n_resamples`` two-level resamples of a ``(seeds, queries)`` score matrix.

    Each resample draws the seeds with replacement and, independently, the queries with replacement,
    and averages the drawn seeds' scores on the drawn queries. Queries are drawn once per resample for
    all seeds: every seed was scored on the same test queries (a crossed design), so a query that is
    drawn twice counts twice in every seed. The statistic is ``w_s · X · w_q / (S·Q)`` with ``w`` the
    draw counts, computed for :data:`CHUNK` resamples at once. The query draws come from
    ``default_rng(seed)`` exactly as in :func:`bootstrap_interval`, so with every seed's row equal the
    resampled means are those of the query bootstrap.
    """
    n_seeds, n_queries = scores.shape
    query_rng, seed_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    means = []
    for start in range(0, n_resamples, CHUNK):
        size = min(CHUNK, n_resamples - start)
        query_counts = _draw_counts(query_rng, n_queries, size)
        seed_counts = _draw_counts(seed_rng, n_seeds, size)
        means.append(np.einsum("cs,sq,cq->c", seed_counts, scores, query_counts) / (n_seeds * n_queries))
    return np.concatenate(means)


def hierarchical_bootstrap(
    scores: Sequence[Sequence[float]] | np.ndarray, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """Mean score over seeds and queries with a percentile interval that includes seed-to-seed variance.

    ``scores[s, q]`` is training seed ``s``'s score on test query ``q`` (e.g. nDCG@5). Resampling the queries
    of seed-averaged scores (:func:`bootstrap_interval`) leaves out how much another training seed would
    move the result; here every resample also redraws the seeds (:func:`hierarchical_means`). With one seed,
    or identical seeds, it is the query bootstrap. Returns ``{"mean", "low", "high"}``.
    """
    _z(confidence)
    array = _seed_query_matrix(scores, "scores")
    low, high = np.quantile(hierarchical_means(array, n_resamples, seed), [(1 - confidence) / 2, (1 + confidence) / 2])
    return {"mean": float(array.mean()), "low": float(low), "high": float(high)}


def hierarchical_paired_bootstrap(
    a: Sequence[Sequence[float]] | np.ndarray, b: Sequence[Sequence[float]] | np.ndarray, confidence: float = 0.95,
    n_resamples: int = 2000, seed: int = 0,
) -> dict[str, float]:
    """The difference ``mean(a) − mean(b)`` of two conditions run with the same seeds on the same queries.

    ``a[s, q]`` and ``b[s, q]`` share seed ``s`` (same data order and warm start) and query ``q``; the
    differences ``a − b`` are resampled over seeds and queries as in :func:`hierarchical_bootstrap`, so the
    interval includes seed variance and stays paired. Identical runs give ``[0, 0]``. Returns
    ``{"diff", "low", "high", "p_value"}``, the p-value as in :func:`paired_bootstrap`.
    """
    _z(confidence)
    a_array, b_array = _seed_query_matrix(a, "a"), _seed_query_matrix(b, "b")
    if a_array.shape != b_array.shape:
        raise ValueError(f"paired runs need the same seeds and queries: a has shape {a_array.shape}, "
                         f"b {b_array.shape}")
    diffs = hierarchical_means(a_array - b_array, n_resamples, seed)
    low, high = np.quantile(diffs, [(1 - confidence) / 2, (1 + confidence) / 2])
    p_value = min(1.0, 2 * min(np.mean(diffs <= 0), np.mean(diffs >= 0)))
    return {"diff": float((a_array - b_array).mean()), "low": float(low), "high": float(high),
            "p_value": float(p_value)}


@dataclass(frozen=True)
class Claim:
    """A claim of the paper: condition ``better`` scores above ``worse`` (on ``evidence`` queries, where a table
    tells evidence types apart)."""

    text: str
    better: str
    worse: str
    evidence: str = "all"


def verdict(low: float, high: float, margin: float) -> str:
    """A claim "better beats worse" judged by the interval ``[low, high]`` of better − worse: ``reproduced`` when
    it lies above 0, ``not reproduced`` when it lies below ``margin`` (no gain as large as the smallest effect of
    interest), else ``inconclusive``."""
    if low > 0:
        return "reproduced"
    return "not reproduced" if high < margin else "inconclusive"
