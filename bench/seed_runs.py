"""The command line of a bench that trains one ``train.py`` run per seed (bench/reader.py, bench/late_interaction.py);
apart from bench/common.py, whose GPU benches must not import the task layer (FAISS, trec_eval)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hkrag.tasks.common import check_seeds


def seed_runs_parser(description: str, out: str, out_help: str) -> argparse.ArgumentParser:
    """The options of a bench that trains one run per seed: ``--out``, ``--seeds``, ``--workers`` and ``train.py``
    overrides for every run (:func:`parse_seed_runs` reads them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path(out), help=out_help)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=1, help="runs side by side, one process each")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run")
    return parser


def parse_seed_runs(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments; repeated seeds or a seed among the overrides end the command with the reason."""
    args = parser.parse_args()
    try:
        check_seeds(args.seeds, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    return args
