"""The generators: HKRAG's uncertainty-guided agents and the single-pass baseline, built from config.

``build_generator(config, backend)`` takes a ``generator`` config (``conf/generator/*.yaml``):

- ``kind: agentic`` — Pruner (Eq. 6) → Judger (Definitions 1–2) → LQP: Summarizer verifies; HQP: Decoupler
  (Eqs. 7–8) → Summarizer integrates. ``pruner: false`` keeps a fixed top-k and ``decoupler: false`` sends
  every query straight to the Summarizer's verification, route ``verify_only`` (the Table 6 ablations;
  without the Decoupler both routes end in the same verification, so no Judger call is made).
- ``kind: single_pass`` — one call with the top-k pages and VDocGenerator's prompt (VDocRAG's generator,
  k = 3).

``Generator.answer`` never raises for a per-query problem: an LVLM error, a page that fails to load, a
query with no pages (unless ``allow_no_pages``, the no-retrieval baseline) or a cap reached becomes a
failed :class:`~hkrag.rag.records.QueryOutcome` that names the agent and the reason, holds every call made
so far, and counts as wrong downstream. Configuration errors raise when the generator is built, before
any query: unknown or missing keys, bad values, a ``caps.max_calls`` below the longest path of the
configuration (:func:`longest_path`), all listed by :meth:`GeneratorConfig.problems`, and an estimator the
backend cannot serve (:meth:`Judger.check_backend`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from hkrag.lvlm import LVLMBackend
from hkrag.lvlm.uncertainty import ESTIMATORS
from hkrag.rag.records import INPUTS, Query, QueryOutcome

from .checks import choice_problem, flag_problem, number_problem
from .context import Caps, QueryContext, QueryFailure
from .decoupler import Decoupler
from .judger import Judger
from .prompts import Prompts
from .pruner import Pruner
from .steps import STEPS, longest_route
from .summarizer import Summarizer

FIELD_CHECKS: dict[str, Callable[[str, Any], str | None]] = {
    "name": lambda key, value: None if isinstance(value, str) and value else f"{key}={value!r}: expected a name",
    "kind": lambda key, value: choice_problem(key, value, tuple(GENERATORS)),
    "top_k": lambda key, value: number_problem(key, value, integer=True, low=1),
    "pruner": flag_problem,
    "decoupler": flag_problem,
    "threshold": lambda key, value: number_problem(key, value, integer=False, low=0, high=1),  # the range of H′
    "estimator": lambda key, value: choice_problem(key, value, ESTIMATORS),
    "top_logprobs": lambda key, value: number_problem(key, value, integer=True, low=0, high=20),  # vLLM's most
    "allow_no_pages": flag_problem,
    "input": lambda key, value: choice_problem(key, value, INPUTS),
    "text_column": lambda key, value: None if isinstance(value, str) and value else f"{key}={value!r}: expected a "
                                                                                     "corpus column name",
    "max_page_tokens": lambda key, value: number_problem(key, value, integer=True, low=1),
}
"""The checks of the generator group's settings besides ``caps`` and ``prompts``, by key."""


@dataclass(frozen=True)
class GeneratorConfig:
    """The ``generator`` config group, checked here and only here (:meth:`problems`); its values, the
    paper's by default, live in ``conf/generator/hkrag.yaml`` (docs/agents.md)."""

    prompts: Prompts
    caps: Caps
    name: str
    kind: str
    top_k: int
    pruner: bool
    decoupler: bool
    threshold: float
    estimator: str
    top_logprobs: int
    allow_no_pages: bool
    input: str = "image"
    text_column: str = "text"
    max_page_tokens: int = 1024

    @classmethod
    def problems(cls, config: Mapping[str, Any]) -> list[str]:
        """Every problem of a ``generator`` config mapping, each naming key, value and what is allowed;
        empty when :meth:`from_config` accepts it. ``eval.py`` lists them with the other groups' problems
        before anything is built (:func:`hkrag.tasks.validation.validate_config`'s ``extra``)."""
        known = [f.name for f in fields(cls)]
        if unknown := set(config) - set(known):
            return [f"generator config has unknown keys {sorted(unknown)}; expected some of {sorted(known)}"]
        if missing := {f.name for f in fields(cls) if f.default is MISSING} - set(config):
            return [f"generator config lacks {sorted(missing)} (see conf/generator/hkrag.yaml)"]
        problems = [check(f"generator.{key}", config[key]) for key, check in FIELD_CHECKS.items() if key in config]
        problems += Caps.problems(config["caps"])
        try:
            Prompts.from_config(config["prompts"])
        except ValueError as error:
            problems.append(str(error))
        problems = [problem for problem in problems if problem]
        return problems or call_cap_problems(cls.build(config))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GeneratorConfig:
        """The checked config of a ``generator`` mapping; a bad one is an error listing :meth:`problems`."""
        if problems := cls.problems(config):
            raise ValueError("; ".join(problems))
        return cls.build(config)

    @classmethod
    def build(cls, config: Mapping[str, Any]) -> GeneratorConfig:
        """The config of a mapping whose settings are each valid (unchecked: use :meth:`from_config`)."""
        return cls(**{**config, "prompts": Prompts.from_config(config["prompts"]),
                      "caps": Caps.from_config(config["caps"])})


def longest_path(config: GeneratorConfig) -> dict[str, int]:
    """The LVLM calls of a query's longest path under ``config``, by agent, from :data:`~agents.steps.STEPS`.

    Agentic: the Pruner's k−1 (without ``pruner``: none), the Judger's 1, the Decoupler's 1 + 2·max_iters
    (HQP; without ``decoupler`` neither Judger nor Decoupler runs) and the Summarizer's 1; single pass: 1.
    """
    path: dict[str, int] = {}
    for name in longest_route(config.kind, config.pruner, config.decoupler):
        step = STEPS[name]
        path[step.agent] = path.get(step.agent, 0) + step.calls(config.top_k, config.caps.max_iters)
    return path


