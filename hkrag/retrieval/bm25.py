"""BM25 over page text (the paper's Table 2 opens with it): ``retriever=bm25`` scored by the ``bm25s`` library, and
``retriever=bm25_vidore``, ViDoRe's BM25 baseline (``rank_bm25``'s BM25Okapi over NLTK tokens), for figures that
compare with ViDoRe's tables.

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

**``bm25_vidore``** (:class:`VidoreBM25Ranker`) follows ``BM25Retriever`` of illuin-tech/vidore-benchmark
(``src/vidore_benchmark/retrievers/bm25_retriever.py``): tokens are NLTK's ``word_tokenize`` (Punkt sentences,
then the Treebank word rules), kept when ``str.isalnum()`` (so ``"P.3"``, ``"U.S."`` and ``"'s"`` go), lowercased,
NLTK's English stop words removed; scored by ``rank_bm25.BM25Okapi`` at its defaults (``k1=1.5``, ``b=0.75``,
``epsilon=0.25``): the same tf part as above, ``idf(t) = ln((N - df + 0.5) / (df + 0.5))``, and an idf below 0
replaced by ``epsilon`` times the mean idf. As in ViDoRe, every page is ranked, those scoring 0 too. NLTK's data
(``punkt_tab``, ``stopwords``) cannot be downloaded at run time here: it is read from NLTK's own search path or,
failing that, from the copy llama-index-core ships (``llama_index/core/_static/nltk_cache``); the English
stop-word list there has 198 words (45 of them contractions such as ``don't``, which the ``isalnum`` test drops
before the stop-word test anyway). Install with ``pip install -e ".[bm25-vidore]"``.

**Ranking.** Pages by score descending; each query keeps its top ``depth`` pages and every page tied with the
``depth``-th score (:func:`hkrag.retrieval.metrics.cut_with_ties`), so no doc id decides which pages a run holds
and the tie-aware metrics are exact. ``bm25`` does not retrieve a page sharing no token with the query (score 0),
so a query may return fewer pages; ``bm25_vidore`` does.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import bm25s
import numpy as np
from tqdm.auto import tqdm

from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, DataError, QAExample
from hkrag.retrieval.metrics import cut_with_ties

METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")
DEFAULT_TOKEN_PATTERN = r"(?u)\b\w\w+\b"
INSTALL_VIDORE = 'pip install -e ".[bm25-vidore]"'
NLTK_RESOURCES = {"tokenizers/punkt_tab/english/": "punkt_tab", "corpora/stopwords/english": "stopwords"}


@dataclass
class PageTextRanker:
    """A lexical :class:`hkrag.retrieval.evaluation.Ranker` over a corpus text column: the text, indexing and ranking
    rules of the module docstring; subclasses tokenise and score. Each corpus is indexed once per ranker (keyed by its
    name and doc ids)."""

    name: str = "bm25"
    text_column: str = "text"
    allow_empty: bool = False
    _indexes: dict[tuple[str, int], BM25Index] = field(default_factory=dict, init=False, repr=False)
    retrieve_zero: ClassVar[bool] = False
    """Whether pages scoring 0 are retrieved (as one tie group) or left out."""

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's tokens."""
        raise NotImplementedError

    def scorer(self, tokens: Sequence[list[str]]) -> Callable[[Sequence[str]], np.ndarray]:
        """Scores of every page (holding ``tokens``, at least one page has a token) for a tokenised query."""
        raise NotImplementedError

    def index(self, corpus: Corpus) -> BM25Index:
        """The BM25 index of ``corpus``'s page texts (built on first use)."""
        key = (corpus.name, hash(tuple(corpus.doc_ids)))
        if key not in self._indexes:
            tokens = self.tokenize(page_texts(corpus, self.text_column, self.allow_empty))
            scorer = self.scorer(tokens) if any(tokens) else None
            self._indexes[key] = BM25Index(corpus.doc_ids, scorer, self.retrieve_zero)
        return self._indexes[key]

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str = "corpus") -> dict:
        """``{query_id: {doc_id: score}}``: each query's top ``depth`` pages of ``corpus`` and the pages tied with the
        ``depth``-th."""
        index = self.index(corpus)
        queries = self.tokenize([ex.query.removeprefix(QUERY_PREFIX) for ex in qa])
        return {ex.query_id: index.top(tokens, depth)
                for ex, tokens in zip(tqdm(qa, desc=f"{self.name} {corpus_key}", leave=False), queries)}


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

    def scorer(self, tokens: Sequence[list[str]]) -> Callable[[Sequence[str]], np.ndarray]:
        model = bm25s.BM25(k1=self.k1, b=self.b, delta=self.delta, method=self.method)
        model.index(list(tokens), show_progress=len(tokens) > 10_000)
        return lambda query: model.get_scores_from_ids(model.get_tokens_ids(list(query)))


