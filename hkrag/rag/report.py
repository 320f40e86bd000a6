"""RAG reports from a run's trace: ``rag.json``, ``rag.md`` and the threshold-sweep summary (paper §4, Tables 3/4/6).

Everything is computed from :class:`~hkrag.rag.records.QueryOutcome` records alone (a trace reproduces every
number). Per data set and pool, and overall:

* judged accuracy (share of queries the LLM judge scored ≥ 4) with its 95 % interval, or "disabled" when
  no judge ran; judge failures (backend errors, unparseable replies) count as wrong;
* the rule metrics of :mod:`hkrag.rag.metrics` (means with 95 % intervals), the lenient
  ``relaxed_accuracy`` and the strict ``relaxed_correctness`` side by side;
* the share of queries per route (every route name in ``hkrag.rag.records.ROUTES`` and any other the data holds);
* the histogram of the Judger's uncertainty H′ (:data:`UNCERTAINTY_BINS` bins on [0, 1]);
* generator cost per query: LVLM calls and input/output tokens (means), wall time (p50 / p95), as in Fig. 4;
  and the judge's cost (calls, tokens, latency) apart from it.

**Intervals count each question once.** A group where every question appears once (one pool of one data
set) gets Wilson intervals for 0/1 metrics and a percentile bootstrap for means. A group holding the same
question more than once (``overall`` pools single and all: two evaluations of the same questions, not two
samples) resamples whole questions, clustered by (data set, query id): :func:`hkrag.stats.cluster_bootstrap_interval`.

**Failed queries are in every denominator** and score 0 on every metric, whatever their recorded
answer or verdict; their ids and reasons are listed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hkrag.data.synthetic import question_kind
from hkrag.environment import describe
from hkrag.io import png_bytes, read_json, write_bytes, write_json, write_text
from hkrag.rag.metrics import METRICS
from hkrag.rag.records import ROUTES, QueryOutcome
from hkrag.rag.trace import MERGED_FILE, load_trace, outcome_key
from hkrag.retrieval.metrics import format_table, table_rows
from hkrag.stats import bootstrap_interval, cluster_bootstrap_interval, wilson_interval

JUDGE_DISABLED = "disabled (no endpoint)"
REPORT_FILE, MARKDOWN_FILE = "rag.json", "rag.md"
"""A RAG run's report, as data and as text (:func:`write_reports`)."""
RUN_CONFIG_FILE = "rag_config.json"
"""The settings a RAG run saves beside its trace (``hkrag/tasks/rag.py``), read by :func:`load_sweep`."""
PAPER_THRESHOLD = 0.8
"""The paper's Judger threshold h (§4), marked on the sweep plot: a label, not the setting's default, which
lives in conf/generator/hkrag.yaml."""
TABLE_METRICS = {"accuracy": "Judged accuracy", "relaxed_accuracy": "Relaxed accuracy (lenient)",
                 "relaxed_correctness": "Relaxed correctness (strict, pix2struct)", "anls": "ANLS"}
METRIC_HEADERS = {"anls": "ANLS", "relaxed_accuracy": "Relaxed acc. (lenient)",
                  "relaxed_correctness": "Relaxed corr. (strict)", "exact_match": "EM", "f1": "F1"}
BINARY_METRICS = ("relaxed_accuracy", "relaxed_correctness", "exact_match")
"""Rule metrics that are 0 or 1 per query (Wilson intervals); the others are means (bootstrap)."""
UNCERTAINTY_BINS = 10
JUDGE_COST_KEYS = ("calls", "prompt_tokens", "completion_tokens", "latency_s")
CLUSTERED = "cluster bootstrap over questions (data set, query id)"


def is_correct(outcome: QueryOutcome) -> bool:
    """The judge's verdict; a failed query or a missing / failed verdict is wrong."""
    return not outcome.failed and bool(outcome.judge and outcome.judge.get("correct"))


def metric_value(outcome: QueryOutcome, name: str) -> float:
    """A rule metric of one query; 0 for a failed query. A metric the record lacks (a trace written before
    the metric existed) is computed from the record's answer and gold answers."""
    if outcome.failed:
        return 0.0
    if outcome.metrics and name in outcome.metrics:
        return float(outcome.metrics[name])
    return METRICS[name](outcome.answer, outcome.gold)


