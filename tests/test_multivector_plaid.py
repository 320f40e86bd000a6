"""PLAID's centroid interaction (``stage=plaid``): stages by hand, recall against exact MaxSim, save/load."""

import numpy as np
import pytest

from hkrag.index.multivector import MultiVectorIndex, MultiVectorSpec
from hkrag.index.plaid import CentroidInteraction, default_centroids

K = 5
PLAID = "stage=plaid;centroids=256;nprobe=2;t_cs=0.6;ndocs=512"


@pytest.fixture(scope="module")
def corpus(multivector_pool):
    vectors, offsets, ids, queries, query_offsets, _, exact = multivector_pool
    return vectors, offsets, ids, queries, query_offsets, exact


def recall(rows, exact):
    return np.mean([len(set(r) & set(e)) / len(e) for r, e in zip(rows, exact, strict=True)])


@pytest.fixture
def hand():
    # Centroids c0 = (1, 0), c1 = (0, 1), c2 = (0.6, 0.8); page 0 holds vectors of c0 and c1, page 1 of c2, page 2
    # two of c1. Query vectors q0 = (1, 0), q1 = (0.6, 0.8): S = [[1, 0, .6], [.6, .8, 1]].
    centroids = np.array([[1, 0], [0, 1], [0.6, 0.8]], np.float32)
    plaid = CentroidInteraction(centroids, np.array([0, 1, 2, 1, 1], np.uint16), np.array([0, 2, 3, 5]))
    query = np.array([[1, 0], [0.6, 0.8]], np.float32)
    return plaid, query, query @ centroids.T


def test_inverted_lists_hold_each_page_once(hand):
    plaid, _, _ = hand
    np.testing.assert_array_equal(plaid.list_offsets, [0, 1, 3, 4])
    np.testing.assert_array_equal(plaid.list_pages, [0, 0, 2, 1])  # c0: page 0; c1: pages 0, 2 (twice); c2: 1


def test_stage_scores_match_a_hand_computed_case(hand):
    plaid, _, scores = hand
    pages = np.array([0, 1, 2])
    # t_cs 0.9 prunes c1 (its best query score is 0.8): page 0 keeps c0 only, q0 1 + q1 0.6; page 1 (c2) 0.6 + 1;
    # page 2 (only c1) has no kept centroid: 0.
    np.testing.assert_allclose(plaid.pruned_interaction(scores, pages, 0.9), [1.6, 1.6, 0.0], rtol=1e-6)
    # Unpruned, page 0 takes max(0.6, 0.8) for q1 and page 2 scores c1: 0 + 0.8.
    np.testing.assert_allclose(plaid.pruned_interaction(scores, pages, 0.0), [1.8, 1.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(plaid.interaction(scores, pages), [1.8, 1.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(plaid.pruned_interaction(scores, np.array([2, 0]), 0.0), [0.8, 1.8], rtol=1e-6)


def test_candidates_come_from_the_probed_centroids(hand):
    plaid, query, _ = hand
    # nprobe 1: q0 probes c0 (page 0), q1 probes c2 (page 1); page 2 is never a candidate.
    np.testing.assert_array_equal(plaid.candidates(query, nprobe=1, t_cs=0.9, ndocs=8, keep=3), [0, 1])
    # nprobe 2 adds c2 for q0 and c1 for q1: all three; the 2 best by unpruned interaction are pages 0 and 1.
    np.testing.assert_array_equal(plaid.candidates(query, nprobe=2, t_cs=0.9, ndocs=8, keep=3), [0, 1, 2])
    np.testing.assert_array_equal(plaid.candidates(query, nprobe=2, t_cs=0.9, ndocs=8, keep=2), [0, 1])
    # ndocs 2 keeps pages 0 and 1 after pruned interaction (1.6, 1.6 against page 2's 0), whatever keep is.
    np.testing.assert_array_equal(plaid.candidates(query, nprobe=2, t_cs=0.9, ndocs=2, keep=3), [0, 1])


def test_default_codebook_size_is_colbertv2s():
    assert default_centroids(6_400_000) == 2**15  # 16 * sqrt(6.4M) = 40,477
    assert default_centroids(24_000) == 2**11  # 2,479
    with pytest.raises(ValueError, match="plaid: 300 centroids need 1 to 200"):
        CentroidInteraction.train(np.ones((200, 4), np.float32), 300)


def test_plaid_recall_against_exact_maxsim(corpus):
    vectors, offsets, ids, queries, query_offsets, exact = corpus
    index = MultiVectorIndex.build(ids, vectors, offsets, "codec=SQ8;" + PLAID)
    assert len(index.plaid.centroids) == 256 and index.plaid.assignment.dtype == np.uint16
    assert recall(index.search(queries, query_offsets, K)[1], exact) >= 0.95  # 0.97 measured
    # Per vector: an SQ8 residual, a uint16 centroid id, at most one inverted-list entry (int32); per page an offset;
    # the 256 centroids (float32) shared.
    bound = (vectors.shape[1] + 2 + 4) * len(vectors) + 8 * len(offsets) + index.plaid.centroids.nbytes
    assert index.bytes_per_page() <= bound / len(ids) + 8
    # Too few pages through the candidate stages loses recall (0.42 measured): the stages, not the codes, limit it.
    index.set_search("ndocs=8;t_cs=0.8")
    assert index.spec.ndocs == 8 and index.spec.t_cs == 0.8
    assert recall(index.search(queries, query_offsets, K)[1], exact) < 0.6
    # 4-bit residuals lose recall (0.89 measured) that exact MaxSim over the 10 best from disk restores (0.98).
    coarse = MultiVectorIndex.build(ids, vectors, offsets, "codec=SQ4;" + PLAID + ";rerank=10")
    assert coarse.bytes_per_page() < index.bytes_per_page() - 0.5 * vectors.shape[1] * len(vectors) / len(ids) + 1
    reranked = recall(coarse.search(queries, query_offsets, K)[1], exact)
    coarse.set_search("rerank=0")
    assert recall(coarse.search(queries, query_offsets, K)[1], exact) < 0.93 < reranked


def test_plaid_save_load_round_trip(corpus, tmp_path):
    vectors, offsets, ids, queries, query_offsets, _ = corpus
    index = MultiVectorIndex.build(ids, vectors, offsets, "codec=SQ4;" + PLAID + ";rerank=10")
    assert str(index.spec) == "codec=SQ4;pool=1;stage=plaid;centroids=256;nprobe=2;t_cs=0.6;ndocs=512;rerank=10"
    assert MultiVectorSpec.parse(str(index.spec)) == index.spec
    loaded = MultiVectorIndex.load(index.save(tmp_path / "ix"), mmap=True)
    assert loaded.spec == index.spec and loaded.bytes_per_page() == pytest.approx(index.bytes_per_page())
    np.testing.assert_array_equal(loaded.plaid.list_pages, index.plaid.list_pages)
    for a, b in zip(loaded.search(queries, query_offsets, K), index.search(queries, query_offsets, K), strict=True):
        np.testing.assert_array_equal(a, b)
    np.save(tmp_path / "ix" / "assignment.npy", index.plaid.assignment[:-1])
    with pytest.raises(ValueError, match=r"assignment.npy holds 23\d+ centroid ids for 23\d+ codes"):
        MultiVectorIndex.load(tmp_path / "ix")
