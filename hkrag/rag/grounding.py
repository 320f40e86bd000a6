"""Answer grounding: which box on which page an answer came from, and how well it matches the drawn evidence.

An answer's *evidence* is a list of :class:`Evidence` (page id, box in that page's pixel coordinates, the source
that found it, a score in [0, 1]), best first. Three sources find it, one interface (:class:`EvidenceSource`):

- :class:`TextSource`: the answer, normalised as relaxed accuracy normalises it (``relaxed_normalize``), located
  among a page's word boxes (Tesseract's ``image_to_data`` for page images, a PDF's text layer for PDFs) by fuzzy
  matching windows of consecutive words (``rapidfuzz``'s normalised Indel similarity, so an OCR slip such as
  ``W3`` read ``WS`` still scores); the best window at or above ``threshold`` over the pages, earlier pages first
  on a tie. A page without word boxes cannot be grounded by text, and says so (:class:`GroundingError`).
- :class:`RegionSource`: the region unit (a SCAN box) that the retriever ranked first among the kept units.
- :class:`ModelSource`: boxes the generator writes itself in :data:`MODEL_BOX_FORMAT`; a backend that does not
  write boxes is refused, as is output whose boxes do not parse.

Metrics (:func:`grounding_score`), per query against the gold boxes: pixel-level precision, recall and F1 between
the union of the predicted boxes and the union of the gold boxes (areas exact by coordinate compression, as
:mod:`hkrag.data.regions`); a predicted box on a page that holds no gold box adds to the predicted area and to
nothing else, so evidence on a wrong page scores 0. ``hit`` says whether the best (first) box has IoU >= 0.5 with
a gold box of its page. A query with no gold boxes (its answer is not drawn) has no score: it is counted apart,
never as a miss.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from hkrag.data.regions import box_iou, union_area
from hkrag.rag.metrics import relaxed_normalize

Box = tuple[float, float, float, float]
HIT_IOU = 0.5
"""A best box at or above this IoU with a gold box counts as a hit (the detection convention)."""
TEXT_THRESHOLD = 0.6
""":class:`TextSource`'s default lowest similarity of a word window to the answer (0-1): chosen on generated answers
to the built-in corpus's validation questions, the best balanced accuracy of "grounded ⇔ right" of 0.5 to 1.0
(docs/grounding.md); at 0.5 a wrong two-character answer (``P.7``) is boxed on the right one (``P.3``)."""
MODEL_BOX_FORMAT = "<box page=N>x0,y0,x1,y1</box>"
"""How a generator writes a box: N is the page's position in its prompt (from 1), coordinates in page pixels."""
_MODEL_BOX = re.compile(r"<box\s+page\s*=\s*(\S+?)\s*>(.*?)</box>", re.IGNORECASE | re.DOTALL)


class GroundingError(ValueError):
    """Evidence that cannot be found or read: the message names the page, box or text at fault."""


def check_evidence_box(box: Sequence[float], size: tuple[int, int], where: str) -> Box:
    """``box`` as four floats when it is a box of positive area inside a ``size`` (width, height) page, else a
    :class:`GroundingError` naming ``where`` and the box."""
    try:
        values = tuple(float(v) for v in box)
    except (TypeError, ValueError):
        raise GroundingError(f"{where}: a box is four numbers (x0, y0, x1, y1), got {box!r}") from None
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        raise GroundingError(f"{where}: a box is four finite numbers (x0, y0, x1, y1), got {tuple(box)}")
    x0, y0, x1, y1 = values
    if not (x0 < x1 and y0 < y1):
        raise GroundingError(f"{where}: box {values} has zero area (needs x0 < x1 and y0 < y1)")
    width, height = size
    if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
        raise GroundingError(f"{where}: box {values} lies outside the {width}x{height} page")
    return values


@dataclass(frozen=True)
class Evidence:
    """One box of an answer's evidence: ``page_id``'s pixels ``box`` (x0, y0, x1, y1), found by ``source``."""

    page_id: str
    box: Box
    source: str
    score: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "box": list(self.box)}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Evidence:
        try:
            return cls(str(row["page_id"]), tuple(float(v) for v in row["box"]), str(row["source"]),
                       float(row.get("score", 1.0)))
        except (KeyError, TypeError, ValueError) as error:
            raise GroundingError(f"an evidence row needs page_id, box (4 numbers) and source, got {dict(row)!r}: "
                                 f"{error}") from None


