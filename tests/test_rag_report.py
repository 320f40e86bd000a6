"""RAG reports: hand-computed group numbers, failed queries, disabled judge, sweep (hkrag/rag/report.py)."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from hkrag.rag.records import ROUTES, CallRecord, QueryOutcome
from hkrag.rag.report import CLUSTERED, flat_metrics, summarize, sweep_summary, write_reports
from hkrag.rag.trace import write_trace
from hkrag.stats import wilson_interval

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
