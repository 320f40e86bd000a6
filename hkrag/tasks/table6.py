"""The paper's Table 6 (the generator ablation) and Fig. 4's cost per query at CPU scale, in one resumable command.

    python -m hkrag.tasks.table6 --out outputs/table6                          # 5 generator seeds
    python -m hkrag.tasks.table6 --out outputs/table6 --seeds 0 1 --eval rag.max_queries=10   # a quick look

1. **Generators**: one ``train.py`` run per seed (``experiment=<--experiment>``, ``generator_training.optim.seed``)
   into ``<out>/generators/generator-s<seed>``; its ``report.json`` lists the prompts it was trained on
   (``trained_steps``). With ``--stage1 OVERRIDE`` each seed first trains a first stage with those overrides
   (``<out>/generators/stage1-s<seed>``), which its generator then starts from (a two-stage recipe).
2. **Runs**: ``eval.py`` with every configuration of :data:`GENERATORS` (``conf/generator``) served by each seed's
   generator, on the gold pages (``task=generation``) and on the shipped reader's top 3 (``task=rag
   run_dir=<--reader>``, pools ``single`` and ``all``) of the test split, into
   ``<out>/runs/<pages>-<generator>-s<seed>``. The command chooses no recipe: the margin is fixed beforehand, the
   Judger's h is the paper's, the generator's recipe was chosen on its own validation split (held-out training
   documents, ``experiment=generator_agents_tiny``); the test split is read once per reported figure.
3. **Report** (:func:`summarize`, a function of the per-query rows alone): ``table6.{md,json}``, the per-step
   report of the same runs (``steps.{md,json}``, :func:`write_step_reports`) and the per-query
   rows ``table6_queries.jsonl.gz`` (:func:`query_rows`) from which every figure is re-derived. Per set of
   queries (:data:`SETS`: the gold pages; the retrieved pages, and apart the sets where the gold page is first, where a
   relevant page is ranked below a distractor, and where no relevant page was retrieved: where the Pruner has work)
   each configuration's relaxed accuracy with its crossed seeds × questions interval
   (:func:`hkrag.stats.crossed_interval`; rows of one question in two pools are one column,
   :func:`hkrag.stats.cluster_rows`), its routes and its cost per query (LVLM calls, input and output tokens,
   seconds: Fig. 4), and a verdict on each claim of the paper (:data:`CLAIMS`): *not testable* when the traces show
   it cannot be tested (:func:`judge_testability`), else the stats' rule with the margin, raw and Holm-corrected over
   the table's family (:func:`hkrag.stats.corrected_verdicts`).

Finished jobs (``report.json`` / ``rag.json`` written) are skipped by a rerun, unfinished ones started again
(:func:`hkrag.tasks.common.run_jobs`); every report file is written atomically.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hkrag.data.opendocvqa import QAExample, load_qa
from hkrag.io import write_bytes, write_json, write_text
from hkrag.rag.records import CallRecord, QueryOutcome
from hkrag.rag.report import REPORT_FILE as RAG_REPORT
from hkrag.rag.report import RUN_CONFIG_FILE, metric_value
from hkrag.rag.step_report import step_markdown, step_report
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.stats import (
    CORRECTION,
    VERDICT_RULE,
    Claim,
    cluster_rows,
    corrected_verdicts,
    crossed_difference,
    crossed_interval,
)
from hkrag.tasks.common import (
    BASE_DIR,
    CONF_DIR,
    FINAL_ADAPTER,
    REPORT_FILE,
    Job,
    check_seeds,
    read_timings,
    record_time,
    run_jobs,
)
from hkrag.tasks.generator_training import page_truth, query_truth

logger = logging.getLogger(__name__)

GENERATORS = ("single_pass", "no_pruner", "no_decoupler", "hkrag")
"""Table 6's rows (conf/generator), the baseline first. The paper's table has no Judger-free row: its rows are the
baseline, "Gen w/o pruner", "Gen w/o decoupler" and HKRAG-Gen (``no_decoupler`` calls no Judger, docs/agents.md)."""
PAGES = {"gold": ("task=generation",), "retrieved": ("task=rag",)}
"""The page settings: the gold pages, or the reader's top ``rag.top_k`` (3) in the pools ``single`` and ``all``."""
CLAIMS = (
    (Claim("HKRAG-Gen beats the baseline", "hkrag", "single_pass"), None),
    (Claim("HKRAG-Gen beats Gen w/o pruner", "hkrag", "no_pruner"), "pruner"),
    (Claim("HKRAG-Gen beats Gen w/o decoupler", "hkrag", "no_decoupler"), "decoupler"),
    (Claim("Gen w/o pruner (the Decoupler alone) beats the baseline", "no_pruner", "single_pass"), "decoupler"),
    (Claim("Gen w/o decoupler (the Pruner alone) beats the baseline", "no_decoupler", "single_pass"), "pruner"),
)
"""The paper's Table 6 claims in the names of ``conf/generator``, each with the agent (``CallRecord.agent``) whose
contribution it tests: the one ``better`` has and ``worse`` lacks (None: the whole agentic generator)."""
SETS = {"gold": "gold pages", "retrieved": "retrieved pages (top 3, pools single + all)",
        "first": "retrieved, the gold page ranked first", "later": "retrieved, a relevant page below a distractor",
        "none": "retrieved, no relevant page in the top 3"}