def call_cap_problems(config: GeneratorConfig) -> list[str]:
    """A ``caps.max_calls`` below the longest path would fail queries by design: a problem naming both."""
    path = longest_path(config)
    minimum = sum(path.values())
    if config.caps.max_calls >= minimum:
        return []
    calls = " + ".join(f"{agent} {count}" for agent, count in path.items())
    return [f"generator caps.max_calls={config.caps.max_calls} is below the {minimum} calls of the longest path "
            f"({calls}); set caps.max_calls >= {minimum}"]


class Generator(ABC):
    """Answers queries on ``backend``; one query's calls run one after another."""

    def __init__(self, config: GeneratorConfig, backend: LVLMBackend,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock

    def answer(self, query: Query) -> QueryOutcome:
        """The query's outcome; a per-query problem gives ``failed=True`` with the reason, never an exception."""
        outcome = QueryOutcome(query.query_id, query.question, list(query.gold), dataset=query.dataset,
                               pool=query.pool, retrieved=[page.key for page in query.pages])
        ctx = QueryContext(self.backend, self.config.prompts, self.config.caps, query.question, self.clock)
        try:
            if not query.pages and not self.config.allow_no_pages:
                raise QueryFailure("generator", "the query has no pages (allow_no_pages is false)")
            self.run(ctx, query, outcome)
        except QueryFailure as failure:
            outcome.failed, outcome.failure, outcome.answer = True, str(failure), ""
        outcome.calls, outcome.wall_s = ctx.calls, ctx.elapsed
        outcome.iterations = max((c.iteration or 0 for c in ctx.calls if c.agent == "decoupler"), default=0)
        return outcome

    def answer_many(self, queries: Iterable[Query]) -> Iterator[QueryOutcome]:
        """Outcomes in the order of ``queries``, one query at a time."""
        for query in queries:
            yield self.answer(query)

    @abstractmethod
    def run(self, ctx: QueryContext, query: Query, outcome: QueryOutcome) -> None:
        """Answer ``query`` through ``ctx``, filling ``outcome`` (kept pages, route, answer)."""


class SinglePassGenerator(Generator):
    """One call with the top-k pages and the ``single_pass`` prompt (VDocRAG's generator); route ``single_pass``."""

    def run(self, ctx: QueryContext, query: Query, outcome: QueryOutcome) -> None:
        kept = query.pages[: self.config.top_k]
        outcome.kept = [page.key for page in kept]
        result, _ = ctx.ask("single_pass", kept)
        outcome.route, outcome.answer = "single_pass", result.text.strip()


class AgenticGenerator(Generator):
    """HKRAG's generator (paper §3.3): Pruner → Judger → (Decoupler) → Summarizer."""

    def __init__(self, config: GeneratorConfig, backend: LVLMBackend,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(config, backend, clock)
        self.pruner = Pruner(config.top_k, config.top_logprobs)
        self.judger = Judger(config.threshold, config.estimator, config.top_logprobs)
        if config.decoupler:
            self.judger.check_backend(backend)
        self.decoupler = Decoupler(config.caps.max_iters)
        self.summarizer = Summarizer()

    def run(self, ctx: QueryContext, query: Query, outcome: QueryOutcome) -> None:
        kept = self.pruner.select(ctx, query.pages) if self.config.pruner else query.pages[: self.config.top_k]
        outcome.kept = [page.key for page in kept]
        if not self.config.decoupler:
            outcome.route = "verify_only"
            outcome.answer = self.summarizer.verify(ctx, kept)
            return
        judgement = self.judger.judge(ctx, kept)
        outcome.route = judgement.route
        outcome.uncertainty, outcome.estimator = judgement.uncertainty.value, judgement.uncertainty.estimator
        if judgement.route == "LQP":
            outcome.answer = self.summarizer.verify(ctx, kept)
            return
        knowledge = self.decoupler.decouple(ctx, kept)
        outcome.capped = None if knowledge.answered else "max_iters"
        outcome.answer = self.summarizer.integrate(ctx, kept, knowledge)


GENERATORS: dict[str, type[Generator]] = {"agentic": AgenticGenerator, "single_pass": SinglePassGenerator}


def context_problem(config: GeneratorConfig, context_length: int | None) -> str | None:
    """With text pages, ``top_k`` pages of ``max_page_tokens`` words plus the longest reply must fit a backend's
    declared ``context_length`` (a word is at least one token, so this is the least the prompt needs)."""
    if config.input != "text" or context_length is None:
        return None
    needed = config.top_k * config.max_page_tokens + max(config.caps.max_new_tokens.values())
    if needed <= context_length:
        return None
    return (f"generator.top_k={config.top_k} text pages of generator.max_page_tokens={config.max_page_tokens} plus a "
            f"reply of {max(config.caps.max_new_tokens.values())} tokens need at least {needed} tokens, more than the "
            f"backend's context_length={context_length}: lower generator.max_page_tokens")


def build_generator(config: Mapping[str, Any], backend: LVLMBackend) -> Generator:
    """The generator a ``generator`` config describes, answering on ``backend`` (whose context must hold the
    text pages, :func:`context_problem`)."""
    checked = GeneratorConfig.from_config(config)
    if problem := context_problem(checked, backend.context_length):
        raise ValueError(problem)
    return GENERATORS[checked.kind](checked, backend)
