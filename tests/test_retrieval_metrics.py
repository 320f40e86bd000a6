"""Retrieval metrics agree with trec_eval and with hand-computed values."""

import itertools
import logging
import math
import random
import statistics

import pytest
import pytrec_eval

from hkrag.retrieval.metrics import (
    check_qrels,
    cut_with_ties,
    evaluate_run,
    format_table,
    load_qrels,
    qrels_from_rows,
    tie_groups,
    trec_order,
    truncate,
)

MEASURES = {"ndcg_cut.5": "ndcg@5", "recall.1": "recall@1", "recall.5": "recall@5", "recall.10": "recall@10"}


def random_case(seed, queries=40, docs=30):
    rng = random.Random(seed)
    pool = [f"doc{i}" for i in range(docs)]
    qrels = {f"q{q}": {d: 1 for d in rng.sample(pool, rng.randint(1, 4))} for q in range(queries)}
    # Scores on a coarse grid so many ties, in a shuffled dict order.
    run = {q: {d: rng.randint(0, 5) / 5 for d in rng.sample(pool, rng.randint(1, 25))} for q in qrels}
    return run, qrels


@pytest.mark.parametrize("seed", range(5))
def test_matches_pytrec_eval_on_random_runs_with_ties(seed):
    run, qrels = random_case(seed)
    ours = evaluate_run(run, qrels)["per_query"]
    reference = pytrec_eval.RelevanceEvaluator(qrels, set(MEASURES)).evaluate(run)
    for q, values in reference.items():
        for key, value in values.items():
            assert ours[q][MEASURES[key.replace("_cut_", "_cut.").replace("recall_", "recall.")]] == pytest.approx(
                value, abs=1e-9
            )


@pytest.mark.parametrize("seed", range(5))
def test_mrr10_matches_an_independent_trec_ordered_computation(seed):
    run, qrels = random_case(seed)
    ours = evaluate_run(run, qrels)["per_query"]
    for q, docs in run.items():
        by_id = sorted(docs, reverse=True)  # stable two-pass sort: score desc, then doc id desc
        ranked = sorted(by_id, key=lambda d: -docs[d])[:10]
        rank = next((i for i, d in enumerate(ranked, 1) if d in qrels[q]), None)
        assert ours[q]["mrr@10"] == pytest.approx(1 / rank if rank else 0.0, abs=1e-12)


def test_hand_computed_example():
    qrels = {"q": {"a": 1, "c": 1, "z": 1}}
    # Ranking a, b, c, d, e, f: relevant at ranks 1 and 3; "z" is never retrieved.
    run = {"q": {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.6, "e": 0.5, "f": 0.4}}
    m = evaluate_run(run, qrels)["mean"]
    dcg = 1 / math.log2(2) + 1 / math.log2(4)
    ideal = 1 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert m["ndcg@5"] == pytest.approx(dcg / ideal, abs=1e-12)  # 0.7039180890341347
    assert m["ndcg@5"] == pytest.approx(0.7039180890341347, abs=1e-12)
    assert (m["recall@1"], m["recall@5"], m["recall@10"]) == pytest.approx((1 / 3, 2 / 3, 2 / 3))
    assert m["mrr@10"] == 1.0


def test_ties_break_by_doc_id_descending():
    qrels = {"q": {"b": 1}}
    m = evaluate_run({"q": {"a": 1.0, "b": 1.0, "c": 1.0}}, qrels)["mean"]
    assert trec_order({"a": 1.0, "b": 1.0, "c": 1.0}) == ["c", "b", "a"]
    assert m["mrr@10"] == 0.5 and m["recall@1"] == 0.0
    assert m["ndcg@5"] == pytest.approx(1 / math.log2(3))


def test_mrr_is_cut_at_ten():
    run = {"q": {f"d{i:02d}": 1 - i / 100 for i in range(15)}}
    assert evaluate_run(run, {"q": {"d10": 1}})["mean"]["mrr@10"] == 0.0
    assert evaluate_run(run, {"q": {"d09": 1}})["mean"]["mrr@10"] == pytest.approx(0.1)
    assert list(truncate(run, 3)["q"]) == ["d00", "d01", "d02"]


