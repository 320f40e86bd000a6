"""Training pairs: each training question with its positive pages present in the corpus (docs/data.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from hkrag.data.opendocvqa import Corpus, QAExample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingPair:
    """A query with its positives that exist in the training corpus (never empty)."""

    query_id: str
    query: str
    positives: tuple[str, ...]

    def positive(self, epoch: int = 0) -> str:
        """The positive used in ``epoch``: multi-positive queries rotate through theirs."""
        return self.positives[epoch % len(self.positives)]


def training_pairs(qa: Iterable[QAExample], corpus: Corpus) -> list[TrainingPair]:
    """Pair each query with its positives present in ``corpus``.

    OpenDocVQA's train split names ~2,100 pages its corpus lacks: those ids are dropped and a
    query left with none is skipped, both counted in one warning instead of a ``KeyError``.
    """
    pairs, missing_ids, skipped = [], 0, 0
    for ex in qa:
        present = tuple(doc_id for doc_id in ex.relevant_doc_ids if doc_id in corpus)
        missing_ids += len(ex.relevant_doc_ids) - len(present)
        if present:
            pairs.append(TrainingPair(ex.query_id, ex.query, present))
        else:
            skipped += 1
    if missing_ids or skipped:
        logger.warning(
            "%d relevant_doc_ids are missing from %s; %d queries without any positive were skipped",
            missing_ids,
            corpus.name,
            skipped,
        )
    return pairs


def pretraining_pairs(corpus: Corpus) -> list[TrainingPair]:
    """VDocRAG pre-training pairs: each page's text as the query, the page itself as its one positive.

    Needs the corpus's ``text`` column (synthetic corpus, PDF ingestion, VDocRetriever-Pretrain-DocStruct);
    pages with blank text (e.g. scans without a text layer) are skipped, counted in one warning.
    """
    if not corpus.has_text:
        raise ValueError(
            f"{corpus.name} has no 'text' column, which pre-training reads: regenerate the synthetic corpus, "
            "re-ingest the PDFs, or use a data set with page texts (data=pretrain_docstruct)"
        )
    pairs = [TrainingPair(doc_id, text, (doc_id,)) for doc_id, text in zip(corpus.doc_ids, corpus.texts())
             if text and text.strip()]
    if len(pairs) < len(corpus):
        logger.warning("%d of %d pages of %s have no text and were skipped", len(corpus) - len(pairs), len(corpus),
                       corpus.name)
    return pairs