"""The sets of queries the table reports apart; ``first``, ``later`` and ``none`` split ``retrieved`` by where the
reader ranked the first relevant page (:func:`retrieved_set`): in ``later`` and ``none`` the Pruner has work."""
METRIC = "relaxed_accuracy"
UNRECORDED_STEPS = ("single_pass",)
"""The prompts of a generator whose ``report.json`` lists no ``trained_steps``: ``run_generator_training`` trained
on the single-pass prompt only before the field existed."""
COSTS = ("lvlm_calls", "input_tokens", "output_tokens", "seconds")
"""Fig. 4's cost per query: LVLM calls, input and output tokens, the query's wall seconds."""
QUERIES_FILE = "table6_queries.jsonl.gz"
EXPERIMENT = "generator_agents_tiny"
"""The default generator experiment (``--experiment``)."""
WEIGHTS_DIR = CONF_DIR.parent / "weights"


@dataclass
class Table6Config:
    """What the command runs; ``overrides`` go to every generator's ``train.py`` run, ``eval_overrides`` to every
    ``eval.py`` run (e.g. ``paths.data_dir=...``, ``rag.max_queries=...``)."""

    out: Path
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    experiment: str = EXPERIMENT
    generator_steps: int | None = None
    """``generator_training.optim.max_steps`` (None: the experiment's own)."""
    reader: Path = WEIGHTS_DIR / "reader_tiny"
    """The retriever whose top 3 the retrieved rows read (a ``train.py`` run or shipped folder)."""
    overrides: Sequence[str] = ()
    stage1: Sequence[str] = ()
    """When given, the ``train.py`` overrides of a first stage per seed (besides the experiment and the seed); each
    seed's generator then starts from its first stage (``generator_training.init_from``)."""
    eval_overrides: Sequence[str] = ()
    margin: float = 0.02
    """The smallest effect of interest (relaxed accuracy, 2 points)."""
    alpha: float = 0.05
    workers: int = 1
    generators: Sequence[str] = GENERATORS
    command: str = ""
    """The command line, for the report."""
    folders: dict[str, Path] = field(init=False)

    def __post_init__(self) -> None:
        if not self.seeds or self.workers < 1 or self.margin < 0 or not 0 < self.alpha < 1:
            raise ValueError(f"Table 6 needs seeds, workers >= 1, margin >= 0 and 0 < alpha < 1: got seeds="
                             f"{list(self.seeds)}, workers={self.workers}, margin={self.margin}, alpha={self.alpha}")
        unknown = sorted(set(self.generators) - set(GENERATORS))
        if unknown or "single_pass" not in self.generators:
            raise ValueError(f"generators {list(self.generators)}: each must be one of {list(GENERATORS)}, and the "
                             "baseline single_pass among them")
        check_seeds(self.seeds, [*self.overrides, *self.stage1])
        self.out, self.reader = Path(self.out), Path(self.reader)
        self.folders = {"generators": self.out / "generators", "runs": self.out / "runs"}


