"""The paper's Tables 5 and 6 at CPU scale in one resumable command, with verdicts (docs/training.md, "The replica").

    python -m hkrag.tasks.replica --out outputs/replica  # 5 seeds: Table 5 rows, alpha x beta grid, dot, Table 6
    python -m hkrag.tasks.replica --out outputs/replica --quick  # 2 seeds: Table 5 rows and Table 6 only

1. **Warm start**: one ``train.py`` run (``experiment=reader_tiny``: the tiny retriever that reads fine print,
   ``loss=infonce``, seed 0) into ``<out>/warmstart``; every job continues from its adapter with the same
   experiment's settings, so every row starts from the same InfoNCE-fine-tuned reader (the warm start's evaluation
   is each job's step 0). ``--experiment scratch_tiny`` replays the earlier replica from random weights.
2. **Jobs**: every condition x seed continues the warm start for the same number of steps (``--steps``), evaluated
   every ``--eval-every`` steps (``trainer.eval_every``: the learning curves), into ``<out>/jobs/<condition>-s<seed>``
   with the ``.hydra/overrides.yaml`` a Hydra multirun writes. Conditions: the Table 5 rows (``loss=infonce``,
   ``hkrag``, ``no_sin``, ``no_din``), the alpha x beta grid of ``loss=hkrag`` and the dot-product reading of the
   masked similarity (``loss.masked_similarity=dot``); with ``--hard-negatives N``, InfoNCE and HKRAG-Ret trained
   with N hard negatives per query mined from the warm start (``<out>/hard_negatives.json``).
3. **Table 6** (:mod:`hkrag.tasks.table6`, into ``<out>/table6``): its generator (``experiment=`` its default,
   ``generator_training.init_from=<out>/warmstart``, ``--generator-steps``) trained once per seed, every
   configuration (``single_pass``, ``no_pruner``, ``no_decoupler``, ``hkrag``) on the gold pages and on the warm
   start's top 3; and the Judger-threshold sweep over h on gold pages (the first seed's generator,
   ``<out>/table6/sweep``).
4. **Report**: ``<out>/replica.{md,json}`` and one plot per table: for the retriever tables
   (:func:`hkrag.retrieval.ablation.summarize`) crossed seeds x queries intervals, Holm-corrected Table 5 verdicts,
   learning curves; for Table 6 :mod:`hkrag.tasks.table6`'s report (crossed seeds x questions intervals, routes,
   cost per query, verdicts with *not testable* read from the traces); the compute each part took.

A finished job (its ``report.json`` written) is skipped by a rerun; an unfinished one continues from its latest
checkpoint where it saved one under the same overrides, else starts again from scratch (:func:`run_job`).
Jobs run in this process, one after the other (``python train.py`` semantics, Hydra's composition included), or
with ``--workers N`` N at a time in spawned processes (:func:`run_jobs`); docs/training.md gives the committed
run's compute.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hkrag.index import mine
from hkrag.io import write_bytes, write_json, write_text
from hkrag.rag.report import REPORT_FILE as RAG_REPORT
from hkrag.rag.report import sweep_summary
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.retrieval.ablation import (
    TABLE5_CLAIMS,
    load_run,
    log_summary,
    markdown,
    plot,
    summarize,
    write_per_query,
)
from hkrag.run_log import RunLogger
from hkrag.stats import Claim
from hkrag.tasks import table6
from hkrag.tasks.common import (
    FINAL_ADAPTER,
    REPORT_FILE,
    TIMINGS_FILE,
    check_seeds,
    read_timings,
    record_time,
    run_job,
    run_jobs,
)
from hkrag.tasks.table6 import Table6Config

logger = logging.getLogger(__name__)

RETRIEVAL_REPORT = "retrieval.json"
"""What a finished ``eval.py task=retrieval`` writes last."""


@dataclass(frozen=True)
class Condition:
    """One row: a name and the ``train.py`` overrides that make it."""

    name: str
    overrides: tuple[str, ...]


TABLE5 = (Condition("infonce", ("loss=infonce",)), Condition("hkrag", ("loss=hkrag",)),
          Condition("no_sin", ("loss=no_sin",)), Condition("no_din", ("loss=no_din",)))
"""Table 5's rows (conf/loss/*.yaml; docs/losses.md gives the mapping)."""
DEFAULT_ALPHA, DEFAULT_BETA = 0.5, 1.0
"""``loss=hkrag``'s alpha and beta (conf/loss/hkrag.yaml): the grid's cell that is Table 5's ``hkrag`` row."""


