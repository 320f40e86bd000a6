"""``eval.py task=rag`` and ``task=generation``: retrieve → generate → judge, resumably (paper §3.3, §4).

``task=rag`` retrieves the top pages of every query with a retriever (a ``train.py`` run's directory or
a named adapter, in every pool of ``eval.pools``); ``task=generation`` hands the generator the gold pages
(``retrieval=gold``, Table 3's "Gold" rows) or no page at all (``retrieval=none``, the "no retrieval"
row). The generator (``generator`` group: HKRAG's agents, a single-pass baseline or a Table 6 ablation)
runs on an LVLM backend (``lvlm`` group); each answer gets the rule metrics and, when a judge endpoint
is configured, the LLM judge's verdict, and is appended to the run's trace at once (:mod:`hkrag.rag.trace`),
so a killed run continues where it stopped. Under ``accelerate launch`` the queries are split across
processes; rank 0 merges the trace and writes ``rag.json``, ``rag.md`` and ``rag.html``.

Every setting is checked before any query is asked and before the run directory is touched
(:func:`hkrag.tasks.validation.validate_config`, the ``generator`` group, ``run_dir``, the data set names).
While answering, an error is either the query's or the run's (:func:`is_run_level`): a query's becomes
a failed outcome in the trace (counted wrong, its type and message in ``failure``); a run's stops the
run at once, with every finished query already in the trace (docs/errors.md, "Generator runs").
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from tqdm.auto import tqdm

from agents import build_generator
from agents.pipeline import GeneratorConfig
from agents.pruner import PageScorer
from hkrag.data.generator_pairs import warn_few_pages
from hkrag.data.ocr import OcrSettings
from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, QAExample, load_corpus, load_qa, pools
from hkrag.environment import environment
from hkrag.index.shards import config_hash
from hkrag.io import WriteError, read_json, write_json, write_text
from hkrag.lvlm import LVLMBackend, PageImage, build_backend
from hkrag.rag.evidence import Grounder, GroundingConfig, PageView, unit_view
from hkrag.rag.gold_evidence import load_gold
from hkrag.rag.grader import build_grader
from hkrag.rag.html import write_html
from hkrag.rag.metrics import rule_metrics
from hkrag.rag.records import Page, PageText, Query, QueryOutcome
from hkrag.rag.report import (
    MARKDOWN_FILE,
    REPORT_FILE,
    RUN_CONFIG_FILE,
    comparison_rows,
    flat_metrics,
    layout_metrics,
    query_rows,
    write_reports,
)
from hkrag.rag.trace import MERGED_FILE, PARTS_DIR, TraceWriter, merge
from hkrag.retrieval.evaluation import PER_QUERY_FILE, TABLE_FILE, evaluate_ranker
from hkrag.retrieval.regions import RegionRanker
from hkrag.run_log import RunLogger
from hkrag.tasks.common import (
    check_pools,
    eval_config,
    make_accelerator,
    missing_run_dir,
    prepare_data,
    resolve_run_dir,
    shared_output_dir,
    trained_model_config,
)
from hkrag.tasks.rankers import VisualModel, bind_ranker
from hkrag.tasks.validation import ConfigError, validate_config

logger = logging.getLogger(__name__)

RETRIEVAL_MODES = {"rag": ("retriever",), "generation": ("gold", "none")}
RUN_LEVEL_ERRORS: tuple[type[BaseException], ...] = (OSError, MemoryError, torch.cuda.OutOfMemoryError, ConfigError)
"""Errors that stop the whole run rather than fail one query (with ``KeyboardInterrupt`` and every other
non-``Exception``): the disk or the trace (``OSError``, ``WriteError``), memory (a CUDA out-of-memory query is
followed by more: lower the batch size or ``rag.concurrency``, then resume) and configuration. Each would
recur on every following query, and recording those as failed answers would report the machine, not the
generator."""
SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate: never part of valid text in a Python string, and unencodable as UTF-8."""
FAILURE_CHARS = 500
HTML_FILE = "rag.html"
"""An unexpected error's message is cut to this many characters in ``failure``."""


@dataclass
class PlannedQuery:
    """One (data set, pool, question) to answer, with its ranked page ids."""

    example: QAExample
    dataset: str
    pool: str
    page_ids: list[str]

    @property
    def key(self) -> str:
        return f"{self.dataset}/{self.pool}/{self.example.query_id}"


