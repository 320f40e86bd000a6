"""The evidence step of a RAG run (``rag.grounding``): after a query is answered, the configured source
(:mod:`hkrag.rag.grounding`) finds its evidence boxes on the pages the generator kept, and, where the corpus has
gold evidence (the built-in corpus, :mod:`hkrag.rag.gold_evidence`), scores them.

Each outcome gets ``evidence`` (the boxes, best first, in page pixels) and ``grounding``: the source, a ``note``
when nothing was found and why (the answer is on none of the pages, a page has no word boxes, the backend writes no
boxes), whether the question's answer is drawn at all (``drawn``; ``None`` without gold evidence) and the
:class:`~hkrag.rag.grounding.GroundingScore` against the gold boxes. A region unit (a row of a region corpus, with
``page_id`` and ``box``) is grounded on its page: its box is the region source's evidence, and the words read on the
crop are moved to page pixels by the crop's corner (its ``crop`` column, the box with the margin it was cut with; the
box's corner for a corpus built without the column), a ``concatenation`` unit's appended global crops left out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from PIL import Image

from hkrag.data.ocr import OcrSettings, OcrUnavailable, WordBoxCache, ocr_words
from hkrag.data.pdf import WORDS_COLUMN
from hkrag.rag.grounding import (
    SOURCES,
    TEXT_THRESHOLD,
    Evidence,
    EvidenceSource,
    GroundingError,
    GroundingPage,
    ModelSource,
    Word,
    check_evidence_box,
    grounding_score,
    make_source,
    without_boxes,
)
from hkrag.rag.records import QueryOutcome

logger = logging.getLogger(__name__)

NONE = "none"
"""``rag.grounding.source`` that skips the step."""
NOT_FOUND = "the answer is on none of the pages the generator read"


@dataclass(frozen=True)
class GroundingConfig:
    """``rag.grounding``: the source (``text``, ``region``, ``model`` or ``none``), the text source's similarity
    threshold, how Tesseract reads page images for word boxes (``psm``, ``upscale``; chosen on the built-in
    corpus's training pages, docs/grounding.md) and where those are cached (``cache``: ``True`` for
    ``$HKRAG_CACHE/ocr``, a folder, or ``False`` for none; :class:`~hkrag.data.ocr.WordBoxCache`)."""

    source: str = "text"
    threshold: float = TEXT_THRESHOLD
    psm: int = 11
    upscale: float = 3.0
    writes_boxes: bool = False
    cache: bool | str = True

    @classmethod
    def problems(cls, config: Mapping[str, Any]) -> list[str]:
        """Every problem of a ``rag.grounding`` mapping, each naming the key, the value and what is allowed."""
        known = {f.name for f in fields(cls)}
        if unknown := set(config) - known:
            return [f"rag.grounding has unknown keys {sorted(unknown)}; expected some of {sorted(known)}"]
        settings = {**asdict(cls()), **config}
        problems = []
        if (source := settings["source"]) not in (*SOURCES, NONE):
            problems.append(f"rag.grounding.source must be one of {sorted((*SOURCES, NONE))}, got {source!r}")
        threshold = settings["threshold"]
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
            problems.append(f"rag.grounding.threshold must be in (0, 1], got {threshold!r}")
        try:
            OcrSettings(psm=settings["psm"], upscale=settings["upscale"])
        except (TypeError, ValueError) as error:
            problems.append(f"rag.grounding: {error}")
        if not isinstance(settings["writes_boxes"], bool):
            problems.append(f"rag.grounding.writes_boxes must be true or false, got {settings['writes_boxes']!r}")
        if not isinstance(cache := settings["cache"], bool | str) or cache == "":
            problems.append(f"rag.grounding.cache must be true, false or a folder, got {cache!r}")
        return problems

    def word_cache(self) -> WordBoxCache | None:
        """The cache of Tesseract's word boxes that ``cache`` names; ``None`` when it is ``False``."""
        if self.cache is False:
            return None
        return WordBoxCache(None if self.cache is True else Path(self.cache).expanduser())

    def make_source(self, backend: str = "lvlm") -> EvidenceSource | None:
        if self.source == NONE:
            return None
        settings = {"text": {"threshold": self.threshold},
                    "model": {"writes_boxes": self.writes_boxes, "backend": backend}}.get(self.source, {})
        return make_source(self.source, **settings)


@dataclass
class PageView:
    """What the grounder needs of a page or region unit: its image and, for a unit, its page and box."""

    image: Image.Image | None
    page_id: str
    box: tuple[float, float, float, float] | None = None
    concatenated: bool = False
    words: list[Word] | None = None
    """The page's text-layer words (a PDF page's ``words`` column), read instead of OCR when present."""
    crop: tuple[float, float, float, float] | None = None
    """Where a unit's own crop lies on its page (a region corpus's ``crop`` column: the box with its margin);
    ``None`` for corpora built before the column, whose crops are taken to start at the box's corner."""


