"""Table 6's command (hkrag/tasks/table6.py): *not testable* decided from the configs alone, zero-width intervals
inconclusive and in the family, duplicated tests counted once, Holm over the table's family, the registered rules'
hash checked, the committed figures re-derived from the committed per-query data, and a rerun that re-runs
nothing."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import hkrag.tasks.common as common
from hkrag.io import write_json
from hkrag.stats import crossed_interval
from hkrag.tasks import table6
from hkrag.tasks.table6 import identical_by_construction, read_rows, summarize

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "table6"
ALL_STEPS = ("single_pass", "pruner", "answer", "verify", "salient", "fine_print", "decouple", "integrate")


CONFIGS = table6.shipped_configs()
"""conf/generator's four configurations, as eval.py composes them."""


def test_not_testable_is_decided_from_the_configs_alone():
    hkrag, no_pruner = CONFIGS["hkrag"], CONFIGS["no_pruner"]
    # one page in the Pruner's buffer: it asks nothing and keeps the page the fixed top-k keeps
    assert "differ only in `pruner`" in identical_by_construction(hkrag, no_pruner, buffer=1)
    assert identical_by_construction(hkrag, no_pruner, buffer=3) is None  # it can prune: a result, whatever it does
    assert identical_by_construction(hkrag, {**hkrag, "name": "copy"}, buffer=3).startswith("identical configurations")
    # the Pruner alone against the baseline on one page: verify's prompt against single_pass's, different calls
    assert identical_by_construction(CONFIGS["no_decoupler"], CONFIGS["single_pass"], buffer=1) is None
    assert identical_by_construction(hkrag, CONFIGS["no_decoupler"], buffer=1) is None
    assert identical_by_construction({**hkrag, "threshold": 0.5}, no_pruner, buffer=1) is None


def test_a_config_handing_the_pruner_one_page_is_not_testable_whatever_the_runs_answered():
    data = synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})
    for row in data:  # one gold page each: hkrag's calls and answers differ from no_pruner's, which changes nothing
        row["ranked"] = 1
    claims = summarize(data, {seed: ALL_STEPS for seed in range(3)}, configs=CONFIGS)["sets"]["gold"]["claims"]
    by = {(c["better"], c["worse"]): c for c in claims}
    assert not by["hkrag", "no_pruner"]["testable"] and "at most 1 page" in by["hkrag", "no_pruner"]["reason"]
    # the Pruner alone against the baseline stays testable (other prompts), its confound named beside the verdict
    pruner_alone = by["no_decoupler", "single_pass"]
    assert pruner_alone["testable"] and pruner_alone["verdict"] != "not testable"
    assert any("Pruner cannot run" in note for note in pruner_alone["caveats"])
    # hkrag and no_pruner are one configuration here: "Gen w/o pruner beats the baseline" is the same test as
    # "HKRAG-Gen beats the baseline", counted once; the family is 3 claims
    duplicate = by["no_pruner", "single_pass"]
    assert duplicate["duplicate_of"] == claims.index(by["hkrag", "single_pass"]) and not duplicate["caveats"]
    assert duplicate["p_holm"] == by["hkrag", "single_pass"]["p_holm"] and claims[0]["family_size"] == 3


def test_a_pruner_that_keeps_every_page_is_a_result_and_a_zero_width_interval_inconclusive_in_the_family():
    data = synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})
    no_pruner = {(r["seed"], r["query_id"]): r["score"] for r in data if r["generator"] == "no_pruner"}
    for row in data:  # three pages; hkrag's Pruner keeps all three and every answer equals no_pruner's
        if row["generator"] == "hkrag":
            row.update(score=no_pruner[row["seed"], row["query_id"]], kept=3)
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, configs=CONFIGS)
    claim = next(c for c in summary["sets"]["gold"]["claims"] if (c["better"], c["worse"]) == ("hkrag", "no_pruner"))
    assert claim["testable"] and (claim["low"], claim["high"]) == (0.0, 0.0)
    assert claim["verdict"] == claim["corrected_verdict"] == "inconclusive"  # never "not reproduced"
    assert claim["p_holm"] == 1.0 and summary["family_size"] == 5  # a member of the family


def test_prompts_the_generator_was_not_trained_on_are_a_caveat_not_a_verdict():
    data = synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})
    claims = summarize(data, {seed: ["single_pass"] for seed in range(3)}, configs=CONFIGS)["sets"]["gold"]["claims"]
    first = claims[0]  # HKRAG-Gen beats the baseline, on a generator trained on the single-pass prompt only
    assert first["testable"] and first["caveats"] == [
        "the generator was not trained on the prompt(s) answer, decouple, fine_print, integrate, pruner, salient, "
        "verify: the contrast also tests the training"]


def test_a_subset_holding_every_query_of_its_set_is_counted_once():
    data = [{**row, "pages": "retrieved", "pool": pool, "set": "first"} for pool in ("single", "all")
            for row in synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})]
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, configs=CONFIGS)
    assert list(summary["sets"]) == ["retrieved", "first"] and summary["family_size"] == 5
    retrieved, first = summary["sets"]["retrieved"]["claims"], summary["sets"]["first"]["claims"]
    assert [c["duplicate_of"] for c in first] == [0, 1, 2, 3, 4]
    assert [c["corrected_verdict"] for c in first] == [c["corrected_verdict"] for c in retrieved]
    assert "counted once" in table6.markdown(summary)