@dataclass(frozen=True)
class GroundingScore:
    """Pixel-level precision/recall/F1 of a query's predicted boxes against its gold boxes, and the best box's
    hit (IoU >= :data:`HIT_IOU`); ``wrong_page`` when no predicted box lies on a page with gold evidence."""

    precision: float
    recall: float
    f1: float
    hit: bool
    wrong_page: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _by_page(evidence: Iterable[Evidence]) -> dict[str, list[Box]]:
    pages: dict[str, list[Box]] = {}
    for item in evidence:
        pages.setdefault(item.page_id, []).append(item.box)
    return pages


def overlap_area(a: Sequence[Box], b: Sequence[Box]) -> float:
    """Area of (union of ``a``) ∩ (union of ``b``): |A| + |B| - |A ∪ B|, each union exact."""
    if not a or not b:
        return 0.0
    return max(0.0, union_area(a) + union_area(b) - union_area([*a, *b]))


def grounding_score(predicted: Sequence[Evidence], gold: Sequence[Evidence]) -> GroundingScore | None:
    """The query's grounding against ``gold`` (module docstring); ``None`` when there is no gold box."""
    if not gold:
        return None
    gold_pages, predicted_pages = _by_page(gold), _by_page(predicted)
    overlap = sum(overlap_area(boxes, gold_pages.get(page, [])) for page, boxes in predicted_pages.items())
    predicted_area = sum(union_area(boxes) for boxes in predicted_pages.values())
    gold_area = sum(union_area(boxes) for boxes in gold_pages.values())
    precision = overlap / predicted_area if predicted_area else 0.0
    recall = overlap / gold_area if gold_area else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    best = predicted[0] if predicted else None
    hit = best is not None and any(box_iou(best.box, box) >= HIT_IOU for box in gold_pages.get(best.page_id, []))
    wrong_page = bool(predicted) and not set(predicted_pages) & set(gold_pages)
    return GroundingScore(precision, recall, f1, hit, wrong_page)


@dataclass(frozen=True)
class Word:
    """A word read on a page, with its pixel box."""

    text: str
    box: Box


@dataclass(frozen=True)
class GroundingPage:
    """A page as the sources see it: its id, pixel size, words (``None``: never read) and region units."""

    page_id: str
    size: tuple[int, int]
    words: Sequence[Word] | None = None
    regions: Sequence[tuple[str, Box]] = ()


class EvidenceSource(Protocol):
    """Finds an answer's evidence on the pages the generator read (in their prompt order)."""

    name: str

    def locate(self, answer: str, pages: Sequence[GroundingPage], output: str = "") -> list[Evidence]: ...


def _bounding(boxes: Sequence[Box]) -> Box:
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def _similarity(a: str, b: str) -> float:
    from rapidfuzz.distance import Indel

    return Indel.normalized_similarity(a, b)


@dataclass(frozen=True)
class TextSource:
    """The answer located among the pages' word boxes (module docstring). ``threshold`` in (0, 1]."""

    threshold: float = TEXT_THRESHOLD
    name: str = "text"

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, int | float) and 0 < self.threshold <= 1):
            raise GroundingError(f"grounding.threshold must be in (0, 1], got {self.threshold!r}")

    def locate(self, answer: str, pages: Sequence[GroundingPage], output: str = "") -> list[Evidence]:
        """The best-matching word window over ``pages`` as one box (empty when none reaches ``threshold`` or the
        answer normalises to nothing); a page that was never read raises :class:`GroundingError`."""
        target = relaxed_normalize(answer)
        if not target:
            return []
        best: Evidence | None = None
        for page in pages:
            if page.words is None:
                raise GroundingError(f"page {page.page_id!r} has no word boxes (no OCR or text layer): the text "
                                     "source cannot ground on it; read it first or use grounding.source=region")
            found = self._best_window(target, page)
            if found is not None and (best is None or found.score > best.score):
                best = found
        return [best] if best is not None and best.score >= self.threshold else []

    def _best_window(self, target: str, page: GroundingPage) -> Evidence | None:
        """The page's best window: ``span`` consecutive words scored by similarity; a window of ``span + 1``
        words (OCR split a word) or a single word holding the answer inside it (OCR merged two) only when the
        letters match exactly, boxed by the answer's share of the word's characters. Ties keep the first."""
        words = [(relaxed_normalize(word.text), word.box) for word in page.words]
        words = [(text, box) for text, box in words if text]
        span, letters = len(target.split()), target.replace(" ", "")
        candidates = []
        for start in range(len(words)):
            window = words[start:start + span]
            if len(window) == span:
                score = _similarity(target, " ".join(text for text, _ in window))
                candidates.append((score, _bounding([box for _, box in window])))
            split = words[start:start + span + 1]
            if len(split) == span + 1 and "".join(text.replace(" ", "") for text, _ in split) == letters:
                candidates.append((1.0, _bounding([box for _, box in split])))
            text, box = words[start]
            at = text.find(letters)
            if span == 1 and at >= 0 and text != letters:
                candidates.append((1.0, _share(box, at / len(text), (at + len(letters)) / len(text))))
        if not candidates:
            return None
        score, box = max(candidates, key=lambda candidate: candidate[0])
        return Evidence(page.page_id, box, self.name, score)


