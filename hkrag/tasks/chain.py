"""The tiny model that reads, end to end in one resumable command: (pre-training →) retriever → generator →
answers, with issue 23's targets measured over seeds (docs/training.md, "The whole chain").

    python -m hkrag.tasks.chain --out outputs/chain                                # one seed
    python -m hkrag.tasks.chain --out outputs/chain --seeds 0 1 2 --workers 2     # the recorded targets

Per seed ``s``, each stage a ``train.py`` / ``eval.py`` run in ``<out>/<stage>/s<s>`` (a finished run is kept):

1. ``pretrain`` (only with ``--pretrain-steps N``): VDocRAG's RCR + RCG (``experiment=pretrain_tiny``, the image
   embedding trained), continued by the retriever through ``model.adapter``;
2. ``reader``: the retriever (``experiment=reader_tiny``), evaluated on the test split;
3. ``generator``: the generator started from that reader (``experiment=generator_reader_tiny``,
   ``generator_training.init_from``), checkpointed every ``--curve-every`` steps;
   ``curve``: the generator at each checkpoint on the gold pages (its learning curve);
4. ``answers``: the generator on the gold pages (``eval.py task=generation generator=single_pass``);
5. ``rag``: the whole pipeline, the reader's top page to the generator (``eval.py task=rag generator.top_k=1``:
   the generator was trained on one page per question, and three pages, a prompt it never saw, undo its reading).

The report (``<out>/chain.{md,json}``, ``curves.png``): nDCG@5 per data set and pool and relaxed accuracy per
evidence type and asked-for field, each a mean over seeds and questions with a crossed seeds × questions 95 % t
interval (:func:`hkrag.stats.crossed_interval`, bounded to [0, 1]), a verdict on each target (:meth:`Target.verdict`),
the training losses, the generator's learning curve and each stage's time; ``<out>/per_query.jsonl`` holds every
seed's per-question score behind them (:func:`per_query_lines`), so each interval can be re-derived from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir

from hkrag.data.opendocvqa import load_corpus, pools
from hkrag.data.synthetic import question_kind
from hkrag.io import png_bytes, read_json, write_bytes, write_json, write_text
from hkrag.rag.records import QueryOutcome
from hkrag.rag.report import REPORT_FILE as RAG_REPORT
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.retrieval.evaluation import AFTER_TRAINING_DIR, PER_QUERY_FILE
from hkrag.retrieval.metrics import chance_ndcg
from hkrag.stats import crossed_interval
from hkrag.tasks.common import (
    BASE_DIR,
    CONF_DIR,
    FINAL_ADAPTER,
    REPORT_FILE,
    UNGROUNDED,
    Job,
    check_seeds,
    read_timings,
    record_time,
    run_jobs,
)
from hkrag.training.checkpoint import ADAPTER_DIR, CHECKPOINTS_DIR

logger = logging.getLogger(__name__)

STAGES = ("pretrain", "reader", "generator", "curve", "answers", "rag")
CURVE_GROUPS = ("salient", "fine_print", "label", "value", "code", "page_no")
"""The question groups the generator's learning curve follows."""
FINE_PRINT = "synfine"
FIELDS = ("label", "value", "code", "year", "page_no")
"""What the built-in questions ask for (:func:`hkrag.data.synthetic.question_field`), salient ones first."""


@dataclass(frozen=True)
class Target:
    """A target of issue 23: ``name``'s mean over seeds and questions at least ``bound`` (``note``: what the
    questions leave out, and why)."""

    name: str
    bound: float
    note: str = ""

    def verdict(self, result: dict[str, float]) -> str:
        """:data:`TARGET_RULE`: ``met`` when the whole interval lies at or above the bound, ``not met`` when it lies
        wholly below, else ``not shown`` (the interval holds the bound: the data neither meet nor miss it, whichever
        side the mean falls)."""
        if result["low"] >= self.bound:
            return "met"
        return "not met" if result["high"] < self.bound else "not shown"


TARGET_RULE = ("*met*: the whole 95 % interval lies at or above the bound; *not met*: it lies wholly below; "
               "*not shown*: it holds the bound (the data neither meet nor miss it)")
"""The rule of :meth:`Target.verdict` in words, as the report states it."""


