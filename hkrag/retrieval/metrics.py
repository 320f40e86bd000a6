"""Retrieval metrics computed by trec_eval (through ``pytrec_eval``), and paper-style tables.

Definitions (binary qrels: a document is relevant iff its grade is >= 1):

* ``ndcg@k``  — trec_eval ``ndcg_cut.k``: gain = grade, discount log2(rank + 1), normalised by
  the ideal ranking of all judged documents.
* ``recall@k`` — trec_eval ``recall.k``: relevant documents in the top k / all relevant documents.
* ``mrr@k``   — trec_eval ``recip_rank`` of the run truncated to its top k: 1 / rank of the first
  relevant document within the top k, else 0.

Ranking and ties follow trec_eval: documents sorted by score descending, ties broken by doc id
descending (string comparison), whatever order the run dict has. Queries judged in ``qrels`` but
absent from the run score 0 on every metric (a failed query counts, it is never dropped); queries
in the run but not judged are excluded with a warning; queries whose qrels list no relevant
document are excluded with a warning, since no metric is defined for them.

**Tie-aware metrics** (``evaluate_run(..., ties="expected")``, reported as ``E[ndcg@5]`` etc.): the expectation of
each metric over every order of the tied documents, equally likely, computed exactly as in McSherry & Najork (ECIR
2008), so no doc id moves a figure. Documents of equal score form a group holding positions ``s+1 .. s+t``; each
of them is at each of those positions with probability ``1/t``, so the group adds its mean gain times the sum of the
discounts of its positions within the cut (nDCG), its relevant count times the share of its positions within the
cut (recall), and, for the first group holding ``r`` relevant documents, ``sum_j P(j) / (s+j)`` with
``P(j) = C(t-j, r-1) / C(t, r)`` the chance that its first relevant document is its ``j``-th (MRR). Without ties the
values equal trec_eval's. Exact only when the run holds every document tied with the last one it keeps within the
cut (:func:`cut_with_ties`; the rankers of :mod:`hkrag.retrieval` return runs that way). Float scores of dense and
late-interaction searches are first snapped at :data:`TIE_TOLERANCE` (:func:`snap_near_ties`), so that identical
pages, whose float32 scores differ in their last bits, are tied as BM25's exactly equal scores are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytrec_eval

from hkrag.io import read_json

log = logging.getLogger(__name__)

Run = Mapping[str, Mapping[str, float]]
Qrels = Mapping[str, Mapping[str, int]]

TIES = ("trec", "expected")
"""How :func:`evaluate_run` treats tied scores: trec_eval's doc-id order, or the expectation over tie orders."""


def expected_name(metric: str) -> str:
    """The report name of ``metric``'s tie-aware value: ``E[ndcg@5]`` for ``ndcg@5``."""
    return f"E[{metric}]"


