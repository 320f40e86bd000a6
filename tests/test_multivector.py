"""The multi-vector index: exact MaxSim by hand, recall against it, MUVERA, pooling, save/load, bad input."""

import numpy as np
import pytest

from hkrag.index.multivector import (
    MultiVectorIndex,
    MultiVectorSpec,
    Muvera,
    check_multivectors,
    exact_search,
    maxsim_sum,
    pool_tokens,
)
from hkrag.index.synthetic_embeddings import QUERY_STREAM, MultiVectorPages

K = 5


@pytest.fixture(scope="module")
def corpus(multivector_pool):
    return multivector_pool


def recall(rows, exact):
    return np.mean([len(set(r) & set(e)) / len(e) for r, e in zip(rows, exact, strict=True)])


def test_maxsim_matches_a_hand_computed_case():
    # Query 0: vectors (1,0) and (0,1); query 1: (1,1)/sqrt2. Page A: (1,0),(0.6,0.8); page B: (0,1).
    queries = np.array([[1, 0], [0, 1], [2**-0.5, 2**-0.5]], np.float32)
    pages = np.array([[1, 0], [0.6, 0.8], [0, 1]], np.float16)
    scores = maxsim_sum(queries, np.array([0, 2, 3]), pages, np.array([0, 2, 3]))
    # q0 vs A: max(1, .6) + max(0, .8) = 1.8; q0 vs B: 0 + 1 = 1; q1 vs A: max(.7071, 1.4/sqrt2=.98995); q1 vs B: .7071
    np.testing.assert_allclose(scores, [[1.8, 1.0], [1.4 / 2**0.5, 2**-0.5]], rtol=1e-3)
    top_scores, rows = exact_search(queries, np.array([0, 2, 3]), pages, np.array([0, 2, 3]), 1, memory=16)
    np.testing.assert_array_equal(rows, [[0], [0]])
    np.testing.assert_allclose(top_scores[:, 0], [1.8, 1.4 / 2**0.5], rtol=1e-3)


def test_chunked_exact_search_equals_one_matrix(corpus):
    vectors, offsets, _, queries, query_offsets, _, exact = corpus
    full = maxsim_sum(queries, query_offsets, vectors, offsets)
    np.testing.assert_array_equal(exact, np.argsort(-full, axis=1, kind="stable")[:, :K])
    _, small_chunks = exact_search(queries, query_offsets, vectors, offsets, K, memory=60 * 16 * 4 * 100)
    np.testing.assert_array_equal(small_chunks, exact)


@pytest.mark.parametrize(
    ("spec", "at_least"),
    [
        ("codec=SQfp16", 1.0),  # the float16 vectors as given: exact MaxSim
        ("codec=SQ8", 0.9),
        ("codec=PQ16x4;rerank=100", 0.9),
        ("stage=tokens;stage_index=IVF32,SQ8;stage_params=nprobe=4;candidates=16", 0.9),
        ("stage=muvera;reps=20;ksim=4;candidates=300", 0.6),  # 300 random candidates of 1500 pages: 0.2
    ],
)
def test_index_recall_against_exact_maxsim(corpus, spec, at_least):
    vectors, offsets, ids, queries, query_offsets, _, exact = corpus
    index = MultiVectorIndex.build(ids, vectors, offsets, spec)
    _, rows = index.search(queries, query_offsets, K)
    assert recall(rows, exact) >= at_least


def test_compressed_codes_lose_recall_that_reranking_restores(corpus):
    vectors, offsets, ids, queries, query_offsets, _, exact = corpus
    codes_only = MultiVectorIndex.build(ids, vectors, offsets, "codec=PQ8x4")
    reranked = MultiVectorIndex.build(ids, vectors, offsets, "codec=PQ8x4;rerank=150")
    pages = len(ids)
    float16 = (2 * vectors.size + 8 * (pages + 1)) / pages
    assert codes_only.bytes_per_page() < float16 / 16  # 4 bytes a vector and the offsets
    assert reranked.disk_bytes_per_page() == pytest.approx(float16)
    assert reranked.bytes_per_page() == pytest.approx(codes_only.bytes_per_page())
    low = recall(codes_only.search(queries, query_offsets, K)[1], exact)  # 0.28 measured
    assert low < 0.5 and recall(reranked.search(queries, query_offsets, K)[1], exact) > 0.85  # 0.92 measured


