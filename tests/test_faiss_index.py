"""DocumentIndex: exact search, compressed kinds, -1 handling, errors, save/load."""

import logging
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from hkrag.index.faiss_index import DocumentIndex, gpu_count
from hkrag.index.mmap import mapped_refine_store
from hkrag.index.spec import IndexSpec

FAST_PQ = "ivfpq:nlist=4,m=4,nbits=4,nprobe=4"


def unit(n, dim=16, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def docs():
    return [f"d{i}" for i in range(300)], unit(300)


def test_spec_parsing_round_trip():
    spec = IndexSpec.parse("ivfpq:nlist=64,m=8,nbits=6,nprobe=4")
    assert (spec.kind, spec.nlist, spec.m, spec.nbits, spec.nprobe) == ("ivfpq", 64, 8, 6, 4)
    assert IndexSpec.parse(str(spec)) == spec
    assert IndexSpec.parse(" SQ8 ").factory_string() == "SQ8"
    with pytest.raises(ValueError, match="unknown index kind 'hnsw'"):
        IndexSpec.parse("hnsw")
    with pytest.raises(ValueError, match="bad index parameter 'efs=3'"):
        IndexSpec.parse("ivfpq:efs=3")


def test_flat_is_exact_inner_product(docs):
    ids, x = docs
    index = DocumentIndex.build(ids, x)
    queries = unit(7, seed=1)
    scores, found = index.search(queries, 5)
    expected = np.argsort(-(queries @ x.T), axis=1)[:, :5]
    assert found == [[ids[j] for j in row] for row in expected]
    np.testing.assert_allclose(np.stack(scores), np.sort(queries @ x.T, axis=1)[:, ::-1][:, :5], rtol=1e-5)


def test_factory_pca_ranks_and_scores_by_inner_product_on_off_centre_data():
    rng = np.random.default_rng(0)  # vectors leaning one way, as retriever embeddings do
    x = rng.standard_normal((400, 16)).astype(np.float32) * 0.3 + 1.0
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    queries = x[:20] + 0.05 * rng.standard_normal((20, 16)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = [f"d{i}" for i in range(400)]
    index = DocumentIndex.build(ids, x, "faiss:PCA16,Flat")  # a full-rank PCA: a rotation after centring
    scores, found = index.search(queries, 5)
    exact = queries @ x.T
    assert found == [[ids[j] for j in row] for row in np.argsort(-exact, axis=1)[:, :5]]
    np.testing.assert_allclose(np.stack(scores), np.sort(exact, axis=1)[:, ::-1][:, :5], atol=1e-4)


def test_cpu_placement_is_logged(docs, caplog):
    with caplog.at_level(logging.INFO, logger="hkrag.index.faiss_index"):
        index = DocumentIndex.build(*docs, use_gpu=False)
    assert not index.on_gpu
    assert "flat index on CPU (disabled by use_gpu=False)" in caplog.text


@pytest.mark.skipif(gpu_count() > 0, reason="checks the CPU-only fallback")
def test_gpu_absent_is_logged_or_refused(docs, caplog):
    with caplog.at_level(logging.INFO, logger="hkrag.index.faiss_index"):
        DocumentIndex.build(*docs)
    assert "flat index on CPU (FAISS has no GPU support or sees no GPU)" in caplog.text
    with pytest.raises(RuntimeError, match="use_gpu=True but FAISS has no GPU support"):
        DocumentIndex.build(*docs, use_gpu=True)


@pytest.mark.parametrize("spec", ["sq8", "fp16", FAST_PQ])
def test_compressed_kinds_find_the_query_document(docs, spec):
    ids, x = docs
    index = DocumentIndex.build(ids, x, spec)
    _, found = index.search(x[:20], 10)
    assert np.mean([ids[i] in f for i, f in enumerate(found)]) >= 0.9
    assert index.nbytes() < DocumentIndex.build(ids, x).nbytes()


def test_k_beyond_corpus_never_invents_documents():
    ids, x = ["a", "b", "c"], unit(3)
    scores, found = DocumentIndex.build(ids, x).search(x, 10)
    assert [sorted(f) for f in found] == [["a", "b", "c"]] * 3
    assert all(len(s) == 3 for s in scores)


def test_minus_one_slots_are_dropped_not_mapped_to_the_last_document(docs):
    ids, x = docs
    index = DocumentIndex.build(ids, x, "ivfpq:nlist=16,m=4,nbits=4,nprobe=1")
    scores, rows = index.search_arrays(x[:50], 200)
    assert (rows == -1).any(), "one probed list of ~19 docs cannot fill k=200"
    got_scores, found = index.search(x[:50], 200)
    for raw, s, f in zip(rows, got_scores, found, strict=True):
        assert f == [ids[r] for r in raw if r >= 0] and len(s) == len(f)
    assert sum(ids[-1] in f for f in found) < 50


def test_to_run_is_a_trec_run(docs):
    ids, x = docs
    run = DocumentIndex.build(ids, x).to_run(["q0", "q1"], x[:2], 3)
    assert list(run) == ["q0", "q1"] and run["q0"]["d0"] == pytest.approx(1.0)
    assert all(len(docs) == 3 and all(isinstance(v, float) for v in docs.values()) for docs in run.values())
    with pytest.raises(ValueError, match="1 query ids for 2 query vectors"):
        DocumentIndex.build(ids, x).to_run(["q0"], x[:2], 3)


def test_errors_are_clear(docs):
    ids, x = docs
    with pytest.raises(ValueError, match="empty corpus"):
        DocumentIndex.build([], np.zeros((0, 16), np.float32))
    index = DocumentIndex.build(ids, x)
    with pytest.raises(ValueError, match="queries have dimension 8 but the index has 16"):
        index.search(unit(2, dim=8), 3)
    with pytest.raises(ValueError, match="k must be positive"):
        index.search(x[:1], 0)
    with pytest.raises(ValueError, match="duplicate document ids"):
        DocumentIndex.build(["a", "a"], unit(2))
    with pytest.raises(ValueError, match="m=5 must divide the vector dimension 16"):
        DocumentIndex.build(ids, x, "ivfpq:m=5")
    with pytest.raises(ValueError, match="fewer than the 256 centroids"):
        DocumentIndex.build(ids[:200], x[:200], "ivfpq:nlist=2,m=4,nbits=8")
    with pytest.raises(RuntimeError, match="must be trained before adding"):
        DocumentIndex(16, "sq8").add(["a"], unit(1))
    with pytest.raises(ValueError, match="nprobe only applies to ivfpq"):
        index.nprobe = 4
    with pytest.raises(ValueError, match="index is empty"):
        DocumentIndex(16).search(x[:1], 1)


@pytest.mark.parametrize("spec", ["flat", "sq8", FAST_PQ])
def test_save_load_round_trip(docs, tmp_path, spec):
    ids, x = docs
    index = DocumentIndex.build(ids, x, spec)
    if index.spec.kind == "ivfpq":
        index.nprobe = 2
    loaded = DocumentIndex.load(index.save(tmp_path), use_gpu=False)
    assert loaded.spec == index.spec and loaded.ids == ids
    a, b = index.search(x[:10], 5), loaded.search(x[:10], 5)
    assert a[1] == b[1]
    np.testing.assert_array_equal(np.stack(a[0]), np.stack(b[0]))


def test_nbytes_counts_the_serialized_index(docs):
    index = DocumentIndex.build(*docs, "sq8")
    assert index.nbytes() == faiss.serialize_index(index.cpu_index()).nbytes
    assert index.mapped_bytes() == 0


def test_mmap_load_reranks_exactly_from_the_mapped_file(docs, tmp_path):
    ids, x = docs
    index = DocumentIndex.build(ids, x, "faiss:PCA8,IVF4,SQ8,Refine(Flat);nprobe=4,k_factor_rf=8", use_gpu=False)
    mapped = DocumentIndex.load(index.save(tmp_path), use_gpu=None, mmap=True)
    assert mapped.mapped_bytes() == len(ids) * 16 * 4  # the Refine(Flat) store stays on disk
    assert not mapped.on_gpu and DocumentIndex.load(tmp_path).mapped_bytes() == 0
    assert mapped_refine_store(mapped.faiss_index) is not None  # its candidates are prefetched
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(mapped.faiss_index).invlists)
    assert all(lists.codes.at(i).is_owned for i in range(lists.nlist))  # the IVF lists are read into memory
    assert mapped_refine_store(index.faiss_index) is None
    queries = unit(20, seed=3)
    a, b = index.search(queries, 5), mapped.search(queries, 5)
    assert a[1] == b[1]
    np.testing.assert_array_equal(np.stack(a[0]), np.stack(b[0]))
    exact_scores = [[q @ x[ids.index(d)] for d in row] for q, row in zip(queries, b[1], strict=True)]
    np.testing.assert_allclose(np.stack(b[0]), exact_scores, atol=1e-5)  # re-ranked by the exact vectors
    with pytest.raises(RuntimeError, match="memory-mapped from disk"):
        DocumentIndex.load(tmp_path, use_gpu=True, mmap=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_RANDOM and /proc/self/smaps are Linux's")
def test_mapped_store_has_no_read_ahead(docs, tmp_path):
    DocumentIndex.build(*docs, "faiss:IVF4,SQ8,Refine(Flat)", use_gpu=False).save(tmp_path)
    mapped = DocumentIndex.load(tmp_path, use_gpu=False, mmap=True)  # noqa: F841 - keeps the mapping alive
    path = str((tmp_path / "index.faiss").resolve())
    flags, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            current = line.endswith(path)
        elif current and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    # FAISS maps with MADV_RANDOM: a re-ranked 3072-d vector is one 12 KB read, not 128 KB of read-ahead
    # (3.7x slower cold here). A FAISS without the hint would make disk re-ranking slow: this test says so.
    assert flags and any("rr" in f for f in flags)


def test_mmap_load_reads_a_graph_base_into_memory(docs, tmp_path):
    """An HNSW base's links and codes are read into memory; only the refine store stays mapped (cold graph walks
    were one page fault a hop)."""
    ids, x = docs
    index = DocumentIndex.build(ids, x, "faiss:HNSW8,SQ8,Refine(Flat);efSearch=16,k_factor_rf=4", use_gpu=False)
    mapped = DocumentIndex.load(index.save(tmp_path), use_gpu=False, mmap=True)
    refine = faiss.downcast_index(mapped.faiss_index)
    graph = faiss.downcast_index(refine.base_index)
    assert graph.hnsw.neighbors.is_owned and faiss.downcast_index(graph.storage).codes.is_owned
    assert mapped.mapped_bytes() == len(ids) * 16 * 4 == faiss.downcast_index(refine.refine_index).codes.size()
    queries = unit(20, seed=3)
    a, b = index.search(queries, 5), mapped.search(queries, 5)
    assert a[1] == b[1]
    np.testing.assert_array_equal(np.stack(a[0]), np.stack(b[0]))
