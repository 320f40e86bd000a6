"""The paper's Table 6 (the generator ablation) and Fig. 4's cost per query at CPU scale, in one resumable command.

    python -m hkrag.tasks.table6 --out outputs/table6                          # 5 generator seeds
    python -m hkrag.tasks.table6 --out outputs/table6 --seeds 0 1 --eval rag.max_queries=10   # a quick look
    python -m hkrag.tasks.table6 --render outputs/table6/table6.json       # a report again, under its rules

0. **Rules**: the verdict rules are registered before any job (:func:`register_rules`: the sha256 of
   ``docs/rules/table6.md``, the margin and alpha into ``<out>/rules.json``); a rerun, a judgement or a rendering
   under other rules is refused (:class:`RulesChangedError`, naming both hashes).

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
   seconds: Fig. 4), and a verdict on each claim of the paper (:data:`CLAIMS`) by the registered rules: *not
   testable* only where the two configurations are identical by construction (:func:`identical_by_construction`,
   from the configs the runs were made with, never from their answers), else the stats' rule with the margin, raw
   and Holm-corrected over the table's one family (:data:`FAMILY`, :func:`hkrag.stats.corrected_verdicts`).

Finished jobs (``report.json`` / ``rag.json`` written) are skipped by a rerun, unfinished ones started again or,
where a training run saved a checkpoint under the same overrides, continued from it
(:func:`hkrag.tasks.common.run_job`); every report file is written atomically.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.steps import longest_route
from hkrag.data.opendocvqa import QAExample, load_qa
from hkrag.io import read_json, read_jsonl, write_bytes, write_json, write_text
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
    UNGROUNDED,
    Job,
    check_seeds,
    generator_conf,
    invocation,
    read_timings,
    record_time,
    run_jobs,
    run_report_command,
)
from hkrag.tasks.generator_training import page_truth, query_truth

logger = logging.getLogger(__name__)

GENERATORS = ("single_pass", "no_pruner", "no_decoupler", "hkrag")
"""Table 6's rows (conf/generator), the baseline first. The paper's table has no Judger-free row: its rows are the
baseline, "Gen w/o pruner", "Gen w/o decoupler" and HKRAG-Gen (``no_decoupler`` calls no Judger, docs/agents.md)."""
PAGES = {"gold": ("task=generation", UNGROUNDED), "retrieved": ("task=rag", UNGROUNDED)}
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
RULES_NAME = "docs/rules/table6.md"
RULES_FILE = CONF_DIR.parent / RULES_NAME
"""The registered verdict rules: their sha256 is recorded before any run (:func:`register_rules`) and in the
report, and a report is judged or rendered only under the same text (:func:`check_rules`)."""
RULES_RECORD = "rules.json"
FAMILY = ("every claim of CLAIMS on every set of SETS with at least 2 questions, less the claims whose two "
          "configurations are identical by construction; a claim whose configurations (up to identity by "
          "construction) and queries another claim already has is listed once")
"""Table 6's one family for the correction, in words (docs/rules/table6.md)."""


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
    """Train every seed's generator and run every configuration (skipping finished jobs; each job once its seed's
    earlier ones have finished: its first stage, then its generator), then write the report."""
    out = config.out
    register_rules(config)
    timings = read_timings(out)
    steps = [f"generator_training.optim.max_steps={config.generator_steps}"] if config.generator_steps else []

    def training(folder: Path, seed: int, overrides: Sequence[str]) -> Job:
        return folder, [f"experiment={config.experiment}", f"generator_training.optim.seed={seed}", *overrides], \
            "train", REPORT_FILE

    stage1 = [training(stage1_folder(config, seed), seed, config.stage1) for seed in config.seeds if config.stage1]
    trainings = [training(generator_folder(config, seed), seed, [
        *steps, *([f"generator_training.init_from={stage1_folder(config, seed)}"] if config.stage1 else []),
        *config.overrides]) for seed in config.seeds]
    needs = {generator_folder(config, seed): [stage1_folder(config, seed)] for seed in config.seeds if config.stage1}
    runs = []
    for seed in config.seeds:
        for pages, task in PAGES.items():
            retriever = [f"run_dir={config.reader}"] if pages == "retrieved" else []
            runs += [(run_folder(config, pages, g, seed), [*task, f"generator={g}", *retriever,
                                                            *serve_overrides(config, seed), *config.eval_overrides],
                      "eval", RAG_REPORT) for g in config.generators]
            needs.update({run_folder(config, pages, g, seed): [generator_folder(config, seed)]
                          for g in config.generators})
    for name, seconds in run_jobs([*stage1, *trainings, *runs], config.workers, "table 6", needs):
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
    identity = read_json(run / RUN_CONFIG_FILE)["identity"]
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
    return {seed: read_json(generator_folder(config, seed) / REPORT_FILE) for seed in config.seeds}


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
    first = next(iter(by_run.values()), {})
    keys = sorted(first)
    for run, members in by_run.items():
        if sorted(members) != keys or any(members[key]["ranked"] != first[key]["ranked"] for key in keys):
            raise ValueError(f"set {name!r}: run {run} answered other queries, or was handed other numbers of pages, "
                             "than the others (the pages must be the same for every configuration and seed)")
    return keys, by_run


