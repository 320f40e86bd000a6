"""Storage-budget sweep on planted data: flat costs most and scores best; the plot is written."""

import json

import numpy as np
import pytest

from hkrag.index import budget
from hkrag.index.shards import encode_corpus

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
