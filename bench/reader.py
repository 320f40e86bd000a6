"""The tiny reader's retrieval targets over seeds (issue 23): ``experiment=reader_tiny`` trained once per seed
(finished runs are kept), then nDCG@5 on the test split per data set and pool, with a crossed seeds × queries 95 %
t interval (:func:`hkrag.stats.crossed_interval`) against random ranking's expected nDCG@5.

    python bench/reader.py --out outputs/reader --seeds 0 1 2 --workers 2

Extra arguments are ``train.py`` overrides for every run. docs/training.md "A tiny model that reads" reads the
figures; bench/RESULTS.md records them.
"""

from __future__ import annotations

import time
from pathlib import Path

from common import machine
from seed_runs import parse_seed_runs, seed_runs_parser

from hkrag.tasks.chain import retrieval_rows, retrieval_table
from hkrag.tasks.common import REPORT_FILE, run_jobs


def main() -> None:
    parser = seed_runs_parser(__doc__.split("\n\n")[0], "outputs/reader", "one run folder per seed: s<seed>")
    parser.add_argument("--corpus", type=Path, default=Path("data/synthetic/corpus"), help="the built-in corpus")
    args = parse_seed_runs(parser)
    runs = [args.out / f"s{seed}" for seed in args.seeds]
    start = time.perf_counter()
    jobs = [(run, ["experiment=reader_tiny", f"trainer.seed={seed}", *args.overrides], "train", REPORT_FILE)
            for run, seed in zip(runs, args.seeds)]
    for name, seconds in run_jobs(jobs, args.workers, "reader runs"):
        print(f"{name}: {seconds / 60:.1f} min")
    print(f"machine: {machine()}; {args.workers} worker(s); {(time.perf_counter() - start) / 60:.1f} min wall")
    print(f"experiment=reader_tiny, seeds {args.seeds}, nDCG@5 x100 on the test split\n")
    print(retrieval_table(retrieval_rows(runs, args.corpus)))


if __name__ == "__main__":
    main()
