"""nDCG@5 over seeds with intervals, from evaluations already run, as the chain reports its reader
(:func:`hkrag.tasks.chain.retrieval_rows`: a crossed seeds × questions t interval, bounded to [0, 1]).

    python -m hkrag.tasks.seeds runs/eval_s0 runs/eval_s1 runs/eval_s2 --corpus data/synthetic/corpus

Each folder is one seed's ``eval.py task=retrieval`` output (its ``per_query.json``) or a ``train.py`` run
(``eval-after/per_query.json``), all over the same questions; ``--corpus`` is the page corpus whose pools give
chance (for region units, the pages they were cut from). Prints the table (``--out``: also writes it and the rows
as ``<out>.md`` / ``<out>.json``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from hkrag.io import write_json, write_text
from hkrag.tasks.chain import retrieval_rows, retrieval_table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="one evaluation folder per seed")
    parser.add_argument("--corpus", required=True, type=Path, help="page corpus of the pools (chance)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not run.is_dir()]
    if missing:
        parser.exit(2, f"error: no such evaluation folder: {', '.join(missing)}\n")
    rows = retrieval_rows(args.runs, args.corpus, args.split)
    table = retrieval_table(rows)
    print(table)
    if args.out:
        write_text(args.out.with_suffix(".md"), table + "\n")
        write_json(args.out.with_suffix(".json"), {"runs": [str(run) for run in args.runs], "rows": rows})


if __name__ == "__main__":
    main()
