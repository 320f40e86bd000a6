"""Ties among float scores: identical pages, whose float32 scores differ in their last bits with their place in
the matrix product, are tied by search_with_ties (scores snapped at TIE_TOLERANCE), for dense and late
interaction, so E[nDCG] averages over their orders as it does for BM25's exactly equal scores."""

import numpy as np
import pytest

from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.maxsim import MaxSimIndex
from hkrag.retrieval.evaluation import search_with_ties
from hkrag.retrieval.metrics import TIE_TOLERANCE, evaluate_run, snap_near_ties


def test_near_ties_snap_to_their_groups_head():
    """Anchored at each group's best score: 1 - 4e-6 joins 1 (within 1e-5), 1 - 1.2e-5 starts a group, which
    1 - 1.9e-5 joins (7e-6 below it, 1.9e-5 below the first head); scores above 1 get a relative tolerance."""
    docs = {"a": 1.0, "b": 1 - 4e-6, "c": 1 - 1.2e-5, "d": 1 - 1.9e-5, "e": 0.5, "f": 3.0, "g": 3.0 - 2.5e-5}
    assert snap_near_ties(docs) == {"f": 3.0, "g": 3.0, "b": 1.0, "a": 1.0, "d": 1 - 1.2e-5, "c": 1 - 1.2e-5,
                                    "e": 0.5}
    assert list(snap_near_ties(docs)) == ["g", "f", "b", "a", "d", "c", "e"]  # trec_eval order: ties by id desc
    assert snap_near_ties({"a": 1.0, "b": 1 - 4e-6}, tolerance=0) == {"a": 1.0, "b": 1 - 4e-6}
    assert TIE_TOLERANCE == 1e-5


def twins(distinct: int, copies: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``copies`` identical unit vectors of each of ``distinct`` random ones, shuffled; and each row's group."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((distinct, width)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    order = rng.permutation(distinct * copies)
    return np.repeat(base, copies, axis=0)[order], np.repeat(np.arange(distinct), copies)[order]


def assert_twins_tied(run: dict, group: np.ndarray, copies: int) -> None:
    """Every page of the cut has all its twins in the cut, at its own score."""
    for docs in run.values():
        scores: dict[int, set[float]] = {}
        for doc, score in docs.items():
            scores.setdefault(group[int(doc[1:])], set()).add(score)
        kept = [int(doc[1:]) for doc in docs]
        assert all(len(s) == 1 for s in scores.values()), "identical pages scored differently"
        assert all(np.sum(group[kept] == g) == copies for g in scores), "a twin was cut"


def test_identical_pages_tie_in_a_flat_faiss_search_at_width_3072():
    """400 pages x 8 copies at width 3072, 50 queries near pages (FAISS flat, BLAS path from 20 queries, gives 7 of
    the 50 queries' own groups two or more scores, up to 2.4e-7 apart, without the snap); E[ndcg@5] then averages
    over the twins' orders."""
    pages, group = twins(400, 8, 3072, 0)
    rng = np.random.default_rng(1)
    queries = pages[rng.integers(0, len(pages), 50)] + 0.02 * rng.standard_normal((50, 3072)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    index = DocumentIndex.build([f"p{i}" for i in range(len(pages))], pages, "flat")
    ids = [f"q{i}" for i in range(50)]
    run = search_with_ties(index, ids, queries, 5)
    assert_twins_tied(run, group, 8)
    assert all(len(docs) == 8 for docs in run.values())  # the query's own group only: 8 pages tied at the cut
    relevant = {q: {next(iter(docs)): 1} for q, docs in run.items()}  # one of eight twins relevant
    expected = evaluate_run(run, relevant, ties="expected")["mean"]["ndcg@5"]
    assert expected == pytest.approx(sum(1 / np.log2(r + 1) for r in range(1, 6)) / 8)


def test_a_page_encoded_twice_ties_under_exact_maxsim():
    """Pages of 24 token vectors (dim 128) in 4 copies each, every copy's tokens shuffled and moved by float32
    rounding noise (1e-7 relative, as the same page encoded in two batches differs): MaxSim separates the copies by
    ~1e-7; after the snap every copy scores alike and the cut keeps all four."""
    rng = np.random.default_rng(2)
    distinct, copies = 60, 4
    tokens = rng.standard_normal((distinct, 24, 128)).astype(np.float32)
    tokens /= np.linalg.norm(tokens, axis=2, keepdims=True)
    order = rng.permutation(distinct * copies)
    group = np.repeat(np.arange(distinct), copies)[order]
    pages = [tokens[g][rng.permutation(24)] * (1 + 1e-7 * rng.standard_normal((24, 1))).astype(np.float32)
             for g in group]
    index = MaxSimIndex.from_pages([f"p{i}" for i in range(len(pages))], pages, memory=1 << 20)
    queries = [tokens[g][:6] + 0.3 * rng.standard_normal((6, 128)).astype(np.float32) for g in range(0, 60, 3)]
    query_ids = [f"q{i}" for i in range(len(queries))]
    assert any(len(set(docs.values())) > 3 for docs in index.to_run(query_ids, queries, 4).values())  # split
    run = search_with_ties(index, query_ids, queries, 3)
    assert_twins_tied(run, group, copies)
