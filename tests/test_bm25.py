"""BM25 over page text (hkrag/retrieval/bm25.py): bm25s's scores against the Lucene BM25 formula written out by
hand, ranking order and ties, tokenisation settings, and pages without text."""

import io
import math

import datasets
import pytest
from PIL import Image

from hkrag.data.opendocvqa import CORPUS_FEATURES, QUERY_PREFIX, Corpus, DataError, QAExample, format_query
from hkrag.retrieval.bm25 import BM25Ranker, VidoreBM25Ranker

PAGES = {
    "d1": "Rainfall chart: rainfall",  # tokens: rainfall chart rainfall
    "d2": "Sales chart",  # sales chart
    "d3": "RAINFALL / REF R4",  # rainfall ref r4
    "d4": "Profit table 2019 a",  # profit table 2019 ("a": one letter, not a token)
}
TOKENS = {"d1": ["rainfall", "chart", "rainfall"], "d2": ["sales", "chart"], "d3": ["rainfall", "ref", "r4"],
          "d4": ["profit", "table", "2019"]}


def corpus_of(texts: dict[str, str | None], column: str = "text") -> Corpus:
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(png, format="PNG")
    rows = {"doc_id": list(texts), "image": [{"bytes": png.getvalue(), "path": None}] * len(texts),
            column: list(texts.values())}
    features = datasets.Features({**CORPUS_FEATURES, column: datasets.Value("string")})
    return Corpus(datasets.Dataset.from_dict(rows, features=features), name="toy")


def queries(*texts: str) -> list[QAExample]:
    return [QAExample(f"q{i}", text, ("x",), ("d1",)) for i, text in enumerate(texts)]


def lucene_bm25(query: list[str], docs: dict[str, list[str]], k1: float = 1.5, b: float = 0.75) -> dict[str, float]:
    """Lucene BM25 (bm25s's default), by the formula:

    score(q, d) = sum over t in q of idf(t) * tf / (tf + k1 (1 - b + b |d| / avgdl)),
    idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)).
    """
    n, avgdl = len(docs), sum(map(len, docs.values())) / len(docs)
    scores = {}
    for doc_id, doc in docs.items():
        total = 0.0
        for term in query:
            df, tf = sum(term in d for d in docs.values()), doc.count(term)
            if tf:
                total += math.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        scores[doc_id] = total
    return {d: s for d, s in scores.items() if s > 0}


def test_scores_equal_the_lucene_formula():
    run = BM25Ranker().rank(queries("rainfall chart", "REF R4?"), corpus_of(PAGES), depth=10)
    assert run["q0"] == pytest.approx(lucene_bm25(["rainfall", "chart"], TOKENS), rel=1e-6)
    assert run["q1"] == pytest.approx(lucene_bm25(["ref", "r4"], TOKENS), rel=1e-6)
    # by hand: N = 4, avgdl = 11/4, df(rainfall) = df(chart) = 2 -> idf = ln 2; d1 has tf(rainfall) = 2, |d1| = 3
    norm = 1.5 * (0.25 + 0.75 * 3 / 2.75)
    assert run["q0"]["d1"] == pytest.approx(math.log(2) * (2 / (2 + norm) + 1 / (1 + norm)), rel=1e-6)
    assert list(run["q0"]) == ["d1", "d2", "d3"]  # best first (d2 is shorter than d3); d4 has no query token


def test_k1_b_and_query_repeats_follow_the_formula():
    ranker = BM25Ranker(k1=0.9, b=0.4)
    run = ranker.rank(queries("chart chart"), corpus_of(PAGES), depth=10)
    assert run["q0"] == pytest.approx(lucene_bm25(["chart", "chart"], TOKENS, k1=0.9, b=0.4), rel=1e-6)


def test_the_depth_cut_keeps_every_page_tied_at_it():
    pages = {"a": "fine print", "c": "fine print", "b": "fine print", "z": "other words", "y": "fine print words"}
    run = BM25Ranker().rank(queries("fine"), corpus_of(pages), depth=2)
    assert list(run["q0"]) == ["c", "b", "a"]  # a, b, c tie at the 2nd score: all three kept, none chosen by name
    deeper = BM25Ranker().rank(queries("fine"), corpus_of(pages), depth=4)["q0"]
    assert list(deeper) == ["c", "b", "a", "y"] and len({deeper[d] for d in "abc"}) == 1 and deeper["y"] < deeper["a"]
    assert BM25Ranker().rank(queries("nothing here"), corpus_of(pages), depth=2) == {"q0": {}}


def test_the_retrieval_instruction_is_not_part_of_the_query():
    pages = {**PAGES, "d5": "an image that answers the question"}
    ranker = BM25Ranker()
    assert ranker.rank(queries(format_query("rainfall")), corpus_of(pages), 10) == \
        ranker.rank(queries("rainfall"), corpus_of(pages), 10)
    assert QUERY_PREFIX.startswith("Instruct")


def test_tokenisation_settings():
    assert BM25Ranker().tokenize(["The REF R4, p.3"]) == [["the", "ref", "r4"]]
    assert BM25Ranker(stopwords="en").tokenize(["The REF R4"]) == [["ref", "r4"]]
    assert BM25Ranker(stopwords=["ref"], lower=False).tokenize(["The REF ref"]) == [["The", "REF"]]
    assert BM25Ranker(token_pattern=r"(?u)\b\w+\b").tokenize(["p.3"]) == [["p", "3"]]
    with pytest.raises(ValueError, match=r"method='bm26': expected one of \['lucene'"):
        BM25Ranker(method="bm26")


