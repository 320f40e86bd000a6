"""``eval.py task=rag|generation`` end to end: plan, answer, trace, resume, reports (hkrag/tasks/rag.py).

The generator runs on a scripted backend that answers each question with its gold answer (so the expected
accuracy is known by hand), except where a test makes a query fail; one test runs the real tiny Phi3V
retriever and generator through the whole path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from hkrag.data.ocr import OcrUnavailable, install_tesseract
from hkrag.data.opendocvqa import load_qa
from hkrag.io import WriteError, read_jsonl
from hkrag.lvlm import LVLMTimeoutError
from hkrag.lvlm.scripted import Reply, ScriptedBackend, request_text
from hkrag.rag import trace as trace_module
from hkrag.rag.__main__ import main
from hkrag.rag.evidence import NOT_FOUND
from hkrag.rag.gold_evidence import EVIDENCE_FILE, evidence_rows
from hkrag.rag.trace import PARTS_DIR, TraceError, TraceWriter, load_trace, merge
from hkrag.tasks import rag as rag_task
from hkrag.tasks import run_eval_task
from hkrag.tasks.common import UNGROUNDED
from hkrag.tasks.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "data.synthetic.n_train=8", "data.synthetic.n_test=16", "data.synthetic.train_groups_per_style=1",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart,syninfo]",
]
QUERIES_PER_DATASET = 3
FAILING = "timed out on purpose"


def config(data_dir: Path, *overrides: str, grounded: bool = False):
    """The run's config, without the evidence step unless ``grounded`` (it OCRs every kept page: only the tests
    that check evidence pay for it)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("eval", [
            f"paths.data_dir={data_dir}", f"paths.output_dir={data_dir / 'out'}", *SMALL_DATA,
            f"rag.max_queries={QUERIES_PER_DATASET}", "task=generation", *([] if grounded else [UNGROUNDED]),
            *overrides,
        ])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The small synthetic corpus, generated once for the module."""
    data_dir = tmp_path_factory.mktemp("rag-data")
    rag_task.prepare_data(config(data_dir).data)
    return data_dir


def gold_answers(cfg) -> dict[str, str]:
    """Question text -> its first gold answer, for every planned query."""
    qa = [ex for ds in cfg.rag.datasets for ex in load_qa(cfg.data.qa_source, ds, "test")[:QUERIES_PER_DATASET]]
    return {rag_task.question_text(ex): ex.answers[0] for ex in qa}


class GoldBackend(ScriptedBackend):
    """Says "yes" to the Pruner and answers every question with its gold answer, with certainty (LQP); the
    question in ``fail`` times out instead, or raises ``error`` at once when one is given."""

    def __init__(self, answers: dict[str, str], fail: str | None = None, error: BaseException | None = None,
                 delay_s: float = 0.0) -> None:
        self.answers, self.fail, self.error = answers, fail, error
        super().__init__(self.reply, delay_s=delay_s)

    def reply(self, request) -> Reply:
        text = request_text(request)
        question = re.search(r"Question: (.*)", text).group(1).strip()
        if question == self.fail and self.error is not None:
            raise self.error
        if question == self.fail:
            return Reply(error=LVLMTimeoutError(FAILING))
        return Reply("yes") if "yes or no" in text else Reply(self.answers[question])


class Built(list):
    """The backends the task built, one per run, each made by ``factory``."""

    factory = None

    def build(self, _config) -> GoldBackend:
        self.append(self.factory())
        return self[-1]


@pytest.fixture
def backends(monkeypatch) -> Built:
    built = Built()
    monkeypatch.setattr(rag_task, "build_backend", built.build)
    return built


def run(cfg, out: Path, factory, built: Built) -> dict:
    built.factory = factory
    return run_eval_task(cfg, out)


def test_generation_on_gold_pages_scores_answers_and_counts_failures_as_wrong(tmp_path, data, backends):
    cfg = config(data)
    answers = gold_answers(cfg)
    failing = next(iter(answers))
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers, fail=failing), backends)

    assert cfg.retrieval == "gold"  # the task's default
    n = 2 * QUERIES_PER_DATASET
    assert report["overall"]["n"] == n and report["overall"]["failed"] == 1
    assert report["overall"]["metrics"]["relaxed_accuracy"] == pytest.approx((n - 1) / n)
    assert report["results"]["synchart"]["gold"]["metrics"]["exact_match"] == pytest.approx(2 / 3)
    assert report["results"]["syninfo"]["gold"]["metrics"]["exact_match"] == pytest.approx(1.0)
    assert report["judge"] == "disabled (no endpoint)" and report["overall"]["accuracy"] is None

    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert [o.dataset for o in trace] == ["synchart"] * 3 + ["syninfo"] * 3  # the plan's order
    failed = [o for o in trace if o.failed]
    assert [o.question for o in failed] == [failing] and FAILING in failed[0].failure
    assert all(o.route == "LQP" and o.retrieved and o.kept == o.retrieved[:1] for o in trace if not o.failed)
    markdown = (tmp_path / "run" / "rag.md").read_text()
    assert "judge: disabled (no endpoint)" in markdown and f"`{failed[0].query_id}` — judger:" in markdown
    assert "<html" in (tmp_path / "run" / "rag.html").read_text().lower()


def test_gold_answers_are_grounded_on_their_pages_and_reported(tmp_path, data, backends):
    try:
        install_tesseract()
    except OcrUnavailable as missing:
        pytest.skip(f"grounding by text needs Tesseract: {missing}")
    cfg = config(data, grounded=True)
    answers = gold_answers(cfg)
    failing = next(iter(answers))
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers, fail=failing), backends)
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert all(o.grounding["source"] == "text" and o.grounding["drawn"] for o in trace)  # every answer is drawn
    failed = next(o for o in trace if o.failed)
    assert failed.evidence == [] and failed.grounding["note"] == "no answer"
    assert failed.grounding["score"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "hit": False,
                                         "wrong_page": False}
    found = [o for o in trace if o.evidence]
    assert found and all(e["page_id"] in o.kept and e["source"] == "text" for o in found for e in o.evidence)
    assert any(o.grounding["score"]["hit"] for o in found)
    overall = report["overall"]["grounding"]
    assert overall["scored"] == len(trace) and overall["not_drawn"] == 0
    assert overall["hit"]["value"] == pytest.approx(sum(o.grounding["score"]["hit"] for o in trace) / len(trace))
    by_evidence = report["grounding_by_evidence"]
    assert set(by_evidence) <= {"salient", "fine_print"}
    assert sum(group["scored"] for group in by_evidence.values()) == len(trace)
    markdown = (tmp_path / "run" / "rag.md").read_text()
    assert "## Grounding (text source" in markdown and "| evidence: " in markdown
    assert 'class="box gold"' in (tmp_path / "run" / "rag.html").read_text()


def test_a_question_whose_answer_is_drawn_nowhere_is_counted_apart_never_as_a_miss(tmp_path, data, backends):
    """Generating the corpus wrote its gold evidence beside the questions; one question's answer edited to a
    string drawn on no page: its row says ``drawn: false``, its run found no evidence and said why, and the report
    counts it under ``not_drawn``, outside the scored questions."""
    try:
        install_tesseract()
    except OcrUnavailable as missing:
        pytest.skip(f"grounding by text needs Tesseract: {missing}")
    generated = data / "synthetic"
    assert read_jsonl(generated / EVIDENCE_FILE) == json.loads(json.dumps(list(evidence_rows(generated))))
    root = tmp_path / "synthetic"
    shutil.copytree(generated, root)
    (root / EVIDENCE_FILE).unlink()  # stale once a question changes: the run writes it again
    questions = root / "qa" / "synchart" / "test-00000-of-00001.parquet"
    table = pq.read_table(questions)
    answers = table.column("answers").to_pylist()
    answers[0] = ["QUETZALCOATL"]
    field = table.schema.field("answers")
    pq.write_table(table.set_column(table.schema.get_field_index("answers"), field, pa.array(answers, field.type)),
                   questions)
    cfg = config(tmp_path, "data.eval_datasets=[synchart]", grounded=True)
    edited = table.column("query_id")[0].as_py()
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(gold_answers(cfg)), backends)

    rows = {row["query_id"]: row for row in read_jsonl(root / EVIDENCE_FILE) if row["dataset"] == "synchart"}
    assert (rows[edited]["drawn"], rows[edited]["evidence"]) == (False, [])
    assert all(row["drawn"] for query_id, row in rows.items() if query_id != edited)
    trace = {o.query_id: o for o in load_trace(tmp_path / "run" / "trace.jsonl")}
    nowhere = trace[edited]
    assert nowhere.answer == "QUETZALCOATL" and nowhere.metrics["relaxed_accuracy"] == 1.0
    assert nowhere.evidence == [] and nowhere.grounding["note"] == NOT_FOUND
    assert (nowhere.grounding["drawn"], nowhere.grounding["gold"], nowhere.grounding["score"]) == (False, [], None)
    overall = report["overall"]["grounding"]
    assert (overall["not_drawn"], overall["scored"]) == (1, len(trace) - 1)
    assert overall["right_ungrounded"] == sum(not o.grounding["score"]["hit"] for o in trace.values()
                                              if o.grounding["drawn"])  # every answer right: misses only
    [saved] = [q for q in json.loads((tmp_path / "run" / "rag.json").read_text())["queries"]
               if q["query_id"] == edited]
    assert (saved["evidence"], saved["grounding"]["drawn"], saved["grounding"]["note"]) == ([], False, NOT_FOUND)
    assert re.search(r"\| synchart \| gold \| 2 \| .* \| 1 \|\n", (tmp_path / "run" / "rag.md").read_text())


class BoxBackend(GoldBackend):
    """:class:`GoldBackend` whose answers end with an evidence box on the first page of the prompt."""

    def reply(self, request) -> Reply:
        reply = super().reply(request)
        return reply if reply.error or reply.text == "yes" else Reply(f"{reply.text} <box page=1>1,2,30,40</box>")


def test_boxes_the_generator_writes_are_its_evidence_and_not_part_of_its_answer(tmp_path, data, backends):
    cfg = config(data, "rag.grounding.source=model", "rag.grounding.writes_boxes=true", grounded=True)
    answers = gold_answers(cfg)
    report = run(cfg, tmp_path / "run", lambda: BoxBackend(answers), backends)
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert report["overall"]["metrics"]["exact_match"] == pytest.approx(1.0)  # the box is out of the answer
    assert [o.answer for o in trace] == [answers[o.question] for o in trace]
    assert all("<box page=1>" in o.calls[-1].output for o in trace)  # the raw output keeps it
    for outcome in trace:
        assert outcome.evidence == [{"page_id": outcome.kept[0], "box": [1.0, 2.0, 30.0, 40.0], "source": "model",
                                     "score": 1.0}]
        assert outcome.grounding["source"] == "model" and outcome.grounding["note"] is None
        assert outcome.grounding["score"]["hit"] is False  # a 29 x 38 px corner is no drawn answer
    undeclared = config(data, "rag.grounding.source=model", grounded=True)
    run(undeclared, tmp_path / "undeclared", lambda: BoxBackend(answers), backends)
    for outcome in load_trace(tmp_path / "undeclared" / "trace.jsonl"):
        assert outcome.evidence == [] and "does not write evidence boxes" in outcome.grounding["note"]
        assert outcome.answer == answers[outcome.question]


def test_bad_grounding_settings_are_refused_before_the_run(tmp_path, data):
    for override, problem in (("rag.grounding.source=ocr", "rag.grounding.source must be one of"),
                              ("rag.grounding.threshold=0", r"threshold must be in \(0, 1\], got 0"),
                              ("rag.grounding.threshold=1.5", r"threshold must be in \(0, 1\], got 1.5"),
                              ("rag.grounding.upscale=-1", "upscale must be in"),
                              ("+rag.grounding.colour=red", "unknown keys \\['colour'\\]")):
        with pytest.raises(Exception, match=problem):
            run_eval_task(config(data, override, grounded=True), tmp_path / "refused")
        assert not (tmp_path / "refused").exists()


def test_the_step_report_of_a_finished_run(tmp_path, data, backends, capsys):
    cfg = config(data)
    answers = gold_answers(cfg)
    run(cfg, tmp_path / "run", lambda: GoldBackend(answers, fail=next(iter(answers))), backends)
    main(["steps", str(tmp_path / "run")])
    report = json.loads((tmp_path / "run" / "steps.json").read_text())
    assert (report["answers"]["final"]["hits"], report["answers"]["final"]["n"]) == (5, 6)  # one timed out
    assert report["answers"]["answer"]["n"] == 5 and report["pruner"]["accuracy"]["n"] == 0  # one page: no Pruner
    assert report["calibration"]["bins"][0]["n"] == 5  # certain answers: H' = 0
    assert "| final: relaxed accuracy | 83.3 [" in capsys.readouterr().out


def test_a_killed_run_continues_without_answering_any_query_twice(tmp_path, data, backends):
    cfg = config(data)
    answers = gold_answers(cfg)
    out = tmp_path / "run"
    run(cfg, out, lambda: GoldBackend(answers), backends)
    first = load_trace(out / "trace.jsonl")

    part = out / PARTS_DIR / "rank-0.jsonl"  # as if killed while writing the third answer
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    (out / "trace.jsonl").unlink()
    run(cfg, out, lambda: GoldBackend(answers), backends)

    asked = {re.search(r"Question: (.*)", t).group(1).strip() for t in backends[-1].prompts}
    assert asked == {o.question for o in first[2:]}
    second = load_trace(out / "trace.jsonl")
    assert [(o.query_id, o.answer) for o in second] == [(o.query_id, o.answer) for o in first]
    assert [json.loads(line)["query_id"] for line in part.read_text().splitlines()] == [o.query_id for o in first]


def test_resuming_with_other_settings_is_refused_and_resume_false_starts_over(tmp_path, data, backends):
    cfg = config(data)
    answers = gold_answers(cfg)
    run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)
    other = config(data, "generator.threshold=0.5")
    with pytest.raises(ValueError, match=r"other settings \(generator differ\).*rag.resume=false"):
        run(other, tmp_path / "run", lambda: GoldBackend(answers), backends)
    fresh = config(data, "generator.threshold=0.5", "rag.resume=false")
    run(fresh, tmp_path / "run", lambda: GoldBackend(answers), backends)
    assert len(backends[-1].requests) == 2 * 2 * QUERIES_PER_DATASET  # every query again: answer + verify
    saved = json.loads((tmp_path / "run" / "rag_config.json").read_text())
    assert saved["identity"]["generator"]["threshold"] == 0.5


def test_where_word_boxes_are_cached_is_no_setting_of_the_answers(data):
    """A trace resumes whatever ``rag.grounding.cache`` says, and one written before the setting existed too."""
    cached, uncached = config(data, grounded=True), config(data, "rag.grounding.cache=false", grounded=True)
    for cfg in (cached, uncached):
        rag_task.resolve_retrieval_mode(cfg)
    assert uncached.rag.grounding.cache is False
    assert rag_task.run_identity(cached) == rag_task.run_identity(uncached)
    assert set(rag_task.run_identity(cached)["rag"]["grounding"]) == {"source", "threshold", "psm", "upscale",
                                                                     "writes_boxes"}


def test_no_retrieval_baseline_answers_without_pages_and_retrieval_modes_are_checked(tmp_path, data, backends):
    answers = gold_answers(config(data))
    report = run(config(data, "retrieval=none"), tmp_path / "none", lambda: GoldBackend(answers), backends)
    assert report["overall"]["failed"] == 0 and set(report["results"]["synchart"]) == {"none"}
    assert all(not request.images for request in backends[-1].requests)
    with pytest.raises(ValueError, match=r"task=generation takes retrieval=gold\|none, got retrieval='retriever'"):
        run(config(data, "retrieval=retriever"), tmp_path / "bad", lambda: None, backends)
    with pytest.raises(ValueError, match="generator.threshold=-1"):
        run(config(data, "generator.threshold=-1"), tmp_path / "bad", lambda: None, backends)


def test_ranks_answer_disjoint_shares_that_merge_in_plan_order(tmp_path, data):
    cfg = config(data)
    plan, store = rag_task.plan_queries(cfg, None, tmp_path)
    answers = gold_answers(cfg)
    for rank in (1, 0):
        generator = rag_task.build_generator(dict(cfg.generator), GoldBackend(answers))
        writer = TraceWriter(tmp_path, rank)
        answered = rag_task.answer_queries(plan, store, generator.answer, None, writer, rank, 2, progress=False)
        assert answered == 3
    shares = [[o.query_id for o in load_trace(tmp_path / PARTS_DIR / f"rank-{r}.jsonl")] for r in (0, 1)]
    assert not set(shares[0]) & set(shares[1])
    assert [o.query_id for o in merge(tmp_path, [p.key for p in plan])] == [p.example.query_id for p in plan]


def test_rag_with_the_tiny_retriever_and_generator(tmp_path, data):
    cfg = config(data, "task=rag", "model=tiny", "rag.max_queries=1", "eval.shard_size=64", grounded=True)
    report = run_eval_task(cfg, tmp_path / "run")
    assert set(report["results"]["syninfo"]) == {"single", "all"} and report["overall"]["n"] == 4
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert {len(o.retrieved) for o in trace if o.pool == "all"} == {cfg.rag.top_k}
    assert {len(o.retrieved) for o in trace if o.pool == "single"} == {2}  # the style's two test pages
    assert all(o.calls and not o.failed for o in trace)
    assert all(o.grounding["source"] == "text" for o in trace)  # the whole path, the evidence step included
    shipped = "weights/generator_agents_w128/base+weights/generator_agents_w128/checkpoints/final/adapter"
    assert report["meta"]["lvlm"] == {"backend": "phi3v", "model": shipped}  # eval.yaml's default lvlm
    assert (tmp_path / "run" / "retrieval.md").is_file()


def test_threshold_sweep_and_comparison_commands_read_finished_runs(tmp_path, data, backends, capsys):
    answers = gold_answers(config(data))
    for number, threshold in enumerate((0.5, 0.8)):
        fail = next(iter(answers)) if threshold == 0.8 else None
        run(config(data, f"generator.threshold={threshold}"), tmp_path / "multirun" / str(number),
            lambda fail=fail: GoldBackend(answers, fail=fail), backends)
    main(["sweep", str(tmp_path / "multirun")])
    rows = json.loads((tmp_path / "multirun" / "sweep.json").read_text())["rows"]
    assert [(r["threshold"], r["metric"], r["failed"]) for r in rows] == [(0.5, "relaxed_accuracy", 0),
                                                                        (0.8, "relaxed_accuracy", 1)]
    assert [r["value"] for r in rows] == pytest.approx([1.0, 5 / 6])
    assert "| 0.8 | 6 | 83.3 [" in capsys.readouterr().out

    main(["compare", str(tmp_path / "multirun" / "0"), str(tmp_path / "multirun" / "1"), "--metric", "exact_match"])
    table = capsys.readouterr().out
    assert re.search(r"\| 0 \| 100\.0 \| 100\.0 \| 100\.0 \|", table) and re.search(r"\| 1 \| 66\.7 \|", table)
    with pytest.raises(ValueError, match="no run was judged"):
        main(["compare", str(tmp_path / "multirun" / "0")])
    with pytest.raises(SystemExit):  # refused as the arguments are parsed, naming the folder and its missing report
        main(["compare", str(tmp_path)])
    assert f"argument run_dirs: {tmp_path} has no rag.json (is it a finished eval.py" in capsys.readouterr().err


def test_concurrent_queries_fill_the_trace_once_each_and_local_backends_refuse(tmp_path, data, backends):
    cfg = config(data, "rag.concurrency=4")
    answers = gold_answers(cfg)
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)
    assert report["overall"]["n"] == 6 and report["overall"]["metrics"]["exact_match"] == 1.0
    part = [json.loads(line)["query_id"] for line in (tmp_path / "run" / PARTS_DIR / "rank-0.jsonl").open()]
    merged = [o.query_id for o in load_trace(tmp_path / "run" / "trace.jsonl")]
    assert sorted(part) == sorted(merged) and len(set(merged)) == 6

    class LocalModel(GoldBackend):
        name, thread_safe = "phi3v", False

    with pytest.raises(ValueError, match="rag.concurrency=2 needs thread-safe backends.*the phi3v backend"):
        run(config(data, "rag.concurrency=2"), tmp_path / "local", lambda: LocalModel(answers), backends)


@pytest.mark.parametrize("error", [ValueError("generator estimator needs a vocabulary"), KeyError("page"),
                                   RuntimeError("kernel launch failed"), ZeroDivisionError("division by zero")])
def test_an_unexpected_error_fails_only_its_query_with_its_type_and_message(tmp_path, data, backends, error):
    cfg = config(data, "rag.concurrency=2")
    answers = gold_answers(cfg)
    failing = list(answers)[1]
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers, fail=failing, error=error), backends)

    assert report["overall"]["n"] == 6 and report["overall"]["failed"] == 1
    assert report["overall"]["metrics"]["exact_match"] == pytest.approx(5 / 6)
    [failed] = [o for o in load_trace(tmp_path / "run" / "trace.jsonl") if o.failed]
    assert (failed.question, failed.route, failed.answer) == (failing, "failed", "")
    assert failed.failure == f"unexpected {type(error).__name__}: {error}"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), MemoryError(),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory"), ConfigError("bad setting"),
                                   KeyboardInterrupt()], ids=lambda e: type(e).__name__)
def test_a_run_level_error_stops_the_run_at_once_keeping_every_finished_query(tmp_path, data, backends, error):
    cfg = config(data, "rag.concurrency=2")
    answers = gold_answers(cfg)
    questions = list(answers)  # the plan's order
    with pytest.raises(type(error)):
        run(cfg, tmp_path / "run", lambda: GoldBackend(answers, fail=questions[0], error=error, delay_s=0.2), backends)

    asked = {re.search(r"Question: (.*)", t).group(1).strip() for t in backends[-1].prompts}
    assert questions[0] in asked <= set(questions[:2])  # a window of two: nothing started after the error
    part = tmp_path / "run" / PARTS_DIR / "rank-0.jsonl"
    kept = [o.question for o in load_trace(part)] if part.exists() else []
    in_flight = [q for q in questions[1:2] if q in asked and not isinstance(error, OSError)]
    assert kept == in_flight  # the query in flight (if it had started) is recorded, unless the disk failed

    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)
    again = {re.search(r"Question: (.*)", t).group(1).strip() for t in backends[-1].prompts}
    assert again == set(questions) - set(kept) and report["overall"]["failed"] == 0


class FailingOs:
    """``os`` for :mod:`hkrag.rag.trace` whose ``call`` fails with ``errno`` on its third use (two records fit),
    after writing half of what it was given when ``call`` is ``write``."""

    def __init__(self, call: str, errno: int) -> None:
        self.call, self.errno, self.uses = call, errno, 0

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name != self.call:
            return real

        def failing(*args):
            self.uses += 1
            if self.uses < 3:
                return real(*args)
            if name == "write":
                real(args[0], args[1][: len(args[1]) // 2])
            raise OSError(self.errno, os.strerror(self.errno))

        return failing


@pytest.mark.parametrize("call,errno", [("write", 28), ("fsync", 5), ("open", 30)])
def test_a_trace_that_cannot_be_written_stops_the_run_naming_the_file_and_loses_nothing(
    tmp_path, data, backends, monkeypatch, call, errno
):
    cfg = config(data)
    answers = gold_answers(cfg)
    monkeypatch.setattr(trace_module, "os", FailingOs(call, errno))
    part = tmp_path / "run" / PARTS_DIR / "rank-0.jsonl"
    with pytest.raises(WriteError, match=f"could not write {re.escape(str(part))}: {os.strerror(errno)}"):
        run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)
    assert len(backends[-1].prompts) == 3 * 2  # stopped at once: three queries asked, answer + verify each
    assert part.read_bytes().endswith(b"\n") and len(load_trace(part)) == 2  # no fragment of the third

    monkeypatch.setattr(trace_module, "os", os)
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)
    assert len(backends[-1].prompts) == 4 * 2 and report["overall"]["metrics"]["exact_match"] == 1.0


def damage(part: Path, how: str) -> None:
    """Damage a finished run's trace part as a crash, an edit or a copy could."""
    lines = part.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[-1])
    if how == "torn mid-character":  # killed while writing the last answer, inside a multi-byte character
        torn = json.dumps({**record, "answer": "€€"}, ensure_ascii=False).encode()
        part.write_bytes(b"".join(lines[:-1]) + torn[: torn.index("€".encode()) + 1])
    elif how == "garbage line":
        part.write_bytes(b"".join(lines[:2]) + b"{not json\n" + b"".join(lines[2:]))
    elif how == "non-UTF-8 line":
        part.write_bytes(b"".join(lines[:2]) + b'{"query_id": "\xff\xfe"}\n' + b"".join(lines[2:]))
    elif how == "record of another type":
        part.write_bytes(b"".join(lines[:2]) + b"[1, 2]\n" + b"".join(lines[2:]))
    elif how == "same line twice":
        part.write_bytes(b"".join(lines) + lines[0])
    elif how == "same query, other answer":
        part.write_bytes(b"".join(lines) + (json.dumps({**json.loads(lines[0]), "answer": "other"}) + "\n").encode())
    elif how == "foreign record":
        part.write_bytes(b"".join(lines) + (json.dumps({**record, "query_id": "elsewhere-q9"}) + "\n").encode())