class PageStore:
    """Every corpus the run reads, so a page id resolves to its (still encoded) image or, with a
    ``text_column`` (``generator.input=text``), to its text cut to ``max_page_tokens`` words."""

    def __init__(self, corpora: list[Corpus], text_column: str | None = None,
                 max_page_tokens: int = GeneratorConfig.max_page_tokens) -> None:
        self.corpora = corpora
        self.text_column = text_column
        self.max_page_tokens = max_page_tokens
        for corpus in corpora if text_column else ():
            if text_column not in corpus.dataset.column_names:
                raise ConfigError(f"generator.text_column={text_column!r}: corpus {corpus.name} has no such column "
                                  f"(has {corpus.dataset.column_names}); run python -m hkrag.data.ocr")

    def row(self, doc_id: str) -> dict[str, Any]:
        """The page's stored row (its image still encoded)."""
        for corpus in self.corpora:
            if doc_id in corpus:
                return corpus.dataset[corpus.index(doc_id)]
        raise KeyError(f"page {doc_id!r} is in none of the loaded corpora")

    def page(self, doc_id: str) -> Page:
        """The page as the generator gets it: decoded lazily, so a broken page (or, as text, an empty one)
        fails inside its query."""
        row = self.row(doc_id)
        if self.text_column is None:
            return PageImage(row["image"], doc_id)
        return PageText(row[self.text_column], doc_id, self.text_column).truncated(self.max_page_tokens)

    def view(self, doc_id: str) -> PageView:
        """The page (or region unit, on its page) as the evidence step sees it."""
        return unit_view(self.row(doc_id), doc_id, self.image(doc_id))

    def image(self, doc_id: str) -> Image.Image | None:
        """The decoded page for thumbnails, or ``None`` when it cannot be shown."""
        try:
            return PageImage(self.row(doc_id)["image"], doc_id).load()
        except (KeyError, ValueError, OSError):
            return None


def question_text(example: QAExample) -> str:
    """The question without OpenDocVQA's retrieval instruction, as valid UTF-8 text."""
    return valid_text(example.query.removeprefix(QUERY_PREFIX).strip())


def valid_text(value: Any) -> Any:
    """``value`` with every string in it made encodable (a lone surrogate becomes U+FFFD), recursively.

    A query or a backend's reply may carry lone surrogates (undecodable bytes, a broken ``\\udXXX`` escape);
    they would make every UTF-8 write of the trace and the reports fail.
    """
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [valid_text(item) for item in value]
    if isinstance(value, dict):
        return {key: valid_text(item) for key, item in value.items()}
    return value


def resolve_retrieval_mode(cfg: DictConfig) -> None:
    """Set ``cfg.retrieval`` to the task's default (retriever for rag, gold for generation) or check it."""
    modes = RETRIEVAL_MODES[cfg.task.name]
    if cfg.get("retrieval") is None:
        cfg.retrieval = modes[0]
    elif cfg.retrieval not in modes:
        raise ValueError(f"task={cfg.task.name} takes retrieval={'|'.join(modes)}, got retrieval={cfg.retrieval!r}")


def load_questions(cfg: DictConfig) -> dict[str, list[QAExample]]:
    """The first ``rag.max_queries`` questions of each data set (a ``DataError`` names an unknown one)."""
    rag = cfg.rag
    return {ds: load_qa(cfg.data.qa_source, ds, rag.split)[: rag.max_queries or None] for ds in rag.datasets}


def plan_queries(
    cfg: DictConfig, accelerator, output_dir: Path, qa: dict[str, list[QAExample]] | None = None
) -> tuple[list[PlannedQuery], PageStore]:
    """The run's queries in a fixed order with the page ids each gets, and the corpora they come from."""
    rag = cfg.rag
    qa = load_questions(cfg) if qa is None else qa
    configs = sorted({pools(ds)[p] for ds in rag.datasets for p in rag.pools} | set(rag.datasets))
    generator = cfg.generator
    text = generator.get("input", GeneratorConfig.input) == "text"
    store = PageStore([load_corpus(cfg.data.corpus_source, c, rag.split) for c in configs],
                      generator.get("text_column", GeneratorConfig.text_column) if text else None,
                      generator.get("max_page_tokens", GeneratorConfig.max_page_tokens))
    if cfg.retrieval == "retriever":
        runs = retrieve(cfg, accelerator, output_dir)
        planned = [PlannedQuery(ex, ds, pool, ranked(runs[ds][pool].get(ex.query_id, {}), rag.top_k))
                   for ds in rag.datasets for pool in rag.pools for ex in qa[ds]]
        warn_few_pages({q.key: len(q.page_ids) for q in planned}, rag.top_k, "rag.top_k",
                       "the retriever ranked fewer pages (a smaller pool); they are answered from those")
        return planned, store
    if cfg.retrieval == "gold":
        planned = [PlannedQuery(ex, ds, "gold", list(ex.relevant_doc_ids[: rag.top_k])) for ds in rag.datasets
                   for ex in qa[ds]]
        warn_few_pages({q.key: len(q.page_ids) for q in planned}, rag.top_k, "rag.top_k",
                       "they are answered from the gold pages they have")
        return planned, store
    return [PlannedQuery(ex, ds, "none", []) for ds in rag.datasets for ex in qa[ds]], store


