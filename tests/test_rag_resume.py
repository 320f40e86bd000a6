"""Kill -9 must not change the report: ``eval.py task=generation`` SIGKILLed mid-run and rerun reports exactly
what an uninterrupted run reports (hkrag/rag/trace.py, hkrag/tasks/rag.py).

The generator runs on the scripted LVLM (conf/lvlm/scripted.yaml), slowed down so the kill lands after some
but not all answers are in the trace. Only wall-clock fields differ between two runs: ``wall_s_p50`` and
``wall_s_p95`` in ``rag.json`` (the "Wall" columns of ``rag.md``'s cost table, masked there), and
``wall_s`` / ``latency_s`` in the trace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from test_rag_task import QUERIES_PER_DATASET, ROOT, SMALL_DATA, config, data  # noqa: F401 (data: a fixture)

from hkrag.rag.trace import PARTS_DIR, load_trace
from hkrag.tasks import run_eval_task

SCRIPTED = ["lvlm=scripted", "lvlm.delay_s=0.15"]  # two calls per query: 0.3 s each
QUERIES = 2 * QUERIES_PER_DATASET
WALL_CLOCK = {"wall_s_p50", "wall_s_p95", "wall_s", "latency_s"}


def without_wall_clock(value: Any) -> Any:
    """``value`` (a report or a trace record) without the fields that measure elapsed time."""
    if isinstance(value, dict):
        return {k: without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [without_wall_clock(v) for v in value]
    return value


def masked_markdown(text: str) -> str:
    """``rag.md`` with every table column headed "Wall …" masked."""
    lines, wall = text.split("\n"), []
    for number, line in enumerate(lines):
        cells = line.split(" | ")
        if not line.startswith("|"):
            wall = []
        elif any("Wall" in cell for cell in cells):
            wall = [column for column, cell in enumerate(cells) if "Wall" in cell]
        elif wall and not line.startswith("|---"):
            lines[number] = " | ".join("–" if column in wall else cell for column, cell in enumerate(cells))
    return "\n".join(lines)


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def kill_mid_run(data_dir: Path, out: Path) -> int:
    """Start ``eval.py`` in a subprocess, SIGKILL it once two answers are in its trace; the lines written."""
    command = [sys.executable, "eval.py", f"hydra.run.dir={out}", f"paths.data_dir={data_dir}", *SMALL_DATA,
               f"rag.max_queries={QUERIES_PER_DATASET}", "task=generation", *SCRIPTED]
    log = out.parent / "killed.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 180
        while complete_lines(out / PARTS_DIR / "rank-0.jsonl") < 2:
            assert process.poll() is None, f"eval.py ended before the kill:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "eval.py wrote no answer in 180 s"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
    return complete_lines(out / PARTS_DIR / "rank-0.jsonl")


def test_a_run_killed_with_sigkill_and_rerun_reports_what_an_uninterrupted_run_reports(tmp_path, data):  # noqa: F811
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    written = kill_mid_run(data, killed)
    assert 2 <= written < QUERIES and not (killed / "rag.json").exists()

    run_eval_task(config(data, *SCRIPTED, grounded=True), killed)  # grounded as the killed run: evidence compared
    run_eval_task(config(data, *SCRIPTED, grounded=True), reference)

    part = [json.loads(line)["query_id"] for line in (killed / PARTS_DIR / "rank-0.jsonl").open()]
    assert len(part) == len(set(part)) == QUERIES  # every query answered once, across the kill
    report, expected = (json.loads((run / "rag.json").read_text()) for run in (killed, reference))
    assert without_wall_clock(report) == without_wall_clock(expected)
    assert masked_markdown((killed / "rag.md").read_text()) == masked_markdown((reference / "rag.md").read_text())
    trace, expected_trace = ([o.to_dict() for o in load_trace(run / "trace.jsonl")] for run in (killed, reference))
    assert without_wall_clock(trace) == without_wall_clock(expected_trace)
