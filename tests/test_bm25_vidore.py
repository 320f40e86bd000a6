"""ViDoRe's v1 BM25 pipeline (hkrag/retrieval/bm25_vidore.py) against what vidore-benchmark's code does on small
hand-made examples: its tokens (NLTK from the shipped data), BM25Okapi over chunks with N, df and avgdl counting
chunks, its evaluator's fold of chunk scores into page scores (``max(results.get(page, 0), score)`` after the first
row), repeated query texts evaluated once with the last one's page, and MTEB's MRR with ties in corpus order."""

import math

import nltk
import numpy as np
import pytest
import pytrec_eval
from _eval_config import tiny_eval_config
from test_bm25 import PAGES, corpus_of, queries

from hkrag.data.opendocvqa import QAExample, format_query
from hkrag.retrieval.bm25_vidore import (
    NLTK_DATA,
    VidoreBM25Ranker,
    corpus_order_mrr,
    nltk_english,
    pack_lines,
    page_scores,
)
from hkrag.retrieval.evaluation import RetrievalEvalConfig, evaluate_ranker

rank_bm25 = pytest.importorskip("rank_bm25")


def reference_page_scores(chunk_scores, filenames):
    """vidore-benchmark's ``ViDoReEvaluatorQA._get_relevant_docs_results`` for one query, restated: the first row
    sets ``{filename: score}``, every later row ``results[f] = max(results.get(f, 0), score)``."""
    results = {}
    for i, (filename, score) in enumerate(zip(filenames, chunk_scores)):
        results = {filename: float(score)} if i == 0 else {**results, filename: max(results.get(filename, 0),
                                                                                      float(score))}
    return results


def reference_run(chunks, filenames, query_tokens):
    """The reference's page scores for a tokenised query: BM25Okapi (defaults) over the chunk rows, then the fold."""
    model = rank_bm25.BM25Okapi([VidoreBM25Ranker().tokenize([c])[0] for c in chunks])
    return reference_page_scores(model.get_scores(query_tokens), filenames)


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


def test_vidore_tokens_by_hand():
    text = "The RAINFALL chart, sourced from OSCAR. REF R4 P.3: Dr. Smith's 3.5% rise? It's U.S.-made"
    # word_tokenize: The RAINFALL chart , sourced from OSCAR . REF R4 P.3 : Dr. Smith 's 3.5 % rise ? It 's U.S.-made
    # kept if alphanumeric (not "P.3", "Dr.", "'s", "3.5", "U.S.-made"), lowercased, minus NLTK's English stop words
    # ("the", "from", "it"); Punkt ends the sentence after "OSCAR", so "OSCAR" loses its period and stays
    assert VidoreBM25Ranker().tokenize([text]) == [["rainfall", "chart", "sourced", "oscar", "ref", "r4", "smith",
                                                    "rise"]]
    assert VidoreBM25Ranker().tokenize(["Is this it?", ""]) == [[], []]  # stop words only; nothing


TEXTS = ["The RAINFALL chart, sourced from OSCAR. REF R4 P.3: Dr. Smith's 3.5% rise? It's U.S.-made",
         'He said "no." Then: (a) x; Mr. Brown left at 5 p.m. on Jan. 3rd... ok!', "e-mail: a@b.com https://x.org/y?z=1",
         "Привет, мир. 中文 文本", "§§ —— ***", "line one\nline two. Line three"]


def test_nltk_data_is_the_shipped_copy_read_by_nltk(monkeypatch):
    word_tokenize, stop_words = nltk_english()
    assert NLTK_DATA.parent.name == "retrieval" and (NLTK_DATA / "NOTICE").is_file()
    assert str(NLTK_DATA) not in nltk.data.path  # NLTK's search path is left as it was
    monkeypatch.setattr(nltk.data, "path", [str(NLTK_DATA)])  # NLTK itself, given only the shipped folder
    from nltk.corpus import stopwords

    assert [word_tokenize(t) for t in TEXTS] == [nltk.word_tokenize(t) for t in TEXTS]
    assert stop_words == frozenset(stopwords.words("english")) and len(stop_words) == 198


