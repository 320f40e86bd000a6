"""SCAN's box selection, matching-based IoU and region->page ranking (hkrag.data.regions, hkrag.retrieval.regions)
against hand-computed cases."""

from __future__ import annotations

import datasets
import pytest
from PIL import Image

from hkrag.data.opendocvqa import Corpus, DataError
from hkrag.data.region_corpus import corpus_pages
from hkrag.data.regions import (
    Region,
    check_region,
    corpus_matching_iou,
    matching_iou,
    matching_pairs,
    non_overlap_ratio,
    page_ranking,
    select,
    selection_score,
    union_area,
)
from hkrag.retrieval.regions import RegionRanker

PAGE = (10, 10)  # area 100


def test_union_area_exact_on_overlaps_and_fractions():
    # 6x10 + 6x10 overlapping on 2x10: 100; a third box inside adds nothing; fractional edges stay exact.
    assert union_area([(0, 0, 6, 10), (4, 0, 10, 10), (1, 1, 3, 3)]) == 100
    assert union_area([(0, 0, 0.5, 0.5), (0.25, 0.25, 0.75, 0.75)]) == pytest.approx(0.25 + 0.25 - 0.0625)
    assert union_area([]) == 0


def test_scores_by_hand():
    a, b, c = (0, 0, 6, 10), (4, 0, 10, 10), (0, 0, 10, 5)
    # pairwise overlaps: a∩b (4,0,6,10) 20, a∩c (0,0,6,5) 30, b∩c (4,0,10,5) 30; their union 50 + 10 = 60
    assert non_overlap_ratio([a, b, c], PAGE) == pytest.approx(0.4)
    assert selection_score([], PAGE) == pytest.approx(0.1)
    assert selection_score([a], PAGE) == pytest.approx(0.9 * 0.6 + 0.1)
    assert selection_score([a, b], PAGE) == pytest.approx(0.9 * 1 + 0.1 * 0.8)
    assert selection_score([a, b, c], PAGE) == pytest.approx(0.9 * 1 + 0.1 * 0.4)


def test_greedy_selection_by_hand():
    a, b = Region((0, 0, 6, 10), "semantic_box", 0.9), Region((4, 0, 10, 10), "semantic_box", 0.8)
    c = Region((0, 0, 10, 5), "title", 0.7)  # S 0.98 -> 0.94: skipped
    low = Region((0, 0, 2, 2), "date", 0.39)  # below the 0.4 minimum confidence
    assert select([c, low, b, a], PAGE) == [a, b]  # visited by confidence, not input order
    # at the threshold itself a box is a candidate: alone it covers 4 % and is kept
    at = Region((0, 0, 2, 2), "date", 0.4)
    assert select([at], PAGE) == [at]
    # with the overlap weight dominant, b's 20 of overlap costs more than its 40 of coverage gains:
    # S(a) = 0.1 * 0.6 + 0.9 * 1 = 0.96 > S(a, b) = 0.1 * 1 + 0.9 * 0.8 = 0.82
    assert select([a, b], PAGE, alpha=0.1, beta=0.9) == [a]
    # a higher threshold leaves b out of the pool
    assert select([a, b], PAGE, threshold=0.85) == [a]


def test_selection_drops_a_box_inside_another():
    small, big = Region((1, 1, 3, 3), "title", 0.95), Region((0, 0, 5, 5), "semantic_box", 0.9)
    # small: S = 0.9 * 0.04 + 0.1 = 0.136; big raises it to 0.9 * 0.25 + 0.1 * 0.96 = 0.321; then small lies in big
    assert select([small, big], PAGE) == [big]
    # an equal box never joins (no coverage gained, overlap grows): one copy stays
    twin = Region((0, 0, 5, 5), "semantic_box", 0.5)
    assert select([big, twin], PAGE) == [big]


