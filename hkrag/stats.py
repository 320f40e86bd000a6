"""Confidence intervals, multiple-comparison corrections and verdicts for the reports (docs/statistics.md).

The paper reports accuracies on a few hundred queries (ChartQA test: 150) without intervals; at n = 150 a
95 % interval is about ±8 points wide, larger than most gaps of Tables 3, 4 and 6. Every interval here is
two-sided at ``confidence`` (default 95 %); the bootstraps are seeded, so a report is reproducible, and their
p-values are floored at 1/B (B resamples): a bootstrap never shows p = 0.

- One run's queries: Wilson (:func:`wilson_interval`) for an accuracy, percentile bootstraps for a mean or a
  paired difference (:func:`bootstrap_interval`, :func:`paired_bootstrap`, :func:`cluster_bootstrap_interval`).
- Several training seeds on the same questions (a crossed seeds × questions design): :func:`crossed_interval`,
  a t interval from the two-way random-effects ANOVA, which holds its coverage with 3–5 seeds where the crossed
  percentile bootstrap (:func:`hierarchical_bootstrap`) does not (tests/test_interval_coverage.py). Rows that
  share a question are first averaged into one column (:func:`cluster_rows`). A 0/1 share near its ceiling:
  :func:`share_interval` (logit-normal seed shares, a generalized pivot), which holds its level where the t interval
  falls short.
- A family of claims: :func:`holm` adjusts their p-values, :func:`corrected_verdicts` gives Bonferroni-level
  intervals and the :func:`verdict` of each.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from scipy import special
from scipy import stats as scipy_stats

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
    difference": twice the smaller share of resampled differences on either side of 0 (capped at 1), floored at
    1/B (:func:`bootstrap_p_value`).
    """
    _z(confidence)
    a_array, b_array = _as_array(a, "a"), _as_array(b, "b")
    if len(a_array) != len(b_array):
        raise ValueError(f"paired samples need the same queries: len(a)={len(a_array)} != len(b)={len(b_array)}")
    diffs = _resampled_means(a_array - b_array, n_resamples, seed)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    return {"diff": float(a_array.mean() - b_array.mean()), "low": float(low), "high": float(high),
            "p_value": bootstrap_p_value(diffs)}


