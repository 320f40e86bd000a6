"""SCAN's region boxes: the box selection and the matching-based IoU (arXiv 2505.14381, Sec. 3.1.2 and 3.2).

A *region* is a box on a page with one of SCAN's classes (:data:`CLASSES`): ``semantic_box`` (content about one
topic: paragraphs, a table, a chart and what describes it) or a *global* box (``title, header, footer, date,
author``), which relates to everything on the page. Boxes are ``(x0, y0, x1, y1)`` in page pixels, left/top edge
inclusive and right/bottom edge exclusive (a box covering pixel columns 0..9 is ``(0, ., 10, .)``), with
``0 <= x0 < x1 <= width`` and ``0 <= y0 < y1 <= height``.

Selection (:func:`select`, SCAN Sec. 3.2): candidates whose confidence is at least ``threshold`` (SCAN's "minimum
confidence threshold", 0.4) are visited in descending confidence (ties in input order); a box joins the selection
only when it strictly raises the score ``S = alpha * R_c + beta * R_o`` (Eq. 3; alpha 0.9, beta 0.1, tuned by SCAN
on DocSemNet's validation split), where the coverage ratio ``R_c`` is the area of the union of the selected boxes
over the page area (Eq. 1) and the non-overlap ratio ``R_o`` is one minus the area of the union of their pairwise
intersections over the page area (Eq. 2). Then every selected box completely covered by another selected box is
removed (of two equal boxes the less confident goes). The comparison is exact, not by floating point: a box joins
when ``alpha * dA_c > beta * dA_o`` (the gains in covered and in overlapped area), with areas counted in integers on
a 1/100-pixel grid (:data:`GRID`; ``detect`` stores boxes to 2 decimals, gold boxes are whole pixels) and the weights
as the decimals they print as (``Fraction(repr(alpha))``), so an exact tie (``alpha * dA_c = beta * dA_o``) never
adds the box, whatever the float rounding of the ratios would say.

Metric (:func:`matching_iou`, SCAN Sec. 3.1.2): predicted and gold boxes of a page are paired by the Hungarian
algorithm (``scipy.optimize.linear_sum_assignment``, maximising the summed IoU); the page's score is the average
IoU over the matched pairs and the unmatched boxes of either side, which count 0, i.e. the summed IoU of the
pairs over ``max(#predicted, #gold)``. Matching ignores classes (SCAN's description pairs boxes, not labels).
Over a corpus, :func:`corpus_matching_iou` pools every page's pairs and unmatched boxes into one average (the
literal reading of "an average IoU over the matched pairs and unmatched boxes"); it also returns the mean of the
per-page scores.

Areas of unions are exact: the union is measured on the grid of the boxes' own distinct edge coordinates
(coordinate compression), where every cell lies wholly inside or outside each box; no rasterising at a fixed
resolution. See docs/data.md, "Region units (SCAN)".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy.optimize import linear_sum_assignment

CLASSES = ("semantic_box", "title", "header", "footer", "date", "author")
"""SCAN's box types, in this order (a detector's class index is its position here)."""
GLOBAL_CLASSES = CLASSES[1:]
"""The global boxes: they relate to every semantic box of their page (SCAN Sec. 3.1.1)."""
THRESHOLD = 0.4
ALPHA = 0.9
BETA = 0.1
"""SCAN's tuned selection settings (Sec. 3.2): minimum confidence, coverage weight, non-overlap weight."""
MATCH_IOU = 0.5
"""The IoU at which a detected box counts as found (the usual detection threshold), for pairing and class checks."""

Box = tuple[float, float, float, float]
GRID = 100
"""Selection measures areas exactly in integers on a grid of 1/GRID pixel (module docstring)."""
DECIMALS = 2
"""Detected boxes are stored, selected and evaluated rounded to this many decimals (``round(v, DECIMALS)``)."""


@dataclass(frozen=True)
class Region:
    """One box on a page: its class (one of :data:`CLASSES`) and confidence (1.0 for gold boxes)."""

    box: Box
    label: str
    score: float = 1.0


def check_box(box: Sequence[float], size: tuple[int, int], where: str) -> Box:
    """``box`` as floats when it is a non-empty box inside a page of ``size`` (width, height), else a ValueError
    naming ``where`` (the page, and the box's place in its list) and the box."""
    try:
        values = tuple(float(v) for v in box)
    except (TypeError, ValueError):
        values = ()
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{where}: a box is four finite numbers (x0, y0, x1, y1), got {box!r}")
    x0, y0, x1, y1 = values
    width, height = size
    if not (x0 < x1 and y0 < y1):
        raise ValueError(f"{where}: box {values} has zero area (needs x0 < x1 and y0 < y1)")
    if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
        page = f"the {width}x{height} page" if math.isfinite(width * height) else "the page (a negative coordinate)"
        raise ValueError(f"{where}: box {values} lies outside {page}")
    return values