@dataclass
class ChainConfig:
    """What the chain runs; ``overrides`` go to every ``train.py`` run, ``eval_overrides`` to every ``eval.py`` run."""

    out: Path
    seeds: Sequence[int] = (0,)
    pretrain_steps: int = 0
    reader: str = "reader_tiny"
    generator: str = "generator_reader_tiny"
    generator_steps: int | None = None
    """The generator's optimizer steps (None: its experiment's)."""
    curve_every: int = 250
    """Checkpoint the generator every N steps and answer the test questions with each (its learning curve; 0: no)."""
    workers: int = 1
    overrides: Sequence[str] = ()
    eval_overrides: Sequence[str] = ()
    corpus: Path | None = None
    """The corpus source of the chance figures (default: ``data.corpus_source`` as ``train.py`` composes it)."""

    def __post_init__(self) -> None:
        if not self.seeds or min(self.pretrain_steps, self.curve_every) < 0 or self.workers < 1 or (
                self.generator_steps is not None and self.generator_steps < 1):
            raise ValueError(f"the chain needs seeds, pretrain_steps >= 0, curve_every >= 0, generator_steps >= 1 and "
                             f"workers >= 1: got seeds={list(self.seeds)}, pretrain_steps={self.pretrain_steps}, "
                             f"curve_every={self.curve_every}, generator_steps={self.generator_steps}, "
                             f"workers={self.workers}")
        check_seeds(self.seeds, self.overrides)
        self.out = Path(self.out)

    def folder(self, stage: str, seed: int) -> Path:
        return self.out / stage / f"s{seed}"

    def curve_folder(self, seed: int, step: int) -> Path:
        """The gold-page answers of seed ``seed``'s generator checkpoint at ``step``."""
        return self.out / "curve" / f"s{seed}-step-{step}"

    def stages(self) -> tuple[str, ...]:
        skipped = {"pretrain": not self.pretrain_steps, "curve": not self.curve_every}
        return tuple(stage for stage in STAGES if not skipped.get(stage))

    def jobs(self, stage: str, seed: int) -> list[Job]:
        """The runs of one stage of one seed: one, or for ``curve`` one per generator checkpoint found."""
        if stage != "curve":
            return [self.job(stage, seed)]
        return [(self.curve_folder(seed, step),
                 ["task=generation", *self.serve(seed, checkpoint / ADAPTER_DIR)], "eval", RAG_REPORT)
                for step, checkpoint in self.checkpoints(seed)]

    def checkpoints(self, seed: int) -> list[tuple[int, Path]]:
        """The generator's intermediate checkpoints ``(step, folder)``, by step."""
        found = (self.folder("generator", seed) / CHECKPOINTS_DIR).glob("step-*")
        return sorted((int(folder.name.removeprefix("step-")), folder) for folder in found)

    def serve(self, seed: int, adapter: Path | None = None) -> list[str]:
        """``eval.py`` overrides serving seed ``seed``'s generator (its final adapter unless ``adapter``)."""
        generator = self.folder("generator", seed)
        return ["generator=single_pass", "lvlm=phi3v", f"lvlm.base={generator / BASE_DIR}",
                f"lvlm.adapter={adapter or generator / FINAL_ADAPTER}", UNGROUNDED, *self.eval_overrides]

    def job(self, stage: str, seed: int) -> Job:
        """``(folder, overrides, config, done file)`` of one stage (not ``curve``) of one seed."""
        reader, serve = self.folder("reader", seed), self.serve(seed)
        pretrained = [f"model.adapter={self.folder('pretrain', seed) / FINAL_ADAPTER}"] if self.pretrain_steps else []
        steps = [f"generator_training.optim.max_steps={self.generator_steps}"] if self.generator_steps else []
        steps += [f"generator_training.optim.save_every={self.curve_every}"] if self.curve_every else []
        jobs: dict[str, tuple[list[str], str, str]] = {
            "pretrain": (["experiment=pretrain_tiny", "model.lora.modules_to_save=[vision_embed_tokens]",
                          "trainer.epochs=1000", f"trainer.seed={seed}", *self.overrides,
                          f"trainer.max_steps={self.pretrain_steps}"], "train", REPORT_FILE),
            "reader": ([f"experiment={self.reader}", f"trainer.seed={seed}", *pretrained, *self.overrides],
                       "train", REPORT_FILE),
            "generator": ([f"experiment={self.generator}", f"generator_training.init_from={reader}",
                           f"generator_training.optim.seed={seed}", *self.overrides, *steps], "train", REPORT_FILE),
            "answers": (["task=generation", *serve], "eval", RAG_REPORT),
            "rag": (["task=rag", f"run_dir={reader}", "generator.top_k=1", *serve], "eval", RAG_REPORT),
        }
        overrides, config, done = jobs[stage]
        return self.folder(stage, seed), overrides, config, done


