"""``eval.py task=retrieval``: a retriever evaluated as in the paper's Table 2; ``eval.py task=baselines``: its
baseline rows side by side.

The ranker is the ``retriever`` config (``conf/retriever/``): ``dense`` (default: a base + adapter, or a
``train.py`` run's directory, evaluated by the same :func:`hkrag.retrieval.evaluation.evaluate_retrieval` code the
training report uses), ``bm25`` (page text) or ``hybrid`` (both, fused). A retriever config that instantiates to a
partial needs the visual model: the task loads it (``model`` / ``run_dir``) into a
:class:`~hkrag.retrieval.evaluation.DenseRanker`, which is the ranker (``dense``) or is handed to it as ``dense``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from hkrag.environment import ENVIRONMENT_FILE, record_environment
from hkrag.io import write_json, write_text
from hkrag.retrieval.baselines import BASELINES_FILE, BASELINES_TABLE, baselines_report
from hkrag.retrieval.degradation import DegradationStudy, run_study
from hkrag.retrieval.evaluation import (
    PER_QUERY_FILE,
    TABLE_FILE,
    TABLE_METRICS,
    DenseRanker,
    Ranker,
    evaluate_ranker,
    per_query_rows,
    retrieval_rows,
)
from hkrag.retrieval.rerank import RerankRanker, check_settings
from hkrag.run_log import RunLogger
from hkrag.tasks.common import (
    check_pools,
    eval_config,
    flat_summary,
    make_accelerator,
    prepare_data,
    shared_output_dir,
)
from hkrag.tasks.rag import page_scorer
from hkrag.tasks.rankers import VisualModel, bind_ranker, needs_model, reranks
from hkrag.tasks.validation import ConfigError, validate_config

RERANK_FILE = "rerank.json"
"""A reranked evaluation's cost (queries, LVLM calls, seconds, per query) and every query's scored pages."""


def run_retrieval_evaluation(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=retrieval``: rank single and all pools with ``cfg.retriever``, write ``retrieval.{json,md}``;
    with ``degrade=[...]`` the degraded-pages study of that one retriever (:func:`run_degradation_study`)."""
    if cfg.get("degrade"):
        return degradation_study(cfg, output_dir, {cfg.retriever.get("name", DenseRanker.name): cfg.retriever})
    results, _, _ = evaluate_rows(cfg, output_dir, {"retriever": cfg.retriever}, by_row=False)
    return results["retriever"]