def at_threshold(evidence: Sequence[Evidence], threshold: float, run_threshold: float) -> list[Evidence]:
    """The :class:`TextSource` evidence of a finished run grounded at ``run_threshold`` as a run at the higher
    ``threshold`` gives it, with no page read again: the source keeps its single best window when the window
    reaches the threshold, so a higher one keeps the recorded box when its score reaches it, else nothing. A lower
    ``threshold`` (the boxes below ``run_threshold`` were never recorded) or another source's evidence is a
    :class:`GroundingError`."""
    TextSource(threshold=threshold)
    if threshold < run_threshold:
        raise GroundingError(f"a run grounded at threshold {run_threshold} holds no window scoring below it: it "
                             f"cannot give threshold {threshold}'s evidence (ground the answers again)")
    if sources := {item.source for item in evidence} - {TextSource.name}:
        raise GroundingError(f"only the text source's evidence has a threshold, got sources {sorted(sources)}")
    return [item for item in evidence if item.score >= threshold]


def _share(box: Box, start: float, end: float) -> Box:
    """The horizontal slice ``[start, end]`` (fractions of the width) of ``box``."""
    width = box[2] - box[0]
    return (box[0] + start * width, box[1], box[0] + end * width, box[3])


@dataclass(frozen=True)
class RegionSource:
    """The first region unit among the pages' ``regions`` (the retriever's order): the unit the answer read."""

    name: str = "region"

    def locate(self, answer: str, pages: Sequence[GroundingPage], output: str = "") -> list[Evidence]:
        for page in pages:
            if page.regions:
                return [Evidence(page.page_id, page.regions[0][1], self.name, 1.0)]
        raise GroundingError("no page the generator read has region units: the region source grounds answers read "
                             "from region units (retriever=regions_dense|regions_bm25); use grounding.source=text")


@dataclass(frozen=True)
class ModelSource:
    """Boxes the generator wrote in its output, :data:`MODEL_BOX_FORMAT`; ``writes_boxes`` says whether the
    backend can (a backend that cannot is refused rather than read as "no evidence")."""

    writes_boxes: bool = False
    backend: str = "lvlm"
    name: str = "model"

    def locate(self, answer: str, pages: Sequence[GroundingPage], output: str = "") -> list[Evidence]:
        if not self.writes_boxes:
            raise GroundingError(f"{self.backend} does not write evidence boxes ({MODEL_BOX_FORMAT}); use "
                                 "grounding.source=text or region")
        return parse_model_boxes(output, pages, self.name)


def parse_model_boxes(output: str, pages: Sequence[GroundingPage], source: str = "model") -> list[Evidence]:
    """Every ``<box page=N>x0,y0,x1,y1</box>`` of ``output`` as evidence on the N-th page (from 1), checked
    against that page's size; a box that does not parse is a :class:`GroundingError` quoting it."""
    evidence = []
    for match in _MODEL_BOX.finditer(output):
        where = f"generator box {match.group(0)!r}"
        try:
            position = int(match.group(1))
            numbers = [float(v) for v in match.group(2).split(",")]
        except ValueError:
            raise GroundingError(f"{where}: expected {MODEL_BOX_FORMAT}") from None
        if not 1 <= position <= len(pages):
            raise GroundingError(f"{where}: page {position} is not among the {len(pages)} pages of the prompt")
        page = pages[position - 1]
        evidence.append(Evidence(page.page_id, check_evidence_box(numbers, page.size, where), source, 1.0))
    return evidence


def without_boxes(text: str) -> str:
    """``text`` with every :data:`MODEL_BOX_FORMAT` box taken out (spaces collapsed): the answer a generator that
    writes boxes gave, as the metrics and the judge read it."""
    return " ".join(_MODEL_BOX.sub(" ", text).split())


SOURCES: dict[str, Callable[..., EvidenceSource]] = {"text": TextSource, "region": RegionSource, "model": ModelSource}
"""``grounding.source`` -> the source's class."""


def make_source(name: str, **settings: Any) -> EvidenceSource:
    """The evidence source called ``name`` (one of :data:`SOURCES`) with ``settings``."""
    if name not in SOURCES:
        raise GroundingError(f"grounding.source must be one of {sorted(SOURCES)}, got {name!r}")
    return SOURCES[name](**settings)
