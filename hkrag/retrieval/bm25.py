"""BM25 over page text (the paper's Table 2 opens with it), scored by the ``bm25s`` library.

**Text.** A page's text is the corpus column ``text_column``: ``text`` (default) holds the strings the built-in
corpus draws on each page and the text layer of PDF ingestion; ``python -m hkrag.data.ocr`` writes OCR text into
a column named by its config (e.g. ``ocr_text``). A page whose text is missing or blank is an error naming the
page and the column (:class:`~hkrag.data.opendocvqa.DataError`) unless ``allow_empty`` is set; such a page then
has no terms and scores 0 for every query (it still counts in N and in the mean page length). When no page
of a corpus has a token (heavily degraded pages OCRed to nothing), every query scores 0 and returns no page.
A query is read without the OpenDocVQA retrieval instruction (:data:`~hkrag.data.opendocvqa.QUERY_PREFIX`).

**Tokens** (``bm25s.tokenize``): lowercased when ``lower``; the matches of ``token_pattern`` (default bm25s's and
scikit-learn's ``(?u)\\b\\w\\w+\\b``: runs of two or more letters/digits, so ``"REF R4 P.3"`` gives ``ref``, ``r4``);
no stop words unless ``stopwords`` names bm25s's list (``en``) or gives one; no stemming.

**Score** (bm25s's defaults, ``method=lucene``, ``k1=1.5``, ``b=0.75``; Kamphuis et al., ECIR 2020): for a page
``d`` of a corpus of ``N`` pages of mean length ``avgdl`` (in tokens),

    score(q, d) = sum over query tokens t of  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

(a token repeated in the query counts once per occurrence; tokens no page holds count 0). ``method`` picks
bm25s's other variants (``robertson``, ``atire``, ``bm25l``, ``bm25+``; ``delta`` for the last two).

**Ranking.** Pages by score descending, ties by doc id descending (trec_eval's order,
:func:`hkrag.retrieval.metrics.trec_order`), at most ``depth`` per query; a page sharing no token with the
query (score 0) is not retrieved, so a query may return fewer pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import bm25s
import numpy as np
from tqdm.auto import tqdm

from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, DataError, QAExample
from hkrag.retrieval.metrics import trec_order

METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")
DEFAULT_TOKEN_PATTERN = r"(?u)\b\w\w+\b"


@dataclass
class BM25Ranker:
    """BM25 as a :class:`hkrag.retrieval.evaluation.Ranker` (config ``retriever=bm25``); settings as in the module
    docstring. Each corpus is indexed once per ranker (keyed by its name and doc ids)."""

    name: str = "bm25"
    text_column: str = "text"
    method: str = "lucene"
    k1: float = 1.5
    b: float = 0.75
    delta: float = 0.5
    lower: bool = True
    token_pattern: str = DEFAULT_TOKEN_PATTERN
    stopwords: str | Sequence[str] | None = None
    allow_empty: bool = False
    _indexes: dict[tuple[str, int], BM25Index] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"BM25 method={self.method!r}: expected one of {list(METHODS)}")
        if self.stopwords is not None and not isinstance(self.stopwords, str):
            self.stopwords = list(self.stopwords)

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's tokens (see the module docstring)."""
        return bm25s.tokenize(list(texts), lower=self.lower, token_pattern=self.token_pattern,
                              stopwords=self.stopwords or [], return_ids=False, show_progress=False)

    def index(self, corpus: Corpus) -> BM25Index:
        """The BM25 index of ``corpus``'s page texts (built on first use)."""
        key = (corpus.name, hash(tuple(corpus.doc_ids)))
        if key not in self._indexes:
            texts = page_texts(corpus, self.text_column, self.allow_empty)
            self._indexes[key] = BM25Index.build(corpus.doc_ids, self.tokenize(texts), self)
        return self._indexes[key]

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str = "corpus") -> dict:
        """``{query_id: {doc_id: score}}``: each query's top ``depth`` pages of ``corpus``."""
        index = self.index(corpus)
        queries = self.tokenize([ex.query.removeprefix(QUERY_PREFIX) for ex in qa])
        return {ex.query_id: index.top(tokens, depth)
                for ex, tokens in zip(tqdm(qa, desc=f"BM25 {corpus_key}", leave=False), queries)}


@dataclass
class BM25Index:
    """A ``bm25s.BM25`` over tokenised pages, with their doc ids; ``model`` is ``None`` when no page has a token
    (every page blank, e.g. OCR of heavily degraded pages read nothing), which bm25s cannot index: every score is 0."""

    doc_ids: list[str]
    model: bm25s.BM25 | None

    @classmethod
    def build(cls, doc_ids: Sequence[str], tokens: Sequence[list[str]], ranker: BM25Ranker) -> BM25Index:
        if not any(tokens):
            return cls(list(doc_ids), None)
        model = bm25s.BM25(k1=ranker.k1, b=ranker.b, delta=ranker.delta, method=ranker.method)
        model.index(list(tokens), show_progress=len(tokens) > 10_000)
        return cls(list(doc_ids), model)

    def scores(self, tokens: Sequence[str]) -> np.ndarray:
        """Every page's score for a tokenised query, in corpus order."""
        if self.model is None:
            return np.zeros(len(self.doc_ids))
        return self.model.get_scores_from_ids(self.model.get_tokens_ids(list(tokens)))

    def top(self, tokens: Sequence[str], depth: int) -> dict[str, float]:
        """The ``depth`` best pages with a positive score, in trec_eval order (ties: doc id descending)."""
        scores = self.scores(tokens)
        hits = np.flatnonzero(scores > 0)
        if len(hits) > depth:  # keep every page tied with the depth-th score, then cut in trec_eval order
            hits = hits[scores[hits] >= np.partition(scores[hits], -depth)[-depth]]
        found = {self.doc_ids[i]: float(scores[i]) for i in hits}
        return {doc_id: found[doc_id] for doc_id in trec_order(found)[:depth]}


def page_texts(corpus: Corpus, column: str, allow_empty: bool = False) -> list[str]:
    """The ``column`` text of every page of ``corpus`` in row order (``""`` for a blank page when ``allow_empty``).

    Raises :class:`DataError` naming the corpus and column when the column is absent, and the pages when some
    text is missing or blank (unless ``allow_empty``).
    """
    if column not in corpus.dataset.column_names:
        raise DataError(f"{corpus.name} has no {column!r} column (columns: {corpus.dataset.column_names}): give "
                        "pages text with `python -m hkrag.data.ocr` or name another column (retriever.text_column)")
    texts = [text or "" for text in corpus.dataset[column][:]]
    empty = [doc_id for doc_id, text in zip(corpus.doc_ids, texts) if not text.strip()]
    if empty and not allow_empty:
        more = f" (and {len(empty) - 1} more: {empty[1:6]})" if len(empty) > 1 else ""
        raise DataError(f"{corpus.name}: page {empty[0]!r} has no text in column {column!r}{more}; fill it "
                        "(`python -m hkrag.data.ocr`) or set allow_empty=true to score such pages 0")
    return texts
