"""The Judger's uncertainty estimators (paper §3.3, Definition 1) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from hkrag.lvlm import LVLMResponseError, LVLMResult, TokenLogprob, uncertainty
from hkrag.lvlm.uncertainty import normalised_entropy, token_plogp, token_plogp_hqp_range, topk_entropy

LN2 = math.log(2)


def result(tokens: list[TokenLogprob], vocab_size: int | None = 16) -> LVLMResult:
    return LVLMResult("answer", tokens, 10, len(tokens), 0.1, "stop", "test", "m", vocab_size=vocab_size)


def test_token_plogp_is_e_times_mean_plogp():
    # p = 1/2 and 1/4 both give -p log p = ln(2)/2, so H = ln(2)/2 and H' = e ln(2)/2
    assert token_plogp([math.log(0.5), math.log(0.25)]) == pytest.approx(math.e * LN2 / 2)
    assert token_plogp([-1.0]) == pytest.approx(1.0)  # p = 1/e is the maximum of -p log p
    assert token_plogp([0.0, 0.0]) == 0.0  # certain tokens
    assert token_plogp([]) == 1.0  # nothing to measure: never confident


def test_normalised_entropy_divides_mean_by_log_vocab():
    assert normalised_entropy([LN2, 2 * LN2], 16) == pytest.approx(1.5 * LN2 / (4 * LN2))
    assert normalised_entropy([5.0], 2) == 1.0  # clipped
    assert normalised_entropy([], 16) == 1.0
    with pytest.raises(ValueError, match="vocab_size must be >= 2, got 1"):
        normalised_entropy([0.1], 1)


def test_topk_entropy_spreads_the_unlisted_mass_evenly():
    # listed 1/2, 1/4; the other 1/4 over 4 tokens -> the distribution (1/2, 1/4, 1/16 x 4): H = 2 ln 2
    assert topk_entropy([math.log(0.5), math.log(0.25)], 6) == pytest.approx(2 * LN2)
    # all mass listed: exactly the listed entropy
    assert topk_entropy([math.log(0.5), math.log(0.5)], 6) == pytest.approx(LN2)


def test_topk_entropy_bounds_the_exact_entropy_from_above():
    probs = [0.6, 0.2, 0.1, 0.05, 0.05]
    exact = -sum(p * math.log(p) for p in probs)
    estimate = topk_entropy([math.log(p) for p in probs[:2]], len(probs))
    assert exact < estimate


def test_dispatcher_values_per_estimator():
    tokens = [
        TokenLogprob("a", math.log(0.5), top=[("a", math.log(0.5)), ("b", math.log(0.25))], entropy=LN2),
        TokenLogprob("c", math.log(0.25), top=[("c", math.log(0.25)), ("d", math.log(0.25))], entropy=2 * LN2),
    ]
    res = result(tokens, vocab_size=16)
    plogp = uncertainty(res)
    assert (plogp.estimator, plogp.num_tokens) == ("token_plogp", 2)
    assert plogp.value == pytest.approx(math.e * LN2 / 2)
    assert uncertainty(res, "entropy_exact").value == pytest.approx(0.375)
    topk = [topk_entropy([math.log(0.5), math.log(0.25)], 16), topk_entropy([math.log(0.25)] * 2, 16)]
    assert uncertainty(res, "entropy_topk").value == pytest.approx(sum(topk) / 2 / math.log(16))
    assert uncertainty(res, "entropy").estimator == "entropy_exact"


def test_dispatcher_falls_back_to_topk_without_entropies():
    res = result([TokenLogprob("a", math.log(0.5), top=[("a", math.log(0.5))])])
    picked = uncertainty(res, "entropy")
    assert picked.estimator == "entropy_topk"
    assert picked.value == pytest.approx(topk_entropy([math.log(0.5)], 16) / math.log(16))


def test_empty_answer_is_maximally_uncertain():
    assert uncertainty(result([])).value == 1.0
    assert uncertainty(result([]), "entropy_exact").value == 1.0


def test_dispatcher_errors_name_the_problem():
    res = result([TokenLogprob("a", -0.1)])
    with pytest.raises(ValueError, match="unknown uncertainty estimator 'bogus'"):
        uncertainty(res, "bogus")
    with pytest.raises(ValueError, match="no per-token entropy"):
        uncertainty(res, "entropy_exact")
    with pytest.raises(ValueError, match="top_logprobs alternatives"):
        uncertainty(res, "entropy_topk")
    with pytest.raises(ValueError, match="vocabulary size; backend 'test'"):
        uncertainty(result([TokenLogprob("a", -0.1, entropy=0.3)], vocab_size=None), "entropy_exact")



@pytest.mark.parametrize(
    "compute,expected",
    [
        # p = 0 is a zero term (the limit of -p log p); p = 1/2 gives ln(2)/2, so H' = e * ln(2)/4
        (lambda: token_plogp([-math.inf, math.log(0.5)]), math.e * LN2 / 4),
        (lambda: token_plogp([-math.inf, -math.inf]), 0.0),
        (lambda: token_plogp([5e-5]), 0.0),  # within the rounding tolerance above 0: p = 1
        (lambda: topk_entropy([math.log(0.5), math.log(0.5), -math.inf], 6), LN2),
        # the listed alternative has p = 0: all the mass spread over the 15 others, H = log 15
        (lambda: uncertainty(result([TokenLogprob("a", -math.inf, top=[("a", -math.inf)])]), "entropy_topk").value,
         math.log(15) / math.log(16)),
    ],
)
def test_zero_probabilities_are_zero_terms(compute, expected):
    assert compute() == pytest.approx(expected)


def tokens_with(logprob=-0.1, alternative=-0.1, entropy=0.2) -> list[TokenLogprob]:
    """Two tokens, the second carrying the given values."""
    return [TokenLogprob("a", -0.1, top=[("a", -0.1)], entropy=0.2),
            TokenLogprob("b", logprob, top=[("b", -0.1), ("c", alternative)], entropy=entropy)]


@pytest.mark.parametrize(
    "tokens,estimator,message",
    [
        (tokens_with(logprob=math.nan), "token_plogp", "token 1's log-probability is NaN"),
        (tokens_with(logprob=0.5), "token_plogp", "token 1's log-probability is 0.5, above 0 beyond the rounding"),
        (tokens_with(logprob=math.inf), "token_plogp", "token 1's log-probability is inf, above 0"),
        (tokens_with(logprob=None), "token_plogp", "token 1's log-probability is null"),
        (tokens_with(logprob="-0.1"), "token_plogp", "token 1's log-probability is not a number .got str '-0.1'."),
        (tokens_with(alternative=math.nan), "entropy_topk", "token 1: alternative 1's log-probability is NaN"),
        (tokens_with(alternative=0.01), "entropy_topk", "token 1: alternative 1's log-probability is 0.01"),
        (tokens_with(entropy=math.nan), "entropy_exact", "token 1's entropy is NaN"),
    ],
)
def test_unusable_values_are_response_errors_naming_the_token(tokens, estimator, message):
    with pytest.raises(LVLMResponseError, match=message):
        uncertainty(result(tokens), estimator)


def constant_h(p: float) -> float:
    """H' of an answer whose tokens all have probability p."""
    return token_plogp([math.log(p)] * 3)


def test_hqp_range_of_constant_token_probabilities():
    low, high = token_plogp_hqp_range(0.8)
    # by hand: e*(-p ln p) is 0.797 at p = 0.16, 0.819 at 0.17, 0.806 at 0.62, 0.791 at 0.63
    assert 0.16 < low < 0.17 and 0.62 < high < 0.63
    assert constant_h(low) == pytest.approx(0.8) and constant_h(high) == pytest.approx(0.8)
    assert constant_h(low - 1e-3) < 0.8 <= constant_h((low + high) / 2) and constant_h(high + 1e-3) < 0.8
    # p = 1/4 and 1/2 both give -p ln p = ln(2)/2
    assert token_plogp_hqp_range(math.e * LN2 / 2) == pytest.approx((0.25, 0.5), abs=1e-9)
    assert token_plogp_hqp_range(1.0) == pytest.approx((1 / math.e, 1 / math.e), abs=1e-7)
    assert token_plogp_hqp_range(0.0) == (0.0, 1.0)
    assert token_plogp_hqp_range(1.01) is None
    with pytest.raises(ValueError, match="threshold must be a number"):
        token_plogp_hqp_range(math.nan)