def generator_config(config: Table6Config, generator: str) -> dict[str, Any]:
    """The ``generator`` config every run of ``generator`` was made with (its ``rag_config.json`` identity); runs of
    one configuration with different generator configs are refused."""
    found = {json.dumps(read_json(run_folder(config, pages, generator, seed) / RUN_CONFIG_FILE)
                        ["identity"]["generator"], sort_keys=True) for pages in PAGES for seed in config.seeds}
    if len(found) != 1:
        raise ValueError(f"the runs of {generator!r} in {config.folders['runs']} were made with {len(found)} different "
                         "generator configs: one configuration, one config")
    return json.loads(found.pop())


def shipped_configs(generators: Sequence[str] = GENERATORS) -> dict[str, dict[str, Any]]:
    """``conf/generator``'s config of each of ``generators``, as ``eval.py generator=<name>`` composes it."""
    return {name: generator_conf(name) for name in generators}


def pruner_buffer(config: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]) -> int:
    """The most pages the Pruner's buffer holds on a set: per query ``min(generator.top_k, pages handed)``, the pages
    handed (``ranked``: the gold pages capped by ``rag.top_k``, or the reader's top ``rag.top_k``) being an input
    that the task fixes before any generator call, the same for every configuration."""
    return max((min(int(config["top_k"]), int(row["ranked"])) for row in rows), default=0)


def identical_by_construction(better: Mapping[str, Any], worse: Mapping[str, Any], buffer: int) -> str | None:
    """Why two generator configs send the same calls on every query of a set whose Pruner buffer holds at most
    ``buffer`` pages, or None when they may differ. Decided from the configs and the code path alone (never from
    what the runs answered), as docs/rules/table6.md registers:

    - the configs are equal (their ``name`` aside);
    - both are agentic and differ only in ``pruner`` while ``buffer`` ≤ 1: the Pruner asks for n = 1 … k−1 only
      (agents/pruner.py), so with one page it asks nothing and keeps the page the fixed top-k keeps.

    Equal calls give equal answers because the agents decode greedily (every request at temperature 0,
    agents/context.py)."""
    a, b = ({k: v for k, v in c.items() if k != "name"} for c in (better, worse))
    if a == b:
        return "identical configurations (their generator configs are equal)"
    if a.get("kind") == b.get("kind") == "agentic" and buffer <= 1 and {**a, "pruner": False} == {**b, "pruner": False}:
        return (f"identical by construction: the configs differ only in `pruner`, and the Pruner's buffer holds at "
                f"most {buffer} page on this set (generator.top_k={a['top_k']}), so the Pruner asks nothing and keeps "
                "the page the fixed top-k keeps; greedy decoding then makes every call the same")
    return None


def possible_steps(config: Mapping[str, Any], buffer: int) -> set[str]:
    """The prompts a generator config can send on a set whose Pruner buffer holds at most ``buffer`` pages: its
    longest route (:func:`agents.steps.longest_route`), the Judger's LQP route (``verify``) with it, no Pruner call
    with one page."""
    steps = set(longest_route(config["kind"], bool(config["pruner"]) and buffer > 1, bool(config["decoupler"])))
    return steps | ({"verify"} if config["kind"] == "agentic" else set())


def caveats(better: Mapping[str, Any], worse: Mapping[str, Any], component: str | None, buffer: int,
            trained: Iterable[str]) -> list[str]:
    """What a testable claim's contrast also measures, from the configs (reported beside the verdict, never
    changing it): prompts the generator was not trained on, a component that cannot run on the set."""
    notes = []
    untrained = sorted((possible_steps(better, buffer) | possible_steps(worse, buffer)) - set(trained))
    if untrained:
        notes.append(f"the generator was not trained on the prompt(s) {', '.join(untrained)}: the contrast also tests "
                     "the training")
    if component == "pruner" and buffer <= 1:
        notes.append("the Pruner cannot run on this set (at most one page in its buffer): the contrast is the other "
                     "steps', not the Pruner's")
    return notes


