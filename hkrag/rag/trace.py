"""The RAG run's trace: one JSON line per answered query, appended as it is answered, resumable.

Each process appends to its own ``trace/rank-<r>.jsonl``; a line is written whole, fsync'd before the
next query's result is recorded, and a write that fails (disk full, read-only folder) is cut back off,
so the file never holds a fragment that a later append would bury. On restart every ``trace/*.jsonl``
is read (whatever world size wrote it): queries with a complete line are not asked again, and a torn
last line (the kill landed mid-write, possibly mid-character) is dropped and its query re-answered.
When all processes are done, rank 0 merges the parts into ``trace.jsonl`` in the run's query order
(an atomic write), which is what the reports and the HTML page read.

What a resumed run refuses (:class:`TraceError`, naming the file, line or query): a malformed line
that is not the last one, a query recorded twice with different content (recorded twice identically,
e.g. a copied line, is kept once), and a record of a query that is not in the run's plan (a trace
copied from another run, or data that changed under the same settings): the trace is the evidence of
the run, so nothing in it is silently ignored or overwritten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hkrag.io import WriteError, write_bytes
from hkrag.rag.records import QueryOutcome

logger = logging.getLogger(__name__)

PARTS_DIR = "trace"
MERGED_FILE = "trace.jsonl"


class TraceError(ValueError):
    """A trace that cannot be resumed from or merged; the message names the file and line, or the query."""


def outcome_key(outcome: QueryOutcome) -> str:
    """The identity of an answered query within a run: data set, pool and query id."""
    return f"{outcome.dataset}/{outcome.pool}/{outcome.query_id}"


def encode_line(outcome: QueryOutcome) -> bytes:
    """One record as one UTF-8 line; a lone surrogate is written as its JSON escape, so encoding never fails."""
    return (json.dumps(outcome.to_dict(), ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")


def parse_line(raw: bytes) -> QueryOutcome:
    """The record on one line; ``ValueError`` / ``TypeError`` when it is not one."""
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict):
        raise TypeError(f"a JSON {type(data).__name__}, not an object")
    return QueryOutcome.from_dict(data)


def numbered_records(path: Path) -> list[tuple[int, QueryOutcome]]:
    """``(line number, record)`` for every complete line of one trace file; a torn final line is dropped.

    A malformed line anywhere else means the file was edited or corrupted: that raises :class:`TraceError`
    naming the file and line, rather than silently re-answering or losing queries.
    """
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            records.append((number, parse_line(raw)))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            if number == len(lines):  # no newline after it: the write was cut short
                logger.warning("%s: dropping a torn last line (the run was killed mid-write); it is re-answered", path)
                continue
            raise TraceError(f"{path}, line {number}: not a trace record ({type(error).__name__}: {error})") from error
    return records


def read_jsonl(path: Path) -> list[QueryOutcome]:
    """The complete records of one trace file (see :func:`numbered_records`)."""
    return [outcome for _, outcome in numbered_records(path)]


def read_parts(parts_dir: Path) -> dict[str, QueryOutcome]:
    """Every record of every ``*.jsonl`` in ``parts_dir`` by :func:`outcome_key`.

    A query recorded twice must be recorded identically (then it counts once); two different records of
    one query raise :class:`TraceError` naming the query and both places.
    """
    done: dict[str, tuple[str, QueryOutcome]] = {}
    for path in sorted(parts_dir.glob("*.jsonl")):
        for number, outcome in numbered_records(path):
            key, here = outcome_key(outcome), f"{path}, line {number}"
            if key not in done:
                done[key] = (here, outcome)
            elif encode_line(done[key][1]) != encode_line(outcome):
                raise TraceError(f"query {key} is recorded twice with different content ({done[key][0]} and "
                                 f"{here}); delete the wrong line, or rerun with rag.resume=false")
    return {key: outcome for key, (_, outcome) in done.items()}


def check_plan(done: Mapping[str, QueryOutcome], order: Sequence[str], parts_dir: Path) -> None:
    """Raise :class:`TraceError` when the trace holds queries that are not in the run's plan ``order``."""
    planned = set(order)
    foreign = [key for key in done if key not in planned]
    if foreign:
        raise TraceError(f"{parts_dir} holds {len(foreign)} record(s) of queries that are not in this run "
                         f"(e.g. {foreign[:3]}): the trace comes from another run or from other data; use "
                         "another run directory or rag.resume=false")


class TraceWriter:
    """Appends one process's outcomes to ``<run>/trace/rank-<rank>.jsonl``."""

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.parts = Path(run_dir) / PARTS_DIR
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise WriteError(self.parts, error) from error
        self.path = self.parts / f"rank-{rank}.jsonl"
        self._repair()

    def _repair(self) -> None:
        """Rewrite this rank's file without a torn last line, so appends start on a fresh line."""
        if self.path.is_file() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            write_bytes(self.path, b"".join(encode_line(o) for o in read_jsonl(self.path)))

    def done(self, order: Sequence[str] | None = None) -> dict[str, QueryOutcome]:
        """Every completed outcome of every part file, by :func:`outcome_key`; checked against the plan
        ``order`` when given (see :func:`read_parts`, :func:`check_plan`)."""
        done = read_parts(self.parts)
        if order is not None:
            check_plan(done, order, self.parts)
        return done

    def append(self, outcome: QueryOutcome) -> None:
        """Write one outcome as one line, durably; on failure the file is cut back to its previous end and
        :class:`~hkrag.io.WriteError` names it."""
        line = encode_line(outcome)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise WriteError(self.path, error) from error
        try:
            end = os.fstat(fd).st_size
            try:
                written = memoryview(line)
                while written:
                    written = written[os.write(fd, written):]
                os.fsync(fd)
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise WriteError(self.path, error) from error
        finally:
            os.close(fd)


def merge(run_dir: str | Path, order: Sequence[str]) -> list[QueryOutcome]:
    """Merge the part files into ``trace.jsonl`` following ``order`` (outcome keys); returns the outcomes.

    Raises :class:`TraceError` for records outside ``order`` and ``ValueError`` naming the missing queries
    when a part is incomplete (a process died).
    """
    run_dir = Path(run_dir)
    done = read_parts(run_dir / PARTS_DIR)
    check_plan(done, order, run_dir / PARTS_DIR)
    missing = [key for key in order if key not in done]
    if missing:
        raise ValueError(f"{len(missing)} queries have no trace record (e.g. {missing[:3]}); rerun to finish them")
    outcomes = [done[key] for key in order]
    write_trace(run_dir / MERGED_FILE, outcomes)
    return outcomes


def write_trace(path: str | Path, outcomes: Iterable[QueryOutcome]) -> Path:
    """Write ``outcomes`` as a JSONL trace, atomically."""
    return write_bytes(path, b"".join(encode_line(o) for o in outcomes))


def load_trace(path: str | Path) -> list[QueryOutcome]:
    """Read a merged ``trace.jsonl`` (or a part file)."""
    return read_jsonl(Path(path))
