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
from dataclasses import dataclass, fields
from typing import Any

from hkrag.lvlm import GenerationSettings, LVLMBackend, LVLMError, LVLMRequest, LVLMResult
from hkrag.lvlm.base import ImageError
from hkrag.rag.records import CallRecord, Page

from .checks import number_problem
from .prompts import Prompts, build_request, shown
from .steps import REPLY_KINDS, STEPS

COUNTS = ("max_iters", "max_calls", "max_total_tokens")


@dataclass(frozen=True)
class Caps:
    """Per-query bounds (``generator.caps``; conf/generator/hkrag.yaml holds the values). ``max_new_tokens``
    holds the per-call limit of each reply kind of :data:`~agents.steps.REPLY_KINDS`."""

    max_iters: int
    max_calls: int
    max_total_tokens: int
    max_seconds: float
    max_new_tokens: Mapping[str, int]

    @classmethod
    def problems(cls, config: Any) -> list[str]:
        """Every problem of a ``caps`` mapping, each naming key, value and what is allowed."""
        if not isinstance(config, Mapping):
            return [f"generator.caps={config!r}: expected a mapping (see conf/generator/hkrag.yaml)"]
        if problem := keys_problem("generator.caps", config, [f.name for f in fields(cls)]):
            return [problem]
        problems = [number_problem(f"generator.caps.{name}", config[name], integer=True, low=1) for name in COUNTS]
        problems.append(number_problem("generator.caps.max_seconds", config["max_seconds"], integer=False, low=0,
                                       low_open=True))
        tokens = config["max_new_tokens"]
        if not isinstance(tokens, Mapping):
            return [f"generator.caps.max_new_tokens={tokens!r}: expected a mapping of {list(REPLY_KINDS)}"]
        problems.append(keys_problem("generator.caps.max_new_tokens", tokens, REPLY_KINDS))
        problems += [number_problem(f"generator.caps.max_new_tokens.{kind}", tokens[kind], integer=True, low=1)
                     for kind in REPLY_KINDS if kind in tokens]
        return [problem for problem in problems if problem]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Caps:
        """The caps of a checked config mapping; a bad one is an error listing :meth:`problems`."""
        if problems := cls.problems(config):
            raise ValueError("; ".join(problems))
        return cls(**{**config, "max_new_tokens": dict(config["max_new_tokens"])})


def keys_problem(key: str, config: Mapping[str, Any], names: Sequence[str]) -> str | None:
    """The unknown and the missing keys of the mapping at ``key``, or ``None`` when it has exactly ``names``."""
    unknown, missing = sorted(set(config) - set(names)), sorted(set(names) - set(config))
    if not unknown and not missing:
        return None
    parts = [f"has unknown keys {unknown}"] * bool(unknown) + [f"lacks {missing}"] * bool(missing)
    return f"{key} {' and '.join(parts)}; expected {list(names)} (see conf/generator/hkrag.yaml)"


def step_request(prompts: Prompts, caps: Caps, question: str, step: str, pages: Sequence[Page],
                 top_logprobs: int = 0, **values: str) -> tuple[str, LVLMRequest]:
    """The prompt text and the request of step ``step`` about ``pages``: the one place a call is built.

    :meth:`QueryContext.ask` sends it; the training curriculum (:mod:`agents.curriculum`) learns on it, so a
    training prompt is the inference prompt by construction. The reply is capped by the step's kind
    (:data:`~agents.steps.STEPS`, ``caps.max_new_tokens``) and it asks for the step's ``words`` masses."""
    text = prompts.render(step, question=question, **values)
    settings = GenerationSettings(max_new_tokens=caps.max_new_tokens[STEPS[step].reply], top_logprobs=top_logprobs,
                                  word_mass=STEPS[step].words)
    return text, build_request(pages, text, settings)


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
        step: str,
        pages: Sequence[Page],
        *,
        iteration: int | None = None,
        top_logprobs: int = 0,
        **values: str,
    ) -> tuple[LVLMResult, CallRecord]:
        """Ask prompt ``step`` (its agent and reply cap from :data:`~agents.steps.STEPS`) about ``pages``; the
        result and its (already appended) record."""
        agent = STEPS[step].agent
        if len(self.calls) >= self.caps.max_calls:
            raise QueryFailure(agent, f"call cap reached (max_calls={self.caps.max_calls})")
        text, request = step_request(self.prompts, self.caps, self.question, step, pages, top_logprobs, **values)
        page_ids = [page.key for page in pages]
        started = self.clock()
        try:
            result = self.backend(request)
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