@pytest.mark.parametrize("spec", ["codec=PQ8x4;rerank=20", "codec=SQ4;stage=plaid;centroids=64;rerank=20"])
def test_reranked_scores_are_exact_maxsim_read_cold_from_disk(corpus, tmp_path, spec):
    """Every page a re-ranking search returns scores exactly its MaxSim over the float16 vectors, read through the
    mapped file after it was dropped from the page cache."""
    vectors, offsets, ids, queries, query_offsets, _, _ = corpus
    MultiVectorIndex.build(ids, vectors, offsets, spec).save(tmp_path)
    index = MultiVectorIndex.load(tmp_path, mmap=True)
    index.drop_cached_vectors()
    assert isinstance(index.full[0], np.memmap)
    scores, rows = index.search(queries, query_offsets, K)
    assert index.last_rerank_s > 0
    exact = maxsim_sum(queries, query_offsets, vectors, offsets)
    assert (rows >= 0).all()
    np.testing.assert_allclose(scores, np.take_along_axis(exact, rows, 1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no re-ranking vectors mapped from disk"):
        MultiVectorIndex.build(ids[:50], vectors[: offsets[50]], offsets[:51], "codec=SQ8").drop_cached_vectors()


def test_read_rows_reads_a_mapped_file_as_indexing_does(tmp_path):
    """Runs of consecutive rows, single rows, any order, a repeated row: equal to fancy indexing, mapped or not."""
    from hkrag.index.mmap import read_rows

    array = np.arange(40 * 3, dtype=np.float16).reshape(40, 3)
    np.save(tmp_path / "a.npy", array)
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    rows = np.array([5, 6, 7, 20, 3, 4, 39, 39, 0])
    np.testing.assert_array_equal(read_rows(mapped, rows), array[rows])
    np.testing.assert_array_equal(read_rows(array, rows), array[rows])
    assert read_rows(mapped, np.array([], np.int64)).shape == (0, 3)


@pytest.mark.parametrize("spec", ["codec=SQ8", "codec=SQ8;stage=muvera;reps=4;ksim=2;candidates=3",
                                  "codec=SQ8;rerank=2"])
def test_k_beyond_the_pages_pads_every_search_alike(corpus, spec):
    """Six pages searched for k = 9: staged, unstaged and re-ranked searches all return [queries, 9], the missing
    places row -1 with score -inf."""
    vectors, offsets, ids, queries, query_offsets, _, _ = corpus
    index = MultiVectorIndex.build(ids[:6], vectors[: offsets[6]], offsets[:7], spec)
    scores, rows = index.search(queries[: query_offsets[2]], query_offsets[:3], 9)
    assert scores.shape == rows.shape == (2, 9)
    found = rows >= 0
    assert (found.sum(axis=1) >= 2).all() and np.isneginf(scores[~found]).all() and np.isfinite(scores[found]).all()
    assert (found[:, :-1] >= found[:, 1:]).all()  # the missing places last


def test_muvera_inner_product_tracks_maxsim():
    data = MultiVectorPages(tokens=16, topics=20, words=256, seed=2)
    vectors, offsets, topics = data.corpus(300)
    queries, query_offsets, _ = data.queries(vectors, offsets, topics, 20, QUERY_STREAM)
    muvera = Muvera(128, reps=20, ksim=3, dproj=16)
    pages = muvera.encode(vectors, offsets, query=False)
    assert pages.shape == (300, 20 * 8 * 16) and muvera.encode(queries, query_offsets, query=True).shape == (20, 2560)
    approx = muvera.encode(queries, query_offsets, query=True) @ pages.T
    true = maxsim_sum(queries, query_offsets, vectors, offsets)
    # Per query, the correlation over the 300 pages of FDE inner products and MaxSim (0.44 measured; 0 by chance).
    assert np.mean([np.corrcoef(a, t)[0, 1] for a, t in zip(approx, true, strict=True)]) > 0.3
    # A page with one vector fills every partition with it: each block is that vector's projection.
    one = Muvera(4, reps=1, ksim=2, dproj=4)
    one.projections[:] = np.eye(4)
    np.testing.assert_allclose(one.encode(np.array([[1.0, 2, 3, 4]]), np.array([0, 1]), query=False),
                               [[1, 2, 3, 4] * 4])


def test_token_pooling_by_hand():
    """Page 0: rows of 1 - cos are r0 (0, .2, 1, 1.6), r1 (.2, 0, .4, 1), r2 (1, .4, 0, .2), r3 (1.6, 1, .2, 0);
    |r0 - r1| = |r2 - r3| = sqrt(.8) are the closest pairs, so 4 // 2 = 2 clusters are {0, 1} and {2, 3}, pooled to
    (.9, .3) and (-.3, .9) renormalised (in fcluster's label order). Page 1 (3 vectors): 3 // 2 = 1 cluster, the
    normalised mean (1.6, 1.8)."""
    page0 = [[1, 0], [0.8, 0.6], [0, 1], [-0.6, 0.8]]
    page1 = [[1, 0], [0, 1], [0.6, 0.8]]
    vectors = np.array(page0 + page1, np.float32)
    pooled, offsets = pool_tokens(vectors, np.array([0, 4, 7]), 2)
    np.testing.assert_array_equal(offsets, [0, 2, 3])
    root = np.sqrt(0.9)
    by_first = pooled[:2][np.argsort(-pooled[:2, 0])]  # fcluster's label order (colpali-engine's too) aside
    np.testing.assert_allclose(by_first, [[0.9 / root, 0.3 / root], [-0.3 / root, 0.9 / root]], rtol=1e-6)
    np.testing.assert_allclose(pooled[2], [1.6 / np.sqrt(5.8), 1.8 / np.sqrt(5.8)], rtol=1e-6)
    assert pool_tokens(vectors, np.array([0, 4, 7]), 1)[0] is vectors
    with pytest.raises(ValueError, match="pool factor must be >= 1"):
        pool_tokens(vectors, np.array([0, 7]), 0)
    with pytest.raises(ValueError, match="page 1 has 1 vector.*use pool=1"):
        pool_tokens(vectors, np.array([0, 4, 5]), 2)


@pytest.mark.parametrize("factor", [2, 3, 5])
def test_token_pooling_matches_colpali_engine(factor):
    """colpali-engine's HierarchicalTokenPooler on pages of 2-70 clustered unit vectors (tests/_colpali.py;
    skipped when colpali-engine is not installed)."""
    import torch
    from _colpali import colpali_module

    rng = np.random.default_rng(factor)
    lengths = rng.integers(2, 71, 12)
    centres = rng.standard_normal((8, 32))
    pages = [centres[rng.integers(0, 8, n)] + 0.6 * rng.standard_normal((n, 32)) for n in lengths]
    pages = [(p / np.linalg.norm(p, axis=1, keepdims=True)).astype(np.float32) for p in pages]
    with colpali_module("compression.token_pooling.hierarchical_token_pooling") as module:
        theirs = [t.numpy() for t in module.HierarchicalTokenPooler().pool_embeddings(
            [torch.from_numpy(p) for p in pages], pool_factor=factor)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pooled, pooled_offsets = pool_tokens(np.vstack(pages), offsets, factor)
    np.testing.assert_array_equal(np.diff(pooled_offsets), [len(t) for t in theirs])
    np.testing.assert_allclose(pooled, np.vstack(theirs), atol=1e-6)


def test_save_load_round_trip(corpus, tmp_path):
    vectors, offsets, ids, queries, query_offsets, _, _ = corpus
    spec = ("codec=SQ8;pool=2;stage=muvera;reps=8;ksim=3;stage_index=HNSW16;stage_params=efSearch=64;candidates=50;"
            "rerank=20")
    index = MultiVectorIndex.build(ids, vectors, offsets, spec)
    loaded = MultiVectorIndex.load(index.save(tmp_path / "ix"), mmap=True)
    assert loaded.spec == index.spec == MultiVectorSpec.parse(str(index.spec)) and loaded.ids == ids
    assert loaded.stage.hnsw.efSearch == 64 and loaded.bytes_per_page() == pytest.approx(index.bytes_per_page())
    for a, b in zip(loaded.search(queries, query_offsets, K), index.search(queries, query_offsets, K), strict=True):
        np.testing.assert_array_equal(a, b)
    (tmp_path / "ix" / "ids.json").write_text('["only one"]')
    with pytest.raises(ValueError, match="parts disagree: 1 ids, 1500 pages in offsets"):
        MultiVectorIndex.load(tmp_path / "ix")
    with pytest.raises(FileNotFoundError, match="no multi-vector index at"):
        MultiVectorIndex.load(tmp_path / "missing")


def test_bad_input_is_named():
    vectors = np.zeros((6, 4), np.float16)
    with pytest.raises(ValueError, match=r"pages: offsets must increase strictly .* page 1 spans offsets\[1\]=3"):
        check_multivectors(vectors, np.array([0, 3, 3, 6]))
    with pytest.raises(ValueError, match="pages: offsets must run from 0 to the 6 vectors, got 0..5"):
        check_multivectors(vectors, np.array([0, 2, 5]))
    with pytest.raises(ValueError, match="queries: vectors have dim 4, expected 8 \\(dim mismatch\\)"):
        check_multivectors(vectors, np.array([0, 6]), name="queries", dim=8)
    with pytest.raises(ValueError, match="offsets must be an integer"):
        check_multivectors(vectors, np.array([0.0, 6.0]))
    index = MultiVectorIndex.build(["a", "b"], np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1]], np.array([0, 3, 6]))
    with pytest.raises(ValueError, match="queries: vectors have dim 3, expected 4"):
        index.search(np.ones((2, 3), np.float32), np.array([0, 2]), 1)
    with pytest.raises(ValueError, match="pages: 1 ids for 2 pages"):
        MultiVectorIndex.build(["a"], vectors, np.array([0, 3, 6]))
    with pytest.raises(ValueError, match="bad multi-vector index setting 'codecs=SQ8'"):
        MultiVectorSpec.parse("codecs=SQ8")
    with pytest.raises(ValueError, match="unknown candidate stage 'xtr'"):
        MultiVectorSpec.parse("stage=xtr")


def test_search_settings_change_without_rebuilding(corpus):
    vectors, offsets, ids, queries, query_offsets, _, exact = corpus
    index = MultiVectorIndex.build(ids, vectors, offsets, "stage=tokens;stage_index=IVF32,SQ8;candidates=1")
    few = recall(index.search(queries, query_offsets, K)[1], exact)
    index.set_search("candidates=16;stage_params=nprobe=4")
    assert index.spec.candidates == 16 and index.stage.nprobe == 4
    assert few < recall(index.search(queries, query_offsets, K)[1], exact)
    many = index.candidates(queries, query_offsets)
    index.set_search("prune=40")  # XTR-style approximate scores from the retrieved vectors keep the 40 best pages
    pruned = index.candidates(queries, query_offsets)
    assert all(len(p) == min(40, len(m)) and set(p) <= set(m) for p, m in zip(pruned, many, strict=True))
    assert np.mean([len(m) for m in many]) > 150
    # 40 random pages of ~200 candidates would keep ~0.2 of the exact top 5 (0.91 unpruned); 0.58 measured.
    assert recall(index.search(queries, query_offsets, K)[1], exact) > 0.4
    with pytest.raises(ValueError, match=r"change at search time, not \['codec'"):
        index.set_search("codec=SQ8")
    with pytest.raises(ValueError, match="rerank needs the vectors kept at build"):
        index.set_search("rerank=10")