@pytest.mark.parametrize("how,refusal", [
    ("torn mid-character", None),
    ("same line twice", None),
    ("garbage line", r"rank-0.jsonl, line 3: not a trace record \(JSONDecodeError"),
    ("non-UTF-8 line", r"rank-0.jsonl, line 3: not a trace record \(UnicodeDecodeError"),
    ("record of another type", r"rank-0.jsonl, line 3: not a trace record \(TypeError: a JSON list"),
    ("same query, other answer", r"query synchart/gold/\S+ is recorded twice with different content \(.*rank-0"
                                 r".jsonl, line 1 and .*rank-0.jsonl, line 7\)"),
    ("foreign record", r"holds 1 record\(s\) of queries that are not in this run \(e.g. \['syninfo/gold/elsewhere"
                       r"-q9'\]\).*rag.resume=false"),
])
def test_a_damaged_trace_is_resumed_or_refused_by_file_line_or_query(tmp_path, data, backends, how, refusal):
    cfg = config(data)
    answers = gold_answers(cfg)
    out = tmp_path / "run"
    run(cfg, out, lambda: GoldBackend(answers), backends)
    first = [(o.query_id, o.answer) for o in load_trace(out / "trace.jsonl")]
    damage(out / PARTS_DIR / "rank-0.jsonl", how)
    if refusal is not None:
        with pytest.raises(TraceError, match=refusal):
            run(cfg, out, lambda: GoldBackend(answers), backends)
        assert not backends[-1].requests
        return
    run(cfg, out, lambda: GoldBackend(answers), backends)
    assert len(backends[-1].requests) == (2 if how.startswith("torn") else 0)  # only the torn query again
    assert [(o.query_id, o.answer) for o in load_trace(out / "trace.jsonl")] == first


