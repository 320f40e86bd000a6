"""The generator's training top-k from a retriever, like VDocRAG's ``create_train_generator`` (DESIGN §11).

Every training query is ranked over the training corpus and its top-k page ids are kept in rank order
(``pages=retrieved``, VDocGenerator's recipe), or its relevant pages are kept (``pages=gold``), or page sets are
drawn from its top ``depth`` (``pages=sampled``: :func:`~hkrag.data.generator_pairs.sampled_pairs`). The corpus
embeddings are resumable shards (:func:`hkrag.retrieval.evaluation.embed_corpus`); the pairs file is
written once, atomically, and a rerun with the same settings reads it back (:mod:`hkrag.data.generator_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hkrag.data.generator_pairs import (
    PAGE_SOURCES,
    GeneratorPair,
    gold_pairs,
    pair_of,
    read_pairs,
    sampled_pairs,
    warn_few_pages,
    write_pairs,
)
from hkrag.data.opendocvqa import Corpus, QAExample
from hkrag.index.faiss_index import DocumentIndex
from hkrag.retriever import Phi3VRetriever

from .evaluation import RetrievalEvalConfig, embed_corpus, shard_identity

EMBEDDINGS_DIR = "embeddings-train"


def encode_training(
    retriever: Phi3VRetriever,
    qa: Sequence[QAExample],
    corpus: Corpus,
    work_dir: Path,
    identity: Mapping[str, Any],
    batch_sizes: tuple[int, int] = (32, 8),
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The training corpus's page ids and vectors (resumable shards in ``work_dir/embeddings-train``, reused by a
    rerun with the same ``identity``) and the vectors of ``qa``'s queries, in eval mode."""
    was_training = retriever.training
    retriever.eval()
    settings = RetrievalEvalConfig("", "", (), query_batch_size=batch_sizes[0], doc_batch_size=batch_sizes[1])
    ids, vectors = embed_corpus(retriever, corpus, work_dir / EMBEDDINGS_DIR, settings,
                                shard_identity(retriever, dict(identity)))
    queries = retriever.encode_queries([ex.query for ex in qa], batch_size=batch_sizes[0],
                                       ids=[ex.query_id for ex in qa])
    retriever.train(was_training)
    return ids, vectors, queries.float().numpy()


def retrieved_pairs(
    retriever: Phi3VRetriever,
    qa: Sequence[QAExample],
    corpus: Corpus,
    top_k: int,
    question: Callable[[QAExample], str],
    work_dir: Path,
    identity: Mapping[str, Any],
    batch_sizes: tuple[int, int] = (32, 8),
) -> list[GeneratorPair]:
    """Each query's ``top_k`` pages of ``corpus`` by the retriever's cosine score (flat index), best first."""
    if top_k > len(corpus):
        raise ValueError(f"top_k={top_k} but the training corpus {corpus.name} has {len(corpus)} pages")
    ids, vectors, queries = encode_training(retriever, qa, corpus, work_dir, identity, batch_sizes)
    run = DocumentIndex.build(ids, vectors, "flat").to_run([ex.query_id for ex in qa], queries, top_k)
    ranked = {qid: sorted(scores, key=scores.__getitem__, reverse=True) for qid, scores in run.items()}
    warn_few_pages({ex.query_id: len(ranked.get(ex.query_id, ())) for ex in qa}, top_k, "generator.top_k",
                   "the index returned fewer pages for them (e.g. a non-finite query embedding); trained on those")
    return [pair_of(ex, ranked.get(ex.query_id, []), question) for ex in qa]


def build_generator_pairs(
    path: Path,
    qa: Sequence[QAExample],
    corpus: Corpus | None,
    pages: str,
    top_k: int,
    question: Callable[[QAExample], str],
    retriever: Callable[[], Phi3VRetriever] | None = None,
    identity: Mapping[str, Any] | None = None,
    sampling: Mapping[str, int] | None = None,
) -> list[GeneratorPair]:
    """The pairs at ``path``, built first if absent (``retriever`` is then called for ``pages=retrieved`` or
    ``sampled``; ``sampling`` holds the latter's ``depth``, ``draws`` and ``seed``).

    ``identity`` names the retriever (base, adapter) and the data; it is stored with the pairs, and an
    existing file built with other settings raises rather than training on stale pages.
    """
    if pages not in PAGE_SOURCES:
        raise ValueError(f"pages must be one of {PAGE_SOURCES}, got {pages!r}")
    sampling = check_sampling(sampling, top_k) if pages == "sampled" else None
    settings = {"pages": pages, "top_k": top_k, "queries": len(qa),
                **({"retriever": dict(identity or {})} if pages != "gold" else {}),
                **({"sampling": sampling} if sampling else {})}
    if path.is_file():
        return read_pairs(path, settings)
    if pages == "gold":
        pairs = gold_pairs(qa, top_k, question)
    else:
        if retriever is None or corpus is None:
            raise ValueError(f"pages={pages} needs a retriever and the training corpus")
        depth = sampling["depth"] if sampling else top_k
        pairs = retrieved_pairs(retriever(), qa, corpus, depth, question, path.parent, identity or {})
        if sampling:
            pairs = sampled_pairs(pairs, top_k, sampling["draws"], sampling["seed"])
    write_pairs(path, pairs, settings)
    return pairs


SAMPLING = {"depth": 10, "draws": 16, "seed": 0}
"""``pages=sampled``'s settings where ``generator_training.sampled`` does not set them
(``+generator_training.sampled.draws=8``)."""


def check_sampling(sampling: Mapping[str, int] | None, top_k: int) -> dict[str, int]:
    """``generator_training.sampled`` (``depth``, ``draws``, ``seed``) over :data:`SAMPLING`, as ints, refused
    (naming the value) where the draws cannot be made: an unknown key, a depth below ``top_k``, fewer than one draw."""
    if sampling is not None and not isinstance(sampling, Mapping):
        raise ValueError(f"generator_training.sampled={sampling!r}: expected a mapping of {list(SAMPLING)}")
    if unknown := sorted(set(sampling or {}) - set(SAMPLING)):
        raise ValueError(f"generator_training.sampled has unknown keys {unknown}; expected some of {list(SAMPLING)}")
    values = {**SAMPLING, **(sampling or {})}
    if wrong := [key for key, value in values.items() if isinstance(value, bool) or not isinstance(value, int)]:
        raise ValueError(f"generator_training.sampled.{wrong[0]}={values[wrong[0]]!r}: expected an integer")
    if values["depth"] < top_k:
        raise ValueError(f"generator_training.sampled.depth={values['depth']} is below generator.top_k={top_k}: "
                         "each drawn set takes top_k of the retriever's top depth pages")
    if values["draws"] < 1:
        raise ValueError(f"generator_training.sampled.draws={values['draws']}: expected at least one page set a query")
    return values