def test_a_page_without_text_is_named_unless_allowed():
    pages = {**PAGES, "blank": "  ", "none": None}
    with pytest.raises(DataError, match=r"toy: page 'blank' has no text in column 'text' \(and 1 more: \['none'\]\)"):
        BM25Ranker().rank(queries("rainfall"), corpus_of(pages), 10)
    run = BM25Ranker(allow_empty=True).rank(queries("rainfall"), corpus_of(pages), 10)
    assert run["q0"] == pytest.approx(lucene_bm25(["rainfall"], {**TOKENS, "blank": [], "none": []}), rel=1e-6)




def test_a_corpus_without_any_token_returns_nothing_for_every_query():
    pages = {"blank": "", "none": None, "short": " x ", "spaces": "   "}  # "x": one letter, not a token
    with pytest.raises(DataError, match="toy: page 'blank' has no text"):
        BM25Ranker().rank(queries("rainfall"), corpus_of(pages), 10)
    ranker = BM25Ranker(allow_empty=True)
    assert ranker.rank(queries("rainfall", "x", ""), corpus_of(pages), 10) == {"q0": {}, "q1": {}, "q2": {}}
    assert list(ranker.index(corpus_of(pages)).scores(["rainfall"])) == [0.0] * 4


def test_text_comes_from_the_configured_column():
    corpus = corpus_of(PAGES, column="ocr_text")
    with pytest.raises(DataError, match=r"toy has no 'text' column .*python -m hkrag.data.ocr"):
        BM25Ranker().rank(queries("rainfall"), corpus, 10)
    assert list(BM25Ranker(text_column="ocr_text").rank(queries("sales"), corpus, 10)["q0"]) == ["d2"]


def test_vidore_tokens_by_hand():
    text = "The RAINFALL chart, sourced from OSCAR. REF R4 P.3: Dr. Smith's 3.5% rise? It's U.S.-made"
    # word_tokenize: The RAINFALL chart , sourced from OSCAR . REF R4 P.3 : Dr. Smith 's 3.5 % rise ? It 's U.S.-made
    # kept if alphanumeric (not "P.3", "Dr.", "'s", "3.5", "U.S.-made"), lowercased, minus NLTK's English stop words
    # ("the", "from", "it"); Punkt ends the sentence after "OSCAR", so "OSCAR" loses its period and stays
    assert VidoreBM25Ranker().tokenize([text]) == [["rainfall", "chart", "sourced", "oscar", "ref", "r4", "smith",
                                                    "rise"]]
    assert VidoreBM25Ranker().tokenize(["Is this it?", ""]) == [[], []]  # stop words only; nothing


def okapi_bm25(query, docs, k1=1.5, b=0.75, epsilon=0.25):
    """rank_bm25's BM25Okapi by its formula: idf(t) = ln((N - df + 0.5) / (df + 0.5)), an idf below 0 replaced by
    epsilon x the mean idf over the corpus's terms; score = sum over t in q of idf(t) tf (k1 + 1) / (tf + k1 (1 - b +
    b |d| / avgdl))."""
    n, avgdl = len(docs), sum(map(len, docs.values())) / len(docs)
    terms = {t for d in docs.values() for t in d}
    idf = {t: math.log((n - (df := sum(t in d for d in docs.values())) + 0.5) / (df + 0.5)) for t in terms}
    floor = epsilon * sum(idf.values()) / len(idf)
    idf = {t: floor if v < 0 else v for t, v in idf.items()}
    return {doc_id: sum(idf.get(t, 0.0) * doc.count(t) * (k1 + 1) / (doc.count(t) + k1 * (1 - b + b * len(doc) /
                                                                                          avgdl)) for t in query)
            for doc_id, doc in docs.items()}


def test_vidore_scores_equal_bm25okapi_and_rank_every_page():
    pages = {**PAGES, "d5": "Rainfall"}
    tokens = {"d1": ["rainfall", "chart", "rainfall"], "d2": ["sales", "chart"], "d3": ["rainfall", "ref", "r4"],
              "d4": ["profit", "table", "2019"], "d5": ["rainfall"]}  # "a" is a stop word
    assert VidoreBM25Ranker().tokenize(list(pages.values())) == list(tokens.values())
    run = VidoreBM25Ranker().rank(queries("Rainfall chart?"), corpus_of(pages), depth=10)["q0"]
    expected = okapi_bm25(["rainfall", "chart"], tokens)
    assert run == pytest.approx(expected, rel=1e-9)
    assert expected["d1"] > 0 and expected["d4"] == 0.0 and "d4" in run  # a page scoring 0 is ranked, as in ViDoRe
    # df(rainfall) = 3 of N = 5: idf = ln(2.5 / 3.5) < 0, replaced by 0.25 x the mean idf (> 0 here)
    rainfall = VidoreBM25Ranker().rank(queries("rainfall"), corpus_of(pages), depth=10)["q0"]
    mean_idf = (6 * math.log(4.5 / 1.5) + math.log(3.5 / 2.5) + math.log(2.5 / 3.5)) / 8  # 6 terms in 1 page, chart 2
    assert rainfall["d5"] == pytest.approx(0.25 * mean_idf * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 1 / 2.4)), rel=1e-9)
    blank = VidoreBM25Ranker(allow_empty=True).rank(queries("rainfall"), corpus_of({"a": "", "b": "the"}), 1)
    assert blank == {"q0": {"b": 0.0, "a": 0.0}}  # no page has a token: every page ties at 0