def _matrix(by_run: Mapping[tuple[str, int], Mapping[Key, Mapping[str, Any]]], generator: str,
            seeds: Sequence[int], keys: Sequence[Key], value: str = "score") -> np.ndarray:
    return np.array([[float(by_run[generator, seed][key][value]) for key in keys] for seed in seeds])


class RulesChangedError(ValueError):
    """A Table 6 report, or an output folder, made under other verdict rules than the registered ones."""


def rules_digest(path: Path | None = None) -> str:
    """The sha256 of the registered rules' text (its bytes; default :data:`RULES_FILE`)."""
    path = RULES_FILE if path is None else path
    if not path.is_file():
        raise RulesChangedError(f"the registered verdict rules {path} are missing: Table 6 judges nothing without them")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def current_rules(margin: float, alpha: float) -> dict[str, Any]:
    """The rules a judgement is made under: the registered text's hash, the margin and alpha."""
    return {"file": RULES_NAME, "sha256": rules_digest(), "margin": margin, "alpha": alpha}


def check_rules(recorded: Mapping[str, Any] | None, margin: float, alpha: float, what: str) -> dict[str, Any]:
    """The current rules (:func:`current_rules`) if ``recorded`` (the rules ``what`` was made under) are the same;
    else :class:`RulesChangedError` naming both hashes (or the margin / alpha that differ)."""
    current = current_rules(margin, alpha)
    if not recorded or "sha256" not in recorded:
        raise RulesChangedError(f"{what} records no registered verdict rules: it was made before {RULES_NAME} was "
                                f"registered (now sha256 {current['sha256']}); run Table 6 into a new --out")
    if recorded["sha256"] != current["sha256"]:
        raise RulesChangedError(f"{what} was made under the verdict rules sha256 {recorded['sha256']}, but "
                                f"{RULES_NAME} now hashes to {current['sha256']}: the rules changed since the run. "
                                "Judging it under other rules than it was run under is refused: restore the registered "
                                "text, or run Table 6 into a new --out under the new rules")
    for key in ("margin", "alpha"):
        if recorded.get(key) != current[key]:
            raise RulesChangedError(f"{what} registered {key}={recorded.get(key)} before its runs, not {current[key]}: "
                                    f"the {key} is fixed with the rules (sha256 {current['sha256']})")
    return current


def register_rules(config: Table6Config) -> dict[str, Any]:
    """Record the rules in ``<out>/rules.json`` before any job runs, or check the ones recorded there: a rerun
    under changed rules is refused (:func:`check_rules`), and so is a folder whose runs were made before any
    registration."""
    record = config.out / RULES_RECORD
    if record.is_file():
        return check_rules(read_json(record), config.margin, config.alpha, str(config.out))
    if config.folders["runs"].is_dir() and any(config.folders["runs"].iterdir()):
        raise RulesChangedError(f"{config.out} holds runs but no {RULES_RECORD}: they were made before the verdict "
                                f"rules were registered (now sha256 {rules_digest()}); run Table 6 into a new --out")
    rules = current_rules(config.margin, config.alpha)
    write_json(record, rules)
    return rules