def test_scores_equal_bm25okapi_and_every_page_is_ranked():
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


def test_lines_are_packed_into_chunks():
    assert pack_lines("rainfall chart\nsales table\n\n  x  \n", 15) == ["rainfall chart", "sales table\nx"]
    assert pack_lines("a very long line indeed\nb", 5) == ["a very long line indeed", "b"]  # a long line alone
    assert pack_lines(" \n", 5) == [""] and pack_lines("a\nb\nc", 100) == ["a\nb\nc"]


CHUNKED = {"p0": "rainfall chart\nsales table", "p1": "rainfall rainfall rainfall", "p2": "profit summary\nrainfall"}


def test_a_page_scores_the_max_of_its_chunks_and_n_df_avgdl_count_chunks():
    ranker = VidoreBM25Ranker(chunk_chars=15)
    chunks = ["rainfall chart", "sales table", "rainfall rainfall rainfall", "profit summary", "rainfall"]
    filenames = ["p0", "p0", "p1", "p2", "p2"]
    for query in ("sales", "rainfall chart", "profit rainfall", "table summary"):
        tokens = ranker.tokenize([query])[0]
        run = ranker.rank(queries(query), corpus_of(CHUNKED), 10)["q0"]
        assert run == pytest.approx(reference_run(chunks, filenames, tokens), rel=1e-12)
    # by hand: N = 5 chunks, avgdl = (2 + 2 + 3 + 2 + 1) / 5 = 2, df(sales) = 1: idf = ln(4.5 / 1.5);
    # "sales table" has |c| = avgdl, so its tf part is 1 x 2.5 / (1 + 1.5) = 1
    sales = ranker.rank(queries("sales"), corpus_of(CHUNKED), 10)["q0"]
    assert sales == pytest.approx({"p0": math.log(3), "p1": 0.0, "p2": 0.0}, rel=1e-12)
    whole = VidoreBM25Ranker().rank(queries("sales"), corpus_of(CHUNKED), 10)["q0"]  # one chunk a page: N = 3
    assert whole["p0"] != pytest.approx(math.log(3))


def test_a_negative_score_survives_only_on_the_first_chunks_page():
    # N = 2, df(alpha) = 2: idf = ln(0.5 / 2.5) = -ln 5; beta, gamma: ln(1.5 / 1.5) = 0; the mean idf is -ln 5 / 3,
    # so alpha's idf becomes 0.25 x that; both chunks have |c| = avgdl: tf part 1. Page p0 holds the first chunk
    # and keeps its negative score; p1 enters as max(0, score) = 0, so it ranks above p0, as in ViDoRe's evaluator
    run = VidoreBM25Ranker().rank(queries("alpha"), corpus_of({"p0": "alpha beta", "p1": "alpha gamma"}), 10)["q0"]
    assert run == pytest.approx({"p1": 0.0, "p0": -math.log(5) / 12}, rel=1e-12) and list(run) == ["p1", "p0"]
    assert run == pytest.approx(reference_run(["alpha beta", "alpha gamma"], ["p0", "p1"], ["alpha"]))
    scores, owners = np.array([-1.0, -2.0, -3.0, 0.5, -0.5]), np.array([0, 0, 1, 2, 1])
    assert list(page_scores(scores, owners, 3)) == [-1.0, 0.0, 0.5]
    assert reference_page_scores(scores, ["p0", "p0", "p1", "p2", "p1"]) == {"p0": -1.0, "p1": 0.0, "p2": 0.5}


def example(query_id, text, *relevant):
    return QAExample(query_id, text, ("x",), relevant, "fine_print" if query_id == "q0" else None)


