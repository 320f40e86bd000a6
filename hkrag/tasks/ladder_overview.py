"""The model-size ladder's rungs side by side: one table and one plot from finished ladder reports.

    python -m hkrag.tasks.ladder_overview docs/ladder docs/ladder/r6000 docs/ladder/t16 docs/ladder/l4t16 \\
        --out docs/ladder/overview

The rungs were run by separate :mod:`hkrag.tasks.ladder` commands, on different reader budgets, seeds and machines,
each judged once by its own report under the rule registered before its run (docs/statistics.md). This view reads
their ``ladder.json`` files and copies every figure and each report's own verdict; it computes no new figure and no
new verdict (a cross-rung comparison was not registered, so none is drawn). A rung is its size and its reader's
steps; the same rung in two reports is refused, naming both.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hkrag.io import FileFormatError, read_json, write_bytes, write_json, write_text
from hkrag.tasks.ladder import LadderError, plot, table_head, table_row

REPORT = "ladder.json"


def load_report(folder: Path) -> dict[str, Any]:
    """``folder/ladder.json``, checked to be a ladder report (its sizes and settings present)."""
    path = Path(folder) / REPORT
    if not path.is_file():
        raise LadderError(f"no ladder report in {folder}: {path} does not exist (run python -m hkrag.tasks.ladder)")
    try:
        report = read_json(path)
    except FileFormatError as error:
        raise LadderError(f"{path} is not JSON: {error}") from error
    if not isinstance(report, dict) or not {"sizes", "settings"} <= report.keys():
        raise LadderError(f"{path} is not a ladder report: it needs 'sizes' and 'settings'")
    return report


def rung_name(size: str, reader_steps: int) -> str:
    """A rung's name in the overview: its size and its reader's optimizer steps."""
    return f"{size} r{reader_steps}"


def overview(reports: Mapping[str, Mapping[str, Any]], out: Path) -> dict[str, Any]:
    """Every size of every report (``reports``: folder → ``ladder.json``, in the order given) as one rung, with its
    source (and its ``ladder.md`` relative to ``out``), its recipe's steps and its own report's verdict
    (``agents_reach_single_pass``, by that report's rule)."""
    rungs: dict[str, dict[str, Any]] = {}
    for source, report in reports.items():
        steps = report["settings"]["training_steps"]
        for size, row in report["sizes"].items():
            name = rung_name(size, steps["reader"])
            if name in rungs:
                raise LadderError(f"rung {name} is in two reports, {rungs[name]['source']} and {source}: "
                                  "give each rung once")
            rungs[name] = {**row, "size": size, "source": str(source),
                           "report": os.path.relpath(Path(source) / "ladder.md", out), "reader_steps": steps["reader"],
                           "generator_steps": steps["generator"], "command": report["settings"].get("command")}
    rules = sorted({report["rule"] for report in reports.values() if "rule" in report})
    return {"rungs": rungs, "rules": rules}


def markdown(view: Mapping[str, Any]) -> str:
    """The overview as Markdown: one row per rung (its report's figures and verdict), then each rung's failing steps."""
    lines = ["# The model-size ladder, every rung\n",
             "Each row is one rung's own report (linked), copied: relaxed accuracy ×100 [95 %] on the test split, "
             "the crossed seeds × questions interval over its seeds; its verdict by its own report's rule, registered "
             "before its run. The rungs differ in reader steps, seeds and machine (each report says which), so this "
             "table draws no verdict across them.\n",
             *table_head(("rung", "reader steps", "agents reach the single pass (its report)", "model", "seeds"))]
    for name, rung in view["rungs"].items():
        verdict = {True: "yes", False: "no"}.get(rung.get("agents_reach_single_pass"), "—")
        lines.append(table_row(name, rung, (f"{rung['reader_steps']:,}", f"[{verdict}]({rung['report']})")))
    lines += ["", *(f"**Rule.** {rule}.\n" for rule in view["rules"]), "## The steps that fall short, per rung\n"]
    lines += [f"- `{name}`: " + ("; ".join(rung.get("failing_steps") or []) or "none")
              for name, rung in view["rungs"].items()]
    return "\n".join(lines) + "\n"


def write_overview(folders: Sequence[Path], out: Path) -> dict[str, Any]:
    """``overview.{json,md,png}`` in ``out`` from the ladder reports in ``folders``."""
    if not folders:
        raise LadderError("give at least one ladder report folder")
    view = overview({str(folder): load_report(folder) for folder in folders}, out)
    write_json(out / "overview.json", view)
    write_text(out / "overview.md", markdown(view))
    write_bytes(out / "overview.png", plot({"sizes": view["rungs"]}))
    return view


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="ladder report folders (each with ladder.json), "
                        "smallest rung first")
    parser.add_argument("--out", type=Path, required=True, help="folder for overview.{json,md,png}")
    args = parser.parse_args(argv)
    try:
        return write_overview(args.folders, args.out)
    except LadderError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
