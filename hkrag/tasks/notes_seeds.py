"""The Decoupler's notes over training seeds: does the forced fine-print note name the asked code (issue 40's target).

    python -m hkrag.tasks.notes_seeds outputs/notes_seeds/steps/test-s0 ... --out DIR --confidence 0.975 --bound 0.8

Each input is the ``--out`` folder of one training seed's ``python -m hkrag.tasks.agent_steps RUN --modes forced
--pages gold`` (the same split and questions for every seed). Per seed and question: 1 when the first fine-print
note on the gold page names the page's reference code (:func:`hkrag.rag.step_report.names_code`, the per-step
report's count), 0 when it does not or the call failed. The figure is the mean of that ``(seeds, questions)``
matrix with :func:`hkrag.stats.share_interval` (a share near its ceiling: the crossed t interval falls short of its
level there, docs/statistics.md) at ``--confidence`` (a level below 95 % is refused: a family's correction widens
intervals) and at 95 %, beside the crossed seeds × questions interval (:func:`hkrag.stats.crossed_interval`,
bounded to [0, 1]) at ``--confidence``, the one the target's attempts were registered with; with ``--bound``, the
targets' verdict on each ``--confidence`` interval (:class:`hkrag.tasks.chain.Target`: *met*, *not met*, *not
shown*). Writes ``per_query.jsonl.gz`` (seed, question, page, 0/1: the figure re-derives from it),
``notes_seeds.json`` and ``notes_seeds.md``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from hkrag.cli import existing, usage_errors
from hkrag.io import read_json, write_json, write_jsonl_gz, write_text
from hkrag.rag.step_report import names_code, page_truth, query_truth
from hkrag.rag.trace import load_trace
from hkrag.stats import crossed_interval, seed_matrix, share_interval
from hkrag.tasks.agent_steps import held_out_queries
from hkrag.tasks.chain import Target
from hkrag.tasks.common import RUN_CONFIG

logger = logging.getLogger(__name__)

TRACE, STEPS = "forced-gold.jsonl", "steps.json"
"""What one seed's ``agent_steps --modes forced --pages gold`` folder holds."""
ROWS_FILE, SUMMARY_FILE, MARKDOWN_FILE = "per_query.jsonl.gz", "notes_seeds.json", "notes_seeds.md"


def seed_rows(steps: Path) -> list[dict[str, Any]]:
    """One row per question of a seed's forced gold-page trace: ``{"seed", "query_id", "doc_id", "names_code"}``.
    Questions whose gold page has no code are left out (a property of the page, the same for every seed)."""
    report = read_json(steps / STEPS, keys=("run", "split"))
    run = Path(report["run"])
    cfg = OmegaConf.load(run / RUN_CONFIG)
    truths = {ex.query_id: query_truth(ex) for ex in held_out_queries(run, cfg, report["split"])}
    pages = page_truth(cfg.data.root, "test" if report["split"] == "test" else "train")
    seed = int(cfg.generator_training.optim.seed)
    rows = []
    for outcome in load_trace(steps / TRACE):
        truth = truths.get(outcome.query_id)
        if truth is None:
            raise ValueError(f"{steps / TRACE}: question {outcome.query_id} is not one of the run's "
                             f"{report['split']} questions")
        relevant = [pages[doc_id] for doc_id in truth.relevant if doc_id in pages]
        notes = [call for call in outcome.calls if call.step == "fine_print" and call.iteration == 1
                 and set(call.page_ids) & set(truth.relevant)]
        if not notes:
            raise ValueError(f"{steps / TRACE}: question {outcome.query_id} has no first fine-print note on its gold "
                             "page (is it a forced gold-page trace: agent_steps --modes forced --pages gold?)")
        named = names_code(notes[0], relevant)
        if named is not None:
            rows.append({"seed": seed, "query_id": outcome.query_id, "doc_id": notes[0].page_ids[0],
                         "names_code": int(named and not notes[0].error)})
    return rows


def matrix(rows: Sequence[dict[str, Any]]) -> tuple[list[int], list[str], np.ndarray]:
    """The seeds, the questions and the ``(seeds, questions)`` 0/1 matrix of ``rows``
    (:func:`hkrag.stats.seed_matrix`); a question scored twice by one seed is a ValueError naming both."""
    by_seed: dict[int, dict[str, int]] = {}
    for row in rows:
        scored = by_seed.setdefault(row["seed"], {})
        if row["query_id"] in scored:
            raise ValueError(f"seed {row['seed']} scores question {row['query_id']} twice (two folders of one seed?)")
        scored[row["query_id"]] = row["names_code"]
    if not by_seed:
        raise ValueError("no scored question: no fine-print note on a page with a reference code")
    return seed_matrix(by_seed)


