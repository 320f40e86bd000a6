"""Storage-budget sweep on planted data: flat costs most and scores best; the plot is written."""

import json

import numpy as np
import pytest

from hkrag.index.shards import encode_corpus
from hkrag.retrieval import budget

DIM = 32
SPECS = ["flat", "fp16", "sq8", "ivfpq:nlist=8,m=4,nbits=4,nprobe=2"]


@pytest.fixture(scope="module")
def planted():
    """Documents in 20 clusters; each query is a noisy copy of one document, which is its relevant one."""
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((20, DIM))
    docs = centers[rng.integers(20, size=400)] + 0.6 * rng.standard_normal((400, DIM))
    docs = (docs / np.linalg.norm(docs, axis=1, keepdims=True)).astype(np.float32)
    targets = rng.choice(400, size=60, replace=False)
    queries = docs[targets] + 0.05 * rng.standard_normal((60, DIM)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    doc_ids = [f"d{i}" for i in range(400)]
    query_ids = [f"q{i}" for i in range(60)]
    qrels = {q: {doc_ids[t]: 1} for q, t in zip(query_ids, targets, strict=True)}
    return docs, doc_ids, queries, query_ids, qrels


def test_flat_has_most_bytes_and_best_ndcg(planted, tmp_path):
    rows = budget.sweep(*planted, SPECS)
    by_kind = {r["spec"].split(":")[0]: r for r in rows}
    flat = by_kind["flat"]
    assert flat["bytes_per_doc"] == max(r["bytes_per_doc"] for r in rows)
    assert flat["bytes_per_doc"] == pytest.approx(DIM * 4, rel=0.05)
    assert by_kind["sq8"]["bytes_per_doc"] < by_kind["fp16"]["bytes_per_doc"] < flat["bytes_per_doc"]
    assert all(flat["ndcg@5"] >= r["ndcg@5"] for r in rows)
    assert flat["ndcg@5"] > 0.95
    png = budget.plot(rows, tmp_path / "budget.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert budget.to_markdown(rows).splitlines()[0].startswith("| index | bytes/doc | build s | ndcg@5 |")
    assert min(rows, key=lambda r: r["bytes_per_doc"])["pareto"]
    assert flat["pareto"] == all(r["ndcg@5"] < flat["ndcg@5"] for r in rows if r is not flat)
    assert budget.to_markdown(rows).splitlines()[0].endswith("| Pareto |")


def test_pareto_frontier_on_a_hand_built_case():
    rows = [
        {"spec": "flat", "bytes_per_doc": 128, "ndcg@5": 0.90},
        {"spec": "fp16", "bytes_per_doc": 64, "ndcg@5": 0.90},  # as good, half the bytes: flat is dominated
        {"spec": "sq8", "bytes_per_doc": 32, "ndcg@5": 0.85},
        {"spec": "pq", "bytes_per_doc": 40, "ndcg@5": 0.80},  # bigger and worse than sq8
        {"spec": "binary", "bytes_per_doc": 4, "ndcg@5": 0.50},
        {"spec": "binary-copy", "bytes_per_doc": 4, "ndcg@5": 0.50},  # exact ties both stay on the frontier
    ]
    assert budget.pareto_frontier(rows) == [False, True, True, False, True, True]
    assert budget.to_markdown([r | {"build_s": 0.0} for r in rows]).splitlines()[4].endswith("| 85.0 | yes |")


def test_binary_codes_hamming_and_rerank():
    docs = np.array(
        [[1, 1, -1, -1, 1, 1, 1, 1], [1, -1, -1, -1, 1, 1, 1, 1], [-1, -1, 1, 1, -1, -1, -1, -1]], np.float32
    )
    query = np.array([[0.9, 0.1, -0.1, -1, 1, 1, 1, 1]], np.float32)  # signs equal doc 0's: Hamming 0, 1, 8
    index = budget.SignIndex(["a", "b", "c"], docs)
    scores, rows = index.search_arrays(query, 3)
    assert rows.tolist() == [[0, 1, 2]] and scores.tolist() == [[0, -1, -8]]
    assert index.nbytes() < 3 * 8 * 4 and index.spec == "binary"
    reranked = budget.SignIndex(["a", "b", "c"], docs, rerank=3)
    scores, rows = reranked.search_arrays(query, 2)
    assert rows.tolist() == [[0, 1]]
    np.testing.assert_allclose(scores, [[query[0] @ docs[0], query[0] @ docs[1]]], rtol=1e-6)  # 6.9, 6.7
    assert budget.SignIndex.parse("binary:rerank=10") == 10 and budget.SignIndex.parse("sq8") is None
    with pytest.raises(ValueError, match="bad binary option 'x=1'"):
        budget.SignIndex.parse("binary:x=1")
    with pytest.raises(ValueError, match="divisible by 8, got 12"):
        budget.SignIndex(["a"], np.ones((1, 12), np.float32))


def test_pca_and_binary_specs_in_the_sweep(planted):
    rows = budget.sweep(*planted, ["flat", "faiss:PCA16,Flat", "binary", "binary:rerank=8"])
    by_spec = {r["spec"]: r for r in rows}
    assert by_spec["binary"]["bytes_per_doc"] == pytest.approx(DIM / 8, rel=0.1)
    assert by_spec["binary:rerank=8"]["bytes_per_doc"] == by_spec["binary"]["bytes_per_doc"]
    assert by_spec["faiss:PCA16,Flat"]["bytes_per_doc"] < by_spec["flat"]["bytes_per_doc"] / 1.5
    assert by_spec["binary:rerank=8"]["ndcg@5"] >= by_spec["binary"]["ndcg@5"]


def test_cli_from_shard_directories(planted, tmp_path):
    docs, doc_ids, queries, query_ids, qrels = planted
    manifest = {"model": "tiny", "config_hash": "h"}
    encode_corpus(
        [{"doc_id": i} for i in doc_ids],
        lambda rows: docs[[int(r["doc_id"][1:]) for r in rows]],
        tmp_path / "docs",
        shard_size=128,
        manifest=manifest,
        dtype="float32",
        progress=False,
    )
    encode_corpus(
        [{"query_id": q} for q in query_ids],
        lambda rows: queries[[int(r["query_id"][1:]) for r in rows]],
        tmp_path / "queries",
        shard_size=128,
        manifest=manifest,
        dtype="float32",
        id_key="query_id",
        progress=False,
    )
    (tmp_path / "qrels.json").write_text(json.dumps(qrels))
    budget.main(
        [
            "--shards",
            str(tmp_path / "docs"),
            "--queries",
            str(tmp_path / "queries"),
            "--qrels",
            str(tmp_path / "qrels.json"),
            "--specs",
            "flat",
            "sq8",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    rows = json.loads((tmp_path / "out" / "budget.json").read_text())
    assert [r["spec"] for r in rows] == ["flat", "sq8"]
    assert (tmp_path / "out" / "budget.png").stat().st_size > 0
    assert (tmp_path / "out" / "budget.md").read_text().count("\n") == 4


def test_default_specs_that_do_not_fit_small_embeddings_are_dropped():
    from hkrag.retrieval.budget import DEFAULT_SPECS, fitting_defaults

    assert fitting_defaults(3072, 10_000) == list(DEFAULT_SPECS)
    assert fitting_defaults(64, 120) == ["flat", "fp16", "sq8", "binary", "binary:rerank=10"]  # the tiny demo's
    assert "faiss:PCA128,SQ8" in fitting_defaults(256, 300) and "faiss:PCA256,SQ8" not in fitting_defaults(256, 300)
