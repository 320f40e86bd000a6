"""Retrieval evaluation (paper Table 2, DESIGN §6): encode, index, search, score.

One code path serves ``train.py`` (before/after report) and ``eval.py``, so both print the same
number for the same checkpoint and data. Corpora are embedded through resumable shards
(:func:`hkrag.index.shards.encode_corpus`, data-parallel across ranks); a page shared by several
pools (a data set's own corpus and ``all``) is encoded once. Every (data set, pool) pair is searched
with FAISS and scored with trec_eval's definitions; queries carrying an ``evidence`` label are also
scored per label (``salient`` / ``fine_print`` in the built-in corpus).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hkrag.data.opendocvqa import Corpus, QAExample, load_corpus, load_qa, pools, qrels
from hkrag.distributed import is_main, rank, world_size
from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import config_hash, encode_corpus, load_shards
from hkrag.metrics import check_qrels, evaluate_run, format_table
from hkrag.retriever import Phi3VRetriever

logger = logging.getLogger(__name__)

REPORTED_METRICS = ("ndcg@5", "recall@1", "recall@5", "recall@10", "mrr@10")


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


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def embed_corpus(
    retriever: Phi3VRetriever, corpus: Corpus, out_dir: Path, cfg: RetrievalEvalConfig, identity: dict[str, Any]
) -> tuple[list[str], np.ndarray]:
    """Embed a corpus into ``out_dir`` shards (every rank its share) and read them back."""

    def embed(rows) -> torch.Tensor:
        return retriever.encode_documents([row.image for row in rows], batch_size=cfg.doc_batch_size)

    manifest = {**identity, "corpus": corpus.name}
    encode_corpus(
        corpus, embed, out_dir, shard_size=cfg.shard_size, manifest=manifest, dtype=cfg.dtype,
        batch_size=cfg.doc_batch_size, rank=rank(), world_size=world_size(), progress=is_main(),
    )
    barrier()
    return load_shards(out_dir)


def score(run: dict, qa: Sequence[QAExample]) -> dict[str, Any]:
    """Mean metrics overall and per evidence label."""
    result = {"all": evaluate_run(run, qrels(qa))["mean"], "num_queries": len(qa)}
    for label in sorted({ex.evidence for ex in qa if ex.evidence}):
        subset = [ex for ex in qa if ex.evidence == label]
        result[label] = evaluate_run({ex.query_id: run.get(ex.query_id, {}) for ex in subset}, qrels(subset))["mean"]
    return result


def evaluate_retrieval(
    retriever: Phi3VRetriever,
    cfg: RetrievalEvalConfig,
    work_dir: str | Path,
    identity: dict[str, Any],
    load_qa_fn: Callable[..., list[QAExample]] = load_qa,
    load_corpus_fn: Callable[..., Corpus] = load_corpus,
) -> dict[str, Any]:
    """Evaluate every data set of ``cfg`` in every pool; returns metrics and a Table-2 Markdown.

    ``identity`` (model, adapter, ...) goes into the shard manifests so embeddings of another
    checkpoint are never reused. Only rank 0 searches and scores; other ranks return ``{}``.
    """
    was_training = retriever.training
    retriever.eval()
    work_dir = Path(work_dir)
    identity = {"model": identity.get("model", "unknown"), "adapter": identity.get("adapter"),
                "config_hash": config_hash(identity)}
    embeddings: dict[str, np.ndarray] = {}
    results: dict[str, dict[str, Any]] = {}
    for dataset in cfg.datasets:
        qa = load_qa_fn(cfg.qa_source, dataset, cfg.split)
        queries = retriever.encode_queries([ex.query for ex in qa], batch_size=cfg.query_batch_size)
        for pool in cfg.pools:
            config = pools(dataset)[pool]
            corpus = load_corpus_fn(cfg.corpus_source, config, cfg.split)
            if not all(doc_id in embeddings for doc_id in corpus.doc_ids):
                ids, vectors = embed_corpus(retriever, corpus, work_dir / f"embeddings-{config}", cfg, identity)
                embeddings.update(zip(ids, vectors))
            if not is_main():
                continue
            index = DocumentIndex.build(
                corpus.doc_ids, np.stack([embeddings[d] for d in corpus.doc_ids]), cfg.index, use_gpu=cfg.use_gpu
            )
            check_qrels(qrels(qa), corpus.doc_ids)  # counted warning: such documents score as misses
            run = index.to_run([ex.query_id for ex in qa], queries.numpy(), cfg.top_k)
            results.setdefault(dataset, {})[pool] = score(run, qa)
            logger.info("%s/%s nDCG@5 %.4f", dataset, pool, results[dataset][pool]["all"]["ndcg@5"])
    retriever.train(was_training)
    tables = "\n\n".join(retrieval_table(results, metric) for metric in REPORTED_METRICS)
    return {"results": results, "table": tables} if is_main() else {}


def retrieval_table(results: dict[str, dict[str, Any]], metric: str = "ndcg@5") -> str:
    """Markdown Table 2 (overall) plus one row per evidence label when the data carry labels."""
    keys = {k for by_pool in results.values() for r in by_pool.values() for k in r} - {"all", "num_queries"}
    labels = ["all", *sorted(keys)]
    rows = {"all queries" if label == "all" else label: _grid(results, label, metric) for label in labels}
    pools_seen = list(dict.fromkeys(p for by_pool in results.values() for p in by_pool))
    return f"{metric} (x100)\n\n" + format_table(rows, pools=pools_seen)


def _grid(results: dict[str, dict[str, Any]], label: str, metric: str) -> dict[str, dict[str, float]]:
    return {ds: {p: r[label][metric] for p, r in by_pool.items() if label in r} for ds, by_pool in results.items()}
