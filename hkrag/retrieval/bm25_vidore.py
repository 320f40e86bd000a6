"""ViDoRe's v1 BM25 pipeline (``retriever=bm25_vidore``), as illuin-tech/vidore-benchmark's code runs it:
``BM25Retriever`` (``src/vidore_benchmark/retrievers/bm25_retriever.py``) scores text rows, and its QA evaluator
(``evaluation/vidore_evaluators/vidore_evaluator_qa.py``) turns row scores into page scores and metrics.

**Tokens** (:meth:`VidoreBM25Ranker.tokenize`): NLTK's ``word_tokenize`` (Punkt sentences, English model, then the
Treebank word rules); a token is kept when ``str.isalnum()`` holds (so ``"P.3"``, ``"U.S."``, ``"'s"`` go),
lowercased, and dropped when it is one of NLTK's English stop words; no stemming.

**Chunks.** ViDoRe scores *rows*, several of which may hold one page (its chunked OCR/caption data sets, or one
row per query on a page): ``BM25Okapi`` is built over the rows, so N, df and avgdl count rows. Here a page's text
(``text_column``: a text layer, OCR by ``python -m hkrag.data.ocr``, or drawn strings) is cut into chunks when
``chunk_chars`` is set: its non-blank lines packed in order into chunks of at most ``chunk_chars`` characters (a
longer line is a chunk alone); with ``chunk_chars: null`` (default) a page is one chunk. A blank page (with
``allow_empty``) is one empty chunk: it counts in N and avgdl, as an empty row does in ViDoRe.

**Scores.** ``rank_bm25.BM25Okapi`` over the chunks at its defaults (``k1=1.5``, ``b=0.75``, ``epsilon=0.25``):
``idf(t) = ln((N - df + 0.5) / (df + 0.5))``, an idf below 0 replaced by ``epsilon`` times the mean idf (so with a
negative mean idf a score can be negative), tf part ``tf (k1 + 1) / (tf + k1 (1 - b + b |c| / avgdl))``. A page's
score is the maximum over its chunks folded as ViDoRe's evaluator does: the first chunk of the corpus enters with
its own score, every later chunk as ``max(results.get(page, 0), score)``, so a page scores at least 0 unless it
holds the corpus's first chunk (:func:`page_scores`). Every page is ranked, those scoring 0 too.

**Queries.** ViDoRe removes repeated query texts (first kept) and judges the kept query by the page of the *last*
row with its text: :meth:`VidoreBM25Ranker.evaluated_queries` does the same to the evaluated QA set (the first
query id and its evidence label kept, the relevant pages of the last).

**Metrics.** ViDoRe's nDCG@k comes from ``pytrec_eval`` (ties by doc id, its file name, descending): the report's
trec_eval ``ndcg@5`` is that value. Its MRR@k is MTEB's (``mteb.evaluation.evaluators.utils.mrr`` of mteb 1.16),
a stable sort by score, so tied pages keep corpus order: the report's ``vidore_mrr@10``
(:func:`corpus_order_mrr`); the report's ``mrr@10`` orders ties by doc id and ``E[mrr@10]`` averages over them.

**What differs from ViDoRe's published tables** (so figures from here are not theirs): their chunks came with
their data sets (made by Unstructured's parsing and OCR or captioning), ours from the line rule above; their QA
data sets repeat a page's text once per row on it, which weighs N and df by how many queries a page has, while a
page here is counted once per chunk; a corpus where no chunk has a token makes ``BM25Okapi`` divide by zero
there, while every page scores 0 here; a query here is read without the OpenDocVQA retrieval instruction; and a run
keeps ``eval.top_k`` pages with their ties rather than every page (no effect on nDCG@k, recall@k or MRR@k for
k <= ``eval.top_k``).

**NLTK data** ships in ``hkrag/retrieval/nltk_data`` (NLTK's ``punkt_tab`` English model and English stop-word
list, 198 words; provenance and licences in its ``NOTICE``): read through NLTK's own loaders from that folder, so
nothing is downloaded and no other package's copy is used. Install with ``pip install -e ".[bm25-vidore]"``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, QAExample, qrels
from hkrag.retrieval.bm25 import PageTextRanker, Scorer

log = logging.getLogger(__name__)

INSTALL_VIDORE = 'pip install -e ".[bm25-vidore]"'
NLTK_DATA = Path(__file__).with_name("nltk_data")
"""NLTK data shipped with the package: ``tokenizers/punkt_tab/english/`` and ``corpora/stopwords/english``."""
MRR_K = 10


@dataclass
class VidoreBM25Ranker(PageTextRanker):
    """ViDoRe's BM25 pipeline (config ``retriever=bm25_vidore``): NLTK tokens, rank_bm25's BM25Okapi over chunks, a
    page the fold of its chunks' scores, every page ranked (module docstring)."""

    name: str = "bm25_vidore"
    k1: float = 1.5
    b: float = 0.75
    epsilon: float = 0.25
    chunk_chars: int | None = None
    retrieve_zero: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.chunk_chars is not None and (isinstance(self.chunk_chars, bool) or not isinstance(
                self.chunk_chars, int) or self.chunk_chars < 1):
            raise ValueError(f"chunk_chars must be a whole number of characters >= 1, or null for one chunk per page; "
                             f"got {self.chunk_chars!r}")

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """ViDoRe's ``preprocess_text``: NLTK word tokens that are alphanumeric, lowercased, minus English stop
        words."""
        word_tokenize, stop_words = nltk_english()
        return [[word.lower() for word in word_tokenize(text) if word.isalnum() and word.lower() not in stop_words]
                for text in texts]

    def scorer(self, tokens: Sequence[list[str]]) -> Scorer:
        """BM25Okapi's scores of every text holding ``tokens`` (at least one has a token) for a tokenised query."""
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as error:
            raise ImportError(f"retriever=bm25_vidore needs rank_bm25: {INSTALL_VIDORE}") from error
        model = BM25Okapi([list(t) for t in tokens], k1=self.k1, b=self.b, epsilon=self.epsilon)
        return lambda query: model.get_scores(list(query))

    def page_scorer(self, corpus: Corpus, texts: Sequence[str]) -> Scorer | None:
        """BM25Okapi over the pages' chunks, a page scoring the fold of its chunks' scores (:func:`page_scores`)."""
        chunks, owners = chunk_pages(texts, self.chunk_chars)
        tokens = self.tokenize(chunks)
        tokenless = np.ones(len(texts), dtype=bool)
        tokenless[owners[[bool(t) for t in tokens]]] = False
        self.count_tokenless(corpus, "pages", tokenless.tolist(), texts)
        if not any(tokens):
            return None
        chunk_scorer = self.scorer(tokens)
        return lambda query: page_scores(chunk_scorer(query), owners, len(texts))

    def evaluated_queries(self, qa: Sequence[QAExample]) -> list[QAExample]:
        """ViDoRe's query set (module docstring): one query per distinct text."""
        return unique_queries(qa)

    def report_extras(self, run: dict, qa: Sequence[QAExample], corpus: Corpus) -> dict[str, float]:
        """The tokenless counts and ViDoRe's MRR@10 (ties in corpus order, :func:`corpus_order_mrr`)."""
        return {**super().report_extras(run, qa, corpus),
                f"vidore_mrr@{MRR_K}": corpus_order_mrr(run, qrels(qa), corpus.doc_ids, MRR_K)}


