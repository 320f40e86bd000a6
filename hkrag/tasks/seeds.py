"""nDCG@5 over seeds with intervals, from evaluations already run, as the chain reports its reader
(:func:`hkrag.tasks.chain.retrieval_rows`: a crossed seeds × questions t interval, bounded to [0, 1]).

    python -m hkrag.tasks.seeds runs/eval_s0 runs/eval_s1 runs/eval_s2 --corpus data/synthetic/corpus
    python -m hkrag.tasks.seeds runs/b_s0 runs/b_s1 runs/b_s2 --vs runs/a_s0 runs/a_s1 runs/a_s2 --corpus ...

Each folder is one seed's ``eval.py task=retrieval`` output (its ``per_query.json``) or a ``train.py`` run
(``eval-after/per_query.json``), all over the same questions (a relative one missing here is the repository's:
``docs/regions/test_pages_s0`` from any folder); ``--corpus`` is the page corpus whose pools give
chance (for region units, the pages they were cut from). Prints the table (``--out``: also writes it and the rows
as ``<out>.md`` / ``<out>.json``). With ``--vs`` (a baseline's folders, one per seed in the same order) it prints
the paired difference instead (:func:`difference_rows`): two conditions evaluated on the same units and questions.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hkrag.io import local_path, with_extension, write_json, write_text
from hkrag.tasks.chain import interval_row, retrieval_rows, retrieval_scores, retrieval_table


def check_runs(runs: Sequence[Path]) -> None:
    """Refuse what would make the interval lie: a folder given twice, two folders holding the same evaluation (the
    same scores for every question: one evaluation counted as two seeds), or folders not over the same data sets,
    pools and questions (the crossed interval pairs each question across seeds). ``ValueError`` naming the folders."""
    seen: dict[Path, Path] = {}
    for run in runs:
        if run.resolve() in seen:
            raise ValueError(f"{run} is given twice (as {seen[run.resolve()]}): each folder is one seed")
        seen[run.resolve()] = run
    scores = [retrieval_scores(run) for run in runs]
    for (run, score), (other, other_score) in itertools.combinations(zip(runs, scores), 2):
        if score == other_score:
            raise ValueError(f"{run} and {other} hold the same evaluation (every question scores the same): one "
                             "evaluation given twice is one seed, not two; give one folder per training seed")
    check_questions(runs, scores)


def check_questions(runs: Sequence[Path], scores: Sequence[dict[str, dict[str, dict[str, float]]]]) -> None:
    """Refuse runs (with their :func:`~hkrag.tasks.chain.retrieval_scores`) not over the same data sets, pools and
    questions; ``ValueError`` naming the folders and what one lacks or adds."""
    first = {(d, p): set(queries) for d, by_pool in scores[0].items() for p, queries in by_pool.items()}
    for run, score in zip(runs[1:], scores[1:]):
        other = {(d, p): set(queries) for d, by_pool in score.items() for p, queries in by_pool.items()}
        for key in sorted(first.keys() | other.keys()):
            mine, theirs = first.get(key, set()), other.get(key, set())
            if mine != theirs:
                lacking, extra = sorted(mine - theirs), sorted(theirs - mine)
                raise ValueError(f"{run} and {runs[0]} do not share the questions of {key[0]}/{key[1]}: {run} lacks "
                                 f"{len(lacking)} (e.g. {lacking[:3]}) and adds {len(extra)} (e.g. {extra[:3]}); "
                                 "evaluate every seed on the same split and data sets")


def difference_rows(runs: Sequence[Path], baseline: Sequence[Path]) -> list[dict[str, Any]]:
    """One row per data set and pool: the paired difference ``runs`` − ``baseline`` (seed ``i`` of one against seed
    ``i`` of the other, question by question), its mean [crossed seeds × questions interval, bounded to [−1, 1]] and
    each seed's mean difference. Both sets must be over the same questions (:func:`check_questions`)."""
    if len(runs) != len(baseline):
        raise ValueError(f"--vs gives {len(baseline)} folder(s) for {len(runs)} run(s): pair each seed with one")
    scores, against = [retrieval_scores(run) for run in runs], [retrieval_scores(run) for run in baseline]
    check_questions([runs[0], baseline[0]], [scores[0], against[0]])
    rows = []
    for dataset, by_pool in scores[0].items():
        for pool, queries in by_pool.items():
            matrix = [[mine[dataset][pool][q] - theirs[dataset][pool][q] for q in queries]
                      for mine, theirs in zip(scores, against)]
            rows.append({"dataset": dataset, "pool": pool, **interval_row(matrix, bounds=(-1.0, 1.0))})
    return rows


def difference_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`difference_rows` as Markdown (x100, signed)."""
    lines = ["| data set | pool | difference [95 %] | per seed |", "|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['pool']} | {100 * r['mean']:+.1f} [{100 * r['low']:+.1f}, "
              f"{100 * r['high']:+.1f}] | {' / '.join(f'{100 * v:+.1f}' for v in r['seeds'])} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="one evaluation folder per seed")
    parser.add_argument("--corpus", required=True, type=Path, help="page corpus of the pools (chance)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--vs", nargs="+", type=Path, default=[], metavar="RUN",
                        help="one folder per seed of a baseline over the same questions, in the runs' seed order: "
                             "print the paired difference (runs - baseline) instead")
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = parser.parse_args(argv)
    # docs/regions/test_pages_s0, the repository's, from anywhere
    args.runs, args.vs = [local_path(run) for run in args.runs], [local_path(run) for run in args.vs]
    missing = [str(run) for run in [*args.runs, *args.vs] if not run.is_dir()]
    if missing:
        parser.exit(2, f"error: no such evaluation folder: {', '.join(missing)}\n")
    try:
        for runs in filter(None, (args.runs, args.vs)):
            check_runs(runs)
        rows = difference_rows(args.runs, args.vs) if args.vs else retrieval_rows(args.runs, args.corpus, args.split)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    table = difference_table(rows) if args.vs else retrieval_table(rows)
    print(table)
    if args.out:
        write_text(with_extension(args.out, ".md"), table + "\n")
        write_json(with_extension(args.out, ".json"), {"runs": [str(run) for run in args.runs],
                                                   **({"vs": [str(run) for run in args.vs]} if args.vs else {}),
                                                   "rows": rows})


if __name__ == "__main__":
    main()
