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
as confident. Every value records its estimator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .base import LVLMResult

ESTIMATORS = ("token_plogp", "entropy_exact", "entropy_topk", "entropy")
MAX_PLOGP = 1 / math.e


@dataclass(frozen=True)
class Uncertainty:
    """A normalised uncertainty in ``[0, 1]``, the estimator that produced it, and over how many tokens."""

    value: float
    estimator: str
    num_tokens: int


def token_plogp(logprobs: Sequence[float]) -> float:
    """Definition 1: ``e · mean_i(−p_i log p_i)`` of the chosen tokens' probabilities, in ``[0, 1]``."""
    if not logprobs:
        return 1.0
    terms = [-math.exp(lp) * lp for lp in logprobs]
    return min(1.0, max(0.0, sum(terms) / len(terms) / MAX_PLOGP))


def normalised_entropy(entropies: Sequence[float], vocab_size: int) -> float:
    """Mean token entropy (nats) divided by ``log |V|``, in ``[0, 1]``."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if not entropies:
        return 1.0
    return min(1.0, max(0.0, sum(entropies) / len(entropies) / math.log(vocab_size)))


def topk_entropy(top_logprobs: Sequence[float], vocab_size: int) -> float:
    """Entropy (nats) of one token estimated from its ``k`` listed log-probabilities (upper bound)."""
    probs = [math.exp(lp) for lp in top_logprobs]
    listed = -sum(p * math.log(p) for p in probs if p > 0)
    rest, others = max(0.0, 1.0 - sum(probs)), vocab_size - len(probs)
    if rest <= 0 or others <= 0:
        return listed
    return listed - rest * math.log(rest / others)


def uncertainty(result: LVLMResult, estimator: str = "token_plogp") -> Uncertainty:
    """The normalised uncertainty of ``result``'s answer.

    ``estimator="entropy"`` takes ``entropy_exact`` when every token carries its entropy and
    ``entropy_topk`` otherwise. Raises ``ValueError`` when the result lacks what the estimator needs.
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
        entropies = [topk_entropy([lp for _, lp in t.top], result.vocab_size) for t in tokens]
    return Uncertainty(normalised_entropy(entropies, result.vocab_size), estimator, len(tokens))