def bootstrap_p_value(resampled: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "the statistic is 0" from its ``B`` resampled values: twice the smaller
    share on either side of 0, capped at 1 and floored at ``1/B``. No resample on the far side of 0 says
    p < 1/B, not p = 0: B resamples cannot resolve a smaller p."""
    p_value = 2 * min(np.mean(resampled <= 0), np.mean(resampled >= 0))
    return float(min(1.0, max(p_value, 1 / len(resampled))))


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


def seed_matrix(by_seed: Mapping[Any, Mapping[Any, float]]) -> tuple[list[Any], list[Any], np.ndarray]:
    """The sorted seeds, the sorted questions and the ``(seeds, questions)`` matrix of per-seed scores; every seed
    must have scored the same questions (the crossed interval pairs each column across seeds): otherwise a
    ValueError naming the first seed that differs and some of the questions."""
    if not by_seed:
        raise ValueError("no seed scored any question")
    seeds = sorted(by_seed)
    questions = sorted(by_seed[seeds[0]])
    for seed in seeds[1:]:
        if set(by_seed[seed]) != set(questions):
            differ = sorted(set(by_seed[seed]) ^ set(questions))
            raise ValueError(f"seed {seed} scored other questions than seed {seeds[0]} ({len(differ)} differ, e.g. "
                             f"{differ[:3]}): every seed must answer the same questions")
    return seeds, questions, np.array([[by_seed[s][q] for q in questions] for s in seeds], dtype=float)


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
    or identical seeds, it is the query bootstrap. Returns ``{"mean", "low", "high"}``. With 3–5 seeds it
    under-covers where seed variance matters (0.77–0.87 for a nominal 0.95, docs/statistics.md): the reports use
    :func:`crossed_interval`.
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
    return {"diff": float((a_array - b_array).mean()), "low": float(low), "high": float(high),
            "p_value": bootstrap_p_value(diffs)}


def cluster_rows(values: Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
                 clusters: Sequence[Hashable]) -> np.ndarray:
    """Average the rows that share a cluster (e.g. a question asked in two pools) into one column per cluster.

    ``values`` is a ``(seeds, rows)`` matrix (or one seed's ``(rows,)`` vector) of per-row scores or paired
    differences, ``clusters[i]`` row ``i``'s cluster (e.g. its ``(data set, question id)``). Rows of one
    question are not independent samples: counting them as such would narrow every interval. Returns the
    ``(seeds, clusters)`` matrix of cluster means, the clusters in the order of their first row, ready for
    :func:`crossed_interval`. Every cluster weighs alike, whatever its number of rows.
    """
    array = np.asarray(values, dtype=float)
    matrix = array[None, :] if array.ndim == 1 else array
    if matrix.ndim != 2 or matrix.shape[1] != len(clusters) or 0 in matrix.shape:
        raise ValueError(f"cluster_rows needs one cluster per row: values of shape {array.shape} (seeds, rows) "
                         f"for {len(clusters)} clusters")
    index = {key: i for i, key in enumerate(dict.fromkeys(clusters))}
    members = np.array([index[key] for key in clusters])
    counts = np.bincount(members, minlength=len(index))
    sums = np.stack([np.bincount(members, weights=row, minlength=len(index)) for row in matrix])
    return sums / counts


def _mean_squares(array: np.ndarray) -> dict[str, tuple[float, int]]:
    """``{"seed", "question", "residual"}`` → (mean square, degrees of freedom) of the two-way ANOVA without
    replication of a ``(S, Q)`` matrix, S, Q ≥ 2 (seed and question main effects, their interaction as residual)."""
    n_seeds, n_questions = array.shape
    grand = array.mean()
    seed_means, question_means = array.mean(axis=1), array.mean(axis=0)
    residual = array - seed_means[:, None] - question_means[None, :] + grand
    df_residual = (n_seeds - 1) * (n_questions - 1)
    return {"seed": (n_questions * float(((seed_means - grand) ** 2).sum()) / (n_seeds - 1), n_seeds - 1),
            "question": (n_seeds * float(((question_means - grand) ** 2).sum()) / (n_questions - 1), n_questions - 1),
            "residual": (float((residual ** 2).sum()) / df_residual, df_residual)}


def variance_components(scores: Sequence[Sequence[float]] | np.ndarray) -> dict[str, float]:
    """Seed, question and residual variance of a ``(seeds, questions)`` matrix (S, Q ≥ 2) by the expected mean
    squares of the crossed random-effects model ``x[s, q] = μ + a_s + b_q + e_sq``:
    E[MS_seed] = σ²_e + Q·σ²_s, E[MS_question] = σ²_e + S·σ²_q, E[MS_residual] = σ²_e, so
    σ²_s = (MS_seed − MS_residual)/Q and σ²_q = (MS_question − MS_residual)/S, each clipped at 0 (a variance is
    not negative; a negative estimate is a component too small to see). Also returns the mean squares."""
    array = _seed_query_matrix(scores, "scores")
    if min(array.shape) < 2:
        raise ValueError(f"variance components need at least 2 seeds and 2 questions, got shape {array.shape}")
    squares = _mean_squares(array)
    ms_seed, ms_question, ms_residual = (squares[k][0] for k in ("seed", "question", "residual"))
    n_seeds, n_questions = array.shape
    return {"seed": max(0.0, (ms_seed - ms_residual) / n_questions),
            "question": max(0.0, (ms_question - ms_residual) / n_seeds), "residual": ms_residual,
            "ms_seed": ms_seed, "ms_question": ms_question, "ms_residual": ms_residual}


CROSSED = "crossed seeds x questions: two-way random-effects ANOVA, t with Satterthwaite df"
ONE_SEED = "one seed: t over questions (question variance only; seed variance not estimable)"
ONE_QUESTION = "one question: t over seeds (seed variance only)"
ONE_VALUE = "one seed and one question: no interval (unbounded, p = 1)"


TIE = 1e-9
"""Relative difference below which two mean squares count as equal (a variance component of rounding error
would enter the Satterthwaite df with the full variance of both mean squares, and collapse it)."""


def _t_interval(mean: float, se: float, df: float, confidence: float) -> tuple[float, float]:
    if math.isinf(se):
        return -math.inf, math.inf
    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, df)) * se
    return mean - half, mean + half


P_FLOOR = float(np.finfo(float).tiny)
"""The floor of a t p-value (the smallest positive normal double): a p-value is never exactly 0."""


def t_p_value(mean: float, se: float, df: float) -> float:
    """Two-sided p-value of "the mean is 0" from ``t = mean/se`` on ``df`` degrees of freedom; never exactly 0:
    a zero standard error (every score equal) gives 1 at mean 0 and the smallest positive double
    (:data:`P_FLOOR`) otherwise, and a tail beyond double precision is floored there too."""
    if se == 0:
        return 1.0 if mean == 0 else P_FLOOR
    if math.isinf(se):
        return 1.0
    return float(min(1.0, max(2 * scipy_stats.t.sf(abs(mean) / se, df), P_FLOOR)))


def crossed_interval(
    scores: Sequence[Sequence[float]] | np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Mean of a ``(seeds, questions)`` matrix and its t interval under the crossed seeds × questions model.

    ``scores[s, q]`` is training seed ``s``'s score on question ``q`` (or a paired difference of two conditions
    run with seed ``s`` on question ``q``; rows that share a question are first merged by :func:`cluster_rows`).
    Every seed answers the same questions, so seeds and questions are *crossed* random factors:
    ``x[s, q] = μ + a_s + b_q + e_sq`` with variances σ²_s, σ²_q, σ²_e, and the grand mean has variance
    σ²_s/S + σ²_q/Q + σ²_e/(SQ). Its estimate plugs in the components of :func:`variance_components` (clipped at
    0): (MS_seed + MS_question − MS_residual)/(SQ) when both are positive, MS_seed/(SQ) when only the seed
    component is, MS_question/(SQ) when only the question one is, MS_residual/(SQ) when neither is. Clipping
    (rather than the conservative (MS_seed + MS_question)/(SQ)) keeps the interval from widening by up to √2 when
    the residual (the seed × question interaction) is large, as it is for 0/1 scores; keeping a negative
    component's mean squares instead (e.g. always MS_seed) lets the Satterthwaite df collapse toward 0 when that
    component is near 0 (the df then carries the full variance of two mean squares that nearly cancel). The
    interval is
    ``mean ± t·se`` with the Satterthwaite degrees of freedom of that combination of mean squares
    (Satterthwaite 1946): near S − 1 when seed variance dominates, so with 3–5 seeds the t quantile is wide
    enough: in tests/test_interval_coverage.py (seed variance dominating) it covers 0.937 and 0.944 of a nominal
    0.95 with 3 and 5 seeds, where the crossed percentile bootstrap (:func:`hierarchical_bootstrap`) covers 0.768
    and 0.836.

    With one seed the seed variance cannot be estimated: the interval is the t interval over questions, and
    ``method`` says so (:data:`ONE_SEED`); with one question, the t interval over seeds; one value has no
    interval: (−inf, inf), se inf, df 0, p 1 (:data:`ONE_VALUE`; its verdict is *inconclusive*). For family-wise
    (Bonferroni-level) intervals over m claims pass ``confidence = 1 − alpha/m`` (:func:`corrected_verdicts`).
    ``bounds`` (e.g. ``(0, 1)`` for an accuracy or nDCG) intersects the interval with the range the mean can take:
    the true mean lies in it, so the coverage is unchanged, and no accuracy interval reads −3 %.

    Returns ``{"mean", "low", "high", "p_value", "df", "se", "seeds", "questions", "method"}``; ``p_value`` is
    the two-sided t p-value of mean = 0 (:func:`t_p_value`, never exactly 0). A zero standard error (every
    score alike, e.g. two identical runs) gives the point interval [mean, mean] and df of the design's seed term.
    """
    _z(confidence)
    array = _seed_query_matrix(scores, "scores")
    n_seeds, n_questions = array.shape
    if n_seeds == 1 and n_questions == 1:
        method, variance, df = ONE_VALUE, math.inf, 0.0
    elif n_seeds == 1 or n_questions == 1:
        values = array.ravel()
        method = ONE_SEED if n_seeds == 1 else ONE_QUESTION
        variance, df = float(values.var(ddof=1)) / len(values), float(len(values) - 1)
    else:
        method = CROSSED
        squares = _mean_squares(array)
        ms_seed, ms_question, ms_residual = (squares[k][0] for k in ("seed", "question", "residual"))
        tie = TIE * max(ms_seed, ms_question, ms_residual)  # mean squares equal but for rounding: no component
        coefficients = {"seed": float(ms_seed - ms_residual > tie),
                        "question": float(ms_question - ms_residual > tie)}
        coefficients["residual"] = 1.0 - coefficients["seed"] - coefficients["question"]
        terms = {k: coefficients[k] * squares[k][0] for k in squares if coefficients[k]}
        variance = sum(terms.values()) / (n_seeds * n_questions)
        denominator = sum(term ** 2 / squares[k][1] for k, term in terms.items())
        df = (sum(terms.values()) ** 2 / denominator) if denominator > 0 else float(n_seeds - 1)
    mean, se = float(array.mean()), math.sqrt(max(variance, 0.0))
    low, high = _t_interval(mean, se, df, confidence)
    if bounds is not None:
        if not bounds[0] <= mean <= bounds[1]:
            raise ValueError(f"the mean {mean} lies outside the bounds {bounds} given for it")
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return {"mean": mean, "low": low, "high": high, "p_value": t_p_value(mean, se, df), "df": df, "se": se,
            "seeds": n_seeds, "questions": n_questions, "method": method}


SHARE_PIVOT = ("seed shares' logits normal: generalized pivot over seeds (chi-square and normal draws), plus the "
               "question term; share_interval")
PIVOT_DRAWS = 20_000
"""Draws of :func:`share_interval`'s pivot: the Monte-Carlo error of its 2.5 % quantile is about 0.1 % of a share."""
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(40)


def _logit_normal_means(logits: np.ndarray, noise: float, draws: int, rng: np.random.Generator) -> np.ndarray:
    """``draws`` generalized-pivot draws of E[sigmoid(m + τ_a·Z)] from the seeds' ``logits`` ~ N(m, τ²):
    τ² = (S − 1)·s²/χ²_{S−1}, m = ℓ̄ − Z·τ/√S, τ_a² = τ² − ``noise`` (at least 0); the expectation by Gauss–Hermite."""
    n_seeds = len(logits)
    spread = logits.var(ddof=1) * (n_seeds - 1) / rng.chisquare(n_seeds - 1, draws)
    centre = logits.mean() - rng.standard_normal(draws) * np.sqrt(spread / n_seeds)
    seed_spread = np.sqrt(np.maximum(spread - noise, 0.0))
    return special.expit(centre[:, None] + seed_spread[:, None] * _NODES) @ (_WEIGHTS / _WEIGHTS.sum())


def share_interval(
    scores: Sequence[Sequence[float]] | np.ndarray, confidence: float = 0.95, draws: int = PIVOT_DRAWS, seed: int = 0
) -> dict[str, Any]:
    """Mean of a ``(seeds, questions)`` matrix of shares in [0, 1] (a 0/1 score per question) and an interval
    that holds its level near 0 or 1, where :func:`crossed_interval` does not.

    Near a ceiling, seed effects that are normal on the logit scale make the seeds' shares skewed, and the t interval
    over a few of them falls short (0.83–0.90 at a nominal 0.95, docs/statistics.md). Here each seed's share p_s is
    taken to its logit ℓ_s = logit(p̃_s), p̃_s = (Q·p_s + ½)/(Q + 1), and the ℓ_s are modelled as normal, N(m, τ²).
    The mean p̃ is then E[sigmoid(m + τ_a·Z)], where τ_a² = τ² − v is the seed effects' own spread (v, the
    within-seed noise of ℓ_s, is MS_residual/(Q·p̃_s²(1 − p̃_s)²) by the delta method, averaged over seeds), and the
    mean share ((Q + 1)·p̃ − ½)/Q (so every seed at 1 gives 1). Its interval is the generalized
    confidence interval (Weerahandi 1993; as Krishnamoorthy & Mathew 2003 do for a lognormal mean): ``draws`` draws
    of τ² = (S − 1)·s²/χ²_{S−1} and m = ℓ̄ − Z·τ/√S give draws of the mean share (Gauss–Hermite, 40 nodes), to which
    the question term N(0, σ²_q/Q) of the crossed model (σ²_q from :func:`variance_components`) is added; the
    interval is their central ``confidence`` quantiles, within [0, 1]. Seeded (``seed``): the same matrix gives the
    same interval. Over the simulated grid of docs/statistics.md (shares 50–93 %, logit seed sd 0–1.5, 3 and 5
    seeds, 124 questions) it covers 0.94–0.97 at a nominal 0.95 and 0.97–0.99 at 0.975.

    With one seed the seed variance cannot be estimated: :func:`crossed_interval` over questions (:data:`ONE_SEED`);
    with one question, :func:`crossed_interval` over seeds. Returns ``{"mean", "low", "high", "df", "se", "seeds",
    "questions", "method"}``; ``df`` is S − 1, ``se`` the draws' standard deviation. ``ValueError`` for a score
    outside [0, 1]."""
    _z(confidence)
    array = _seed_query_matrix(scores, "scores")
    if array.min() < 0 or array.max() > 1:
        raise ValueError(f"share_interval needs shares in [0, 1] (a 0/1 score per question), got values in "
                         f"[{array.min():g}, {array.max():g}]; use crossed_interval for other scores")
    n_seeds, n_questions = array.shape
    if min(n_seeds, n_questions) < 2:
        return crossed_interval(array, confidence, bounds=(0.0, 1.0))
    components = variance_components(array)
    shares = (n_questions * array.mean(axis=1) + 0.5) / (n_questions + 1)
    logits = np.log(shares / (1 - shares))
    noise = float(np.mean(components["residual"] / (n_questions * (shares * (1 - shares)) ** 2)))
    rng = np.random.default_rng(seed)
    means = (_logit_normal_means(logits, noise, draws, rng) * (n_questions + 1) - 0.5) / n_questions
    means = means + rng.standard_normal(draws) * math.sqrt(components["question"] / n_questions)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return {"mean": float(array.mean()), "low": float(max(low, 0.0)), "high": float(min(high, 1.0)),
            "df": float(n_seeds - 1), "se": float(means.std()), "seeds": n_seeds, "questions": n_questions,
            "method": SHARE_PIVOT}


def crossed_difference(
    a: Sequence[Sequence[float]] | np.ndarray, b: Sequence[Sequence[float]] | np.ndarray,
    clusters: Sequence[Hashable] | None = None, confidence: float = 0.95,
) -> dict[str, Any]:
    """:func:`crossed_interval` of the paired difference ``a − b`` of two conditions run with the same seeds
    (rows) on the same question rows (columns); ``clusters`` names each column's question, and columns of one
    question are averaged first (:func:`cluster_rows`). Adds ``"diff"`` (the mean difference)."""
    a_array, b_array = _seed_query_matrix(a, "a"), _seed_query_matrix(b, "b")
    if a_array.shape != b_array.shape:
        raise ValueError(f"paired runs need the same seeds and questions: a has shape {a_array.shape}, "
                         f"b {b_array.shape}")
    diffs = a_array - b_array if clusters is None else cluster_rows(a_array - b_array, clusters)
    result = crossed_interval(diffs, confidence)
    return {"diff": result["mean"], **result}


def interval_at(result: dict[str, Any], confidence: float) -> tuple[float, float]:
    """The interval of a :func:`crossed_interval` result at another ``confidence`` (same mean, se and df)."""
    _z(confidence)
    return _t_interval(result["mean"], result["se"], result["df"], confidence)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (Holm 1979), in the order given.

    Sorted ascending, the i-th smallest (i = 1..m) is multiplied by m − i + 1, made non-decreasing by a running
    maximum and capped at 1; rejecting where the adjusted p is below alpha controls the family-wise error rate
    at alpha, and never rejects less than Bonferroni (m·p).
    """
    array = np.asarray(p_values, dtype=float)
    if array.ndim != 1 or ((array < 0) | (array > 1) | ~np.isfinite(array)).any():
        raise ValueError(f"holm needs a 1-D sequence of p-values in [0, 1], got {list(p_values)}")
    order = np.argsort(array, kind="stable")
    m = len(array)
    stepped = np.minimum(1.0, np.maximum.accumulate(array[order] * (m - np.arange(m))))
    adjusted = np.empty(m)
    adjusted[order] = stepped
    return adjusted.tolist()


@dataclass(frozen=True)
class Claim:
    """A claim of the paper: condition ``better`` scores above ``worse`` (on ``evidence`` queries, where a table
    tells evidence types apart)."""

    text: str
    better: str
    worse: str
    evidence: str = "all"


VERDICTS = ("reproduced", "not reproduced", "inconclusive", "not testable")
VERDICT_RULE = ("*not testable* only when the two configurations are identical by construction (decided from the code "
                "path and the configs before any run, never from the outcomes; the reason is given); a zero-width "
                "interval (low = high: no variation to estimate an uncertainty from, e.g. no discordant pair) is "
                "*inconclusive*; otherwise the smallest effect of interest is tested first: *not reproduced* when the "
                "interval of better − worse lies wholly below the margin (even if above 0); *reproduced* when it lies "
                "above 0 and reaches the margin; else *inconclusive*")
""":func:`verdict`'s rule in words, for reports to quote (with the margin; docs/statistics.md, docs/rules/)."""


def verdict(low: float, high: float, margin: float, testable: bool = True, reason: str | None = None) -> str:
    """The verdict on a claim "better beats worse" from the interval ``[low, high]`` of better − worse.

    The rule (:data:`VERDICT_RULE`):

    - ``not testable`` when ``testable`` is False: the caller decided, before any run, that the two configurations
      are identical by construction; ``reason`` must say why (reports show it beside the label);
    - ``inconclusive`` when the interval has zero width (``low == high``): a zero standard error is no evidence of
      no effect (two configurations that differ on no sampled query), so it never reads *not reproduced*;
    - ``not reproduced`` when ``high < margin`` (``margin`` ≥ 0, the smallest effect of interest): no gain as large
      as the margin is compatible with the data, even when the interval lies above 0;
    - ``reproduced`` when ``low > 0`` (and, by the previous test, ``high ≥ margin``);
    - ``inconclusive`` otherwise (the interval holds 0 and reaches the margin).
    """
    if margin < 0:
        raise ValueError(f"the margin (smallest effect of interest) must be >= 0, got {margin}")
    if low > high:
        raise ValueError(f"an interval needs low <= high, got [{low}, {high}]")
    if not testable:
        if not reason:
            raise ValueError("a claim that is not testable needs a reason (e.g. 'identical configurations')")
        return "not testable"
    if low == high:
        return "inconclusive"
    if high < margin:
        return "not reproduced"
    return "reproduced" if low > 0 else "inconclusive"


def corrected_verdicts(
    results: Sequence[dict[str, Any]], margin: float, alpha: float = 0.05
) -> list[dict[str, Any]]:
    """Raw and family-corrected p-values, intervals and verdicts of a family of claims (e.g. a table's verdicts).

    ``results[i]`` is claim i's :func:`crossed_interval` (or :func:`crossed_difference`) result: ``mean``, ``se``,
    ``df``, ``p_value``, ``low``, ``high``. Two kinds of entry stay out of the family:

    - ``"testable": False`` (with ``"reason"``): two configurations identical by construction;
    - ``"duplicate_of": j``: the same test as entry ``j`` (the same configurations on the same queries, e.g. a
      subset that holds every query of its set), listed once in the family: it takes entry ``j``'s corrected
      p-value, interval and verdicts.

    A zero-width interval is a member like any other (its verdict is *inconclusive*, :func:`verdict`). With m
    members:

    - ``p_holm``: Holm's adjusted p-value of mean = 0 (:func:`holm`);
    - ``corrected_low``/``corrected_high``: the Bonferroni-level interval at ``corrected_confidence`` = 1 − alpha/m
      (:func:`interval_at`); the m intervals hold their parameters together with probability ≥ 1 − alpha, so every
      corrected verdict (in either direction) holds at family-wise level alpha. An interval that excludes 0 has
      ``p_holm < alpha`` too (Holm rejects at least what Bonferroni does);
    - ``verdict`` from the raw interval, ``corrected_verdict`` from the corrected one (:func:`verdict`, the same
      ``margin``).

    Returns one dict per claim: its entries and these keys (None for the corrected ones of an untestable claim).
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    for i, result in enumerate(results):
        j = result.get("duplicate_of")
        if j is not None and not (0 <= j < len(results) and j != i and results[j].get("duplicate_of") is None):
            raise ValueError(f"claim {i}: duplicate_of={j} must name another claim of the family that is not itself "
                             "a duplicate")
    members = [i for i, result in enumerate(results)
               if result.get("testable", True) and result.get("duplicate_of") is None]
    adjusted = dict(zip(members, holm([results[i]["p_value"] for i in members])))
    confidence = 1 - alpha / max(1, len(members))
    out: list[dict[str, Any]] = []
    for i, result in enumerate(results):
        testable, reason = result.get("testable", True), result.get("reason")
        entry = {**result, "verdict": verdict(result["low"], result["high"], margin, testable, reason),
                 "p_holm": None, "corrected_low": None, "corrected_high": None,
                 "corrected_confidence": confidence, "corrected_verdict": "not testable", "family_size": len(members)}
        if i in adjusted:
            low, high = interval_at(result, confidence)
            entry.update(p_holm=adjusted[i], corrected_low=low, corrected_high=high,
                         corrected_verdict=verdict(low, high, margin))
        out.append(entry)
    for entry in out:
        if (j := entry.get("duplicate_of")) is not None:
            entry.update({key: out[j][key] for key in ("verdict", "p_holm", "corrected_low", "corrected_high",
                                                        "corrected_verdict")})
    return out


CORRECTION = ("Holm–Bonferroni over the table's family of m claims (adjusted p; a claim identical by construction "
              "is out of it, a duplicated test counted once, a zero-width interval in it), Bonferroni-level intervals "
              "at confidence 1 − alpha/m for the corrected verdicts")
""":func:`corrected_verdicts`' correction in words, for reports to quote."""