@dataclass
class VidoreBM25Ranker(PageTextRanker):
    """ViDoRe's BM25 baseline (config ``retriever=bm25_vidore``): NLTK tokens, rank_bm25's BM25Okapi; every page
    ranked (module docstring)."""

    name: str = "bm25_vidore"
    k1: float = 1.5
    b: float = 0.75
    epsilon: float = 0.25
    retrieve_zero: ClassVar[bool] = True

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """ViDoRe's ``preprocess_text``: NLTK word tokens that are alphanumeric, lowercased, minus English stop
        words."""
        word_tokenize, stop_words = nltk_english()
        return [[word.lower() for word in word_tokenize(text) if word.isalnum() and word.lower() not in stop_words]
                for text in texts]

    def scorer(self, tokens: Sequence[list[str]]) -> Callable[[Sequence[str]], np.ndarray]:
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as error:
            raise ImportError(f"retriever=bm25_vidore needs rank_bm25: {INSTALL_VIDORE}") from error
        model = BM25Okapi([list(t) for t in tokens], k1=self.k1, b=self.b, epsilon=self.epsilon)
        return lambda query: model.get_scores(list(query))


@functools.cache
def nltk_english() -> tuple[Callable[[str], list[str]], frozenset[str]]:
    """NLTK's ``word_tokenize`` and English stop words, their data read offline: NLTK's search path first, then the
    copy llama-index-core ships. Raises ImportError naming what to install when neither has it."""
    try:
        import nltk
    except ImportError as error:
        raise ImportError(f"retriever=bm25_vidore needs nltk: {INSTALL_VIDORE}") from error
    shipped = _llama_index_nltk_data()
    for resource, package in NLTK_RESOURCES.items():
        try:
            nltk.data.find(resource)
        except LookupError:
            if shipped is None or str(shipped) in nltk.data.path:
                raise ImportError(f"NLTK data {package!r} not found (NLTK's path: {nltk.data.path}); install "
                                  f"llama-index-core, which ships it, or run nltk.download({package!r})") from None
            nltk.data.path.append(str(shipped))
            nltk.data.find(resource)
    from nltk.corpus import stopwords
    from nltk.tokenize import word_tokenize

    return word_tokenize, frozenset(stopwords.words("english"))


def _llama_index_nltk_data() -> Path | None:
    """llama-index-core's bundled NLTK data folder (found without importing llama_index.core), or None."""
    try:
        spec = importlib.util.find_spec("llama_index.core")
    except ModuleNotFoundError:
        return None
    folders = [Path(p) / "_static" / "nltk_cache" for p in (spec.submodule_search_locations or [])] if spec else []
    return next((f for f in folders if f.is_dir()), None)


class BM25Index:
    """The pages' doc ids and a scorer (tokenised query -> every page's score, in corpus order); no scorer when no
    page has a token (every page blank, e.g. OCR of heavily degraded pages read nothing): every score is 0.
    ``retrieve_zero``: whether pages scoring 0 are retrieved (ranked as a tie) or left out."""

    def __init__(self, doc_ids: Sequence[str], scorer: Callable[[Sequence[str]], np.ndarray] | None = None,
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