def test_selection_empty_and_bad_boxes():
    assert select([], PAGE) == []
    assert select([Region((0, 0, 5, 5), "title", 0.1)], PAGE) == []
    with pytest.raises(ValueError, match=r"p7, candidate 1: box \(8.0, 0.0, 12.0, 4.0\) lies outside the 10x10 page"):
        select([Region((0, 0, 5, 5), "title", 0.9), Region((8, 0, 12, 4), "title", 0.9)], PAGE, page="p7")
    with pytest.raises(ValueError, match="p7, candidate 0: box .* has zero area"):
        select([Region((3, 3, 3, 8), "title", 0.9)], PAGE, page="p7")
    with pytest.raises(ValueError, match="p7, candidate 0: a box is four finite numbers"):
        select([Region((0, 0, float("nan"), 3), "title", 0.9)], PAGE, page="p7")


@pytest.mark.parametrize("offset", [0, 1.5, 37.25, 100])
def test_an_exact_tie_never_adds_a_box_whatever_the_float_noise(offset):
    # b adds 1 of new area and 9 of overlap: alpha * 1 = beta * 9 exactly (0.9 = 0.1 * 9), a tie, so b stays out.
    # The float ratios said otherwise on the 224 x 168 page at offset 0 (S rose by 1.4e-17): b was selected.
    a = Region((offset, 0, offset + 10, 1), "semantic_box", 0.9)
    b = Region((offset + 1, 0, offset + 11, 1), "title", 0.8)
    assert select([a, b], (224, 168)) == [a]
    # one more 1/100 pixel of new area breaks the tie: 0.9 * 1.01 > 0.1 * 9
    wider = Region((offset + 1, 0, offset + 11.01, 1), "title", 0.8)
    assert select([a, wider], (224, 168)) == [a, wider]
    # 2-decimal boxes of the same tie (0.1 x 1 new, 0.9 x 1 overlapping): the same answer on every page size
    for size in ((224, 168), (1000, 1000), (10_000, 7_000)):
        c = Region((offset, 2, offset + 1.0, 3), "title", 0.9)
        d = Region((offset + 0.1, 2, offset + 1.1, 3), "title", 0.5)
        assert select([c, d], size) == [c]


def test_regions_that_scan_does_not_have_are_refused_naming_the_page_and_box():
    for region, message in ((Region((0, 0, 5, 5), "table", 0.9), r"p7, candidate 0: box \(0, 0, 5, 5\) has class "
                                                                  r"'table', not one of SCAN's"),
                            (Region((0, 0, 5, 5), "", 0.9), "has class '', not one of SCAN's"),
                            (Region((0, 0, 5, 5), "title", 1.5), r"has confidence 1.5, not a number in \[0, 1\]"),
                            (Region((0, 0, 5, 5), "title", float("nan")), "has confidence nan"),
                            (Region((0, 0, 5, float("inf")), "title", 0.5), "a box is four finite numbers"),
                            (Region((0, 0, 5), "title", 0.5), "a box is four finite numbers"),
                            (Region(("a", 0, 5, 5), "title", 0.5), "a box is four finite numbers"),
                            (Region((-0.01, 0, 5, 5), "title", 0.5), "lies outside the 10x10 page"),
                            (Region((9.99, 0, 9.99, 5), "title", 0.5), "has zero area")):
        with pytest.raises(ValueError, match=message):
            select([region], PAGE, page="p7")
        with pytest.raises(ValueError, match=message):
            check_region(region, PAGE, "p7, candidate 0")
    assert check_region(Region((0, 0, 10, 10), "author", 0.0), PAGE, "p") == Region((0, 0, 10, 10), "author", 0.0)


def flat(x0: float, x1: float) -> tuple[float, float, float, float]:
    """A box of height 1: its IoU with another is that of their x intervals."""
    return (x0, 0, x1, 1)


def test_matching_iou_beats_greedy_pairing():
    gold = [flat(0, 10), flat(6, 16)]
    predicted = [flat(2, 12), flat(0, 4)]
    # IoUs: p0-g0 8/12, p0-g1 6/14, p1-g0 4/10, p1-g1 0. Best-first pairing takes p0-g0 (2/3) then p1-g1 (0);
    # Hungarian takes p0-g1 + p1-g0 = 3/7 + 2/5 = 29/35, over two terms: 29/70.
    assert matching_iou(predicted, gold) == pytest.approx(29 / 70)
    assert matching_pairs(predicted, gold) == [(0, 1, pytest.approx(3 / 7)), (1, 0, pytest.approx(2 / 5))]
    assert matching_pairs(predicted, []) == []


