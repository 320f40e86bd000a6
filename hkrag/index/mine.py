"""Hard-negative mining from a retriever run (Tevatron / colpali style), into the training data.

    python eval.py task=retrieval eval.split=train eval.pools=[single] ...   # embeds training queries and pages
    python -m hkrag.index.mine --queries <work>/queries --corpus <work>/embeddings-<config> \\
        --qrels <work>/qrels.json --corpus-source data/synthetic/corpus --corpus-config default \\
        --depth 30 --skip 0 --keep 8 --out data/hard_negatives.json
    python train.py trainer.hard_negatives=2 trainer.negatives_file=data/hard_negatives.json

The evaluation's work dir holds the query embeddings (``queries/``), the page embeddings
(``embeddings-<config>/``) and the relevant pages (``qrels.json``). Every query's ``depth`` nearest pages are
ranked (exact inner-product search, ties by doc id); the first ``skip`` ranks are dropped (pages ranked
that high are often unlabelled positives), then every relevant page of the query and every page outside
the training corpus (``--corpus-source``/``--corpus-config``, split ``train``), and the first ``keep`` that
remain are its hard negatives, hardest first. The file (``{"settings", "negatives": {query_id: [doc_id]}}``)
is what :func:`hkrag.data.pairs.read_hard_negatives` reads (docs/training.md "Hard negatives").
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np

from hkrag.data.opendocvqa import load_corpus
from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import load_shards, read_manifest
from hkrag.io import read_json, write_json
from hkrag.ranges import NON_NEGATIVE, POSITIVE

logger = logging.getLogger(__name__)


def ranking(scores: Mapping[str, float]) -> list[str]:
    """Doc ids by descending score, ties by doc id (a deterministic order whatever the search returned)."""
    return sorted(scores, key=lambda doc_id: (-scores[doc_id], doc_id))


def mine_negatives(
    run: Mapping[str, Mapping[str, float]],
    positives: Mapping[str, Collection[str]],
    keep: int,
    skip: int = 0,
    allowed: Collection[str] | None = None,
) -> dict[str, list[str]]:
    """Each query's hard negatives from its retrieved ``run`` scores, hardest first.

    From the query's :func:`ranking`, drop the first ``skip`` ranks, then the query's ``positives`` (never a
    relevant page) and pages not in ``allowed`` (the training corpus: a test page must never become
    training data); keep the first ``keep``. Queries of ``run`` without judgements are an error (their
    positives are unknown, so any page could be one). Queries come out in sorted order.
    """
    if keep < 1 or skip < 0:
        raise ValueError(f"need keep >= 1 and skip >= 0, got keep={keep}, skip={skip}")
    unjudged = sorted(set(run) - set(positives))
    if unjudged:
        raise ValueError(f"{len(unjudged)} queries of the run have no relevance judgements (e.g. {unjudged[:3]}): "
                         "pass the qrels of the same queries")
    negatives = {}
    for query_id in sorted(run):
        relevant = positives[query_id]
        candidates = ranking(run[query_id])[skip:]
        negatives[query_id] = [doc_id for doc_id in candidates
                               if doc_id not in relevant and (allowed is None or doc_id in allowed)][:keep]
    return negatives


def search_run(
    query_ids: Sequence[str], queries: np.ndarray, doc_ids: Sequence[str], documents: np.ndarray, depth: int
) -> dict[str, dict[str, float]]:
    """``{query_id: {doc_id: score}}`` of each query's ``depth`` nearest pages (exact FAISS inner product)."""
    index = DocumentIndex.build(doc_ids, documents, "flat", use_gpu=False)
    return index.to_run(list(query_ids), queries, min(depth, len(doc_ids)))


def mine_from_embeddings(
    queries_dir: str | Path, corpus_dir: str | Path, qrels: Mapping[str, Mapping[str, int]], depth: int, keep: int,
    skip: int = 0, allowed: Collection[str] | None = None,
) -> dict[str, list[str]]:
    """:func:`mine_negatives` on the run of the query shards ``queries_dir`` against the page shards ``corpus_dir``
    (both :func:`hkrag.index.shards.encode_corpus` folders, e.g. of an evaluation on the training split); the two
    must hold embeddings of the same weights (their manifests' ``weights`` fingerprint)."""
    if depth < keep + skip:
        raise ValueError(f"--depth {depth} leaves no room for --skip {skip} and --keep {keep}: use depth >= skip + "
                         "keep plus the positives per query")
    query_ids, queries = load_shards(queries_dir)
    doc_ids, documents = load_shards(corpus_dir, expect={"weights": read_manifest(queries_dir).get("weights")})
    run = search_run(query_ids, queries, doc_ids, documents, depth)
    positives = {query_id: set(judged) for query_id, judged in qrels.items()}
    negatives = mine_negatives(run, positives, keep, skip, allowed)
    short = [query_id for query_id, mined in negatives.items() if len(mined) < keep]
    if short:
        logger.warning("%d of %d queries got fewer than %d hard negatives (e.g. %s): raise --depth",
                       len(short), len(negatives), keep, short[:3])
    return negatives


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", required=True, help="query embedding shards (<eval work dir>/queries)")
    parser.add_argument("--corpus", required=True, help="page embedding shards of the training corpus")
    parser.add_argument("--qrels", required=True, help="qrels.json of the same queries ({query_id: {doc_id: 1}})")
    parser.add_argument("--out", required=True, help="hard-negative file to write (JSON)")
    parser.add_argument("--depth", type=POSITIVE.arg, default=30, help="pages retrieved per query")
    parser.add_argument("--skip", type=NON_NEGATIVE.arg, default=0,
                        help="top ranks never used (likely unlabelled positives)")
    parser.add_argument("--keep", type=POSITIVE.arg, default=8, help="hard negatives kept per query")
    parser.add_argument("--corpus-source", help="training corpus (data set or folder): negatives only from its pages")
    parser.add_argument("--corpus-config", default=None, help="its config name")
    parser.add_argument("--split", default="train", help="its split (default train)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    allowed = None
    if args.corpus_source:
        allowed = set(load_corpus(args.corpus_source, args.corpus_config, args.split).doc_ids)
    qrels = read_json(args.qrels)
    negatives = mine_from_embeddings(args.queries, args.corpus, qrels, args.depth, args.keep, args.skip, allowed)
    settings = {key: getattr(args, key) for key in ("queries", "corpus", "qrels", "depth", "skip", "keep",
                                                    "corpus_source", "corpus_config", "split")}
    out = write_json(args.out, {"settings": settings, "negatives": negatives})
    logger.info("%d queries, %d hard negatives -> %s", len(negatives), sum(map(len, negatives.values())), out)
    return out


if __name__ == "__main__":
    main()
