"""Late-interaction recipes chosen on a validation split (issue 32's `synfine` target): each candidate is
``experiment=reader_li_tiny`` with one change, trained once (seed 0) on the default corpus and scored on the test
split of independent corpora drawn with other data seeds (``data.synthetic.seed`` 1, 2, 3: the same generator and
sizes, 120 pages and 24 `synfine` questions each), `synfine` nDCG@5 in the `all` pool; the default corpus's test
split is never read here.

    python bench/li_validation.py --out outputs/li2

Candidates (:data:`CANDIDATES`) and their runs are kept in ``--out`` (finished ones are skipped); the table lists
each candidate's score per validation corpus and their mean over the 72 questions. ``--test NAME`` then trains the
chosen candidate for seeds 0, 1, 2 (seed 0's run is the validated one), evaluates each on the default corpus's test
split (every data set, both pools) and compares it with the committed 300-step runs at the same warm start and
budget (docs/late_interaction/infonce_300: dense and late interaction with InfoNCE), crossed seeds x queries 95 %
intervals as bench/late_interaction.py reports them. docs/training.md "Late interaction" records the figures and
the choice.

    python bench/li_validation.py --out outputs/li2 --test dim64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from late_interaction import ROWS, cell, difference

from hkrag.retrieval.evaluation import PER_QUERY_FILE
from hkrag.stats import crossed_difference, crossed_interval
from hkrag.tasks.chain import retrieval_scores
from hkrag.tasks.common import REPORT_FILE, run_jobs

CANDIDATES = {
    "ce": [],  # the experiment as it is: InfoNCE over MaxSim
    "pw": ["loss=colbert_pairwise", "loss.pairwise_tau=0.05"],  # as measured: the experiment's tau, before pairwise_tau
    "nogroup": ["trainer.group_pattern=null"],
    "tau02": ["loss.tau=0.02"],
    "qa0": ["model.late_interaction.query_augmentation=0"],
    "lr3e4": ["optim.lr=3e-4"],
    "dim64": ["model.late_interaction.dim=64"],
}
"""Name -> the one change to experiment=reader_li_tiny it makes."""
VALIDATION_SEEDS = (1, 2, 3)
TEST_SEEDS = (0, 1, 2)
COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "late_interaction" / "infonce_300"
"""bench/late_interaction.py's 300-step runs (``dense_s<seed>``, ``li_s<seed>``): their per-query nDCG@5."""


def training(out: Path, name: str, seed: int) -> tuple[Path, list[str], str, str]:
    """Candidate ``name``'s training run for ``seed`` (no evaluation: the validation or test one follows)."""
    return (out / f"{name}_s{seed}", ["experiment=reader_li_tiny", f"trainer.seed={seed}", "eval_before_after=false",
                                      *CANDIDATES[name]], "train", REPORT_FILE)


def jobs(out: Path, names: list[str]) -> list[tuple[Path, list[str], str, str]]:
    """Each candidate's training run, then its evaluation on every validation corpus."""
    train = [training(out, name, 0) for name in names]
    validate = [(out / f"val{data}_{name}_s0", ["task=retrieval", f"run_dir={out / f'{name}_s0'}",
                                                f"paths.data_dir={out / f'data_val{data}'}",
                                                f"data.synthetic.seed={data}", "data.eval_datasets=[synfine]",
                                                "eval.pools=[all]"], "eval", PER_QUERY_FILE)
                for name in names for data in VALIDATION_SEEDS]
    return train + validate


def score(folder: Path) -> list[float]:
    """Each validation question's nDCG@5 (`synfine`, `all` pool) in an evaluation folder."""
    return [row["ndcg@5"] for row in json.loads((folder / PER_QUERY_FILE).read_text())["synfine"]["all"].values()]


def table(out: Path, names: list[str]) -> str:
    """Markdown: per candidate, nDCG@5 x100 on each validation corpus and the mean over all their questions."""
    lines = ["| candidate | change | " + " | ".join(f"data seed {d}" for d in VALIDATION_SEEDS) + " | mean |",
             "|---|---|" + "---|" * (len(VALIDATION_SEEDS) + 1)]
    for name in names:
        scores = [score(out / f"val{data}_{name}_s0") for data in VALIDATION_SEEDS]
        every = [value for part in scores for value in part]
        cells = [f"{100 * sum(part) / len(part):.1f}" for part in scores] + [f"{100 * sum(every) / len(every):.1f}"]
        lines.append(f"| {name} | {' '.join(CANDIDATES[name]) or 'none (InfoNCE)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_jobs(out: Path, name: str) -> list[tuple[Path, list[str], str, str]]:
    """The chosen candidate's runs for every test seed, then each one's evaluation on the test split."""
    return [training(out, name, seed) for seed in TEST_SEEDS] + [
        (out / f"test_{name}_s{seed}", ["task=retrieval", f"run_dir={out / f'{name}_s{seed}'}"], "eval",
         PER_QUERY_FILE) for seed in TEST_SEEDS]


def test_table(out: Path, name: str) -> str:
    """Markdown: per data set and pool, dense, late interaction with InfoNCE and the chosen candidate (mean
    [interval]), and the candidate's paired differences from the two."""
    scores = {"dense": [retrieval_scores(COMMITTED / f"dense_s{seed}") for seed in TEST_SEEDS],
              "li": [retrieval_scores(COMMITTED / f"li_s{seed}") for seed in TEST_SEEDS],
              name: [retrieval_scores(out / f"test_{name}_s{seed}") for seed in TEST_SEEDS]}
    lines = [f"| data set | pool | dense | late interaction | {name} | {name} − dense | {name} − late interaction |",
             "|---|---|---|---|---|---|---|"]
    for dataset, pool in ROWS:
        queries = sorted(scores["dense"][0][dataset][pool])
        matrix = {head: [[run[dataset][pool][q] for q in queries] for run in runs] for head, runs in scores.items()}
        means = [cell(crossed_interval(matrix[head], bounds=(0, 1))) for head in scores]
        diffs = [difference(crossed_difference(matrix[name], matrix[other])) for other in ("dense", "li")]
        lines.append(f"| `{dataset}` | {pool} | " + " | ".join(means + diffs) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/li_validation"))
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--test", choices=list(CANDIDATES), help="the chosen candidate: its three seeds on the test "
                        "split against the committed 300-step runs")
    args = parser.parse_args()
    start = time.perf_counter()
    todo = jobs(args.out, args.candidates) + (test_jobs(args.out, args.test) if args.test else [])
    for name, seconds in run_jobs(todo, desc="late-interaction validation"):
        print(f"{name}: {seconds / 60:.1f} min")
    print(table(args.out, args.candidates))
    if args.test:
        print(test_table(args.out, args.test))
    print(f"wall: {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
