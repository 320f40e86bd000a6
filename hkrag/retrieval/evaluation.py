"""Retrieval evaluation (paper Table 2, docs/index.md): rank, score, report.

:func:`evaluate_ranker` scores any :class:`Ranker` (a run per data set and pool) the same way: the visual
retriever (:class:`DenseRanker`, encode + FAISS), BM25 over page text (:mod:`hkrag.retrieval.bm25`) and their
fusion (:mod:`hkrag.retrieval.fusion`); docs/evaluation.md, "Baselines". For the visual retriever,
one code path serves ``train.py`` (before/after report) and ``eval.py``, so both print the same
number for the same checkpoint and data. Corpora are embedded through resumable shards
(:func:`hkrag.index.shards.encode_corpus`, data-parallel across ranks); a page shared by several
pools (a data set's own corpus and ``all``) is encoded once, when its stored image is byte-identical
in both (a ``doc_id`` holding another image in another pool is embedded from its own pool, with a
warning). The shard identity includes a fingerprint of the retriever's weights, so embeddings of
another model (another seed, checkpoint or adapter) are never reused. Every (data set, pool) pair is
searched with FAISS and scored with trec_eval's definitions; queries carrying an ``evidence`` label are also
scored per label (``salient`` / ``fine_print`` in the built-in corpus). Each query's nDCG@5 and label go to
``<work_dir>/per_query.json`` (what ``hkrag.retrieval.ablation``'s paired bootstrap reads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hkrag.data.images import ImageError
from hkrag.data.opendocvqa import Corpus, QAExample, load_corpus, load_qa, pools, qrels
from hkrag.data.region_corpus import corpus_pages
from hkrag.distributed import is_main, rank, world_size
from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.maxsim import MaxSimIndex, multivector_spec
from hkrag.index.shards import config_hash, encode_corpus, load_multi_vector_shards, load_shards
from hkrag.io import atomic_directory, write_json
from hkrag.retrieval.metrics import (
    Run,
    check_qrels,
    cut_with_ties,
    evaluate_run,
    expected_name,
    format_table,
    snap_near_ties,
    table_rows,
)
from hkrag.retriever import Phi3VRetriever, weights_fingerprint

logger = logging.getLogger(__name__)

REPORTED_METRICS = ("ndcg@5", "recall@1", "recall@5", "recall@10", "mrr@10")
EXPECTED_METRICS = tuple(expected_name(metric) for metric in REPORTED_METRICS)
"""The same metrics' expectations over the orders of tied pages (``E[ndcg@5]``, ...: :mod:`hkrag.retrieval.metrics`),
scored beside trec_eval's values, which break ties by doc id."""
TABLE_METRICS = (EXPECTED_METRICS[0], *REPORTED_METRICS)
"""The tables of ``retrieval.md``: the tie-aware nDCG@5, then trec_eval's metrics (every value is in the JSON)."""
PER_QUERY_FILE = "per_query.json"
QUERIES_DIR = "queries"
TABLE_FILE = "retrieval.md"
"""The retrieval table a task writes into its output directory."""
BEFORE_TRAINING_DIR, AFTER_TRAINING_DIR = "eval-before", "eval-after"
CURVE_DIR = "eval-step-{step}"
"""A learning-curve point's folder in a training run (``trainer.eval_every``)."""
"""A training run's evaluation work dirs, before and after training (what the ablation reads)."""
QRELS_FILE = "qrels.json"
"""``{dataset: {pool: {query_id: {"evidence": label or null, "ndcg@5": value}}}}`` in an evaluation's work dir."""


@dataclass
class RetrievalEvalConfig:
    """What to evaluate (config group ``eval``)."""

    qa_source: str
    corpus_source: str
    datasets: Sequence[str]
    split: str = "test"
    pools: Sequence[str] = ("single", "all")
    index: str = "flat"
    top_k: int = 10
    query_batch_size: int = 32
    doc_batch_size: int = 8
    shard_size: int = 1024
    dtype: str = "float32"
    use_gpu: bool | None = None


def late_interaction(retriever: Phi3VRetriever) -> bool:
    """Whether ``retriever`` embeds one vector per token (a stand-in without the attribute embeds one per page)."""
    return bool(getattr(retriever, "late_interaction", False))


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def embed_corpus(
    retriever: Phi3VRetriever, corpus: Corpus, out_dir: Path, cfg: RetrievalEvalConfig, identity: dict[str, Any]
) -> tuple[list[str], np.ndarray | list[np.ndarray]]:
    """Embed a corpus into ``out_dir`` shards (every rank its share) and read them back: ``(n, dim)`` vectors, or
    under the late-interaction head one ``(tokens, dim)`` array per page (multi-vector shards).

    A page the model's processor refuses (e.g. a 500x2 strip's aspect ratio) raises :class:`ImageError`
    naming its ``doc_id``.
    """
    encode_shards(retriever, corpus, out_dir, cfg, identity, rank(), world_size())
    barrier()
    if not late_interaction(retriever):
        return load_shards(out_dir)
    ids, vectors, offsets = load_multi_vector_shards(out_dir)
    return ids, np.split(vectors, offsets[1:-1])


