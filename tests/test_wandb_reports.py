"""Reports in W&B (``hkrag/run_log.py``): each task's Table 2/3/5/6 layouts and per-query rows as tables, its figures
as images and its report files as an artifact, read back from the offline run (``WANDB_MODE=offline``, no network)
and compared with the local ``report.json`` / ``retrieval.json`` / ``rag.json`` / ``ablation.json``.

The offline run is read from its files: the history rows of the run's ``.wandb`` log (the LevelDB-style record
log wandb writes, parsed with wandb's own protobuf records) name each table's and image's file under ``files/``,
and its artifact records list each file with its MD5.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _eval_config import tiny_eval_config
from hydra import compose, initialize_config_dir
from test_ablation import multirun  # noqa: F401  (fixture)
from test_rag_task import GoldBackend, backends, config, data, gold_answers, run  # noqa: F401  (fixtures)
from test_table6 import ALL_STEPS, synthetic_rows

from hkrag.retrieval.ablation import aggregate
from hkrag.retrieval.evaluation import AFTER_TRAINING_DIR, BEFORE_TRAINING_DIR, PER_QUERY_FILE, TABLE_METRICS
from hkrag.run_log import RunLogger
from hkrag.tasks import replica
from hkrag.tasks.retrieval import run_retrieval_evaluation
from hkrag.tasks.table6 import summarize
from hkrag.tasks.training import run_training

ROOT = Path(__file__).resolve().parents[1]
BLOCK, HEADER = 32768, 7
"""The ``.wandb`` log's block size and its file / record header sizes (both 7 bytes)."""
FULL, FIRST, LAST = 1, 2, 4
LOG_WAIT_S = 30


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B in offline mode, its settings, cache and artifact staging under ``tmp_path``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))


