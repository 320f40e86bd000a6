"""``python -m hkrag.tasks.encode`` under the late-interaction head: multi-vector shards that resume, refuse the
other head's folder, and that ``eval.py task=retrieval`` reads instead of encoding the pages again, with the figures
of an evaluation computed in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_experiment import config
from torch.nn.utils.rnn import pad_sequence

from hkrag.data.opendocvqa import load_corpus, load_qa, pools
from hkrag.index.shards import ShardError, load_multi_vector_shards, read_manifest
from hkrag.late_interaction import maxsim_mean
from hkrag.retrieval.evaluation import per_query_scores
from hkrag.retriever import Phi3VRetriever
from hkrag.tasks import encode
from hkrag.tasks.common import build_retriever, evaluated_model, prepare_data
from hkrag.tasks.retrieval import run_retrieval_evaluation

DATASETS = ["synchart", "syninfo"]
SMALL_DATA = [
    "data.synthetic.n_train=8", "data.synthetic.n_test=16", "data.synthetic.train_groups_per_style=1",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2",
    f"data.eval_datasets=[{','.join(DATASETS)}]",
]
LATE = ["model=tiny", "model.num_crops=4", "model.head=late_interaction", "model.late_interaction.dim=16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """Overrides naming the small synthetic corpus (generated once): 10 test pages, so 3 shards of 4 pages."""
    overrides = [f"paths.data_dir={tmp_path_factory.mktemp('encode') / 'data'}", *SMALL_DATA, "eval.shard_size=4"]
    prepare_data(config("eval", overrides).data)
    return overrides


class Killed(RuntimeError):
    pass


@pytest.fixture
def page_batches(monkeypatch) -> list[int]:
    """Every ``encode_documents`` call's page count, recorded (the pages a run encodes)."""
    calls: list[int] = []
    original = Phi3VRetriever.encode_documents

    def counted(self, images, *args, **kwargs):
        calls.append(len(images))
        return original(self, images, *args, **kwargs)

    monkeypatch.setattr(Phi3VRetriever, "encode_documents", counted)
    return calls


def kill_after_one_shard(monkeypatch, folder: Path) -> None:
    """The encoder raises :class:`Killed` once ``folder``'s first shard is written (a job killed mid-encode)."""
    original = Phi3VRetriever.encode_documents

    def killed(self, images, *args, **kwargs):
        if (folder / "shard-00000.json").is_file():
            raise Killed(f"the job is killed while encoding its second shard into {folder}")
        return original(self, images, *args, **kwargs)

    monkeypatch.setattr(Phi3VRetriever, "encode_documents", killed)


def test_a_killed_late_interaction_encode_resumes_to_the_same_vectors(data, tmp_path, monkeypatch):
    cfg = encode.load_config([*data, *LATE])
    assert encode.encode_part(cfg, "all", tmp_path / "clean") == [0, 1, 2]
    kill_after_one_shard(monkeypatch, tmp_path / "killed")
    with pytest.raises(Killed):
        encode.encode_part(cfg, "all", tmp_path / "killed")
    monkeypatch.undo()
    assert encode.encode_part(cfg, "all", tmp_path / "killed") == [1, 2]  # the finished shard is kept
    assert encode.encode_part(cfg, "all", tmp_path / "killed") == []
    manifest = read_manifest(tmp_path / "killed")
    assert manifest["layout"] == "multi_vector" and manifest["dim"] == 16 and manifest["count"] == 10
    clean, resumed = load_multi_vector_shards(tmp_path / "clean"), load_multi_vector_shards(tmp_path / "killed")
    assert resumed[0] == clean[0] and len(resumed[2]) == 11
    for one, other in zip(clean[1:], resumed[1:], strict=True):
        np.testing.assert_array_equal(other, one)


def test_encode_refuses_a_folder_of_the_other_head(data, tmp_path, monkeypatch):
    """A dense job killed after its first shard, then the late-interaction job into its folder (and back)."""
    dense = encode.load_config([*data, "model=tiny", "model.num_crops=4"])
    kill_after_one_shard(monkeypatch, tmp_path / "dense")
    with pytest.raises(Killed):
        encode.encode_part(dense, "all", tmp_path / "dense")
    monkeypatch.undo()
    with pytest.raises(ShardError, match=rf"{tmp_path / 'dense'} holds dense embeddings, not the multi-vector ones"):
        encode.encode_part(encode.load_config([*data, *LATE]), "all", tmp_path / "dense")
    assert not list((tmp_path / "dense").glob("*.offsets.npy"))
    encode.encode_part(encode.load_config([*data, *LATE]), "all", tmp_path / "late")
    with pytest.raises(ShardError, match="late holds multi-vector embeddings, not the dense ones asked for"):
        encode.encode_part(dense, "all", tmp_path / "late")  # every shard finished: refused all the same