def test_repeated_query_texts_are_evaluated_once_with_the_last_ones_page():
    qa = [example("q0", "What is X?", "d1"), example("q1", "other", "d2"), example("q2", format_query("What is X?"),
                                                                                   "d3")]
    kept = VidoreBM25Ranker().evaluated_queries(qa)
    assert [(ex.query_id, ex.query, ex.relevant_doc_ids, ex.evidence) for ex in kept] == [
        ("q0", "What is X?", ("d3",), "fine_print"), ("q1", "other", ("d2",), None)]
    assert VidoreBM25Ranker().evaluated_queries(qa[:2]) == qa[:2]


TIED = {"a": "fine print", "b": "fine print", "c": "fine print", "d": "other words", "e": "more text",
        "f": "some table", "g": "last page"}


def test_the_evaluation_dedupes_queries_and_reports_mrr_with_ties_in_corpus_order(tmp_path):
    qa = [example("q0", "fine", "a"), example("q1", "words", "d"), example("q2", "fine", "c")]
    cfg = RetrievalEvalConfig("qa", "corpus", ["toy"], pools=("single",))
    report = evaluate_ranker(VidoreBM25Ranker(), cfg, tmp_path, lambda *a: qa, lambda *a: corpus_of(TIED))
    result = report["results"]["toy"]["single"]
    assert result["num_queries"] == 2 and list(report["per_query"]["toy"]["single"]) == ["q0", "q1"]
    # q0 (relevant: c, the last "fine" query's page) ties a, b, c at one positive score (df 3 of N = 7):
    # corpus order puts c 3rd (ViDoRe's MTEB MRR 1/3), doc id descending 1st (trec_eval 1), E[] = (1 + 1/2 + 1/3) / 3
    assert result["all"]["vidore_mrr@10"] == pytest.approx((1 / 3 + 1) / 2)
    assert result["all"]["mrr@10"] == pytest.approx(1.0)
    assert result["all"]["E[mrr@10]"] == pytest.approx((11 / 18 + 1) / 2)
    # ViDoRe's nDCG@5: pytrec_eval over its full results (every page, scores folded from BM25Okapi's) = ndcg@5 here
    full = {q: reference_run(list(TIED.values()), list(TIED), VidoreBM25Ranker().tokenize([text])[0])
            for q, text in (("q0", "fine"), ("q1", "words"))}
    ndcg = pytrec_eval.RelevanceEvaluator({"q0": {"c": 1}, "q1": {"d": 1}}, {"ndcg_cut.5"}).evaluate(full)
    assert result["all"]["ndcg@5"] == pytest.approx(np.mean([v["ndcg_cut_5"] for v in ndcg.values()]))
    assert corpus_order_mrr({"q": {"c": 1.0, "a": 1.0}}, {"q": {"c": 1}}, ["a", "c"]) == 0.5
    assert corpus_order_mrr({}, {"q": {"c": 1}}, ["c"]) == 0.0  # a judged query without a run scores 0


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "10"])
def test_chunk_size_is_a_positive_whole_number_or_null(value):
    with pytest.raises(ValueError, match=rf"chunk_chars must be a whole number of characters >= 1, or null for one "
                                         rf"chunk per page; got {value!r}"):
        VidoreBM25Ranker(chunk_chars=value)


@pytest.mark.parametrize("override, message", [
    ("retriever.chunk_chars=0", r"retriever.chunk_chars=0: expected an integer >= 1 or null"),
    ("retriever.epsilon=-1", r"retriever.epsilon=-1: expected a number >= 0"),
])
def test_the_config_validator_refuses_bad_settings_before_any_work(tmp_path, override, message):
    from hkrag.tasks.retrieval import run_retrieval_evaluation

    with pytest.raises(ValueError, match=message):
        run_retrieval_evaluation(tiny_eval_config(tmp_path, "o", "retriever=bm25_vidore", override, n_train=8),
                                 tmp_path / "o")
    assert not (tmp_path / "data").exists()
