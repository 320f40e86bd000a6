"""The Pruner (paper §3.3, Eq. 6): the fewest top-ranked pages that suffice to answer, and its P(yes).

For n = 1 … k−1 it asks the LVLM whether pages 1..n hold enough to answer the question and stops at the
first yes; when none does, the buffer keeps the top k (capacity k, ``generator.top_k``). The yes/no is read
from the first generated token's probabilities when the backend returns them and that token is itself a
yes or a no (the summed mass of every "yes"-like against every "no"-like token, case- and
space-insensitive), else from the text; anything that is not a clear yes counts as no, which keeps more
pages.

**P(yes)**, recorded on every call with token statistics (docs/agents.md, "The Pruner's P(yes)"), is
m_yes / (m_yes + m_no), the first answer token's probability of reading as "yes" given that it reads as
"yes" or "no", with m a class's summed probability:

- ``full``: over the whole vocabulary, when the backend knows the distribution (the local backends answer the
  step's ``word_mass``, :attr:`hkrag.lvlm.GenerationSettings.word_mass`): exact;
- ``top_k``: over the returned candidates (the chosen token and its ``top_logprobs`` alternatives, as from an
  OpenAI-compatible server). A class with no listed token is given the most an unlisted token can have (the
  smallest listed probability, or the mass the listed ones leave, 1 − Σ listed, when that is less), so a list
  holding only "no" gives a P(yes) below ½, and one holding neither gives ½.

Without token statistics there is no P(yes) (``None``); a NaN mass is an error naming the value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.lvlm import LVLMBackend, LVLMResult, TokenLogprob
from hkrag.lvlm.words import normalise
from hkrag.rag.records import CallRecord, Page

from .context import Caps, QueryContext, QueryFailure, step_request
from .prompts import Prompts

YES = frozenset({"yes"})
NO = frozenset({"no"})
SOURCES = ("full", "top_k")
"""Where a P(yes) comes from: the whole vocabulary's distribution, or the returned top-k candidates."""


@dataclass(frozen=True)
class YesNo:
    """A yes/no reading: the decision; with token statistics the two classes' first-token masses (``p_yes``,
    ``p_no``: 0 for a class no listed candidate reads as), their ``source`` (one of :data:`SOURCES`) and
    ``probability``, the P(yes) of the module docstring."""

    yes: bool
    p_yes: float | None = None
    p_no: float | None = None
    source: str | None = None
    probability: float | None = None


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


def masses(first: TokenLogprob) -> tuple[float, float, str, float]:
    """``(m_yes, m_no, source, P(yes))`` of a first token: from its full-vocabulary ``words`` when the backend gave
    both, else from its distinct candidates (every candidate's probability summed into its class, never one
    overwriting another that normalises alike; an absent class imputed the most an unlisted token can have: the
    smallest listed probability, or the mass the listed ones leave when that is less)."""
    if first.words is not None and {"yes", "no"} <= set(first.words):
        p_yes, p_no = math.exp(first.words["yes"]), math.exp(first.words["no"])
        return p_yes, p_no, "full", p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5
    scored = [(normalise(token), math.exp(lp)) for token, lp in candidates(first)]
    p_yes = sum(p for token, p in scored if token in YES)
    p_no = sum(p for token, p in scored if token in NO)
    floor = min(min(p for _, p in scored), max(0.0, 1.0 - sum(p for _, p in scored)))
    imputed_yes = p_yes if any(token in YES for token, _ in scored) else floor
    imputed_no = p_no if any(token in NO for token, _ in scored) else floor
    total = imputed_yes + imputed_no
    return p_yes, p_no, "top_k", imputed_yes / total if total > 0 else 0.5


def read_yes_no(result: LVLMResult) -> YesNo:
    """Yes when the yes-like first-token candidates carry more probability than the no-like ones.

    The probabilities decide only when the chosen first token is itself yes- or no-like; otherwise ("The pages
    do not …") or without token statistics the first word of the text does. The masses and P(yes) are returned
    whenever the first token has statistics (:func:`masses`); a NaN among them is a :class:`ValueError` naming
    the values.
    """
    words = result.text.split()
    if not result.tokens:
        return YesNo(bool(words) and normalise(words[0]) in YES)
    p_yes, p_no, source, probability = masses(result.tokens[0])
    if any(math.isnan(value) for value in (p_yes, p_no, probability)):
        raise ValueError(f"P(yes) is NaN: yes mass {p_yes}, no mass {p_no} ({source} distribution of the first "
                         f"token {result.tokens[0].token!r}); the backend's probabilities are unusable")
    if normalise(result.tokens[0].token) in YES | NO:
        return YesNo(p_yes > p_no, p_yes, p_no, source, probability)
    return YesNo(bool(words) and normalise(words[0]) in YES, p_yes, p_no, source, probability)


def record_reading(record: CallRecord, reading: YesNo) -> None:
    """Write a reading into its call's record: ``decision``, the masses, their source and P(yes)."""
    record.decision = "yes" if reading.yes else "no"
    record.p_yes, record.p_no, record.p_source, record.yes_probability = (reading.p_yes, reading.p_no,
                                                                          reading.source, reading.probability)


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
            try:
                reading = read_yes_no(result)
            except ValueError as error:
                record.error = f"call n={n} on pages {[page.key for page in buffer[:n]]}: {error}"
                raise QueryFailure("pruner", record.error) from error
            record_reading(record, reading)
            if reading.yes:
                return buffer[:n]
        return buffer


@dataclass(frozen=True)
class PageScorer:
    """P(yes | question, page) for each page alone: the Pruner's n = 1 request about it (the prompts, caps and
    ``top_logprobs`` of a ``generator`` config), one call per page, sent as one batch. The visual reranker's
    scorer (``hkrag.retrieval.rerank``, built at the composition root, ``hkrag.tasks.rag.page_scorer``)."""

    backend: LVLMBackend
    prompts: Prompts
    caps: Caps
    top_logprobs: int

    def __call__(self, question: str, pages: Sequence[Page]) -> list[float]:
        """One P(yes) per page, in order; a :class:`ValueError` naming the page when the backend's reply has no
        token statistics or a NaN probability."""
        requests = [step_request(self.prompts, self.caps, question, "pruner", [page], self.top_logprobs, n="1")[1]
                    for page in pages]
        scores = []
        for page, result in zip(pages, self.backend.generate(requests)):
            try:
                reading = read_yes_no(result)
            except ValueError as error:
                raise ValueError(f"pruner score of page {page.key!r} for {question!r}: {error}") from error
            if reading.probability is None:
                raise ValueError(f"pruner score of page {page.key!r} for {question!r}: the {self.backend.name} "
                                 "backend returned no token probabilities, and P(yes) needs them")
            scores.append(reading.probability)
        return scores