def test_missing_and_unjudged_queries(caplog):
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 0}}
    run = {"q1": {"a": 1.0}, "q9": {"a": 1.0}}
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.metrics"):
        result = evaluate_run(run, qrels)
    assert result["num_queries"] == 2 and result["unjudged"] == ["q9"] and result["no_run"] == ["q2"]
    assert result["per_query"]["q2"] == {
        "ndcg@5": 0.0,
        "recall@1": 0.0,
        "recall@5": 0.0,
        "recall@10": 0.0,
        "mrr@10": 0.0,
    }
    assert result["mean"]["ndcg@5"] == 0.5  # the failed query counts as zero, never dropped
    assert "1 run queries are not in qrels" in caplog.text
    assert "1 judged queries have no retrieved documents" in caplog.text
    assert "1 queries have no relevant document" in caplog.text
    with pytest.raises(ValueError, match="no query with a relevant document"):
        evaluate_run(run, {"q": {"a": 0}})


def test_check_qrels_counts_absent_documents(caplog):
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.metrics"):
        missing = check_qrels({"q1": {"a": 1, "x": 1}, "q2": {"y": 1}}, ["a", "b"])
    assert missing == [("q1", "x"), ("q2", "y")]
    assert "2 judged document(s) of 2 queries are absent" in caplog.text


def test_qrels_readers(tmp_path):
    rows = [{"query_id": 7, "relevant_doc_ids": ["a", "b"]}]
    assert qrels_from_rows(rows) == {"7": {"a": 1, "b": 1}}
    (tmp_path / "q.txt").write_text("7 0 a 1\n7 0 b 1\n\n8 0 c 2\n")
    assert load_qrels(tmp_path / "q.txt") == {"7": {"a": 1, "b": 1}, "8": {"c": 2}}
    (tmp_path / "q.json").write_text('{"7": {"a": 1}}')
    assert load_qrels(tmp_path / "q.json") == {"7": {"a": 1}}
    (tmp_path / "bad.txt").write_text("7 a 1\n")
    with pytest.raises(ValueError, match="bad.txt:1: expected"):
        load_qrels(tmp_path / "bad.txt")


def test_format_table_like_table_2():
    results = {
        "HKRAG": {"ChartQA": {"single": 0.876, "all": 0.821}, "SlideVQA": {"single": 0.762, "all": 0.725}},
        "BM25": {"ChartQA": {"single": 0.548}},
    }
    table = format_table(results).splitlines()
    assert table[0] == (
        "| Method | ChartQA Single | ChartQA All | SlideVQA Single | SlideVQA All | Avg. Single | Avg. All |"
    )
    assert table[1] == "|---|---|---|---|---|---|---|"
    assert table[2] == "| HKRAG | 87.6 | 82.1 | 76.2 | 72.5 | 81.9 | 77.3 |"
    assert table[3] == "| BM25 | 54.8 | – | – | – | – | – |"


EXPECTED = {"ks": (1, 3, 5), "ndcg_ks": (3, 5), "mrr_k": 3}