def check_region(region: Region, size: tuple[int, int], where: str) -> Region:
    """``region`` when its box passes :func:`check_box` and its class is one of :data:`CLASSES`, else a ValueError
    naming ``where``, the box and the class (a class SCAN does not have never passes as a new one)."""
    check_box(region.box, size, where)
    if region.label not in CLASSES:
        raise ValueError(f"{where}: box {tuple(region.box)} has class {region.label!r}, not one of SCAN's "
                         f"{list(CLASSES)}")
    if not (isinstance(region.score, (int, float)) and 0 <= region.score <= 1):
        raise ValueError(f"{where}: box {tuple(region.box)} has confidence {region.score!r}, not a number in [0, 1]")
    return region


def rounded(box: Sequence[float]) -> Box:
    """``box`` rounded to :data:`DECIMALS` decimals, as detected boxes are stored and selected."""
    return tuple(round(float(v), DECIMALS) for v in box)


def union_area(boxes: Iterable[Box]) -> float:
    """Exact area of the union of ``boxes`` (coordinate compression; see the module docstring)."""
    return float(_union(np.asarray(list(boxes), dtype=float).reshape(-1, 4)))


def _union(rows: np.ndarray) -> np.generic:
    """The union's area of ``rows`` (x0, y0, x1, y1), in their dtype: exact for integers."""
    if not len(rows):
        return rows.dtype.type(0)
    xs, ys = np.unique(rows[:, [0, 2]]), np.unique(rows[:, [1, 3]])
    covered = np.zeros((len(ys) - 1, len(xs) - 1), dtype=bool)
    for x0, y0, x1, y1 in rows:
        covered[np.searchsorted(ys, y0):np.searchsorted(ys, y1), np.searchsorted(xs, x0):np.searchsorted(xs, x1)] = True
    return (np.diff(ys)[:, None] * np.diff(xs)[None, :])[covered].sum()