def grid(alphas: Sequence[float], betas: Sequence[float]) -> tuple[Condition, ...]:
    """``loss=hkrag`` at every alpha x beta but the default (Table 5's ``hkrag`` row)."""
    return tuple(Condition(f"hkrag a={a:g} b={b:g}", ("loss=hkrag", f"loss.alpha={a:g}", f"loss.beta={b:g}"))
                 for a in alphas for b in betas if (a, b) != (DEFAULT_ALPHA, DEFAULT_BETA))


DOT = Condition("hkrag dot", ("loss=hkrag", "loss.masked_similarity=dot"))
"""The other reading of Eq. 3's masked similarity (docs/losses.md)."""
HARD_NEGATIVES_FILE = "hard_negatives.json"
HARD_NEGATIVE_CLAIMS = (
    Claim("With mined hard negatives, HKRAG-Ret beats InfoNCE", "hkrag hn", "infonce hn"),
    Claim("With mined hard negatives, HKRAG-Ret beats InfoNCE on fine print", "hkrag hn", "infonce hn", "fine_print"),
)
"""Ours, not the paper's: where fine-print sensitivity should matter most (issue 20)."""
PAPER_THRESHOLD = 0.8
FINE_PRINT_SPLITS = ("synfine",)
"""Data sets reported as their own column besides the evidence types: the built-in fine-print split (docs/data.md)."""


