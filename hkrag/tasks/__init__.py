"""One module per task: ``training`` (``train.py``), ``retrieval`` (``eval.py task=retrieval``) and ``rag``
(``eval.py task=rag|generation``); ``common`` holds what they share. Modules load on demand."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

EVAL_TASKS = {
    "retrieval": "hkrag.tasks.retrieval:run_retrieval_evaluation",
    "rag": "hkrag.tasks.rag:run_rag_evaluation",
    "generation": "hkrag.tasks.rag:run_rag_evaluation",
}


def run_eval_task(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.task`` (one of :data:`EVAL_TASKS`) into ``output_dir``."""
    if cfg.task not in EVAL_TASKS:
        raise ValueError(f"task={cfg.task!r} is not a task; choose from {sorted(EVAL_TASKS)}")
    module, name = EVAL_TASKS[cfg.task].split(":")
    return getattr(importlib.import_module(module), name)(cfg, output_dir)