def run_chain(config: ChainConfig) -> dict[str, Any]:
    """Run (or resume) every stage for every seed, stage by stage, then write the report; returns its JSON."""
    timings = read_timings(config.out)
    started = time.perf_counter()
    for stage in config.stages():
        jobs = [job for seed in config.seeds for job in config.jobs(stage, seed)]
        for name, seconds in run_jobs(jobs, config.workers, f"chain: {stage}"):
            record_time(timings, config.out, f"{stage}/{name}", seconds)
    record_time(timings, config.out, "wall", timings.get("wall", 0.0) + time.perf_counter() - started)
    return write_report(config, timings)


def retrieval_scores(run: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``{dataset: {pool: {query_id: ndcg@5}}}`` of a ``train.py`` run's evaluation after training, or of an
    ``eval.py task=retrieval`` output folder (its own ``per_query.json``)."""
    trained = run / AFTER_TRAINING_DIR / PER_QUERY_FILE
    return ndcg_by_query(read_json(trained if trained.is_file() else run / PER_QUERY_FILE))


def ndcg_by_query(scores: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """``{dataset: {pool: {query_id: ndcg@5}}}`` of a retrieval evaluation's ``per_query.json`` contents."""
    return {dataset: {pool: {query: row["ndcg@5"] for query, row in queries.items()}
                      for pool, queries in by_pool.items()}
            for dataset, by_pool in scores.items()}


def retrieval_rows(runs: Sequence[Path], corpus: Path, split: str = "test") -> list[dict[str, Any]]:
    """One row per data set and pool: chance (over the pages of ``corpus``'s pool), the mean [crossed interval]
    over ``runs`` (one per seed) and queries, and each seed's mean."""
    scores = [retrieval_scores(run) for run in runs]
    rows = []
    for dataset, by_pool in scores[0].items():
        for pool, queries in by_pool.items():
            matrix = [[run[dataset][pool][query] for query in queries] for run in scores]
            chance = chance_ndcg(len(load_corpus(corpus, pools(dataset)[pool], split)))
            rows.append({"dataset": dataset, "pool": pool, "chance": chance,
                         **interval_row(matrix)})
    return rows


def interval_row(matrix: Sequence[Sequence[float]], bounds: tuple[float, float] = (0.0, 1.0)) -> dict[str, Any]:
    """The crossed seeds × questions interval of a score matrix, bounded to ``bounds``, and each seed's mean."""
    interval = crossed_interval(matrix, bounds=bounds)
    return {**{k: interval[k] for k in ("mean", "low", "high", "se", "df", "method")},
            "seeds": [sum(row) / len(row) for row in matrix]}


def answer_rows(traces: Sequence[Sequence[QueryOutcome]], metric: str = "relaxed_accuracy") -> list[dict[str, Any]]:
    """Relaxed accuracy of one trace per seed (the same questions, in any order) per group of questions: all, every
    evidence type, fine print without the year questions (any year is within relaxed accuracy's 5 % of any other),
    and each asked-for field (:func:`hkrag.data.synthetic.question_kind`; other questions count in ``all`` only)."""
    by_id = [{row.query_id: row for row in trace} for trace in traces]
    questions = sorted(by_id[0].values(), key=lambda row: row.query_id)
    groups: dict[str, Callable[[QueryOutcome], bool]] = {"all": lambda row: True}
    kinds = {row.query_id: question_kind(row.question) or (None, None) for row in questions}
    for evidence in sorted({evidence for evidence, _ in kinds.values() if evidence}):
        groups[evidence] = lambda row, e=evidence: kinds[row.query_id][0] == e
    groups["fine_print, no year"] = lambda row: (kinds[row.query_id][0] == "fine_print"
                                                 and kinds[row.query_id][1] != "year")
    for name in FIELDS:
        groups[name] = lambda row, f=name: kinds[row.query_id][1] == f
    rows = []
    for name, member in groups.items():
        ids = [row.query_id for row in questions if member(row)]
        if ids:
            matrix = [[seed[query].metrics[metric] for query in ids] for seed in by_id]
            rows.append({"questions": name, "n": len(ids), **interval_row(matrix)})
    return rows


RETRIEVER_TARGETS = {("synfine", "single"): 3.0, ("synfine", "all"): 1.0}
"""Issue 23: ``synfine`` nDCG@5 at least 3x chance in its own pool, and above chance among all pages."""
ANSWER_TARGETS = (Target("salient", 0.5), Target(
    "fine_print, no year", 0.3, "year questions left out: relaxed accuracy's 5 % tolerance counts any year of "
    "2017–2024 right (hkrag.data.synthetic.question_field)"))
"""Issue 23 on gold pages: salient questions at least 50 %, fine print at least 30 % on the questions whose answer
must be read (the fine-print questions but the year ones)."""


def write_report(config: ChainConfig, timings: dict[str, float]) -> dict[str, Any]:
    """``chain.{md,json}`` and ``curves.png`` in ``config.out`` from the finished runs."""
    corpus = config.corpus or _corpus_source(config)
    retrieval = retrieval_rows([config.folder("reader", s) for s in config.seeds], corpus)
    answers = {stage: _answers(config, stage) for stage in ("answers", "rag")}
    targets = [{"target": f"{d} nDCG@5 >= {x:g}x chance ({p} pool)", "bound": x * row["chance"],
                "verdict": Target(d, x * row["chance"]).verdict(row), **_mean(row)}
               for (d, p), x in RETRIEVER_TARGETS.items() for row in retrieval
               if (row["dataset"], row["pool"]) == (d, p)]
    gold = {row["questions"]: row for row in answers["answers"]["gold"]}
    targets += [{"target": f"{t.name} relaxed accuracy >= {t.bound:.0%} (gold pages)", "bound": t.bound,
                 "verdict": t.verdict(gold[t.name]), "note": t.note, **_mean(gold[t.name])}
                for t in ANSWER_TARGETS if t.name in gold]
    report = {"settings": _settings(config), "timings": timings, "targets": targets, "retrieval": retrieval,
              "answers": answers, "curve": generator_curve(config)}
    write_json(config.out / "chain.json", report)
    write_text(config.out / PER_QUERY_LINES, "".join(json.dumps(line) + "\n" for line in per_query_lines(config)))
    write_text(config.out / "chain.md", markdown(report))
    write_bytes(config.out / "curves.png", plot_curves(config, report["curve"]))
    return report


def _answers(config: ChainConfig, stage: str) -> dict[str, list[dict[str, Any]]]:
    """Answer rows per pool of one eval stage (``gold`` for the gold pages, ``single``/``all`` for RAG)."""
    traces = [load_trace(config.folder(stage, seed) / MERGED_FILE) for seed in config.seeds]
    by_pool = sorted({row.pool for row in traces[0]})
    return {pool: answer_rows([[row for row in trace if row.pool == pool] for trace in traces]) for pool in by_pool}


def generator_curve(config: ChainConfig) -> list[dict[str, Any]]:
    """Relaxed accuracy on the gold pages at every generator checkpoint all seeds have: ``{"step", group: {"mean",
    "low", "high"}}`` for the :data:`CURVE_GROUPS`."""
    if "curve" not in config.stages():
        return []
    steps = sorted(set.intersection(*({step for step, _ in config.checkpoints(seed)} for seed in config.seeds)))
    points = []
    for step in steps:
        traces = [load_trace(config.curve_folder(seed, step) / MERGED_FILE) for seed in config.seeds]
        rows = {row["questions"]: _mean(row) for row in answer_rows(traces)}
        points.append({"step": step, **{group: rows[group] for group in CURVE_GROUPS if group in rows}})
    return points


PER_QUERY_LINES = "per_query.jsonl"


def per_query_lines(config: ChainConfig) -> list[dict[str, Any]]:
    """Every per-question score behind the report, one line per run and page set: ``{"stage", "seed", "dataset"
    (reader) or "pool" (answers, rag, curve with its "step"), "scores": {query id: score}}`` (nDCG@5 for the
    reader, relaxed accuracy for the generator), after a first line ``{"questions": {query id: [evidence,
    field]}}`` (:func:`hkrag.data.synthetic.question_kind`). An interval of the report is
    :func:`hkrag.stats.crossed_interval` of the ``(seeds, questions)`` matrix of one stage, pool and group."""
    lines: list[dict[str, Any]] = []
    kinds: dict[str, Any] = {}
    for seed in config.seeds:
        for dataset, by_pool in retrieval_scores(config.folder("reader", seed)).items():
            lines += [{"stage": "reader", "seed": seed, "dataset": dataset, "pool": pool, "scores": scores}
                      for pool, scores in by_pool.items()]
    runs = [(stage, None, config.folder(stage, seed), seed) for stage in ("answers", "rag") for seed in config.seeds]
    if "curve" in config.stages():
        runs += [("curve", step, config.curve_folder(seed, step), seed)
                 for seed in config.seeds for step, _ in config.checkpoints(seed)]
    for stage, step, folder, seed in runs:
        trace = load_trace(folder / MERGED_FILE)
        for pool in sorted({row.pool for row in trace}):
            rows = [row for row in trace if row.pool == pool]
            kinds.update({row.query_id: question_kind(row.question) for row in rows})
            lines.append({"stage": stage, **({"step": step} if step is not None else {}), "seed": seed, "pool": pool,
                          "scores": {row.query_id: row.metrics["relaxed_accuracy"] for row in rows}})
    return [{"questions": kinds}, *lines]


def _mean(row: dict[str, Any]) -> dict[str, float]:
    return {"mean": row["mean"], "low": row["low"], "high": row["high"]}


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: targets, retrieval, answers (gold pages, then RAG) and the time each stage took."""
    settings, timings = report["settings"], report["timings"]
    lines = ["# The tiny model that reads: the whole chain\n",
             f"Seeds {settings['seeds']}; stages {', '.join(settings['stages'])}; commands in docs/training.md. Means "
             "over seeds and test questions ×100 with 95 % crossed seeds × questions t intervals (two-way "
             "random-effects ANOVA, Satterthwaite df; `hkrag.stats.crossed_interval`), bounded to [0, 100]; every "
             f"seed's per-question score is in `{PER_QUERY_LINES}`.\n",
             "## Targets\n", f"Verdicts: {TARGET_RULE}.\n", "| target | bound | result [95 %] | verdict |",
             "|---|---|---|---|"]
    lines += [f"| {_target_name(t)} | {100 * t['bound']:.1f} | {_interval(t)} | {t['verdict']} |"
              for t in report["targets"]]
    lines += ["", "## Retrieval (nDCG@5, the reader)\n", retrieval_table(report["retrieval"])]
    for stage, title in (("answers", "gold pages"), ("rag", "the reader's top page")):
        for pool, rows in report["answers"][stage].items():
            lines += ["", f"## Answers on {title} (relaxed accuracy; pool `{pool}`)\n",
                      "| questions | n | relaxed accuracy [95 %] | per seed |", "|---|---|---|---|"]
            lines += [f"| {r['questions']} | {r['n']} | {_interval(r)} | {_seeds(r)} |" for r in rows]
    if report["curve"]:
        groups = [group for group in CURVE_GROUPS if group in report["curve"][0]]
        lines += ["", "## The generator's learning curve (gold pages, relaxed accuracy)\n",
                  "| step | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
        lines += [f"| {point['step']} | " + " | ".join(_interval(point[group]) for group in groups) + " |"
                  for point in report["curve"]]
    lines += ["", "## Time (seconds of compute per run; wall: the command's, summed over its invocations)\n",
              "| run | seconds |", "|---|---|"]
    lines += [f"| {name} | {seconds:.0f} |" for name, seconds in timings.items()]
    lines += ["", "![training curves](curves.png)", ""]
    return "\n".join(lines)


def _target_name(target: dict[str, Any]) -> str:
    return f"{target['target']} ({target['note']})" if target.get("note") else target["target"]


def retrieval_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`retrieval_rows` as Markdown (x100): data set, pool, chance, mean [interval], x chance, per seed."""
    lines = ["| data set | pool | chance | nDCG@5 [95 %] | x chance | per seed |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['pool']} | {100 * r['chance']:.1f} | {_interval(r)} "
              f"| {r['mean'] / r['chance']:.1f} | {_seeds(r)} |" for r in rows]
    return "\n".join(lines)


def _interval(row: dict[str, Any]) -> str:
    return f"{100 * row['mean']:.1f} [{100 * row['low']:.1f}, {100 * row['high']:.1f}]"


def _seeds(row: dict[str, Any]) -> str:
    return " / ".join(f"{100 * value:.1f}" for value in row["seeds"])


def plot_curves(config: ChainConfig, curve: Sequence[dict[str, Any]] = ()) -> bytes:
    """PNG: the training loss of every training stage against its step, one line per seed (faint: every step),
    and the generator's gold-page accuracy per question group at its checkpoints (``curve``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [stage for stage in config.stages() if stage in ("pretrain", "reader", "generator")]
    panels = len(trained) + bool(curve)
    figure, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.2), squeeze=False)
    for axis, stage in zip(axes[0], trained):
        for seed in config.seeds:
            lines = (config.folder(stage, seed) / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            steps, losses = zip(*[(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r])
            window = max(1, len(losses) // 30)
            smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
            line, = axis.plot(steps, losses, linewidth=0.5, alpha=0.25)
            axis.plot(steps[window - 1:], smooth, color=line.get_color(), linewidth=1.2, label=f"seed {seed}")
        axis.set(title=stage, xlabel="step", ylabel=f"training loss (running mean of {window} steps)", yscale="log")
        axis.legend(fontsize=7)
    if curve:
        axis, steps = axes[0][-1], [point["step"] for point in curve]
        for group in (group for group in CURVE_GROUPS if group in curve[0]):
            mean = [100 * point[group]["mean"] for point in curve]
            line, = axis.plot(steps, mean, marker="o", markersize=3, label=group)
            axis.fill_between(steps, [100 * p[group]["low"] for p in curve], [100 * p[group]["high"] for p in curve],
                              color=line.get_color(), alpha=0.12)
        axis.set(title="generator on gold pages", xlabel="step", ylabel="relaxed accuracy ×100 [95 %]",
                 ylim=(-2, 102))
        axis.legend(fontsize=7)
    figure.tight_layout()
    return png_bytes(figure, dpi=110)


def _corpus_source(config: ChainConfig) -> Path:
    """The corpus the reader was evaluated on, as ``train.py`` composes it from the chain's overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return Path(compose("train", [f"experiment={config.reader}", *config.overrides]).data.corpus_source)


def _settings(config: ChainConfig) -> dict[str, Any]:
    return {"seeds": list(config.seeds), "stages": list(config.stages()), "pretrain_steps": config.pretrain_steps,
            "reader": config.reader, "generator": config.generator, "generator_steps": config.generator_steps,
            "overrides": list(config.overrides),
            "eval_overrides": list(config.eval_overrides), "curve_every": config.curve_every,
            "runs": {stage: jobs[0][1] for stage in config.stages() if (jobs := config.jobs(stage, config.seeds[0]))}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the chain (resumed when it exists)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default: 0)")
    parser.add_argument("--pretrain-steps", type=int, default=0,
                        help="VDocRAG RCR + RCG pre-training steps before the retriever (default: 0, none)")
    parser.add_argument("--reader", default="reader_tiny", help="the retriever's train.py experiment")
    parser.add_argument("--generator", default="generator_reader_tiny", help="the generator's train.py experiment")
    parser.add_argument("--generator-steps", type=int, help="the generator's optimizer steps (default: its "
                        "experiment's)")
    parser.add_argument("--curve-every", type=int, default=250, help="checkpoint the generator every N steps and "
                        "answer the test questions with each: its learning curve (default: 250; 0: none)")
    parser.add_argument("--workers", type=int, default=1, help="seeds side by side, one process each (default: 1)")
    parser.add_argument("--eval", action="append", default=[], dest="eval_overrides", metavar="OVERRIDE",
                        help="an eval.py override for the answers and rag stages (repeat)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every training run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = ChainConfig(args.out, args.seeds, args.pretrain_steps, args.reader, args.generator,
                             args.generator_steps, args.curve_every, args.workers, args.overrides, args.eval_overrides)
    except ValueError as error:  # bad arguments (e.g. --seeds 0 0 1): a usage error, not a traceback
        parser.error(str(error))
    report = run_chain(config)
    for target in report["targets"]:
        print(f"{target['target']}: {_interval(target)} -> {target['verdict']}")
    print(f"report: {args.out / 'chain.md'}")


if __name__ == "__main__":
    main()