def judge_failed(outcome: QueryOutcome) -> bool:
    """No valid verdict for an answered query (backend error, unparseable reply, or never judged)."""
    return not outcome.failed and (outcome.judge is None or outcome.judge.get("score") is None)


def _interval(low: float, high: float) -> list[float]:
    return [round(low, 6), round(high, 6)]


def question_key(outcome: QueryOutcome) -> tuple[str, str]:
    """The question an outcome answers: one cluster of the intervals, whatever pool it was asked in."""
    return outcome.dataset, outcome.query_id


def interval_method(outcomes: Sequence[QueryOutcome]) -> str:
    """``"per query"`` when every question appears once in the group, else :data:`CLUSTERED`."""
    return "per query" if len({question_key(o) for o in outcomes}) == len(outcomes) else CLUSTERED


def interval95(values: Sequence[float], outcomes: Sequence[QueryOutcome], binary: bool) -> list[float]:
    """95 % interval of the mean of per-query ``values`` that counts each question once (module docstring)."""
    if interval_method(outcomes) == CLUSTERED:
        return _interval(*cluster_bootstrap_interval(values, [question_key(o) for o in outcomes]))
    if binary:
        return _interval(*wilson_interval(int(round(sum(values))), len(values)))
    return _interval(*bootstrap_interval(values))


def route_names(outcomes: Sequence[QueryOutcome]) -> list[str]:
    """``hkrag.rag.records.ROUTES`` in order, then any other route the outcomes took (read from the data)."""
    return list(dict.fromkeys([*ROUTES, *(o.route for o in outcomes)]))


def uncertainty_histogram(outcomes: Sequence[QueryOutcome], bins: int = UNCERTAINTY_BINS) -> dict[str, Any]:
    """Counts of the Judger's H′ in ``bins`` equal bins on [0, 1]: bin k holds k/bins ≤ H′ < (k+1)/bins, the
    last also H′ = 1 (so with h = 0.8 the bins from 0.8 up are the queries routed to HQP). Queries without
    H′ (failed before the Judger, single-pass baselines) are ``missing``; values outside [0, 1] (or NaN) are
    ``out_of_range``, never clipped into a bin."""
    counts, missing, out_of_range = [0] * bins, 0, 0
    for outcome in outcomes:
        value = outcome.uncertainty
        if value is None:
            missing += 1
        elif not 0 <= value <= 1:
            out_of_range += 1
        else:
            counts[min(int(round(value * bins, 9)), bins - 1)] += 1
    return {"edges": [round(k / bins, 6) for k in range(bins + 1)], "counts": counts, "missing": missing,
            "out_of_range": out_of_range}


def judge_cost(outcomes: Sequence[QueryOutcome]) -> dict[str, Any]:
    """The judge's calls, prompt / completion tokens and latency (``verdict["cost"]``): totals and per-query means.

    ``unrecorded`` counts verdicts without a cost (traces written before costs were recorded; they add 0).
    """
    costs = [(o.judge or {}).get("cost") or {} for o in outcomes]
    total = {key: float(sum(cost.get(key, 0) for cost in costs)) for key in JUDGE_COST_KEYS}
    return {"per_query": {key: value / len(outcomes) for key, value in total.items()}, "total": total,
            "unrecorded": sum(not cost for cost in costs)}


def grounding_group(outcomes: Sequence[QueryOutcome]) -> dict[str, Any] | None:
    """Grounding of a group (``None`` when the run did not ground): over the questions with drawn gold evidence,
    mean pixel F1 / precision / recall and the share of IoU hits with 95 % intervals, evidence on a wrong page;
    answers right but ungrounded and grounded (a hit) but wrong, counted apart; questions with no drawn evidence."""
    grounded = [o for o in outcomes if o.grounding]
    if not grounded:
        return None
    scored = [o for o in grounded if o.grounding.get("score")]
    group: dict[str, Any] = {"source": grounded[0].grounding["source"], "scored": len(scored),
                             "not_drawn": sum(o.grounding.get("drawn") is False for o in grounded),
                             "no_evidence": sum(not o.evidence for o in grounded)}
    if not scored:
        return group
    for name, binary in (("f1", False), ("precision", False), ("recall", False), ("hit", True)):
        values = [float(o.grounding["score"][name]) for o in scored]
        group[name] = {"value": float(np.mean(values)), "ci95": interval95(values, scored, binary=binary)}
    right = [bool(metric_value(o, "relaxed_accuracy")) for o in scored]
    hits = [bool(o.grounding["score"]["hit"]) for o in scored]
    group["wrong_page"] = sum(bool(o.grounding["score"]["wrong_page"]) for o in scored)
    group["right_ungrounded"] = sum(r and not h for r, h in zip(right, hits))
    group["grounded_wrong"] = sum(h and not r for r, h in zip(right, hits))
    return group