def qrels_from_rows(rows: Iterable[Mapping], *, qid_key: str = "query_id", docs_key: str = "relevant_doc_ids") -> dict:
    """Binary qrels ``{query_id: {doc_id: 1}}`` from OpenDocVQA-style QA rows."""
    return {str(row[qid_key]): {str(d): 1 for d in row[docs_key]} for row in rows}


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """Read qrels from JSON ``{qid: {docid: grade}}`` or a TREC file ``qid 0 docid grade``."""
    path = Path(path)
    if path.suffix == ".json":
        return {str(q): {str(d): int(g) for d, g in docs.items()} for q, docs in read_json(path).items()}
    qrels: dict[str, dict[str, int]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 4:
            raise ValueError(f"{path}:{number}: expected 'qid iter docid grade', got {line!r}")
        qrels.setdefault(parts[0], {})[parts[2]] = int(parts[3])
    return qrels


def check_qrels(qrels: Qrels, corpus_ids: Iterable[str]) -> list[tuple[str, str]]:
    """Judged (query, doc) pairs whose document is not in the corpus; logs how many."""
    corpus = set(corpus_ids)
    missing = [(q, d) for q, docs in qrels.items() for d in docs if d not in corpus]
    if missing:
        log.warning(
            "%d judged document(s) of %d queries are absent from the corpus (e.g. %s); they can never be retrieved",
            len(missing),
            len({q for q, _ in missing}),
            missing[0],
        )
    return missing


def chance_ndcg(pool_size: int, k: int = 5) -> float:
    """Expected nDCG@k of a random ranking of ``pool_size`` pages holding one relevant page (binary grade)."""
    return sum(1 / math.log2(rank + 1) for rank in range(1, min(k, pool_size) + 1)) / pool_size


def trec_order(docs: Mapping[str, float], query: str | None = None) -> list[str]:
    """Doc ids in trec_eval's ranking order: score descending, then doc id descending. A NaN or infinite score is
    refused (``ValueError`` naming ``query`` and the page): NaN compares false with everything, so a ranking holding
    one, and every cut of it, would depend on where it happens to stand."""
    bad = None if _finite_sum(docs.values()) else next(
        (d for d, score in docs.items() if not math.isfinite(float(score))), None)
    if bad is not None:
        where = f"query {query!r}: " if query is not None else ""
        raise ValueError(f"{where}page {bad!r} scored {float(docs[bad])}, which cannot be ranked (NaN or infinite "
                         "score: a non-finite embedding or model output upstream)")
    return sorted(docs, key=lambda d: (float(docs[d]), d), reverse=True)


def _finite_sum(scores: Iterable[float]) -> bool:
    """Whether the scores' sum is finite: true of every list of finite scores but for an overflow, so one C-level
    pass clears a ranking (a tenth of the time of checking each score; the caller checks each when it is false)."""
    try:
        return math.isfinite(sum(scores))
    except TypeError:
        return False


def truncate(run: Run, k: int) -> dict[str, dict[str, float]]:
    """The run cut to each query's top k in trec_eval order."""
    return {q: {d: float(docs[d]) for d in trec_order(docs, q)[:k]} for q, docs in run.items()}


def cut_with_ties(run: Run, k: int) -> dict[str, dict[str, float]]:
    """Each query's top ``k`` documents and every document tied with the ``k``-th score (so which documents are
    kept never depends on doc ids), in trec_eval order."""
    cut = {}
    for q, docs in run.items():
        order = trec_order(docs, q)
        floor = float(docs[order[k - 1]]) if len(order) > k else -math.inf
        cut[q] = {d: float(docs[d]) for d in order if float(docs[d]) >= floor}
    return cut


TIE_TOLERANCE = 1e-5
"""Float scores this close (relative to ``max(1, |score|)``) count as tied (:func:`snap_near_ties`): identical pages
scored by float32 dot products differ in their last bits with their place in the matrix product (FAISS flat at
width 3072: up to 2.4e-7, tests/test_ties.py), as does a page encoded in two batches."""


def snap_near_ties(docs: Mapping[str, float], tolerance: float = TIE_TOLERANCE) -> dict[str, float]:
    """``docs`` with each score within ``tolerance * max(1, |head|)`` below a group's head (its best score, walking
    down from the best) replaced by the head's, so that identical pages computed in float arithmetic score alike and
    :func:`tie_groups` and :func:`cut_with_ties` see their tie. Groups are anchored at their head (no chaining); in
    trec_eval order."""
    snapped: dict[str, float] = {}
    head: float | None = None
    for d in sorted(docs, key=lambda d: float(docs[d]), reverse=True):
        score = float(docs[d])
        if head is None or head - score > tolerance * max(1.0, abs(head)):
            head = score
        snapped[d] = head
    return {d: snapped[d] for d in trec_order(snapped)}


def tie_groups(docs: Mapping[str, float]) -> list[list[str]]:
    """Doc ids grouped by equal score, best score first (each group in trec_eval order)."""
    groups: list[list[str]] = []
    last = None
    for d in trec_order(docs):
        if groups and float(docs[d]) == last:
            groups[-1].append(d)
        else:
            groups.append([d])
        last = float(docs[d])
    return groups


def expected_query_metrics(
    docs: Mapping[str, float], rels: Mapping[str, int], ks: Sequence[int], ndcg_ks: Sequence[int], mrr_k: int
) -> dict[str, float]:
    """One query's tie-aware nDCG@k, recall@k and MRR@k (module docstring): ``docs`` its run, ``rels`` its grades."""
    gains = {d: g for d, g in rels.items() if g > 0}
    ideal = sorted(gains.values(), reverse=True)
    dcg = dict.fromkeys(ndcg_ks, 0.0)
    found = dict.fromkeys(ks, 0.0)
    rr: float | None = None
    start = 0
    for group in tie_groups(docs):
        size, relevant = len(group), [gains[d] for d in group if d in gains]
        for k in ndcg_ks:
            positions = range(start + 1, min(start + size, k) + 1)
            dcg[k] += sum(relevant) / size * sum(1 / math.log2(p + 1) for p in positions)
        for k in ks:
            found[k] += len(relevant) * max(0, min(start + size, k) - start) / size
        if relevant and rr is None:  # the first group with a relevant document sets RR (0 past the cut)
            r = len(relevant)
            rr = sum(math.comb(size - j, r - 1) / math.comb(size, r) / (start + j)
                     for j in range(1, min(size - r + 1, mrr_k - start) + 1))
        start += size
    values = {f"ndcg@{k}": dcg[k] / sum(g / math.log2(i + 2) for i, g in enumerate(ideal[:k])) for k in ndcg_ks}
    values.update({f"recall@{k}": found[k] / len(gains) for k in ks})
    values[f"mrr@{mrr_k}"] = rr or 0.0
    return values


def _names(ks: Sequence[int], ndcg_ks: Sequence[int], mrr_k: int) -> dict[str, str]:
    """Our metric name -> pytrec_eval result key."""
    names = {f"ndcg@{k}": f"ndcg_cut_{k}" for k in ndcg_ks}
    names.update({f"recall@{k}": f"recall_{k}" for k in ks})
    names[f"mrr@{mrr_k}"] = "recip_rank"
    return names


def evaluate_run(
    run: Run,
    qrels: Qrels,
    ks: Sequence[int] = (1, 5, 10),
    *,
    ndcg_ks: Sequence[int] = (5,),
    mrr_k: int = 10,
    ties: str = "trec",
) -> dict:
    """nDCG@k, recall@k and MRR@k per query and averaged over the judged queries.

    ``ties="trec"``: trec_eval's values (ties by doc id descending); ``ties="expected"``: their expectation over the
    orders of tied documents (module docstring), under the same names. Returns ``{"mean": {metric: value},
    "per_query": {qid: {metric: value}}, "num_queries": n, "unjudged": [qids in run not in qrels], "no_run": [judged
    qids the run lacks]}``.
    """
    if ties not in TIES:
        raise ValueError(f"ties={ties!r}: expected one of {list(TIES)}")
    judged = {q: {d: int(g) for d, g in docs.items()} for q, docs in qrels.items() if any(g > 0 for g in docs.values())}
    if len(judged) < len(qrels):
        log.warning("%d queries have no relevant document in qrels; excluded", len(qrels) - len(judged))
    if not judged:
        raise ValueError("qrels hold no query with a relevant document")
    unjudged = sorted(set(run) - set(judged))
    if unjudged:
        log.warning("%d run queries are not in qrels and are excluded (e.g. %s)", len(unjudged), unjudged[0])
    no_run = sorted(q for q in judged if not run.get(q))
    if no_run:
        log.warning("%d judged queries have no retrieved documents; they score 0 (e.g. %s)", len(no_run), no_run[0])

    names = _names(ks, ndcg_ks, mrr_k)
    measures = {f"ndcg_cut.{k}" for k in ndcg_ks} | {f"recall.{k}" for k in ks}
    scored = {q: {d: float(s) for d, s in docs.items()} for q, docs in run.items() if q in judged and docs}
    if ties == "expected":
        per_query = {q: expected_query_metrics(scored.get(q, {}), judged[q], ks, ndcg_ks, mrr_k)
                     for q in sorted(judged)}
    else:
        full = pytrec_eval.RelevanceEvaluator(judged, measures).evaluate(scored)
        mrr = pytrec_eval.RelevanceEvaluator(judged, {"recip_rank"}).evaluate(truncate(scored, mrr_k))
        per_query = {
            q: {name: float({**full.get(q, {}), **mrr.get(q, {})}.get(key, 0.0)) for name, key in names.items()}
            for q in sorted(judged)
        }
    mean = {name: sum(v[name] for v in per_query.values()) / len(per_query) for name in names}
    return {"mean": mean, "per_query": per_query, "num_queries": len(per_query), "unjudged": unjudged, "no_run": no_run}


def format_table(
    results: Mapping[str, Mapping[str, Mapping[str, float]]],
    *,
    datasets: Sequence[str] | None = None,
    pools: Sequence[str] = ("single", "all"),
    scale: float = 100.0,
    digits: int = 1,
) -> str:
    """Markdown table like the paper's Table 2: one row per method, columns dataset × pool + average.

    ``results[method][dataset][pool]`` is a metric value in [0, 1] (shown × ``scale``). A missing
    cell shows "–", and the average of a pool is shown only when every dataset has a value (:func:`table_rows`).
    """
    header, rows = table_rows(results, datasets=datasets, pools=pools, scale=scale)
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for method, *values in rows:
        lines.append(f"| {method} | " + " | ".join("–" if v is None else f"{v:.{digits}f}" for v in values) + " |")
    return "\n".join(lines)


def table_rows(
    results: Mapping[str, Mapping[str, Mapping[str, float]]],
    *,
    datasets: Sequence[str] | None = None,
    pools: Sequence[str] = ("single", "all"),
    scale: float = 100.0,
) -> tuple[list[str], list[list[Any]]]:
    """:func:`format_table`'s header and rows, unrounded: the method, then each dataset × pool value and each
    pool's average × ``scale`` (``None`` where missing); what the Markdown and the W&B table are built from."""
    datasets = list(datasets or dict.fromkeys(d for by_ds in results.values() for d in by_ds))
    columns = [(d, p) for d in [*datasets, "Avg."] for p in pools]
    rows = []
    for method, by_dataset in results.items():
        cells = {(d, p): by_dataset.get(d, {}).get(p) for d in datasets for p in pools}
        for p in pools:
            values = [cells[d, p] for d in datasets]
            cells["Avg.", p] = None if None in values else sum(values) / len(values)
        rows.append([method, *(None if cells[c] is None else scale * cells[c] for c in columns)])
    return ["Method", *(f"{d} {p.capitalize()}" for d, p in columns)], rows
