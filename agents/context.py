"""One query's conversation with the LVLM: every call recorded, every cap enforced.

The agents ask through a :class:`QueryContext`, which renders the prompt (pages first), calls the backend
once (network retries belong to the backends), records a :class:`~hkrag.rag.records.CallRecord` and stops
the query with a :class:`QueryFailure` naming the agent and the reason when the backend fails, a page does
not load, or the query's calls, tokens or seconds pass their caps. Nothing here loops: the number of calls
is bounded by ``max_calls``, and the Decoupler's loop by ``max_iters``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hkrag.data.images import ImageError
from hkrag.lvlm import GenerationSettings, LVLMBackend, LVLMError, LVLMResult, PageImage
from hkrag.rag.records import CallRecord

from .prompts import Prompts, build_request, shown

REPLY_KINDS = {
    "pruner": "yes_no",
    "answer": "answer",
    "single_pass": "answer",
    "verify": "answer",
    "integrate": "answer",
    "salient": "notes",
    "fine_print": "notes",
    "decouple": "notes",
}
"""Which ``max_new_tokens`` entry bounds each prompt's reply."""


@dataclass(frozen=True)
class Caps:
    """Per-query bounds. ``max_new_tokens`` holds the per-call limit of each reply kind
    (``yes_no``: the Pruner; ``answer``: Judger, Summarizer, single pass; ``notes``: the Decoupler)."""

    max_iters: int = 3
    max_calls: int = 16
    max_total_tokens: int = 200_000
    max_seconds: float = 300.0
    max_new_tokens: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("max_iters", "max_calls", "max_total_tokens", "max_seconds"):
            if getattr(self, name) is None or getattr(self, name) <= 0:
                raise ValueError(f"generator caps.{name} must be a positive number, got {getattr(self, name)!r}")
        tokens = {"yes_no": 4, "answer": 64, "notes": 256, **(self.max_new_tokens or {})}
        if unknown := set(tokens) - set(REPLY_KINDS.values()):
            raise ValueError(f"generator caps.max_new_tokens has unknown kinds {sorted(unknown)}")
        if bad := {kind: n for kind, n in tokens.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1}:
            raise ValueError(f"generator caps.max_new_tokens must be positive integers, got {bad}")
        object.__setattr__(self, "max_new_tokens", tokens)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Caps:
        return cls(**dict(config or {}))


class QueryFailure(Exception):
    """A query that cannot be answered: ``agent`` is where it stopped, ``reason`` why."""

    def __init__(self, agent: str, reason: str) -> None:
        super().__init__(f"{agent}: {reason}")
        self.agent = agent
        self.reason = reason


class QueryContext:
    """The LVLM calls of one query: renders, calls, records, and enforces :class:`Caps`."""

    def __init__(
        self,
        backend: LVLMBackend,
        prompts: Prompts,
        caps: Caps,
        question: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.backend = backend
        self.prompts = prompts
        self.caps = caps
        self.question = question
        self.clock = clock
        self.start = clock()
        self.calls: list[CallRecord] = []

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    @property
    def total_tokens(self) -> int:
        return sum(c.prompt_tokens + c.completion_tokens for c in self.calls)

    def ask(
        self,
        agent: str,
        step: str,
        pages: Sequence[PageImage],
        *,
        iteration: int | None = None,
        top_logprobs: int = 0,
        **values: str,
    ) -> tuple[LVLMResult, CallRecord]:
        """Ask prompt ``step`` about ``pages``; the result and its (already appended) record."""
        if len(self.calls) >= self.caps.max_calls:
            raise QueryFailure(agent, f"call cap reached (max_calls={self.caps.max_calls})")
        text = self.prompts.render(step, question=self.question, **values)
        settings = GenerationSettings(
            max_new_tokens=self.caps.max_new_tokens[REPLY_KINDS[step]], top_logprobs=top_logprobs
        )
        page_ids = [page.key for page in pages]
        started = self.clock()
        try:
            result = self.backend(build_request(pages, text, settings))
        except (LVLMError, ImageError) as error:
            reason = f"{type(error).__name__}: {error}"
            self.calls.append(CallRecord(agent, shown(pages, text), page_ids, step=step, iteration=iteration,
                                         latency_s=self.clock() - started, error=reason))
            raise QueryFailure(agent, reason) from error
        record = CallRecord.from_result(agent, shown(pages, text), page_ids, result, step=step, iteration=iteration)
        self.calls.append(record)
        self.check_budget(agent)
        return result, record

    def check_budget(self, agent: str) -> None:
        """Stop the query once its tokens or wall time pass their caps."""
        if self.total_tokens > self.caps.max_total_tokens:
            raise QueryFailure(
                agent, f"token cap exceeded ({self.total_tokens} > max_total_tokens={self.caps.max_total_tokens})"
            )
        if self.elapsed > self.caps.max_seconds:
            raise QueryFailure(agent, f"time cap exceeded ({self.elapsed:.3f} s > max_seconds={self.caps.max_seconds})")
