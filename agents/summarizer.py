"""The Summarizer (paper §3.3): the final answer on either route.

LQP: a final verification. The paper forbids feeding the initial answer back ("neither used as model input
nor reflected upon"), so verification cannot show the model a candidate: it re-answers from the pages and
the question with the ``verify`` prompt (check the evidence on the pages, then answer). HQP: the
``integrate`` prompt combines the salient content I_h and the decoupled fine print I′_d (when the
Decoupler was capped, the notes it accumulated over every iteration) into a short answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.rag.records import Page

from .context import QueryContext
from .decoupler import Decoupled


@dataclass(frozen=True)
class Summarizer:
    """The two paths into the final answer."""

    def verify(self, ctx: QueryContext, pages: Sequence[Page]) -> str:
        """LQP: the verified answer, from the pages and question alone."""
        result, _ = ctx.ask("verify", pages)
        return result.text.strip()

    def integrate(self, ctx: QueryContext, pages: Sequence[Page], knowledge: Decoupled) -> str:
        """HQP: the answer from salient and fine-print knowledge (and the pages)."""
        result, _ = ctx.ask("integrate", pages, salient=knowledge.salient,
                            fine_print=knowledge.fine_print)
        return result.text.strip()