def test_changed_rules_are_refused_naming_both_hashes(tmp_path, monkeypatch):
    rules = tmp_path / "table6.md"
    rules.write_text("the registered rules\n")
    monkeypatch.setattr(table6, "RULES_FILE", rules)
    config = table6.Table6Config(tmp_path / "out", seeds=[0])
    registered = table6.register_rules(config)
    assert json.loads((tmp_path / "out" / "rules.json").read_text()) == registered
    assert registered["sha256"] == hashlib.sha256(b"the registered rules\n").hexdigest()
    assert table6.register_rules(config) == registered  # a rerun under the same rules
    data = synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8})
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, configs=CONFIGS, rules=registered)
    assert summary["rules"] == registered and "Registered before the runs" in table6.markdown(summary)
    rules.write_text("a rule changed after the results\n")
    changed = hashlib.sha256(b"a rule changed after the results\n").hexdigest()
    for refused in (lambda: table6.register_rules(config), lambda: table6.markdown(summary),
                    lambda: summarize(data, {seed: ALL_STEPS for seed in range(3)}, configs=CONFIGS, rules=registered)):
        with pytest.raises(table6.RulesChangedError, match=f"sha256 {registered['sha256']}.*now hashes to {changed}"):
            refused()
    rules.write_text("the registered rules\n")  # the same text again, another margin
    with pytest.raises(table6.RulesChangedError, match="registered margin=0.02 before its runs, not 0.05"):
        table6.register_rules(table6.Table6Config(tmp_path / "out", seeds=[0], margin=0.05))
    with pytest.raises(table6.RulesChangedError, match="records no registered verdict rules"):
        table6.markdown({**summary, "rules": None})
    (tmp_path / "old" / "runs" / "gold-hkrag-s0").mkdir(parents=True)  # runs made before any registration
    with pytest.raises(table6.RulesChangedError, match="holds runs but no rules.json"):
        table6.register_rules(table6.Table6Config(tmp_path / "old", seeds=[0]))


def test_the_registered_rules_are_the_committed_file(capsys, tmp_path):
    assert table6.RULES_FILE == Path(__file__).resolve().parents[1] / "docs" / "rules" / "table6.md"
    assert "identical by construction" in table6.RULES_FILE.read_text()
    for folder in (COMMITTED, COMMITTED / "two_stage"):  # both re-run under the registered rules
        committed = json.loads((folder / "table6.json").read_text())
        assert committed["rules"]["sha256"] == table6.rules_digest()
        assert table6.render(committed) == (folder / "table6.md").read_text()
    old = tmp_path / "table6.json"  # as the reports made under the earlier, post-hoc rule were: no rules recorded
    write_json(old, {key: value for key, value in committed.items() if key != "rules"})
    with pytest.raises(table6.RulesChangedError, match="records no registered verdict rules"):
        table6.render(json.loads(old.read_text()))
    with pytest.raises(SystemExit) as exit_info:
        table6.main(["--render", str(old)])
    assert exit_info.value.code == 2 and "records no registered verdict rules" in capsys.readouterr().err


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
    summary = summarize(data, {seed: ALL_STEPS for seed in range(3)}, margin=0.02, configs=CONFIGS)
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
    served = yaml.safe_load((tmp_path / "t6" / "runs" / "retrieved-no_decoupler-s1" / ".hydra" / "overrides.yaml")
                            .read_text())
    assert common.UNGROUNDED in served  # Table 6 measures answers and cost: no OCR of every kept page
    ran = []
    monkeypatch.setattr(common, "run_job", lambda *job: ran.append(job[0]) or 0.0)
    again = table6.main(argv)
    assert ran == [] and again == first
    claim = again["sets"]["gold"]["claims"][0]  # the Pruner alone on one gold page: judged, its confound named
    assert claim["testable"] and any("Pruner cannot run" in note for note in claim["caveats"])
    assert again["rules"] == json.loads((tmp_path / "t6" / "rules.json").read_text())
    assert again["rules"]["sha256"] == table6.rules_digest()
    rendered = json.loads((tmp_path / "t6" / "table6.json").read_text())  # --render: the same table6.md again
    assert table6.main(["--render", str(tmp_path / "t6" / "table6.json")]) == rendered
    assert table6.render(rendered) == (tmp_path / "t6" / "table6.md").read_text()
    steps = json.loads((tmp_path / "t6" / "steps.json").read_text())  # the per-step report of the same runs
    assert set(steps) == {f"{pages}-{g}" for pages in ("gold", "retrieved") for g in ("single_pass", "no_decoupler")}
    assert steps["gold-single_pass"]["queries"] == 2 * 3  # two seeds' runs of 3 questions, pooled
    assert len(read_rows(tmp_path / "t6" / table6.QUERIES_FILE)) == 2 * 2 * (3 + 6)  # seeds x configs x rows


def test_the_readmes_verdicts_are_the_committed_reports():
    """README's Table 6 verdict table, cell by cell, is docs/table6/table6.json's (difference, interval, verdicts)."""
    readme = (COMMITTED.parents[1] / "README.md").read_text()
    table = readme.split("| claim | gold pages | retrieved pages |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    report = json.loads((COMMITTED / "table6.json").read_text())
    cell = re.compile(r"([+−-]\d+\.\d) \[([+−-]\d+\.\d), ([+−-]\d+\.\d)\] ([a-z ]+) \(([a-z ]+)\)")
    for line, claim in zip(table.splitlines(), table6.CLAIMS, strict=True):
        for text, pages in zip(line.strip("|").split("|")[1:], ("gold", "retrieved"), strict=True):
            committed = next(c for c in report["sets"][pages]["claims"] if c["text"] == claim[0].text)
            if committed["verdict"] == "not testable":
                assert text.strip().startswith("not testable")
                continue
            diff, low, high, raw, corrected = cell.fullmatch(text.strip()).groups()
            numbers = [float(x.replace("−", "-")) for x in (diff, low, high)]
            assert numbers == [round(100 * committed[k], 1) for k in ("diff", "low", "high")]
            assert (raw, corrected) == (committed["verdict"], committed["corrected_verdict"])
