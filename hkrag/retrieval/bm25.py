"""BM25 over page text (the paper's Table 2 opens with it): ``retriever=bm25`` scored by the ``bm25s`` library; the
text, indexing and ranking rules shared with ``retriever=bm25_vidore`` (:mod:`hkrag.retrieval.bm25_vidore`).

**Text.** A page's text is the corpus column ``text_column``: ``text`` (default) holds the strings the built-in
corpus draws on each page and the text layer of PDF ingestion; ``python -m hkrag.data.ocr`` writes OCR text into
a column named by its config (e.g. ``ocr_text``). A page whose text is missing or blank is an error naming the
page and the column (:class:`~hkrag.data.opendocvqa.DataError`) unless ``allow_empty`` is set; such a page then
has no terms and scores 0 for every query (it still counts in N and in the mean page length). When no page
of a corpus has a token (heavily degraded pages OCRed to nothing), every query scores 0.
A query is read without the OpenDocVQA retrieval instruction (:data:`~hkrag.data.opendocvqa.QUERY_PREFIX`).

**``bm25`` tokens** (``bm25s.tokenize``): lowercased when ``lower``; the matches of ``token_pattern`` (default bm25s's
and scikit-learn's ``(?u)\\b\\w\\w+\\b``: runs of two or more letters/digits, so ``"REF R4 P.3"`` gives ``ref``,
``r4``); no stop words unless ``stopwords`` names bm25s's list (``en``) or gives one (``bm25s.tokenize`` itself
defaults to its English list; we pass none); no stemming.

**``bm25`` score** (``method=lucene``, Lucene's BM25 formula after Kamphuis et al., ECIR 2020, with bm25s's default
parameters ``k1=1.5``, ``b=0.75``; 1.5 is also rank_bm25's default, while Lucene's own ``BM25Similarity`` defaults
to ``k1=1.2``): for a page ``d`` of a corpus of ``N`` pages of mean length ``avgdl`` (in tokens),

    score(q, d) = sum over query tokens t of  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

(a token repeated in the query counts once per occurrence; tokens no page holds count 0). ``method`` picks
bm25s's other variants (``robertson``, ``atire``, ``bm25l``, ``bm25+``; ``delta`` for the last two).

**Ranking.** Pages by score descending; each query keeps its top ``depth`` pages and every page tied with the
``depth``-th score (:func:`hkrag.retrieval.metrics.cut_with_ties`), so no doc id decides which pages a run holds
and the tie-aware metrics are exact. ``bm25`` does not retrieve a page sharing no token with the query (score 0),
so a query may return fewer pages; ``bm25_vidore`` does.

**Text without tokens.** A page or query whose text tokenises to nothing (blank, symbols only, a script the
tokeniser drops) scores 0 against everything. Each corpus logs a warning with how many of its pages have no token,
each ranking one with how many queries have none, and :meth:`PageTextRanker.report_extras` puts the counts that are
not 0 in the evaluation report's ``all`` block (``pages_without_tokens``, ``queries_without_tokens``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import bm25s
import numpy as np
from tqdm.auto import tqdm

from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, DataError, QAExample
from hkrag.retrieval.metrics import cut_with_ties

METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")
DEFAULT_TOKEN_PATTERN = r"(?u)\b\w\w+\b"

log = logging.getLogger(__name__)

Scorer = Callable[[Sequence[str]], np.ndarray]
"""A tokenised query -> every page's score, in corpus order."""


