"""``eval.py task=retrieval``: a retriever evaluated as in the paper's Table 2; ``eval.py task=baselines``: its
baseline rows side by side.

The ranker is the ``retriever`` config (``conf/retriever/``): ``dense`` (default: a base + adapter, or a
``train.py`` run's directory, evaluated by the same :func:`hkrag.retrieval.evaluation.evaluate_retrieval` code the
training report uses), ``bm25`` (page text) or ``hybrid`` (both, fused). A retriever config that instantiates to a
partial needs the visual model: the task loads it (``model`` / ``run_dir``) into a
:class:`~hkrag.retrieval.evaluation.DenseRanker`, which is the ranker (``dense``) or is handed to it as ``dense``.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hkrag.io import write_json, write_text
from hkrag.retrieval.baselines import BASELINES_FILE, BASELINES_TABLE, baselines_report
from hkrag.retrieval.evaluation import TABLE_FILE, DenseRanker, Ranker, RetrievalEvalConfig, evaluate_ranker
from hkrag.run_log import RunLogger
from hkrag.tasks.common import (
    build_retriever,
    check_pools,
    eval_config,
    evaluated_model,
    flat_summary,
    make_accelerator,
    prepare_data,
    shared_output_dir,
)
from hkrag.tasks.validation import validate_config


def run_retrieval_evaluation(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=retrieval``: rank single and all pools with ``cfg.retriever``, write ``retrieval.{json,md}``."""
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
    write_text(output_dir / BASELINES_TABLE, report["table"] + "\n")
    print(report["table"])
    return report


def evaluate_rows(
    cfg: DictConfig, output_dir: str | Path, rows: dict[str, DictConfig], by_row: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, float], Path]:
    """Evaluate the ranker of each ``retriever`` config of ``rows`` into ``output_dir`` (``output_dir/<row>`` when
    ``by_row``), each with its report; returns ``{row: result}`` (``{}`` results on ranks other than 0), each
    row's wall time in seconds (its model loading, encoding, search and scoring) and the output folder."""
    validate_config(cfg)
    accelerator = make_accelerator(cfg.get("cpu", False))
    output_dir = shared_output_dir(accelerator, output_dir)
    factories = {name: instantiate(row) for name, row in rows.items()}  # bad settings fail before any work
    model = evaluated_model(cfg) if any(isinstance(f, functools.partial) for f in factories.values()) else None
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()
    settings = eval_config(cfg)
    check_pools(settings)
    results, times = {}, {}
    for name, factory in factories.items():
        work_dir = output_dir / name if by_row else output_dir
        start = time.perf_counter()
        results[name] = evaluate_ranker(bind_ranker(factory, model, settings, work_dir, accelerator.device),
                                        settings, work_dir)
        times[name] = time.perf_counter() - start
        if accelerator.is_main_process:
            write_report(cfg, work_dir, results[name])
    return results, times, output_dir


def bind_ranker(
    factory: Ranker | functools.partial, model: tuple[DictConfig, dict[str, Any]] | None,
    settings: RetrievalEvalConfig, work_dir: Path, device: torch.device | str,
) -> Ranker:
    """The ranker of an instantiated ``retriever`` config: itself, or (a partial) given the visual retriever of
    ``model`` (:func:`hkrag.tasks.common.evaluated_model`) as a :class:`DenseRanker` searching into ``work_dir``."""
    if not isinstance(factory, functools.partial):
        return factory
    model_cfg, identity = model
    retriever = build_retriever(model_cfg, trainable=False)
    retriever.model.to(device)
    dense = DenseRanker(retriever, settings, work_dir, identity)
    return dense if factory.func is DenseRanker else factory(dense=dense)


def write_report(cfg: DictConfig, output_dir: Path, result: dict[str, Any]) -> None:
    """``retrieval.json`` / ``retrieval.md`` in ``output_dir``, the table printed, the summary logged."""
    write_json(output_dir / "retrieval.json", result["results"])
    write_text(output_dir / TABLE_FILE, result["table"] + "\n")
    print(result["table"])
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    run_logger.summary(flat_summary({"after": result["results"]}))
    run_logger.finish()
