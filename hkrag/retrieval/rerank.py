"""A first-stage ranker's top pages reordered by a page scorer (``retriever=rerank``; docs/evaluation.md, "Reranking").

:class:`RerankRanker` asks its ``first`` ranker for each query's top pages, scores the top ``depth`` of them (and
every page tied with the ``depth``-th, so no doc id decides which pages are scored) with ``scorer``, and returns
them ordered by that score above the first stage's remaining pages, which keep their first-stage order. The
scorer is a callable built at the composition root (``hkrag.tasks.rag.page_scorer``: the generator's
P(yes | question, page), the Pruner's request about each page alone), so this module never names a generator
package. Pages of equal P(yes) stay tied (the tie-aware metrics score them exactly); nothing breaks the tie.

Cost: every scored page is one LVLM call; :attr:`RerankRanker.cost` counts the queries, calls and seconds spent in
the scorer, and :attr:`RerankRanker.trace` holds each query's scored pages with their first-stage rank and score.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hkrag.lvlm import PageImage
from hkrag.retrieval.fusion import min_max
from hkrag.retrieval.metrics import Run, cut_with_ties, trec_order

if TYPE_CHECKING:
    from hkrag.data.opendocvqa import Corpus, QAExample
    from hkrag.retrieval.evaluation import Ranker

RERANKERS = ("pruner",)
"""The scorers a ``retriever=rerank`` config may name (``rerank``)."""
TAIL_CEILING = 0.5
"""The unscored pages' first-stage scores are min-max scaled into [0, TAIL_CEILING], below every scored page
(whose score is 1 + P(yes), in [1, 2])."""

PageScorer = Callable[["QAExample", Sequence[PageImage]], list[float]]
"""``scorer(question, pages)``: one score in [0, 1] per page, in order (one LVLM call each)."""


def check_depth(depth: object, pool_size: int | None = None, pool: str = "") -> int:
    """``depth`` when it is an integer in 1 .. ``pool_size`` (the pool's pages; unbounded when ``None``), else a
    :class:`ValueError` naming the value and the allowed range."""
    high = "the pool's pages" if pool_size is None else f"{pool_size}, the pages of pool {pool!r}"
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1 or (pool_size is not None
                                                                              and depth > pool_size):
        raise ValueError(f"retriever.depth={depth!r}: the rerank depth must be an integer from 1 to {high}")
    return depth


def check_settings(rerank: object, depth: object) -> None:
    """A :class:`ValueError` naming a ``rerank`` that is not one of :data:`RERANKERS` or a ``depth`` below 1 (the
    pool bounds it when a query is ranked); run before any work on a config's values."""
    if rerank not in RERANKERS:
        raise ValueError(f"retriever.rerank={rerank!r}: expected one of {list(RERANKERS)}")
    check_depth(depth)


@dataclass
class RerankRanker:
    """``first``'s top ``depth`` pages per query reordered by ``scorer`` (module docstring); ``rerank`` names the
    scorer (one of :data:`RERANKERS`), ``name`` labels the row."""

    first: Ranker
    scorer: PageScorer
    depth: int = 10
    rerank: str = "pruner"
    name: str = "rerank"
    cost: dict[str, float] = field(default_factory=lambda: {"queries": 0, "calls": 0, "seconds": 0.0})
    trace: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_settings(self.rerank, self.depth)

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str = "corpus") -> Run:
        """``{query_id: {doc_id: score}}``: each query's top ``depth`` pages of ``corpus`` after reranking."""
        check_depth(self.depth, len(corpus), corpus_key)
        first = self.first.rank(qa, corpus, max(depth, self.depth), corpus_key)
        scored = cut_with_ties(first, self.depth)
        run = {}
        for example in qa:
            docs = first.get(example.query_id, {})
            top = trec_order(scored.get(example.query_id, {}))
            start = time.perf_counter()
            values = self.scorer(example, [PageImage(corpus[doc_id].image, doc_id) for doc_id in top])
            seconds = time.perf_counter() - start
            self.check_scores(example.query_id, top, values)
            chosen = set(top)
            tail = min_max({doc_id: score for doc_id, score in docs.items() if doc_id not in chosen})
            run[example.query_id] = {**{doc_id: 1.0 + value for doc_id, value in zip(top, values)},
                                     **{doc_id: TAIL_CEILING * value for doc_id, value in tail.items()}}
            self.cost["queries"] += 1
            self.cost["calls"] += len(top)
            self.cost["seconds"] += seconds
            order = trec_order(docs)
            self.trace.append({"pool": corpus_key, "query_id": example.query_id, "seconds": seconds,
                               "pages": [{"doc_id": doc_id, "first_rank": order.index(doc_id) + 1,
                                          "first_score": docs[doc_id], "score": value}
                                         for doc_id, value in zip(top, values)]})
        return cut_with_ties(run, depth)

    def check_scores(self, query_id: str, pages: Sequence[str], values: Sequence[float]) -> None:
        """A :class:`ValueError` unless the scorer gave one probability in [0, 1] per page (NaN is not one)."""
        if len(values) != len(pages):
            raise ValueError(f"the {self.rerank} scorer returned {len(values)} scores for {len(pages)} pages of "
                             f"query {query_id!r}")
        for doc_id, value in zip(pages, values):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"the {self.rerank} scorer gave page {doc_id!r} of query {query_id!r} the score "
                                 f"{value!r}: expected a probability in [0, 1]")

    def per_query_cost(self) -> dict[str, float]:
        """The mean LVLM calls and seconds per reranked query (``0`` before any query)."""
        queries = self.cost["queries"] or 1
        return {"calls_per_query": self.cost["calls"] / queries, "seconds_per_query": self.cost["seconds"] / queries}
