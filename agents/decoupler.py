"""The Decoupler (paper §3.3, Eqs. 7–8): mine fine print anchored on the salient content.

First the salient knowledge I_h (the prominent content related to the question). Then, for
t = 1 … ``max_iters``: the fine-print notes I_d(t) = Θ(I_h, I_d(t−1)) (Eq. 7, the previous notes in, new
overlooked details out) and the decoupled I′_d(t) = Θ(I_h, I_d(t)) (Eq. 8, the fine print restated apart
from the salient content, ending with the prompts' ``answered_marker`` and yes or no).

The notes accumulate: I_d(t) is I_d(t−1) followed by the details the ``fine_print`` call of iteration t
found (the call asks only for what the notes so far overlooked), so the ``decouple`` call of iteration t
sees the details of iterations 1 … t. The loop stops at the first I′_d(t) that answers the question, and
the Summarizer integrates that I′_d(t) (an I′_d that holds nothing but the marker hands on I_d(t)
instead). At ``max_iters`` no I′_d answered: the outcome is marked ``capped="max_iters"`` and the
Summarizer still integrates what was found, as the paper does, namely the accumulated notes I_d(max_iters)
(every detail of every iteration, not only the last restatement that was judged insufficient).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from hkrag.rag.records import Page

from .context import QueryContext
from .pruner import normalise


@dataclass(frozen=True)
class Decoupled:
    """What the Decoupler hands the Summarizer: I_h, the fine print (the answering I′_d(t), or the
    accumulated notes I_d(max_iters) when capped), and how the loop ended."""

    salient: str
    fine_print: str
    iterations: int
    answered: bool


def read_answered(text: str, marker: str) -> tuple[bool, str]:
    """Whether ``text`` ends its Eq. 8 reply with ``marker`` + yes, and the text without that marker line."""
    found = list(re.finditer(re.escape(marker) + r"[ \t*_]*(\S*)[^\n]*", text, flags=re.IGNORECASE))
    if not found:
        return False, text.strip()
    last = found[-1]
    return normalise(last.group(1)) == "yes", (text[: last.start()] + text[last.end():]).strip()


def accumulate(notes: str, details: str) -> str:
    """Eq. 7's I_d(t): the notes I_d(t−1) followed by iteration t's new ``details`` (blank details add nothing)."""
    details = details.strip()
    return f"{notes}\n{details}" if notes and details else notes or details


@dataclass(frozen=True)
class Decoupler:
    """Eqs. 7–8, at most ``max_iters`` iterations (``generator.caps.max_iters``)."""

    max_iters: int

    def decouple(self, ctx: QueryContext, pages: Sequence[Page]) -> Decoupled:
        """I_h, then Eqs. 7–8 until an I′_d(t) answers the question or ``max_iters`` is reached."""
        salient, _ = ctx.ask("salient", pages)
        notes = ""
        for t in range(1, self.max_iters + 1):
            mined, _ = ctx.ask("fine_print", pages, iteration=t, salient=salient.text,
                               fine_print=notes or ctx.prompts.no_notes)
            notes = accumulate(notes, mined.text)
            separated, record = ctx.ask("decouple", pages, iteration=t, salient=salient.text,
                                        fine_print=notes or ctx.prompts.no_notes)
            answered, decoupled = read_answered(separated.text, ctx.prompts.answered_marker)
            record.decision = "yes" if answered else "no"
            if answered:
                return Decoupled(salient.text, decoupled or notes, t, True)
        return Decoupled(salient.text, notes, self.max_iters, False)
