"""One module per task: ``training`` (``train.py``), ``retrieval`` (``eval.py task=retrieval``) and ``rag``
(``eval.py task=rag|generation``), ``replica`` (``python -m hkrag.tasks.replica``: the Table 5 and 6 replica built on
the others); ``common`` holds what they share.

``eval.py``'s task is a config group, ``conf/task/<name>.yaml``: its ``name`` and, under ``run``, the
``_target_`` function it runs (docs/evaluation.md). Modules load on demand, when the task is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig


def run_eval_task(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run the function of ``cfg.task`` (a ``conf/task`` entry) on ``cfg`` into ``output_dir``. Hydra is imported
    here, not with the package, so that ``python -m hkrag.tasks.preflight --help`` does not wait for it."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig

    task = cfg.get("task")
    if not isinstance(task, DictConfig) or "name" not in task or "run" not in task:
        raise ValueError(f"task={task!r} is not a conf/task entry (name, run._target_); pick one with task=<name>, "
                         "e.g. task=rag")
    return instantiate(task.run)(cfg, output_dir)
