"""The RAG run's trace: one JSON line per answered query, appended as it is answered, resumable.

Each process appends to its own ``trace/rank-<r>.jsonl``; a line is written whole, flushed and
fsync'd before the next query starts, so a killed run loses at most the query in flight. On restart
every ``trace/*.jsonl`` is read (whatever world size wrote it): queries with a complete line are not
asked again, and a torn last line (the kill landed mid-write) is dropped and its query re-answered.
When all processes are done, rank 0 merges the parts into ``trace.jsonl`` in the run's query order
(an atomic write), which is what the reports and the HTML page read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from agents.records import QueryOutcome
from hkrag.io import WriteError, write_text

logger = logging.getLogger(__name__)

PARTS_DIR = "trace"
MERGED_FILE = "trace.jsonl"


def outcome_key(outcome: QueryOutcome) -> str:
    """The identity of an answered query within a run: data set, pool and query id."""
    return f"{outcome.dataset}/{outcome.pool}/{outcome.query_id}"


def read_jsonl(path: Path) -> list[QueryOutcome]:
    """The complete records of one trace file; a torn final line is dropped with a warning.

    A malformed line anywhere else means the file was edited or corrupted: that raises ``ValueError``
    naming the file and line, rather than silently re-answering or losing queries.
    """
    lines = path.read_text(encoding="utf-8").split("\n")
    outcomes = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            outcomes.append(QueryOutcome.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            if number == len(lines):
                logger.warning("%s: dropping a torn last line (the run was killed mid-write); it is re-answered", path)
                continue
            raise ValueError(f"{path}, line {number}: not a trace record ({error})") from error
    return outcomes


class TraceWriter:
    """Appends one process's outcomes to ``<run>/trace/rank-<rank>.jsonl``."""

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.parts = Path(run_dir) / PARTS_DIR
        self.parts.mkdir(parents=True, exist_ok=True)
        self.path = self.parts / f"rank-{rank}.jsonl"
        self._repair()

    def _repair(self) -> None:
        """Rewrite this rank's file without a torn last line, so appends start on a fresh line."""
        if self.path.is_file() and not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size:
            kept = read_jsonl(self.path)
            write_text(self.path, "".join(json.dumps(o.to_dict()) + "\n" for o in kept))

    def done(self) -> dict[str, QueryOutcome]:
        """Every completed outcome of every part file, by :func:`outcome_key`."""
        return {outcome_key(o): o for path in sorted(self.parts.glob("*.jsonl")) for o in read_jsonl(path)}

    def append(self, outcome: QueryOutcome) -> None:
        """Write one outcome as one line, durably."""
        line = json.dumps(outcome.to_dict(), ensure_ascii=False) + "\n"
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            raise WriteError(self.path, error) from error


def merge(run_dir: str | Path, order: Sequence[str]) -> list[QueryOutcome]:
    """Merge the part files into ``trace.jsonl`` following ``order`` (outcome keys); returns the outcomes.

    Raises ``ValueError`` naming the missing queries when a part is incomplete (a process died).
    """
    run_dir = Path(run_dir)
    done = {outcome_key(o): o for path in sorted((run_dir / PARTS_DIR).glob("*.jsonl")) for o in read_jsonl(path)}
    missing = [key for key in order if key not in done]
    if missing:
        raise ValueError(f"{len(missing)} queries have no trace record (e.g. {missing[:3]}); rerun to finish them")
    outcomes = [done[key] for key in order]
    write_trace(run_dir / MERGED_FILE, outcomes)
    return outcomes


def write_trace(path: str | Path, outcomes: Iterable[QueryOutcome]) -> Path:
    """Write ``outcomes`` as a JSONL trace, atomically."""
    return write_text(path, "".join(json.dumps(o.to_dict(), ensure_ascii=False) + "\n" for o in outcomes))


def load_trace(path: str | Path) -> list[QueryOutcome]:
    """Read a merged ``trace.jsonl`` (or a part file)."""
    return read_jsonl(Path(path))
