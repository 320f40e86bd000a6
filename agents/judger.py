"""The Judger (paper §3.3, Definitions 1–2): route on the uncertainty of an initial answer.

The LVLM answers from the kept pages; the answer's normalised uncertainty H′ (``generator.estimator``; the
shipped config uses the paper's mean −p·log p over the chosen tokens, :mod:`hkrag.lvlm.uncertainty`) below
the threshold h makes a low-uncertainty pair (LQP, to the Summarizer), otherwise a high-uncertainty pair (HQP,
to the Decoupler). The initial answer is only measured: it is never shown to a later agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.lvlm import LVLMBackend, LVLMError, Uncertainty
from hkrag.lvlm.uncertainty import uncertainty
from hkrag.rag.records import Page

from .context import QueryContext, QueryFailure

NEEDS_ALTERNATIVES = frozenset({"entropy_topk", "entropy"})
"""Estimators that read the ``top_logprobs`` alternatives (``entropy`` falls back to them over HTTP)."""


@dataclass(frozen=True)
class Judgement:
    route: str
    uncertainty: Uncertainty


@dataclass(frozen=True)
class Judger:
    """Definitions 1–2 with threshold ``h`` and ``estimator`` (the settings are checked once, by
    :class:`~agents.pipeline.GeneratorConfig`; their values live in conf/generator/hkrag.yaml)."""

    threshold: float
    estimator: str
    top_logprobs: int

    @property
    def alternatives(self) -> int:
        """The ``top_logprobs`` the initial answer asks for: the setting's when the estimator reads them, else 0."""
        return self.top_logprobs if self.estimator in NEEDS_ALTERNATIVES else 0

    def check_backend(self, backend: LVLMBackend) -> None:
        """Raise before any query when ``backend`` cannot give what the estimator needs.

        ``entropy_exact`` needs per-token entropies (``backend.exact_entropy``); ``entropy_topk``, and
        ``entropy`` on a backend without exact entropies (it falls back to top-k), need the vocabulary size
        (``backend.vocab_size``) and ``top_logprobs`` ≥ 1 alternatives.
        """
        exact = getattr(backend, "exact_entropy", False)
        if self.estimator == "entropy_exact" and not exact:
            raise ValueError(f"generator estimator 'entropy_exact' needs per-token entropies, which backend "
                             f"{backend.name!r} does not report; use 'entropy_topk' or 'token_plogp'")
        if self.estimator == "entropy_topk" or (self.estimator == "entropy" and not exact):
            needs = (f"generator estimator {self.estimator!r} estimates the entropy from the top-k alternatives on "
                     f"backend {backend.name!r} and needs")
            if getattr(backend, "vocab_size", None) is None:
                raise ValueError(f"{needs} the vocabulary size, which the backend does not report (set its vocab_size)")
            if self.top_logprobs < 1:
                raise ValueError(f"{needs} top_logprobs >= 1, got top_logprobs={self.top_logprobs}")

    def judge(self, ctx: QueryContext, pages: Sequence[Page]) -> Judgement:
        """LQP when H′ < h, else HQP; the uncertainty is recorded on the call. An answer whose statistics
        cannot be measured (NaN, missing alternatives) fails the query naming the Judger."""
        result, record = ctx.ask("answer", pages, top_logprobs=self.alternatives)
        try:
            measured = uncertainty(result, self.estimator)
        except (ValueError, LVLMError) as error:
            record.error = f"{type(error).__name__}: {error}"
            raise QueryFailure("judger", record.error) from error
        record.uncertainty, record.estimator = measured.value, measured.estimator
        return Judgement("LQP" if measured.value < self.threshold else "HQP", measured)
