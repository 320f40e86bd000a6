"""hkrag.tasks.answers: relaxed accuracy over seeds from finished answer runs, the paired difference of two
conditions, the refusals that keep the interval honest, and the committed report of the default generator on the
shipped reader's top 3 (docs/ladder/default/) re-derived from its per-query rows."""

import json
from pathlib import Path

import numpy as np
import pytest

from hkrag.rag.records import QueryOutcome
from hkrag.rag.trace import MERGED_FILE, write_trace
from hkrag.stats import cluster_bootstrap_interval, cluster_rows, crossed_difference, crossed_interval
from hkrag.tasks.answers import compare, main, questions_of

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "ladder"
QUESTIONS = [("synchart", "q1"), ("synchart", "q2"), ("synfine", "q3")]


def run(folder: Path, right: set[tuple[str, str, str]], seconds: float = 0.5) -> Path:
    """A finished answer run over QUESTIONS in pools single and all; ``right`` rows answer the gold "7"; each query
    took ``seconds`` (two runs of one model differ there at least)."""
    outcomes = [QueryOutcome(query_id=q, question="?", gold=["7"], dataset=d, pool=pool, route="LQP",
                             answer="7" if (d, pool, q) in right else "9", wall_s=seconds)
                for d, q in QUESTIONS for pool in ("single", "all")]
    write_trace(folder / MERGED_FILE, outcomes)
    return folder


def test_one_seed_is_the_mean_with_the_bootstrap_over_questions(tmp_path):
    agents = run(tmp_path / "a", {("synchart", "all", "q1"), ("synchart", "single", "q1"), ("synfine", "all", "q3")})
    single = run(tmp_path / "s", {("synchart", "all", "q1")})
    report = compare([agents], [single])
    assert report["runs"]["accuracy"]["mean"] == pytest.approx(3 / 6)
    assert report["baseline"]["accuracy"]["mean"] == pytest.approx(1 / 6)
    assert report["runs"]["by_pool"]["all"]["mean"] == pytest.approx(2 / 3)
    assert report["difference"]["diff"] == pytest.approx(2 / 6)
    rows = sorted((d, p, q) for d, q in QUESTIONS for p in ("single", "all"))
    diffs = np.array([float((d, p, q) in {("synchart", "single", "q1"), ("synfine", "all", "q3")}) for d, p, q in rows])
    low, high = cluster_bootstrap_interval(diffs, questions_of(rows))  # a question's two pools drawn together
    assert (report["difference"]["low"], report["difference"]["high"]) == (low, high)


def test_several_seeds_are_the_crossed_interval(tmp_path):
    right = [{("synchart", "all", "q1")}, {("synchart", "all", "q1"), ("synfine", "single", "q3")},
             {("synchart", "single", "q2")}]
    runs = [run(tmp_path / f"a{seed}", found) for seed, found in enumerate(right)]
    base = [run(tmp_path / f"s{seed}", set(), seconds=seed) for seed in range(3)]
    report = compare(runs, base)
    matrix = np.array([[float(row in found) for row in sorted((d, p, q) for d, q in QUESTIONS
                                                               for p in ("single", "all"))] for found in right])
    assert report["runs"]["per_seed"] == pytest.approx([1 / 6, 2 / 6, 1 / 6])
    assert report["runs"]["accuracy"]["mean"] == pytest.approx(matrix.mean())
    assert report["difference"]["diff"] == pytest.approx(matrix.mean())
    rows = sorted((d, p, q) for d, q in QUESTIONS for p in ("single", "all"))
    found = crossed_difference(matrix, np.zeros_like(matrix), questions_of(rows))
    assert (report["difference"]["low"], report["difference"]["high"]) == (found["low"], found["high"])
    assert len(report["per_query"]) == 2 * 3 * 6


def test_a_folder_twice_a_copy_and_other_questions_are_refused(tmp_path):
    one = run(tmp_path / "a", {("synchart", "all", "q1")})
    with pytest.raises(ValueError, match="is given twice"):
        compare([one, one])
    copy = run(tmp_path / "b", {("synchart", "all", "q1")})
    with pytest.raises(ValueError, match="hold the same run"):
        compare([one, copy])
    other = tmp_path / "c"
    write_trace(other / MERGED_FILE, [QueryOutcome(query_id="q9", question="?", gold=["7"], dataset="synchart",
                                                   pool="all", route="LQP", answer="7")])
    with pytest.raises(ValueError, match="did not answer the same queries: .*lacks 6"):
        compare([one, other])
    with pytest.raises(ValueError, match="--vs gives 1 folder"):
        compare([one, run(tmp_path / "d", set())], [copy])


