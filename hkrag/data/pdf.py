"""Render PDFs into a page corpus in the OpenDocVQA layout (``doc_id, image, text``), one row per page.

    python -m hkrag.data.pdf reports/*.pdf --out data/reports --dpi 144

Page ``n`` (1-based) of ``report.pdf`` becomes ``doc_id = "report.pdf#p{n}"``; ``text`` is the page's text
layer (pdfium's text page, empty for a scan), which VDocRAG pre-training reads (docs/training.md); the corpus
card declares it (``text_columns: {text: text_layer}``), so ``hkrag.data.ocr`` keeps it and OCRs only the scans.
``words`` holds the text layer's words with their boxes in the rendered page's pixels (:data:`WORDS_COLUMN`), which
answer grounding reads instead of OCR.
A PDF that is encrypted, corrupt, empty, page-less, not a file, or whose name collides with an earlier one is
reported (logged, and summarised at the end) and skipped; the others are still ingested. Each PDF
is rendered whole before it is written, so a file that fails half-way leaves no partial pages
behind, and the corpus file is replaced atomically (a failed run leaves the previous corpus
intact). A page so large that ``dpi`` would exceed the loader's pixel limit
(:data:`hkrag.data.images.DEFAULT_MAX_PIXELS`) is rendered at a lower resolution, with a logged
note. The progress bar counts pages. The command exits non-zero only when no page was ingested.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pypdfium2 as pdfium
from tqdm.auto import tqdm

from hkrag.data.images import DEFAULT_MAX_PIXELS, file_problem, page_png
from hkrag.data.opendocvqa import PAGE_TEXT_FEATURES, TEXT_COLUMN
from hkrag.data.writer import declare_text_columns, save_split

logger = logging.getLogger(__name__)

WORDS_COLUMN = "words"
"""The corpus column of a page's text-layer words with their pixel boxes (JSON ``[[word, x0, y0, x1, y1], ...]``):
what answer grounding reads for a PDF page instead of OCR (:mod:`hkrag.rag.evidence`)."""
PAGE_WORDS_FEATURES = datasets.Features({**PAGE_TEXT_FEATURES, WORDS_COLUMN: datasets.Value("string")})


class PdfError(ValueError):
    """A PDF that cannot be ingested; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass
class IngestReport:
    """What :func:`ingest` did: pages written, files ingested, and why each failed file failed."""

    pages: int = 0
    files: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    output: Path | None = None


def render_pdf(
    path: str | Path, dpi: int = 144, max_pixels: int = DEFAULT_MAX_PIXELS, progress: tqdm | None = None
) -> list[tuple[str, bytes]]:
    """Render every page of ``path`` to PNG bytes, as ``(doc_id, png)`` pairs in page order.

    Pages are capped at ``max_pixels`` (rendered at a lower dpi, logged); ``progress`` advances per page.
    """
    return [(doc_id, png) for doc_id, png, _ in read_pdf(path, dpi, max_pixels, progress)]


def read_pdf(
    path: str | Path, dpi: int = 144, max_pixels: int = DEFAULT_MAX_PIXELS, progress: tqdm | None = None
) -> list[tuple[str, bytes, str]]:
    """:func:`render_pdf`'s pages with each page's text layer: ``(doc_id, png, text)`` in page order."""
    return [page[:3] for page in read_pdf_words(path, dpi, max_pixels, progress)]


def read_pdf_words(
    path: str | Path, dpi: int = 144, max_pixels: int = DEFAULT_MAX_PIXELS, progress: tqdm | None = None
) -> list[tuple[str, bytes, str, list[list]]]:
    """:func:`read_pdf`'s pages with the text layer's words and their boxes in the rendered page's pixels:
    ``(doc_id, png, text, [[word, x0, y0, x1, y1], ...])`` (no words for a scan)."""
    path = Path(path)
    document = _open(path)
    try:
        if len(document) == 0:
            raise PdfError(path, "the PDF has no pages")
        if progress is not None:
            progress.total = (progress.total or 0) + len(document)
            progress.refresh()
        pages = []
        for i in range(len(document)):
            png, scale = _render_page(document, i, dpi, path, max_pixels)
            pages.append((f"{path.name}#p{i + 1}", png, _page_text(document, i, path),
                          _page_words(document, i, scale, path)))
            if progress is not None:
                progress.update(1)
        return pages
    finally:
        document.close()


def _page_text(document: pdfium.PdfDocument, index: int, path: Path) -> str:
    """The page's text layer in pdfium's reading order ("" for a page without one, e.g. a scan)."""
    try:
        textpage = document[index].get_textpage()
        try:
            return textpage.get_text_range().replace("\r\n", "\n")
        finally:
            textpage.close()
    except pdfium.PdfiumError as error:
        raise PdfError(path, f"the text of page {index + 1} cannot be read ({error})") from error


def _page_words(document: pdfium.PdfDocument, index: int, scale: float, path: Path) -> list[list]:
    """The page's text-layer words (runs of non-space characters in pdfium's order) with the union of their
    characters' boxes, in the pixels of the page rendered at ``scale`` (top-left origin)."""
    try:
        page = document[index]
        height = page.get_height()
        textpage = page.get_textpage()
        try:
            words, current = [], []
            for i in range(textpage.count_chars()):
                char = textpage.get_text_range(i, 1)
                if char.strip():
                    current.append((char, textpage.get_charbox(i)))
                elif current:
                    words.append(_word(current, height, scale))
                    current = []
            return words + ([_word(current, height, scale)] if current else [])
        finally:
            textpage.close()
    except pdfium.PdfiumError as error:
        raise PdfError(path, f"the words of page {index + 1} cannot be read ({error})") from error