HUGE = " ".join(["word"] * 300_000)


@pytest.mark.parametrize("question,reply,recorded", [
    (HUGE, None, "failed: judger: token cap exceeded (3001"),
    ("What is \udcff\udcfe the code?", None, "question: What is \ufffd\ufffd the code?"),
    (None, "", "answer: "),
    (None, " \n\t ", "answer: "),
    (None, "M\udc802", "answer: M\ufffd2"),
    (None, 'a\x00b\u2028c"}{', 'answer: a\x00b\u2028c"}{'),
    (None, "x" * 200_000, "answer: " + "x" * 200_000),
], ids=["huge question", "undecodable question", "empty answer", "blank answer", "undecodable answer",
        "control characters", "huge answer"])
def test_odd_questions_and_answers_are_recorded_and_never_crash_the_run(
    tmp_path, data, backends, monkeypatch, question, reply, recorded
):
    """The first query's question is ``question``, or the backend's answer to it is ``reply``."""
    def first_one_odd(source, name, split):
        examples = load_qa(source, name, split)
        if name == "synchart" and question is not None:
            examples[0] = dataclasses.replace(examples[0], query=question)
        return examples

    monkeypatch.setattr(rag_task, "load_qa", first_one_odd)
    cfg = config(data)
    answers = gold_answers(cfg)
    first = next(iter(answers))
    answers[first if question is None else rag_task.valid_text(question)] = answers[first] if reply is None else reply
    report = run(cfg, tmp_path / "run", lambda: GoldBackend(answers), backends)

    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert len(trace) == report["overall"]["n"] == 6 and (tmp_path / "run" / "rag.html").is_file()
    odd = trace[0]
    what, _, value = recorded.partition(": ")
    if what == "failed":
        assert odd.failure.startswith(value)
    else:
        assert {"question": odd.question, "answer": odd.answer}[what] == value
    assert report["overall"]["failed"] == (what == "failed")


