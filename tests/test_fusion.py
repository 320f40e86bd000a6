"""Fusing rankings (hkrag/retrieval/fusion.py) on hand-built runs: exact RRF and normalised-sum scores, ties."""

import random

import pytest

from hkrag.retrieval.fusion import HybridRanker, min_max, normalized_sum, reciprocal_rank_fusion

DENSE = {"q": {"x": 3.0, "y": 2.0, "z": 1.0}}  # ranks x 1, y 2, z 3
LEXICAL = {"q": {"y": 0.9, "w": 0.5}}  # ranks y 1, w 2


def test_rrf_sums_reciprocal_ranks():
    fused = reciprocal_rank_fusion([DENSE, LEXICAL])
    assert fused["q"] == pytest.approx({"y": 1 / 62 + 1 / 61, "x": 1 / 61, "w": 1 / 62, "z": 1 / 63})
    assert list(fused["q"]) == ["y", "x", "w", "z"]
    weighted = reciprocal_rank_fusion([DENSE, LEXICAL], k=0, weights=[2, 1])
    assert weighted["q"] == pytest.approx({"x": 2.0, "y": 2 / 2 + 1.0, "z": 2 / 3, "w": 1 / 2})
    assert reciprocal_rank_fusion([DENSE, LEXICAL], depth=2) == {"q": {"y": 1 / 62 + 1 / 61, "x": 1 / 61}}


def test_tied_pages_share_the_mean_reciprocal_rank_of_their_positions():
    tied = {"q": {"a": 1.0, "b": 1.0}}  # trec_eval's order would give b 1/61 and a 1/62 by name
    assert reciprocal_rank_fusion([tied]) == {"q": {"b": (1 / 61 + 1 / 62) / 2, "a": (1 / 61 + 1 / 62) / 2}}
    run = {"q": {"top": 9.0, "c": 2.0, "a": 2.0, "b": 2.0, "last": 1.0}}  # a, b, c hold positions 2, 3, 4
    fused = reciprocal_rank_fusion([run, {"q": {"a": 5.0}}], k=0)
    third = (1 / 2 + 1 / 3 + 1 / 4) / 3
    assert fused["q"] == pytest.approx({"a": third + 1.0, "top": 1.0, "b": third, "c": third, "last": 1 / 5})
    assert fused["q"]["b"] == fused["q"]["c"]


def test_the_cut_keeps_every_page_tied_at_the_depth():
    fused = reciprocal_rank_fusion([{"q": {"p": 5.0}}, {"q": {"r": 0.1}}], depth=1)
    assert fused == {"q": {"r": 1 / 61, "p": 1 / 61}}  # p and r tie at 1/61: both kept, none chosen by name
    summed = normalized_sum([{"q": {"a": 3.0, "b": 1.0, "c": 1.0, "d": 0.0}}], depth=2)
    assert summed == {"q": {"a": 1.0, "c": 1 / 3, "b": 1 / 3}}


def test_fusion_does_not_depend_on_doc_ids_or_run_order():
    rng = random.Random(0)
    names = [f"d{i}" for i in range(30)]
    runs = [{"q": {d: rng.randint(0, 4) / 4 for d in rng.sample(names, 20)}} for _ in range(3)]
    relabel = dict(zip(names, rng.sample([f"x{i:02d}" for i in range(30)], 30)))
    renamed = [{"q": {relabel[d]: s for d, s in run["q"].items()}} for run in runs]
    for fuse in (reciprocal_rank_fusion, normalized_sum):
        fused, other = fuse(runs, depth=5)["q"], fuse(renamed, depth=5)["q"]
        assert {relabel[d]: s for d, s in fused.items()} == other  # same pages kept, bit-identical scores
    assert reciprocal_rank_fusion(runs) == reciprocal_rank_fusion(runs[::-1])  # fsum: the order of runs is moot


def test_normalized_sum_weights_min_max_scores():
    fused = normalized_sum([DENSE, LEXICAL], weights=[0.7, 0.3])
    # dense: x 1, y 0.5, z 0; lexical: y 1, w 0
    assert fused["q"] == pytest.approx({"x": 0.7, "y": 0.7 * 0.5 + 0.3, "z": 0.0, "w": 0.0})
    assert list(fused["q"]) == ["x", "y", "z", "w"]
    assert min_max({"a": 5.0, "b": 5.0}) == {"a": 1.0, "b": 1.0} and min_max({}) == {}
    assert min_max({"a": -1.0, "b": 3.0}) == {"a": 0.0, "b": 1.0}


def test_queries_missing_from_a_run_and_bad_weights():
    fused = reciprocal_rank_fusion([{"q1": {"a": 1.0}}, {"q2": {"b": 1.0}, "q1": {}}])
    assert fused == {"q1": {"a": 1 / 61}, "q2": {"b": 1 / 61}}
    assert normalized_sum([{"q1": {"a": 2.0}}, {}], weights=[0.5, 0.5]) == {"q1": {"a": 0.5}}
    with pytest.raises(ValueError, match="1 fusion weights for 2 runs"):
        normalized_sum([DENSE, LEXICAL], weights=[1.0])
    with pytest.raises(ValueError, match="RRF k=-1"):
        reciprocal_rank_fusion([DENSE], k=-1)


class Fixed:
    """A ranker returning a fixed run, recording the depth it was asked for."""

    def __init__(self, run):
        self.run, self.depths = run, []

    def rank(self, qa, corpus, depth, corpus_key):
        self.depths.append(depth)
        return self.run


def test_hybrid_ranker_fuses_deeper_runs_and_keeps_the_evaluation_depth():
    dense, lexical = Fixed(DENSE), Fixed(LEXICAL)
    hybrid = HybridRanker(dense, lexical, fusion_depth=100)
    assert hybrid.rank([], None, 2, "all") == {"q": {"y": 1 / 62 + 1 / 61, "x": 1 / 61}}
    assert dense.depths == lexical.depths == [100]
    summed = HybridRanker(dense, lexical, fusion="sum", dense_weight=0.7, fusion_depth=1).rank([], None, 3, "all")
    assert summed["q"] == pytest.approx({"x": 0.7, "y": 0.65, "z": 0.0, "w": 0.0})  # z, w tie at the cut
    assert dense.depths[-1] == 3
    with pytest.raises(ValueError, match=r"fusion='max': expected one of \['rrf', 'sum'\]"):
        HybridRanker(dense, lexical, fusion="max")
    with pytest.raises(ValueError, match=r"dense_weight=1.5"):
        HybridRanker(dense, lexical, fusion="sum", dense_weight=1.5)