def summarize_group(outcomes: Sequence[QueryOutcome]) -> dict[str, Any]:
    """Accuracy, rule metrics, routes, H′ histogram and costs of a group of queries (see the module docstring)."""
    if not outcomes:
        raise ValueError("cannot summarise an empty group of queries")
    n = len(outcomes)
    judged = any(o.judge is not None for o in outcomes)
    summary: dict[str, Any] = {"n": n, "questions": len({question_key(o) for o in outcomes}),
                               "ci_method": interval_method(outcomes), "accuracy": None, "judge_cost": None}
    if judged:
        verdicts = [float(is_correct(o)) for o in outcomes]
        unjudged = [o.query_id for o in outcomes if judge_failed(o)]
        summary["accuracy"] = {"value": sum(verdicts) / n, "ci95": interval95(verdicts, outcomes, binary=True),
                               "correct": int(sum(verdicts)), "judge_failed": len(unjudged),
                               "judge_failed_ids": unjudged}
        summary["judge_cost"] = judge_cost(outcomes)
    values = {name: [metric_value(o, name) for o in outcomes] for name in METRICS}
    summary["metrics"] = {name: float(np.mean(v)) for name, v in values.items()}
    summary["ci95"] = {name: interval95(v, outcomes, binary=name in BINARY_METRICS) for name, v in values.items()}
    failed = [o for o in outcomes if o.failed]
    summary["failed"] = len(failed)
    summary["failed_queries"] = [{"query_id": o.query_id, "reason": o.failure or "unknown"} for o in failed]
    counts = {route: sum(o.route == route for o in outcomes) for route in route_names(outcomes)}
    summary["route_counts"] = counts
    summary["routes"] = {route: count / n for route, count in counts.items()}
    summary["uncertainty_histogram"] = uncertainty_histogram(outcomes)
    summary["grounding"] = grounding_group(outcomes)
    walls = [o.wall_s for o in outcomes]
    summary["cost"] = {
        "lvlm_calls": float(np.mean([o.num_calls for o in outcomes])),
        "input_tokens": float(np.mean([o.prompt_tokens for o in outcomes])),
        "output_tokens": float(np.mean([o.completion_tokens for o in outcomes])),
        "wall_s_p50": float(np.percentile(walls, 50)),
        "wall_s_p95": float(np.percentile(walls, 95)),
    }
    return summary


