"""Relaxed accuracy over seeds with its interval, from answer runs already made (``eval.py task=rag|generation``),
as the ladder reports its sizes; with ``--vs``, the paired difference of two conditions.

    python -m hkrag.tasks.answers runs/agents_s0 runs/agents_s1 runs/agents_s2
    python -m hkrag.tasks.answers runs/agents_s0 runs/agents_s1 --vs runs/single_s0 runs/single_s1 --out docs/x/top3

Each folder is one seed's finished run (its ``trace``), all over the same questions and pools. A row is one answered
query (data set, pool, question); a question's pools are one column of the interval (its rows are not independent):
with several seeds the crossed seeds × questions t interval (:func:`hkrag.stats.crossed_interval`), with one the
percentile bootstrap over questions. ``--vs`` pairs seed ``i`` of the runs with seed ``i`` of the baseline, row by
row. ``--out`` writes ``<out>.md``, ``<out>.json`` and the per-query scores ``<out>_per_query.jsonl`` they come from.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hkrag.io import with_extension, write_json, write_text
from hkrag.rag.report import metric_value
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.stats import cluster_bootstrap_interval, cluster_rows, crossed_difference, crossed_interval

METRIC = "relaxed_accuracy"
BOOTSTRAP = "one seed: 95 % percentile bootstrap over questions (2,000 resamples)"
Row = tuple[str, str, str]
"""An answered query: ``(data set, pool, query id)``."""


def interval(matrix: np.ndarray, questions: Sequence[Any]) -> dict[str, Any]:
    """The mean of a ``(seeds, rows)`` score matrix with its 95 % interval: crossed seeds × questions with several
    seeds (:func:`hkrag.stats.crossed_interval`), else the percentile bootstrap over questions
    (:func:`hkrag.stats.cluster_bootstrap_interval`); rows of one question are one column (one cluster)."""
    if len(matrix) > 1:
        found = crossed_interval(cluster_rows(matrix, questions), bounds=(0.0, 1.0))
        return {key: found[key] for key in ("mean", "low", "high", "method")}
    low, high = cluster_bootstrap_interval(matrix[0], questions)
    return {"mean": float(matrix[0].mean()), "low": low, "high": high, "method": BOOTSTRAP}


def difference(better: np.ndarray, worse: np.ndarray, questions: Sequence[Any]) -> dict[str, Any]:
    """The paired difference ``better − worse`` (same seeds, same rows) with its 95 % interval, as :func:`interval`."""
    if len(better) > 1:
        found = crossed_difference(better, worse, questions)
        return {key: found[key] for key in ("diff", "low", "high", "method")}
    low, high = cluster_bootstrap_interval(better[0] - worse[0], questions)
    return {"diff": float((better[0] - worse[0]).mean()), "low": low, "high": high, "method": BOOTSTRAP}


def run_scores(run: Path) -> dict[Row, float]:
    """A finished answer run's relaxed accuracy per answered query; ``FileNotFoundError`` naming a folder that is
    not one."""
    trace = Path(run) / MERGED_FILE
    if not trace.exists():
        raise FileNotFoundError(f"{run}: no {MERGED_FILE} (not a finished eval.py task=rag|generation run)")
    return {(o.dataset, o.pool, o.query_id): metric_value(o, METRIC) for o in load_trace(trace)}


def score_matrix(runs: Sequence[Path]) -> tuple[np.ndarray, list[Row]]:
    """``(seeds, rows)`` scores of ``runs`` (one seed each) and the rows in order. ``ValueError`` naming the folders
    for a folder given twice, two folders holding the same answers (one run counted as two seeds) or runs over
    different queries (the crossed interval pairs each row across seeds)."""
    seen = {}
    for run in runs:
        if Path(run).resolve() in seen:
            raise ValueError(f"{run} is given twice (as {seen[Path(run).resolve()]}): each folder is one seed")
        seen[Path(run).resolve()] = run
    scores = [run_scores(run) for run in runs]
    rows = sorted(scores[0])
    for run, found in zip(runs[1:], scores[1:]):
        if sorted(found) != rows:
            lacking, extra = sorted(set(rows) - set(found)), sorted(set(found) - set(rows))
            raise ValueError(f"{run} and {runs[0]} did not answer the same queries: {run} lacks {len(lacking)} (e.g. "
                             f"{lacking[:2]}) and adds {len(extra)} (e.g. {extra[:2]}); answer every seed on the "
                             "same split, data sets and pools")
    for (run, one), (other, two) in itertools.combinations(zip(runs, scores), 2):
        if one == two and _same_trace(run, other):
            raise ValueError(f"{run} and {other} hold the same run (the same trace): one run given twice is one "
                             "seed, not two; give one folder per seed")
    return np.array([[found[row] for row in rows] for found in scores]), rows


def _same_trace(run: Path, other: Path) -> bool:
    return (Path(run) / MERGED_FILE).read_bytes() == (Path(other) / MERGED_FILE).read_bytes()


def questions_of(rows: Sequence[Row]) -> list[tuple[str, str]]:
    """Each row's question ``(data set, query id)``: a question's pools are one column of the interval."""
    return [(dataset, query) for dataset, _, query in rows]


def compare(runs: Sequence[Path], baseline: Sequence[Path] = ()) -> dict[str, Any]:
    """The runs' accuracy [95 %] and each seed's; with ``baseline`` (one folder per seed, the same order) also its
    accuracy and the paired difference ``runs − baseline``; ``per_query`` holds every score behind them."""
    matrix, rows = score_matrix(runs)
    report: dict[str, Any] = {"metric": METRIC, "rows": len(rows), "seeds": len(runs),
                              "runs": {"folders": [str(run) for run in runs], **summary(matrix, rows)}}
    per_query = query_scores("runs", matrix, rows)
    if baseline:
        if len(baseline) != len(runs):
            raise ValueError(f"--vs gives {len(baseline)} folder(s) for {len(runs)} run(s): pair each seed with one")
        against, against_rows = score_matrix(baseline)
        if against_rows != rows:
            raise ValueError(f"{baseline[0]} and {runs[0]} did not answer the same queries: compare runs over the "
                             "same split, data sets and pools")
        report["baseline"] = {"folders": [str(run) for run in baseline], **summary(against, rows)}
        report["difference"] = difference(matrix, against, questions_of(rows))
        per_query += query_scores("baseline", against, rows)
    report["per_query"] = per_query
    return report


def query_scores(condition: str, matrix: np.ndarray, rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The per-query rows of one condition's ``(seeds, rows)`` matrix, as ``<out>_per_query.jsonl`` keeps them."""
    return [{"condition": condition, "seed": i, "dataset": d, "pool": p, "query_id": q, "score": float(score)}
            for i, scores in enumerate(matrix) for (d, p, q), score in zip(rows, scores)]


