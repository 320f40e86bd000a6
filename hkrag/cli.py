"""Command-line inputs of the report commands: paths checked as arguments are parsed (:func:`existing`), and a
refused run reported as a usage error (:func:`usage_errors`), so a bad input is named before (or instead of) a
traceback (docs/errors.md, "Input paths of the report commands")."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hkrag.io import local_path


def existing(kind: str = "file", holding: Sequence[str] = (), what: str = "") -> Callable[[str], Path]:
    """An argparse ``type`` for an input path: the ``Path`` (found by :func:`local_path`, so a repository path such
    as ``docs/...`` works from any folder), once it is an existing ``kind`` (``"file"`` or ``"dir"``) that holds each
    of ``holding`` (paths inside a folder); otherwise argparse's usage error naming the argument, the path and what
    is missing (``what`` says what the folder should be), before any work starts."""
    if kind not in ("file", "dir"):
        raise ValueError(f"kind={kind!r}: expected 'file' or 'dir'")

    def path(text: str) -> Path:
        found = local_path(text)
        if not found.exists():
            raise argparse.ArgumentTypeError(f"{text}: no such {'folder' if kind == 'dir' else 'file'}")
        if (kind == "dir") != found.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: {'not a folder' if kind == 'dir' else 'a folder, not a file'}")
        missing = [str(name) for name in holding if not (found / name).exists()]
        if missing:
            role = f" (is it {what}?)" if what else ""
            raise argparse.ArgumentTypeError(f"{text} has no {', '.join(missing)}{role}")
        return found

    return path


@contextmanager
def usage_errors(parser: argparse.ArgumentParser, errors: type[Exception] = ValueError) -> Iterator[None]:
    """Run the block; an ``errors`` exception (default ``ValueError``: inputs that do not fit together) exits 2 with
    argparse's ``prog: error: message`` line, as a bad argument does."""
    try:
        yield
    except errors as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
