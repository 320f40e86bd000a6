"""Fusing rankings (hybrid retrieval): reciprocal-rank fusion and a min-max-normalised weighted sum.

Runs are TREC-style ``{query_id: {doc_id: score}}``. A run's ranking is trec_eval's order (score descending, ties
by doc id descending: :func:`hkrag.retrieval.metrics.trec_order`), so tied pages get distinct ranks the same way
the metrics rank them; fused runs are cut in that order too. A query absent from a run counts as one that run
retrieved nothing for, and a page absent from a run's list of a query adds nothing from that run.

* **RRF** (Cormack et al., SIGIR 2009): ``score(d) = sum_r w_r / (k + rank_r(d))``, ranks from 1, ``k = 60``.
* **Normalised sum**: each run's scores of a query min-max scaled to [0, 1]
  (``(s - min) / (max - min)``; all pages get 1 when every score is equal), then
  ``score(d) = sum_r w_r * norm_r(d)``; with two runs (dense, lexical) the weights are ``w`` and ``1 - w``.

:class:`HybridRanker` (``retriever=hybrid``) fuses the dense ranker of the evaluated model with a lexical one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkrag.retrieval.metrics import Run, trec_order, truncate

if TYPE_CHECKING:
    from hkrag.data.opendocvqa import Corpus, QAExample
    from hkrag.retrieval.evaluation import Ranker

FUSIONS = ("rrf", "sum")
RRF_K = 60


def reciprocal_rank_fusion(
    runs: Sequence[Run], k: float = RRF_K, weights: Sequence[float] | None = None, depth: int | None = None
) -> dict[str, dict[str, float]]:
    """RRF of ``runs`` (optionally weighted), each query cut to ``depth`` pages (all when ``None``)."""
    if k < 0:
        raise ValueError(f"RRF k={k}: expected a number >= 0")
    weights = _weights(runs, weights)
    fused: dict[str, dict[str, float]] = {}
    for query_id in _query_ids(runs):
        scores = fused.setdefault(query_id, {})
        for run, weight in zip(runs, weights):
            for rank, doc_id in enumerate(trec_order(run.get(query_id, {})), start=1):
                scores[doc_id] = scores.get(doc_id, 0.0) + weight / (k + rank)
    return _cut(fused, depth)


def normalized_sum(
    runs: Sequence[Run], weights: Sequence[float] | None = None, depth: int | None = None
) -> dict[str, dict[str, float]]:
    """Weighted sum of per-query min-max-normalised scores, each query cut to ``depth`` pages (all when ``None``)."""
    weights = _weights(runs, weights)
    fused: dict[str, dict[str, float]] = {}
    for query_id in _query_ids(runs):
        scores = fused.setdefault(query_id, {})
        for run, weight in zip(runs, weights):
            for doc_id, value in min_max(run.get(query_id, {})).items():
                scores[doc_id] = scores.get(doc_id, 0.0) + weight * value
    return _cut(fused, depth)


def min_max(scores: Mapping[str, float]) -> dict[str, float]:
    """Scores scaled to [0, 1] by their min and max (all 1 when they are equal)."""
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    return {d: 1.0 if high == low else (float(s) - low) / (high - low) for d, s in scores.items()}


def _weights(runs: Sequence[Run], weights: Sequence[float] | None) -> list[float]:
    weights = [1.0] * len(runs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(runs):
        raise ValueError(f"{len(weights)} fusion weights for {len(runs)} runs")
    return weights


def _query_ids(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(q for run in runs for q in run))


def _cut(run: dict[str, dict[str, float]], depth: int | None) -> dict[str, dict[str, float]]:
    return truncate(run, depth) if depth is not None else {q: {d: docs[d] for d in trec_order(docs)}
                                                           for q, docs in run.items()}


@dataclass
class HybridRanker:
    """Dense + lexical retrieval fused (config ``retriever=hybrid``).

    Each ranker returns its top ``max(depth, fusion_depth)`` pages per query; ``fusion`` (``rrf`` with ``rrf_k``,
    or ``sum`` with weights ``dense_weight`` and ``1 - dense_weight``) fuses them and the evaluation's depth is kept.
    """

    dense: Ranker
    lexical: Ranker
    name: str = "hybrid"
    fusion: str = "rrf"
    rrf_k: float = RRF_K
    dense_weight: float = 0.5
    fusion_depth: int = 100

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise ValueError(f"hybrid fusion={self.fusion!r}: expected one of {list(FUSIONS)}")
        if not 0 <= self.dense_weight <= 1:
            raise ValueError(f"hybrid dense_weight={self.dense_weight}: expected a number in [0, 1]")

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str = "corpus") -> dict:
        """``{query_id: {doc_id: fused score}}``: each query's top ``depth`` pages of ``corpus``."""
        pool = max(depth, self.fusion_depth)
        runs = [self.dense.rank(qa, corpus, pool, corpus_key), self.lexical.rank(qa, corpus, pool, corpus_key)]
        if self.fusion == "rrf":
            return reciprocal_rank_fusion(runs, self.rrf_k, depth=depth)
        return normalized_sum(runs, [self.dense_weight, 1 - self.dense_weight], depth=depth)