def intersection(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when it has no area."""
    x0, y0, x1, y1 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    return (x0, y0, x1, y1) if x0 < x1 and y0 < y1 else None


def coverage_ratio(boxes: Sequence[Box], size: tuple[int, int]) -> float:
    """SCAN Eq. 1: ``R_c = A(union of boxes) / A(page)``."""
    return union_area(boxes) / (size[0] * size[1])


def non_overlap_ratio(boxes: Sequence[Box], size: tuple[int, int]) -> float:
    """SCAN Eq. 2: ``R_o = 1 - A(union over i < j of B_i ∩ B_j) / A(page)``."""
    overlaps = [o for i, a in enumerate(boxes) for b in boxes[i + 1:] if (o := intersection(a, b))]
    return 1.0 - union_area(overlaps) / (size[0] * size[1])


def selection_score(boxes: Sequence[Box], size: tuple[int, int], alpha: float = ALPHA, beta: float = BETA) -> float:
    """SCAN Eq. 3: ``S = alpha * R_c + beta * R_o`` (``beta`` for no box: nothing covered, nothing overlaps)."""
    return alpha * coverage_ratio(boxes, size) + beta * non_overlap_ratio(boxes, size)


def contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies completely inside ``outer`` (edges may touch)."""
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def select(
    candidates: Sequence[Region],
    size: tuple[int, int],
    *,
    threshold: float = THRESHOLD,
    alpha: float = ALPHA,
    beta: float = BETA,
    page: str = "page",
) -> list[Region]:
    """SCAN's greedy box selection (Sec. 3.2, module docstring), in selection order (descending confidence).

    An empty candidate list, or one with no box at or above ``threshold``, gives an empty selection. A candidate
    that is no region of the page (:func:`check_region`: zero area, outside it, not finite, a class SCAN does not
    have) raises a ValueError naming ``page``, its position and the box; callers reading stored candidates drop
    those first (``hkrag.data.layout``)."""
    for i, region in enumerate(candidates):
        check_region(region, size, f"{page}, candidate {i}")
    pool = sorted((r for r in candidates if r.score >= threshold), key=lambda r: -r.score)
    weight_c, weight_o = Fraction(repr(float(alpha))), Fraction(repr(float(beta)))
    chosen: list[Region] = []
    grid: list[tuple[int, ...]] = []
    covered = overlapped = 0
    for region in pool:
        boxes = [*grid, tuple(round(v * GRID) for v in region.box)]
        new_covered, new_overlapped = _grid_union(boxes), _grid_union(_overlaps(boxes))
        if weight_c * (new_covered - covered) > weight_o * (new_overlapped - overlapped):
            chosen.append(region)
            grid, covered, overlapped = boxes, new_covered, new_overlapped
    return [r for i, r in enumerate(chosen)
            if not any(j != i and contains(o.box, r.box) and (o.box != r.box or j < i) for j, o in enumerate(chosen))]


def _overlaps(boxes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    return [o for i, a in enumerate(boxes) for b in boxes[i + 1:] if (o := intersection(a, b))]


def _grid_union(boxes: Sequence[Sequence[int]]) -> int:
    """Exact area of the union of integer boxes (coordinates up to about 10**9 stay exact in int64)."""
    return int(_union(np.asarray(boxes, dtype=np.int64).reshape(-1, 4)))


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes."""
    overlap = intersection(a, b)
    if overlap is None:
        return 0.0
    inter = (overlap[2] - overlap[0]) * (overlap[3] - overlap[1])
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def matching_terms(predicted: Sequence[Box], gold: Sequence[Box]) -> tuple[float, int]:
    """``(summed IoU of the Hungarian pairs, number of terms)``: the numerator and denominator of SCAN's
    matching-based IoU, where the terms are the pairs plus the unmatched boxes of either side (``max`` of the
    two counts)."""
    return float(sum(iou for _, _, iou in matching_pairs(predicted, gold))), max(len(predicted), len(gold))


def matching_pairs(predicted: Sequence[Box], gold: Sequence[Box]) -> list[tuple[int, int, float]]:
    """The Hungarian pairs of SCAN's matching-based IoU: ``(predicted index, gold index, IoU)``, pairing boxes to
    maximise the summed IoU (classes ignored); ``min(#predicted, #gold)`` pairs, some possibly of IoU 0."""
    if not predicted or not gold:
        return []
    ious = np.array([[box_iou(p, g) for g in gold] for p in predicted])
    rows, cols = linear_sum_assignment(ious, maximize=True)
    return [(int(r), int(c), float(ious[r, c])) for r, c in zip(rows, cols)]


def matching_iou(predicted: Sequence[Box], gold: Sequence[Box], page: str = "page") -> float:
    """SCAN's matching-based IoU of one page (module docstring); no predicted box scores 0. A page with neither
    predicted nor gold boxes has no score: ValueError naming ``page``."""
    total, terms = matching_terms(predicted, gold)
    if not terms:
        raise ValueError(f"{page}: no predicted and no gold boxes, the matching-based IoU is undefined")
    return total / terms


def corpus_matching_iou(pages: Iterable[tuple[str, Sequence[Box], Sequence[Box]]]) -> dict[str, float]:
    """Matching-based IoU over ``(page, predicted, gold)`` triples: ``pooled`` (every page's terms in one
    average, module docstring), ``page_mean`` (mean of the per-page scores) and ``pages``."""
    total, terms, scores = 0.0, 0, []
    for page, predicted, gold in pages:
        page_total, page_terms = matching_terms(predicted, gold)
        if not page_terms:
            raise ValueError(f"{page}: no predicted and no gold boxes, the matching-based IoU is undefined")
        total, terms = total + page_total, terms + page_terms
        scores.append(page_total / page_terms)
    if not scores:
        raise ValueError("no pages to score")
    return {"pooled": total / terms, "page_mean": float(np.mean(scores)), "pages": len(scores)}


def page_ranking(ranked_units: Iterable[tuple[str, float]], page_of: dict[str, str]) -> list[tuple[str, float]]:
    """Pages ranked from scored region units: a page scores the maximum over its units (SCAN's region units
    answer for the page they were cut from); ties keep the order in which pages first appear in ``ranked_units``.
    A unit missing from ``page_of`` raises a KeyError naming it."""
    best: dict[str, float] = {}
    for unit, score in ranked_units:
        if unit not in page_of:
            raise KeyError(f"region unit {unit!r} has no page")
        page = page_of[unit]
        if page not in best or score > best[page]:
            best[page] = score
    order = {page: i for i, page in enumerate(best)}
    return sorted(best.items(), key=lambda item: (-item[1], order[item[0]]))
