"""Atomic file writes and named reads: every file the project writes or parses goes through here.

A file is written to a hidden temporary name in the same folder, flushed to disk, and renamed over
the target. A crash, a full disk or an exception mid-write leaves the previous version intact (and no
half-written file under the real name); the error names the path that could not be written.
Folders (checkpoints, parquet corpora) use :func:`atomic_directory`: built under a temporary name and
swapped into place only when complete.

Reads of JSON and JSON Lines go through :func:`read_json` / :func:`read_jsonl`: a truncated, non-UTF-8 or
malformed file, or one without the keys its reader needs, raises :class:`FileFormatError` naming the file, the
line (or key) and what is wrong, instead of the parser's bare ``JSONDecodeError`` / ``UnicodeDecodeError``.

The repository's own files are found from any working directory (:func:`local_path`): a relative path the documents
write from the repository's root (``run_dir=weights/reader_tiny``, ``--model weights/layout_tiny/model``) that is
missing under the working directory is looked up under the repository, so a command runs as documented from wherever
a user runs it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any


class WriteError(OSError):
    """A file or folder could not be written; the previous version, if any, is intact."""

    def __init__(self, path: str | Path, error: BaseException) -> None:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        message = f"could not write {path}: {reason}; the previous version (if any) is intact"
        super().__init__(getattr(error, "errno", None), message)
        self.path = Path(path)


class FileFormatError(ValueError):
    """A file that cannot be parsed as its format, or lacks a key its reader needs; the message names the file."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)


def _sibling(path: Path, suffix: str) -> Path:
    """A hidden name beside ``path``, unique per process and thread (two writers never share one)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.{suffix}")


def with_extension(stem: str | Path, extension: str) -> Path:
    """``stem`` with ``extension`` appended: ``top3_h0.8`` -> ``top3_h0.8.md``. A report's ``--out`` names a stem,
    and ``Path.with_suffix`` would swap a dotted stem's last part (``top3_h0.md``), so two reports could collide."""
    stem = Path(stem)
    return stem.with_name(stem.name + extension)


def atomic_write(path: str | Path, write: Callable[[IO], Any], mode: str = "w") -> Path:
    """Write ``path`` through ``write(file)`` on a temporary file, then rename it into place.

    ``mode`` is ``"w"`` (text, UTF-8) or ``"wb"``. Raises :class:`WriteError` naming ``path``.
    """
    path = Path(path)
    tmp = _sibling(path, "tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # no temporary file, or no folder to hold one (a file in the way)
            tmp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise WriteError(path, error) from error
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    return atomic_write(path, lambda f: f.write(text))


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Atomically write ``data`` to ``path``."""
    return atomic_write(path, lambda f: f.write(data), "wb")


def png_bytes(figure: Any, dpi: int = 120) -> bytes:
    """A matplotlib figure as PNG bytes (for :func:`write_bytes`); the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    plt.close(figure)
    return buffer.getvalue()


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Atomically write ``obj`` as JSON to ``path``."""
    return write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def write_jsonl_gz(path: str | Path, rows: Iterable[Any]) -> Path:
    """Atomically write ``rows`` as gzipped JSON lines (keys sorted), byte for byte reproducible (no timestamp in
    the gzip header): small per-query data committed beside a report."""
    text = "".join(json.dumps(row, sort_keys=True, default=str) + "\n" for row in rows)
    return write_bytes(path, gzip.compress(text.encode("utf-8"), mtime=0))


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Build a folder under a temporary name; on success it replaces ``path`` whole.

    Yields the temporary folder to write into. If the body raises, the temporary folder is removed and
    ``path`` keeps its previous content. The swap renames the old folder aside before renaming the new
    one in, so at every instant one complete version exists under ``path`` or its ``.old`` name.
    """
    path = Path(path)
    tmp, old = _sibling(path, "tmp"), _sibling(path, "old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise WriteError(path, error) from error
        raise
    shutil.rmtree(old, ignore_errors=True)


def _text(path: Path) -> str:
    """``path`` decoded as UTF-8 (gunzipped first when it ends in ``.gz``, as :func:`write_jsonl_gz` writes); a bad
    byte raises :class:`FileFormatError` naming its line and offset, a damaged archive naming the file."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise FileFormatError(path, f"not a readable gzip file (truncated or damaged: {error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise FileFormatError(path, f"line {line} is not UTF-8 ({error.reason} at byte {error.start})") from None


def _parse(path: Path, text: str, line: int | None = None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {line}" if line is not None else f"line {error.lineno} column {error.colno}"
        ends_early = error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
        truncated = " (truncated?)" if ends_early else ""
        raise FileFormatError(path, f"{where}: not valid JSON{truncated}: {error.msg}") from None


def _missing(value: Any, keys: Sequence[str]) -> list[str]:
    return [key for key in keys if not isinstance(value, dict) or key not in value]


def read_json(path: str | Path, keys: Sequence[str] = (), what: str = "") -> Any:
    """The JSON document at ``path``; with ``keys``, an object holding each of them. ``what`` names the file's role
    in the error (e.g. ``"run config"``). Raises :class:`FileFormatError` naming the file, or ``FileNotFoundError``."""
    path = Path(path)
    value = _parse(path, _text(path))
    missing = _missing(value, keys)
    if missing:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise FileFormatError(path, f"{what + ' ' if what else ''}lacks key(s) {missing} (found {found})")
    return value


def read_array(path: str | Path, mmap: bool = False) -> Any:
    """The NumPy array saved at ``path`` (``.npy``; memory-mapped read-only with ``mmap``). A truncated or damaged
    file raises :class:`FileFormatError` naming it, never NumPy's bare error; a missing one ``FileNotFoundError``."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise FileFormatError(path, f"not a readable .npy array (truncated or damaged: {error})") from None


def read_jsonl(path: str | Path, keys: Sequence[str] = ()) -> list[Any]:
    """The records of the JSON Lines file at ``path``, gzipped when it ends in ``.gz`` (blank lines skipped); with
    ``keys``, each an object holding them. Raises :class:`FileFormatError` naming the file and the line."""
    path = Path(path)
    rows = []
    for number, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        row = _parse(path, line, number)
        missing = _missing(row, keys)
        if missing:
            raise FileFormatError(path, f"line {number}: record lacks key(s) {missing}")
        rows.append(row)
    return rows


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
