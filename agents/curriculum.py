"""The agents' training curriculum: every step's request, built by the code the agents send it with, and its target.

For one training query (question, ranked pages, ground truth) :meth:`AgentCurriculum.examples` yields the
examples of the chosen steps of :data:`~agents.steps.STEPS`, each an :class:`Example` of the step's
:class:`~hkrag.lvlm.LVLMRequest` (made by :func:`agents.context.step_request`, the function
:meth:`~agents.context.QueryContext.ask` sends through, with the settings the agents pass) and the reply a correct
agent gives, derived from the ground truth (:class:`~hkrag.rag.records.QueryTruth`,
:class:`~hkrag.rag.records.PageTruth`), never from a model (docs/training.md, "The agents' curriculum"):

- ``pruner`` (Eq. 6), for n = 1 … k−1 over the buffer: ``yes`` iff pages 1..n hold a relevant page (qrels);
- ``answer``, ``single_pass``, ``verify``, ``integrate``: the first gold answer;
- ``salient`` (I_h): the pages' salient strings, one line per page, ``Page n: s1; s2; …`` in reading order;
- ``fine_print`` (Eq. 7): at t = 1 the pages' fine-print strings laid out alike; at t > 1 (reached only when the
  ``decouple`` reply said no) nothing new, an empty reply;
- ``decouple`` (Eq. 8): the fine-print notes, then the line ``<answered_marker> yes`` iff a relevant page is
  among the pages and its fine print holds one of the answers (the notes hold the asked value), else ``no``.

The later steps see the pages a correct Pruner keeps (the first n that hold a relevant page, else the buffer)
and/or the whole buffer (``kept``); the single pass always sees the buffer, as it does at inference. A buffer
without a relevant page still teaches the answer steps ``answers[0]`` (VDocGenerator's recipe) unless
``answer_unanswerable`` is false: then only its Pruner and notes examples are given, so no answer is learnt
from pages that cannot hold it. Identical (step, request) pairs are given once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hkrag.lvlm import LVLMRequest, LVLMResult
from hkrag.rag.records import CallRecord, Page, PageTruth, QueryTruth

from .context import step_request
from .decoupler import read_answered
from .judger import Judger
from .mixture import Mixture
from .pipeline import GeneratorConfig
from .pruner import read_yes_no, record_reading
from .steps import STEPS

ORDERS = ("ranked", "relevant_first", "relevant_last")
"""How a page set is shown: as ranked, and/or (recipes for reading among pages) with its relevant pages moved
before the others (the Pruner's yes at n = 1) or behind them (its no before its yes; the answer found last)."""
KEPT = ("pruned", "all")
"""Which pages the steps after the Pruner learn on: those a correct Pruner keeps, and/or the whole buffer."""
NOTES_STEPS = frozenset({"salient", "fine_print", "decouple", "integrate"})
"""The steps whose request or target holds notes drawn from the pages' items."""


@dataclass(frozen=True)
class Example:
    """One training example: the step, the request the agents send for it, the target reply."""

    query_id: str
    step: str
    request: LVLMRequest
    target: str
    iteration: int | None = None


def notes(pages: Sequence[Page], truth: Mapping[str, PageTruth], kind: str) -> str:
    """The ``kind`` strings (``salient`` or ``fine_print``) of ``pages`` in reading order, one line per page that has
    any: ``"Page n: s1; s2"`` with ``n`` the page's position in the prompt (from 1)."""
    missing = [page.key for page in pages if page.key not in truth]
    if missing:
        raise KeyError(f"no drawn items for page(s) {missing[:3]}: notes targets need the corpus's items "
                       "(hkrag.data.synthetic.load_page_items)")
    lines = [f"Page {n}: " + "; ".join(getattr(truth[page.key], kind)) for n, page in enumerate(pages, 1)
             if getattr(truth[page.key], kind)]
    return "\n".join(lines)


def holds_answer(pages: Sequence[Page], query: QueryTruth, truth: Mapping[str, PageTruth]) -> bool:
    """Whether the fine-print notes of ``pages`` hold the asked value (:meth:`QueryTruth.answered_by`)."""
    return query.answered_by([truth[page.key] for page in pages])


class AgentCurriculum:
    """The examples of ``steps`` (names of :data:`~agents.steps.STEPS`) under ``generator`` (a ``conf/generator``
    mapping: its prompts, caps, ``top_k`` and the Pruner's and Judger's ``top_logprobs``); ``balance_pruner``,
    ``focus`` and ``others_share`` resample them for a stage (:class:`agents.mixture.Mixture`, :meth:`select`)."""

    def __init__(self, generator: Mapping[str, Any], steps: Sequence[str], kept: Sequence[str] = KEPT,
                 orders: Sequence[str] = ("ranked",), answer_unanswerable: bool = True, balance_pruner: bool = False,
                 focus: Sequence[str] = (), others_share: float = 0.0) -> None:
        if unknown := [step for step in steps if step not in STEPS]:
            raise ValueError(f"generator_training.curriculum.steps has unknown steps {unknown}; "
                             f"expected some of {list(STEPS)}")
        if not steps:
            raise ValueError("generator_training.curriculum.steps is empty: name the steps to train")
        if not kept or any(choice not in KEPT for choice in kept):
            raise ValueError(f"generator_training.curriculum.kept={list(kept)}: expected a non-empty list of {KEPT}")
        if not orders or any(order not in ORDERS for order in orders):
            raise ValueError(f"generator_training.curriculum.orders={list(orders)}: expected a non-empty list of "
                             f"{ORDERS}")
        self.config = GeneratorConfig.from_config(generator)
        self.steps, self.kept = tuple(dict.fromkeys(steps)), tuple(dict.fromkeys(kept))
        self.orders = tuple(dict.fromkeys(orders))
        self.answer_unanswerable = answer_unanswerable
        self.mixture = Mixture(bool(balance_pruner), tuple(focus), float(others_share))
        self.mixture.check(self.steps)
        self.judger = Judger(self.config.threshold, self.config.estimator, self.config.top_logprobs)

    @property
    def needs_items(self) -> bool:
        """Whether some step's request or target holds notes (the pages' drawn items are then required)."""
        return bool(NOTES_STEPS & set(self.steps))

    def select(self, examples: Sequence[Example], seed: int) -> list[Example]:
        """The examples a stage trains on (:meth:`agents.mixture.Mixture.apply`; all of them, in order, when no
        resampling is set), the same for the same ``seed``."""
        steps, targets = [example.step for example in examples], [example.target for example in examples]
        return [examples[i] for i in self.mixture.apply(steps, targets, seed)]

    def decision(self, step: str, result: LVLMResult) -> str | None:
        """How the agents read a reply to ``step``: the Pruner's yes/no (:func:`agents.pruner.read_yes_no`), the
        Decoupler's "answers the question" (:func:`agents.decoupler.read_answered`); ``None`` for other steps."""
        if step == "pruner":
            return "yes" if read_yes_no(result).yes else "no"
        if step == "decouple":
            return "yes" if read_answered(result.text, self.config.prompts.answered_marker)[0] else "no"
        return None

    def record(self, step: str, result: LVLMResult, record: CallRecord) -> None:
        """Write into ``record`` what the agents record of a reply to ``step``: its :meth:`decision` and, for the
        Pruner, its masses and P(yes) (:func:`agents.pruner.record_reading`)."""
        if step == "pruner":
            record_reading(record, read_yes_no(result))
        else:
            record.decision = self.decision(step, result)

    def request(self, question: str, step: str, pages: Sequence[Page], top_logprobs: int = 0,
                **values: str) -> LVLMRequest:
        """The request the agents send for ``step`` (:func:`agents.context.step_request`)."""
        return step_request(self.config.prompts, self.config.caps, question, step, pages, top_logprobs, **values)[1]

    def examples(self, query: QueryTruth, question: str, page_sets: Sequence[Sequence[Page]],
                 truth: Mapping[str, PageTruth] | None = None) -> list[Example]:
        """The examples of one query on each of its ``page_sets`` (each ranked, e.g. its gold pages and a retriever's
        top k), each (step, request) once: ``question`` as the agents ask it, ``truth`` the pages' items (needed by
        the notes steps)."""
        if self.needs_items and truth is None:
            raise ValueError(f"steps {sorted(NOTES_STEPS & set(self.steps))} need the pages' drawn items")
        if not query.answers:
            raise ValueError(f"training query {query.query_id!r} has no answer: the answer steps' target is "
                             "answers[0]")
        seen, found = set(), []
        for buffer in [ordered for pages in page_sets for ordered in self.ordered(query, pages)]:
            for example in self._all(query, question, buffer, truth or {}):
                key = (example.step, tuple(page.key for page in example.request.images),
                       tuple(message.text for message in example.request.messages), example.request.settings)
                if example.step in self.steps and key not in seen:
                    seen.add(key)
                    found.append(example)
        return found

    def ordered(self, query: QueryTruth, pages: Sequence[Page]) -> list[list[Page]]:
        """The buffer (the first ``top_k`` of ``pages``) in each of :attr:`orders`."""
        buffer = list(pages[: self.config.top_k])
        relevant = [page for page in buffer if page.key in query.relevant]
        others = [page for page in buffer if page.key not in query.relevant]
        orders = {"ranked": buffer, "relevant_first": relevant + others, "relevant_last": others + relevant}
        return [orders[order] for order in self.orders]

    def _all(self, query: QueryTruth, question: str, buffer: list[Page],
             truth: Mapping[str, PageTruth]) -> Iterator[Example]:
        """Every step's examples for the buffer, in the order the agents ask."""
        def example(step: str, pages: Sequence[Page], target: str, iteration: int | None = None,
                    top_logprobs: int = 0, **values: str) -> Example:
            return Example(query.query_id, step, self.request(question, step, pages, top_logprobs, **values), target,
                           iteration)

        answer = query.answers[0]
        kept = buffer
        for n in range(1, len(buffer)):
            relevant = any(page.key in query.relevant for page in buffer[:n])
            yield example("pruner", buffer[:n], "yes" if relevant else "no", n, self.config.top_logprobs, n=str(n))
            if relevant:
                kept = buffer[:n]
                break
        answers = self.answer_unanswerable or any(page.key in query.relevant for page in buffer)
        if answers:
            yield example("single_pass", buffer, answer)
        sets = [kept if choice == "pruned" else buffer for choice in self.kept]
        for pages in [pages for i, pages in enumerate(sets) if pages not in sets[:i]]:
            if answers:
                yield example("answer", pages, answer, top_logprobs=self.judger.alternatives)
                yield example("verify", pages, answer)
            if self.needs_items:
                yield from self._decoupler(example, query, pages, truth, answer if answers else None)

    def _decoupler(self, example, query: QueryTruth, pages: Sequence[Page], truth: Mapping[str, PageTruth],
                   answer: str | None) -> Iterator[Example]:
        """The Decoupler's and (with an ``answer``) the integration's examples on ``pages`` (Eqs. 7–8, then the
        Summarizer's HQP)."""
        prompts = self.config.prompts
        salient, fine = notes(pages, truth, "salient"), notes(pages, truth, "fine_print")
        marker = f"{prompts.answered_marker} {'yes' if holds_answer(pages, query, truth) else 'no'}"
        yield example("salient", pages, salient)
        yield example("fine_print", pages, fine, 1, salient=salient, fine_print=prompts.no_notes)
        yield example("decouple", pages, f"{fine}\n{marker}" if fine else marker, 1, salient=salient,
                      fine_print=fine or prompts.no_notes)
        if marker.endswith("no") and self.config.caps.max_iters > 1:
            yield example("fine_print", pages, "", 2, salient=salient, fine_print=fine or prompts.no_notes)
        if answer is not None:
            yield example("integrate", pages, answer, salient=salient, fine_print=fine)
