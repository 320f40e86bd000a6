"""Composed runs: train.py's report and eval.py agree; config and data errors say what to fix."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from safetensors import safe_open

from hkrag.data.opendocvqa import load_qa
from hkrag.data.pairs import TrainingPair
from hkrag.tasks.retrieval import run_retrieval_evaluation as run_evaluation
from hkrag.tasks.training import run_training
from hkrag.training.trainer import document_groups

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "data.synthetic.n_train=40", "data.synthetic.n_test=12", "data.synthetic.train_groups_per_style=2",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=3", "data.eval_datasets=[synchart,syninfo]",
]


def config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_eval_py_reproduces_the_training_report(tmp_path):
    data = [f"paths.data_dir={tmp_path / 'data'}", *SMALL_DATA]
    train_cfg = config("train", [
        *data, f"paths.output_dir={tmp_path / 'run'}", "model.num_crops=4", "trainer.global_batch_size=8",
        "trainer.chunk_size=4", "trainer.max_steps=2", "trainer.save_every=null", "eval.doc_batch_size=16",
    ])
    report = run_training(train_cfg, tmp_path / "run")
    assert report["steps"] == 2 and (tmp_path / "run" / "report.md").is_file()
    eval_cfg = config("eval", [*data, f"paths.output_dir={tmp_path / 'eval'}", f"run_dir={tmp_path / 'run'}",
                               "eval.doc_batch_size=5"])
    evaluated = run_evaluation(eval_cfg, tmp_path / "eval")["results"]
    for dataset, by_pool in report["after"].items():
        for pool, result in by_pool.items():
            assert evaluated[dataset][pool]["all"] == pytest.approx(result["all"], abs=1e-6), (dataset, pool)
            assert set(result) == {"all", "num_queries", "salient", "fine_print"}


def test_the_reader_experiment_batches_documents_and_trains_the_image_embedding(tmp_path):
    data = [f"paths.data_dir={tmp_path / 'data'}", *SMALL_DATA]
    cfg = config("train", ["experiment=reader_tiny", *data, f"paths.output_dir={tmp_path / 'run'}",
                           "model.num_crops=4", "trainer.global_batch_size=6", "trainer.max_steps=2",
                           "eval_before_after=false"])
    assert not cfg.loss.use_din and not cfg.loss.use_sin and cfg.loss.tau == 0.05  # InfoNCE, the demo's tau
    assert config("train", ["experiment=reader_tiny", "loss=hkrag"]).loss.use_sin  # a row of the replica
    run_training(cfg, tmp_path / "run")
    qa = load_qa(tmp_path / "data" / "synthetic" / "qa", "default", "train")
    pairs = [TrainingPair(ex.query_id, ex.query, ex.relevant_doc_ids) for ex in qa]
    documents = [pair.positives[0].rsplit("-p", 1)[0] for pair in pairs]  # synchart-train-d001-p3 -> ...-d001
    assert document_groups(pairs, cfg.trainer.group_pattern) == documents and len(set(documents)) > 1
    adapter = tmp_path / "run" / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors"
    with safe_open(adapter, "pt") as tensors:
        trained = [name for name in tensors.keys() if "vision_embed_tokens.img_processor" in name]
    assert trained  # the vision tower is saved with the adapter: trained in full


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_unknown_config_key_is_named():
    result = run_script("train.py", "trainer.bogus_key=1")
    assert result.returncode != 0
    assert "bogus_key" in result.stderr


def test_missing_data_path_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    result = run_script("train.py", "data=opendocvqa", f"data.qa_source={missing}", f"hydra.run.dir={tmp_path}/o")
    assert result.returncode != 0
    assert f"data path {missing} does not exist" in result.stderr


def test_unknown_experiment_lists_the_choices():
    result = run_script("train.py", "experiment=nope")
    assert result.returncode != 0
    assert "hkrag_retriever" in result.stderr


def test_generated_corpus_is_regenerated_when_its_settings_change(tmp_path):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import prepare_data

    data = OmegaConf.create({"root": str(tmp_path / "syn"), "synthetic": {
        "n_train": 8, "n_test": 4, "train_groups_per_style": 1, "test_groups_per_style": 1, "group_size": 2}})
    prepare_data(data)
    stamp = (tmp_path / "syn" / "synthetic_config.json").stat().st_mtime_ns
    prepare_data(data)  # same settings: kept as is
    assert (tmp_path / "syn" / "synthetic_config.json").stat().st_mtime_ns == stamp
    data.synthetic.n_train = 6
    prepare_data(data)
    assert len(load_qa(tmp_path / "syn" / "qa", "default", "train")) == 6


def test_the_built_in_corpus_is_generated_with_its_gold_evidence_beside_the_questions(tmp_path, monkeypatch, caplog):
    from omegaconf import OmegaConf

    from hkrag.io import WriteError, read_jsonl
    from hkrag.rag.gold_evidence import EVIDENCE_FILE, evidence_rows, load_gold
    from hkrag.tasks import common

    root = tmp_path / "syn"
    data = OmegaConf.create({"root": str(root), "synthetic": {
        "n_train": 8, "n_test": 4, "train_groups_per_style": 1, "test_groups_per_style": 1, "group_size": 2}})
    common.prepare_data(data)
    rows = read_jsonl(root / EVIDENCE_FILE)
    assert len(rows) == 8 + 4 and all(row["drawn"] and row["evidence"] for row in rows)  # every question, drawn
    # the 4 test questions fell on three styles: synchart's test split has none, and adds no row
    assert {(row["dataset"], row["split"]) for row in rows} == {("default", "train"), ("synslide", "test"),
                                                                ("syntable", "test"), ("syninfo", "test")}
    stamp = (root / "synthetic_config.json").stat().st_mtime_ns
    (root / EVIDENCE_FILE).unlink()  # a corpus the command line generated has none
    common.prepare_data(data)
    assert read_jsonl(root / EVIDENCE_FILE) == rows
    assert (root / "synthetic_config.json").stat().st_mtime_ns == stamp  # the corpus itself kept as is
    (root / EVIDENCE_FILE).unlink()

    def unwritable(path):
        raise WriteError(Path(path) / EVIDENCE_FILE, PermissionError(13, "Permission denied"))

    monkeypatch.setattr(common, "write_evidence", unwritable)
    with caplog.at_level("WARNING"):
        common.prepare_data(data)
    assert re.search(r"gold evidence not written beside the questions \(runs derive it\): .*could not write "
                     r".*evidence.jsonl: Permission denied", caplog.text)
    assert not (root / EVIDENCE_FILE).exists()
    assert len(load_gold(root)) == len(list(evidence_rows(root))) == len(rows)  # derived from pages.jsonl


def test_foreign_folder_is_never_overwritten(tmp_path):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import prepare_data

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by hkrag.data.synthetic"):
        prepare_data(OmegaConf.create({"root": str(tmp_path / "mine"), "synthetic": {"n_train": 8}}))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_evaluation_warns_about_positives_missing_from_the_pool(tmp_path, caplog):
    from omegaconf import OmegaConf

    from hkrag.data.opendocvqa import QAExample, load_corpus
    from hkrag.retrieval.evaluation import RetrievalEvalConfig, evaluate_retrieval
    from hkrag.retriever import Phi3VRetriever
    from hkrag.tasks.common import prepare_data

    root = tmp_path / "syn"
    prepare_data(OmegaConf.create({"root": str(root), "synthetic": {
        "n_train": 8, "n_test": 4, "train_groups_per_style": 1, "test_groups_per_style": 1, "group_size": 2}}))
    pool = load_corpus(root / "corpus", "synchart", "test")
    qa = [QAExample("q1", "Query: chart", ("x",), (pool.doc_ids[0], "not-in-the-pool"), "salient")]
    cfg = RetrievalEvalConfig(str(root / "qa"), str(root / "corpus"), ["synchart"], pools=["single"])
    retriever = Phi3VRetriever.tiny(num_crops=4)
    with caplog.at_level("WARNING"):
        result = evaluate_retrieval(retriever, cfg, tmp_path / "work", {"model": "tiny"}, load_qa_fn=lambda *a: qa)
    assert "1 judged document(s) of 1 queries are absent from the corpus" in caplog.text
    assert result["results"]["synchart"]["single"]["all"]["recall@10"] == pytest.approx(0.5)
    assert "recall@5 (x100)" in result["table"] and "mrr@10 (x100)" in result["table"]


def test_run_dir_latest_is_the_newest_finished_training_run(tmp_path):
    from hkrag.tasks.common import FINAL_ADAPTER, resolve_run_dir

    with pytest.raises(FileNotFoundError, match="run_dir=latest: no finished train.py run under"):
        resolve_run_dir("latest", tmp_path)
    for stamp in ("2026-01-02_10-00-00", "2026-01-03_09-00-00"):
        (tmp_path / stamp / FINAL_ADAPTER).mkdir(parents=True)
    (tmp_path / "2026-01-04_08-00-00" / "checkpoints" / "step-1").mkdir(parents=True)  # still training
    assert resolve_run_dir("latest", tmp_path) == tmp_path / "2026-01-03_09-00-00"
    assert resolve_run_dir(tmp_path / "x", tmp_path) == tmp_path / "x"


def test_a_relative_run_dir_missing_here_is_looked_up_in_the_repository(tmp_path, monkeypatch):
    """The README's `run_dir=weights/reader_tiny` (and a `model.adapter` under weights/) works from any folder (the
    shipped weights); a folder of that name under the working directory wins; one found nowhere is refused naming
    both places looked; a hub id stays one."""
    from omegaconf import OmegaConf

    from hkrag.io import REPOSITORY
    from hkrag.tasks.common import local_adapter, resolve_run_dir, trained_model_config

    monkeypatch.chdir(tmp_path)
    assert REPOSITORY == ROOT
    assert resolve_run_dir("weights/reader_tiny") == ROOT / "weights" / "reader_tiny"
    assert trained_model_config(OmegaConf.create({"kind": "tiny"}), "weights/reader_tiny").adapter == str(
        ROOT / "weights" / "reader_tiny" / "checkpoints" / "final" / "adapter")
    adapter = "weights/reader_tiny/checkpoints/final/adapter"
    assert local_adapter(adapter) == str(ROOT / adapter)
    assert local_adapter("NTT-hil-insight/VDocRetriever-Phi3-vision") == "NTT-hil-insight/VDocRetriever-Phi3-vision"
    (tmp_path / "weights" / "reader_tiny").mkdir(parents=True)
    assert resolve_run_dir("weights/reader_tiny") == Path("weights/reader_tiny")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"run_dir='no/run': no such directory (looked in {tmp_path / 'no/run'} and {ROOT / 'no/run'})")):
        trained_model_config(OmegaConf.create({"kind": "tiny"}), "no/run")


def test_the_weights_folder_is_the_repositorys_from_any_working_folder(tmp_path, monkeypatch):
    """``paths.weights_dir`` (the `lvlm=` configs' weights, eval.py's default generator): HKRAG_WEIGHTS_DIR, else
    weights/ under the working folder, else the repository's; eval.py from another folder failed on
    `weights/generator_agents_w128/base` (read as a hub id) while its `run_dir=weights/reader_tiny` was found."""
    def weights_dir() -> tuple[str, str]:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("eval", [])
        return cfg.paths.weights_dir, cfg.lvlm.base

    monkeypatch.delenv("HKRAG_WEIGHTS_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    assert weights_dir()[0] == "weights"
    monkeypatch.chdir(tmp_path)
    found, base = weights_dir()
    assert found == str(ROOT / "weights") and Path(base).is_dir()
    (tmp_path / "weights").mkdir()
    assert weights_dir()[0] == "weights"
    monkeypatch.setenv("HKRAG_WEIGHTS_DIR", "/srv/weights")
    assert weights_dir()[0] == "/srv/weights"


def test_evaluation_saves_queries_and_qrels_for_the_storage_budget(tmp_path):
    import json

    from hkrag.index.shards import load_shards
    from hkrag.retrieval import budget
    from hkrag.retrieval.evaluation import QRELS_FILE, QUERIES_DIR

    data = [f"paths.data_dir={tmp_path / 'data'}", *SMALL_DATA]
    cfg = config("eval", [*data, f"paths.output_dir={tmp_path / 'eval'}", "model=tiny", "eval.doc_batch_size=16"])
    results = run_evaluation(cfg, tmp_path / "eval")["results"]
    query_ids, _ = load_shards(tmp_path / "eval" / QUERIES_DIR)
    qa = [ex for ds in cfg.eval.datasets for ex in load_qa(cfg.data.qa_source, ds, "test")]
    assert query_ids == [ex.query_id for ex in qa]
    assert json.loads((tmp_path / "eval" / QRELS_FILE).read_text()) == {
        ex.query_id: dict.fromkeys(ex.relevant_doc_ids, 1) for ex in qa}

    run = tmp_path / "eval"
    budget.main(["--shards", str(run / "embeddings-all"), "--queries", str(run / QUERIES_DIR),
                 "--qrels", str(run / QRELS_FILE), "--specs", "flat", "--out", str(tmp_path / "b")])
    (flat,) = json.loads((tmp_path / "b" / "budget.json").read_text())
    by_dataset = [results[ds]["all"] for ds in cfg.eval.datasets]  # the all pool, query-weighted
    expected = sum(r["all"]["ndcg@5"] * r["num_queries"] for r in by_dataset) / len(qa)
    assert flat["ndcg@5"] == pytest.approx(expected, abs=1e-4)


def test_eval_every_logs_a_learning_curve_ending_at_the_final_evaluation(tmp_path):
    import json

    from hkrag.retrieval.evaluation import PER_QUERY_FILE

    run = tmp_path / "run"
    cfg = config("train", [
        f"paths.data_dir={tmp_path / 'data'}", *SMALL_DATA, f"paths.output_dir={run}", "model.num_crops=4",
        "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.save_every=null", "trainer.eval_every=2",
        "eval.doc_batch_size=16",
    ])
    report = run_training(cfg, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {row["step"]: row for row in rows if any(key.startswith("curve/") for key in row)}
    assert sorted(curve) == [2, 4]
    assert curve[4]["curve/synchart/single/all/ndcg@5"] == pytest.approx(report["after"]["synchart"]["single"]["all"]
                                                                         ["ndcg@5"])
    assert json.loads((run / "eval-step-4" / PER_QUERY_FILE).read_text()) == \
        json.loads((run / "eval-after" / PER_QUERY_FILE).read_text())  # the last point is the final model
    assert not list(run.glob("eval-step-*/embeddings-*")) and (run / "eval-step-2" / "retrieval.md").is_file()
    cfg.eval_before_after = False
    with pytest.raises(ValueError, match="trainer.eval_every needs the evaluation"):
        run_training(cfg, tmp_path / "no-eval")