def generator_folder(config: Table6Config, seed: int) -> Path:
    return config.folders["generators"] / f"generator-s{seed}"


def stage1_folder(config: Table6Config, seed: int) -> Path:
    return config.folders["generators"] / f"stage1-s{seed}"


def run_folder(config: Table6Config, pages: str, generator: str, seed: int) -> Path:
    return config.folders["runs"] / f"{pages}-{generator}-s{seed}"


def serve_overrides(config: Table6Config, seed: int) -> list[str]:
    """The ``eval.py`` overrides that serve seed ``seed``'s generator."""
    generator = generator_folder(config, seed)
    return ["lvlm=phi3v", f"lvlm.base={generator / BASE_DIR}", f"lvlm.adapter={generator / FINAL_ADAPTER}"]


def run_table6(config: Table6Config) -> dict[str, Any]:
    """Train every seed's generator and run every configuration (skipping finished jobs), then write the report."""
    out = config.out
    timings = read_timings(out)
    steps = [f"generator_training.optim.max_steps={config.generator_steps}"] if config.generator_steps else []

    def training(folder: Path, seed: int, overrides: Sequence[str]) -> Job:
        return folder, [f"experiment={config.experiment}", f"generator_training.optim.seed={seed}", *overrides], \
            "train", REPORT_FILE

    stage1 = [training(stage1_folder(config, seed), seed, config.stage1) for seed in config.seeds if config.stage1]
    trainings = [training(generator_folder(config, seed), seed, [
        *steps, *([f"generator_training.init_from={stage1_folder(config, seed)}"] if config.stage1 else []),
        *config.overrides]) for seed in config.seeds]
    for jobs, desc in ((stage1, "table 6 first stages"), (trainings, "table 6 generators")):
        for name, seconds in run_jobs(jobs, config.workers, desc):
            record_time(timings, out, name, seconds)
    runs = []
    for seed in config.seeds:
        for pages, task in PAGES.items():
            retriever = [f"run_dir={config.reader}"] if pages == "retrieved" else []
            runs += [(run_folder(config, pages, g, seed), [*task, f"generator={g}", *retriever,
                                                            *serve_overrides(config, seed), *config.eval_overrides],
                      "eval", RAG_REPORT) for g in config.generators]
    for name, seconds in run_jobs(runs, config.workers, "table 6 runs"):
        record_time(timings, out, name, seconds)
    return write_report(config, timings)