def test_eval_reads_the_encoded_shards_and_equals_an_evaluation_in_memory(data, tmp_path, monkeypatch, page_batches):
    """The Slurm encoding's command line into a run folder, then eval.py task=retrieval there: no page is encoded
    again (the single pools come from the union pool's shards), and every score and nDCG@5 is that of MaxSim over
    the pages and queries encoded in memory."""
    run = tmp_path / "run"
    monkeypatch.setenv("HKRAG_RUN_DIR", str(run))
    encode.main(["--corpus", "all", *data, *LATE])
    assert sum(page_batches) == 10 and read_manifest(run / "embeddings-all")["layout"] == "multi_vector"
    page_batches.clear()
    cfg = config("eval", [*data, *LATE, f"paths.output_dir={run}"])
    result = run_retrieval_evaluation(cfg, run)
    assert page_batches == []  # read from the shards
    assert sorted(p.name for p in run.glob("embeddings-*")) == ["embeddings-all"]

    retriever = build_retriever(evaluated_model(cfg)[0], trainable=False).eval()
    for dataset in DATASETS:
        qa = load_qa(cfg.data.qa_source, dataset, "test")
        with torch.no_grad():
            queries = retriever.encode_queries([ex.query for ex in qa])
        for pool, corpus_config in pools(dataset).items():
            corpus = load_corpus(cfg.data.corpus_source, corpus_config, "test")
            with torch.no_grad():
                pages = retriever.encode_documents([page.image for page in corpus], batch_size=len(corpus))
            scores = maxsim_mean(pad_sequence(queries, batch_first=True), pad_sequence(pages, batch_first=True))
            in_memory = {ex.query_id: dict(zip(corpus.doc_ids, row.tolist(), strict=True))
                         for ex, row in zip(qa, scores, strict=True)}
            from_shards = result["runs"][dataset][pool]
            for query_id, ranked in from_shards.items():
                assert ranked == pytest.approx({d: in_memory[query_id][d] for d in ranked}, abs=1e-5)
            expected = {q: e["ndcg@5"] for q, e in per_query_scores(in_memory, qa).items()}
            got = {q: e["ndcg@5"] for q, e in result["per_query"][dataset][pool].items()}
            assert got == pytest.approx(expected), (dataset, pool)
            assert result["results"][dataset][pool]["all"]["ndcg@5"] == pytest.approx(np.mean(list(expected.values())))
    assert "| Method | synchart Single | synchart All | syninfo Single | syninfo All |" in result["table"]


def test_eval_searches_the_shards_with_a_multi_vector_index(data, tmp_path, page_batches):
    """eval.index="multivector:<spec>" builds hkrag.index.multivector's index from the same shards: SQ8 codes with
    every page re-ranked by exact MaxSim over the float16 vectors gives exact MaxSim's scores to float16's precision;
    a setting it cannot use fails before any page is encoded, naming eval.index."""
    run = tmp_path / "run"
    encode.encode_part(encode.load_config([*data, *LATE]), "all", run / "embeddings-all")
    page_batches.clear()
    evaluations = {index: run_retrieval_evaluation(config("eval", [
        *data, *LATE, f"paths.output_dir={run}", f"eval.index='{index}'"]), run) for index in (
        "flat", "multivector:codec=SQ8;rerank=10")}
    assert page_batches == []
    exact, compressed = evaluations.values()
    for dataset in DATASETS:
        for pool in ("single", "all"):
            for query_id, ranked in exact["runs"][dataset][pool].items():
                assert compressed["runs"][dataset][pool][query_id] == pytest.approx(ranked, abs=2e-3)
    refusals = {"sq8": r"the late-interaction head is searched by exact MaxSim \(eval.index=flat\) or a multi-vector",
                "multivector:codec=SQ8;bogus=1": "bad multi-vector index setting 'bogus=1'"}
    for index, message in refusals.items():
        with pytest.raises(ValueError, match=rf"eval.index='{index}': {message}"):
            run_retrieval_evaluation(config("eval", [*data, *LATE, f"paths.output_dir={run}",
                                                     f"eval.index='{index}'"]), tmp_path / "bad")
    assert page_batches == []


def test_eval_in_a_folder_of_dense_shards_refuses_the_late_interaction_head(data, tmp_path):
    run = tmp_path / "run"
    encode.encode_part(encode.load_config([*data, "model=tiny", "model.num_crops=4"]), "all", run / "embeddings-all")
    with pytest.raises(ShardError, match=r"embeddings-all holds embeddings of a different run \(.*layout: on disk "
                                         r"None vs now 'multi_vector'\)"):
        run_retrieval_evaluation(config("eval", [*data, *LATE, f"paths.output_dir={run}"]), run)


def test_encode_needs_an_output_folder(monkeypatch, capsys):
    monkeypatch.delenv("HKRAG_RUN_DIR", raising=False)
    with pytest.raises(SystemExit):
        encode.main(["--corpus", "all"])
    assert "give --out or set HKRAG_RUN_DIR" in capsys.readouterr().err
