"""The README's demo table re-derived from the committed per-query data of its 15 runs (docs/demo_range/runs)."""

import gzip
import json
from pathlib import Path

from readme_commands import iter_markdown_table

from hkrag.tasks.training import DEMO_COLUMNS, DEMO_ROWS, demo_cell, demo_figures_from_per_query

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "demo_range"


def test_readme_demo_table_is_the_range_of_the_committed_runs():
    runs = [json.loads(gzip.decompress(path.read_bytes())) for path in sorted((REPORT / "runs").glob("*.json.gz"))]
    assert len(runs) == 15 and {(r["kernel"], r["seed"]) for r in runs} == {
        (k, s) for k in ("native", "avx2", "default") for s in (42, 0, 1, 2, 3)}
    figures = [{when: demo_figures_from_per_query(r[when]) for when in ("before", "after")} for r in runs]
    derived = {row: [demo_cell([f[when][pool][row] for f in figures]) for when, pool in DEMO_COLUMNS.values()]
               for row in DEMO_ROWS}
    table = list(iter_markdown_table((ROOT / "README.md").read_text(), "| queries | before (the shipped reader)"))
    assert table[0][1:] == list(DEMO_COLUMNS)
    assert {row[0]: row[1:] for row in table[1:]} == derived
    summary = json.loads((REPORT / "demo_range.json").read_text())
    assert {f"{row} | {col}": cell for row, cells in derived.items() for col, cell in zip(DEMO_COLUMNS, cells)} \
        == summary["range_all"]


def test_every_committed_run_names_its_kernel_path():
    for path in sorted((REPORT / "runs").glob("*.json.gz")):
        run = json.loads(gzip.decompress(path.read_bytes()))
        expected = {"native": "AVX512", "avx2": "AVX2", "default": "DEFAULT"}[run["kernel"]]
        assert run["environment"]["cpu_capability"] == expected, path.name
        assert run["environment"]["libraries"]["torch"].startswith("2.13.0")