def chunk_pages(texts: Sequence[str], chunk_chars: int | None) -> tuple[list[str], np.ndarray]:
    """Every page's chunks in corpus order and, per chunk, the index of its page (module docstring, "Chunks")."""
    chunks: list[str] = []
    owners: list[int] = []
    for page, text in enumerate(texts):
        pieces = [text] if chunk_chars is None else pack_lines(text, chunk_chars)
        chunks.extend(pieces)
        owners.extend([page] * len(pieces))
    return chunks, np.asarray(owners, dtype=np.int64)


def pack_lines(text: str, chunk_chars: int) -> list[str]:
    """``text``'s non-blank lines packed in order into chunks of at most ``chunk_chars`` characters (joined by a
    line break; a longer line is a chunk alone); ``[""]`` for a blank text."""
    chunks: list[str] = []
    for line in (line.strip() for line in text.splitlines()):
        if not line:
            continue
        if chunks and len(chunks[-1]) + 1 + len(line) <= chunk_chars:
            chunks[-1] += "\n" + line
        else:
            chunks.append(line)
    return chunks or [""]


def page_scores(chunk_scores: np.ndarray, owners: np.ndarray, n_pages: int) -> np.ndarray:
    """Page scores from chunk scores as ViDoRe's evaluator folds them: the first chunk's page starts at that chunk's
    score, every other page at 0, and each later chunk raises its page to its score when higher."""
    chunk_scores = np.asarray(chunk_scores, dtype=np.float64)
    scores = np.zeros(n_pages)
    np.maximum.at(scores, owners, chunk_scores)
    first = owners[0]
    scores[first] = chunk_scores[owners == first].max()
    return scores