def ranked(scores: dict[str, float], k: int) -> list[str]:
    """The ``k`` best doc ids of one query's run, best first."""
    return [doc_id for doc_id, _ in sorted(scores.items(), key=lambda item: -item[1])[:k]]


def retrieve(cfg: DictConfig, accelerator, output_dir: Path) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Rank every query's pages with the ``retriever`` config (``dense``: all ranks encode, rank 0 searches;
    ``bm25``, ``hybrid``: as ``task=retrieval`` ranks); broadcast the runs. A region ranker (``retriever=regions_*``
    over a region corpus) gives each query's ranked units instead: the generator reads the top crops, while the
    retrieval table stays page-level."""
    factory = instantiate(cfg.retriever)
    model = VisualModel(cfg, accelerator.device) if isinstance(factory, functools.partial) else None
    retrieval_cfg = eval_config(cfg)
    retrieval_cfg.datasets, retrieval_cfg.pools = list(cfg.rag.datasets), list(cfg.rag.pools)
    check_pools(retrieval_cfg)
    retriever = bind_ranker(factory, model, retrieval_cfg, output_dir / "retrieval")
    result = evaluate_ranker(retriever, retrieval_cfg, output_dir / "retrieval")
    if accelerator.is_main_process:
        write_text(output_dir / TABLE_FILE, result["table"] + "\n")
    runs = [retriever.unit_runs(result["runs"]) if isinstance(retriever, RegionRanker) and "runs" in result
            else result.get("runs")]
    if accelerator.num_processes > 1:
        runs = broadcast_object_list(runs, from_process=0)
    del retriever
    return runs[0]


def run_identity(cfg: DictConfig) -> dict[str, Any]:
    """What determines the answers: a resumed trace must come from the same settings (the task by name); where
    OCR is cached (``rag.grounding.cache``) changes no answer or box."""
    keys = ("retrieval", "retriever", "model", "data", "lvlm", "generator", "judge", "rag")
    identity = {"task": cfg.task.name}
    identity.update({key: OmegaConf.to_container(cfg[key], resolve=True) if isinstance(cfg.get(key), DictConfig)
                     else cfg.get(key) for key in keys})
    if isinstance(grounding := (identity.get("rag") or {}).get("grounding"), dict):
        grounding.pop("cache", None)
    identity["run_dir"] = str(resolve_run_dir(cfg.run_dir)) if cfg.get("run_dir") else None  # `latest` moves on
    return identity


def prepare_run_dir(cfg: DictConfig, output_dir: Path) -> None:
    """Start fresh (``rag.resume=false``) or check that the trace there was made with these settings."""
    identity = run_identity(cfg)
    marker = output_dir / RUN_CONFIG_FILE
    parts = output_dir / PARTS_DIR
    if not cfg.rag.resume:
        shutil.rmtree(parts, ignore_errors=True)
    elif not marker.is_file() and parts.is_dir() and any(parts.iterdir()):
        raise ValueError(f"{parts} holds answers but {marker} is missing: nothing vouches for the settings they were "
                         "made with, so they cannot be resumed; restore the file, use another run directory, or "
                         "rag.resume=false to start over")
    elif marker.is_file() and parts.is_dir():
        saved = read_json(marker, keys=("identity",), what="run config")
        changed = sorted(k for k in identity if saved.get("identity", {}).get(k) != identity[k])
        if changed:
            raise ValueError(
                f"{output_dir} holds a trace made with other settings ({', '.join(changed)} differ); "
                "use another run directory or rag.resume=false to start over"
            )
    write_json(marker, {"hash": config_hash(identity), "identity": identity})


def generator_problems(cfg: DictConfig) -> list[str]:
    """Every problem of ``cfg``'s ``generator`` group (:meth:`agents.pipeline.GeneratorConfig.problems`), for
    :func:`~hkrag.tasks.validation.validate_config`'s ``extra``: the one place ``hkrag`` reaches the agents' checks,
    shared by ``eval.py task=rag|generation`` and the generator's training (``generator.top_k`` 0 would train on
    examples without pages)."""
    return GeneratorConfig.problems(OmegaConf.to_container(cfg.generator, resolve=True))


def run_dir_problems(cfg: DictConfig) -> list[str]:
    """Why ``run_dir`` (when set) names no finished ``train.py`` run: missing, or half-written (no final
    adapter, no base model) as :func:`~hkrag.tasks.common.trained_model_config` checks."""
    if not cfg.get("run_dir"):
        return []
    try:
        if not resolve_run_dir(cfg.run_dir).is_dir():
            return [f"run_dir={cfg.run_dir!r}: {missing_run_dir(cfg.run_dir)}"]
        trained_model_config(cfg.model, cfg.run_dir)
    except FileNotFoundError as error:
        return [f"run_dir={cfg.run_dir!r}: {error}"]
    return []


def to_query(item: PlannedQuery, store: PageStore) -> Query:
    return Query(
        query_id=item.example.query_id, question=question_text(item.example),
        pages=[store.page(doc_id) for doc_id in item.page_ids], gold=list(item.example.answers),
        dataset=item.dataset, pool=item.pool,
    )


def is_run_level(error: BaseException) -> bool:
    """Whether ``error`` stops the run (:data:`RUN_LEVEL_ERRORS`, or not an ``Exception`` at all, e.g. a
    ``KeyboardInterrupt``) rather than failing only the query that raised it."""
    return not isinstance(error, Exception) or isinstance(error, RUN_LEVEL_ERRORS)


def describe_error(error: BaseException) -> str:
    """``"unexpected ValueError: message"``, the message cut to :data:`FAILURE_CHARS`."""
    return valid_text(f"unexpected {type(error).__name__}: {str(error)[:FAILURE_CHARS]}")


def failed_outcome(item: PlannedQuery, error: Exception) -> QueryOutcome:
    """The record of a query whose answer raised an unexpected per-query error: failed, counted wrong."""
    example = item.example
    return QueryOutcome(example.query_id, question_text(example), valid_text(list(example.answers)),
                        dataset=item.dataset, pool=item.pool, retrieved=list(item.page_ids), failed=True,
                        failure=describe_error(error))


def judged(judge, outcome: QueryOutcome) -> dict[str, Any]:
    """The judge's verdict; an unexpected per-query error is a verdict without a score (counted wrong)."""
    try:
        return judge.judge(outcome.question, outcome.gold, "" if outcome.failed else outcome.answer)
    except Exception as error:
        if is_run_level(error):
            raise
        logger.warning("judging %s failed: %s", outcome.query_id, describe_error(error))
        return judge.failed_verdict(describe_error(error))


