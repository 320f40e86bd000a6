"""BM25 over page text (hkrag/retrieval/bm25.py): bm25s's scores against the Lucene BM25 formula written out by
hand, ranking order and ties, tokenisation settings, pages without text, and text without tokens counted and warned
of in both BM25 rankers (and through the hybrid and region rankers that hold one)."""

import io
import logging
import math

import datasets
import pytest
from PIL import Image

from hkrag.data.opendocvqa import CORPUS_FEATURES, QUERY_PREFIX, Corpus, DataError, QAExample, format_query
from hkrag.retrieval.bm25 import BM25Ranker
from hkrag.retrieval.bm25_vidore import VidoreBM25Ranker

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


TOKENLESS = {  # text that tokenises to nothing, for each ranker
    "symbols": "§§ —— *** · • ¶",
    "hindi": "हिन्दी भाषा",  # vowel signs are not alphanumeric: no run of two word characters, no isalnum word
    "punctuation": "... ?! -- (( ))",
}


@pytest.mark.parametrize("ranker", [BM25Ranker(), VidoreBM25Ranker()], ids=["bm25", "bm25_vidore"])
def test_tokenless_pages_and_queries_are_counted_and_warned_of(ranker, caplog):
    pages = {**PAGES, **{f"x_{name}": text for name, text in TOKENLESS.items()}}
    corpus = corpus_of(pages)
    qa = queries("rainfall chart", *TOKENLESS.values(), "12.5 %")
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.bm25"):
        run = ranker.rank(qa, corpus, 10)
    pages_line, queries_line = (r.getMessage() for r in caplog.records)
    assert pages_line.startswith(f"{ranker.name} on toy: 3 of 7 pages have no token (0 blank; e.g. [('x_symbols',")
    assert pages_line.endswith("so they score 0 against every query")
    tokenless_queries = 4 if ranker.name == "bm25_vidore" else 3  # "12.5 %": bm25 keeps "12", ViDoRe drops "12.5"
    assert queries_line.startswith(f"{ranker.name} on toy: {tokenless_queries} of 5 queries have no token (0 blank")
    assert ranker.report_extras(run, qa, corpus) | {"vidore_mrr@10": 0} == {
        "pages_without_tokens": 3, "queries_without_tokens": tokenless_queries, "vidore_mrr@10": 0}
    assert all(run[f"q{i}"][d] == 0 for i in (1, 2, 3) for d in run[f"q{i}"])  # every page 0 (bm25: none at all)
    assert all(run["q0"].get(d, 0) == 0 for d in pages if d.startswith("x_"))


def test_no_warning_and_no_report_entry_when_every_text_has_a_token(caplog):
    ranker = BM25Ranker()
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.bm25"):
        run = ranker.rank(queries("rainfall"), corpus_of(PAGES), 10)
    assert caplog.records == [] and ranker.report_extras(run, queries("rainfall"), corpus_of(PAGES)) == {}


def test_blank_pages_allowed_are_counted_as_blank(caplog):
    pages = {**PAGES, "blank": " ", "none": None}
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.bm25"):
        BM25Ranker(allow_empty=True).rank(queries("rainfall"), corpus_of(pages), 10)
    assert [r.getMessage() for r in caplog.records] == [
        "bm25 on toy: 2 of 6 pages have no token (2 blank; e.g. [('blank', ' '), ('none', '')]), so they score 0 "
        "against every query"]


def test_the_hybrid_ranker_warns_through_its_bm25(caplog):
    from hkrag.retrieval.fusion import HybridRanker

    class Dense:
        name = "dense"

        def rank(self, qa, corpus, depth, corpus_key="corpus"):
            return {ex.query_id: {corpus.doc_ids[0]: 1.0} for ex in qa}

    corpus = corpus_of({**PAGES, "x": TOKENLESS["symbols"]})
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.bm25"):
        HybridRanker(dense=Dense(), lexical=BM25Ranker()).rank(queries("§§"), corpus, 5, "all")
    assert [r.getMessage()[:44] for r in caplog.records] == ["bm25 on toy: 1 of 5 pages have no token (0 b",
                                                             "bm25 on toy: 1 of 1 queries have no token (0"]


def test_the_region_ranker_warns_through_its_bm25_of_tokenless_units(caplog):
    from hkrag.data.region_corpus import PAGE_COLUMN
    from hkrag.retrieval.regions import RegionRanker

    units = corpus_of({"p1#0": "Rainfall chart", "p1#1": TOKENLESS["symbols"], "p2#0": TOKENLESS["hindi"]})
    units = Corpus(units.dataset.add_column(PAGE_COLUMN, ["p1", "p1", "p2"]), name="units")
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.bm25"):
        run = RegionRanker(inner=BM25Ranker()).rank(queries("rainfall", "—"), units, 5, "all")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["bm25 on units: 2 of 3 pages have no token",
                                                                       "bm25 on units: 1 of 2 queries have no token"]
    assert list(run["q0"]) == ["p1"] and run["q1"] == {}
