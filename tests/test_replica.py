"""``python -m hkrag.tasks.replica`` on a tiny corpus: every job continues the one warm start, the report judges the
Table 5 claims, and a rerun skips finished jobs and redoes unfinished ones."""

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import hkrag.tasks.training as training
from hkrag.retrieval.ablation import load_per_query, summarize
from hkrag.retrieval.evaluation import PER_QUERY_FILE
from hkrag.tasks import replica
from hkrag.tasks.replica import TABLE5, ReplicaConfig, job_folder, run_jobs, run_replica
from hkrag.tasks.table6 import GENERATORS

DATA = ["data.synthetic.n_train=16", "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
        "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart]"]
TINY = [*DATA, "model.num_crops=4", "trainer.global_batch_size=8", "trainer.max_steps=2", "eval.doc_batch_size=16",
        "eval.pools=[single]"]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    out = tmp_path_factory.mktemp("replica")
    data_dir = f"paths.data_dir={out / 'data'}"
    config = ReplicaConfig(out / "run", seeds=(0, 1), steps=2, eval_every=1, alphas=(0.5,), betas=(1.0,),
                           similarity=False, overrides=[data_dir, *TINY], generator_steps=2,
                           hard_negatives=2,
                           thresholds=(0.5, 0.8), eval_overrides=[data_dir, *DATA, "rag.max_queries=3"])
    return config, run_replica(config)


def test_every_job_continues_the_warm_start(done):
    config, report = done
    warm = json.loads((config.out / "warmstart" / "eval-after" / PER_QUERY_FILE).read_text())
    for condition in TABLE5:
        for seed in config.seeds:
            job = job_folder(config.out, condition, seed)
            assert json.loads((job / "eval-before" / PER_QUERY_FILE).read_text()) == warm  # the same start
            chosen = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
            assert f"trainer.seed={seed}" in chosen and condition.overrides[0] in chosen
            assert (job / "eval-step-1").is_dir() and (job / "eval-step-2").is_dir()  # the learning curve
    jobs = {job_folder(config.out, c, s).name for c in config.conditions() for s in config.seeds}
    table6 = {f"table6/{pages}-{g}-s{seed}" for pages in ("gold", "retrieved") for g in GENERATORS
              for seed in config.seeds} | {f"table6/generator-s{seed}" for seed in config.seeds}
    assert set(report["timings"]) == {"warmstart", "mining", *jobs, *table6, "gold-hkrag-h0.5"}


def test_hard_negatives_are_mined_from_the_warm_start_and_never_positives(done):
    from hkrag.data.opendocvqa import load_qa

    config, report = done
    mined = json.loads((config.out / "hard_negatives.json").read_text())["negatives"]
    qa = load_qa(config.out.parent / "data" / "synthetic" / "qa", "default", "train")
    assert set(mined) == {ex.query_id for ex in qa}
    assert all(len(mined[ex.query_id]) == 8 and not set(mined[ex.query_id]) & set(ex.relevant_doc_ids) for ex in qa)
    summary = report["tables"]["hard_negatives"]
    assert summary["conditions"] == ["infonce hn", "hkrag hn"] and len(summary["verdicts"]) == 2
    job = yaml.safe_load((job_folder(config.out, config.tables["hard_negatives"][1], 0) / ".hydra"
                          / "overrides.yaml").read_text())
    assert "trainer.hard_negatives=2" in job and f"trainer.negatives_file={config.out / 'hard_negatives.json'}" in job


def test_table_6_compares_the_generators_on_the_same_queries(done):
    config, report = done
    tables = report["table6"]["sets"]
    assert list(tables)[:2] == ["gold", "retrieved"]
    for pages, rows in (("gold", 3), ("retrieved", 6)):  # 3 queries; retrieved in the single and all pools
        summary = tables[pages]
        assert list(summary["generators"]) == list(GENERATORS) and summary["rows"] == rows
        assert summary["questions"] == 3 and len(summary["claims"]) == 5
    assert report["table6"]["seeds"] == list(config.seeds)
    assert [row["threshold"] for row in report["table6"]["sweep"]] == [0.5, 0.8]
    runs = config.out / "table6" / "runs"
    served = yaml.safe_load((runs / "gold-hkrag-s1" / ".hydra" / "overrides.yaml").read_text())
    generator = config.out / "table6" / "generators" / "generator-s1"
    assert f"lvlm.adapter={generator / 'checkpoints' / 'final' / 'adapter'}" in served
    trained = yaml.safe_load((generator / ".hydra" / "overrides.yaml").read_text())
    assert f"generator_training.init_from={config.out / 'warmstart'}" in trained
    retrieved = yaml.safe_load((runs / "retrieved-hkrag-s0" / ".hydra" / "overrides.yaml").read_text())
    assert f"run_dir={config.out / 'warmstart'}" in retrieved
    text = (config.out / "replica.md").read_text()
    assert "## Table 6: the generator ablation" in text and "### Judger threshold h" in text


