"""hkrag.tasks.notes_seeds: the forced fine-print notes naming the gold page's code, over training seeds, with the
share interval, the crossed seeds × questions interval and the target's verdicts (issue 40; docs/training.md, "The
notes target over five seeds")."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from hkrag.io import read_jsonl
from hkrag.rag.records import CallRecord, PageTruth, words
from hkrag.rag.step_report import names_code
from hkrag.stats import crossed_interval, share_interval
from hkrag.tasks import notes_seeds
from hkrag.tasks.common import RUN_CONFIG

NOTES_STAGE = Path(__file__).resolve().parents[1] / "docs" / "ladder" / "notes_stage"
COMMITTED = NOTES_STAGE.parent / "notes_seeds"


def rows(matrix: list[list[int]], seeds: list[int] | None = None) -> list[dict]:
    seeds = seeds or list(range(len(matrix)))
    return [{"seed": s, "query_id": f"q{q}", "doc_id": f"d{q}", "names_code": value}
            for s, row in zip(seeds, matrix) for q, value in enumerate(row)]


def test_names_code_reads_whole_words_of_every_relevant_page():
    page = PageTruth("d1", (), (), {"code": "QX-7"})
    other = PageTruth("d2", (), (), {"code": "AB-1"})
    note = CallRecord("decoupler", "", ["d1"], step="fine_print", output="ref QX-7; year 2020")
    assert names_code(note, [page]) is True
    assert names_code(CallRecord("decoupler", "", ["d1"], step="fine_print", output="ref QX-70"), [page]) is False
    assert names_code(note, [page, other]) is False
    assert names_code(note, [PageTruth("d3", (), ())]) is None


def test_summary_is_the_matrix_mean_with_its_share_and_crossed_intervals():
    matrix = [[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]]
    summary = notes_seeds.summarise(rows(matrix, [4, 0, 2]), confidence=0.975)
    assert summary["seeds"] == [0, 2, 4] and summary["questions"] == 4
    assert summary["per_seed"] == {"0": 0.5, "2": 1.0, "4": 0.75}
    assert summary["interval"]["mean"] == pytest.approx(9 / 12)
    ordered = np.array([matrix[1], matrix[2], matrix[0]], dtype=float)
    assert summary["interval"] == share_interval(ordered, 0.975)
    assert summary["interval_95"] == share_interval(ordered, 0.95)
    assert summary["crossed"] == crossed_interval(ordered, 0.975, bounds=(0.0, 1.0))
    assert summary["interval"]["low"] <= summary["interval_95"]["low"] <= summary["interval_95"]["high"] \
        <= summary["interval"]["high"]
    assert "verdict" not in summary and "crossed_verdict" not in summary


def test_the_verdict_is_the_targets_rule_on_the_chosen_interval():
    rng = np.random.default_rng(0)
    high = (rng.random((5, 124)) < 0.95).astype(int).tolist()
    low = (rng.random((5, 124)) < 0.6).astype(int).tolist()
    assert notes_seeds.summarise(rows(high), 0.975, bound=0.8)["verdict"] == "met"
    assert notes_seeds.summarise(rows(low), 0.975, bound=0.8)["verdict"] == "not met"
    near = notes_seeds.summarise(rows(high), 0.975, bound=0.95)
    assert near["interval"]["low"] < 0.95 <= near["interval"]["high"] and near["verdict"] == "not shown"
    # seed shares spread near the ceiling: the crossed interval clears the bound, the share interval does not
    skewed = (rng.random((5, 124)) < np.array([[0.8], [0.97], [0.97], [0.93], [0.99]])).astype(int).tolist()
    spread = notes_seeds.summarise(rows(skewed), 0.975, bound=0.85)
    assert spread["crossed"]["low"] >= 0.85 > spread["interval"]["low"]
    assert (spread["crossed_verdict"], spread["verdict"]) == ("met", "not shown")


@pytest.mark.parametrize("bad, message", [
    (rows([[1, 0], [1]]), r"seed 1 scored other questions than seed 0 \(1 differ, e.g. \['q1'\]\)"),
    (rows([[1, 0]]) * 2, r"seed 0 scores question q0 twice"),
    ([], r"no scored question"),
])
def test_seeds_that_do_not_line_up_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        notes_seeds.summarise(bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"bound": 80}, r"bound=80: expected a share in \(0, 1\], e.g. 0.8"),
    ({"confidence": 0.9}, r"confidence=0.9: expected at least 0.95"),
])
def test_a_bound_or_level_out_of_range_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        notes_seeds.summarise(rows([[1, 0]]), **kwargs)


def forced_folder(root: Path, builtin_data: Path, seed: int, trace: Path) -> Path:
    """An agent_steps folder for a committed forced gold-page trace: its steps.json, and the run config it names."""
    run = root / f"run-s{seed}"
    (run / RUN_CONFIG).parent.mkdir(parents=True)
    config = {"data": {"root": str(builtin_data), "qa_source": str(builtin_data / "qa"),
                       "eval_datasets": ["synchart", "synslide", "syntable", "syninfo", "synfine"]},
              "generator_training": {"optim": {"seed": seed}}}
    (run / RUN_CONFIG).write_text(yaml.safe_dump(config))
    steps = root / f"steps-s{seed}"
    steps.mkdir()
    (steps / "steps.json").write_text(json.dumps({"run": str(run), "split": "test"}))
    with gzip.open(trace, "rb") as source, open(steps / notes_seeds.TRACE, "wb") as target:
        shutil.copyfileobj(source, target)
    return steps


def test_a_seed_scores_as_the_per_step_report_counts(tmp_path, builtin_data):
    """The committed first attempt (seed 42, test): 107 of 124 notes name the code, in the rows as in its report."""
    steps = forced_folder(tmp_path, builtin_data, 42, NOTES_STAGE / "test_forced_gold_trace.jsonl.gz")
    found = notes_seeds.seed_rows(steps)
    reported = json.loads((NOTES_STAGE / "test_forced_steps.json").read_text())["reports"]["forced-gold"]["notes"]
    assert len(found) == reported["fine_print code"]["n"] == 124
    assert sum(row["names_code"] for row in found) == reported["fine_print code"]["hits"] == 107
    assert {row["seed"] for row in found} == {42}


def test_the_command_writes_rows_that_re_derive_the_summary(tmp_path, builtin_data, capsys):
    trace = NOTES_STAGE / "test_forced_gold_trace.jsonl.gz"
    inputs = [str(forced_folder(tmp_path, builtin_data, seed, trace)) for seed in (0, 1)]
    notes_seeds.main([*inputs, "--out", str(tmp_path / "out"), "--confidence", "0.975", "--bound", "0.8"])
    written = read_jsonl(tmp_path / "out" / notes_seeds.ROWS_FILE)
    summary = json.loads((tmp_path / "out" / notes_seeds.SUMMARY_FILE).read_text())["summary"]
    assert summary == json.loads(json.dumps(notes_seeds.summarise(written, 0.975, 0.8)))
    assert summary["per_seed"] == {"0": pytest.approx(107 / 124), "1": pytest.approx(107 / 124)}
    assert "Target ≥ 80 % on the 97.5 % share_interval" in capsys.readouterr().out


def test_a_missing_or_wrong_folder_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder, message in ((tmp_path / "absent", "no such folder"),
                            (tmp_path / "empty", "has no steps.json, forced-gold.jsonl (is it an agent_steps")):
        with pytest.raises(SystemExit) as exit_:
            notes_seeds.main([str(folder), "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("split, questions", [("test", 124), ("validation", 108)])
def test_the_committed_figure_re_derives_from_its_traces(split, questions, builtin_data):
    """docs/ladder/notes_seeds: each seed's committed forced trace gives its rows (the first fine-print note on the
    gold page names the drawn code), the rows give the summary, and each seed's rate is its per-step report's."""
    folder = COMMITTED / split
    codes = {row["doc_id"]: row["code"] for row in read_jsonl(builtin_data / "pages.jsonl")}
    rows = read_jsonl(folder / notes_seeds.ROWS_FILE)
    saved = json.loads((folder / notes_seeds.SUMMARY_FILE).read_text())["summary"]
    assert saved["seeds"] == [0, 1, 2, 3, 4] and saved["questions"] == questions
    for seed in saved["seeds"]:
        notes = {row["query_id"]: (call["output"], codes[row["retrieved"][0]])
                 for row in read_jsonl(folder / f"forced_gold_s{seed}.jsonl.gz") for call in row["calls"]
                 if call["step"] == "fine_print" and call["iteration"] == 1}
        mine = {row["query_id"]: row["names_code"] for row in rows if row["seed"] == seed}
        assert mine == {query: int(code in words(output)) for query, (output, code) in notes.items()}
        reported = json.loads((folder / f"steps_s{seed}.json").read_text())["reports"]["forced-gold"]["notes"]
        assert sum(mine.values()) == reported["fine_print code"]["hits"]
        assert saved["per_seed"][str(seed)] == pytest.approx(sum(mine.values()) / questions)
    assert saved == json.loads(json.dumps(notes_seeds.summarise(rows, saved["confidence"], saved.get("bound"))))
    if split == "test":
        assert (saved["confidence"], saved["bound"], saved["verdict"], saved["crossed_verdict"]) == (
            0.975, 0.8, "not shown", "not shown")