def answer_one(item: PlannedQuery, store: PageStore, generate: Callable[[Query], QueryOutcome], judge,
               grounder: Grounder | None = None) -> QueryOutcome:
    """One planned query answered, scored, grounded (with a ``grounder``) and judged; only a run-level error
    (:func:`is_run_level`) raises."""
    try:
        outcome = QueryOutcome.from_dict(valid_text(generate(to_query(item, store)).to_dict()))
        outcome.dataset, outcome.pool, outcome.retrieved = item.dataset, item.pool, list(item.page_ids)
        if grounder is not None:
            grounder.annotate(outcome)
        outcome.metrics = rule_metrics("" if outcome.failed else outcome.answer, outcome.gold)
    except Exception as error:
        if is_run_level(error):
            raise
        logger.warning("query %s failed: %s", item.key, describe_error(error))
        outcome = failed_outcome(item, error)
    if judge is not None:
        outcome.judge = judged(judge, outcome)
    return outcome


def answer_all(generator_cfg: dict[str, Any], backend: LVLMBackend, queries: Iterable[Query]) -> list[QueryOutcome]:
    """``queries`` answered one by one by the generator ``generator_cfg`` describes on ``backend``, each scored by
    the rule metrics: the agents on held-out queries outside ``eval.py`` (``hkrag.tasks.agent_steps``)."""
    generator = build_generator(generator_cfg, backend)
    outcomes = []
    for outcome in generator.answer_many(queries):
        outcome.metrics = rule_metrics("" if outcome.failed else outcome.answer, outcome.gold)
        outcomes.append(outcome)
    return outcomes