def test_the_command_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "nothing")])
    assert exit_.value.code == 2
    assert f"{tmp_path / 'nothing'}: no {MERGED_FILE}" in capsys.readouterr().err


def test_the_command_writes_the_report_and_its_per_query_rows(tmp_path):
    agents = run(tmp_path / "a", {("synchart", "all", "q1")})
    single = run(tmp_path / "s", set())
    main([str(agents), "--vs", str(single), "--out", str(tmp_path / "out" / "top3")])
    written = json.loads((tmp_path / "out" / "top3.json").read_text())
    assert written["difference"]["diff"] == pytest.approx(1 / 6) and "per_query" not in written
    lines = (tmp_path / "out" / "top3_per_query.jsonl").read_text().splitlines()
    assert len(lines) == 12 and "**+16.7 [" in (tmp_path / "out" / "top3.md").read_text()


def test_a_dotted_out_name_keeps_its_dots(tmp_path):
    """``--out top3_h0.8`` writes top3_h0.8.md / .json / _per_query.jsonl; swapping the suffix would have written
    top3_h0.md and top3_h0.json, where a second report (top3_h0.38) overwrites the first."""
    agents = run(tmp_path / "a", {("synchart", "all", "q1")})
    single = run(tmp_path / "s", set())
    for name in ("top3_h0.8", "top3_h0.38"):
        main([str(agents), "--vs", str(single), "--out", str(tmp_path / "out" / name)])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"top3_h0.{h}{ext}" for h in ("38", "8") for ext in (".json", ".md", "_per_query.jsonl")]


@pytest.mark.parametrize(("folder", "name", "rows_file", "answered"), [
    *[(folder, name, "reader_tiny_top3", 248) for folder in ("default", "default_first")
      for name in ("reader_tiny_top3", "reader_tiny_top3_s0")],
    ("notes", "top3", "top3", 248), ("notes", "gold", "gold", 124),
    *[("notes_h", name, name, 248) for name in ("top3", "top3_h0.8")]])
def test_the_committed_paired_answer_reports_re_derive_from_their_rows(folder, name, rows_file, answered):
    """docs/ladder/default: the w128-l2 generators on the 6,000-step reader (seeds 0-2; the shipped one is seed 0)
    on the shipped reader's top 3, agents against the single pass, re-derived from the three-seed per-query file;
    docs/ladder/default_first the same for the first default's rung (its 3,000-step reader); docs/ladder/notes the
    w64-l2 rung with the notes stage on its readers' top 3 and on gold pages; docs/ladder/notes_h the notes stage's
    seeds 42, 0, 1 on the shipped reader's top 3 at h = 0.38 (the registered rule's) and at the paper's 0.8."""
    report = json.loads((COMMITTED / folder / f"{name}.json").read_text())
    rows = [json.loads(line) for line in (COMMITTED / folder / f"{rows_file}_per_query.jsonl").read_text().splitlines()]
    seeds = range(report["seeds"])

    def matrix(condition: str) -> tuple[np.ndarray, list]:
        by_seed = {s: {(r["dataset"], r["pool"], r["query_id"]): r["score"] for r in rows
                       if r["condition"] == condition and r["seed"] == s} for s in seeds}
        keys = sorted(by_seed[0])
        return np.array([[by_seed[s][k] for k in keys] for s in seeds]), questions_of(keys)

    agents, questions = matrix("runs")
    single, _ = matrix("baseline")
    assert report["rows"] == agents.shape[1] == answered
    assert report["runs"]["accuracy"]["mean"] == pytest.approx(agents.mean())
    assert report["difference"]["diff"] == pytest.approx((agents - single).mean())
    if report["seeds"] > 1:
        found = crossed_difference(agents, single, questions)
        accuracy = crossed_interval(cluster_rows(agents, questions), bounds=(0.0, 1.0))
        assert report["runs"]["accuracy"]["low"] == pytest.approx(accuracy["low"])
    else:
        low, high = cluster_bootstrap_interval(agents[0] - single[0], questions)
        found = {"low": low, "high": high}
    assert (report["difference"]["low"], report["difference"]["high"]) == pytest.approx((found["low"], found["high"]))
