"""The Judger (paper §3.3, Definitions 1–2): route on the uncertainty of an initial answer.

The LVLM answers from the kept pages; the answer's normalised uncertainty H′ (estimator from the config,
default the paper's mean −p·log p over the chosen tokens, :mod:`hkrag.lvlm.uncertainty`) below the
threshold h makes a low-uncertainty pair (LQP, to the Summarizer), otherwise a high-uncertainty pair (HQP,
to the Decoupler). The initial answer is only measured: it is never shown to a later agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.lvlm import PageImage, Uncertainty
from hkrag.lvlm.uncertainty import ESTIMATORS, uncertainty

from .context import QueryContext

NEEDS_ALTERNATIVES = frozenset({"entropy_topk", "entropy"})
"""Estimators that read the ``top_logprobs`` alternatives (``entropy`` falls back to them over HTTP)."""


@dataclass(frozen=True)
class Judgement:
    route: str
    uncertainty: Uncertainty


@dataclass(frozen=True)
class Judger:
    """Definitions 1–2 with threshold ``h`` and ``estimator``."""

    threshold: float = 0.8
    estimator: str = "token_plogp"
    top_logprobs: int = 5

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"generator estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"generator threshold must be in [0, 1], got {self.threshold}")

    def judge(self, ctx: QueryContext, pages: Sequence[PageImage]) -> Judgement:
        """LQP when H′ < h, else HQP; the uncertainty is recorded on the call."""
        top = self.top_logprobs if self.estimator in NEEDS_ALTERNATIVES else 0
        result, record = ctx.ask("judger", "answer", pages, top_logprobs=top)
        measured = uncertainty(result, self.estimator)
        record.uncertainty, record.estimator = measured.value, measured.estimator
        return Judgement("LQP" if measured.value < self.threshold else "HQP", measured)
