"""Training pairs: each training question with its positive pages present in the corpus (docs/data.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hkrag.data.opendocvqa import TEXT_COLUMN, Corpus, DataError, QAExample
from hkrag.io import read_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingPair:
    """A query with its positives that exist in the training corpus (never empty), and any hard negatives
    mined for it (:func:`with_hard_negatives`), batched after the positives (docs/training.md)."""

    query_id: str
    query: str
    positives: tuple[str, ...]
    negatives: tuple[str, ...] = ()

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


def field_pairs(fields: Mapping[str, Mapping[str, str]], templates: Sequence[str],
                corpus: Corpus) -> list[TrainingPair]:
    """Queries made from each page's drawn fields (``{title} {value}%``): one pair per page in ``corpus`` and
    template, the page its one positive. With document-grouped batches (``trainer.group_pattern``) the pages of one
    document share their title, so a template naming a field that differs within a document (the headline value, the
    page number) is a contrast that needs that field read. ``fields``: doc id -> field name -> drawn string
    (``hkrag.data.synthetic.load_page_items``' ``fields``); a template naming a field a page lacks is an error
    naming both."""
    pairs = []
    for template in templates:
        for doc_id in sorted(fields):
            if doc_id not in corpus:
                continue
            try:
                query = template.format(**fields[doc_id])
            except KeyError as missing:
                raise DataError(f"data.field_queries: {template!r} names the field {missing} that page {doc_id!r} "
                                f"lacks (it has {sorted(fields[doc_id])})") from None
            pairs.append(TrainingPair(f"{doc_id}-field{templates.index(template)}", query, (doc_id,)))
    return pairs


def pretraining_pairs(corpus: Corpus, column: str = TEXT_COLUMN) -> list[TrainingPair]:
    """VDocRAG pre-training pairs: each page's text as the query, the page itself as its one positive.

    Needs the corpus's ``text`` column (synthetic corpus, PDF ingestion, VDocRetriever-Pretrain-DocStruct;
    ``column`` is its name in the data set, for messages). Pages with no text (null, empty or blank, e.g. scans
    without a text layer) are skipped, counted in one warning. A text that is not a string (bytes, a number, a
    list), stored bytes that are not valid UTF-8, or a string not encodable as UTF-8 (a lone surrogate) is a
    :class:`~hkrag.data.opendocvqa.DataError` naming
    the corpus, the column and the rows, since training on ``str(value)`` would teach the model the wrong text.
    """
    if not corpus.has_text:
        raise ValueError(
            f"{corpus.name} has no 'text' column, which pre-training reads: regenerate the synthetic corpus, "
            "re-ingest the PDFs, or use a data set with page texts (data=pretrain_docstruct)"
        )
    pairs, bad = [], []
    for row, (doc_id, text) in enumerate(zip(corpus.doc_ids, page_texts(corpus))):
        if (problem := text_problem(text)) is not None:
            bad.append(f"row {row} (doc_id {doc_id!r}): {problem}")
        elif text is not None and text.strip():
            pairs.append(TrainingPair(doc_id, text, (doc_id,)))
    if bad:
        raise DataError(f"{corpus.name}: column {column!r} holds {len(bad)} page text(s) that are not UTF-8 strings, "
                        f"e.g. {'; '.join(bad[:3])}: store the column as strings (decoded UTF-8)")
    if not pairs:
        raise DataError(f"{corpus.name}: column {column!r} is empty on every one of its {len(corpus)} pages (null, "
                        "empty or blank): pre-training has no page text to learn from; fill the column (OCR the "
                        "pages, re-ingest the PDFs with their text layer) or name another text column")
    if len(pairs) < len(corpus):
        logger.warning("%d of %d pages of %s have no text in column %r and were skipped", len(corpus) - len(pairs),
                       len(corpus), corpus.name, column)
    return pairs


@dataclass(frozen=True)
class Undecodable:
    """A stored page text whose bytes are not valid UTF-8 (``reason`` says where), in place of the string."""

    reason: str


def page_texts(corpus: Corpus) -> list[object]:
    """The corpus's page texts in row order; a stored string that is not valid UTF-8 (Arrow does not always check
    what a parquet file holds) becomes an :class:`Undecodable` instead of failing the whole column unnamed."""
    try:
        return corpus.texts()
    except UnicodeDecodeError:
        pass
    column = corpus.dataset.select_columns([TEXT_COLUMN]).with_format("arrow")[:].column(0)
    texts: list[object] = []
    for value in column:
        try:
            texts.append(value.as_py())
        except UnicodeDecodeError as error:
            texts.append(Undecodable(f"invalid UTF-8: {error.reason} at byte {error.start}"))
    return texts


def text_problem(text: object) -> str | None:
    """Why ``text`` cannot be a page text (``None`` when it can: a string encodable as UTF-8, or null)."""
    if text is None:
        return None
    if isinstance(text, Undecodable):
        return text.reason
    if not isinstance(text, str):
        return f"{type(text).__name__} {_preview(text)}, not a string"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"not encodable as UTF-8 ({error.reason} at character {error.start})"
    return None


def _preview(value: object, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def read_hard_negatives(path: str | Path) -> dict[str, tuple[str, ...]]:
    """``query_id -> mined doc ids, hardest first`` from a ``python -m hkrag.index.mine`` file."""
    path = Path(path)
    try:
        negatives = read_json(path, keys=("negatives",), what="hard-negative file")["negatives"]
    except FileNotFoundError as error:
        message = f"hard-negative file {path} does not exist: mine one with python -m hkrag.index.mine"
        raise FileNotFoundError(message) from error
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a hard-negative file of python -m hkrag.index.mine: {error!r}") from error
    return {query_id: tuple(doc_ids) for query_id, doc_ids in negatives.items()}


def with_hard_negatives(
    pairs: Sequence[TrainingPair], negatives: Mapping[str, Sequence[str]], n: int, corpus: Corpus
) -> list[TrainingPair]:
    """``pairs`` with the first ``n`` mined negatives of each query (every query needs ``n``).

    A negative must be a page of the training ``corpus`` (negatives mined from another split's pages
    would leak them into training) and never one of the query's positives; either is an error naming
    the query and page.
    """
    if n < 1:
        raise ValueError(f"the number of hard negatives per query must be >= 1, got {n}")
    out = []
    for pair in pairs:
        mined = tuple(negatives.get(pair.query_id, ()))[:n]
        if len(mined) < n:
            raise ValueError(f"query {pair.query_id} has {len(mined)} mined hard negatives, {n} are needed: "
                             "mine deeper (python -m hkrag.index.mine --depth) or lower trainer.hard_negatives")
        for doc_id in mined:
            if doc_id not in corpus:
                raise ValueError(f"hard negative {doc_id} of query {pair.query_id} is not a page of {corpus.name}: "
                                 "mine from the training split's corpus")
            if doc_id in pair.positives:
                raise ValueError(f"hard negative {doc_id} of query {pair.query_id} is one of its positives")
        out.append(replace(pair, negatives=mined))
    return out