def summarize(rows: Sequence[Mapping[str, Any]], trained: Mapping[int, Sequence[str]], margin: float = 0.02,
              alpha: float = 0.05, generators: Sequence[str] = GENERATORS,
              configs: Mapping[str, Mapping[str, Any]] | None = None,
              rules: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Table 6 from the per-query rows under the registered rules (docs/rules/table6.md): per set its rows and
    claims, the claims of every set one family for the correction.

    ``configs`` are the generator configs the runs were made with (default: ``conf/generator``'s,
    :func:`shipped_configs`); a claim is *not testable* only where they are :func:`identical_by_construction` on
    the set, and a claim whose configurations and queries another claim of the family already has is listed once
    (``duplicate_of``). ``rules``: the rules the runs were registered under (:func:`register_rules`; default: the
    current ones); changed rules are refused (:class:`RulesChangedError`)."""
    rules = check_rules(rules, margin, alpha, "the runs") if rules is not None else current_rules(margin, alpha)
    configs = configs if configs is not None else shipped_configs(generators)
    seeds = sorted({row["seed"] for row in rows})
    trained_all = set.intersection(*(set(trained[seed]) for seed in seeds))
    confidence = 1 - alpha
    tables: dict[str, dict[str, Any]] = {}
    family: list[dict[str, Any]] = []
    tested: dict[tuple[Any, ...], int] = {}
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
        handed = list(by_run[generators[0], seeds[0]].values())
        buffers = {g: pruner_buffer(configs[g], handed) for g in generators}
        same = {g: next(h for h in generators if h == g or identical_by_construction(
            configs[h], configs[g], max(buffers[g], buffers[h]))) for g in generators}
        for claim, component in CLAIMS:
            if claim.better not in generators or claim.worse not in generators:
                continue
            pages = max(buffers[claim.better], buffers[claim.worse])
            reason = identical_by_construction(configs[claim.better], configs[claim.worse], pages)
            entry = {"set": name, "text": claim.text, "better": claim.better, "worse": claim.worse,
                     "component": component, "pruner_buffer": pages,
                     **crossed_difference(_matrix(by_run, claim.better, seeds, keys),
                                          _matrix(by_run, claim.worse, seeds, keys), questions, confidence),
                     "testable": reason is None, "reason": reason,
                     "caveats": [] if reason else caveats(configs[claim.better], configs[claim.worse], component,
                                                          pages, trained_all)}
            test = (tuple(keys), same[claim.better], same[claim.worse])
            if reason is None and test in tested:
                first = family[tested[test]]
                entry.update(duplicate_of=tested[test], same_as=f"{first['text']} ({SETS[first['set']]})")
            elif reason is None:
                tested[test] = len(family)
            family.append(entry)
        tables[name] = table
    claims = corrected_verdicts(family, margin, alpha)
    for name, table in tables.items():
        table["claims"] = [claim for claim in claims if claim["set"] == name]
    return {"metric": METRIC, "seeds": seeds, "trained_steps": sorted(trained_all), "margin": margin, "alpha": alpha,
            "confidence": confidence, "rule": VERDICT_RULE, "correction": CORRECTION, "rules": rules,
            "family": FAMILY, "family_size": claims[0]["family_size"] if claims else 0, "sets": tables}


def write_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """The per-query rows as gzipped JSON lines, byte-for-byte reproducible (no timestamp in the header)."""
    text = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows)
    return write_bytes(path, gzip.compress(text.encode("utf-8"), mtime=0))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows :func:`write_rows` wrote."""
    return read_jsonl(path)


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


def _note(notes: list[str], *texts: str) -> str:
    """Append ``texts`` to a table's numbered notes; their marks, e.g. `` (2) (3)``."""
    notes.extend(texts)
    return "".join(f" ({len(notes) - len(texts) + i})" for i in range(1, len(texts) + 1))


def markdown(summary: Mapping[str, Any], header: str = "") -> str:
    """Table 6 as Markdown: the rule, then per set the configurations' scores and costs and the verdicts; refused
    when the rules the summary was judged under are not the registered ones now (:func:`check_rules`)."""
    rules = check_rules(summary.get("rules"), summary["margin"], summary["alpha"], "the Table 6 report")
    lines = [header] if header else []
    confidence = 100 * summary["confidence"]
    lines += [f"**Rule.** {summary['metric']} ×100 with {confidence:.0f} % intervals, crossed seeds × questions "
              f"(seeds {summary['seeds']}; a t interval from the two-way random-effects ANOVA, Satterthwaite degrees "
              "of freedom, a score's bounded to [0, 100]; a question asked in both pools is one column, never two "
              f"rows). Registered before the runs: `{rules['file']}` (sha256 `{rules['sha256'][:16]}…`). Verdict on "
              f"each claim (better − worse): {summary['rule']}; margin (smallest effect of interest) "
              f"{100 * summary['margin']:.0f} points. Correction: {summary['correction']}, over one family "
              f"({summary['family']}): {summary['family_size']} claims, alpha {summary['alpha']:g}. Prompts the "
              f"generator was trained on (every seed): {', '.join(summary['trained_steps'])}.\n"]
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
                  "claims.\n",
                  "| claim | difference [95%] | p | p (Holm) | corrected interval | verdict | corrected verdict |",
                  "|---|---|---|---|---|---|---|"]
        notes: list[str] = []
        for claim in table["claims"]:
            name = f"{claim['text']} (`{claim['better']}` vs `{claim['worse']}`)"
            interval = f"{_pct(claim['diff'])} [{_pct(claim['low'])}, {_pct(claim['high'])}]"
            if not claim["testable"]:
                tag = _note(notes, claim["reason"])
                lines.append(f"| {name} | {interval} | – | – | – | **not testable**{tag} | **not testable**{tag} |")
                continue
            duplicate = [f"the same test as {claim['same_as']}, counted once in the family"] if claim.get("same_as") \
                else []
            tag = _note(notes, *claim["caveats"], *duplicate)
            corrected = f"[{_pct(claim['corrected_low'])}, {_pct(claim['corrected_high'])}]"
            lines.append(f"| {name}{tag} | {interval} | {claim['p_value']:.2g} | {claim['p_holm']:.2g} | {corrected} "
                         f"| **{claim['verdict']}** | **{claim['corrected_verdict']}** |")
        lines += [""] + [f"({number}) {note}." for number, note in enumerate(notes, 1)] + [""]
    return "\n".join(lines)