def summarise(rows: Sequence[dict[str, Any]], confidence: float = 0.95, bound: float | None = None) -> dict[str, Any]:
    """The share of notes naming the code (×1), per seed and over all, with its :func:`hkrag.stats.share_interval` at
    ``confidence`` and at 95 % and its crossed seeds × questions interval at ``confidence`` (``"crossed"``), and,
    given ``bound``, the target's verdict on each ``confidence`` interval (``"verdict"``, ``"crossed_verdict"``)."""
    if not 0.95 <= confidence < 1:
        raise ValueError(f"confidence={confidence}: expected at least 0.95 (a family's level is 1 - 0.05/m) and "
                         "below 1")
    if bound is not None and not 0 < bound <= 1:
        raise ValueError(f"bound={bound}: expected a share in (0, 1], e.g. 0.8 for 80 %")
    seeds, questions, scores = matrix(rows)
    summary = {
        "seeds": seeds, "questions": len(questions),
        "per_seed": {str(s): float(row.mean()) for s, row in zip(seeds, scores)},
        "confidence": confidence,
        "interval": share_interval(scores, confidence),
        "interval_95": share_interval(scores, 0.95),
        "crossed": crossed_interval(scores, confidence, bounds=(0.0, 1.0)),
    }
    if bound is not None:
        target = Target("notes name the asked code", bound)
        summary |= {"bound": bound, "verdict": target.verdict(summary["interval"]),
                    "crossed_verdict": target.verdict(summary["crossed"])}
    return summary


def markdown(summary: dict[str, Any], inputs: Sequence[Path]) -> str:
    """The summary as Markdown (×100)."""
    level = f"{100 * summary['confidence']:g} %"
    intervals = {f"{level} (share_interval)": summary["interval"], "95 % (share_interval)": summary["interval_95"],
                 f"{level} (crossed seeds × questions)": summary["crossed"]}
    lines = ["# The forced fine-print notes name the gold page's code", "",
             f"{len(summary['seeds'])} seeds × {summary['questions']} questions; inputs: "
             + ", ".join(f"`{path}`" for path in inputs), "",
             "| seeds | share ×100 | " + " | ".join(intervals) + " |", "|---|---|" + "---|" * len(intervals),
             f"| {', '.join(map(str, summary['seeds']))} | {100 * summary['interval']['mean']:.1f} | "
             + " | ".join(f"[{100 * i['low']:.1f}, {100 * i['high']:.1f}]" for i in intervals.values()) + " |", "",
             "Per seed: " + ", ".join(f"{seed}: {100 * rate:.1f}" for seed, rate in summary["per_seed"].items()), "",
             "share_interval: seed shares' logits normal, a generalized pivot over seeds (`hkrag.stats.share_interval`;"
             " the crossed t interval falls short of its level near a ceiling, docs/statistics.md)."]
    if "bound" in summary:
        lines += ["", f"Target ≥ {100 * summary['bound']:g} % on the {level} share_interval: **{summary['verdict']}**; "
                  f"on the {level} crossed interval: **{summary['crossed_verdict']}** (*met*: the whole interval at "
                  "or above the bound; *not met*: wholly below; *not shown*: it holds the bound)."]
    return "\n".join(lines) + "\n"


def evaluate(inputs: Sequence[Path], out: Path, confidence: float = 0.95, bound: float | None = None
             ) -> dict[str, Any]:
    """Score every seed's forced notes, write the rows and the summary into ``out``; returns the summary."""
    rows = [row for steps in inputs for row in seed_rows(steps)]
    summary = summarise(rows, confidence, bound)
    write_jsonl_gz(out / ROWS_FILE, rows)
    write_json(out / SUMMARY_FILE, {"inputs": [str(path) for path in inputs], "summary": summary})
    write_text(out / MARKDOWN_FILE, markdown(summary, inputs))
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="+", type=existing("dir", holding=(STEPS, TRACE),
                                                          what="an agent_steps --modes forced --pages gold folder"),
                        help="one agent_steps --out folder per training seed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="the interval the verdict reads (0.975: a family of two attempts, Bonferroni)")
    parser.add_argument("--bound", type=float, default=None, help="the target's bound, e.g. 0.8")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with usage_errors(parser):
        evaluate(args.steps, args.out, args.confidence, args.bound)
    print((args.out / MARKDOWN_FILE).read_text())


if __name__ == "__main__":
    main()
