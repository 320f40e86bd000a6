"""The ladder's overview (hkrag/tasks/ladder_overview.py): every rung of the committed ladder reports in one table
and plot, each figure and verdict copied from its own report, a rung given twice or a folder without a report
refused by name."""

import json
import shutil
from pathlib import Path

import pytest

from hkrag.tasks import ladder, ladder_overview
from hkrag.tasks.ladder import LadderError

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["docs/ladder", "docs/ladder/r6000", "docs/ladder/t16", "docs/ladder/l4t16"]
OUT = ROOT / "docs" / "ladder" / "overview"


def test_the_committed_overview_is_its_reports_copied(monkeypatch):
    """docs/ladder/overview follows from the four committed ladder reports: a report or the overview edited by hand
    alone fails; each rung's paired difference and verdict are its own report's."""
    monkeypatch.chdir(ROOT)
    reports = {folder: ladder_overview.load_report(Path(folder)) for folder in FOLDERS}
    view = ladder_overview.overview(reports, Path("docs/ladder/overview"))
    assert view == json.loads((OUT / "overview.json").read_text())
    assert ladder_overview.markdown(view) == (OUT / "overview.md").read_text()
    assert len(view["rungs"]) == sum(len(report["sizes"]) for report in reports.values()) == 7
    rung = view["rungs"]["w128-l4-t16 r6000"]
    source = reports["docs/ladder/l4t16"]["sizes"]["w128-l4-t16"]
    assert rung["agents_minus_single_pass"] == source["agents_minus_single_pass"]
    assert rung["agents_reach_single_pass"] is False and view["rungs"]["w128-l2 r6000"]["agents_reach_single_pass"]
    assert view["rungs"]["w128-l2 r3000"]["source"] == "docs/ladder"  # the same size on two reader budgets: two rungs
    assert rung["report"] == "../l4t16/ladder.md"


def test_writes_table_plot_and_links_relative_to_out(tmp_path):
    out = tmp_path / "view" / "here"
    view = ladder_overview.main([str(ROOT / "docs/ladder/t16"), str(ROOT / "docs/ladder/l4t16"), "--out", str(out)])
    assert list(view["rungs"]) == ["w128-l2-t16 r6000", "w128-l4-t16 r6000"]
    text = (out / "overview.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| w128-l4-t16 r6000 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    head = ladder.table_head(("rung", "reader steps", "agents reach the single pass (its report)", "model",
                              "seeds"))[0]
    assert len(cells) == head.count("|") - 1
    assert cells[1] == "6,000" and cells[2].startswith("[no](")
    assert (out / cells[2][len("[no]("):-1]).resolve() == ROOT / "docs/ladder/l4t16/ladder.md"
    assert cells[cells.index("-1.6 [-8.3, 5.1]") + 1] == "0.690 [0.643, 0.734]"
    assert (out / "overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rung_in_two_reports_is_refused_naming_both(tmp_path):
    copy = tmp_path / "again"
    shutil.copytree(ROOT / "docs/ladder/t16", copy, ignore=shutil.ignore_patterns("runs"))
    with pytest.raises(LadderError, match=r"rung w128-l2-t16 r6000 is in two reports, .*t16 and .*again"):
        ladder_overview.write_overview([ROOT / "docs/ladder/t16", copy], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, named", [(None, "does not exist"), ("{", "is not JSON"),
                                             ('{"sizes": {}}', "is not a ladder report: it needs 'sizes' and "
                                                               "'settings'"),
                                             ("[1]", "is not a ladder report")])
def test_a_folder_without_a_ladder_report_is_refused_by_path(tmp_path, capsys, content, named):
    if content is not None:
        (tmp_path / "ladder.json").write_text(content)
    with pytest.raises(SystemExit) as exit_:
        ladder_overview.main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert named in error and str(tmp_path) in error