def log_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` log: 32 KiB blocks of chunks (checksum, length, type), a record being one FULL
    chunk or FIRST … LAST; a block's tail shorter than a chunk header is padding."""
    log, position, records, pending = path.read_bytes(), HEADER, [], b""
    assert log[:4] == b":W&B", f"{path} is not a W&B run log"
    while position + HEADER <= len(log):
        if BLOCK - position % BLOCK < HEADER:
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", log[position:position + HEADER])
        chunk = log[position + HEADER:position + HEADER + length]
        position += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            records.append(pending)
    return records


def run_records(path: Path) -> list[Any]:
    """The log's records as wandb's protobuf ``Record`` messages; none while a record is only partly written (wandb's
    service writes the log after ``finish()`` returns: a torn record does not parse yet)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    records = []
    for serialized in log_records(path):
        records.append(wandb_internal_pb2.Record())
        try:
            records[-1].ParseFromString(serialized)
        except DecodeError:
            return []
    return records


@dataclass
class OfflineRun:
    """What an offline run holds: its history values (the latest per key) and its report artifacts' files."""

    files: Path
    history: dict[str, Any]
    artifacts: dict[str, dict[str, str]]
    """``name`` (without the run id) -> ``{path: MD5 in base64}`` of the artifacts of type ``report``."""

    @classmethod
    def read(cls, directory: Path) -> OfflineRun:
        """The one offline run under ``directory/wandb``, once its log is complete (wandb's service may still be
        writing it when ``finish()`` returns; the ``exit`` record comes last)."""
        found = list((directory / "wandb").glob("offline-run-*"))
        assert len(found) == 1, found
        deadline = time.monotonic() + LOG_WAIT_S
        records = run_records(next(found[0].glob("*.wandb")))
        while not records or records[-1].WhichOneof("record_type") != "exit":
            assert time.monotonic() < deadline, f"{found[0]}: no exit record after {LOG_WAIT_S} s"
            time.sleep(0.1)
            records = run_records(next(found[0].glob("*.wandb")))
        history, artifacts = {}, {}
        for record in records:
            if record.WhichOneof("record_type") == "history":
                history.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif record.WhichOneof("record_type") == "artifact" and record.artifact.type == "report":
                name = record.artifact.name.rsplit("-", 1)[0]
                artifacts[name] = {entry.path: entry.digest for entry in record.artifact.manifest.contents}
        return cls(found[0] / "files", history, artifacts)

    def table(self, key: str) -> dict[str, dict[str, Any]]:
        """The table logged as ``key``: ``{first cell: {column: value}}``."""
        assert self.history[f"{key}/_type"] == "table-file", key
        table = json.loads((self.files / self.history[f"{key}/path"]).read_text())
        return {row[0]: dict(zip(table["columns"], row)) for row in table["data"]}

    def rows(self, key: str) -> list[dict[str, Any]]:
        table = json.loads((self.files / self.history[f"{key}/path"]).read_text())
        return [dict(zip(table["columns"], row)) for row in table["data"]]

    def image(self, key: str) -> bytes:
        assert self.history[f"{key}/_type"] == "image-file", key
        return (self.files / self.history[f"{key}/path"]).read_bytes()


def md5(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def assert_artifact(run: OfflineRun, name: str, folder: Path, files: list[str]) -> None:
    """The artifact ``name`` holds exactly ``files`` of ``folder``, byte for byte."""
    assert run.artifacts[name] == {file: md5(folder / file) for file in files}


def assert_table_2(run: OfflineRun, key: str, results: dict[str, Any]) -> None:
    """The run's Table 2 of every metric ``retrieval.md`` shows (the tie-aware nDCG@5, then trec_eval's) under
    ``key/`` holds ``results`` (``retrieval.json``) x100: a row per evidence label, a cell per data set and pool
    (``None`` where a label has no query), each pool's average."""
    groups = [(f"{ds} {pool.capitalize()}", pool, r) for ds, by_pool in results.items() for pool, r in by_pool.items()]
    labels = dict.fromkeys(label for *_, r in groups for label in r if label != "num_queries")
    assert TABLE_METRICS[0] == "E[ndcg@5]"
    for metric in TABLE_METRICS:
        table = run.table(f"{key}/{metric}")
        assert list(table) == ["all queries", *sorted(set(labels) - {"all"})]
        for label in labels:
            cells = {column: 100 * r[label][metric] if label in r else None for column, _, r in groups}
            for pool in ("single", "all"):
                values = [cells[column] for column, p, _ in groups if p == pool]
                cells[f"Avg. {pool.capitalize()}"] = None if None in values else sum(values) / len(values)
            row = "all queries" if label == "all" else label
            assert table[row] == pytest.approx({"Method": row, **cells}, abs=1e-9), (key, metric, row)


def assert_per_query(run: OfflineRun, key: str, per_query_file: Path) -> None:
    """The per-query table holds ``per_query.json`` row for row."""
    expected = [{"dataset": ds, "pool": pool, "query_id": qid, **entry}
                for ds, by_pool in json.loads(per_query_file.read_text()).items()
                for pool, by_query in by_pool.items() for qid, entry in by_query.items()]
    assert run.rows(f"{key}/per_query") == expected


def test_training_report_tables_per_query_rows_and_files_equal_the_local_report(tmp_path, offline):
    tiny_data = [f"paths.data_dir={tmp_path / 'data'}", "data.synthetic.n_train=8", "data.synthetic.n_test=12",
                 "data.synthetic.train_groups_per_style=1", "data.synthetic.test_groups_per_style=1",
                 "+data.synthetic.group_size=3", "data.eval_datasets=[synchart,syninfo]"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", [*tiny_data, f"paths.output_dir={tmp_path / 'run'}", "model.num_crops=4",
                                "trainer.global_batch_size=4", "trainer.chunk_size=4", "trainer.max_steps=1",
                                "trainer.save_every=null", "eval.doc_batch_size=16"])
    out = tmp_path / "run"
    run_training(cfg, out)
    report = json.loads((out / "report.json").read_text())
    run = OfflineRun.read(out)

    for key, folder in (("before", BEFORE_TRAINING_DIR), ("after", AFTER_TRAINING_DIR)):
        assert_table_2(run, key, report[key])
        assert_per_query(run, key, out / folder / PER_QUERY_FILE)
    per_query = run.rows("after/per_query")
    synchart = [row["ndcg@5"] for row in per_query if (row["dataset"], row["pool"]) == ("synchart", "all")]
    assert sum(synchart) / len(synchart) == pytest.approx(report["after"]["synchart"]["all"]["all"]["ndcg@5"])
    assert_artifact(run, "training-report", out, ["report.json", "report.md", f"{BEFORE_TRAINING_DIR}/per_query.json",
                                                  f"{AFTER_TRAINING_DIR}/per_query.json"])
    assert run.history["loss"] > 0  # the trainer's scalars still land in the same run


def test_retrieval_task_logs_table_2_and_its_files(tmp_path, offline):
    out = tmp_path / "out"
    run_retrieval_evaluation(tiny_eval_config(tmp_path, "out", "task=retrieval", "retriever=bm25"), out)
    run = OfflineRun.read(out)
    assert_table_2(run, "retrieval", json.loads((out / "retrieval.json").read_text()))
    assert_per_query(run, "retrieval", out / PER_QUERY_FILE)
    assert_artifact(run, "retrieval-report", out, ["retrieval.json", "retrieval.md", PER_QUERY_FILE,
                                                   "environment.json"])


def test_rag_report_layouts_per_query_rows_and_files_equal_rag_json(tmp_path, data, backends, offline):  # noqa: F811
    cfg = config(data)
    answers = gold_answers(cfg)
    failing = next(iter(answers))
    out = tmp_path / "run"
    run(cfg, out, lambda: GoldBackend(answers, fail=failing), backends)
    report = json.loads((out / "rag.json").read_text())
    wandb_run = OfflineRun.read(out)

    assert "rag/accuracy/path" not in wandb_run.history  # not judged: no judged-accuracy layout, as in rag.md
    for metric in ("relaxed_accuracy", "relaxed_correctness", "anls"):
        row = wandb_run.table(f"rag/{metric}")[report["config"]]
        values = [100 * report["results"][ds]["gold"]["metrics"][metric] for ds in ("synchart", "syninfo")]
        assert row == pytest.approx({"Method": report["config"], "synchart Gold": values[0],
                                     "syninfo Gold": values[1], "Avg. Gold": sum(values) / 2})
    queries = wandb_run.rows("rag/per_query")
    assert [(q["dataset"], q["failed"]) for q in queries] == [("synchart", True), *[("synchart", False)] * 2,
                                                              *[("syninfo", False)] * 3]
    for dataset in ("synchart", "syninfo"):
        matches = [q["exact_match"] for q in queries if q["dataset"] == dataset]
        assert sum(matches) / len(matches) == pytest.approx(
            report["results"][dataset]["gold"]["metrics"]["exact_match"])
    assert queries[0]["question"] == failing and queries[0]["correct"] is None and queries[0]["route"] == "failed"
    assert_artifact(wandb_run, "rag-report", out, ["rag.json", "rag.md", "rag.html", "trace.jsonl"])


def test_ablation_and_replica_get_runs_of_their_own(tmp_path, multirun, offline):  # noqa: F811
    out = tmp_path / "ablation"
    summary = aggregate(multirun, out)
    local = json.loads((out / "ablation.json").read_text())
    run = OfflineRun.read(out)
    tables = {}
    for pool in ("single", "all"):
        scores = tables[pool] = run.table(f"ablation/{pool}/ndcg@5")
        assert list(scores) == local["conditions"] == ["infonce", "hkrag", "no_sin"]
        for condition, row in scores.items():
            for label in local["evidence"]:
                cell = local["ndcg@5"][pool][label][condition]
                assert (row[f"{label} mean"], row[f"{label} std"]) == pytest.approx((100 * cell["mean"],
                                                                                     100 * cell["std"]))
        differences = run.table(f"ablation/{pool}/vs_baseline")
        assert differences["hkrag"]["fine_print diff"] == pytest.approx(
            100 * local["vs_baseline"][pool]["fine_print"]["hkrag"]["diff"])
        assert differences["no_sin"]["all p_value"] == local["vs_baseline"][pool]["all"]["no_sin"]["p_value"]
    verdicts = run.rows("ablation/verdicts")
    assert len(verdicts) == len(local["verdicts"]) == 8  # four claims on these losses, two pools
    assert [(v["better"], v["worse"], v["pool"], v["verdict"]) for v in verdicts] == [
        (v["better"], v["worse"], v["pool"], v["verdict"]) for v in local["verdicts"]]
    assert run.image("ablation/plot") == (out / "ablation.png").read_bytes()
    assert_artifact(run, "ablation-report", out, ["ablation.json", "ablation.md", "ablation.png",
                                                  "ablation_per_query.jsonl"])

    folder = tmp_path / "replica"
    (folder / "table6").mkdir(parents=True)
    for plot in ("table5.png", "table6/sweep.png"):
        shutil.copy(out / "ablation.png", folder / plot)
    for file in ("replica.json", "replica.md", replica.TIMINGS_FILE):
        (folder / file).write_text("{}")
    table6 = summarize(synthetic_rows({"single_pass": 0.2, "no_pruner": 0.5, "no_decoupler": 0.35, "hkrag": 0.8}),
                       {seed: ALL_STEPS for seed in range(3)})
    replica.log_report(folder, {"settings": {"seeds": [0, 1]}, "tables": {"table5": summary}, "table6": table6})
    run = OfflineRun.read(folder)
    assert {pool: run.table(f"table5/{pool}/ndcg@5") for pool in tables} == tables
    rows, gold = run.table("table6/gold"), table6["sets"]["gold"]
    assert list(rows) == list(gold["generators"])
    assert rows["hkrag"]["score"] == pytest.approx(100 * gold["generators"]["hkrag"]["score"]["mean"])
    assert rows["hkrag"]["lvlm_calls"] == pytest.approx(gold["generators"]["hkrag"]["cost"]["lvlm_calls"])
    assert [(v["better"], round(v["diff"], 9), v["verdict"], v["corrected_verdict"])
            for v in run.rows("table6/gold/verdicts")] == [
        (v["better"], round(100 * v["diff"], 9), v["verdict"], v["corrected_verdict"]) for v in gold["claims"]]
    assert len(gold["claims"]) == 5
    assert run.image("table6/sweep") == (folder / "table6/sweep.png").read_bytes()
    assert_artifact(run, "replica-report", folder, ["replica.json", "replica.md", replica.TIMINGS_FILE, "table5.png",
                                                    "table6/sweep.png"])


def test_without_wandb_or_off_the_main_rank_nothing_is_logged(tmp_path, multirun, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "disabled")
    aggregate(multirun, tmp_path / "disabled")
    assert (tmp_path / "disabled" / "ablation.md").is_file() and not (tmp_path / "disabled" / "wandb").exists()
    quiet = RunLogger(tmp_path / "rank1", wandb_mode="offline", enabled=False)
    quiet.table("t", ["a"], [[1]])
    quiet.image("i", tmp_path / "disabled" / "ablation.png")
    quiet.artifact("a", "report", tmp_path / "disabled", ["ablation.md"])
    quiet.finish()
    assert not (tmp_path / "rank1").exists()
