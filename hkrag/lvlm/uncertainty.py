"""Answer uncertainty for the Judger (paper §3.3, Definition 1): one place, three estimators.

``token_plogp`` (the paper's Definition 1)
    ``H(ŵ) = −(1/L) Σ_i p_i·log p_i`` over the L generated tokens, ``p_i`` the probability of the chosen
    token i. Each term ``−p·log p`` lies in ``[0, 1/e]`` (its maximum is at ``p = 1/e``), so we
    normalise by that maximum: ``H′ = e·H ∈ [0, 1]``. Note that it is small both for confident tokens
    (p → 1) and for very unlikely ones (p → 0); that is the paper's definition and we keep it.
``entropy_exact``
    The mean over tokens of the full next-token distribution's entropy divided by its maximum
    ``log |V|``. Exact, needs the whole distribution: local backends record it per token.
``entropy_topk``
    The same quantity estimated from the ``k`` alternatives an HTTP server returns: the listed
    probabilities contribute ``−p·log p`` each and the remaining mass ``r = 1 − Σp`` is spread evenly over
    the other ``|V| − k`` tokens, ``−r·log(r / (|V| − k))``. Spreading evenly maximises the unlisted
    part, so this is an upper bound of the exact entropy (equal when the unlisted tokens are uniform).

An answer without tokens has no uncertainty to measure; it gets 1.0 (maximal), so it is never taken
as confident. Every value records its estimator. The token that ended generation (EOS / end-of-turn) is
never among the tokens (the backends drop it, :class:`~hkrag.lvlm.base.LVLMBackend`), so the same answer
gets the same H′ from every backend.

Non-finite values: a log-probability of −inf (p = 0) contributes 0, the limit of ``−p·log p`` as
p → 0. NaN, a non-number, or a log-probability above 0 beyond
:data:`~hkrag.lvlm.base.LOGPROB_TOLERANCE` (p > 1) is a malformed answer:
:class:`~hkrag.lvlm.base.LVLMResponseError` naming the token, never a NaN that clamps to "confident".

Calibration: for an answer whose tokens share one probability p, ``token_plogp`` is
``e·(−p·log p)``, so a threshold h routes to HQP exactly the p in :func:`token_plogp_hqp_range`
(h = 0.8: p ∈ [0.161, 0.624]); a very flat argmax (p → 0) counts as confident.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .base import LVLMResponseError, LVLMResult, TokenLogprob, logprob_problem

ESTIMATORS = ("token_plogp", "entropy_exact", "entropy_topk", "entropy")
MAX_PLOGP = 1 / math.e


@dataclass(frozen=True)
class Uncertainty:
    """A normalised uncertainty in ``[0, 1]``, the estimator that produced it, and over how many tokens."""

    value: float
    estimator: str
    num_tokens: int


def checked_logprobs(logprobs: Sequence[float], what: str = "token") -> list[float]:
    """``logprobs`` as floats; :class:`LVLMResponseError` naming the first unusable one (NaN, null, p > 1)."""
    for index, logprob in enumerate(logprobs):
        if problem := logprob_problem(logprob):
            raise LVLMResponseError(f"{what} {index}'s log-probability {problem}")
    return [float(lp) for lp in logprobs]


def plogp(logprob: float) -> float:
    """``−p·log p`` of one probability given as its log; −inf (p = 0) gives the limit 0, and a log-probability
    within the rounding tolerance above 0 counts as 0 (p = 1)."""
    if logprob == -math.inf:
        return 0.0
    logprob = min(logprob, 0.0)
    return -math.exp(logprob) * logprob


def token_plogp(logprobs: Sequence[float]) -> float:
    """Definition 1: ``e · mean_i(−p_i log p_i)`` of the chosen tokens' probabilities, in ``[0, 1]``."""
    if not logprobs:
        return 1.0
    terms = [plogp(lp) for lp in checked_logprobs(logprobs)]
    return min(1.0, max(0.0, sum(terms) / len(terms) / MAX_PLOGP))