def encode_shards(
    retriever: Phi3VRetriever, corpus: Corpus, out_dir: Path, cfg: RetrievalEvalConfig, identity: dict[str, Any],
    part: int = 0, parts: int = 1,
) -> Path:
    """Embed shards ``s ≡ part (mod parts)`` of ``corpus`` into ``out_dir``: one rank's or one Slurm array task's share
    (``hkrag.tasks.encode``). ``identity`` comes from :func:`shard_identity`."""

    def embed(rows) -> torch.Tensor:
        try:
            return retriever.encode_documents([row.image for row in rows], batch_size=cfg.doc_batch_size)
        except ImageError:
            raise
        except ValueError as error:
            raise _page_error(retriever, rows, error) from error

    manifest = {**identity, "corpus": corpus.name}
    return encode_corpus(
        corpus, embed, out_dir, shard_size=cfg.shard_size, manifest=manifest, dtype=cfg.dtype,
        batch_size=cfg.doc_batch_size, rank=part, world_size=parts, progress=is_main(),
        multi_vector=late_interaction(retriever),
    )


def _page_error(retriever: Phi3VRetriever, rows: Sequence[Any], error: ValueError) -> ValueError:
    """The batch error, tied to the first page the processor refuses on its own (else left as is)."""
    for row in rows:
        try:
            retriever.document_inputs([row.image])
        except ValueError as page_error:
            return ImageError(row.doc_id, f"cannot be encoded: {page_error}")
    return error


@dataclass
class EmbeddingCache:
    """Page embeddings shared by the pools of one evaluation: ``doc_id -> (image fingerprint, vector)``."""

    vectors: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    prints: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    def fingerprints(self, corpus: Corpus) -> list[str]:
        """``corpus.fingerprints()``, read once per corpus (the ``all`` pool is met once per data set)."""
        key = (corpus.name, hash(tuple(corpus.doc_ids)))
        if key not in self.prints:
            self.prints[key] = corpus.fingerprints()
        return self.prints[key]


def pool_embeddings(
    retriever: Phi3VRetriever,
    corpus: Corpus,
    out_dir: Path,
    cfg: RetrievalEvalConfig,
    identity: dict[str, Any],
    cache: EmbeddingCache,
) -> np.ndarray | list[np.ndarray]:
    """Embeddings of ``corpus`` in row order (a list of per-page token arrays under late interaction), reusing
    ``cache`` where the stored image is the same.

    The cache serves a pool only if every page is in it with the same image bytes; otherwise the pool
    is embedded into ``out_dir`` and its pages join the cache (first pool seen wins on conflicts).
    """
    prints = cache.fingerprints(corpus)
    known = [cache.vectors.get(doc_id) for doc_id in corpus.doc_ids]
    if all(k is not None and k[0] == p for k, p in zip(known, prints)):
        return _rows([k[1] for k in known], retriever)
    conflicts = [d for d, k, p in zip(corpus.doc_ids, known, prints) if k is not None and k[0] != p]
    if conflicts:
        logger.warning("%s: %d doc_id(s) hold other images than in a pool evaluated before (e.g. %s); "
                       "this pool is embedded on its own", corpus.name, len(conflicts), conflicts[:5])
    ids, vectors = embed_corpus(retriever, corpus, out_dir, cfg, identity)
    by_id = dict(zip(ids, vectors))
    for doc_id, fingerprint in zip(corpus.doc_ids, prints):
        cache.vectors.setdefault(doc_id, (fingerprint, by_id[doc_id]))
    return _rows([by_id[doc_id] for doc_id in corpus.doc_ids], retriever)


def _rows(vectors: list[np.ndarray], retriever: Phi3VRetriever) -> np.ndarray | list[np.ndarray]:
    """Per-page vectors as one ``(n, dim)`` matrix (dense) or the list of token arrays (late interaction)."""
    return vectors if late_interaction(retriever) else np.stack(vectors)


