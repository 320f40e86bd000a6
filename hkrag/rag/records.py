"""What the agentic generator records per query: every LVLM call and the query's outcome.

One :class:`QueryOutcome` per query is one line of the run's JSONL trace (``to_dict``/``from_dict``
round-trip). The answer evaluation fills ``judge`` and ``metrics``; the reports and the HTML page read
nothing else, so a trace alone reproduces every number of a run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hkrag.lvlm.base import Content, LVLMResult, PageImage

INPUTS = ("image", "text")
"""How a page reaches the generator (``generator.input``): its image, or its text (text RAG, Table 3)."""
WORD = re.compile(r"\S+")
"""A page-text token for the per-page budget: a whitespace-separated word (a word is one or more model tokens)."""


@dataclass(frozen=True)
class PageText:
    """A page as text in a prompt (``generator.input=text``): ``text`` from corpus column ``column`` of page
    ``key`` (its ``doc_id``). A page without text is an error naming both, never an empty page in a prompt."""

    text: str
    key: str
    column: str = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"page {self.key!r} has no text in corpus column {self.column!r} (got {self.text!r}); "
                             "fill it (python -m hkrag.data.ocr) or set generator.text_column")

    def truncated(self, max_tokens: int) -> PageText:
        """The page cut after its first ``max_tokens`` words (:data:`WORD`); unchanged when shorter."""
        words = list(WORD.finditer(self.text))
        if len(words) <= max_tokens:
            return self
        return PageText(self.text[: words[max_tokens - 1].end()], self.key, self.column)

    def prompt(self, position: int) -> str:
        """The page as the prompt shows it: ``"Page {position}:\n{text}\n\n"`` (``position`` counts from 1)."""
        return f"Page {position}:\n{self.text}\n\n"


Page = PageImage | PageText
"""A page handed to the generator: its image or its text."""


def page_content(page: Page, position: int) -> Content:
    """What ``page`` adds to a request at ``position`` (from 1): the image itself, or its text block."""
    return page.prompt(position) if isinstance(page, PageText) else page


def page_marker(page: Page) -> str:
    """How the trace shows ``page`` in a recorded prompt: ``<page:id>`` for an image, ``<text:id>`` for text."""
    return f"<{'text' if isinstance(page, PageText) else 'page'}:{page.key}>\n"

@dataclass(frozen=True)
class PageTruth:
    """What is drawn on a page, the ground truth the agents' training targets and the per-step report read.

    ``salient`` and ``fine_print`` hold the page's drawn strings of each kind in reading order (top to bottom, then
    left to right; ``hkrag.data.synthetic.load_page_truth``); ``fields`` its named values (the built-in corpus's
    ``label``, ``value``, ``code``, ``year``, ``page_no`` …, as drawn), e.g. ``fields["code"]``, the reference code.
    """

    doc_id: str
    salient: tuple[str, ...]
    fine_print: tuple[str, ...]
    fields: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class QueryTruth:
    """A question's ground truth: its gold ``answers`` (the first is the target), its relevant pages (qrels) and,
    for a built-in question, the page ``field`` it asks for (``hkrag.data.synthetic.question_field``)."""

    query_id: str
    question: str
    answers: tuple[str, ...]
    relevant: tuple[str, ...]
    field: str | None = None

    def answered_by(self, pages: Sequence[PageTruth]) -> bool:
        """Whether the fine print of ``pages`` holds the asked value: a relevant page among them has an answer as a
        whole word of its fine-print strings (:func:`words`: ``"P.3"`` in ``"REF K7  P.3"``, not ``"3"`` in
        ``"2023"``). The target of the Decoupler's "answers the question" marker (agents/curriculum.py)."""
        answers = set(self.answers)
        return any(page.doc_id in self.relevant and answers & words(" ".join(page.fine_print)) for page in pages)


def words(text: str) -> set[str]:
    """The whole words of ``text``, split at white space, ``/``, ``;`` and ``,`` (the notes' separators)."""
    return set(re.split(r"[\s/;,]+", text)) - {""}