def token_plogp_hqp_range(threshold: float) -> tuple[float, float] | None:
    """The constant per-token probabilities p that ``token_plogp`` routes to HQP at ``threshold`` h.

    An answer whose tokens all have probability p gets ``H′ = e·(−p·log p)``, which rises on ``[0, 1/e]``
    and falls on ``[1/e, 1]``; H′ ≥ h (HQP, Definition 1) holds exactly on ``[p_low, p_high]`` around 1/e.
    Returns ``(p_low, p_high)`` (``(0, 1)`` for h ≤ 0), or ``None`` for h > 1 (nothing reaches it).
    Solved by bisection on each monotone side.
    """
    if math.isnan(threshold):
        raise ValueError("threshold must be a number, got nan")
    if threshold <= 0:
        return 0.0, 1.0
    if threshold > 1:
        return None

    def normalised(p: float) -> float:
        return plogp(math.log(p)) / MAX_PLOGP if p > 0 else 0.0

    return _bisect(normalised, threshold, 0.0, MAX_PLOGP), _bisect(normalised, threshold, 1.0, MAX_PLOGP)


def _bisect(f: Callable[[float], float], level: float, outside: float, inside: float) -> float:
    """The point between ``outside`` (``f < level``) and ``inside`` (``f ≥ level``) where ``f`` crosses
    ``level``, to float precision; ``f`` monotone in between."""
    for _ in range(100):
        middle = (outside + inside) / 2
        if middle in (outside, inside):
            break
        if f(middle) >= level:
            inside = middle
        else:
            outside = middle
    return inside


def normalised_entropy(entropies: Sequence[float], vocab_size: int) -> float:
    """Mean token entropy (nats) divided by ``log |V|``, in ``[0, 1]``; a NaN entropy is an
    :class:`LVLMResponseError` naming the token."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if not entropies:
        return 1.0
    for index, entropy in enumerate(entropies):
        if math.isnan(entropy):
            raise LVLMResponseError(f"token {index}'s entropy is NaN")
    return min(1.0, max(0.0, sum(entropies) / len(entropies) / math.log(vocab_size)))


def topk_entropy(top_logprobs: Sequence[float], vocab_size: int) -> float:
    """Entropy (nats) of one token estimated from its ``k`` listed log-probabilities (upper bound).

    −inf alternatives (p = 0) add nothing; NaN or p > 1 is an :class:`LVLMResponseError`.
    """
    logprobs = checked_logprobs(top_logprobs, "alternative")
    probs = [math.exp(min(lp, 0.0)) for lp in logprobs]
    listed = sum(plogp(lp) for lp in logprobs)
    rest, others = max(0.0, 1.0 - sum(probs)), vocab_size - len(probs)
    if rest <= 0 or others <= 0:
        return listed
    return listed - rest * math.log(rest / others)


def uncertainty(result: LVLMResult, estimator: str = "token_plogp") -> Uncertainty:
    """The normalised uncertainty of ``result``'s answer.

    ``estimator="entropy"`` takes ``entropy_exact`` when every token carries its entropy and
    ``entropy_topk`` otherwise. Raises ``ValueError`` when the result lacks what the estimator needs and
    :class:`LVLMResponseError` when a token's value is unusable (NaN, p > 1).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown uncertainty estimator {estimator!r}; choose from {ESTIMATORS}")
    tokens = result.tokens
    if estimator == "token_plogp":
        return Uncertainty(token_plogp([t.logprob for t in tokens]), estimator, len(tokens))
    if estimator == "entropy":
        exact = bool(tokens) and all(t.entropy is not None for t in tokens)
        estimator = "entropy_exact" if exact else "entropy_topk"
    if result.vocab_size is None:
        raise ValueError(f"{estimator} needs the vocabulary size; backend {result.backend!r} did not report it")
    if estimator == "entropy_exact":
        if any(t.entropy is None for t in tokens):
            raise ValueError(f"backend {result.backend!r} returned no per-token entropy; use entropy_topk")
        entropies = [t.entropy for t in tokens]
    else:
        if any(not t.top for t in tokens):
            raise ValueError("entropy_topk needs top_logprobs alternatives on every token (settings.top_logprobs > 0)")
        entropies = topk_entropies(tokens, result.vocab_size)
    return Uncertainty(normalised_entropy(entropies, result.vocab_size), estimator, len(tokens))


def topk_entropies(tokens: Sequence[TokenLogprob], vocab_size: int) -> list[float]:
    """:func:`topk_entropy` of every token's alternatives; an unusable one is named by token and rank."""
    return [
        topk_entropy(checked_logprobs([lp for _, lp in token.top], f"token {index}: alternative"), vocab_size)
        for index, token in enumerate(tokens)
    ]