def test_the_report_judges_the_table_5_claims(done):
    config, report = done
    summary = report["tables"]["table5"]
    assert list(report["tables"]) == ["table5", "hard_negatives"]
    assert summary["conditions"] == ["infonce", "hkrag", "no_sin", "no_din"]
    assert len(summary["verdicts"]) == 7  # every claim, one pool
    assert {v["verdict"] for v in summary["verdicts"]} <= {"reproduced", "not reproduced", "inconclusive"}
    assert summary["curves"]["single"]["all"]["hkrag"]["steps"] == [0, 1, 2]
    text = (config.out / "replica.md").read_text()
    assert text.startswith("# Replica of the paper's Table 5 at CPU scale") and "### Verdicts" in text
    assert (config.out / "table5.png").read_bytes()[:4] == b"\x89PNG"
    # the verdicts re-derive from the per-query scores written beside the report
    runs = [run for run in load_per_query(config.out / replica.RETRIEVER_PER_QUERY)
            if run.condition in summary["conditions"]]
    again = summarize(runs, "infonce", margin=config.margin, datasets=replica.FINE_PRINT_SPLITS)
    keys = ("diff", "low", "high", "p_value", "p_holm", "corrected_low", "corrected_high")
    assert [v[k] for v in again["verdicts"] for k in keys] == pytest.approx(
        [v[k] for v in summary["verdicts"] for k in keys])
    assert [v["corrected_verdict"] for v in again["verdicts"]] == [v["corrected_verdict"] for v in summary["verdicts"]]


def test_a_rerun_skips_finished_jobs_and_redoes_unfinished_ones(done, monkeypatch):
    config, report = done
    ran = []
    train = training.run_training
    monkeypatch.setattr(training, "run_training", lambda cfg, folder: ran.append(folder.name) or train(cfg, folder))
    unfinished = job_folder(config.out, TABLE5[2], 1)
    (unfinished / "report.json").unlink()
    again = run_replica(config)
    assert ran == [unfinished.name]
    assert again["tables"]["table5"]["ndcg@5"] == report["tables"]["table5"]["ndcg@5"]  # deterministic rerun


def test_workers_redo_unfinished_jobs_side_by_side(done):
    config, report = done
    unfinished = [job_folder(config.out, condition, 0) for condition in TABLE5[:2]]
    for folder in unfinished:
        (folder / "report.json").unlink()
    again = run_replica(replace(config, workers=2))
    assert all((folder / "report.json").is_file() for folder in unfinished)
    assert again["tables"]["table5"]["ndcg@5"] == report["tables"]["table5"]["ndcg@5"]


def test_a_failing_job_stops_the_side_by_side_run(tmp_path):
    jobs = [(tmp_path / name, ["trainer.bogus_key=1"], "train", "report.json") for name in ("a", "b", "c")]
    with pytest.raises(Exception, match="bogus_key"):
        list(run_jobs(jobs, workers=2))
    assert not any((tmp_path / name / "report.json").exists() for name in ("a", "b", "c"))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="the replica needs seeds, steps >= 1"):
        ReplicaConfig("out", seeds=(), steps=2)
    with pytest.raises(ValueError, match="workers=0"):
        ReplicaConfig("out", workers=0)


def test_the_readmes_table_5_verdicts_are_the_committed_report():
    root = Path(__file__).resolve().parents[1]
    verdicts = json.loads((root / "docs" / "replica" / "replica.json").read_text())["tables"]["table5"]["verdicts"]
    readme = " ".join((root / "README.md").read_text().split())
    counts = Counter(v["corrected_verdict"] for v in verdicts)  # the README quotes the Holm-corrected verdicts
    assert (len(verdicts), counts["inconclusive"], counts["not reproduced"]) == (14, 13, 1)
    assert ("Of the 14 verdicts on the paper's Table 5 claims (7 claims × 2 pools), 13 are *inconclusive*" in readme
            and "and one is *not reproduced*" in readme)


def test_every_interval_the_readme_quotes_for_table_5_is_in_the_committed_report():
    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().replace("−", "-").split())
    start, end = "nDCG@5 ×100 in the single pools after 324 steps", "**Table 6** in the replica"
    section = readme[readme.index(start):readme.index(end)]
    quoted = re.findall(r"\[[-+]?\d+\.\d, [-+]?\d+\.\d\]", section)
    report = (root / "docs" / "replica" / "replica.md").read_text()
    assert len(quoted) > 20, "the README's Table 5 section moved"
    assert [interval for interval in quoted if interval not in report] == []
