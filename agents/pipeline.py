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
any query: unknown keys, bad values, a ``caps.max_calls`` below the longest path of the configuration
(:func:`longest_path`), and an estimator the backend cannot serve (:meth:`Judger.check_backend`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from hkrag.lvlm import LVLMBackend
from hkrag.rag.records import Query, QueryOutcome

from .context import Caps, QueryContext, QueryFailure
from .decoupler import Decoupler
from .judger import Judger
from .prompts import Prompts
from .pruner import Pruner
from .summarizer import Summarizer

KINDS = ("agentic", "single_pass")


@dataclass(frozen=True)
class GeneratorConfig:
    """The ``generator`` config group, checked: unknown keys and bad values are errors that name them."""

    prompts: Prompts
    caps: Caps
    name: str = "hkrag"
    kind: str = "agentic"
    top_k: int = 3
    pruner: bool = True
    decoupler: bool = True
    threshold: float = 0.8
    estimator: str = "token_plogp"
    top_logprobs: int = 5
    allow_no_pages: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"generator kind must be one of {KINDS}, got {self.kind!r}")
        if self.top_k < 1:
            raise ValueError(f"generator top_k must be >= 1, got {self.top_k}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"generator.threshold={self.threshold!r}: must be in [0, 1], the range of H′")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"generator top_logprobs must be in [0, 20], got {self.top_logprobs}")
        check_call_cap(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GeneratorConfig:
        known = {f.name for f in fields(cls)}
        if unknown := set(config) - known:
            raise ValueError(f"generator config has unknown keys {sorted(unknown)}; expected some of {sorted(known)}")
        if "prompts" not in config:
            raise ValueError("generator config lacks 'prompts' (see conf/generator/hkrag.yaml)")
        return cls(**{**config, "prompts": Prompts.from_config(config["prompts"]),
                      "caps": Caps.from_config(config.get("caps"))})


def longest_path(config: GeneratorConfig) -> dict[str, int]:
    """The LVLM calls of a query's longest path under ``config``, by agent.

    Agentic: the Pruner's k−1 (without ``pruner``: none), the Judger's 1, the Decoupler's 1 + 2·max_iters
    (HQP; without ``decoupler`` neither Judger nor Decoupler runs) and the Summarizer's 1; single pass: 1.
    """
    if config.kind == "single_pass":
        return {"single_pass": 1}
    path = {"pruner": config.top_k - 1} if config.pruner else {}
    if config.decoupler:
        path |= {"judger": 1, "decoupler": 1 + 2 * config.caps.max_iters}
    return path | {"summarizer": 1}


def check_call_cap(config: GeneratorConfig) -> None:
    """A ``caps.max_calls`` below the longest path would fail queries by design: an error naming both."""
    path = longest_path(config)
    minimum = sum(path.values())
    if config.caps.max_calls < minimum:
        calls = " + ".join(f"{agent} {count}" for agent, count in path.items())
        raise ValueError(f"generator caps.max_calls={config.caps.max_calls} is below the {minimum} calls of the "
                         f"longest path ({calls}); set caps.max_calls >= {minimum}")


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
        result, _ = ctx.ask("single_pass", "single_pass", kept)
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


def build_generator(config: Mapping[str, Any], backend: LVLMBackend) -> Generator:
    """The generator a ``generator`` config describes, answering on ``backend``."""
    checked = GeneratorConfig.from_config(config)
    return GENERATORS[checked.kind](checked, backend)