def run_baselines(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=baselines``: every retriever of ``task.rows`` (BM25, dense, hybrid) evaluated as
    ``task=retrieval`` would, each into ``<output_dir>/<row>/`` and timed; writes ``baselines.{md,json}``."""
    results, times, output_dir = evaluate_rows(cfg, output_dir, dict(cfg.task.rows), by_row=True)
    if not all(results.values()):  # ranks other than 0
        return {}
    report = baselines_report(results, times)
    write_json(output_dir / BASELINES_FILE, report["json"])
    record_environment(output_dir)
    write_text(output_dir / BASELINES_TABLE, report["table"] + "\n")
    print(report["table"])
    return report


def run_degradation_study(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=degradation``: the degraded-pages study (:mod:`hkrag.retrieval.degradation`) of every
    retriever of ``task.rows`` (dense, BM25 over the re-OCRed text, hybrid) under ``degrade``."""
    return degradation_study(cfg, output_dir, dict(cfg.task.rows))


def degradation_study(cfg: DictConfig, output_dir: str | Path, rows: dict[str, DictConfig]) -> dict[str, Any]:
    """Every ranker of ``rows`` scored on the evaluation corpus degraded as ``cfg.degrade`` says, at each strength
    (``cfg.degradation`` holds the seed and OCR settings); writes ``degradation.{json,md}`` into ``output_dir``.

    BM25 reads the OCR text of the degraded pages, which can be empty: its pages without text score 0
    (``allow_empty`` is set on every lexical ranker). The visual model is loaded once for every point. One process
    only: the corpus preparation (degrade, OCR) is not shared across ranks.
    """
    validate_config(cfg)
    study = degradation_plan(cfg)
    accelerator = make_accelerator(cfg.get("cpu", False))
    if accelerator.num_processes > 1:
        raise ValueError("the degradation study runs in one process: use `python eval.py`, not `accelerate launch`")
    factories = {name: instantiate(_with_empty_pages(row)) for name, row in rows.items()}
    model = VisualModel(cfg, accelerator.device) if needs_model(factories) else None
    prepare_data(cfg.data)
    settings = eval_config(cfg)
    check_pools(settings)

    def rankers(point_dir: Path) -> dict[str, Ranker]:
        return {name: bind_ranker(factory, model, settings, point_dir / name) for name, factory in factories.items()}

    output_dir = Path(output_dir)
    result = run_study(study, rankers, settings, output_dir)
    print(result["table"])
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    run_logger.summary({"/".join(str(row[key]) for key in ("degradation", "strength", "retriever", "dataset", "pool",
                                                           "evidence")) + f"/{study.metric}": row[study.metric]
                        for row in result["rows"]})
    run_logger.finish()
    return result


def degradation_plan(cfg: DictConfig) -> DegradationStudy:
    """The study ``cfg.degrade`` and ``cfg.degradation`` describe; a bad item fails naming it (a ConfigError)."""
    specs = OmegaConf.to_container(cfg.degrade) if isinstance(cfg.degrade, ListConfig) else cfg.degrade
    try:
        return instantiate(cfg.degradation, specs=specs)
    except InstantiationException as error:
        cause = error.__cause__ or error
        raise ConfigError(f"invalid config value(s):\n  degrade={specs!r}: {cause}") from cause


def _with_empty_pages(row: DictConfig) -> DictConfig:
    """``row`` with ``allow_empty: true`` wherever it has the setting (BM25, a hybrid's ``lexical``)."""
    row = row.copy()
    for node in (row, row.get("lexical")):
        if isinstance(node, DictConfig) and "allow_empty" in node:
            node.allow_empty = True
    return row


def evaluate_rows(
    cfg: DictConfig, output_dir: str | Path, rows: dict[str, DictConfig], by_row: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, float], Path]:
    """Evaluate the ranker of each ``retriever`` config of ``rows`` into ``output_dir`` (``output_dir/<row>`` when
    ``by_row``), each with its report; returns ``{row: result}`` (``{}`` results on ranks other than 0), each
    row's wall time in seconds (its encoding, search and scoring; the first row that needs the visual model also
    loads it) and the output folder."""
    validate_config(cfg)
    accelerator = make_accelerator(cfg.get("cpu", False))
    output_dir = shared_output_dir(accelerator, output_dir)
    factories = {name: instantiate(row) for name, row in rows.items()}  # bad settings fail before any work
    for factory in filter(reranks, factories.values()):
        given = factory.keywords
        check_settings(given.get("rerank", RerankRanker.rerank), given.get("depth", RerankRanker.depth))
    model = VisualModel(cfg, accelerator.device) if needs_model(factories) else None
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()
    settings = eval_config(cfg)
    check_pools(settings)
    results, times = {}, {}
    scorer, backend = page_scorer(cfg) if any(map(reranks, factories.values())) else (None, None)
    try:
        for row, factory in factories.items():
            work_dir = output_dir / row if by_row else output_dir
            start = time.perf_counter()
            ranker = bind_ranker(factory, model, settings, work_dir, scorer)
            name = ranker.name if by_row and isinstance(ranker, DenseRanker) else row  # late_interaction says so
            results[name] = evaluate_ranker(ranker, settings, work_dir)
            times[name] = time.perf_counter() - start
            if isinstance(ranker, RerankRanker) and results[name]:
                results[name]["rerank"] = {**ranker.cost, **ranker.per_query_cost()}
                write_json(work_dir / RERANK_FILE, {**results[name]["rerank"], "queries": ranker.trace})
            if accelerator.is_main_process:
                write_report(cfg, work_dir, results[name])
    finally:
        if backend is not None:
            backend.close()
    return results, times, output_dir


def write_report(cfg: DictConfig, output_dir: Path, result: dict[str, Any]) -> None:
    """``retrieval.json`` / ``retrieval.md`` in ``output_dir``, the table printed, the summary logged."""
    write_json(output_dir / "retrieval.json", result["results"])
    record_environment(output_dir)
    write_text(output_dir / TABLE_FILE, result["table"] + "\n")
    print(result["table"])
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    run_logger.summary(flat_summary({"after": result["results"]}))
    log_retrieval(run_logger, result)
    run_logger.artifact("retrieval-report", "report", output_dir,
                        ["retrieval.json", TABLE_FILE, PER_QUERY_FILE, ENVIRONMENT_FILE])
    run_logger.finish()


def log_retrieval(run_logger: RunLogger, result: dict[str, Any], prefix: str = "retrieval") -> None:
    """An evaluation's Table 2 of every metric ``retrieval.md`` shows (x100) and its per-query rows as W&B tables
    under ``prefix/`` (no-op without W&B): the rows ``retrieval.md`` and ``per_query.json`` hold."""
    for metric in TABLE_METRICS:
        run_logger.table(f"{prefix}/{metric}", *retrieval_rows(result["results"], metric))
    run_logger.table(f"{prefix}/per_query", *per_query_rows(result["per_query"]))
