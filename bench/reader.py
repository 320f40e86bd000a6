"""The tiny reader's retrieval targets over seeds (issue 23): ``experiment=reader_tiny`` trained once per seed
(finished runs are kept), then nDCG@5 on the test split per data set and pool, with a hierarchical 95 % interval
(seeds, then queries: :func:`hkrag.stats.hierarchical_bootstrap`) against random ranking's expected nDCG@5.

    python bench/reader.py --out outputs/reader --seeds 0 1 2 --workers 2

Extra arguments are ``train.py`` overrides for every run. docs/training.md "A tiny model that reads" reads the
figures; bench/RESULTS.md records them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from common import machine

from hkrag.data.opendocvqa import load_corpus, pools
from hkrag.retrieval.evaluation import AFTER_TRAINING_DIR, PER_QUERY_FILE
from hkrag.stats import hierarchical_bootstrap
from hkrag.tasks.replica import REPORT_FILE, run_jobs

TOP_K = 5


def chance_ndcg(pool_size: int, k: int = TOP_K) -> float:
    """Expected nDCG@k of a random ranking of ``pool_size`` pages holding one relevant page."""
    return sum(1 / math.log2(rank + 1) for rank in range(1, min(k, pool_size) + 1)) / pool_size


def per_query(run: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``{dataset: {pool: {query_id: ndcg@5}}}`` of a run's evaluation after training."""
    scores = json.loads((run / AFTER_TRAINING_DIR / PER_QUERY_FILE).read_text())
    return {dataset: {pool: {query: row["ndcg@5"] for query, row in queries.items()}
                      for pool, queries in by_pool.items()}
            for dataset, by_pool in scores.items()}


def table(runs: list[Path], corpus: Path) -> str:
    """Markdown rows: data set, pool, chance, mean [interval], x chance, per-seed means (all x100)."""
    scores = [per_query(run) for run in runs]
    lines = ["| data set | pool | chance | nDCG@5 [95 %] | x chance | per seed |", "|---|---|---|---|---|---|"]
    for dataset, by_pool in scores[0].items():
        for pool, queries in by_pool.items():
            matrix = [[run[dataset][pool][query] for query in queries] for run in scores]
            result = hierarchical_bootstrap(matrix)
            chance = chance_ndcg(len(load_corpus(corpus, pools(dataset)[pool], "test")))
            seeds = " / ".join(f"{100 * sum(row) / len(row):.1f}" for row in matrix)
            lines.append(f"| {dataset} | {pool} | {100 * chance:.1f} | {100 * result['mean']:.1f} "
                         f"[{100 * result['low']:.1f}, {100 * result['high']:.1f}] | {result['mean'] / chance:.1f} "
                         f"| {seeds} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/reader"), help="one run folder per seed: s<seed>")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=1, help="runs side by side, one process each")
    parser.add_argument("--corpus", type=Path, default=Path("data/synthetic/corpus"), help="the built-in corpus")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run")
    args = parser.parse_args()
    runs = [args.out / f"s{seed}" for seed in args.seeds]
    start = time.perf_counter()
    jobs = [(run, ["experiment=reader_tiny", f"trainer.seed={seed}", *args.overrides], "train", REPORT_FILE)
            for run, seed in zip(runs, args.seeds)]
    for name, seconds in run_jobs(jobs, args.workers, "reader runs"):
        print(f"{name}: {seconds / 60:.1f} min")
    print(f"machine: {machine()}; {args.workers} worker(s); {(time.perf_counter() - start) / 60:.1f} min wall")
    print(f"experiment=reader_tiny, seeds {args.seeds}, nDCG@5 x100 on the test split\n")
    print(table(runs, args.corpus))


if __name__ == "__main__":
    main()