def score(run: dict, qa: Sequence[QAExample]) -> dict[str, Any]:
    """Mean metrics overall and per evidence label: trec_eval's (``ndcg@5``, ...) and the tie-aware ones
    (``E[ndcg@5]``, ...)."""
    result = {"all": both_means(run, qa), "num_queries": len(qa)}
    for label in sorted({ex.evidence for ex in qa if ex.evidence}):
        subset = [ex for ex in qa if ex.evidence == label]
        result[label] = both_means({ex.query_id: run.get(ex.query_id, {}) for ex in subset}, subset)
    return result


def both_means(run: dict, qa: Sequence[QAExample]) -> dict[str, float]:
    """trec_eval's mean metrics of ``run`` over ``qa`` and, under ``E[...]`` names, their tie-aware expectations."""
    expected = evaluate_run(run, qrels(qa), ties="expected")["mean"]
    return {**evaluate_run(run, qrels(qa))["mean"], **{expected_name(m): v for m, v in expected.items()}}


def per_query_scores(run: dict, qa: Sequence[QAExample], metric: str = "ndcg@5") -> dict[str, dict[str, Any]]:
    """``metric`` and the evidence label of every query of ``qa`` (a query the run lacks scores 0)."""
    scores = evaluate_run(run, qrels(qa))["per_query"]
    return {ex.query_id: {"evidence": ex.evidence, metric: scores.get(ex.query_id, {}).get(metric, 0.0)} for ex in qa}


def shard_identity(retriever: Phi3VRetriever, identity: dict[str, Any]) -> dict[str, Any]:
    """The shard-manifest identity of ``retriever``'s embeddings: ``identity`` (model, adapter) plus a weights
    fingerprint, so that embeddings of another checkpoint are never reused."""
    given = {**identity, "weights": weights_fingerprint(retriever)}
    return {"model": given.get("model", "unknown"), "adapter": given.get("adapter"),
            "weights": given["weights"], "config_hash": config_hash(given)}


class Ranker(Protocol):
    """What :func:`evaluate_ranker` evaluates: pages of a corpus ranked for a set of queries.

    ``rank(qa, corpus, depth, corpus_key)`` returns the run ``{query_id: {doc_id: score}}`` of each query's top
    ``depth`` pages (fewer when it finds fewer); ``corpus_key`` names the corpus (its config, e.g. ``all``) for
    rankers that keep work on disk (the dense one's embedding shards). ``name`` labels the ranker in reports.
    Implementations: :class:`DenseRanker`, :class:`hkrag.retrieval.bm25.BM25Ranker`,
    :class:`hkrag.retrieval.bm25_vidore.VidoreBM25Ranker`,
    :class:`hkrag.retrieval.fusion.HybridRanker`. Under ``accelerate launch`` every rank calls ``rank`` and only
    rank 0's run is scored.

    Optional: ``evaluated_queries(qa) -> qa``, the queries a ranker's reference evaluates (ViDoRe's BM25 drops
    repeated query texts), and ``report_extras(run, qa, corpus) -> {name: value}``, entries added to the report's
    ``all`` block (the BM25 rankers' counts of tokenless pages and queries, ViDoRe's corpus-order MRR).
    """

    name: str

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str) -> Run: ...


class DenseRanker:
    """The visual retriever searched with FAISS (``cfg.index``), or under the late-interaction head by exact MaxSim
    (:class:`~hkrag.index.maxsim.MaxSimIndex`, multi-vector shards): page embeddings in resumable shards under
    ``<work_dir>/embeddings-<corpus_key>`` (shared across pools, :class:`EmbeddingCache`), query embeddings once
    per query set. Every rank embeds its share; rank 0 searches (other ranks return ``{}``) and writes the
    queries' embeddings and qrels for the storage-budget study (:func:`save_queries`).

    ``identity`` (model, adapter, ...) and a fingerprint of the retriever's weights go into the shard
    manifests, so embeddings of another checkpoint are never reused.
    """

    name = "dense"

    def __init__(self, retriever: Phi3VRetriever, cfg: RetrievalEvalConfig, work_dir: str | Path,
                 identity: dict[str, Any]):
        self.retriever, self.cfg, self.work_dir = retriever, cfg, Path(work_dir)
        if late_interaction(retriever):
            self.name = "late_interaction"
            multivector_spec(cfg.index)  # a bad eval.index fails before any page is encoded
        self.identity = shard_identity(retriever, identity)
        self.embeddings = EmbeddingCache()
        self.queries: dict[tuple[str, ...], torch.Tensor] = {}
        self.queried: list[tuple[QAExample, np.ndarray]] = []

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str) -> Run:
        with evaluating(self.retriever):
            queries = self.encode_queries(qa)
            vectors = pool_embeddings(self.retriever, corpus, self.work_dir / f"embeddings-{corpus_key}", self.cfg,
                                      self.identity, self.embeddings)
        if not is_main():
            return {}
        query_ids = [ex.query_id for ex in qa]
        if late_interaction(self.retriever):
            index = MaxSimIndex.from_pages(corpus.doc_ids, vectors, spec=multivector_spec(self.cfg.index))
            return search_with_ties(index, query_ids, [q.float().numpy() for q in queries], depth)
        index = DocumentIndex.build(corpus.doc_ids, vectors, self.cfg.index, use_gpu=self.cfg.use_gpu)
        return search_with_ties(index, query_ids, queries.numpy(), depth)

    def encode_queries(self, qa: Sequence[QAExample]) -> torch.Tensor | list[torch.Tensor]:
        """The embeddings of ``qa`` (encoded once per query set; a new set is saved with the others)."""
        key = tuple(ex.query_id for ex in qa)
        if key not in self.queries:
            self.queries[key] = self.retriever.encode_queries(
                [ex.query for ex in qa], batch_size=self.cfg.query_batch_size, ids=list(key))
            self.queried += zip(qa, [q.float().numpy() for q in self.queries[key]])
            if is_main():
                save_queries(self.queried, self.work_dir, self.identity)
        return self.queries[key]