def test_tie_aware_metrics_by_hand():
    # a first; b, c, d, e tied at positions 2-5 (c and e relevant); f, g tied at 6-7 (g relevant); z never retrieved
    run = {"q": {"a": 3.0, "b": 2.0, "c": 2.0, "d": 2.0, "e": 2.0, "f": 1.0, "g": 1.0}}
    qrels = {"q": {"c": 1, "e": 1, "g": 1, "z": 1}}
    m = evaluate_run(run, qrels, ties="expected", **EXPECTED)["mean"]
    ideal3 = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    ideal5 = ideal3 + 1 / math.log2(5)
    # each of c, e holds each of the positions 2..5 with probability 1/4: mean gain 2/4 per position
    assert m["ndcg@3"] == pytest.approx(2 / 4 * (1 / math.log2(3) + 1 / math.log2(4)) / ideal3, abs=1e-12)
    assert m["ndcg@5"] == pytest.approx(2 / 4 * sum(1 / math.log2(p + 1) for p in range(2, 6)) / ideal5, abs=1e-12)
    assert (m["recall@1"], m["recall@3"], m["recall@5"]) == pytest.approx((0.0, 2 * 2 / 4 / 4, 2 / 4))
    # first relevant of the group (r = 2 of t = 4) is its 1st with P = C(3,1)/C(4,2) = 1/2, 2nd with 1/3 (rank 3)
    assert m["mrr@3"] == pytest.approx(1 / 2 * 1 / 2 + 1 / 3 * 1 / 3, abs=1e-12)
    # trec_eval's order puts e, d, c, b: e at 2 and c at 4
    trec = evaluate_run(run, qrels, **EXPECTED)["mean"]
    assert trec["mrr@3"] == 0.5 and trec["ndcg@3"] == pytest.approx(1 / math.log2(3) / ideal3)


@pytest.mark.parametrize("seed", range(4))
def test_tie_aware_metrics_are_the_mean_over_every_order_of_the_ties(seed):
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(8)]
    run = {"q": {d: rng.randint(0, 2) for d in docs}}  # 3 scores over 8 pages: large tie groups
    qrels = {"q": {d: rng.randint(1, 2) for d in rng.sample(docs, 3)} | {"absent": 1}}  # graded, one never retrieved
    groups = tie_groups(run["q"])
    orders = [sum(perms, []) for perms in itertools.product(*(map(list, itertools.permutations(g)) for g in groups))]
    ranked = [evaluate_run({"q": {d: -i for i, d in enumerate(order)}}, qrels, **EXPECTED)["mean"] for order in orders]
    expected = evaluate_run(run, qrels, ties="expected", **EXPECTED)["mean"]
    assert expected == pytest.approx({k: statistics.mean(r[k] for r in ranked) for k in expected}, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_tie_aware_metrics_ignore_doc_ids_and_equal_trec_eval_without_ties(seed):
    run, qrels = random_case(seed)
    rng = random.Random(seed)
    names = {d: f"x{rng.random()}" for d in {d for docs in [*run.values(), *qrels.values()] for d in docs}}
    renamed_run = {q: {names[d]: s for d, s in docs.items()} for q, docs in run.items()}
    renamed_qrels = {q: {names[d]: g for d, g in docs.items()} for q, docs in qrels.items()}
    ours = evaluate_run(run, qrels, ties="expected")["per_query"]
    assert ours == evaluate_run(renamed_run, renamed_qrels, ties="expected")["per_query"]
    assert evaluate_run(run, qrels)["per_query"] != evaluate_run(renamed_run, renamed_qrels)["per_query"]  # trec moves
    distinct = {q: {d: docs[d] + i * 1e-6 for i, d in enumerate(docs)} for q, docs in run.items()}  # no ties left
    expected, trec = (evaluate_run(distinct, qrels, ties=t)["per_query"] for t in ("expected", "trec"))
    assert expected == {q: pytest.approx(v, abs=1e-12) for q, v in trec.items()}
    with pytest.raises(ValueError, match=r"ties='random': expected one of \['trec', 'expected'\]"):
        evaluate_run(run, qrels, ties="random")


def test_cut_with_ties_keeps_the_group_at_the_cut():
    run = {"q": {"a": 3.0, "b": 2.0, "c": 2.0, "d": 2.0, "e": 1.0}, "short": {"a": 1.0}}
    assert cut_with_ties(run, 2) == {"q": {"a": 3.0, "d": 2.0, "c": 2.0, "b": 2.0}, "short": {"a": 1.0}}
    assert list(cut_with_ties(run, 4)["q"]) == ["a", "d", "c", "b"] and len(cut_with_ties(run, 5)["q"]) == 5
    assert tie_groups(run["q"]) == [["a"], ["d", "c", "b"], ["e"]]
