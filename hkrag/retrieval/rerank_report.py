"""A reranked evaluation against its first stage, per query, with paired differences.

    python -m hkrag.retrieval.rerank_report outputs/rerank/rerank.json --qa-source data/synthetic/qa \
        --split test --datasets synchart synslide syntable syninfo synfine --out docs/rerank/test

From a reranked evaluation's ``rerank.json`` (:attr:`hkrag.retrieval.rerank.RerankRanker.trace`: every query's
scored pages with their first-stage score and their reranking score) and the questions' qrels, each query's nDCG@5
before and after reranking, both as trec_eval orders tied pages (by doc id) and as their expectation over the
orders of tied pages (``E[ndcg@5]``). The scored pages are the first stage's top ``depth`` (and the pages tied
with the last), so with ``depth`` ≥ 5 they decide nDCG@5 both before and after. The summary gives, overall and
by data set, pool, evidence label and data set × pool, each mean with its 95 % percentile bootstrap interval over
questions and the paired difference (reranked − first stage) with its paired bootstrap interval and p-value
(:func:`hkrag.stats.paired_bootstrap`); the LVLM calls and seconds per query come with it. Writes
``per_query.jsonl.gz`` (one row per query and pool, reproducible bytes), ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hkrag.cli import existing, usage_errors
from hkrag.data.opendocvqa import ALL_POOL, QAExample, load_qa, qrels
from hkrag.io import read_json, write_json, write_jsonl_gz, write_text
from hkrag.retrieval.metrics import evaluate_run, expected_name
from hkrag.stats import bootstrap_interval, paired_bootstrap

METRICS = ("E[ndcg@5]", "ndcg@5")
STAGES = ("first", "reranked")
GROUPS = ("dataset", "pool", "evidence")


def dataset_of(query_id: str) -> str:
    """The data set a built-in query id names (``synfine-test-d000-p1-fine_print`` -> ``synfine``)."""
    return query_id.split("-", 1)[0]


def query_metrics(docs: Mapping[str, float], example: QAExample) -> dict[str, float]:
    """nDCG@5 of one query's ranked pages: trec_eval's and its expectation over tied orders."""
    judged, run = qrels([example]), {example.query_id: dict(docs)}
    trec = evaluate_run(run, judged)["per_query"][example.query_id]["ndcg@5"]
    expected = evaluate_run(run, judged, ties="expected")["per_query"][example.query_id]["ndcg@5"]
    return {expected_name("ndcg@5"): expected, "ndcg@5": trec}


def per_query_rows(trace: Sequence[Mapping[str, Any]], examples: Mapping[str, QAExample]) -> list[dict[str, Any]]:
    """One row per traced query and pool (``all``, or ``single``: any other corpus, e.g. a data set's own pages):
    its group labels, cost, and nDCG@5 before and after reranking."""
    missing = sorted({entry["query_id"] for entry in trace} - set(examples))
    if missing:
        raise ValueError(f"{len(missing)} reranked queries have no question in the given QA sets, e.g. {missing[:3]} "
                         "(--qa-source, --split and --datasets name the questions the evaluation ranked)")
    rows = []
    for entry in trace:
        example = examples[entry["query_id"]]
        first = {page["doc_id"]: page["first_score"] for page in entry["pages"]}
        reranked = {page["doc_id"]: 1.0 + page["score"] for page in entry["pages"]}
        pool = "all" if entry["pool"] == ALL_POOL else "single"
        rows.append({"query_id": example.query_id, "dataset": dataset_of(example.query_id), "pool": pool,
                     "evidence": example.evidence, "calls": len(entry["pages"]), "seconds": entry["seconds"],
                     "relevant": list(example.relevant_doc_ids),
                     "first": query_metrics(first, example), "reranked": query_metrics(reranked, example),
                     "pages": entry["pages"]})
    return rows


def summarise(rows: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Means ×100 with bootstrap intervals and paired differences, for all rows and every group of :data:`GROUPS`
    and data set × pool."""
    groups: dict[str, list[Mapping[str, Any]]] = {"all": list(rows)}
    for key in GROUPS:
        for row in rows:
            if row[key]:
                groups.setdefault(f"{key} {row[key]}", []).append(row)
    for row in rows:
        groups.setdefault(f"{row['dataset']} / {row['pool']}", []).append(row)
    return {name: group_summary(members, seed) for name, members in groups.items()}


def group_summary(rows: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, Any]:
    """One group's figures (×100): each stage's mean [95 %] and the paired difference per metric."""
    found: dict[str, Any] = {"n": len(rows), "calls_per_query": sum(r["calls"] for r in rows) / len(rows),
                             "seconds_per_query": sum(r["seconds"] for r in rows) / len(rows)}
    for metric in METRICS:
        values = {stage: [100 * row[stage][metric] for row in rows] for stage in STAGES}
        found[metric] = {stage: {"mean": sum(v) / len(v), "interval": bootstrap_interval(v, seed=seed)}
                         for stage, v in values.items()}
        found[metric]["difference"] = paired_bootstrap(values["reranked"], values["first"], seed=seed)
    return found


def summary_markdown(summary: Mapping[str, Any], title: str) -> str:
    """The summary as one Markdown table per metric."""
    lines = [f"# {title}", ""]
    for metric in METRICS:
        lines += [f"## {metric} (×100, 95 % bootstrap over questions)", "",
                  "| group | queries | first stage | reranked | reranked − first [95 %] (p) | LVLM calls / query | "
                  "seconds / query |", "|---|---|---|---|---|---|---|"]
        for name, group in summary.items():
            stages = group[metric]
            cells = [f"{stages[s]['mean']:.1f} [{stages[s]['interval'][0]:.1f}, {stages[s]['interval'][1]:.1f}]"
                     for s in STAGES]
            diff = stages["difference"]
            lines.append(f"| {name} | {group['n']} | {cells[0]} | {cells[1]} | {diff['diff']:+.1f} "
                         f"[{diff['low']:+.1f}, {diff['high']:+.1f}] ({diff['p_value']:.3g}) | "
                         f"{group['calls_per_query']:.1f} | {group['seconds_per_query']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def report(trace_file: Path, qa_source: str, split: str, datasets: Sequence[str], out: Path,
           queries: set[str] | None = None) -> dict[str, Any]:
    """Per-query rows and the summary of ``trace_file`` against the questions of ``datasets`` (``queries``: only
    these ids, e.g. a validation split), written into ``out``."""
    examples = {ex.query_id: ex for dataset in datasets for ex in load_qa(qa_source, dataset, split)}
    trace = read_json(trace_file)["queries"]
    trace = [entry for entry in trace if queries is None or entry["query_id"] in queries]
    rows = per_query_rows(trace, examples)
    summary = summarise(rows)
    write_jsonl_gz(out / "per_query.jsonl.gz", rows)
    write_json(out / "summary.json", summary)
    write_text(out / "summary.md", summary_markdown(summary, f"Reranked vs first stage: {trace_file}, {split}"))
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=existing(), help="a reranked evaluation's rerank.json")
    parser.add_argument("--qa-source", required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--datasets", nargs="+", required=True)
    parser.add_argument("--queries", type=existing(), default=None, help="a JSON list of query ids to keep")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    queries = set(read_json(args.queries)) if args.queries else None
    with usage_errors(parser):
        report(args.trace, args.qa_source, args.split, args.datasets, args.out, queries)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