def render(report: Mapping[str, Any]) -> str:
    """``table6.md`` from a ``table6.json`` report: its header (command, seeds, compute) and :func:`markdown`, which
    refuses a report whose registered rules changed since its run."""
    settings, compute = report["settings"], sum(report["timings"].values())
    header = ("# Table 6 at CPU scale: the generator ablation\n\n"
              f"`{settings['command'] or 'python -m hkrag.tasks.table6'}`: `experiment={settings['experiment']}` "
              f"trained once per seed ({', '.join(str(s) for s in settings['seeds'])}; steps "
              f"{sorted(set(settings['generator_steps'].values()), key=str)}), each served to every configuration on "
              f"the gold pages and on the top 3 of `{Path(settings['reader']).name}`. Compute {compute / 60:.1f} min "
              f"(`timings.json`); per-query data: `{QUERIES_FILE}` (one JSON line per seed × configuration × "
              "query).\n")
    return markdown(report, header)


def write_report(config: Table6Config, timings: Mapping[str, float],
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``table6.{md,json}`` and the per-query rows (:data:`QUERIES_FILE`) in ``config.out``, judged under the rules
    registered before the runs (:func:`register_rules`); returns the JSON."""
    rules = register_rules(config)
    rows = query_rows(config)
    reports = generator_reports(config)
    trained = trained_steps(reports)
    configs = {generator: generator_config(config, generator) for generator in config.generators}
    summary = summarize(rows, trained, config.margin, config.alpha, config.generators, configs, rules)
    write_rows(config.out / QUERIES_FILE, rows)
    write_step_reports(config)
    settings = {"command": config.command, "experiment": config.experiment, "seeds": list(config.seeds),
                "generator_steps": {seed: report.get("steps") for seed, report in reports.items()},
                "trained_steps": trained, "reader": str(config.reader),
                "overrides": list(config.overrides), "stage1": list(config.stage1),
                "eval_overrides": list(config.eval_overrides),
                "generators": list(config.generators)}
    report = {"settings": settings, "timings": dict(timings), **summary, **(extra or {})}
    write_json(config.out / "table6.json", report)
    write_text(config.out / "table6.md", render(report))
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Resumable: a rerun skips every finished generator and run.")
    parser.add_argument("--out", type=Path, help="folder of the runs and reports (resumed if present; required but "
                        "with --render)")
    parser.add_argument("--render", type=Path, metavar="TABLE6_JSON",
                        help="print a table6.json report as Markdown and exit (refused if its rules changed)")
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
    if args.render:
        report = read_json(args.render)
        try:
            print(render(report))
        except RulesChangedError as error:
            parser.exit(2, f"{parser.prog}: error: {args.render}: {error}\n")
        return report
    if args.out is None:
        parser.error("--out is required (but with --render)")
    command = invocation("hkrag.tasks.table6", argv).strip()
    return run_report_command(
        parser, lambda: Table6Config(args.out, seeds=args.seeds, experiment=args.experiment,
                                     generator_steps=args.generator_steps, reader=args.reader,
                                     overrides=args.overrides, stage1=args.stage1,
                                     eval_overrides=args.eval_overrides, margin=args.margin, alpha=args.alpha,
                                     workers=args.workers, generators=args.generators, command=command),
        run_table6, RulesChangedError, lambda config: config.out / "table6.md")


if __name__ == "__main__":
    main()
