"""Finished RAG runs: ``python -m hkrag.rag sweep MULTIRUN_DIR | compare RUN_DIR ... | steps RUN_DIR``.

``sweep`` tabulates accuracy, routes and cost per Judger threshold over an ``eval.py -m`` folder; ``compare``
lays several runs out as the paper's Tables 3, 4 and 6 (docs/evaluation.md); ``steps`` writes the per-step report
(:mod:`hkrag.rag.step_report`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from hkrag.cli import existing
from hkrag.rag.metrics import METRICS
from hkrag.rag.report import REPORT_FILE, RUN_CONFIG_FILE, compare_runs, sweep_summary
from hkrag.rag.step_report import report_run
from hkrag.rag.trace import MERGED_FILE

FINISHED = "a finished eval.py task=rag|generation run"


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m hkrag.rag sweep MULTIRUN_DIR`` | ``compare RUN_DIR ...``."""
    parser = argparse.ArgumentParser(prog="python -m hkrag.rag", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("sweep", help="accuracy, routes and cost per Judger threshold of a multirun folder "
                                "(eval.py -m ... generator.threshold=0.2,0.5,0.8); writes sweep.{json,md,png}")
    sweep.add_argument("folder", type=existing("dir"))
    sweep.add_argument("--key", default="generator.threshold", help="the swept setting (default %(default)s)")
    sweep.add_argument("--out", type=Path, default=None, help="where to write (default: the folder)")
    compare = commands.add_parser("compare", help="one table with a row per run directory (Tables 3, 4, 6)")
    compare.add_argument("run_dirs", type=existing("dir", (REPORT_FILE,), FINISHED), nargs="+")
    compare.add_argument("--metric", default="accuracy", choices=["accuracy", *METRICS])
    steps = commands.add_parser("steps", help="the per-step report (Pruner, notes, answers per step, calibration "
                                "of H') of an eval.py run on the built-in corpus; writes steps.{json,md} into it")
    steps.add_argument("run_dir", type=existing("dir", (RUN_CONFIG_FILE, MERGED_FILE), FINISHED))
    steps.add_argument("--threshold-from", type=existing(), default=None, help="a validation run's steps.json: its "
                       "Pruner P(yes) threshold is applied here (default: one chosen on this run, labelled so)")
    args = parser.parse_args(argv)
    if args.command == "steps":
        report_run(args.run_dir, args.threshold_from)
        print((args.run_dir / "steps.md").read_text())
    elif args.command == "sweep":
        print(sweep_summary(args.folder, args.out, args.key)["table"])
    else:
        print(compare_runs(args.run_dirs, args.metric))


if __name__ == "__main__":
    main()