@dataclass
class PageTextRanker:
    """A lexical :class:`hkrag.retrieval.evaluation.Ranker` over a corpus text column: the text, indexing and ranking
    rules of the module docstring; subclasses tokenise and score. Each corpus is indexed once per ranker (keyed by its
    name and doc ids)."""

    name: str = "bm25"
    text_column: str = "text"
    allow_empty: bool = False
    _indexes: dict[tuple[str, int], BM25Index] = field(default_factory=dict, init=False, repr=False)
    _tokenless: dict[str, dict[str, int]] = field(default_factory=dict, init=False, repr=False)
    retrieve_zero: ClassVar[bool] = False
    """Whether pages scoring 0 are retrieved (as one tie group) or left out."""

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's tokens."""
        raise NotImplementedError

    def scorer(self, tokens: Sequence[list[str]]) -> Scorer:
        """Scores of every page (holding ``tokens``, at least one page has a token) for a tokenised query."""
        raise NotImplementedError

    def page_scorer(self, corpus: Corpus, texts: Sequence[str]) -> Scorer | None:
        """The scorer of the pages holding ``texts`` (``None`` when no page has a token); warns of tokenless pages."""
        tokens = self.tokenize(texts)
        self.count_tokenless(corpus, "pages", [not t for t in tokens], texts)
        return self.scorer(tokens) if any(tokens) else None

    def index(self, corpus: Corpus) -> BM25Index:
        """The BM25 index of ``corpus``'s page texts (built on first use)."""
        key = (corpus.name, hash(tuple(corpus.doc_ids)))
        if key not in self._indexes:
            texts = page_texts(corpus, self.text_column, self.allow_empty)
            self._indexes[key] = BM25Index(corpus.doc_ids, self.page_scorer(corpus, texts), self.retrieve_zero)
        return self._indexes[key]

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str = "corpus") -> dict:
        """``{query_id: {doc_id: score}}``: each query's top ``depth`` pages of ``corpus`` and the pages tied with the
        ``depth``-th."""
        index = self.index(corpus)
        texts = [ex.query.removeprefix(QUERY_PREFIX) for ex in qa]
        queries = self.tokenize(texts)
        self.count_tokenless(corpus, "queries", [not t for t in queries], texts, [ex.query_id for ex in qa])
        return {ex.query_id: index.top(tokens, depth)
                for ex, tokens in zip(tqdm(qa, desc=f"{self.name} {corpus_key}", leave=False), queries)}

    def count_tokenless(self, corpus: Corpus, what: str, empty: Sequence[bool], texts: Sequence[str],
                        ids: Sequence[str] | None = None) -> None:
        """Record how many of ``texts`` (the corpus's pages or the queries ranked on it) have no token, and warn
        naming a few when some have none: they score 0 against everything."""
        count = sum(empty)
        self._tokenless.setdefault(corpus.name, {})[f"{what}_without_tokens"] = count
        if count:
            ids = corpus.doc_ids if ids is None else ids
            examples = [(i, t[:40]) for i, t, e in zip(ids, texts, empty) if e][:3]
            blank = sum(1 for t, e in zip(texts, empty) if e and not t.strip())
            log.warning("%s on %s: %d of %d %s have no token (%d blank; e.g. %s), so they score 0 against every %s",
                        self.name, corpus.name, count, len(empty), what, blank, examples,
                        "query" if what == "pages" else "page")

    def report_extras(self, run: dict, qa: Sequence[QAExample], corpus: Corpus) -> dict[str, float]:
        """Entries for the evaluation report beside the metrics: how many pages of ``corpus`` and queries ranked on
        it had no token, when some had none (so a report's keys stay those of the dense retriever's otherwise)."""
        return {key: count for key, count in self._tokenless.get(corpus.name, {}).items() if count}


@dataclass
class BM25Ranker(PageTextRanker):
    """BM25 scored by bm25s (config ``retriever=bm25``); settings as in the module docstring."""

    method: str = "lucene"
    k1: float = 1.5
    b: float = 0.75
    delta: float = 0.5
    lower: bool = True
    token_pattern: str = DEFAULT_TOKEN_PATTERN
    stopwords: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"BM25 method={self.method!r}: expected one of {list(METHODS)}")
        if self.stopwords is not None and not isinstance(self.stopwords, str):
            self.stopwords = list(self.stopwords)

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's tokens (see the module docstring)."""
        return bm25s.tokenize(list(texts), lower=self.lower, token_pattern=self.token_pattern,
                              stopwords=self.stopwords or [], return_ids=False, show_progress=False)

    def scorer(self, tokens: Sequence[list[str]]) -> Scorer:
        model = bm25s.BM25(k1=self.k1, b=self.b, delta=self.delta, method=self.method)
        model.index(list(tokens), show_progress=len(tokens) > 10_000)
        return lambda query: model.get_scores_from_ids(model.get_tokens_ids(list(query)))


class BM25Index:
    """The pages' doc ids and a scorer (tokenised query -> every page's score, in corpus order); no scorer when no
    page has a token (every page blank, e.g. OCR of heavily degraded pages read nothing): every score is 0.
    ``retrieve_zero``: whether pages scoring 0 are retrieved (ranked as a tie) or left out."""

    def __init__(self, doc_ids: Sequence[str], scorer: Scorer | None = None,
                 retrieve_zero: bool = False):
        self.doc_ids, self.scorer, self.retrieve_zero = list(doc_ids), scorer, retrieve_zero

    def scores(self, tokens: Sequence[str]) -> np.ndarray:
        """Every page's score for a tokenised query, in corpus order."""
        return np.zeros(len(self.doc_ids)) if self.scorer is None else np.asarray(self.scorer(tokens))

    def top(self, tokens: Sequence[str], depth: int) -> dict[str, float]:
        """The ``depth`` best pages and every page tied with the ``depth``-th (pages scoring 0 only when
        ``retrieve_zero``), in trec_eval order."""
        scores = self.scores(tokens)
        hits = np.arange(len(scores)) if self.retrieve_zero else np.flatnonzero(scores > 0)
        if len(hits) > depth:  # only pages scoring at least the depth-th score can be kept
            hits = hits[scores[hits] >= np.partition(scores[hits], -depth)[-depth]]
        return cut_with_ties({"q": {self.doc_ids[i]: float(scores[i]) for i in hits}}, depth)["q"]


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