def unique_queries(qa: Sequence[QAExample]) -> list[QAExample]:
    """One query per distinct text (the retrieval instruction removed), in first-seen order: the first query's id
    and evidence label with the relevant pages of the last query of that text, as ViDoRe builds its qrels."""
    def text(ex: QAExample) -> str:
        return ex.query.removeprefix(QUERY_PREFIX)

    last = {text(ex): ex for ex in qa}
    first: dict[str, QAExample] = {}
    for ex in qa:
        first.setdefault(text(ex), ex)
    kept = [dataclasses.replace(ex, relevant_doc_ids=last[t].relevant_doc_ids) for t, ex in first.items()]
    if len(kept) < len(qa):
        log.info("bm25_vidore: %d repeated query texts removed (%d of %d queries kept), as ViDoRe does",
                 len(qa) - len(kept), len(kept), len(qa))
    return kept


def corpus_order_mrr(run: dict, judged: dict[str, dict[str, int]], doc_order: Sequence[str], k: int = MRR_K) -> float:
    """MTEB's MRR@k as ViDoRe computes it: each query's pages by score descending, tied pages in corpus order
    (``doc_order``), 1 / rank of the first relevant page within the top ``k`` (0 if none), averaged over the judged
    queries (a judged query the run lacks scores 0)."""
    position = {doc: i for i, doc in enumerate(doc_order)}
    total = 0.0
    for query, grades in judged.items():
        docs = run.get(query, {})
        top = sorted(docs, key=lambda d: (-float(docs[d]), position.get(d, len(position))))[:k]
        total += next((1 / rank for rank, d in enumerate(top, 1) if grades.get(d, 0) > 0), 0.0)
    return total / len(judged) if judged else 0.0


@functools.cache
def nltk_english() -> tuple[Callable[[str], list[str]], frozenset[str]]:
    """NLTK's ``word_tokenize`` (English Punkt sentences, then NLTK's Treebank word tokenizer on each) and English
    stop words, both read from :data:`NLTK_DATA` by NLTK's loaders. ImportError naming the extra without nltk."""
    try:
        import nltk.data
        from nltk.corpus.reader import WordListCorpusReader
        from nltk.tokenize import NLTKWordTokenizer
        from nltk.tokenize.punkt import PunktSentenceTokenizer, load_punkt_params
    except ImportError as error:
        raise ImportError(f"retriever=bm25_vidore needs nltk: {INSTALL_VIDORE}") from error
    nltk.data.path.insert(0, str(NLTK_DATA))  # NLTK reads data only from its search path; removed once read
    try:
        params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
        stop_words = frozenset(WordListCorpusReader(nltk.data.find("corpora/stopwords"), ["english"]).words("english"))
    finally:
        nltk.data.path.remove(str(NLTK_DATA))
    sentences, words = PunktSentenceTokenizer(params), NLTKWordTokenizer()

    def word_tokenize(text: str) -> list[str]:
        return [token for sentence in sentences.tokenize(text) for token in words.tokenize(sentence)]

    return word_tokenize, stop_words