@dataclass
class ReplicaConfig:
    """What the replica runs; ``overrides`` go to every ``train.py`` run (e.g. ``paths.data_dir=...``)."""

    out: Path
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    steps: int = 324
    eval_every: int = 54
    experiment: str = "reader_tiny"
    """The ``train.py`` experiment of the warm start and of every job (conf/experiment)."""
    warm_overrides: Sequence[str] = ("loss=infonce", "trainer.seed=0")
    alphas: Sequence[float] = (0.5, 1.0, 2.0)
    betas: Sequence[float] = (0.25, 1.0)
    similarity: bool = True
    hard_negatives: int = 0
    """Mined hard negatives per query for the hard-negative table (0: no such table; ``--hard-negatives``)."""
    generator_steps: int | None = 1500
    """Generator fine-tuning steps for Table 6 (None: no Table 6)."""
    thresholds: Sequence[float] = (0.2, 0.5, 0.8, 0.95)
    overrides: Sequence[str] = ()
    eval_overrides: Sequence[str] = ()
    """``eval.py`` overrides for every Table 6 run (e.g. ``paths.data_dir=...``, ``rag.max_queries=...``)."""
    margin: float = 0.01
    workers: int = 1
    """Jobs run side by side, each in its own process with ``cpus // workers`` threads (``--workers``)."""
    tables: dict[str, tuple[Condition, ...]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.seeds or self.steps < 1 or not 0 <= self.eval_every or self.workers < 1:
            raise ValueError(f"the replica needs seeds, steps >= 1, eval_every >= 0 and workers >= 1: got "
                             f"seeds={list(self.seeds)}, steps={self.steps}, eval_every={self.eval_every}, "
                             f"workers={self.workers}")
        check_seeds(self.seeds, self.overrides)
        self.out = Path(self.out)
        self.tables = {"table5": TABLE5}
        if len(self.alphas) * len(self.betas) > 1:
            self.tables["grid"] = (TABLE5[0], TABLE5[1], *grid(self.alphas, self.betas))
        if self.similarity:
            self.tables["similarity"] = (TABLE5[0], TABLE5[1], DOT)
        if self.hard_negatives:
            mined = [f"trainer.hard_negatives={self.hard_negatives}",
                     f"trainer.negatives_file={self.out / HARD_NEGATIVES_FILE}"]
            self.tables["hard_negatives"] = (Condition("infonce hn", ("loss=infonce", *mined)),
                                             Condition("hkrag hn", ("loss=hkrag", *mined)))

    def conditions(self) -> list[Condition]:
        """Every condition once, in table order."""
        return list(dict.fromkeys(c for table in self.tables.values() for c in table))


def job_folder(out: Path, condition: Condition, seed: int) -> Path:
    return out / "jobs" / f"{condition.name.replace(' ', '_').replace('=', '')}-s{seed}"


def run_replica(config: ReplicaConfig) -> dict[str, Any]:
    """Run (or resume) every job, then write ``replica.{md,json}`` and the plots; returns the report's JSON."""
    out = config.out
    timings = read_timings(out)
    warm = out / "warmstart"
    experiment = f"experiment={config.experiment}"
    timings["warmstart"] = (run_job(warm, [experiment, *config.warm_overrides, *config.overrides])
                            or timings.get("warmstart", 0.0))
    write_json(out / TIMINGS_FILE, timings)
    if config.hard_negatives:
        mine_hard_negatives(config, timings)
    jobs = [(job_folder(out, c, seed), [experiment, *c.overrides, f"trainer.seed={seed}",
                                          f"model.adapter={warm / FINAL_ADAPTER}", f"trainer.max_steps={config.steps}",
                                          "trainer.epochs=1000", f"trainer.eval_every={config.eval_every}",
                                          *config.overrides],
             "train", REPORT_FILE) for c in config.conditions() for seed in config.seeds]
    for name, seconds in run_jobs(jobs, config.workers):
        record_time(timings, out, name, seconds)
    table6_summary = run_table6(config, timings) if config.generator_steps else None
    return write_report(config, timings, table6_summary)


def mine_hard_negatives(config: ReplicaConfig, timings: dict[str, float]) -> Path:
    """The warm start's hard negatives for every training query (:mod:`hkrag.index.mine`, depth 30, 8 kept): its
    retrieval evaluation on the training split (``<out>/mining``), then the mined file ``<out>/hard_negatives.json``."""
    mining, out = config.out / "mining", config.out / HARD_NEGATIVES_FILE
    train_split = ["task=retrieval", f"run_dir={config.out / 'warmstart'}", "eval.split=train", "eval.pools=[single]",
                   "data.eval_datasets=[${data.train.qa_config}]"]
    record_time(timings, config.out, "mining", run_job(mining, [*config.eval_overrides, *train_split], "eval",
                                                  RETRIEVAL_REPORT))
    if not out.is_file():
        corpus = next(mining.glob("embeddings-*"))
        mine.main(["--queries", str(mining / "queries"), "--corpus", str(corpus), "--qrels", str(mining / "qrels.json"),
                   "--out", str(out)])
    return out


def table6_config(config: ReplicaConfig) -> Table6Config:
    """Table 6 of the replica (:mod:`hkrag.tasks.table6`): its generator started from the warm start's weights and
    trained for ``generator_steps`` once per seed, the warm start ranking the retrieved pages (of training and of
    evaluation)."""
    warm = config.out / "warmstart"
    return Table6Config(config.out / "table6", seeds=config.seeds, experiment=table6.EXPERIMENT,
                        generator_steps=config.generator_steps, reader=warm,
                        overrides=[f"generator_training.init_from={warm}",
                                   f"generator_training.retriever.run_dir={warm}", *config.overrides],
                        eval_overrides=config.eval_overrides, workers=config.workers)


def sweep_runs(config: ReplicaConfig) -> dict[float, tuple[Path, list[str]]]:
    """``h -> (folder, overrides)`` of the Judger-threshold sweep: ``generator=hkrag`` on gold pages, served by the
    first seed's generator; the paper's h is Table 6's own run."""
    t6, seed = table6_config(config), config.seeds[0]
    runs = {PAPER_THRESHOLD: (table6.run_folder(t6, "gold", "hkrag", seed), [])}
    runs.update({h: (t6.out / "sweep" / f"gold-hkrag-h{h:g}",
                     [*table6.PAGES["gold"], "generator=hkrag", f"generator.threshold={h:g}",
                      *table6.serve_overrides(t6, seed), *config.eval_overrides])
                 for h in config.thresholds if h != PAPER_THRESHOLD})
    return runs


def run_table6(config: ReplicaConfig, timings: dict[str, float]) -> dict[str, Any]:
    """Table 6 (:func:`hkrag.tasks.table6.run_table6`, in ``<out>/table6``), then the threshold sweep (skipping
    finished runs); returns Table 6's report."""
    t6 = table6_config(config)
    report = table6.run_table6(t6)
    for name, seconds in read_timings(t6.out).items():
        record_time(timings, config.out, f"table6/{name}", seconds)
    sweep = [(folder, overrides, "eval", RAG_REPORT) for folder, overrides in sweep_runs(config).values() if overrides]
    for name, seconds in run_jobs(sweep, config.workers, "threshold sweep"):
        record_time(timings, config.out, name, seconds)
    return report


RETRIEVER_PER_QUERY = "retriever_per_query.jsonl"
"""Every retriever job's per-query nDCG@5 (:func:`hkrag.retrieval.ablation.per_query_lines`): the retriever tables'
intervals re-derive from it with :func:`hkrag.retrieval.ablation.load_per_query` and ``summarize``."""


def write_report(config: ReplicaConfig, timings: dict[str, float],
                 table6_summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summaries of every table into ``replica.{md,json}`` and ``<table>.png`` in ``config.out``, the retriever
    jobs' per-query scores behind them into :data:`RETRIEVER_PER_QUERY`, and Table 6's (:func:`run_table6`'s
    report) when given."""
    report: dict[str, Any] = {"settings": _settings(config), "timings": timings, "tables": {}}
    sections = [_header(config, timings)]
    loaded = {(c.name, seed): replace(load_run(job_folder(config.out, c, seed)), condition=c.name)
              for c in config.conditions() for seed in config.seeds}
    write_per_query(config.out / RETRIEVER_PER_QUERY, list(loaded.values()))
    for name, conditions in config.tables.items():
        runs = [loaded[c.name, seed] for c in conditions for seed in config.seeds]
        claims = {"table5": TABLE5_CLAIMS, "hard_negatives": HARD_NEGATIVE_CLAIMS}.get(name, ())
        summary = summarize(runs, conditions[0].name, margin=config.margin, claims=claims, datasets=FINE_PRINT_SPLITS)
        report["tables"][name] = summary
        sections.append(markdown(summary, TITLES[name]).replace("# Ablation: ", "## ", 1)
                        .replace("\n## ", "\n### ") + f"\n![{name}]({name}.png)\n")
        write_bytes(config.out / f"{name}.png", plot(summary))
    if table6_summary is not None:
        report["table6"], section = table6_report(config, table6_summary)
        sections.append(section)
    write_json(config.out / "replica.json", report)
    write_text(config.out / "replica.md", "\n".join(sections))
    print(sections[0])
    log_report(config.out, report)
    return report


def log_report(out: Path, report: dict[str, Any]) -> None:
    """The replica in a W&B run of its own when W&B is enabled (``WANDB_MODE``): each retriever table's scores,
    differences and verdicts, Table 6 per page setting and its verdicts as tables; the plots as images;
    ``replica.{md,json}``, the timings and the plots as an artifact."""
    run_logger = RunLogger.from_defaults(out, f"replica {out.name}", report["settings"])
    plots = [f"{name}.png" for name in report["tables"]]
    for name, summary in report["tables"].items():
        log_summary(run_logger, summary, name)
        run_logger.image(f"{name}/plot", out / f"{name}.png")
    for pages, summary in report.get("table6", {}).get("sets", {}).items():
        run_logger.table(f"table6/{pages}", *table6.score_rows(summary))
        run_logger.table(f"table6/{pages}/verdicts", *table6.verdict_rows(summary))
    if "table6" in report:
        plots.append("table6/sweep.png")
        run_logger.image("table6/sweep", out / plots[-1])
    run_logger.artifact("replica-report", "report", out, ["replica.json", "replica.md", TIMINGS_FILE, *plots])
    run_logger.finish()


def table6_report(config: ReplicaConfig, report: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Table 6's report (:mod:`hkrag.tasks.table6`) as the replica's section, and the sweep over h."""
    sweep = sweep_summary({h: load_trace(folder / MERGED_FILE) for h, (folder, _) in sweep_runs(config).items()},
                          config.out / "table6")
    t6 = table6_config(config)
    lines = ["## Table 6: the generator ablation\n",
             f"`experiment={t6.experiment}` started from the warm start's weights, {config.generator_steps} steps "
             f"per seed; every configuration answers the same test queries (`table6/table6.md`, per-query data "
             f"`table6/{table6.QUERIES_FILE}`).\n", table6.markdown(report).replace("\n### ", "\n#### "),
             "### Judger threshold h (gold pages, `generator=hkrag`, the first seed's generator)\n", sweep["table"], "",
             "![sweep](table6/sweep.png)\n"]
    return {**report, "sweep": sweep["rows"]}, "\n".join(lines)


TITLES = {"table5": "Table 5: the loss ablation",
          "hard_negatives": "mined hard negatives (trainer.hard_negatives): HKRAG-Ret against InfoNCE",
          "grid": "alpha x beta grid of loss=hkrag (vs InfoNCE)",
          "similarity": "masked similarity: cosine (hkrag) against dot (hkrag dot)"}


def _header(config: ReplicaConfig, timings: dict[str, float]) -> str:
    total = sum(timings.values())
    return (f"# Replica of the paper's Table 5 at CPU scale\n\n"
            f"Every job continues the warm start (`experiment={config.experiment} "
            f"{' '.join(config.warm_overrides)}`) with the same experiment for "
            f"{config.steps} steps, evaluated every {config.eval_every}; seeds {list(config.seeds)}; extra "
            f"overrides {list(config.overrides) or 'none'}. Compute: {total / 60:.1f} min in all "
            f"(warm start {timings.get('warmstart', 0) / 60:.1f} min, {len(timings) - 1} jobs timed in this folder; "
            f"`timings.json`).\n")


def _settings(config: ReplicaConfig) -> dict[str, Any]:
    return {"seeds": list(config.seeds), "steps": config.steps, "eval_every": config.eval_every,
            "experiment": config.experiment, "warm_overrides": list(config.warm_overrides),
            "overrides": list(config.overrides),
            "conditions": {c.name: list(c.overrides) for c in config.conditions()}, "margin": config.margin,
            "generator_steps": config.generator_steps,
            "thresholds": list(config.thresholds), "eval_overrides": list(config.eval_overrides),
            "hard_negatives": config.hard_negatives}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the replica (resumed when it exists)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per condition (default: 5)")
    parser.add_argument("--steps", type=int, default=324, help="steps per job after the warm start (default: 324, "
                        "the demo's 6 epochs of batch 32)")
    parser.add_argument("--eval-every", type=int, default=54, help="learning-curve interval in steps (default: 54)")
    parser.add_argument("--experiment", default="reader_tiny", help="train.py experiment of the warm start and the "
                        "jobs (default: reader_tiny; scratch_tiny: from random weights)")
    parser.add_argument("--quick", action="store_true", help="2 seeds, Table 5 rows and Table 6, no grid or dot")
    parser.add_argument("--generator-steps", type=int, default=1500,
                        help="generator fine-tuning steps for Table 6, 7 epochs of batch 8 (0: none; default: 1500)")
    parser.add_argument("--eval", action="append", default=[], dest="eval_overrides", metavar="OVERRIDE",
                        help="an eval.py override for every Table 6 run (repeat), e.g. --eval rag.max_queries=10")
    parser.add_argument("--hard-negatives", type=int, default=0,
                        help="add a table with N mined hard negatives per query (InfoNCE and HKRAG-Ret; default: 0)")
    parser.add_argument("--workers", type=int, default=1, help="jobs side by side, one process each (default: 1; "
                        "2 on 2 idle cores halves the wall time)")
    parser.add_argument("--margin", type=float, default=0.01, help="smallest effect of interest (nDCG@5, 0.01)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run (e.g. paths.data_dir=...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quick = {"seeds": range(2), "alphas": (DEFAULT_ALPHA,), "betas": (DEFAULT_BETA,), "similarity": False}
    settings = {"seeds": range(args.seeds), **(quick if args.quick else {})}
    try:
        config = ReplicaConfig(args.out, experiment=args.experiment, steps=args.steps, eval_every=args.eval_every,
                               margin=args.margin, overrides=args.overrides, eval_overrides=args.eval_overrides,
                               hard_negatives=args.hard_negatives, workers=args.workers,
                               generator_steps=args.generator_steps or None, **settings)
    except ValueError as error:  # bad arguments (e.g. trainer.seed=3 among the overrides): a usage error
        parser.error(str(error))
    run_replica(config)


if __name__ == "__main__":
    main()
