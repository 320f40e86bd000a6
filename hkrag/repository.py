"""The repository's own files from any working directory: a relative path the documents write from the repository's
root (``run_dir=weights/reader_tiny``, ``--model weights/layout_tiny/model``) that is missing under the working
directory is looked up under the repository, so a command runs as documented from wherever a user runs it."""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
"""The repository's root (the folder holding ``hkrag/``, ``conf/`` and ``weights/``)."""


def repository_locations(path: str | Path) -> list[Path]:
    """Where ``path`` is looked for, in order: as given (relative to the working directory), then, when relative,
    under :data:`REPOSITORY`."""
    path = Path(path)
    return [path] if path.is_absolute() else [path, REPOSITORY / path]


def local_path(path: str | Path) -> Path:
    """The first of :func:`repository_locations` that exists, else ``path`` as given (its error names it)."""
    return next((found for found in repository_locations(path) if found.exists()), Path(path))