def summary(matrix: np.ndarray, rows: Sequence[Row]) -> dict[str, Any]:
    """A condition's accuracy [95 %] over every row and by pool, and each seed's mean."""
    by_pool = {}
    for pool in sorted({p for _, p, _ in rows}):
        keep = [i for i, row in enumerate(rows) if row[1] == pool]
        by_pool[pool] = interval(matrix[:, keep], questions_of([rows[i] for i in keep]))
    return {"accuracy": interval(matrix, questions_of(rows)), "by_pool": by_pool,
            "per_seed": [float(seed.mean()) for seed in matrix]}


def markdown(report: Mapping[str, Any]) -> str:
    """:func:`compare`'s report as a Markdown table (×100)."""
    def cell(found: Mapping[str, Any], key: str = "mean") -> str:
        sign = "+" if key == "diff" else ""
        return (f"{100 * found[key]:{sign}.1f} [{100 * found['low']:{sign}.1f}, "
                f"{100 * found['high']:{sign}.1f}]")

    lines = [f"Relaxed accuracy ×100 [95 %], {report['rows']} answered queries, {report['seeds']} seed(s) "
             f"({report['runs']['accuracy']['method']}).", "",
             "| condition | every row | " + " | ".join(f"pool {pool}" for pool in report["runs"]["by_pool"])
             + " | per seed |",
             "|---|---|" + "---|" * len(report["runs"]["by_pool"]) + "---|"]
    for name in ("runs", "baseline"):
        if name in report:
            found = report[name]
            lines.append(f"| {name}: {', '.join(found['folders'])} | {cell(found['accuracy'])} | "
                         + " | ".join(cell(found["by_pool"][pool]) for pool in found["by_pool"]) + " | "
                         + " / ".join(f"{100 * value:.1f}" for value in found["per_seed"]) + " |")
    if "difference" in report:
        per_seed = " / ".join(f"{100 * (mine - theirs):+.1f}" for mine, theirs in
                              zip(report["runs"]["per_seed"], report["baseline"]["per_seed"]))
        lines += ["", f"Paired difference runs − baseline: **{cell(report['difference'], 'diff')}** (per seed: "
                  f"{per_seed})"]
    return "\n".join(lines)


def write_report(report: Mapping[str, Any], out: Path) -> None:
    """``<out>.md``, ``<out>.json`` (the figures) and ``<out>_per_query.jsonl`` (every score behind them)."""
    write_text(with_extension(out, ".md"), markdown(report) + "\n")
    write_json(with_extension(out, ".json"), {key: value for key, value in report.items() if key != "per_query"})
    write_text(with_extension(out, "_per_query.jsonl"),
               "".join(json.dumps(row) + "\n" for row in report["per_query"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="one finished answer run per seed")
    parser.add_argument("--vs", nargs="+", type=Path, default=[], metavar="RUN",
                        help="one baseline run per seed over the same queries, in the runs' seed order: the paired "
                             "difference runs - baseline")
    parser.add_argument("--out", type=Path, help="write <out>.md, <out>.json and <out>_per_query.jsonl")
    args = parser.parse_args(argv)
    try:
        report = compare(args.runs, args.vs)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(markdown(report))
    if args.out:
        write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