def test_matching_iou_unmatched_boxes_count_zero():
    gold = [(0, 0, 4, 4), (6, 6, 10, 10)]
    predicted = [(0, 0, 4, 2), (6, 6, 10, 10), (0, 6, 2, 8)]  # IoU 0.5, 1, and an extra box
    assert matching_iou(predicted, gold) == pytest.approx((0.5 + 1) / 3)
    assert matching_iou(predicted[:1], gold) == pytest.approx(0.5 / 2)  # a missed gold box counts 0
    assert matching_iou([], gold) == 0
    with pytest.raises(ValueError, match="p3: no predicted and no gold boxes"):
        matching_iou([], [], page="p3")


def test_corpus_matching_iou_pools_terms():
    pages = [("a", [(0, 0, 4, 2)], [(0, 0, 4, 4)]),  # 0.5 over 1 term
             ("b", [(0, 0, 1, 1)], [(0, 0, 1, 1), (5, 5, 6, 6), (7, 7, 8, 8)])]  # 1 over 3 terms
    assert corpus_matching_iou(pages) == pytest.approx({"pooled": 1.5 / 4, "page_mean": (0.5 + 1 / 3) / 2, "pages": 2})
    with pytest.raises(ValueError, match="no pages"):
        corpus_matching_iou([])


def test_page_ranking_takes_each_pages_best_region():
    page_of = {"a#0": "a", "a#1": "a", "b#0": "b", "c#0": "c", "c#1": "c"}
    ranked = [("c#1", 0.9), ("a#0", 0.7), ("b#0", 0.7), ("a#1", 0.2), ("c#0", 0.95)]
    # c: max(0.9, 0.95); a: max(0.7, 0.2); b: 0.7, after a (a's best unit came first)
    assert page_ranking(ranked, page_of) == [("c", 0.95), ("a", 0.7), ("b", 0.7)]
    with pytest.raises(KeyError, match="region unit 'z#0' has no page"):
        page_ranking([("z#0", 1.0)], page_of)


class FakeRanker:
    """Returns a fixed unit run and records the depth it was asked for."""

    name = "fake"

    def __init__(self, run):
        self.run, self.depths = run, []

    def rank(self, qa, corpus, depth, corpus_key):
        self.depths.append(depth)
        return self.run


def unit_corpus(page_of: dict[str, str], with_pages: bool = True) -> Corpus:
    columns = {"doc_id": list(page_of), "image": [Image.new("RGB", (4, 4))] * len(page_of)}
    if with_pages:
        columns["page_id"] = list(page_of.values())
    return Corpus(datasets.Dataset.from_dict(columns), name="units")


def test_region_ranker_scores_pages_by_their_best_unit():
    page_of = {"a#0": "a", "a#1": "a", "b#0": "b", "c#0": "c", "d#0": "d"}
    inner = FakeRanker({"q": {"a#1": 0.2, "b#0": 0.7, "a#0": 0.9, "c#0": 0.5, "d#0": 0.5}})
    ranker = RegionRanker(inner=inner, unit_depth=50)
    # pages: a 0.9 (max of 0.9 and 0.2), b 0.7, c and d tied at 0.5: a cut at 3 keeps both tied pages
    assert ranker.rank([], unit_corpus(page_of), 3, "all") == {"q": {"a": 0.9, "b": 0.7, "c": 0.5, "d": 0.5}}
    assert ranker.rank([], unit_corpus(page_of), 2, "all") == {"q": {"a": 0.9, "b": 0.7}}
    assert inner.depths == [50, 50]
    assert corpus_pages(unit_corpus(page_of)) == ["a", "b", "c", "d"]
    assert corpus_pages(unit_corpus(page_of, with_pages=False)) == list(page_of)  # a page corpus: its doc ids
    with pytest.raises(DataError, match="units has no 'page_id' column"):
        ranker.rank([], unit_corpus(page_of, with_pages=False), 3, "all")
    with pytest.raises(ValueError, match="give inner"):
        RegionRanker()