def _word(chars: list[tuple[str, tuple[float, ...]]], height: float, scale: float) -> list:
    """``[text, x0, y0, x1, y1]``: PDF points (bottom-left origin) to rendered pixels (top-left origin)."""
    left = min(box[0] for _, box in chars)
    bottom = min(box[1] for _, box in chars)
    right = max(box[2] for _, box in chars)
    top = max(box[3] for _, box in chars)
    return ["".join(char for char, _ in chars), round(left * scale, 2), round((height - top) * scale, 2),
            round(right * scale, 2), round((height - bottom) * scale, 2)]


def _open(path: Path) -> pdfium.PdfDocument:
    problem = file_problem(path)
    if problem:
        raise PdfError(path, problem)
    if path.stat().st_size == 0:
        raise PdfError(path, "empty file (0 bytes)")
    try:
        return pdfium.PdfDocument(path)
    except pdfium.PdfiumError as error:
        raise PdfError(path, _diagnose(path, error)) from error


def _diagnose(path: Path, error: pdfium.PdfiumError) -> str:
    """PDFium's error codes are unreliable (a page-less PDF reports a password error, "Success", or the
    previous file's error), so look at the file itself: an encryption dictionary, or no page object at
    all (when no compressed object stream could hide one)."""
    data = path.read_bytes()
    if b"/Encrypt" in data:
        return f"encrypted (password required): {error}"
    if not re.search(rb"/Type\s*/Page(?!s)", data) and b"/ObjStm" not in data:
        return "the PDF has no pages"
    return f"corrupt or unreadable: {error}"


def render_scale(width_pt: float, height_pt: float, dpi: int, max_pixels: int) -> float:
    """Points-to-pixels scale for ``dpi``, lowered so the page stays within ``max_pixels``."""
    scale = dpi / 72
    if width_pt * height_pt * scale**2 > max_pixels:
        scale = math.sqrt(max_pixels / (width_pt * height_pt)) * 0.999
    return scale


def _render_page(document: pdfium.PdfDocument, index: int, dpi: int, path: Path,
                 max_pixels: int) -> tuple[bytes, float]:
    """The page as PNG bytes and the points-to-pixels scale it was rendered at."""
    try:
        page = document[index]
        width, height = page.get_size()
        scale = render_scale(width, height, dpi, max_pixels)
        if scale < dpi / 72:
            logger.info("%s page %d is %.0fx%.0f pt: rendered at %.0f dpi instead of %d to stay under %d pixels",
                        path, index + 1, width, height, scale * 72, dpi, max_pixels)
        image = page.render(scale=scale).to_pil()
    except pdfium.PdfiumError as error:
        raise PdfError(path, f"page {index + 1} cannot be rendered ({error})") from error
    return page_png(image), scale


def ingest(
    pdfs: Iterable[str | Path],
    out_dir: str | Path,
    dpi: int = 144,
    config: str = "default",
    split: str = "train",
) -> IngestReport:
    """Render ``pdfs`` into ``out_dir/config/{split}-*.parquet``; failed files are reported, not fatal.

    Nothing is written when no page could be rendered. Load the result with
    ``hkrag.data.opendocvqa.load_corpus(out_dir, config, split)``.
    """
    report = IngestReport()
    rows = _rows([Path(p) for p in pdfs], dpi, report)
    first = next(rows, None)
    if first is not None:
        report.output = save_split(itertools.chain([first], rows), out_dir, config, split, PAGE_WORDS_FEATURES)
        declare_text_columns(out_dir, {TEXT_COLUMN: "text_layer"})  # what hkrag.data.ocr may keep instead of OCR
    logger.info("ingested %d pages from %d PDFs into %s", report.pages, report.files, report.output)
    if report.failed:
        summary = "; ".join(f"{path} ({problem})" for path, problem in report.failed.items())
        logger.warning("%d PDFs skipped: %s", len(report.failed), summary)
    return report


def _rows(paths: list[Path], dpi: int, report: IngestReport) -> Iterator[dict]:
    names: dict[str, Path] = {}
    with tqdm(desc="rendering PDF pages", unit="page", total=0) as progress:
        for path in paths:
            try:
                if path.name in names:
                    raise PdfError(path, f"same file name as {names[path.name]}; doc_ids would collide")
                pages = read_pdf_words(path, dpi, progress=progress)
            except PdfError as error:
                logger.warning("%s", error)
                report.failed[str(path)] = error.problem
                continue
            names[path.name] = path
            report.files += 1
            report.pages += len(pages)
            progress.set_postfix(files=report.files)
            yield from ({"doc_id": doc_id, "image": {"bytes": png, "path": None}, "text": text,
                         WORDS_COLUMN: json.dumps(words)} for doc_id, png, text, words in pages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render PDFs into a page corpus (doc_id, image).")
    parser.add_argument("pdfs", nargs="+", type=Path, help="PDF files to ingest")
    parser.add_argument("--out", required=True, type=Path, help="corpus directory (OpenDocVQA layout)")
    parser.add_argument("--dpi", type=int, default=144, help="render resolution (default: 144)")
    parser.add_argument("--config", default="default", help="config name to write (default: default)")
    parser.add_argument("--split", default="train", help="split name to write (default: train)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = ingest(args.pdfs, args.out, dpi=args.dpi, config=args.config, split=args.split)
    return 0 if report.pages else 1


if __name__ == "__main__":
    sys.exit(main())