def summarize(outcomes: Sequence[QueryOutcome]) -> dict[str, Any]:
    """``{"results": {dataset: {pool: group}}, "overall": group, "judged": bool}`` (see :func:`summarize_group`)."""
    groups: dict[tuple[str, str], list[QueryOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault((outcome.dataset, outcome.pool), []).append(outcome)
    results: dict[str, dict[str, Any]] = {}
    for (dataset, pool), members in groups.items():
        results.setdefault(dataset, {})[pool] = summarize_group(members)
    return {"results": results, "overall": summarize_group(outcomes),
            "judged": any(o.judge is not None for o in outcomes),
            "grounding_by_evidence": grounding_by_evidence(outcomes)}


def evidence_type(outcome: QueryOutcome) -> str:
    """The evidence type of a built-in question (``salient``, ``fine_print``), ``other`` for any other question."""
    kind = question_kind(outcome.question)
    return kind[0] if kind else "other"


def grounding_by_evidence(outcomes: Sequence[QueryOutcome]) -> dict[str, Any]:
    """:func:`grounding_group` per evidence type (:func:`evidence_type`), every pool together; empty when the run
    did not ground."""
    groups: dict[str, list[QueryOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault(evidence_type(outcome), []).append(outcome)
    found = {kind: grounding_group(members) for kind, members in sorted(groups.items())}
    return {kind: group for kind, group in found.items() if group}


def headline(group: Mapping[str, Any], metric: str) -> float | None:
    """The value of a table metric in a group: judged accuracy, or a rule metric's mean."""
    if metric == "accuracy":
        return group["accuracy"]["value"] if group["accuracy"] else None
    return group["metrics"][metric]


def cells(by_pool: Mapping[str, Mapping[str, Any]], metric: str) -> dict[str, float]:
    values = {pool: headline(group, metric) for pool, group in by_pool.items()}
    return {pool: value for pool, value in values.items() if value is not None}


def comparison_table(summaries: Mapping[str, Mapping[str, Any]], metric: str = "accuracy") -> str:
    """The paper's Table 3/4/6 layout: one row per configuration, columns data set × pool (× 100)."""
    rows, pools = comparison_grid(summaries, metric)
    return format_table(rows, pools=pools)


def comparison_rows(summaries: Mapping[str, Mapping[str, Any]], metric: str = "accuracy") -> tuple[list, list]:
    """:func:`comparison_table`'s header and rows (× 100, unrounded): its W&B table."""
    rows, pools = comparison_grid(summaries, metric)
    return table_rows(rows, pools=pools)


def comparison_grid(summaries: Mapping[str, Mapping[str, Any]], metric: str) -> tuple[dict[str, Any], list[str]]:
    """``{configuration: {data set: {pool: value}}}`` of ``metric`` and the pools seen, in order."""
    rows = {config: {ds: cells(by_pool, metric) for ds, by_pool in summary["results"].items()}
            for config, summary in summaries.items()}
    pools = dict.fromkeys(p for s in summaries.values() for by_pool in s["results"].values() for p in by_pool)
    return rows, list(pools)


def layout_metrics(report: Mapping[str, Any]) -> list[str]:
    """The metrics a report's Table 3/4/6 layouts show: :data:`TABLE_METRICS`, judged accuracy only when judged."""
    return [metric for metric in TABLE_METRICS if metric != "accuracy" or report["judged"]]


QUERY_COLUMNS = ("dataset", "pool", "query_id", "question", "gold", "answer", "route", "uncertainty", "iterations",
                 "failed", "failure", "judge_score", "correct", *METRICS, "lvlm_calls", "input_tokens",
                 "output_tokens", "wall_s", "evidence", "grounding_note", "answer_drawn", "grounding_f1",
                 "grounding_hit")
"""The per-query table of a RAG run (:func:`query_rows`)."""


def _grounding_cells(outcome: QueryOutcome) -> list[Any]:
    """``evidence`` (the boxes as JSON text), the grounding note, whether the answer is drawn, the F1 and the hit;
    all ``None`` when the run did not ground, the last three when the question has no gold evidence."""
    if not outcome.grounding:
        return [None] * 5
    score = outcome.grounding.get("score") or {}
    return [json.dumps(outcome.evidence), outcome.grounding.get("note"), outcome.grounding.get("drawn"),
            score.get("f1"), score.get("hit")]


def query_rows(outcomes: Sequence[QueryOutcome]) -> tuple[list[str], list[list[Any]]]:
    """One row per query of the trace, with the values the report averages (a failed query scores 0 and is
    wrong, as in every denominator; ``judge_score`` is ``None`` when unjudged, ``correct`` when no query was) and
    its evidence (:func:`_grounding_cells`)."""
    judged = any(o.judge is not None for o in outcomes)
    return list(QUERY_COLUMNS), [
        [o.dataset, o.pool, o.query_id, o.question, " | ".join(o.gold), o.answer, o.route, o.uncertainty,
         o.iterations, o.failed, o.failure, (o.judge or {}).get("score"), is_correct(o) if judged else None,
         *(metric_value(o, name) for name in METRICS), o.num_calls, o.prompt_tokens, o.completion_tokens, o.wall_s,
         *_grounding_cells(o)]
        for o in outcomes]


def query_record(outcome: QueryOutcome) -> dict[str, Any]:
    """One query as ``rag.json``'s ``queries`` keeps it: enough to re-derive every grounding count of the report
    (:func:`grounding_group`) and to see each answer's boxes without the trace. ``relaxed_accuracy`` is the score
    the report uses (0 for a failed query); ``evidence`` is ``[]`` and ``grounding`` ``None`` when the run did not
    ground."""
    return {"dataset": outcome.dataset, "pool": outcome.pool, "query_id": outcome.query_id,
            "evidence_type": evidence_type(outcome), "answer": outcome.answer, "failed": outcome.failed,
            "relaxed_accuracy": metric_value(outcome, "relaxed_accuracy"), "evidence": outcome.evidence,
            "grounding": outcome.grounding}


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _ci_cell(value: float, ci95: Sequence[float]) -> str:
    return f"{_pct(value)} [{_pct(ci95[0])}, {_pct(ci95[1])}]"


def _accuracy_cell(group: Mapping[str, Any]) -> str:
    accuracy = group["accuracy"]
    return "disabled" if accuracy is None else _ci_cell(accuracy["value"], accuracy["ci95"])


def _group_rows(summary: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    rows = [(ds, pool, group) for ds, by_pool in summary["results"].items() for pool, group in by_pool.items()]
    return [*rows, ("overall", "", summary["overall"])]


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def table_routes(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """The route columns of several groups: every route any of them holds, in first-seen order."""
    return list(dict.fromkeys(route for group in groups for route in group["routes"]))


def bin_labels(edges: Sequence[float]) -> list[str]:
    """``[0.0, 0.1)`` … ``[0.9, 1.0]``: the last bin is closed."""
    labels = [f"[{low:.1f}, {high:.1f})" for low, high in zip(edges[:-1], edges[1:])]
    return [*labels[:-1], labels[-1][:-1] + "]"]


def judge_line(judge: Any) -> str:
    if judge == JUDGE_DISABLED:
        return f"judge: {JUDGE_DISABLED}"
    return (f"judge: {judge.get('backend')} `{judge.get('model')}`, rubric {judge.get('rubric')} "
            f"({judge.get('rubric_version', 'version not recorded')}), correct ⇔ score ≥ 4")


def _metric_sections(report: Mapping[str, Any], rows: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """The Table-3 layouts, the per-group metrics and their intervals."""
    parts = [f"## {TABLE_METRICS[metric]} (×100; rows = configurations, as in Tables 3, 4 and 6)\n\n"
             + comparison_table({report["config"]: report}, metric) for metric in layout_metrics(report)]
    parts.append("## Per data set and pool\n\n" + _markdown_table(
        ["Data set", "Pool", "n", "Judged acc. [95% CI]", *METRIC_HEADERS.values(), "Failed", "Judge failed"],
        [[ds, pool, str(g["n"]), _accuracy_cell(g), *(_pct(g["metrics"][m]) for m in METRIC_HEADERS),
          str(g["failed"]), str(g["accuracy"]["judge_failed"]) if g["accuracy"] else "–"] for ds, pool, g in rows]))
    parts.append("## 95% intervals\n\nEach question counts once: a group holding a question twice (overall: "
                 "the single and all pools) resamples questions.\n\n" + _markdown_table(
                     ["Data set", "Pool", "Questions", "Interval", *METRIC_HEADERS.values()],
                     [[ds, pool, str(g["questions"]), g["ci_method"],
                       *(_ci_cell(g["metrics"][m], g["ci95"][m]) for m in METRIC_HEADERS)] for ds, pool, g in rows]))
    return parts


def _calibration_sections(rows: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """Route shares and the Judger's H′ histogram per group."""
    routes = table_routes([g for _, _, g in rows])
    labels = bin_labels(rows[-1][2]["uncertainty_histogram"]["edges"])
    return [
        "## Routes (share of queries, %)\n\n" + _markdown_table(
            ["Data set", "Pool", *routes], [[ds, pool, *(_pct(g["routes"].get(r, 0.0)) for r in routes)]
                                            for ds, pool, g in rows]),
        "## Judger uncertainty H′ (queries per bin)\n\n" + _markdown_table(
            ["Data set", "Pool", *labels, "none", "outside [0, 1]"],
            [[ds, pool, *map(str, h["counts"]), str(h["missing"]), str(h["out_of_range"])]
             for ds, pool, g in rows for h in [g["uncertainty_histogram"]]]),
    ]


def _grounding_cell(group: Mapping[str, Any], name: str) -> str:
    return _ci_cell(group[name]["value"], group[name]["ci95"]) if name in group else "–"


def _grounding_section(rows: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """The grounding table (hkrag/rag/evidence.py), when the run grounded its answers."""
    rows = [(ds, pool, g["grounding"]) for ds, pool, g in rows if g.get("grounding")]
    if not rows:
        return []
    return [f"## Grounding ({rows[-1][2]['source']} source; pixel-level, ×100 [95% CI])\n\n"
            "Over the questions whose answer is drawn on a gold page; evidence on another page scores 0. A hit: the "
            "best box has IoU ≥ 0.5 with a gold box. Right but ungrounded / grounded but wrong: relaxed accuracy "
            "against the hit.\n\n" + _markdown_table(
                ["Data set", "Pool", "Scored", "F1", "Precision", "Recall", "IoU ≥ 0.5", "Wrong page",
                 "Right, ungrounded", "Grounded, wrong", "No evidence", "Answer not drawn"],
                [[ds, pool, str(g["scored"]), *(_grounding_cell(g, n) for n in ("f1", "precision", "recall", "hit")),
                  *(str(g.get(n, "–")) for n in ("wrong_page", "right_ungrounded", "grounded_wrong")),
                  str(g["no_evidence"]), str(g["not_drawn"])] for ds, pool, g in rows])]


def _cost_sections(report: Mapping[str, Any], rows: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """Generator cost per query, and the judge's apart from it."""
    parts = ["## Cost per query (generator)\n\n" + _markdown_table(
        ["Data set", "Pool", "LVLM calls", "Input tokens", "Output tokens", "Wall p50 (s)", "Wall p95 (s)"],
        [[ds, pool, f"{c['lvlm_calls']:.2f}", f"{c['input_tokens']:.0f}", f"{c['output_tokens']:.0f}",
          f"{c['wall_s_p50']:.2f}", f"{c['wall_s_p95']:.2f}"] for ds, pool, g in rows for c in [g["cost"]]])]
    if report["judged"]:
        parts.append("## Judge cost (apart from the generator's)\n\n" + _markdown_table(
            ["Data set", "Pool", "Judge calls / query", "Judge input tok. / query", "Judge output tok. / query",
             "Judge latency / query (s)", "Judge calls (total)", "Judge latency (total, s)"],
            [[ds, pool, f"{q['calls']:.2f}", f"{q['prompt_tokens']:.0f}", f"{q['completion_tokens']:.0f}",
              f"{q['latency_s']:.2f}", f"{t['calls']:.0f}", f"{t['latency_s']:.1f}"]
             for ds, pool, g in rows for q, t in [(g["judge_cost"]["per_query"], g["judge_cost"]["total"])]]))
    return parts


def render_markdown(report: Mapping[str, Any]) -> str:
    """``rag.md``: the run, its judge, Table-3 layouts, metrics with intervals, routes, H′, costs and failures."""
    meta = report["meta"]
    lvlm = meta.get("lvlm") or {}
    rows = _group_rows(report)
    parts = [
        f"# RAG evaluation: {report['config']}",
        "\n".join([f"- task: {meta.get('task', '?')}, retrieval: {meta.get('retrieval', '?')}, "
                   f"generator: {meta.get('generator', '?')}",
                   f"- LVLM: {lvlm.get('backend', '?')} `{lvlm.get('model', '?')}`",
                   *([f"- machine: {describe(meta['environment'])}"] if meta.get("environment") else []),
                   f"- {judge_line(report['judge'])}",
                   f"- queries: {report['overall']['n']}, failed: {report['overall']['failed']} "
                   "(failed queries count as wrong in every metric)"]),
        *_metric_sections(report, rows),
        *_grounding_section([*rows, *((f"evidence: {kind}", "all pools", {"grounding": group})
                                      for kind, group in (report.get("grounding_by_evidence") or {}).items())]),
        *_calibration_sections(rows),
        *_cost_sections(report, rows),
    ]
    failures = [f"- {ds}/{pool}: `{f['query_id']}` — {f['reason']}" for ds, pool, g in rows[:-1]
                for f in g["failed_queries"]]
    unjudged = [f"- {ds}/{pool}: " + ", ".join(f"`{q}`" for q in g["accuracy"]["judge_failed_ids"])
                for ds, pool, g in rows[:-1] if g["accuracy"] and g["accuracy"]["judge_failed_ids"]]
    parts.append("## Failed queries\n\n" + ("\n".join(failures) or "none"))
    if report["judged"]:
        parts.append("## Judge failures (counted wrong)\n\n" + ("\n".join(unjudged) or "none"))
    return "\n\n".join(parts) + "\n"


def build_report(outcomes: Sequence[QueryOutcome], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The content of ``rag.json``: the run's ``meta``, its judge (or "disabled"), :func:`summarize` and
    ``queries``, one :func:`query_record` a query in the trace's order (absent from reports written before it)."""
    return {"config": meta.get("config", "run"), "meta": dict(meta), "judge": meta.get("judge") or JUDGE_DISABLED,
            **summarize(outcomes), "queries": [query_record(o) for o in outcomes]}


def write_reports(out_dir: str | Path, outcomes: Sequence[QueryOutcome], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``rag.json`` and ``rag.md`` into ``out_dir`` (atomically); returns the report dict.

    ``meta``: ``config`` (the row name in the tables), ``task``, ``retrieval``, ``generator``,
    ``lvlm`` (``{"backend", "model"}``) and ``judge`` (:meth:`hkrag.rag.grader.Grader.describe` or ``None``).
    """
    report = build_report(outcomes, meta)
    out_dir = Path(out_dir)
    write_json(out_dir / REPORT_FILE, report)
    write_text(out_dir / MARKDOWN_FILE, render_markdown(report))
    return report


def flat_metrics(report: Mapping[str, Any], prefix: str = "rag") -> dict[str, float]:
    """Scalars for W&B: ``rag/<dataset>/<pool>/<metric>`` and ``rag/overall/<metric>`` (judged accuracy when judged)."""
    flat: dict[str, float] = {}
    for ds, pool, group in _group_rows(report):
        key = f"{prefix}/{ds}/{pool}".rstrip("/")
        if group["accuracy"]:
            flat[f"{key}/accuracy"] = group["accuracy"]["value"]
            flat[f"{key}/judge_failed"] = float(group["accuracy"]["judge_failed"])
            flat.update({f"{key}/judge_{name}": value for name, value in group["judge_cost"]["per_query"].items()})
        flat.update({f"{key}/{name}": value for name, value in group["metrics"].items()})
        flat.update({f"{key}/route_{route}": share for route, share in group["routes"].items()})
        flat.update({f"{key}/{name}": value for name, value in group["cost"].items()})
        histogram = group["uncertainty_histogram"]
        flat.update({f"{key}/uncertainty_bin{k}": float(count) for k, count in enumerate(histogram["counts"])})
        flat[f"{key}/n"], flat[f"{key}/failed"] = float(group["n"]), float(group["failed"])
    return flat


def _dotted(config: Mapping[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def load_sweep(folder: str | Path, threshold_key: str = "generator.threshold") -> dict[float, list[QueryOutcome]]:
    """The traces of a Hydra multirun folder, by the threshold each run used.

    Every sub-folder holding a ``trace.jsonl`` is one run; its threshold is ``threshold_key`` of the
    settings the RAG task saved beside the trace (``rag_config.json``, ``identity``).
    """
    runs: dict[float, list[QueryOutcome]] = {}
    for trace in sorted(Path(folder).rglob(MERGED_FILE)):
        config = trace.parent / RUN_CONFIG_FILE
        identity = read_json(config).get("identity", {}) if config.is_file() else {}
        threshold = _dotted(identity, threshold_key)
        if threshold is None:
            raise ValueError(f"{trace.parent}: no {threshold_key!r} in {config.name}; cannot place it in the sweep")
        if float(threshold) in runs:
            raise ValueError(f"{trace.parent}: a second run with {threshold_key}={threshold}")
        runs[float(threshold)] = load_trace(trace)
    if not runs:
        raise ValueError(f"{folder}: no {MERGED_FILE} found in any sub-folder")
    return runs


def sweep_row(threshold: float, outcomes: Sequence[QueryOutcome]) -> dict[str, Any]:
    """One threshold's accuracy (judged, else relaxed), route shares, H′ histogram and cost."""
    group = summarize_group(outcomes)
    judged = group["accuracy"] is not None
    value = group["accuracy"]["value"] if judged else group["metrics"]["relaxed_accuracy"]
    ci95 = group["accuracy"]["ci95"] if judged else group["ci95"]["relaxed_accuracy"]
    return {"threshold": threshold, "n": group["n"], "metric": "accuracy" if judged else "relaxed_accuracy",
            "value": value, "ci95": ci95, "routes": group["routes"], "cost": group["cost"], "failed": group["failed"],
            "uncertainty_histogram": group["uncertainty_histogram"]}


def sweep_plot(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """PNG: accuracy and HQP share against h; accuracy against LVLM calls per query (the trade-off)."""
    from matplotlib.figure import Figure

    thresholds = np.array([r["threshold"] for r in rows])
    values = np.array([100 * r["value"] for r in rows])
    errors = np.array([[100 * (r["value"] - r["ci95"][0]), 100 * (r["ci95"][1] - r["value"])] for r in rows]).T
    calls = np.array([r["cost"]["lvlm_calls"] for r in rows])
    label = "judged accuracy (%)" if rows[0]["metric"] == "accuracy" else "relaxed accuracy (%)"
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    left, right = figure.subplots(1, 2)
    left.errorbar(thresholds, values, yerr=errors, marker="o", capsize=3, label=label)
    left.plot(thresholds, [100 * r["routes"].get("HQP", 0.0) for r in rows], marker="s", linestyle="--",
              label="routed to Decoupler, HQP (%)")
    if thresholds.min() <= PAPER_THRESHOLD <= thresholds.max():
        left.axvline(PAPER_THRESHOLD, color="grey", linestyle=":", label=f"paper: h = {PAPER_THRESHOLD}")
    left.set(xlabel="uncertainty threshold h", ylabel="%", title="accuracy and routing vs. h")
    left.legend(fontsize=8)
    right.errorbar(calls, values, yerr=errors, marker="o", linestyle="-", capsize=3)
    for h, x, y in zip(thresholds, calls, values):
        right.annotate(f"h={h:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    right.set(xlabel="LVLM calls per query (mean)", ylabel=label, title="accuracy vs. cost")
    return png_bytes(figure, dpi=100)


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> str:
    routes = table_routes(rows)
    header = ["h", "n", rows[0]["metric"] + " [95% CI]", *routes, "LVLM calls", "Input tok.", "Output tok.",
              "Wall p50 (s)"]
    return _markdown_table(header, [
        [f"{r['threshold']:g}", str(r["n"]), _ci_cell(r["value"], r["ci95"]),
         *(_pct(r["routes"].get(route, 0.0)) for route in routes), f"{r['cost']['lvlm_calls']:.2f}",
         f"{r['cost']['input_tokens']:.0f}", f"{r['cost']['output_tokens']:.0f}", f"{r['cost']['wall_s_p50']:.2f}"]
        for r in rows])


def sweep_summary(
    runs: Mapping[float, Sequence[QueryOutcome]] | str | Path,
    out_dir: str | Path | None = None,
    threshold_key: str = "generator.threshold",
) -> dict[str, Any]:
    """Accuracy, routed share and cost per Judger threshold h (the trade-off the paper fixes at h = 0.8).

    ``runs`` maps thresholds to outcomes, or is a multirun folder (:func:`load_sweep`). Every run must
    answer the same queries, so the rows compare like with like. With ``out_dir`` (default: the folder),
    writes ``sweep.json``, ``sweep.md`` and ``sweep.png``. Returns ``{"rows", "table"}``.
    """
    if isinstance(runs, (str, Path)):
        out_dir = runs if out_dir is None else out_dir
        runs = load_sweep(runs, threshold_key)
    if not runs:
        raise ValueError("a sweep needs at least one run")
    queries = {h: {outcome_key(o) for o in outcomes} for h, outcomes in runs.items()}
    every = set().union(*queries.values())
    incomplete = sorted(h for h, keys in queries.items() if keys != every)
    if incomplete:
        raise ValueError(f"the runs at h={incomplete} lack queries the others answered; a sweep compares the same "
                         "queries")
    rows = [sweep_row(h, runs[h]) for h in sorted(runs)]
    result = {"rows": rows, "table": sweep_table(rows)}
    if out_dir is not None:
        out_dir = Path(out_dir)
        write_json(out_dir / "sweep.json", result)
        write_text(out_dir / "sweep.md", "# Judger threshold sweep\n\n" + result["table"] + "\n")
        write_bytes(out_dir / "sweep.png", sweep_plot(rows))
    return result


def compare_runs(run_dirs: Sequence[str | Path], metric: str = "accuracy") -> str:
    """One table with a row per RAG run directory (its ``rag.json``), as the paper's Tables 3, 4 and 6."""
    summaries = {}
    for run_dir in map(Path, run_dirs):
        report_file = run_dir / REPORT_FILE
        if not report_file.is_file():
            raise FileNotFoundError(f"{run_dir}: no {REPORT_FILE} (not a finished eval.py task=rag|generation run)")
        summaries[run_dir.name] = read_json(report_file, keys=("overall",))
    if metric == "accuracy" and all(s["overall"]["accuracy"] is None for s in summaries.values()):
        raise ValueError("no run was judged (judge: disabled); compare a rule metric, e.g. --metric relaxed_accuracy")
    return comparison_table(summaries, metric)
