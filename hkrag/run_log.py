"""Run logging: a local JSONL always, W&B when enabled (``offline``/``disabled`` need no network).

Besides scalars, a W&B run holds a task's report as W&B objects (:meth:`RunLogger.table`, :meth:`RunLogger.image`,
:meth:`RunLogger.artifact`): each task calls them where it writes the local report, with the rows its Markdown
is built from, so the local files and the run hold the same numbers (docs/evaluation.md, "Reports in W&B").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""The run directory's metrics log (one JSON row per logged step)."""
LOGGER_CONFIG = Path(__file__).resolve().parents[1] / "conf" / "logger" / "default.yaml"
"""The ``logger`` config group's default: what commands outside Hydra (ablation, replica) log with."""


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

    def table(self, name: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """A ``wandb.Table`` under ``name``: ``columns`` and ``rows`` as a report's Markdown table is built from."""
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Table(columns=list(columns), data=[[_plain(v) for v in row] for row in rows])})

    def image(self, name: str, path: str | Path) -> None:
        """The figure at ``path`` (a PNG a report wrote) as a ``wandb.Image`` under ``name``."""
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Image(str(path))})

    def artifact(self, name: str, kind: str, folder: str | Path, files: Iterable[str]) -> None:
        """The report ``files`` of ``folder`` (paths relative to it; those that exist) as one artifact
        ``<name>-<run id>`` of type ``kind``, each file under its relative path (none when no file exists)."""
        present = [str(file) for file in files if (Path(folder) / file).is_file()]
        if self.run is None or not present:
            return
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{name}-{self.run.id}"), type=kind)
        for file in present:
            artifact.add_file(str(Path(folder) / file), name=file)
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()

    @classmethod
    def from_defaults(cls, directory: str | Path, name: str, config: Mapping[str, Any] | None = None) -> RunLogger:
        """A logger with :data:`LOGGER_CONFIG`'s project and mode (``WANDB_MODE``, else disabled), for commands
        that aggregate runs after the fact and have no Hydra config of their own."""
        settings = OmegaConf.to_container(OmegaConf.load(LOGGER_CONFIG), resolve=True)
        return cls(directory, project=settings["project"], wandb_mode=settings["wandb_mode"], config=config, name=name)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