def search_with_ties(index: DocumentIndex | MaxSimIndex, query_ids: Sequence[str], queries: np.ndarray | list,
                     depth: int) -> Run:
    """``index``'s run at ``depth`` holding, for each query, every page tied with its ``depth``-th score
    (:func:`~hkrag.retrieval.metrics.cut_with_ties`; FAISS alone cuts a tie group by its internal order), scores
    within :data:`~hkrag.retrieval.metrics.TIE_TOLERANCE` of a better one counting as tied
    (:func:`~hkrag.retrieval.metrics.snap_near_ties`: identical pages' float32 scores differ in their last bits):
    searched deeper, doubling, until each query's list ends below its cut or holds every page the index returns."""
    k = depth
    while True:
        k = min(2 * k, len(index))
        run = {q: snap_near_ties(docs) for q, docs in index.to_run(query_ids, queries, k).items()}
        cut = cut_with_ties(run, depth)
        if k == len(index) or all(len(cut[q]) < len(run[q]) or len(run[q]) < k for q in run):
            return cut


@contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode, its training flag restored afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def evaluate_retrieval(
    retriever: Phi3VRetriever,
    cfg: RetrievalEvalConfig,
    work_dir: str | Path,
    identity: dict[str, Any],
    load_qa_fn: Callable[..., list[QAExample]] = load_qa,
    load_corpus_fn: Callable[..., Corpus] = load_corpus,
) -> dict[str, Any]:
    """Evaluate the visual retriever (a :class:`DenseRanker`) with :func:`evaluate_ranker`."""
    return evaluate_ranker(DenseRanker(retriever, cfg, work_dir, identity), cfg, work_dir, load_qa_fn, load_corpus_fn)


def evaluate_ranker(
    ranker: Ranker,
    cfg: RetrievalEvalConfig,
    work_dir: str | Path,
    load_qa_fn: Callable[..., list[QAExample]] = load_qa,
    load_corpus_fn: Callable[..., Corpus] = load_corpus,
) -> dict[str, Any]:
    """Evaluate every data set of ``cfg`` in every pool; returns metrics, a Table-2 Markdown and the runs.

    ``runs[dataset][pool][query_id]`` maps the top-k doc ids to scores (what the RAG task reads). Each query's
    nDCG@5 goes to ``<work_dir>/per_query.json``. Only rank 0 scores; other ranks return ``{}``.
    A data set's pools are ranked largest corpus first (reported in ``cfg.pools``' order): the union pool's page
    embeddings (``embeddings-all``, also what ``python -m hkrag.tasks.encode`` writes) then serve the smaller
    pools through :class:`EmbeddingCache` instead of encoding their pages again.
    """
    work_dir = Path(work_dir)
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Run]] = {}
    per_query: dict[str, dict[str, dict[str, Any]]] = {}
    for dataset in cfg.datasets:
        qa = load_qa_fn(cfg.qa_source, dataset, cfg.split)
        qa = ranker.evaluated_queries(qa) if hasattr(ranker, "evaluated_queries") else qa
        configs = {pool: pools(dataset)[pool] for pool in cfg.pools}
        corpora = {pool: load_corpus_fn(cfg.corpus_source, config, cfg.split) for pool, config in configs.items()}
        for pool in sorted(cfg.pools, key=lambda p: -len(corpora[p])):
            corpus = corpora[pool]
            run = ranker.rank(qa, corpus, cfg.top_k, configs[pool])
            if not is_main():
                continue
            check_qrels(qrels(qa), corpus_pages(corpus))  # counted warning: such documents score as misses
            runs.setdefault(dataset, {})[pool] = run
            results.setdefault(dataset, {})[pool] = score(run, qa)
            if hasattr(ranker, "report_extras"):
                results[dataset][pool]["all"].update(ranker.report_extras(run, qa, corpus))
            per_query.setdefault(dataset, {})[pool] = per_query_scores(run, qa)
            logger.info("%s/%s nDCG@5 %.4f", dataset, pool, results[dataset][pool]["all"]["ndcg@5"])
        if is_main():
            for by_dataset in (runs, results, per_query):
                by_dataset[dataset] = {pool: by_dataset[dataset][pool] for pool in cfg.pools}
    if not is_main():
        return {}
    write_json(work_dir / PER_QUERY_FILE, per_query)
    tables = "\n\n".join(retrieval_table(results, metric) for metric in TABLE_METRICS)
    return {"results": results, "table": tables, "runs": runs, "per_query": per_query}