@pytest.mark.parametrize("override,message", [
    ("rag.top_k=2", "rag.top_k=2 < generator.top_k=3: the generator is handed 2 page(s) but keeps up to 3"),
    ("rag.top_k=0", "rag.top_k=0: expected an integer >= 1"),
    ("rag.max_queries=-1", "rag.max_queries=-1: expected an integer >= 1 or null"),
    ("rag.concurrency=0", "rag.concurrency=0: expected an integer >= 1"),
    ("rag.datasets=[]", "rag.datasets=[]: expected a non-empty list of names"),
    ("rag.datasets=[synchart,synchart]", "rag.datasets=['synchart', 'synchart']: a name is listed twice"),
    ("rag.pools=[single,al]", "rag.pools=['single', 'al']: ['al'] not among ['single', 'all']"),
    ("rag.split=''", "rag.split='': expected the name of a split, e.g. test"),
    ("rag.resume=maybe", "rag.resume='maybe': expected true or false"),
    ("generator.threshold=1.5", "generator.threshold=1.5: expected a number >= 0 and <= 1"),
    ("generator.caps.max_calls=0", "generator.caps.max_calls=0: expected an integer >= 1"),
    ("generator.caps.max_new_tokens.answer=0", "generator.caps.max_new_tokens.answer=0: expected an integer >= 1"),
    ("+generator.bogus=1", "generator config has unknown keys ['bogus']"),
    ("lvlm._target_=hkrag.lvlm.gpt.GPTBackend", "lvlm._target_='hkrag.lvlm.gpt.GPTBackend': cannot be imported "
                                                "(ModuleNotFoundError: No module named 'hkrag.lvlm.gpt')"),
    ("~lvlm._target_", "lvlm._target_=None: expected the dotted path of an LVLMBackend class"),
    ("judge.backend={{_target_:hkrag.lvlm.base.Message}}",
     "judge.backend._target_='hkrag.lvlm.base.Message': not an LVLMBackend class"),
    ("run_dir=/no/such/run", "run_dir='/no/such/run': no such directory"),
    ("run_dir={half}", "/train has no checkpoints/final/adapter: is it a finished train.py run directory?"),
    ("rag.datasets=[synchart,synbogus]", "qa[synbogus/test] could not be loaded: ValueError: BuilderConfig "
                                         "'synbogus' not found"),
    ("rag.split=dev", "qa[synchart/dev] could not be loaded"),
])
def test_bad_rag_settings_are_refused_by_name_before_the_run_directory_is_touched(
    tmp_path, data, backends, override, message
):
    half = tmp_path / "train"  # a train.py run that stopped after its first checkpoint
    (half / "checkpoints" / "step-10").mkdir(parents=True)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(message)):
        run(config(data, override.format(half=half)), out, lambda: pytest.fail("no backend may be built"), backends)
    assert not out.exists()
