"""The Pruner (paper §3.3, Eq. 6): the fewest top-ranked pages that suffice to answer.

For n = 1 … k−1 it asks the LVLM whether pages 1..n hold enough to answer the question and stops at the
first yes; when none does, the buffer keeps the top k (capacity k, ``generator.top_k``). The yes/no is read
from the first generated token's probabilities when the backend returns them and that token is itself a
yes or a no (the summed mass of every "yes"-like against every "no"-like candidate, case- and
space-insensitive), else from the text; anything that is not a clear yes counts as no, which keeps more
pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.lvlm import LVLMResult, TokenLogprob
from hkrag.rag.records import Page

from .context import QueryContext

YES = frozenset({"yes"})
NO = frozenset({"no"})
STRIP = " \t\n\r▁Ġ.,:;!?\"'*`()[]"


def normalise(token: str) -> str:
    """A token as compared with the yes/no words: no spaces, sentencepiece/BPE markers or punctuation; lower."""
    return token.strip(STRIP).lower()


@dataclass(frozen=True)
class YesNo:
    """A yes/no reading: the decision and, when log-probabilities decided it, the two probability masses."""

    yes: bool
    p_yes: float | None = None
    p_no: float | None = None


def same_entry(first: TokenLogprob, alternative: tuple[str, float]) -> bool:
    """Whether ``alternative`` is the chosen token itself, listed again among its alternatives.

    Alternatives are ``(text, logprob)`` pairs without token ids, and backends list each token id once, so
    only the chosen token can repeat; it is recognised by its exact text and log-probability. Two distinct
    tokens that merely decode alike (SentencePiece's ``▁Yes`` and ``Yes`` both decode to "Yes") are not.
    """
    token, logprob = alternative
    return token == first.token and math.isclose(logprob, first.logprob, rel_tol=0.0, abs_tol=1e-6)


def candidates(first: TokenLogprob) -> list[tuple[str, float]]:
    """The first token's distinct candidates: every listed alternative, plus the chosen token unless listed."""
    listed = list(first.top)
    if any(same_entry(first, alternative) for alternative in listed):
        return listed
    return [*listed, (first.token, first.logprob)]


def read_yes_no(result: LVLMResult) -> YesNo:
    """Yes when the yes-like first-token candidates carry more probability than the no-like ones.

    Every distinct candidate's probability is summed into its class (never one overwriting another that
    normalises alike). The probabilities decide only when the chosen first token is itself yes- or
    no-like; otherwise ("The pages do not …") or without token statistics the first word of the text does.
    """
    if result.tokens and normalise(result.tokens[0].token) in YES | NO:
        scored = candidates(result.tokens[0])
        p_yes = sum(math.exp(lp) for token, lp in scored if normalise(token) in YES)
        p_no = sum(math.exp(lp) for token, lp in scored if normalise(token) in NO)
        return YesNo(p_yes > p_no, p_yes, p_no)
    words = result.text.split()
    return YesNo(bool(words) and normalise(words[0]) in YES)


@dataclass(frozen=True)
class Pruner:
    """Eq. 6 over a buffer of capacity ``k``; ``top_logprobs`` alternatives are requested per answer
    (both checked by :class:`~agents.pipeline.GeneratorConfig`)."""

    k: int
    top_logprobs: int

    def select(self, ctx: QueryContext, pages: Sequence[Page]) -> list[Page]:
        """The first n < k pages that suffice, else the buffer's (up to) k pages."""
        buffer = list(pages[: self.k])
        for n in range(1, len(buffer)):
            result, record = ctx.ask("pruner", buffer[:n], iteration=n, top_logprobs=self.top_logprobs,
                                     n=str(n))
            reading = read_yes_no(result)
            record.decision, record.p_yes, record.p_no = ("yes" if reading.yes else "no"), reading.p_yes, reading.p_no
            if reading.yes:
                return buffer[:n]
        return buffer
