"""Table 2's baseline rows side by side (``eval.py task=baselines``): one row per retriever (BM25, dense, hybrid).

:func:`baselines_report` lays the results of several :func:`hkrag.retrieval.evaluation.evaluate_ranker` runs
(one per retriever, on the same queries and pools) into the paper's Table 2 layout — rows = retrievers, columns =
data set x pool, plus the average — for every reported metric, its expectation over the orders of tied pages
(``E[ndcg@5]``, the figure that no doc id moves) above trec_eval's value (ties by doc id descending), then nDCG@5
both ways per evidence label (``salient`` / ``fine_print`` in the built-in corpus) and each row's wall time; a
reranked row (``retriever=rerank``) adds its LVLM calls and seconds per query.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hkrag.retrieval.evaluation import REPORTED_METRICS, metric_grid
from hkrag.retrieval.metrics import expected_name, format_table

BASELINES_FILE = "baselines.json"
BASELINES_TABLE = "baselines.md"


def baselines_report(results: Mapping[str, Mapping[str, Any]], seconds: Mapping[str, float]) -> dict[str, Any]:
    """``{"table": Markdown, "json": {row: {"seconds", "results"}}}`` from ``{row: evaluate_ranker(...)}`` and
    each row's wall time in seconds."""
    by_row = {row: result["results"] for row, result in results.items()}
    pools = list(dict.fromkeys(p for res in by_row.values() for by_pool in res.values() for p in by_pool))
    labels = sorted({label for res in by_row.values() for by_pool in res.values() for r in by_pool.values()
                     for label in r} - {"all", "num_queries"})
    both = [name for metric in REPORTED_METRICS for name in (expected_name(metric), metric)]
    tables = [f"{metric} (x100)\n\n" + format_table(_cells(by_row, "all", metric), pools=pools) for metric in both]
    tables += [f"{metric} (x100), {label} queries\n\n" + format_table(_cells(by_row, label, metric), pools=pools)
               for label in labels for metric in both[:2]]
    costs = {row: result.get("rerank") for row, result in results.items()}
    timing = "wall time\n\n| Method | seconds | LVLM calls / query | LVLM seconds / query |\n|---|---|---|---|\n" + \
        "\n".join(f"| {row} | {seconds[row]:.1f} | " + ("— | — |" if costs[row] is None else
                   f"{costs[row]['calls_per_query']:.1f} | {costs[row]['seconds_per_query']:.2f} |") for row in by_row)
    return {"table": "\n\n".join([*tables, timing]),
            "json": {row: {"seconds": seconds[row], "results": res, **({"rerank": costs[row]} if costs[row] else {})}
                     for row, res in by_row.items()}}


def _cells(by_row: Mapping[str, Any], label: str, metric: str) -> dict[str, dict[str, dict[str, float]]]:
    return {row: metric_grid(res, label, metric) for row, res in by_row.items()}
