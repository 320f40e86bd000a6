"""``eval.py task=retrieval``: a retriever evaluated as in the paper's Table 2.

A retriever (base + adapter, or a ``train.py`` run's directory) evaluated by the same
:func:`hkrag.retrieval.evaluation.evaluate_retrieval` the training report used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hkrag.io import write_json, write_text
from hkrag.retrieval.evaluation import TABLE_FILE, evaluate_retrieval
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
    """``eval.py task=retrieval``: encode, search single and all pools, write ``retrieval.{json,md}``."""
    validate_config(cfg)
    accelerator = make_accelerator(cfg.get("cpu", False))
    output_dir = shared_output_dir(accelerator, output_dir)
    model_cfg, identity = evaluated_model(cfg)
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()
    check_pools(eval_config(cfg))
    retriever = build_retriever(model_cfg, trainable=False)
    retriever.model.to(accelerator.device)
    result = evaluate_retrieval(retriever, eval_config(cfg), output_dir, identity)
    if accelerator.is_main_process:
        write_json(output_dir / "retrieval.json", result["results"])
        write_text(output_dir / TABLE_FILE, result["table"] + "\n")
        print(result["table"])
        run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                               config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
        run_logger.summary(flat_summary({"after": result["results"]}))
        run_logger.finish()
    return result
