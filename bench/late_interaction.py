"""Late interaction against dense at the same warm start and budget (issue 32): ``experiment=reader_li_tiny`` with
``model.head=late_interaction`` and with ``model.head=dense``, once per seed (finished runs are kept), then each
head's nDCG@5 on the test split and their paired difference, with crossed seeds × queries 95 % t intervals
(:func:`hkrag.stats.crossed_interval`, :func:`hkrag.stats.crossed_difference`), as the chain reports its figures.

    python bench/late_interaction.py --out outputs/li_bench --seeds 0 1 2
    python bench/late_interaction.py --out outputs/li_bench_1000 --seeds 0 1 2 -- trainer.max_steps=1000

Extra arguments (after ``--``) are ``train.py`` overrides for every run. bench/RESULTS.md and
docs/training.md "Late interaction" record the figures.
"""

from __future__ import annotations

import time
from pathlib import Path

from common import machine
from seed_runs import parse_seed_runs, seed_runs_parser

from hkrag.stats import crossed_difference, crossed_interval
from hkrag.tasks.chain import retrieval_scores
from hkrag.tasks.common import REPORT_FILE, run_jobs

HEADS = {"dense": "dense", "li": "late_interaction"}
STYLES = ("synchart", "synslide", "syntable", "syninfo")
ROWS = [("synfine", "all"), ("synfine", "single"), *((style, "all") for style in STYLES),
        *((style, "single") for style in STYLES)]


def cell(result: dict) -> str:
    return f"{100 * result['mean']:.1f} [{100 * result['low']:.1f}, {100 * result['high']:.1f}]"


def difference(result: dict) -> str:
    return f"{100 * result['diff']:+.1f} [{100 * result['low']:+.1f}, {100 * result['high']:+.1f}]"


def table(out: Path, seeds: list[int]) -> str:
    """Markdown: per data set and pool, each head's mean [interval] and late interaction − dense [interval]."""
    scores = {head: [retrieval_scores(out / f"{head}_s{seed}") for seed in seeds] for head in HEADS}
    lines = ["| data set | pool | dense | late interaction | late interaction − dense |", "|---|---|---|---|---|"]
    for dataset, pool in ROWS:
        queries = sorted(scores["dense"][0][dataset][pool])
        matrix = {head: [[run[dataset][pool][q] for q in queries] for run in runs] for head, runs in scores.items()}
        dense, late = (crossed_interval(matrix[head], bounds=(0, 1)) for head in HEADS)
        lines.append(f"| `{dataset}` | {pool} | {cell(dense)} | {cell(late)} | "
                     f"{difference(crossed_difference(matrix['li'], matrix['dense']))} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_seed_runs(seed_runs_parser(__doc__.split("\n\n")[0], "outputs/li_bench",
                                            "run folders <head>_s<seed>"))
    start = time.perf_counter()
    jobs = [(args.out / f"{name}_s{seed}", ["experiment=reader_li_tiny", f"model.head={head}", f"trainer.seed={seed}",
                                            *args.overrides], "train", REPORT_FILE)
            for seed in args.seeds for name, head in HEADS.items()]
    for name, seconds in run_jobs(jobs, args.workers, "late interaction vs dense"):
        print(f"{name}: {seconds / 60:.1f} min")
    print(f"machine: {machine()}; {args.workers} worker(s); {(time.perf_counter() - start) / 60:.1f} min wall")
    print(f"experiment=reader_li_tiny, seeds {args.seeds}, nDCG@5 x100 on the test split, 95 % crossed intervals\n")
    print(table(args.out, args.seeds))


if __name__ == "__main__":
    main()