def answer_queries(
    plan: list[PlannedQuery], store: PageStore, generate: Callable[[Query], QueryOutcome], judge, writer: TraceWriter,
    rank: int, world: int, progress: bool, concurrency: int = 1, grounder: Grounder | None = None,
) -> int:
    """Answer this rank's share of ``plan`` that the trace does not hold yet; returns how many were answered.

    At most ``concurrency`` queries are in flight at once (for an HTTP endpoint serving many clients);
    each outcome is appended to the trace as soon as it is finished, in whatever order. A run-level error
    stops the run (see :func:`record_in_window`).
    """
    done = writer.done([item.key for item in plan])
    mine = [item for i, item in enumerate(plan) if i % world == rank and item.key not in done]
    if done:
        logger.info("resuming: %d queries already in the trace, %d left for this process", len(done), len(mine))
    bar = tqdm(total=len(mine), desc="rag", disable=not progress, dynamic_ncols=True)
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            record_in_window(
                pool, mine, lambda item: answer_one(item, store, generate, judge, grounder), writer, concurrency,
                bar.update,
            )
    finally:
        bar.close()
    return len(mine)


def record_in_window(
    pool: ThreadPoolExecutor, items: Iterable[PlannedQuery], work: Callable[[PlannedQuery], QueryOutcome],
    writer: TraceWriter, concurrency: int, on_recorded: Callable[[], Any],
) -> None:
    """Run ``work`` on ``items`` with at most ``concurrency`` in flight, appending each outcome as it finishes.

    A query starts only when one before it is recorded, so a run-level error (raised by ``work`` or by
    the trace) leaves nothing queued: no further query starts, the ones in flight finish and are recorded
    unless the error was an ``OSError`` (the disk may be what failed), and the error is re-raised.
    """
    todo, window = iter(items), set()
    try:
        while True:
            window |= {pool.submit(work, item) for item in islice(todo, concurrency - len(window))}
            if not window:
                return
            finished, _ = wait(window, return_when=FIRST_COMPLETED)
            for future in finished:
                window.discard(future)
                writer.append(future.result())
                on_recorded()
    except BaseException as error:
        record_in_flight(window, writer if not isinstance(error, OSError) else None)
        raise


def record_in_flight(window: set[Future], writer: TraceWriter | None) -> None:
    """After a run-level error: wait for the queries in flight and append those that succeeded (to
    ``writer``, when the trace can still be written); their own errors are logged, not raised."""
    for future in window:
        future.cancel()
    for future in window:
        if future.cancelled():
            continue
        error = future.exception()
        if error is not None:
            logger.warning("a query in flight when the run stopped failed too: %s", describe_error(error))
        elif writer is not None:
            try:
                writer.append(future.result())
            except WriteError as write_error:
                logger.error("%s", write_error)
                return


def check_concurrency(concurrency: int, *backends: LVLMBackend) -> None:
    """Concurrent queries need backends that may be called from several threads (the generator's and the judge's)."""
    for backend in backends:
        if concurrency > 1 and not backend.thread_safe:
            raise ValueError(f"rag.concurrency={concurrency} needs thread-safe backends (HTTP ones such as "
                             f"lvlm=openai); the {backend.name} backend answers one query at a time: set "
                             "rag.concurrency=1")


def build_grounder(cfg: DictConfig, store: PageStore, backend: str) -> Grounder | None:
    """The run's evidence step (``rag.grounding``), with the built-in corpus's gold boxes when the data has
    them; ``None`` for ``source: none`` or a run without pages."""
    settings = GroundingConfig(**OmegaConf.to_container(cfg.rag.get("grounding") or {}, resolve=True))
    source = settings.make_source(backend)
    if source is None or cfg.retrieval == "none":
        return None
    gold = load_gold(cfg.data.root) if cfg.data.get("synthetic") is not None else None
    return Grounder(source, store.view, gold, OcrSettings(psm=settings.psm, upscale=settings.upscale),
                    settings.word_cache())


