"""Run logging: a local JSONL always, W&B when enabled (``offline``/``disabled`` need no network)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""The run directory's metrics log (one JSON row per logged step)."""


class RunLogger:
    """Writes metrics of the main process to ``<dir>/metrics.jsonl`` and, if enabled, to W&B.

    Args:
        directory: the run directory.
        wandb_mode: ``online``, ``offline`` or ``disabled`` (``WANDB_MODE`` overrides it).
        enabled: False on non-main ranks: every call becomes a no-op.
    """

    def __init__(
        self,
        directory: str | Path,
        project: str = "hkrag",
        wandb_mode: str = "disabled",
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.path = Path(directory) / METRICS_FILE
        self.run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=project, name=name, dir=str(directory), mode=wandb_mode, config=dict(config or {})
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log(dict(row), step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update({k: _plain(v) for k, v in values.items()})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
