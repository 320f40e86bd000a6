"""RAG reports: hand-computed group numbers, failed queries, disabled judge, sweep (hkrag/rag/report.py)."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from hkrag.rag.evidence import NOT_FOUND
from hkrag.rag.records import ROUTES, CallRecord, QueryOutcome
from hkrag.rag.report import CLUSTERED, flat_metrics, query_rows, summarize, sweep_summary, write_reports
from hkrag.rag.trace import write_trace
from hkrag.stats import bootstrap_interval, cluster_bootstrap_interval, wilson_interval

PERFECT = {"anls": 1.0, "relaxed_accuracy": 1.0, "relaxed_correctness": 1.0, "exact_match": 1.0, "f1": 1.0}
WRONG = dict.fromkeys(PERFECT, 0.0)
JUDGE_COST = {"calls": 2, "prompt_tokens": 300, "completion_tokens": 20, "latency_s": 0.5, "cached_calls": 0}


def verdict(score, cost=JUDGE_COST):
    return {"score": score, "correct": score is not None and score >= 4, "raw": [f"Score: {score}"], "attempts": 1,
            "error": None if score else "LVLMHTTPError: 500", "status": "ok" if score else "backend_error",
            "rubric": "llamaindex", "cost": cost}


def outcome(qid, dataset="ChartQA", pool="single", *, route="LQP", score=5, metrics=PERFECT, failed=False,
            calls=1, wall=1.0, judged=True, uncertainty=None):
    return QueryOutcome(
        query_id=qid, question=f"question {qid}?", gold=["42"], dataset=dataset, pool=pool, route=route,
        answer="" if failed else "42", failed=failed, failure="max_calls=6 reached" if failed else None,
        calls=[CallRecord("judger", "p", [], prompt_tokens=100, completion_tokens=10) for _ in range(calls)],
        wall_s=wall, judge=verdict(score) if judged else None, metrics=metrics, uncertainty=uncertainty,
    )


def routes(**shares):
    """Every known route at 0 except ``shares``."""
    return {**dict.fromkeys(ROUTES, 0.0), **shares}


def chartqa_single():
    """4 queries: right; judged 3; failed (its stored verdict and metrics must be ignored); judge backend error."""
    return [
        outcome("q1", route="LQP", calls=3, wall=1.0),
        outcome("q2", route="HQP", score=3, calls=5, wall=2.0,
                metrics={"anls": 0.5, "relaxed_accuracy": 0.0, "relaxed_correctness": 0.0, "exact_match": 0.0,
                         "f1": 0.5}),
        outcome("q3", route="failed", failed=True, calls=6, wall=3.0),
        outcome("q4", route="HQP", score=None, calls=2, wall=4.0),
    ]


def test_group_numbers_by_hand():
    group = summarize(chartqa_single())["results"]["ChartQA"]["single"]
    assert group["n"] == 4
    accuracy = group["accuracy"]
    assert (accuracy["value"], accuracy["correct"], accuracy["judge_failed"]) == (0.25, 1, 1)
    assert accuracy["judge_failed_ids"] == ["q4"]
    assert accuracy["ci95"] == pytest.approx(list(wilson_interval(1, 4)), abs=1e-6)
    assert (group["questions"], group["ci_method"]) == (4, "per query")
    # failed q3 scores 0 although its record says 1: ANLS (1 + 0.5 + 0 + 1) / 4, relaxed (1 + 0 + 0 + 1) / 4
    assert group["metrics"] == {"anls": 0.625, "relaxed_accuracy": 0.5, "relaxed_correctness": 0.5,
                                "exact_match": 0.5, "f1": 0.625}
    assert group["ci95"]["relaxed_correctness"] == pytest.approx(list(wilson_interval(2, 4)), abs=1e-6)
    assert group["failed"] == 1
    assert group["failed_queries"] == [{"query_id": "q3", "reason": "max_calls=6 reached"}]
    assert group["routes"] == routes(LQP=0.25, HQP=0.5, failed=0.25)
    assert group["route_counts"] == {**dict.fromkeys(ROUTES, 0), "LQP": 1, "HQP": 2, "failed": 1}
    # judge cost apart from the generator's: 2 calls, 300 / 20 tokens, 0.5 s per verdict
    assert group["judge_cost"]["total"] == {"calls": 8.0, "prompt_tokens": 1200.0, "completion_tokens": 80.0,
                                            "latency_s": 2.0}
    assert group["judge_cost"]["per_query"]["prompt_tokens"] == 300.0 and group["judge_cost"]["unrecorded"] == 0
    # calls (3 + 5 + 6 + 2) / 4 = 4, tokens 4 * 100 and 4 * 10 per query; wall p50 = 2.5, p95 = 3 + 0.85 * 1
    assert group["cost"] == pytest.approx({"lvlm_calls": 4.0, "input_tokens": 400.0, "output_tokens": 40.0,
                                           "wall_s_p50": 2.5, "wall_s_p95": 3.85})


def test_groups_and_overall():
    outcomes = [*chartqa_single(), outcome("a1", pool="all"), outcome("i1", dataset="InfoVQA", score=2)]
    summary = summarize(outcomes)
    assert {ds: sorted(p) for ds, p in summary["results"].items()} == {"ChartQA": ["all", "single"],
                                                                        "InfoVQA": ["single"]}
    assert summary["overall"]["n"] == 6
    assert summary["overall"]["accuracy"]["value"] == pytest.approx(2 / 6)  # q1 and a1


def test_write_reports(tmp_path):
    outcomes = [*chartqa_single(), outcome("a1", pool="all", score=4), outcome("i1", dataset="InfoVQA", score=2)]
    meta = {"config": "hkrag-gen", "task": "rag", "retrieval": "retriever", "generator": "hkrag",
            "lvlm": {"backend": "phi3v", "model": "tiny"},
            "judge": {"backend": "openai", "model": "qwen-plus", "rubric": "llamaindex",
                      "rubric_version": "llama-index-core==0.14.25 sha256:0123456789ab"}}
    report = write_reports(tmp_path, outcomes, meta)
    assert json.loads((tmp_path / "rag.json").read_text()) == json.loads(json.dumps(report))
    markdown = (tmp_path / "rag.md").read_text()
    assert ("judge: openai `qwen-plus`, rubric llamaindex (llama-index-core==0.14.25 sha256:0123456789ab), "
            "correct ⇔ score ≥ 4") in markdown
    # Table 3 layout: the run's config is the row, data set x pool the columns; the average needs every data set
    header = "| Method | ChartQA Single | ChartQA All | InfoVQA Single | InfoVQA All | Avg. Single | Avg. All |"
    assert header in markdown
    assert "| hkrag-gen | 25.0 | 100.0 | 0.0 | – | 12.5 | – |" in markdown
    low, high = wilson_interval(1, 4)
    assert ("| Data set | Pool | n | Judged acc. [95% CI] | ANLS | Relaxed acc. (lenient) | Relaxed corr. (strict) "
            "| EM | F1 | Failed | Judge failed |") in markdown
    assert (f"| ChartQA | single | 4 | 25.0 [{100 * low:.1f}, {100 * high:.1f}] | 62.5 | 50.0 | 50.0 | 50.0 | 62.5 "
            "| 1 | 1 |") in markdown
    assert "## Relaxed correctness (strict, pix2struct)" in markdown and "## Relaxed accuracy (lenient)" in markdown
    assert "| ChartQA | single | 25.0 | 50.0 | 0.0 | 0.0 | 25.0 |" in markdown  # routes: LQP HQP single_pass ...
    assert "| ChartQA | single | 4.00 | 400 | 40 | 2.50 | 3.85 |" in markdown  # generator cost
    assert "| ChartQA | single | 2.00 | 300 | 20 | 0.50 | 8 | 2.0 |" in markdown  # judge cost, apart
    assert "- ChartQA/single: `q3` — max_calls=6 reached" in markdown
    assert "- ChartQA/single: `q4`" in markdown  # judge failures listed
    flat = flat_metrics(report)
    assert flat["rag/ChartQA/single/accuracy"] == 0.25
    assert flat["rag/overall/accuracy"] == pytest.approx(2 / 6)
    assert flat["rag/ChartQA/single/route_HQP"] == 0.5
    assert flat["rag/ChartQA/single/judge_calls"] == 2.0
    assert all(isinstance(v, float) for v in flat.values())


def test_disabled_judge_says_so(tmp_path):
    outcomes = [outcome("q1", judged=False), outcome("q2", judged=False, failed=True)]
    report = write_reports(tmp_path, outcomes, {"config": "baseline", "judge": None})
    markdown = (tmp_path / "rag.md").read_text()
    assert report["judge"] == "disabled (no endpoint)" and report["overall"]["accuracy"] is None
    assert "judge: disabled (no endpoint)" in markdown
    assert "Judged accuracy (" not in markdown and "| ChartQA | single | 2 | disabled |" in markdown
    assert "rag/overall/accuracy" not in flat_metrics(report)
    assert flat_metrics(report)["rag/overall/relaxed_accuracy"] == 0.5


def test_overall_interval_resamples_questions_not_pool_rows(tmp_path):
    """Single and all pools ask the same two questions: 4 rows but 2 samples.

    q1 is right in both pools, q2 wrong in both. Resampling the 2 questions gives an overall accuracy of
    0 (q2 twice, probability 1/4), 1/2 (1/2) or 1 (q1 twice, 1/4), so the 95 % percentile interval is
    [0, 1]; Wilson over 4 independent rows would claim [0.150, 0.850].
    """
    outcomes = [outcome(q, pool=pool, score=score, metrics=metrics)
                for pool in ("single", "all") for q, score, metrics in [("q1", 5, PERFECT), ("q2", 2, WRONG)]]
    report = write_reports(tmp_path, outcomes, {"config": "run"})
    for pool in ("single", "all"):
        group = report["results"]["ChartQA"][pool]
        assert group["ci_method"] == "per query"
        assert group["accuracy"]["ci95"] == pytest.approx(list(wilson_interval(1, 2)), abs=1e-6)
    overall = report["overall"]
    assert (overall["n"], overall["questions"], overall["ci_method"]) == (4, 2, CLUSTERED)
    assert overall["accuracy"]["value"] == 0.5
    assert overall["accuracy"]["ci95"] == [0.0, 1.0]
    assert overall["ci95"]["relaxed_correctness"] == [0.0, 1.0] and overall["ci95"]["anls"] == [0.0, 1.0]
    assert f"| overall |  | 2 | {CLUSTERED} | 50.0 [0.0, 100.0] |" in (tmp_path / "rag.md").read_text()


def test_uncertainty_histogram_and_route_shares_from_the_data(tmp_path):
    values = [0.0, 0.05, 0.1, 0.3, 0.79, 0.8, 0.95, 1.0, None, 1.2, math.nan]
    outcomes = [outcome(f"q{i}", uncertainty=h, route="HQP" if h is not None and h >= 0.8 else "LQP")
                for i, h in enumerate(values)]
    outcomes.append(outcome("q99", route="reranked", uncertainty=0.55))  # a route no constant names
    report = write_reports(tmp_path, outcomes, {"config": "run"})
    histogram = report["overall"]["uncertainty_histogram"]
    # [0, .1): 0, .05 | [.1, .2): .1 | [.3, .4): .3 | [.5, .6): .55 | [.7, .8): .79 | [.8, .9): .8 | [.9, 1]: .95, 1
    assert histogram["counts"] == [2, 1, 0, 1, 0, 1, 0, 1, 1, 2]
    assert (histogram["missing"], histogram["out_of_range"]) == (1, 2)
    assert histogram["edges"] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    n = len(outcomes)
    # HQP: .8, .95, 1, 1.2; LQP: the other seven (None and NaN compare below .8)
    assert report["overall"]["routes"] == pytest.approx(routes(LQP=7 / n, HQP=4 / n, reranked=1 / n))
    assert json.loads((tmp_path / "rag.json").read_text())["overall"]["uncertainty_histogram"] == histogram
    markdown = (tmp_path / "rag.md").read_text()
    assert "| Data set | Pool | LQP | HQP | single_pass | verify_only | failed | reranked |" in markdown
    assert ("| Data set | Pool | [0.0, 0.1) | [0.1, 0.2) | [0.2, 0.3) | [0.3, 0.4) | [0.4, 0.5) | [0.5, 0.6) "
            "| [0.6, 0.7) | [0.7, 0.8) | [0.8, 0.9) | [0.9, 1.0] | none | outside [0, 1] |") in markdown
    assert "| ChartQA | single | 2 | 1 | 0 | 1 | 0 | 1 | 0 | 1 | 1 | 2 | 1 | 2 |" in markdown
    assert flat_metrics(report)["rag/overall/uncertainty_bin9"] == 2.0


def grounded(qid, precision=0.0, recall=0.0, *, right=True, hit=False, wrong_page=False, drawn=True,
             failed=False, dataset="ChartQA", pool="single"):
    """An unjudged outcome with text evidence scored against a gold box (``drawn``), or no gold evidence."""
    result = outcome(qid, dataset, pool, metrics=PERFECT if right else WRONG, failed=failed, judged=False)
    found = bool(precision or hit or wrong_page)
    result.evidence = [{"page_id": f"{qid}-p2" if wrong_page else f"{qid}-p1", "box": [0.0, 0.0, 10.0, 10.0],
                        "source": "text", "score": 1.0}] if found else []
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    score = {"precision": precision, "recall": recall, "f1": f1, "hit": hit, "wrong_page": wrong_page}
    result.grounding = {"source": "text", "note": None if found else NOT_FOUND, "drawn": drawn,
                        "gold": [{"page_id": f"{qid}-p1", "box": [0.0, 0.0, 10.0, 20.0], "source": "gold",
                                  "score": 1.0}] if drawn else [],
                        "score": score if drawn else None}
    return result


def grounded_run():
    """ChartQA/single: g1 right and hit (P 1, R 1/2); g2 right, no hit (1/2, 1/2): right but ungrounded; g3 wrong
    and hit (1, 1): grounded but wrong; g4 wrong, its box on a wrong page (0, 0); g5 right, its answer drawn
    nowhere (not scored); g6 failed (its record says right: it scores 0). ChartQA/all: g1 again, hit (1, 1).
    InfoVQA/single: i1, i2 right and hit (1, 1)."""
    return [grounded("g1", 1.0, 0.5, hit=True), grounded("g2", 0.5, 0.5), grounded("g3", 1.0, 1.0, right=False,
                                                                                     hit=True),
            grounded("g4", right=False, wrong_page=True), grounded("g5", drawn=False),
            grounded("g6", failed=True), grounded("g1", 1.0, 1.0, hit=True, pool="all"),
            *(grounded(q, 1.0, 1.0, hit=True, dataset="InfoVQA") for q in ("i1", "i2"))]


def test_grounding_counts_shares_and_intervals_by_hand(tmp_path):
    report = write_reports(tmp_path, grounded_run(), {"config": "run"})
    single = report["results"]["ChartQA"]["single"]["grounding"]
    f1s = [2 / 3, 0.5, 1.0, 0.0, 0.0]  # g1 .. g4 and g6 scored; g5 not drawn
    assert {key: single[key] for key in ("source", "scored", "not_drawn", "no_evidence", "wrong_page",
                                         "right_ungrounded", "grounded_wrong")} == {
        "source": "text", "scored": 5, "not_drawn": 1, "no_evidence": 2, "wrong_page": 1, "right_ungrounded": 1,
        "grounded_wrong": 1}  # no evidence: g5, g6; right but ungrounded: g2; grounded but wrong: g3
    assert single["f1"]["value"] == pytest.approx(13 / 30)  # (2/3 + 1/2 + 1) / 5
    assert single["precision"]["value"] == pytest.approx(0.5) and single["recall"]["value"] == pytest.approx(0.4)
    assert single["hit"]["value"] == pytest.approx(0.4)
    assert single["hit"]["ci95"] == pytest.approx(list(wilson_interval(2, 5)), abs=1e-6)  # 2 hits of 5, Wilson
    assert single["f1"]["ci95"] == pytest.approx(list(bootstrap_interval(f1s)), abs=1e-6)
    low, high = single["f1"]["ci95"]
    assert 0 < low < 13 / 30 < high < 1
    info = report["results"]["InfoVQA"]["single"]["grounding"]
    assert info["f1"] == {"value": 1.0, "ci95": [1.0, 1.0]}  # every resample of two 1s is 1
    assert info["hit"]["ci95"] == pytest.approx(list(wilson_interval(2, 2)), abs=1e-6)
    assert (info["right_ungrounded"], info["grounded_wrong"], info["not_drawn"]) == (0, 0, 0)
    chart_all = report["results"]["ChartQA"]["all"]["grounding"]
    assert (chart_all["scored"], chart_all["f1"]["value"], chart_all["hit"]["value"]) == (1, 1.0, 1.0)
    overall = report["overall"]["grounding"]  # g1 twice (both pools): its question resampled, not its rows
    assert (overall["scored"], overall["not_drawn"], overall["right_ungrounded"], overall["grounded_wrong"],
            overall["wrong_page"]) == (8, 1, 1, 1, 1)
    scored = [*f1s[:4], f1s[4], 1.0, 1.0, 1.0]
    clusters = [("ChartQA", q) for q in ("g1", "g2", "g3", "g4", "g6", "g1")] + [("InfoVQA", "i1"), ("InfoVQA", "i2")]
    assert overall["f1"]["value"] == pytest.approx(sum(scored) / 8)
    assert overall["f1"]["ci95"] == pytest.approx(list(cluster_bootstrap_interval(scored, clusters)), abs=1e-6)
    assert overall["hit"]["ci95"] == pytest.approx(list(cluster_bootstrap_interval(
        [1, 0, 1, 0, 0, 1, 1, 1], clusters)), abs=1e-6)
    assert report["grounding_by_evidence"]["other"]["scored"] == 8  # "question g1?" is no built-in question
    markdown = (tmp_path / "rag.md").read_text()
    cells = " | ".join(f"{100 * v:.1f} [{100 * single[n]['ci95'][0]:.1f}, {100 * single[n]['ci95'][1]:.1f}]"
                       for n, v in (("f1", 13 / 30), ("precision", 0.5), ("recall", 0.4), ("hit", 0.4)))
    assert f"| ChartQA | single | 5 | {cells} | 1 | 1 | 1 | 2 | 1 |" in markdown


def test_rag_json_carries_each_query_s_evidence_and_the_counts_re_derive_from_it(tmp_path):
    outcomes = grounded_run()
    write_reports(tmp_path, outcomes, {"config": "run"})
    saved = json.loads((tmp_path / "rag.json").read_text())
    queries = saved["queries"]
    assert [(q["dataset"], q["pool"], q["query_id"]) for q in queries] == [(o.dataset, o.pool, o.query_id)
                                                                          for o in outcomes]
    g4 = queries[3]
    assert g4["evidence"] == [{"page_id": "g4-p2", "box": [0.0, 0.0, 10.0, 10.0], "source": "text", "score": 1.0}]
    assert g4["grounding"]["score"]["wrong_page"] is True and g4["evidence_type"] == "other"
    assert queries[4]["evidence"] == [] and queries[4]["grounding"]["drawn"] is False
    assert queries[5]["failed"] is True and queries[5]["relaxed_accuracy"] == 0.0  # as the report scores it
    single = [q for q in queries if (q["dataset"], q["pool"]) == ("ChartQA", "single")]
    scored = [q for q in single if q["grounding"]["score"]]
    hit = [q["grounding"]["score"]["hit"] for q in scored]
    right = [q["relaxed_accuracy"] == 1 for q in scored]
    group = saved["results"]["ChartQA"]["single"]["grounding"]
    assert sum(r and not h for r, h in zip(right, hit)) == group["right_ungrounded"]
    assert sum(h and not r for r, h in zip(right, hit)) == group["grounded_wrong"]
    assert sum(q["grounding"]["drawn"] is False for q in single) == group["not_drawn"]
    assert sum(q["grounding"]["score"]["f1"] for q in scored) / len(scored) == pytest.approx(group["f1"]["value"])

    columns, rows = query_rows(outcomes)
    table = [dict(zip(columns, row)) for row in rows]
    assert json.loads(table[3]["evidence"]) == g4["evidence"]
    assert (table[3]["answer_drawn"], table[3]["grounding_f1"], table[3]["grounding_hit"]) == (True, 0.0, False)
    assert (table[4]["evidence"], table[4]["grounding_note"], table[4]["answer_drawn"], table[4]["grounding_f1"]) \
        == ("[]", NOT_FOUND, False, None)
    ungrounded = query_rows(chartqa_single())[1][0]
    assert ungrounded[-5:] == [None] * 5  # a run that did not ground
    assert write_reports(tmp_path, chartqa_single(), {"config": "run"})["queries"][0]["grounding"] is None


def sweep_runs():
    """Three thresholds over the same 4 queries: a higher h routes fewer queries to the Decoupler (HQP)."""
    def run(hqp, correct):
        return [outcome(f"q{i}", route="HQP" if i < hqp else "LQP", score=5 if i < correct else 2,
                        calls=4 if i < hqp else 2, wall=1.0 + i) for i in range(4)]
    return {0.9: run(1, 2), 0.5: run(4, 3), 0.8: run(2, 3)}


def test_sweep_summary(tmp_path):
    result = sweep_summary(sweep_runs(), tmp_path)
    rows = result["rows"]
    assert [r["threshold"] for r in rows] == [0.5, 0.8, 0.9]
    assert [r["value"] for r in rows] == [0.75, 0.75, 0.5]
    assert [r["routes"]["HQP"] for r in rows] == [1.0, 0.5, 0.25]
    assert [r["cost"]["lvlm_calls"] for r in rows] == [4.0, 3.0, 2.5]
    assert "| 0.8 | 4 | 75.0 [" in result["table"]
    with Image.open(tmp_path / "sweep.png") as image:
        assert image.size == (1000, 400)
        assert np.asarray(image.convert("L")).std() > 10  # axes and lines drawn, not a blank canvas
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][1]["threshold"] == 0.8


def test_sweep_from_a_multirun_folder(tmp_path):
    for number, (threshold, outcomes) in enumerate(sweep_runs().items()):
        run_dir = tmp_path / str(number)
        write_trace(run_dir / "trace.jsonl", outcomes)
        (run_dir / "rag_config.json").write_text(json.dumps({"identity": {"generator": {"threshold": threshold}}}))
    result = sweep_summary(tmp_path)
    assert [r["threshold"] for r in result["rows"]] == [0.5, 0.8, 0.9]
    assert (tmp_path / "sweep.png").is_file() and (tmp_path / "sweep.md").is_file()
    with pytest.raises(ValueError, match="no 'generator.h'"):
        sweep_summary(tmp_path, threshold_key="generator.h")


def test_sweep_needs_the_same_queries():
    runs = sweep_runs()
    runs[0.9] = runs[0.9][:3]
    with pytest.raises(ValueError, match=r"h=\[0.9\]"):
        sweep_summary(runs)
