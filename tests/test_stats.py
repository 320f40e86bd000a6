"""Confidence intervals against hand-computed values (hkrag/stats.py)."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from hkrag.stats import (
    CROSSED,
    ONE_SEED,
    ONE_VALUE,
    P_FLOOR,
    SHARE_PIVOT,
    bootstrap_interval,
    cluster_rows,
    corrected_verdicts,
    crossed_difference,
    crossed_interval,
    hierarchical_bootstrap,
    hierarchical_means,
    hierarchical_paired_bootstrap,
    holm,
    interval_at,
    paired_bootstrap,
    seed_matrix,
    share_interval,
    variance_components,
    verdict,
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
    assert result["p_value"] == 1 / 2000  # no resample at or below 0: p < 1/B, reported as the floor 1/B


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
    assert result["p_value"] == 1 / 2000
    assert hierarchical_paired_bootstrap(scores + 0.1, scores, n_resamples=500)["p_value"] == 1 / 500


def test_hierarchical_bootstrap_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"scores must be a finite \(seeds, queries\) matrix"):
        hierarchical_bootstrap([1.0, 2.0])
    with pytest.raises(ValueError, match=r"a has shape \(2, 3\), b \(3, 3\)"):
        hierarchical_paired_bootstrap(np.zeros((2, 3)), np.zeros((3, 3)))


# The crossed seeds x questions interval. Seeds score the 4 questions:
#   seed 0: 1 3 2  6   (mean 3)      question means 2, 4, 4, 22/3; grand mean 52/12 = 13/3
#   seed 1: 2 5 3  6   (mean 4)
#   seed 2: 3 4 7 10   (mean 6)
# SS_seed = Q * sum((3, 4, 6) - 13/3)^2 = 4 * (16 + 1 + 25)/9 = 56/3,   df 2, MS_seed = 28/3
# SS_question = S * (49 + 1 + 1 + 81)/9 = 44,                          df 3, MS_question = 44/3
# SS_total = sum(x^2) - 52^2/12 = 298 - 676/3 = 218/3, SS_residual = 218/3 - 56/3 - 44 = 10, df 6, MS_residual = 5/3
MATRIX = [[1.0, 3, 2, 6], [2, 5, 3, 6], [3, 4, 7, 10]]
MS_SEED, MS_QUESTION, MS_RESIDUAL = 28 / 3, 44 / 3, 5 / 3


def test_variance_components_by_hand():
    components = variance_components(MATRIX)
    assert (components["ms_seed"], components["ms_question"], components["ms_residual"]) == pytest.approx(
        (MS_SEED, MS_QUESTION, MS_RESIDUAL))
    # sigma2_seed = (MS_seed - MS_res)/Q = (23/3)/4 = 23/12; sigma2_question = (MS_q - MS_res)/S = 13/3
    assert (components["seed"], components["question"], components["residual"]) == pytest.approx(
        (23 / 12, 13 / 3, 5 / 3))


def test_seed_matrix_orders_seeds_and_questions_and_refuses_misaligned_seeds():
    seeds, questions, matrix = seed_matrix({2: {"b": 1, "a": 0}, 0: {"a": 0.5, "b": 0.25}})
    assert (seeds, questions) == ([0, 2], ["a", "b"])
    assert matrix.tolist() == [[0.5, 0.25], [0.0, 1.0]]
    with pytest.raises(ValueError, match=r"seed 1 scored other questions than seed 0 \(2 differ, e.g. \['b', 'c'\]\)"):
        seed_matrix({0: {"a": 1, "b": 1}, 1: {"a": 1, "c": 0}})
    with pytest.raises(ValueError, match="no seed scored any question"):
        seed_matrix({})


def test_crossed_interval_by_hand():
    result = crossed_interval(MATRIX)
    # Var(mean) = s2_seed/S + s2_question/Q + s2_res/(SQ) = (MS_seed + MS_question - MS_res)/(SQ) = (67/3)/12
    variance = (MS_SEED + MS_QUESTION - MS_RESIDUAL) / 12
    assert variance == pytest.approx(67 / 36)
    # Satterthwaite: (67/3)^2 / ((28/3)^2/2 + (44/3)^2/3 + (5/3)^2/6) = 498.78 / 115.72 = 4.3101
    df = (67 / 3) ** 2 / (MS_SEED ** 2 / 2 + MS_QUESTION ** 2 / 3 + MS_RESIDUAL ** 2 / 6)
    assert df == pytest.approx(4.3101, abs=1e-4)
    half = scipy_stats.t.ppf(0.975, df) * variance ** 0.5  # t(0.975; 4.31) = 2.6994
    assert result["mean"] == pytest.approx(13 / 3)
    assert (result["se"], result["df"]) == pytest.approx((variance ** 0.5, df))
    assert (result["low"], result["high"]) == pytest.approx((13 / 3 - half, 13 / 3 + half))
    assert result["p_value"] == pytest.approx(2 * scipy_stats.t.sf(13 / 3 / variance ** 0.5, df))
    assert (result["seeds"], result["questions"], result["method"]) == (3, 4, CROSSED)
    assert interval_at(result, 0.95) == pytest.approx((result["low"], result["high"]))


def test_crossed_interval_clips_a_negative_seed_component():
    # Seed means 7/3, 8/3, 7/3 barely differ: MS_seed = 3 * (1/81 + 4/81 + 1/81) / 2 = 1/9 < MS_residual, so the
    # seed component is 0 and Var(mean) = MS_question/(SQ) with the question term's df, Q - 1 = 2.
    matrix = np.array([[1.0, 2, 4], [2, 3, 3], [0, 2, 5]])
    components = variance_components(matrix)
    assert components["ms_seed"] == pytest.approx(1 / 9) and components["seed"] == 0.0
    result = crossed_interval(matrix)
    # question means 1, 7/3, 4 around 22/9: MS_question = 3 * ((13/9)^2 + (1/9)^2 + (14/9)^2) / 2 = 3 * 366/81 / 2
    assert components["ms_question"] == pytest.approx(61 / 9)
    assert result["se"] == pytest.approx((61 / 9 / 9) ** 0.5)
    assert result["df"] == pytest.approx(2.0)


def test_crossed_interval_with_one_seed_is_the_t_interval_over_questions():
    result = crossed_interval([[1.0, 2.0, 3.0]])
    half = scipy_stats.t.ppf(0.975, 2) * (1 / 3) ** 0.5  # sample variance 1, se sqrt(1/3), df 2
    assert (result["low"], result["high"]) == pytest.approx((2 - half, 2 + half))
    assert result["method"] == ONE_SEED and "seed variance not estimable" in result["method"]


def test_crossed_interval_of_identical_runs_is_a_point_and_never_p_zero():
    result = crossed_difference(np.ones((3, 4)), np.ones((3, 4)))
    assert (result["diff"], result["low"], result["high"], result["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    shifted = crossed_difference(np.ones((3, 4)) + 0.1, np.ones((3, 4)))
    assert shifted["p_value"] == P_FLOOR > 0
    single = crossed_interval([[0.5]])  # one seed, one question: no interval at all
    assert (single["low"], single["high"], single["p_value"], single["method"]) == (-np.inf, np.inf, 1.0, ONE_VALUE)
    assert verdict(single["low"], single["high"], 0.01) == "inconclusive"


def test_share_interval_of_identical_seeds_is_the_question_term_by_hand():
    # two identical seeds, 60 of 100 right: no seed spread and no residual, so the interval is the share 0.6 (the
    # adjusted share 60.5/101 taken back) plus N(0, sigma_q^2/Q): MS_question = 2 x (60 x 0.4^2 + 40 x 0.6^2)/99,
    # term = MS_q/(2 x 100)
    row = [1.0] * 60 + [0.0] * 40
    result = share_interval([row, row])
    centre, sd = 0.6, (2 * 24 / 99 / 200) ** 0.5
    half = scipy_stats.norm.ppf(0.975) * sd
    assert (result["low"], result["high"]) == pytest.approx((centre - half, centre + half), abs=0.003)
    assert result["mean"] == 0.6 and result["df"] == 1.0 and result["method"] == SHARE_PIVOT


def test_share_interval_near_a_ceiling_reaches_further_down_than_the_crossed_one():
    # the notes stage's seed shares (72.6-99.2 %): the weak seed drags the logit-normal mean's lower end down
    rng = np.random.default_rng(0)
    scores = (rng.random((5, 124)) < np.array([[0.73], [0.93], [0.94], [0.85], [0.99]])).astype(float)
    share, crossed = share_interval(scores, 0.975), crossed_interval(scores, 0.975, bounds=(0.0, 1.0))
    assert share["mean"] == crossed["mean"]
    assert share["low"] < crossed["low"] - 0.05 and share["high"] < 1.0
    assert share == share_interval(scores, 0.975)  # seeded: the same matrix, the same interval
    narrower = share_interval(scores, 0.95)
    assert share["low"] < narrower["low"] < narrower["high"] < share["high"]


def test_share_interval_of_seeds_that_all_score_everything_is_the_point_1():
    result = share_interval(np.ones((3, 40)))
    assert (result["mean"], result["low"], result["high"]) == pytest.approx((1.0, 1.0, 1.0))


def test_share_interval_falls_back_with_one_seed_and_refuses_scores_outside_0_1():
    assert share_interval([[1.0, 0.0, 1.0, 1.0]]) == crossed_interval([[1.0, 0.0, 1.0, 1.0]], bounds=(0.0, 1.0))
    with pytest.raises(ValueError, match=r"shares in \[0, 1\].*values in \[0, 2\]; use crossed_interval"):
        share_interval([[1.0, 2.0], [0.0, 1.0]])


def test_cluster_rows_averages_a_questions_rows_before_the_interval():
    # question a asked in two pools (rows 0 and 2): one column of their mean, in order of first appearance
    assert cluster_rows([[1.0, 2.0, 3.0, 4.0], [0, 0, 2, 2]], ["a", "b", "a", "c"]).tolist() == [[2, 2, 4], [1, 0, 2]]
    assert cluster_rows([1.0, 3.0], ["q", "q"]).tolist() == [[2.0]]
    with pytest.raises(ValueError, match="3 clusters"):
        cluster_rows([[1.0, 2.0]], ["a", "b", "c"])
    a, b = np.array([[1.0, 1.0, 0.0, 1.0], [1, 0, 1, 1]]), np.zeros((2, 4))
    clustered = crossed_difference(a, b, clusters=["a", "b", "a", "b"])
    assert clustered["questions"] == 2 and clustered["diff"] == pytest.approx(0.75)
    assert clustered == crossed_interval(cluster_rows(a - b, ["a", "b", "a", "b"])) | {"diff": clustered["mean"]}


def test_holm_by_hand():
    # sorted: 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 = 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # 0.5 x 2 capped at 1, then monotone
    assert holm([]) == []
    with pytest.raises(ValueError, match="p-values in \\[0, 1\\]"):
        holm([0.2, 1.5])


@pytest.mark.parametrize("low, high, expected", [
    (0.001, 0.05, "reproduced"),
    (0.002, 0.008, "not reproduced"),  # above 0 but wholly below the margin: the margin is tested first
    (-0.02, 0.005, "not reproduced"),
    (-0.05, -0.01, "not reproduced"),
    (-0.02, 0.03, "inconclusive"),
    (0.0, 0.0, "inconclusive"),  # zero width: no discordant pair is no evidence of no effect
    (0.005, 0.005, "inconclusive"),  # zero width below the margin: still no interval to judge by
    (0.03, 0.03, "inconclusive"),
])
def test_verdict_rule_tests_the_margin_first(low, high, expected):
    assert verdict(low, high, margin=0.01) == expected


def test_not_testable_needs_a_reason():
    assert verdict(0.0, 0.0, 0.01, testable=False, reason="identical calls on every query") == "not testable"
    with pytest.raises(ValueError, match="needs a reason"):
        verdict(0.0, 0.0, 0.01, testable=False)
    with pytest.raises(ValueError, match="margin"):
        verdict(0.0, 0.1, -0.01)


def test_corrected_verdicts_apply_holm_and_bonferroni_intervals():
    # two testable claims (m = 2): Bonferroni intervals at 97.5 %; t = 3.33 and 2.5 on 10 df: p = 0.0076, 0.031,
    # Holm p = (2 x 0.0076, max(2 x 0.0076, 0.031))
    results = [{"mean": 0.05, "se": 0.015, "df": 10.0}, {"mean": 0.03, "se": 0.012, "df": 10.0},
               {"mean": 0.0, "se": 0.0, "df": 4.0, "low": 0.0, "high": 0.0, "p_value": 1.0, "testable": False,
                "reason": "identical configurations"}]
    for result in results[:2]:
        result["p_value"] = 2 * scipy_stats.t.sf(result["mean"] / result["se"], result["df"])
        result["low"], result["high"] = interval_at(result, 0.95)
    out = corrected_verdicts(results, margin=0.01)
    p0, p1 = results[0]["p_value"], results[1]["p_value"]
    assert p0 < p1 < 0.05
    assert [o["p_holm"] for o in out[:2]] == pytest.approx([2 * p0, max(2 * p0, p1)])
    t = scipy_stats.t.ppf(1 - 0.05 / 4, 10)  # two-sided 97.5 %: the 98.75 % quantile
    assert (out[0]["corrected_low"], out[0]["corrected_high"]) == pytest.approx((0.05 - t * 0.015, 0.05 + t * 0.015))
    assert out[0]["corrected_confidence"] == 0.975 and out[0]["family_size"] == 2
    assert [o["verdict"] for o in out] == ["reproduced", "reproduced", "not testable"]
    # claim 1's raw interval 0.03 ± 2.228 x 0.012 = [0.0033, 0.057] lies above 0; at 97.5 % (± 2.634 x 0.012) it
    # reaches below 0: inconclusive once corrected
    assert [o["corrected_verdict"] for o in out] == ["reproduced", "inconclusive", "not testable"]
    assert out[2]["p_holm"] is None and out[2]["corrected_low"] is None


def test_bounds_intersect_the_interval_with_the_range_of_the_mean():
    accuracy = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]  # mean 0.25: the t interval reaches below 0
    free, bounded = crossed_interval(accuracy), crossed_interval(accuracy, bounds=(0.0, 1.0))
    assert free["low"] < 0 and bounded["low"] == 0.0 and bounded["high"] == free["high"]
    with pytest.raises(ValueError, match="outside the bounds"):
        crossed_interval([[2.0, 3.0]], bounds=(0.0, 1.0))


def test_a_zero_width_interval_is_a_family_member_and_a_duplicate_is_counted_once():
    results = [{"mean": 0.05, "se": 0.015, "df": 10.0}, {"mean": 0.0, "se": 0.0, "df": 4.0, "p_value": 1.0},
               {"mean": 0.05, "se": 0.015, "df": 10.0, "duplicate_of": 0}]
    for result in (results[0], results[2]):
        result["p_value"] = 2 * scipy_stats.t.sf(result["mean"] / result["se"], result["df"])
    for result in results:
        result["low"], result["high"] = interval_at(result, 0.95)
    out = corrected_verdicts(results, margin=0.01)
    assert out[0]["family_size"] == 2 and out[0]["corrected_confidence"] == 0.975  # the zero-width claim counts
    assert out[1]["verdict"] == out[1]["corrected_verdict"] == "inconclusive" and out[1]["p_holm"] == 1.0
    assert out[0]["p_holm"] == pytest.approx(2 * results[0]["p_value"])
    assert {k: out[2][k] for k in ("p_holm", "corrected_low", "corrected_verdict")} == {
        k: out[0][k] for k in ("p_holm", "corrected_low", "corrected_verdict")}
    with pytest.raises(ValueError, match="duplicate_of=2 must name another claim"):
        corrected_verdicts([results[0], {**results[1], "duplicate_of": 2}, results[2]], margin=0.01)
