"""hkrag.tasks.correct_pruner: the answering steps on a correct Pruner's pages, from a forced trace, by hand."""

import pytest

from hkrag.rag.records import CallRecord, QueryOutcome
from hkrag.rag.trace import write_trace
from hkrag.tasks import correct_pruner
from hkrag.tasks.correct_pruner import query_row, summarise


def forced(query_id: str, kept: int, replies: dict[tuple[str, int], str], buffer: int = 3) -> QueryOutcome:
    """A forced outcome over ``buffer`` pages, gold answer ``"42"``; ``replies[(step, pages)]`` each step's reply."""
    pages = [f"{query_id}-p{i}" for i in range(buffer)]
    outcome = QueryOutcome(query_id, "which value?", ["42"], retrieved=pages, route="forced")
    outcome.calls = [CallRecord("pruner", "", pages[:n], step="pruner", iteration=n, decision="yes" if n == kept
                                else "no") for n in range(1, min(kept, buffer - 1) + 1)]
    outcome.calls += [CallRecord(step, "", pages[:n], step=step, output=reply) for (step, n), reply in replies.items()]
    return outcome


def test_a_query_whose_correct_pruner_keeps_one_page():
    """Verify right on the kept page, wrong on all three; the single pass wrong: the row says so."""
    outcome = forced("q1", 1, {("single_pass", 3): "7", ("answer", 1): "42", ("verify", 1): "42",
                               ("answer", 3): "7", ("verify", 3): "7"})
    assert query_row(outcome) == {"query_id": "q1", "buffer": 3, "kept": 1, "single_pass": 0, "verify_kept": 1,
                                  "verify_all": 0, "answer_kept": 1, "answer_all": 0}


def test_a_query_with_nothing_to_prune_scores_its_one_page_set_twice():
    """The curriculum asks an identical request once: kept = the buffer, the same reply in both columns."""
    row = query_row(forced("q2", 3, {("single_pass", 3): "42", ("answer", 3): "7", ("verify", 3): "42"}))
    assert row["kept"] == 3 and row["verify_kept"] == row["verify_all"] == 1 and row["answer_kept"] == 0


def test_no_answer_step_gives_no_row_and_a_live_trace_is_refused():
    assert query_row(forced("q3", 3, {})) is None
    with pytest.raises(ValueError, match=r"q5: the forced trace has a single pass but no answer or verify call"):
        query_row(forced("q5", 3, {("single_pass", 3): "42"}))
    live = forced("q4", 3, {("single_pass", 3): "42"})
    live.route = "lqp"
    with pytest.raises(ValueError, match=r"q4: route 'lqp', not a forced trace"):
        query_row(live)


def test_the_summary_by_hand(tmp_path):
    """Two pruned questions (verify on the kept pages right in both, the single pass in one) and one unpruned (all
    right): pruned verify_kept 100, single pass 50, difference +50; every question 100 / 66.7."""
    outcomes = [
        forced("a", 1, {("single_pass", 3): "42", ("answer", 1): "42", ("verify", 1): "42", ("answer", 3): "42",
                        ("verify", 3): "42"}),
        forced("b", 2, {("single_pass", 3): "7", ("answer", 2): "7", ("verify", 2): "42", ("answer", 3): "7",
                        ("verify", 3): "7"}),
        forced("c", 3, {("single_pass", 3): "42", ("answer", 3): "42", ("verify", 3): "42"}),
    ]
    summary = summarise([query_row(o) for o in outcomes])
    pruned, every = summary["pruned"], summary["every question"]
    assert pruned["n"] == 2 and every["n"] == 3
    assert pruned["accuracy"]["verify_kept"][0] == 100.0 and pruned["accuracy"]["single_pass"][0] == 50.0
    assert pruned["differences"]["verify_kept - single_pass"]["diff"] == pytest.approx(50.0)
    assert pruned["differences"]["verify_kept - verify_all"]["diff"] == pytest.approx(50.0)
    assert every["accuracy"]["single_pass"][0] == pytest.approx(200 / 3)
    trace = tmp_path / "forced-retrieved.jsonl"
    write_trace(trace, outcomes)
    assert correct_pruner.evaluate(trace, tmp_path / "out") == summary
    assert "| verify_kept - single_pass | +50.0" in (tmp_path / "out" / "correct_pruner.md").read_text()


def test_a_trace_without_answers_is_an_error_naming_it(tmp_path, capsys):
    trace = tmp_path / "forced-retrieved.jsonl"
    write_trace(trace, [forced("q3", 3, {})])
    with pytest.raises(SystemExit) as exit_:
        correct_pruner.main([str(trace), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "no query with an answer step (1 queries)" in capsys.readouterr().err


@pytest.mark.parametrize("generator", ["w128", "w64"])
def test_the_committed_report_re_derives_from_its_traces(tmp_path, generator):
    """docs/rerank/correct_pruner/<generator>: the rows follow from the committed forced trace, the summary from the
    rows (docs/rerank/README.md, "What a correct Pruner's pages would give")."""
    import gzip
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "docs" / "rerank" / "correct_pruner" / generator
    trace = tmp_path / "forced-retrieved.jsonl"
    trace.write_bytes(gzip.decompress((folder / "forced-retrieved.jsonl.gz").read_bytes()))
    summary = correct_pruner.evaluate(trace, tmp_path / "out")
    rows = [json.loads(line) for line in gzip.open(folder / correct_pruner.ROWS_FILE, "rt")]
    assert [json.loads(line) for line in gzip.open(tmp_path / "out" / correct_pruner.ROWS_FILE, "rt")] == rows
    assert json.loads((folder / correct_pruner.SUMMARY_FILE).read_text())["summary"] == json.loads(json.dumps(summary))
    assert summary["every question"]["n"] == 108 and summary["pruned"]["n"] == 42
