"""What a correct Pruner's pages give the answering steps, from ``agent_steps --modes forced`` on the reader's top k.

    python -m hkrag.tasks.correct_pruner RUN/steps_val/forced-retrieved.jsonl --out DIR

In forced mode (:mod:`hkrag.tasks.agent_steps`) every curriculum example of a query is asked once: ``answer`` and
``verify`` on the pages a correct Pruner keeps (the first n of the buffer holding a relevant page, Eq. 6) and on the
whole buffer (``curriculum.kept: [pruned, all]``), and ``single_pass`` on the buffer. The LQP route's answer is
``verify``'s, so ``verify`` on the kept pages against the single pass on the buffer is what the agents would answer
with a Pruner that never errs, against the baseline: the most that ranking the pages right (issue 40's Pruner AUROC
target) can buy at this size, with every other step as trained. Per query one row (relaxed accuracy 0/1 of each step
on each page set); the summary gives the questions whose correct Pruner keeps fewer pages than the buffer, and all of
them, with paired differences and their 95 % percentile bootstrap intervals over questions.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hkrag.cli import existing, usage_errors
from hkrag.io import write_json, write_jsonl_gz, write_text
from hkrag.rag.metrics import relaxed_accuracy
from hkrag.rag.records import QueryOutcome
from hkrag.rag.trace import load_trace
from hkrag.stats import bootstrap_interval, paired_bootstrap

logger = logging.getLogger(__name__)

ROWS_FILE, SUMMARY_FILE = "correct_pruner.jsonl.gz", "correct_pruner.json"
COLUMNS = ("single_pass", "verify_kept", "verify_all", "answer_kept", "answer_all")
"""Each row's scores: a step (``answer``, ``verify``) on the kept pages or on the whole buffer; the single pass on the
buffer."""
DIFFERENCES = (("verify_kept", "single_pass"), ("verify_kept", "verify_all"), ("verify_all", "single_pass"))
"""The paired differences reported: the agents' LQP answer with a correct Pruner against the single pass; what the
pruning itself changes for ``verify``; and the prompts alone, on the same pages."""


def query_row(outcome: QueryOutcome) -> dict[str, Any] | None:
    """One query's scores (:data:`COLUMNS`), or ``None`` when no answer step was asked (a buffer without a relevant
    page under ``answer_unanswerable=false``). Raises ValueError naming the query when its trace is not a forced
    one."""
    if outcome.route != "forced":
        raise ValueError(f"{outcome.query_id}: route {outcome.route!r}, not a forced trace (agent_steps --modes "
                         "forced)")
    buffer = list(outcome.retrieved)
    calls: dict[str, dict[int, str]] = {}
    for call in outcome.calls:
        if call.step in ("answer", "verify", "single_pass"):
            calls.setdefault(call.step, {})[len(call.page_ids)] = call.output.strip()
    if "single_pass" not in calls:
        return None
    if lacking := [step for step in ("answer", "verify") if step not in calls]:
        raise ValueError(f"{outcome.query_id}: the forced trace has a single pass but no {' or '.join(lacking)} call "
                         "(agent_steps asks every step of the curriculum)")
    kept = min(calls["verify"])
    right = {f"{step}_{which}": relaxed_accuracy(calls[step][n], outcome.gold) == 1.0
             for step in ("answer", "verify") for which, n in (("kept", kept), ("all", max(calls[step])))}
    single = relaxed_accuracy(calls["single_pass"][len(buffer)], outcome.gold) == 1.0
    return {"query_id": outcome.query_id, "buffer": len(buffer), "kept": kept, "single_pass": int(single),
            **{key: int(value) for key, value in right.items()}}


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy ×100 of each column with its interval, and the paired differences, for the questions whose correct
    Pruner prunes (``kept`` below ``buffer``) and for every question."""
    groups = {"pruned": [row for row in rows if row["kept"] < row["buffer"]], "every question": list(rows)}
    summary = {}
    for name, group in groups.items():
        if not group:
            summary[name] = {"n": 0}
            continue
        columns = {column: [100.0 * row[column] for row in group] for column in COLUMNS}
        summary[name] = {
            "n": len(group),
            "accuracy": {column: [sum(v) / len(v), *bootstrap_interval(v)] for column, v in columns.items()},
            "differences": {f"{a} - {b}": paired_bootstrap(columns[a], columns[b]) for a, b in DIFFERENCES},
        }
    return summary


def markdown(summary: dict[str, Any], trace: Path) -> str:
    """The summary as Markdown tables (×100, 95 % intervals)."""
    lines = [f"# A correct Pruner's pages: {trace}", ""]
    for name, group in summary.items():
        lines += [f"## {name} ({group['n']} questions)", ""]
        if not group["n"]:
            lines += ["none", ""]
            continue
        lines += ["| step, pages | relaxed accuracy |", "|---|---|"]
        lines += [f"| {column} | {v[0]:.1f} [{v[1]:.1f}, {v[2]:.1f}] |" for column, v in group["accuracy"].items()]
        lines += ["", "| paired difference | mean [95 %] | p |", "|---|---|---|"]
        lines += [f"| {key} | {d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}] | {d['p_value']:.3f} |"
                  for key, d in group["differences"].items()]
        lines.append("")
    return "\n".join(lines)


def evaluate(trace: Path, out: Path) -> dict[str, Any]:
    """Rows and summary of a forced trace on retrieved pages, written into ``out``."""
    outcomes = load_trace(trace)
    rows = [row for row in map(query_row, outcomes) if row is not None]
    if not rows:
        raise ValueError(f"{trace}: no query with an answer step ({len(outcomes)} queries)")
    logger.info("%d of %d queries answered", len(rows), len(outcomes))
    summary = summarise(rows)
    write_jsonl_gz(out / ROWS_FILE, rows)
    write_json(out / SUMMARY_FILE, {"trace": str(trace), "summary": summary})
    write_text(out / "correct_pruner.md", markdown(summary, trace))
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=existing(), help="agent_steps' forced-retrieved.jsonl (--modes forced --pages "
                        "retrieved)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with usage_errors(parser):
        evaluate(args.trace, args.out)
    print((args.out / "correct_pruner.md").read_text())


if __name__ == "__main__":
    main()