def call_signature(call: CallRecord) -> str:
    """A short digest of what a call asked and got: its step, pages, prompt and reply (10 hex digits)."""
    text = json.dumps([call.step, call.page_ids, call.prompt, call.output], ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8", "backslashreplace")).hexdigest()[:10]


def retrieved_set(retrieved: Sequence[str], relevant: Iterable[str]) -> str:
    """Where the first relevant page is among ``retrieved``: ``first``, ``later`` (below a distractor) or ``none``."""
    relevant = set(relevant)
    ranks = [rank for rank, doc_id in enumerate(retrieved) if doc_id in relevant]
    return "none" if not ranks else "first" if ranks[0] == 0 else "later"


def query_row(outcome: QueryOutcome, pages: str, generator: str, seed: int, relevant: Iterable[str]) -> dict[str, Any]:
    """One answered query as the committed per-query data keeps it: identity, set, score, route, cost and each call's
    agent, step and :func:`call_signature` (enough to re-derive every interval and every *not testable*)."""
    return {"pages": pages, "generator": generator, "seed": seed, "dataset": outcome.dataset, "pool": outcome.pool,
            "query_id": outcome.query_id,
            "set": "gold" if pages == "gold" else retrieved_set(outcome.retrieved, relevant),
            "score": metric_value(outcome, METRIC), "route": outcome.route, "failed": outcome.failed,
            "ranked": len(outcome.retrieved), "kept": len(outcome.kept),
            "calls": [[c.agent, c.step, call_signature(c)] for c in outcome.calls],
            "input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens,
            "seconds": round(outcome.wall_s, 4)}


def run_questions(run: Path) -> tuple[dict[str, Any], dict[str, list[QAExample]]]:
    """An ``eval.py`` run's settings (its ``rag_config.json`` identity) and its data sets' questions."""
    identity = json.loads((run / RUN_CONFIG_FILE).read_text())["identity"]
    return identity, {dataset: load_qa(identity["data"]["qa_source"], dataset, identity["rag"]["split"])
                      for dataset in identity["rag"]["datasets"]}


def relevant_pages(run: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    """``(data set, query id) -> relevant doc ids`` of the questions an ``eval.py`` run answered (its qrels)."""
    return {(dataset, ex.query_id): ex.relevant_doc_ids for dataset, questions in run_questions(run)[1].items()
            for ex in questions}


def query_rows(config: Table6Config) -> list[dict[str, Any]]:
    """The per-query rows of every finished run, in a fixed order (pages, generator, seed, then the run's)."""
    rows, qrels = [], None
    for pages in PAGES:
        for generator in config.generators:
            for seed in config.seeds:
                run = run_folder(config, pages, generator, seed)
                qrels = relevant_pages(run) if qrels is None else qrels
                rows += [query_row(o, pages, generator, seed, qrels.get((o.dataset, o.query_id), ()))
                         for o in load_trace(run / MERGED_FILE)]
    return rows


def step_reports(config: Table6Config) -> dict[str, dict[str, Any]]:
    """The per-step report (:func:`hkrag.rag.step_report.step_report`) of every page setting x configuration, its
    seeds' runs pooled: the Pruner's yes/no against the qrels, the notes against the pages' drawn items, each
    step's answers, the calibration of H′."""
    identity, questions = run_questions(run_folder(config, "gold", config.generators[0], config.seeds[0]))
    truths = {ex.query_id: query_truth(ex) for examples in questions.values() for ex in examples}
    items = page_truth(identity["data"]["root"], identity["rag"]["split"])
    return {f"{pages}-{generator}": step_report([o for seed in config.seeds for o in load_trace(
        run_folder(config, pages, generator, seed) / MERGED_FILE)], truths, items)
        for pages in PAGES for generator in config.generators}


def write_step_reports(config: Table6Config) -> dict[str, dict[str, Any]]:
    """``steps.{json,md}`` beside the table: :func:`step_reports`."""
    reports = step_reports(config)
    seeds = ", ".join(str(seed) for seed in config.seeds)
    write_json(config.out / "steps.json", reports)
    write_text(config.out / "steps.md", "# Table 6's runs step by step\n\nEach configuration's per-step report "
               f"(`hkrag.rag.step_report`) on Table 6's own runs, the seeds' runs ({seeds}) pooled: its Wilson "
               "intervals count every call as independent, so they are descriptive, narrower than a seed-aware "
               "interval.\n\n" + "\n".join(step_markdown(report, name).replace("## ", "## `", 1).replace("\n", "`\n", 1)
                                          for name, report in reports.items()))
    return reports


def generator_reports(config: Table6Config) -> dict[int, dict[str, Any]]:
    """Each seed's generator ``report.json``."""
    return {seed: json.loads((generator_folder(config, seed) / REPORT_FILE).read_text()) for seed in config.seeds}


def trained_steps(reports: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """Each seed's ``trained_steps`` from its generator's report (:data:`UNRECORDED_STEPS` if absent)."""
    return {seed: list(report.get("trained_steps", UNRECORDED_STEPS)) for seed, report in reports.items()}


Key = tuple[str, str, str]
"""A row of a set: (data set, pool, query id)."""


def _key(row: Mapping[str, Any]) -> Key:
    return row["dataset"], row["pool"], row["query_id"]


def in_set(row: Mapping[str, Any], name: str) -> bool:
    """Whether ``row`` belongs to the set ``name`` of :data:`SETS`."""
    return row["pages"] == name if name in PAGES else row["pages"] == "retrieved" and row["set"] == name


def set_rows(rows: Sequence[Mapping[str, Any]], name: str
             ) -> tuple[list[Key], dict[tuple[str, int], dict[Key, Mapping[str, Any]]]]:
    """The set's row keys (sorted) and ``(generator, seed) -> key -> row``; every run must hold the same keys."""
    by_run: dict[tuple[str, int], dict[Key, Mapping[str, Any]]] = {}
    for row in rows:
        if in_set(row, name):
            by_run.setdefault((row["generator"], row["seed"]), {})[_key(row)] = row
    keys = sorted(next(iter(by_run.values()), {}))
    for run, members in by_run.items():
        if sorted(members) != keys:
            raise ValueError(f"set {name!r}: run {run} answered other queries than the others (the retrieved pages "
                             "must be the same for every configuration and seed)")
    return keys, by_run


def judge_testability(better: Sequence[Mapping[str, Any]], worse: Sequence[Mapping[str, Any]], component: str | None,
                trained: Iterable[str]) -> tuple[bool, str | None]:
    """Whether a claim "``better`` beats ``worse``" can be tested on a set, from the two configurations' rows (the
    same queries and seeds, in the same order), the agent the claim is about and the prompts the generator was
    trained on. Not testable, with every reason that holds:

    - the generator was not trained on a prompt either configuration sends (a contrast of a trained prompt with an
      untrained one tests the training, not the component);
    - ``component`` never runs in ``better`` on the set (no call of that agent, e.g. the Pruner with one page), or
      the Pruner runs but never prunes (it keeps every page of every query: what follows it sees the pages it
      would have seen without it);
    - the two coincide: on every query and seed the calls of the steps both configurations send are identical
      (step, pages, prompt and reply), so their answers are equal by construction; either every call is identical,
      or the component ran and changed no other call (e.g. the Pruner kept every page).
    """
    reasons = []
    sent = {call[1] for row in (*better, *worse) for call in row["calls"]}
    untrained = sorted(sent - set(trained))
    if untrained:
        reasons.append(f"the generator was not trained on the prompt(s) {', '.join(untrained)}")
    if component and not any(call[0] == component for row in better for call in row["calls"]):
        reasons.append(f"the {component.capitalize()} never runs on this set (no {component} call)")
    elif component == "pruner" and all(row["kept"] == row["ranked"] for row in better):
        reasons.append("the Pruner never prunes on this set (it keeps every page of every query)")
    shared = {call[1] for row in better for call in row["calls"]} & {call[1] for row in worse for call in row["calls"]}

    def calls(row: Mapping[str, Any], steps: set[str] | None = None) -> list[list[str]]:
        return [call for call in row["calls"] if steps is None or call[1] in steps]

    if all(calls(b) == calls(w) for b, w in zip(better, worse, strict=True)):
        reasons.append("the two configurations coincide: identical calls (steps, pages, prompts, replies) on every "
                       "query and seed")
    elif shared and all(calls(b, shared) == calls(w, shared) for b, w in zip(better, worse, strict=True)):
        reasons.append(f"the two configurations coincide: the {component or 'extra'} calls changed no other call on "
                       "any query and seed (same pages, prompts and replies after them)")
    return not reasons, "; ".join(reasons) or None


def _matrix(by_run: Mapping[tuple[str, int], Mapping[Key, Mapping[str, Any]]], generator: str,
            seeds: Sequence[int], keys: Sequence[Key], value: str = "score") -> np.ndarray:
    return np.array([[float(by_run[generator, seed][key][value]) for key in keys] for seed in seeds])


def summarize(rows: Sequence[Mapping[str, Any]], trained: Mapping[int, Sequence[str]], margin: float = 0.02,
              alpha: float = 0.05, generators: Sequence[str] = GENERATORS) -> dict[str, Any]:
    """Table 6 from the per-query rows (module docstring): per set its rows and claims; the claims of every set
    form one family for the correction."""
    seeds = sorted({row["seed"] for row in rows})
    trained_all = set.intersection(*(set(trained[seed]) for seed in seeds))
    confidence = 1 - alpha
    tables: dict[str, dict[str, Any]] = {}
    family = []
    for name, title in SETS.items():
        keys, by_run = set_rows(rows, name)
        questions = [(dataset, query_id) for dataset, _, query_id in keys]
        if len(set(questions)) < 2:
            continue  # no interval from one question (a tiny run, or an empty subset)
        table: dict[str, Any] = {"title": title, "rows": len(keys), "questions": len(set(questions)),
                                 "generators": {}}
        for generator in generators:
            members = [by_run[generator, seed][key] for seed in seeds for key in keys]
            table["generators"][generator] = {
                "score": crossed_interval(cluster_rows(_matrix(by_run, generator, seeds, keys), questions), confidence,
                                          bounds=(0.0, 1.0)),
                "routes": {route: sum(r["route"] == route for r in members) / len(members)
                           for route in sorted({r["route"] for r in members})},
                "cost": {cost: float(np.mean([len(r["calls"]) if cost == "lvlm_calls" else r[cost] for r in members]))
                         for cost in COSTS},
                "failed": sum(bool(r["failed"]) for r in members)}
        for claim, component in CLAIMS:
            if claim.better not in generators or claim.worse not in generators:
                continue
            better = [by_run[claim.better, seed][key] for seed in seeds for key in keys]
            worse = [by_run[claim.worse, seed][key] for seed in seeds for key in keys]
            testable, reason = judge_testability(better, worse, component, trained_all)
            family.append({"set": name, "text": claim.text, "better": claim.better, "worse": claim.worse,
                           "component": component,
                           **crossed_difference(_matrix(by_run, claim.better, seeds, keys),
                                                _matrix(by_run, claim.worse, seeds, keys), questions, confidence),
                           "testable": testable, "reason": reason})
        tables[name] = table
    claims = corrected_verdicts(family, margin, alpha)
    for name, table in tables.items():
        table["claims"] = [claim for claim in claims if claim["set"] == name]
    return {"metric": METRIC, "seeds": seeds, "trained_steps": sorted(trained_all), "margin": margin, "alpha": alpha,
            "confidence": confidence, "rule": VERDICT_RULE, "correction": CORRECTION, "family_size": len(
                [c for c in claims if c["testable"]]), "sets": tables}


def write_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """The per-query rows as gzipped JSON lines, byte-for-byte reproducible (no timestamp in the header)."""
    text = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows)
    return write_bytes(path, gzip.compress(text.encode("utf-8"), mtime=0))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows :func:`write_rows` wrote."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}"


def score_rows(table: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """A set's configurations, unrounded (×100 for scores): score and interval, cost per query (what W&B logs)."""
    return ["generator", "score", "low", "high", *COSTS], [
        [name, *(100 * row["score"][k] for k in ("mean", "low", "high")), *(row["cost"][k] for k in COSTS)]
        for name, row in table["generators"].items()]


def verdict_rows(table: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """A set's claims: text, configurations, difference and interval (×100), p-values, verdicts, reason."""
    return ["claim", "better", "worse", "diff", "low", "high", "p_value", "p_holm", "verdict", "corrected_verdict",
            "reason"], [[c["text"], c["better"], c["worse"], 100 * c["diff"], 100 * c["low"], 100 * c["high"],
                         c["p_value"], c["p_holm"], c["verdict"], c["corrected_verdict"], c["reason"]]
                        for c in table["claims"]]


def markdown(summary: Mapping[str, Any], header: str = "") -> str:
    """Table 6 as Markdown: the rule, then per set the configurations' scores and costs and the verdicts."""
    lines = [header] if header else []
    confidence = 100 * summary["confidence"]
    lines += [f"**Rule.** {summary['metric']} ×100 with {confidence:.0f} % intervals, crossed seeds × questions "
              f"(seeds {summary['seeds']}; a t interval from the two-way random-effects ANOVA, Satterthwaite degrees "
              "of freedom, a score's bounded to [0, 100]; a question asked in both pools is one column, never two "
              "rows). Verdict on each claim "
              f"(better − worse): {summary['rule']}; margin (smallest effect of interest) "
              f"{100 * summary['margin']:.0f} points. Correction: {summary['correction']}, over the "
              f"{summary['family_size']} testable claims of every set below (one family, alpha "
              f"{summary['alpha']:g}). Prompts the generator was trained on (every seed): "
              f"{', '.join(summary['trained_steps'])}.\n"]
    for table in summary["sets"].values():
        lines += [f"### {table['title']}\n", f"{table['rows']} rows, {table['questions']} questions.\n",
                  "| generator | score [95%] | routes | LVLM calls / query | input tok. | output tok. | s / query | "
                  "failed |", "|---|---|---|---|---|---|---|---|"]
        for name, row in table["generators"].items():
            score, cost = row["score"], row["cost"]
            routes = ", ".join(f"{route} {100 * share:.0f}%" for route, share in row["routes"].items())
            lines.append(f"| {name} | {100 * score['mean']:.1f} [{100 * score['low']:.1f}, {100 * score['high']:.1f}]"
                         f" | {routes} | {cost['lvlm_calls']:.2f} | {cost['input_tokens']:.0f} | "
                         f"{cost['output_tokens']:.0f} | {cost['seconds']:.3f} | {row['failed']} |")
        corrected = 100 * table["claims"][0]["corrected_confidence"] if table["claims"] else confidence
        lines += ["", f"Verdicts by the rule above (margin {100 * summary['margin']:.0f} points); p (Holm) and the "
                  f"corrected interval ({corrected:.2f} %) over the table's family of {summary['family_size']} "
                  "testable claims.\n",
                  "| claim | difference [95%] | p | p (Holm) | corrected interval | verdict | corrected verdict |",
                  "|---|---|---|---|---|---|---|"]
        notes = []
        for claim in table["claims"]:
            name = f"{claim['text']} (`{claim['better']}` vs `{claim['worse']}`)"
            interval = f"{_pct(claim['diff'])} [{_pct(claim['low'])}, {_pct(claim['high'])}]"
            if claim["testable"]:
                corrected = f"[{_pct(claim['corrected_low'])}, {_pct(claim['corrected_high'])}]"
                lines.append(f"| {name} | {interval} | {claim['p_value']:.2g} | {claim['p_holm']:.2g} | {corrected} "
                             f"| **{claim['verdict']}** | **{claim['corrected_verdict']}** |")
            else:
                notes.append(claim["reason"])
                lines.append(f"| {name} | {interval} | – | – | – | **not testable** ({len(notes)}) | "
                             f"**not testable** ({len(notes)}) |")
        lines += [""] + [f"({number}) {note}." for number, note in enumerate(notes, 1)] + [""]
    return "\n".join(lines)


def write_report(config: Table6Config, timings: Mapping[str, float],
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``table6.{md,json}`` and the per-query rows (:data:`QUERIES_FILE`) in ``config.out``; returns the JSON."""
    rows = query_rows(config)
    reports = generator_reports(config)
    trained = trained_steps(reports)
    summary = summarize(rows, trained, config.margin, config.alpha, config.generators)
    write_rows(config.out / QUERIES_FILE, rows)
    write_step_reports(config)
    settings = {"command": config.command, "experiment": config.experiment, "seeds": list(config.seeds),
                "generator_steps": {seed: report.get("steps") for seed, report in reports.items()},
                "trained_steps": trained, "reader": str(config.reader),
                "overrides": list(config.overrides), "stage1": list(config.stage1),
                "eval_overrides": list(config.eval_overrides),
                "generators": list(config.generators)}
    report = {"settings": settings, "timings": dict(timings), **summary, **(extra or {})}
    compute = sum(timings.values())
    header = ("# Table 6 at CPU scale: the generator ablation\n\n"
              f"`{config.command or 'python -m hkrag.tasks.table6'}`: `experiment={config.experiment}` trained once "
              f"per seed ({', '.join(str(s) for s in config.seeds)}; steps "
              f"{sorted(set(settings['generator_steps'].values()))}), each served to every configuration on the gold "
              f"pages and on the top 3 of `{config.reader.name}`. Compute {compute / 60:.1f} min "
              f"(`timings.json`); per-query data: `{QUERIES_FILE}` (one JSON line per seed × configuration × "
              "query).\n")
    write_json(config.out / "table6.json", report)
    write_text(config.out / "table6.md", markdown(summary, header))
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Resumable: a rerun skips every finished generator and run.")
    parser.add_argument("--out", type=Path, required=True, help="folder of the runs and reports (resumed if present)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="generator training seeds (generator_training.optim.seed; default: 0 1 2 3 4)")
    parser.add_argument("--experiment", default=EXPERIMENT,
                        help=f"train.py experiment of the generator (default: {EXPERIMENT})")
    parser.add_argument("--generator-steps", type=int, default=None,
                        help="generator_training.optim.max_steps (default: the experiment's)")
    parser.add_argument("--reader", type=Path, default=WEIGHTS_DIR / "reader_tiny",
                        help="the retriever whose top 3 the retrieved rows read (default: weights/reader_tiny)")
    parser.add_argument("--margin", type=float, default=0.02,
                        help="smallest effect of interest in relaxed accuracy (default: 0.02, 2 points)")
    parser.add_argument("--alpha", type=float, default=0.05, help="family-wise error rate (default: 0.05)")
    parser.add_argument("--stage1", action="append", default=[], metavar="OVERRIDE",
                        help="a train.py override of a first training stage per seed (repeat); each generator then "
                        "starts from its seed's first stage, e.g. --stage1 'generator_training.pages=[gold]' --stage1 "
                        "'generator_training.curriculum.steps=[single_pass]'")
    parser.add_argument("--eval", action="append", default=[], dest="eval_overrides", metavar="OVERRIDE",
                        help="an eval.py override for every run (repeat), e.g. --eval rag.max_queries=10")
    parser.add_argument("--generators", nargs="+", default=list(GENERATORS), choices=GENERATORS,
                        help="configurations (conf/generator; default: all four, the baseline single_pass among them)")
    parser.add_argument("--workers", type=int, default=1, help="jobs side by side, one process each (default: 1)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every generator (e.g. paths.data_dir=...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = "python -m hkrag.tasks.table6 " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        config = Table6Config(args.out, seeds=args.seeds, experiment=args.experiment,
                              generator_steps=args.generator_steps, reader=args.reader,
                              overrides=args.overrides, stage1=args.stage1, eval_overrides=args.eval_overrides,
                              margin=args.margin,
                              alpha=args.alpha, workers=args.workers, generators=args.generators,
                              command=command.strip())
    except ValueError as error:
        parser.error(str(error))
    report = run_table6(config)
    print((config.out / "table6.md").read_text())
    return report


if __name__ == "__main__":
    main()