@dataclass
class Grounder:
    """Finds and scores an outcome's evidence (module docstring). ``view(doc_id)`` gives a kept id's
    :class:`PageView`; ``gold`` maps (data set, query id) to gold boxes (``None``: no gold evidence); ``ocr`` is how
    Tesseract reads a page without a text layer, ``cache`` where its word boxes are kept."""

    source: EvidenceSource
    view: Callable[[str], PageView]
    gold: Mapping[tuple[str, str], list[Evidence]] | None = None
    ocr: OcrSettings = field(default_factory=OcrSettings)
    cache: WordBoxCache | None = None
    """Where Tesseract's word boxes are kept between runs (``None``: every page read by Tesseract)."""
    _words: dict[str, list[Word] | None] = field(default_factory=dict)

    def words(self, doc_id: str, view: PageView) -> list[Word] | None:
        """The words read on ``doc_id`` in page pixels (cached); ``None`` when it cannot be read."""
        if doc_id not in self._words:
            self._words[doc_id] = self._read(view)
        return self._words[doc_id]

    def _read(self, view: PageView) -> list[Word] | None:
        if view.words is not None:
            return view.words
        if view.image is None:
            return None
        try:
            read = ocr_words(view.image, self.ocr, self.cache)
        except (OcrUnavailable, RuntimeError) as missing:  # pytesseract's TesseractError is a RuntimeError
            logger.warning("no word boxes for grounding: %s", missing)
            return None
        if view.box is None:
            return [Word(text, box) for text, box in read]
        rect = view.crop or view.box
        x, y = rect[0], rect[1]
        height = rect[3] - rect[1] if view.concatenated else float("inf")
        return [Word(text, (b[0] + x, b[1] + y, b[2] + x, b[3] + y)) for text, b in read if b[3] <= height]

    def page(self, doc_id: str) -> GroundingPage:
        view = self.view(doc_id)
        if view.box is not None:  # a region unit: its page's size is not known here, only that it holds the box
            size = (int(view.box[2]) + 1, int(view.box[3]) + 1)
        else:
            size = view.image.size if view.image is not None else (0, 0)
        words = self.words(doc_id, view) if self.source.name == "text" else None
        regions = [(doc_id, view.box)] if view.box is not None else []
        return GroundingPage(view.page_id, size, words, regions)

    def annotate(self, outcome: QueryOutcome) -> QueryOutcome:
        """Set ``outcome.evidence`` and ``outcome.grounding`` (module docstring); returns ``outcome``. With the
        ``model`` source the boxes are read from the generator's last output and taken out of ``outcome.answer``
        (:func:`~hkrag.rag.grounding.without_boxes`), so the answer is scored without them."""
        note, evidence = None, []
        if isinstance(self.source, ModelSource):
            outcome.answer = without_boxes(outcome.answer)
        answer = "" if outcome.failed else outcome.answer
        try:
            pages = [self.page(doc_id) for doc_id in (outcome.kept or outcome.retrieved)]
            output = outcome.calls[-1].output if outcome.calls else ""
            evidence = self.source.locate(answer, pages, output) if answer else []
        except GroundingError as error:
            note = str(error)
        if not evidence and note is None:
            note = "no answer" if not answer else NOT_FOUND
        gold = None if self.gold is None else self.gold.get((outcome.dataset, outcome.query_id))
        score = grounding_score(evidence, gold) if gold else None
        outcome.evidence = [item.to_dict() for item in evidence]
        outcome.grounding = {"source": self.source.name, "note": note, "drawn": None if gold is None else bool(gold),
                             "gold": [item.to_dict() for item in gold or []],
                             "score": score.to_dict() if score else None}
        return outcome


def unit_view(row: Mapping[str, Any], doc_id: str, image: Image.Image | None) -> PageView:
    """A corpus row as a :class:`PageView`: a region unit (``page_id``, ``box``) on its page, else the page, with
    its text-layer words when the corpus has them (a PDF's ``words`` column, :data:`hkrag.data.pdf.WORDS_COLUMN`)."""
    if row.get("page_id") and row.get("box"):
        rect = tuple(float(v) for v in row["crop"]) if row.get("crop") else None
        return PageView(image, str(row["page_id"]), tuple(float(v) for v in row["box"]),
                        "+" in str(row.get("label", "")), crop=rect)
    return PageView(image, doc_id, words=layer_words(row.get(WORDS_COLUMN), doc_id))


def layer_words(value: str | None, doc_id: str) -> list[Word] | None:
    """A ``words`` cell as :class:`Word` s; ``None`` without one or for a page whose layer holds no word (a scan:
    OCR reads it); a cell that does not parse is a :class:`GroundingError` naming the page."""
    if not value:
        return None
    try:
        words = [Word(str(text), check_evidence_box(box, (float("inf"), float("inf")), f"page {doc_id!r}"))
                 for text, *box in json.loads(value)]
    except (ValueError, TypeError) as error:
        raise GroundingError(f"page {doc_id!r}: its words column is not [[word, x0, y0, x1, y1], ...] ({error})") \
            from None
    return words or None