def save_queries(queries: Sequence[tuple[QAExample, np.ndarray]], work_dir: Path, identity: dict[str, Any]) -> None:
    """Every evaluated query's embedding (``queries/`` shards) and relevant pages (``qrels.json``), so the
    storage-budget study (``python -m hkrag.retrieval.budget``) can run on this evaluation's real embeddings."""
    if not queries:
        return
    rows = [{"query_id": ex.query_id, "vector": vector} for ex, vector in queries]
    multi = rows[0]["vector"].ndim == 2  # late interaction: each query's token vectors, as multi-vector shards

    def vectors(batch: list[dict[str, Any]]) -> np.ndarray | list[np.ndarray]:
        return [row["vector"] for row in batch] if multi else np.stack([row["vector"] for row in batch])

    with atomic_directory(work_dir / QUERIES_DIR) as out:  # replaced whole: the evaluated queries may change
        encode_corpus(rows, vectors, out, shard_size=len(rows), manifest=identity, dtype="float32",
                      id_key="query_id", progress=False, multi_vector=multi)
    write_json(work_dir / QRELS_FILE, qrels([ex for ex, _ in queries]))


def retrieval_table(results: dict[str, dict[str, Any]], metric: str = "ndcg@5") -> str:
    """Markdown Table 2 (overall) plus one row per evidence label when the data carry labels."""
    grid, pools_seen = retrieval_grid(results, metric)
    return f"{metric} (x100)\n\n" + format_table(grid, pools=pools_seen)


def retrieval_rows(results: dict[str, dict[str, Any]], metric: str = "ndcg@5") -> tuple[list[str], list[list[Any]]]:
    """:func:`retrieval_table`'s header and rows (x100, unrounded): its W&B table."""
    grid, pools_seen = retrieval_grid(results, metric)
    return table_rows(grid, pools=pools_seen)


def retrieval_grid(results: dict[str, dict[str, Any]], metric: str) -> tuple[dict[str, Any], list[str]]:
    """Table 2's rows (all queries, then each evidence label) as :func:`format_table` input, and the pools."""
    keys = {k for by_pool in results.values() for r in by_pool.values() for k in r} - {"all", "num_queries"}
    labels = ["all", *sorted(keys)]
    rows = {"all queries" if label == "all" else label: metric_grid(results, label, metric) for label in labels}
    return rows, list(dict.fromkeys(p for by_pool in results.values() for p in by_pool))


def per_query_rows(per_query: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> tuple[list[str], list[list[Any]]]:
    """``per_query.json`` as a table: data set, pool, query id, then each query's recorded values (label, scores)."""
    entries = [(ds, pool, qid, entry) for ds, by_pool in per_query.items() for pool, by_query in by_pool.items()
               for qid, entry in by_query.items()]
    keys = list(dict.fromkeys(key for *_, entry in entries for key in entry))
    return ["dataset", "pool", "query_id", *keys], [[ds, pool, qid, *(entry.get(k) for k in keys)]
                                                    for ds, pool, qid, entry in entries]


def metric_grid(results: dict[str, dict[str, Any]], label: str, metric: str) -> dict[str, dict[str, float]]:
    """``{dataset: {pool: metric}}`` over the queries labelled ``label`` (``all``: every query)."""
    return {ds: {p: r[label][metric] for p, r in by_pool.items() if label in r} for ds, by_pool in results.items()}
