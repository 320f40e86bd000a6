"""Carry a many-run command's folder between sittings: ``save`` copies what a later sitting needs from ``OUT`` (the
ladder's, the replica's: every run under ``OUT/runs`` and ``OUT``'s own files) into a folder small enough to commit,
``restore`` puts it back, so the same command, run again, continues where the last sitting stopped.

A finished run keeps everything but its intermediate checkpoints (``checkpoints/final`` stays, what later runs
load, without its optimizer, scheduler and RNG states) and its HTML views; an unfinished training run keeps its
latest ``step-N`` checkpoint, its base, its ``.hydra`` overrides and ``pieces.json`` (the seconds of each sitting),
which is what :func:`~hkrag.tasks.common.run_job` resumes from. JSON-lines files are gzipped on the way (byte for byte
reproducible) and unpacked on the way back.

    python -m hkrag.tasks.pieces save outputs/ladder_l4t16 docs/ladder/l4t16/pieces
    python -m hkrag.tasks.pieces restore docs/ladder/l4t16/pieces outputs/ladder_l4t16
"""

from __future__ import annotations

import argparse
import gzip
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from hkrag.cli import existing, usage_errors
from hkrag.io import atomic_directory, read_json, write_bytes, write_json
from hkrag.training.checkpoint import CHECKPOINTS_DIR, FINAL_CHECKPOINT, latest_checkpoint

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
MANIFEST_FILE = "pieces_manifest.json"
"""What ``save`` wrote: each gzipped file's path (relative to the saved folder), for ``restore`` to unpack."""
DROPPED_SUFFIXES = (".html",)
"""Views rebuilt from the runs' data, not read by any later run or report."""
RESUME_ONLY = ("optimizer.pt", "scheduler.pt", "rng-")
"""A checkpoint's files only a resumed run reads: dropped from a finished run's ``final`` (later runs load its base
and adapter)."""


def kept_checkpoint(run: Path) -> Path | None:
    """The one checkpoint of ``run`` a later sitting needs: ``final`` when the run finished, else its latest
    ``step-N`` (None: no checkpoint)."""
    final = run / CHECKPOINTS_DIR / FINAL_CHECKPOINT
    return final if final.is_dir() else latest_checkpoint(run)


def _files(run: Path) -> list[Path]:
    """``run``'s files a later sitting needs (:func:`_carried`)."""
    kept = kept_checkpoint(run)
    return sorted(path for path in run.rglob("*") if path.is_file() and _carried(path, run, kept))


def _carried(path: Path, run: Path, kept: Path | None) -> bool:
    """Whether ``path`` of ``run`` is carried: not a dropped view, and inside ``checkpoints`` only within ``kept``
    (:func:`kept_checkpoint`), a finished run's ``final`` without its :data:`RESUME_ONLY` files."""
    if path.name.endswith(DROPPED_SUFFIXES):
        return False
    if not path.is_relative_to(run / CHECKPOINTS_DIR):
        return True
    if kept is None or not path.is_relative_to(kept):
        return False
    return not (kept.name == FINAL_CHECKPOINT and path.parent == kept and path.name.startswith(RESUME_ONLY))


def _copy(source: Path, target: Path, gzipped: list[str], root: Path) -> None:
    if source.suffix == ".jsonl":
        target = target.with_name(target.name + ".gz")
        write_bytes(target, gzip.compress(source.read_bytes(), mtime=0))
        gzipped.append(target.relative_to(root).as_posix())
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def save(out: Path, dest: Path) -> list[str]:
    """Copy ``out``'s files and runs (as the module says) into ``dest``, which is replaced whole; returns the runs'
    names. ``ValueError`` when ``out`` holds no ``runs`` folder, or ``dest`` is not a new folder or an earlier save
    apart from ``out`` (replacing it would lose data)."""
    runs = sorted(path for path in (out / RUNS_DIR).glob("*") if path.is_dir())
    if not runs:
        raise ValueError(f"{out} holds no runs (no folder under {out / RUNS_DIR}): "
                         "is it a ladder's or replica's --out?")
    _apart(out, dest)
    if dest.exists() and not (dest / MANIFEST_FILE).is_file():
        raise ValueError(f"{dest} exists and is not a pieces save (no {MANIFEST_FILE}): a save replaces its folder "
                         "whole, so give a new folder or an earlier save")
    gzipped: list[str] = []
    with atomic_directory(dest) as tmp:
        for path in sorted(out.iterdir()):
            if path.is_file() and not path.name.endswith(DROPPED_SUFFIXES):
                _copy(path, tmp / path.name, gzipped, tmp)
        for run in runs:
            for path in _files(run):
                _copy(path, tmp / RUNS_DIR / run.name / path.relative_to(run), gzipped, tmp)
        write_json(tmp / MANIFEST_FILE, {"gzipped": gzipped})
    return [run.name for run in runs]


def restore(src: Path, out: Path) -> dict[str, list[str]]:
    """Put ``save``'s folder ``src`` back as ``out``: each run absent from ``out/runs`` is restored whole (each
    atomically), one already there is kept as it is (it may be further along); ``out``'s own files likewise.
    Returns ``{"restored": [...], "kept": [...]}`` (run names)."""
    _apart(src, out)
    gzipped = set(read_json(src / MANIFEST_FILE, keys=("gzipped",), what="a pieces save")["gzipped"])
    done: dict[str, list[str]] = {"restored": [], "kept": []}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name != MANIFEST_FILE:
            _unpack(path, out, gzipped, src)
    for run in sorted(path for path in (src / RUNS_DIR).glob("*") if path.is_dir()):
        target = out / RUNS_DIR / run.name
        if target.exists():
            done["kept"].append(run.name)
            continue
        with atomic_directory(target) as tmp:
            for path in sorted(p for p in run.rglob("*") if p.is_file()):
                _unpack(path, tmp / path.relative_to(run).parent, gzipped, src)
        done["restored"].append(run.name)
    return done


def _apart(first: Path, second: Path) -> None:
    """``ValueError`` unless neither folder is the other or lies inside it."""
    a, b = first.resolve(), second.resolve()
    if a.is_relative_to(b) or b.is_relative_to(a):
        raise ValueError(f"{first} and {second} overlap: the save and the command's folder must be apart")


def _unpack(path: Path, folder: Path, gzipped: set[str], root: Path) -> None:
    """Copy ``path`` into ``folder`` (gunzipped when ``save`` gzipped it) unless a file of its name is there."""
    packed = path.relative_to(root).as_posix() in gzipped
    target = folder / (path.name.removesuffix(".gz") if packed else path.name)
    if target.exists():
        return
    if packed:
        write_bytes(target, gzip.decompress(path.read_bytes()))
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    save_parser = commands.add_parser("save", help="copy OUT's runs into DEST (replaced whole)")
    save_parser.add_argument("out", type=existing("dir", holding=(RUNS_DIR,), what="a ladder's or replica's --out"))
    save_parser.add_argument("dest", type=Path)
    restore_parser = commands.add_parser("restore", help="put SRC (a save) back as OUT; runs already there are kept")
    restore_parser.add_argument("src", type=existing("dir", holding=(MANIFEST_FILE,), what="a pieces save"))
    restore_parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with usage_errors(parser):
        if args.command == "save":
            names = save(args.out, args.dest)
            logger.info("saved %d runs of %s into %s", len(names), args.out, args.dest)
        else:
            done = restore(args.src, args.out)
            logger.info("restored %d runs into %s; kept %d already there: %s", len(done["restored"]), args.out,
                        len(done["kept"]), ", ".join(done["kept"]) or "none")


if __name__ == "__main__":
    main()
