"""The agents' steps, one table: each prompt's agent, reply cap, placeholders and calls per query.

A step is one prompt of ``conf/generator/hkrag.yaml`` (``prompts:``) and one LVLM call: the context renders
it (:mod:`agents.context`), the trace records its name as ``CallRecord.step`` (:mod:`hkrag.rag.records`),
the prompts are checked against its placeholders (:mod:`agents.prompts`) and the longest path of a
configuration adds up its calls (:func:`agents.pipeline.longest_path`). docs/agents.md describes each step.
"""

from __future__ import annotations

from dataclasses import dataclass

REPEATS = ("once", "pages", "iterations")
"""How often a step runs on a query's longest path: once, for n = 1 … k−1 (Eq. 6), for t = 1 … max_iters."""


@dataclass(frozen=True)
class Step:
    """``agent`` asks it; ``reply`` names the ``caps.max_new_tokens`` entry that bounds its reply;
    ``placeholders`` are the fields its template may use; ``repeats`` is one of :data:`REPEATS`; ``words`` are
    the answer words whose first-token mass its request asks for (``GenerationSettings.word_mass``: the Pruner's
    yes and no, for its P(yes))."""

    agent: str
    reply: str
    placeholders: frozenset[str]
    repeats: str = "once"
    words: tuple[str, ...] = ()

    def calls(self, top_k: int, max_iters: int) -> int:
        """The step's calls on the longest path of a query with buffer ``top_k`` and ``max_iters``."""
        return {"once": 1, "pages": top_k - 1, "iterations": max_iters}[self.repeats]


QUESTION = frozenset({"question"})
NOTES = frozenset({"question", "salient", "fine_print"})

STEPS: dict[str, Step] = {
    "pruner": Step("pruner", "yes_no", frozenset({"question", "n"}), "pages", ("yes", "no")),  # Eq. 6: 1..n suffice?
    "answer": Step("judger", "answer", QUESTION),  # Definition 1: the initial answer, only measured
    "single_pass": Step("single_pass", "answer", QUESTION),  # the single-pass baseline (VDocGenerator's prompt)
    "verify": Step("summarizer", "answer", QUESTION),  # LQP: a fresh, verified answer
    "salient": Step("decoupler", "notes", QUESTION),  # I_h
    "fine_print": Step("decoupler", "notes", NOTES, "iterations"),  # Eq. 7: I_d(t)
    "decouple": Step("decoupler", "notes", NOTES, "iterations"),  # Eq. 8: I′_d(t), ending with the marker
    "integrate": Step("summarizer", "answer", NOTES),  # HQP: the answer from I_h and I′_d
}
"""Step (prompt) name -> :class:`Step`."""

REPLY_KINDS = tuple(dict.fromkeys(step.reply for step in STEPS.values()))
"""The ``caps.max_new_tokens`` entries: ``yes_no``, ``answer``, ``notes``."""

AGENTIC_ROUTE = ("answer", "salient", "fine_print", "decouple", "integrate")
"""The steps after the Pruner on the agentic generator's longest route (HQP, the Decoupler capped)."""


def longest_route(kind: str, pruner: bool, decoupler: bool) -> tuple[str, ...]:
    """The steps of a query's longest route: the single pass; else the Pruner (when on), then HQP through the
    Decoupler, or, without the Decoupler, the Summarizer's verification alone."""
    if kind == "single_pass":
        return ("single_pass",)
    return ("pruner",) * pruner + (AGENTIC_ROUTE if decoupler else ("verify",))