def page_scorer(cfg: DictConfig) -> tuple[Callable[[QAExample, list[PageImage]], list[float]], LVLMBackend]:
    """The visual reranker's scorer (``retriever=rerank``, :mod:`hkrag.retrieval.rerank`): the generator's
    P(yes | question, page) (:class:`agents.pruner.PageScorer`) with ``cfg.generator``'s prompts on ``cfg.lvlm``'s
    backend, asked the question as the agents ask it; and the backend, for the caller to close."""
    config = GeneratorConfig.from_config(OmegaConf.to_container(cfg.generator, resolve=True))
    backend = build_backend(OmegaConf.to_container(cfg.lvlm, resolve=True))
    scorer = PageScorer(backend, config.prompts, config.caps, config.top_logprobs)
    return (lambda example, pages: scorer(question_text(example), pages)), backend


def run_rag_evaluation(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=rag|generation``: answer every planned query, then report (rank 0).

    Settings, the generator config and the data set names are checked before the run directory is touched;
    the backends and the generator are built (and checked) before any query.
    """
    resolve_retrieval_mode(cfg)
    generator_cfg = OmegaConf.to_container(cfg.generator, resolve=True)
    grounding = OmegaConf.to_container(cfg.rag.get("grounding") or {}, resolve=True)
    validate_config(cfg, extra=run_dir_problems(cfg) + generator_problems(cfg) + GroundingConfig.problems(grounding))
    if cfg.retrieval == "none":
        generator_cfg["allow_no_pages"] = True
    accelerator = make_accelerator(cfg.get("cpu", False))
    output_dir = shared_output_dir(accelerator, output_dir)
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()
    qa = load_questions(cfg)
    if accelerator.is_main_process:
        prepare_run_dir(cfg, output_dir)
    accelerator.wait_for_everyone()
    plan, store = plan_queries(cfg, accelerator, output_dir, qa)
    backend = build_backend(OmegaConf.to_container(cfg.lvlm, resolve=True))
    try:
        judge = build_grader(OmegaConf.to_container(cfg.judge, resolve=True))
        check_concurrency(cfg.rag.concurrency, backend, *([judge.backend] if judge is not None else []))
        generator = build_generator(generator_cfg, backend)
        writer = TraceWriter(output_dir, accelerator.process_index)
        answer_queries(plan, store, generator.answer, judge, writer, accelerator.process_index,
                       accelerator.num_processes, accelerator.is_main_process, cfg.rag.concurrency,
                       build_grounder(cfg, store, backend.name))
    finally:
        backend.close()
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return {}
    return report(cfg, output_dir, plan, store, backend, judge)


def log_report(run_logger: RunLogger, output_dir: Path, summary: dict[str, Any], outcomes: list[QueryOutcome]) -> None:
    """The report in W&B (no-op without it): the Table 3/4/6 layout of each metric ``rag.md`` shows and the
    per-query rows as tables; ``rag.{json,md,html}``, the trace and the retrieval table as an artifact."""
    for metric in layout_metrics(summary):
        run_logger.table(f"rag/{metric}", *comparison_rows({summary["config"]: summary}, metric))
    run_logger.table("rag/per_query", *query_rows(outcomes))
    run_logger.artifact("rag-report", "report", output_dir, [REPORT_FILE, MARKDOWN_FILE, HTML_FILE, MERGED_FILE,
                                                             TABLE_FILE, f"retrieval/{PER_QUERY_FILE}"])


def report(cfg: DictConfig, output_dir: Path, plan: list[PlannedQuery], store: PageStore, backend, judge) -> dict:
    """Merge the trace and write ``rag.json``, ``rag.md``, ``rag.html``; log the summary and the report to W&B."""
    outcomes = merge(output_dir, [item.key for item in plan])
    meta = {
        "config": cfg.get("run_name", "rag"), "task": cfg.task.name, "retrieval": cfg.retrieval,
        "generator": cfg.generator.name, "lvlm": {"backend": backend.name, "model": backend.model},
        "judge": judge.describe() if judge is not None else None, "environment": environment(),
    }
    summary = write_reports(output_dir, outcomes, meta)
    write_html(output_dir / HTML_FILE, outcomes, store.image, title=f"HKRAG {cfg.task.name}: {meta['config']}")
    print((output_dir / MARKDOWN_FILE).read_text())
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    run_logger.summary(flat_metrics(summary))
    log_report(run_logger, output_dir, summary, outcomes)
    run_logger.finish()
    logger.info("trace: %s; report: %s", output_dir / MERGED_FILE, output_dir / MARKDOWN_FILE)
    return summary