ROUTES = ("LQP", "HQP", "single_pass", "verify_only", "failed")
"""Low-uncertainty pair (Judger → Summarizer verifies), high-uncertainty pair (→ Decoupler), the single-pass
baseline, the no-decoupler ablation (Pruner → Summarizer verifies, no Judger: without the Decoupler both of
its routes end in the same verification), or a query that failed before it was routed."""


@dataclass
class Query:
    """A question for the generator with its ranked pages (retrieved, gold, or none; images or texts) and gold
    answers."""

    query_id: str
    question: str
    pages: list[Page]
    gold: list[str] = field(default_factory=list)
    dataset: str = ""
    pool: str = ""


@dataclass
class CallRecord:
    """One LVLM call: which agent asked what about which pages, and what came back at what cost.

    ``step`` names the prompt (for the agentic generator, a step of ``agents/steps.py:STEPS``, docs/agents.md);
    ``iteration`` is the Decoupler's t (Eqs. 7–8) or the Pruner's n (Eq. 6). A yes/no call (Pruner,
    Decoupler's "answers the question") records its ``decision``; a Pruner call with token statistics also records
    the first token's yes-like and no-like probability masses (``p_yes``, ``p_no``), where they come from
    (``p_source``: ``full`` vocabulary or ``top_k`` candidates) and its P(yes) (``yes_probability``,
    ``agents.pruner``; docs/agents.md).
    """

    agent: str
    prompt: str
    page_ids: list[str]
    step: str = ""
    iteration: int | None = None
    output: str = ""
    num_tokens: int = 0
    mean_logprob: float | None = None
    min_logprob: float | None = None
    uncertainty: float | None = None
    estimator: str | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False
    decision: str | None = None
    p_yes: float | None = None
    p_no: float | None = None
    p_source: str | None = None
    yes_probability: float | None = None
    error: str | None = None

    @classmethod
    def from_result(
        cls, agent: str, prompt: str, page_ids: list[str], result: LVLMResult, step: str = "",
        iteration: int | None = None,
    ) -> CallRecord:
        """A record of a successful call (log-probabilities summarised as mean and minimum)."""
        logprobs = result.logprobs
        return cls(
            agent=agent,
            prompt=prompt,
            page_ids=list(page_ids),
            step=step,
            iteration=iteration,
            output=result.text,
            num_tokens=len(logprobs),
            mean_logprob=sum(logprobs) / len(logprobs) if logprobs else None,
            min_logprob=min(logprobs) if logprobs else None,
            latency_s=result.latency_s,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached=result.cached,
        )


@dataclass
class QueryOutcome:
    """A query's path through the generator and its final answer.

    ``failed`` queries (an LVLM error, a page that fails to load, a cap on calls/tokens/seconds reached)
    keep ``answer == ""``, name the agent and the reason in ``failure`` (``"judger: LVLMTimeoutError: …"``)
    and count as wrong in every metric: they are never dropped from a denominator. ``route`` is where the
    query got to (one of :data:`ROUTES`; ``"failed"`` when it failed before it was routed). ``capped``
    names a cap that ended a loop without failing the query: ``"max_iters"`` when the Decoupler reached its
    iteration cap without fine print that answers the question (the paper then summarises what it has,
    Eq. 8). ``evidence`` and ``grounding`` are the answer's evidence boxes and their score
    (:mod:`hkrag.rag.evidence`; empty / ``None`` when the run does not ground).
    """

    query_id: str
    question: str
    gold: list[str]
    dataset: str = ""
    pool: str = ""
    retrieved: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    route: str = "failed"
    uncertainty: float | None = None
    estimator: str | None = None
    iterations: int = 0
    capped: str | None = None
    answer: str = ""
    failed: bool = False
    failure: str | None = None
    calls: list[CallRecord] = field(default_factory=list)
    wall_s: float = 0.0
    judge: dict[str, Any] | None = None
    metrics: dict[str, float] | None = None
    evidence: list[dict[str, Any]] = field(default_factory=list)
    grounding: dict[str, Any] | None = None

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.calls)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.calls)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QueryOutcome:
        return cls(**{**data, "calls": [CallRecord(**c) for c in data.get("calls", [])]})
