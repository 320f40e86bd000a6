"""Fusing rankings (hybrid retrieval): reciprocal-rank fusion and a min-max-normalised weighted sum.

Runs are TREC-style ``{query_id: {doc_id: score}}``. No doc id ever decides a fused score or which pages a fused
run keeps: pages of equal score in a run (a tie group) are treated alike, and a fused run of depth ``n`` keeps its
top ``n`` pages and every page tied with the ``n``-th (:func:`hkrag.retrieval.metrics.cut_with_ties`), so the
tie-aware metrics can score it exactly. A query absent from a run counts as one that run retrieved nothing for,
and a page absent from a run's list of a query adds nothing from that run. Sums use :func:`math.fsum`, so pages with
the same contributions get bit-identical fused scores (a tie) whatever the order of the runs.

* **RRF** (Cormack et al., SIGIR 2009): ``score(d) = sum_r w_r * E[1 / (k + rank_r(d))]``, ranks from 1,
  ``k = 60``. A page alone at its score has its rank; a page of a tie group at positions ``s+1 .. s+t`` gets the
  mean of ``1 / (k + p)`` over those positions: its expected reciprocal rank when the group's order is random
  (where ranking by doc id would give the group's pages ``1/(k+s+1)``, ``1/(k+s+2)``, ... by name).
* **Normalised sum**: each run's scores of a query min-max scaled to [0, 1]
  (``(s - min) / (max - min)``; all pages get 1 when every score is equal), then
  ``score(d) = sum_r w_r * norm_r(d)``; with two runs (dense, lexical) the weights are ``w`` and ``1 - w``. Tied
  pages get equal normalised scores; only the cut needed the tie rule above.

:class:`HybridRanker` (``retriever=hybrid``) fuses the dense ranker of the evaluated model with a lexical one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkrag.retrieval.metrics import Run, cut_with_ties, tie_groups, trec_order

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
    fused: dict[str, dict[str, list[float]]] = {}
    for query_id in _query_ids(runs):
        parts = fused.setdefault(query_id, {})
        for run, weight in zip(runs, weights):
            for doc_id, value in reciprocal_ranks(run.get(query_id, {}), k).items():
                parts.setdefault(doc_id, []).append(weight * value)
    return _cut(fused, depth)


def reciprocal_ranks(scores: Mapping[str, float], k: float = RRF_K) -> dict[str, float]:
    """Each page's ``1 / (k + rank)`` in one query's run, a tie group's pages the mean over the group's positions."""
    values, start = {}, 0
    for group in tie_groups(scores):
        value = math.fsum(1 / (k + p) for p in range(start + 1, start + len(group) + 1)) / len(group)
        values.update(dict.fromkeys(group, value))
        start += len(group)
    return values


def normalized_sum(
    runs: Sequence[Run], weights: Sequence[float] | None = None, depth: int | None = None
) -> dict[str, dict[str, float]]:
    """Weighted sum of per-query min-max-normalised scores, each query cut to ``depth`` pages (all when ``None``)."""
    weights = _weights(runs, weights)
    fused: dict[str, dict[str, list[float]]] = {}
    for query_id in _query_ids(runs):
        parts = fused.setdefault(query_id, {})
        for run, weight in zip(runs, weights):
            for doc_id, value in min_max(run.get(query_id, {})).items():
                parts.setdefault(doc_id, []).append(weight * value)
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


def _cut(parts: dict[str, dict[str, list[float]]], depth: int | None) -> dict[str, dict[str, float]]:
    """The fused run (each page's contributions summed exactly) cut to ``depth`` with its ties, in trec_eval order."""
    run = {q: {d: math.fsum(values) for d, values in docs.items()} for q, docs in parts.items()}
    if depth is not None:
        return cut_with_ties(run, depth)
    return {q: {d: docs[d] for d in trec_order(docs)} for q, docs in run.items()}


@dataclass
class HybridRanker:
    """Dense + lexical retrieval fused (config ``retriever=hybrid``).

    Each ranker returns its top ``max(depth, fusion_depth)`` pages per query (with the pages tied at the cut);
    ``fusion`` (``rrf`` with ``rrf_k``, or ``sum`` with weights ``dense_weight`` and ``1 - dense_weight``) fuses them
    and the evaluation's depth is kept, with its ties.
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
