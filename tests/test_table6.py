"""Table 6's command (hkrag/tasks/table6.py): *not testable* read from the traces, Holm over the table's family, the
committed figures re-derived from the committed per-query data, and a rerun that re-runs nothing."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import hkrag.tasks.common as common
from hkrag.rag.records import CallRecord, QueryOutcome
from hkrag.stats import crossed_interval
from hkrag.tasks import table6
from hkrag.tasks.table6 import judge_testability, query_row, read_rows, summarize

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "table6"
ALL_STEPS = ("single_pass", "pruner", "answer", "verify", "salient", "fine_print", "decouple", "integrate")


def outcome(query_id: str, calls: list[tuple[str, str, list[str], str]], answer: str = "R4",
            retrieved: tuple[str, ...] = ("p1", "p2", "p3")) -> QueryOutcome:
    """A retrieved-pages outcome whose calls are ``(agent, step, pages, reply)``; its gold answer is R4; the pages
    kept are those of its last call."""
    records = [CallRecord(agent=agent, prompt=f"{step} about {query_id}", page_ids=pages, step=step, output=reply)
               for agent, step, pages, reply in calls]
    kept = calls[-1][2] if calls else list(retrieved)
    return QueryOutcome(query_id=query_id, question="What is the code?", gold=["R4"], dataset="synchart",
                        pool="single", retrieved=list(retrieved), kept=list(kept), route="LQP", answer=answer,
                        calls=records, metrics={"relaxed_accuracy": float(answer == "R4")})


def rows(outcomes: list[QueryOutcome], generator: str = "hkrag") -> list[dict]:
    return [query_row(o, "retrieved", generator, 0, {"p1"}) for o in outcomes]


AGENTIC = [("pruner", "pruner", ["p1"], "yes"), ("judger", "answer", ["p1"], "R4"),
           ("summarizer", "verify", ["p1"], "R4")]


def test_identical_traces_are_not_testable_and_one_other_reply_is():
    first = rows([outcome("q1", AGENTIC), outcome("q2", AGENTIC)])
    same = rows([outcome("q1", AGENTIC), outcome("q2", AGENTIC)], "no_decoupler")
    testable, reason = judge_testability(first, same, "pruner", ALL_STEPS)
    assert not testable and "identical calls" in reason
    other_reply = [*AGENTIC[:2], ("summarizer", "verify", ["p1"], "R5")]
    differs = rows([outcome("q1", AGENTIC), outcome("q2", other_reply, answer="R5")], "no_decoupler")
    assert judge_testability(first, differs, "pruner", ALL_STEPS) == (True, None)


def test_a_component_that_changes_no_other_call_is_not_testable():
    # hkrag's Pruner asks and keeps every page: the calls after it are no_pruner's, call for call
    kept_all = [("pruner", "pruner", ["p1"], "no"), ("pruner", "pruner", ["p1", "p2"], "no"),
                ("judger", "answer", ["p1", "p2", "p3"], "R4"), ("summarizer", "verify", ["p1", "p2", "p3"], "R4")]
    with_pruner = rows([outcome("q1", kept_all)])
    without = rows([outcome("q1", kept_all[2:])], "no_pruner")
    testable, reason = judge_testability(with_pruner, without, "pruner", ALL_STEPS)
    assert not testable and reason == ("the Pruner never prunes on this set (it keeps every page of every query); the "
                                       "two configurations coincide: the pruner calls changed no other call on any "
                                       "query and seed (same pages, prompts and replies after them)")
    single_pass = rows([outcome("q1", [("single_pass", "single_pass", ["p1", "p2", "p3"], "R5")], answer="R5")],
                       "single_pass")  # the Pruner alone against the baseline: other prompts, but no pruning
    assert judge_testability(with_pruner, single_pass, "pruner", ALL_STEPS) == (
        False, "the Pruner never prunes on this set (it keeps every page of every query)")
    pruned = rows([outcome("q1", AGENTIC)])  # it kept page 1 alone: later calls see other pages
    assert judge_testability(pruned, without, "pruner", ALL_STEPS) == (True, None)


def test_a_component_that_never_runs_is_not_testable():
    one_page = [("judger", "answer", ["p1"], "R4"), ("summarizer", "verify", ["p1"], "R4")]
    better = rows([outcome("q1", one_page)])  # hkrag on one gold page: the Pruner's loop never runs
    worse = rows([outcome("q1", [("single_pass", "single_pass", ["p1"], "R5")], answer="R5")], "single_pass")
    testable, reason = judge_testability(better, worse, "pruner", ALL_STEPS)
    assert not testable and reason == "the Pruner never runs on this set (no pruner call)"


def test_prompts_the_generator_was_not_trained_on_are_not_testable():
    better = rows([outcome("q1", AGENTIC)])
    worse = rows([outcome("q1", [("single_pass", "single_pass", ["p1", "p2", "p3"], "R5")], answer="R5")],
                 "single_pass")
    testable, reason = judge_testability(better, worse, None, ["single_pass"])  # today's generator: one prompt
    assert not testable and reason == "the generator was not trained on the prompt(s) answer, pruner, verify"
    assert judge_testability(better, worse, None, ALL_STEPS) == (True, None)


def synthetic_rows(seed_effects: dict[str, float], n_questions: int = 12, seeds: int = 3) -> list[dict]:
    """Gold-page rows: each configuration right on a question when a fixed draw falls below its rate, plus a seed
    shift; distinct calls per configuration (the Pruner asks in hkrag and no_decoupler, the Decoupler runs in hkrag
    and no_pruner), so every claim but the coinciding ones is testable."""
    rng = np.random.default_rng(0)
    draws = rng.random((seeds, n_questions))
    steps = {"single_pass": [("single_pass", "single_pass")],
             "no_pruner": [("judger", "answer"), ("decoupler", "salient"), ("summarizer", "integrate")],
             "no_decoupler": [("pruner", "pruner"), ("summarizer", "verify")],
             "hkrag": [("pruner", "pruner"), ("judger", "answer"), ("decoupler", "salient"),
                       ("summarizer", "integrate")]}
    out = []
    for generator, rate in seed_effects.items():
        for seed in range(seeds):
            for q in range(n_questions):
                right = draws[seed, q] < rate + 0.05 * seed
                out.append({"pages": "gold", "generator": generator, "seed": seed, "dataset": "synchart",
                            "pool": "gold", "query_id": f"q{q}", "set": "gold", "score": float(right),
                            "route": "LQP", "failed": False, "ranked": 3, "kept": 1,
                            "calls": [[agent, step, f"{generator}-{step}-{q}"] for agent, step in steps[generator]],
                            "input_tokens": 10, "output_tokens": 2, "seconds": 0.01})
    return out


def test_holm_runs_over_the_testable_claims_of_the_table():
    data = synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, margin=0.02)
    claims = summary["sets"]["gold"]["claims"]
    assert [c["testable"] for c in claims] == [True] * 5 and summary["family_size"] == 5
    raw = [c["p_value"] for c in claims]
    order = sorted(range(5), key=raw.__getitem__)
    expected, running = [0.0] * 5, 0.0
    for rank, index in enumerate(order):  # Holm by hand: the k-th smallest times (m - k + 1), a running maximum
        running = max(running, min(1.0, (5 - rank) * raw[index]))
        expected[index] = running
    assert [c["p_holm"] for c in claims] == pytest.approx(expected)
    assert claims[0]["corrected_confidence"] == pytest.approx(1 - 0.05 / 5)
    assert all(c["corrected_low"] <= c["low"] and c["corrected_high"] >= c["high"] for c in claims)
    # with the Pruner's calls gone from every hkrag row, hkrag vs no_pruner coincide: the family shrinks to 4
    for row in data:
        if row["generator"] == "hkrag":
            row["calls"] = [[a, s, sig.replace("hkrag", "no_pruner")] for a, s, sig in row["calls"] if s != "pruner"]
            row["score"] = next(r["score"] for r in data if r["generator"] == "no_pruner" and r["seed"] == row["seed"]
                                and r["query_id"] == row["query_id"])
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, margin=0.02)
    claims = summary["sets"]["gold"]["claims"]
    assert summary["family_size"] == 4 and claims[1]["verdict"] == "not testable" and claims[1]["p_holm"] is None


def test_a_committed_interval_is_re_derived_from_the_committed_per_query_data():
    report = json.loads((COMMITTED / "table6.json").read_text())
    data = read_rows(COMMITTED / table6.QUERIES_FILE)
    claim = next(c for c in report["sets"]["retrieved"]["claims"] if c["better"] == "hkrag"
                 and c["worse"] == "single_pass")
    seeds = report["seeds"]
    by = {(r["generator"], r["seed"], r["dataset"], r["pool"], r["query_id"]): r["score"] for r in data
          if r["pages"] == "retrieved"}
    questions = sorted({(d, q) for g, s, d, p, q in by if g == "hkrag" and s == seeds[0]})
    pools = sorted({p for g, s, d, p, q in by})
    diffs = np.array([[np.mean([by["hkrag", s, d, p, q] - by["single_pass", s, d, p, q] for p in pools])
                       for d, q in questions] for s in seeds])  # each question one column, its pools averaged
    derived = crossed_interval(diffs, report["confidence"])
    assert (derived["mean"], derived["low"], derived["high"]) == pytest.approx((claim["diff"], claim["low"],
                                                                                claim["high"]), abs=1e-12)


DATA = ["data.synthetic.n_train=16", "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
        "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart]"]


@pytest.mark.slow  # 10-33 s on the shared 2 cores: four tiny generators and eight runs
def test_a_second_invocation_re_runs_nothing(tmp_path, monkeypatch):
    data = f"paths.data_dir={tmp_path / 'data'}"
    stage1 = [f"--stage1={o}" for o in (data, *DATA, "generator_training.optim.max_steps=2")]
    argv = ["--out", str(tmp_path / "t6"), "--seeds", "0", "1", "--generator-steps", "2", "--generators",
            "single_pass", "no_decoupler", *stage1, *(f"--eval={o}" for o in (data, *DATA, "rag.max_queries=3")),
            data, *DATA]
    first = table6.main(argv)
    assert set(first["timings"]) == {"stage1-s0", "stage1-s1", "generator-s0", "generator-s1",
                                     *(f"{pages}-{g}-s{seed}" for seed in (0, 1) for pages in ("gold", "retrieved")
                                       for g in ("single_pass", "no_decoupler"))}
    generators = tmp_path / "t6" / "generators"
    trained = yaml.safe_load((generators / "generator-s1" / ".hydra" / "overrides.yaml").read_text())
    assert f"generator_training.init_from={generators / 'stage1-s1'}" in trained
    ran = []
    monkeypatch.setattr(common, "run_job", lambda *job: ran.append(job[0]) or 0.0)
    again = table6.main(argv)
    assert ran == [] and again == first
    claim = again["sets"]["gold"]["claims"][0]
    assert claim["verdict"] == "not testable" and "never runs" in claim["reason"]  # one gold page: no Pruner call
    steps = json.loads((tmp_path / "t6" / "steps.json").read_text())  # the per-step report of the same runs
    assert set(steps) == {f"{pages}-{g}" for pages in ("gold", "retrieved") for g in ("single_pass", "no_decoupler")}
    assert steps["gold-single_pass"]["queries"] == 2 * 3  # two seeds' runs of 3 questions, pooled
    assert len(read_rows(tmp_path / "t6" / table6.QUERIES_FILE)) == 2 * 2 * (3 + 6)  # seeds x configs x rows
