"""Page text for a corpus: Tesseract OCR of every page, or a PDF's text layer where the corpus has one.

    python -m hkrag.data.ocr data/synthetic/corpus --out data/synthetic_ocr --column ocr_text   # OCR every page
    python -m hkrag.data.ocr data/reports --out data/reports_text --column text --overwrite     # PDF: OCR the scans

Reads every config/split of a corpus in our schema (``doc_id, image`` [+ ``text``], :mod:`hkrag.data.opendocvqa`;
the source positionally or as ``--source``; ``--config``/``--split`` pick some) and writes a copy with one more
string column (``--column``), plus ``<out>/ocr_report.json`` saying for every page whether it was OCRed or took a
text layer, and a summary line on stdout.

A *text layer* is text a born-digital file embeds beside its picture: a PDF page's text, which PDF ingestion keeps
in ``text`` and declares ``text_columns: {text: text_layer}`` in the corpus card. The synthetic corpus's ``text``
is no text layer: it is the exact strings the generator drew (ground truth; its card declares ``text: drawn``).
By default (``--text-layer auto``) a page takes the text of the column its card declares a text layer when that
is not blank, and every other page is read by Tesseract (through ``pytesseract``), upscaled by ``upscale`` first
(small pages read better larger). A corpus whose card declares no text layer (the synthetic corpus, OpenDocVQA,
a hub id, a corpus written before cards declared their text) is OCRed page by page: copying ground truth and
calling it OCR would publish the wrong baseline. ``--text-layer COLUMN`` takes that column as the layer whatever
the card says (with a warning when it declares something else); ``--text-layer none`` OCRs every page.

``--column`` must not name an identifying or content column (``doc_id``, ``image``), nor a non-string column; an
existing text column is replaced only with ``--overwrite``. The output card declares the new column (``ocr``, or
``text_layer+ocr`` when some pages took the layer) beside the source's declarations.

OCR results are cached one file per page under ``cache_dir`` (default ``<out>/.cache/ocr``), keyed by a hash of
the stored image bytes and the engine settings (language, page segmentation mode, upscale, Tesseract version):
a rerun OCRs nothing again, an interrupted run resumes where it stopped, and a page shared by two configs is read
once. A page that cannot be read (corrupt image, Tesseract error) keeps an empty text, is listed in
``<out>/ocr_failures.json``, the report and a warning, and is retried by the next run; it is never dropped. When
pages needed OCR and every one of them failed, the command says so and exits 1 (the copy is still written).
See docs/data.md, "Page text (OCR)".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import datasets
from PIL import Image
from tqdm.auto import tqdm

from hkrag.data.images import open_image
from hkrag.data.opendocvqa import (
    CORPUS_COLUMNS,
    TEXT_COLUMN,
    Corpus,
    DataError,
    load_corpus,
    read_card,
    text_kinds,
)
from hkrag.data.writer import declare_text_columns, save_split
from hkrag.io import WriteError, read_json, write_json, write_text

logger = logging.getLogger(__name__)

FAILURES_FILE = "ocr_failures.json"
"""Written into the output folder: every page whose text could not be read (empty list when none)."""
REPORT_FILE = "ocr_report.json"
"""Written into the output folder: where the last run's text of every page came from (:meth:`OcrReport.as_json`)."""
AUTO = "auto"
"""``text_layer`` default: the column the corpus card declares a text layer, if any (module docstring)."""
PROTECTED_COLUMNS = CORPUS_COLUMNS
"""Columns ``--column`` may never replace: a page's id and its image (docs/data.md, "Schema")."""
CACHE_SUBDIR = Path(".cache") / "ocr"
"""Default cache under the output folder (the loader ignores ``.cache`` folders)."""
CACHE_ENV = "HKRAG_CACHE"
"""The project's cache folder (default ``~/.cache/hkrag``); :class:`WordBoxCache` keeps its entries in ``ocr/``."""
WordBoxes = list[tuple[str, tuple[float, ...]]]
"""Words read on an image, each with its box ``(x0, y0, x1, y1)`` in the image's pixels (:func:`ocr_words`)."""
_LANG = re.compile(r"[A-Za-z0-9_]+(\+[A-Za-z0-9_]+)*")


class OcrUnavailable(RuntimeError):
    """Tesseract (or one of its languages) is missing and cannot be installed here; the message says how to."""


@dataclass(frozen=True)
class OcrSettings:
    """How Tesseract reads a page; every field is part of the cache key.

    ``psm`` is Tesseract's page segmentation mode (3: automatic layout, its default; 6: one block; 11: sparse
    text). The defaults read the built-in corpus best of upscale 1-3 x psm 3/6/11 (character accuracy 0.852,
    fine-print words 96.5 % found, against 0.845 and 77.5 % unscaled; docs/data.md, "Page text (OCR)").
    """

    lang: str = "eng"
    psm: int = 3
    upscale: float = 1.5

    def __post_init__(self) -> None:
        if not isinstance(self.lang, str) or not _LANG.fullmatch(self.lang):
            raise ValueError(f"lang must be Tesseract language codes joined by '+' (e.g. 'eng', 'eng+deu'), "
                             f"got {self.lang!r}")
        if not 0 <= self.psm <= 13:
            raise ValueError(f"psm must be a Tesseract page segmentation mode in [0, 13], got {self.psm}")
        if not 0 < self.upscale <= 8:
            raise ValueError(f"upscale must be in (0, 8], got {self.upscale}")


def debian_packages(lang: str = "eng") -> list[str]:
    """Debian's packages for Tesseract and the languages of ``lang`` (``eng+chi_sim`` -> ``tesseract-ocr-chi-sim``)."""
    return ["tesseract-ocr", *(f"tesseract-ocr-{code.lower().replace('_', '-')}" for code in lang.split("+"))]


def _pytesseract() -> Any:
    """The ``pytesseract`` module (an optional dependency: ``pip install 'hkrag[ocr]'``)."""
    try:
        import pytesseract
    except ImportError:
        raise OcrUnavailable("pytesseract is not installed: pip install 'hkrag[ocr]'") from None
    return pytesseract


def tesseract_version() -> str:
    """The installed Tesseract's version; :class:`OcrUnavailable` saying how to install it when there is none."""
    pytesseract = _pytesseract()
    try:
        return str(pytesseract.get_tesseract_version())
    except pytesseract.TesseractNotFoundError:
        raise OcrUnavailable(f"tesseract is not installed: apt-get install {' '.join(debian_packages())} "
                             "(or call hkrag.data.ocr.install_tesseract() as root)") from None


def check_tesseract(lang: str = "eng") -> str:
    """Tesseract's version, once it is installed with every language of ``lang``; else :class:`OcrUnavailable`."""
    version = tesseract_version()
    missing = sorted(set(lang.split("+")) - set(_pytesseract().get_languages(config="")))
    if missing:
        raise OcrUnavailable(f"tesseract has no language data for {missing}: "
                             f"apt-get install {' '.join(debian_packages('+'.join(missing))[1:])}")
    return version


def install_tesseract(lang: str = "eng") -> str:
    """Install Debian's Tesseract packages for ``lang`` when missing (root with apt-get only); returns the version.

    Raises :class:`OcrUnavailable` with the reason when they are missing and cannot be installed here.
    """
    try:
        return check_tesseract(lang)
    except OcrUnavailable as missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise OcrUnavailable(f"{missing}; installing needs root and apt-get") from None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *debian_packages(lang)]):
        result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise OcrUnavailable(f"{' '.join(args)} failed: {result.stderr.strip()[-500:]}")
    return check_tesseract(lang)


def _upscaled(image: Image.Image, settings: OcrSettings) -> Image.Image:
    """``image`` in RGB, resized by ``settings.upscale`` (Lanczos) for Tesseract."""
    image = image.convert("RGB")
    if settings.upscale == 1:
        return image
    size = (max(1, round(image.width * settings.upscale)), max(1, round(image.height * settings.upscale)))
    return image.resize(size, Image.Resampling.LANCZOS)


def ocr_image(image: Image.Image, settings: OcrSettings = OcrSettings()) -> str:
    """Tesseract's text of ``image``: upscaled by ``settings.upscale``, one line per text line, blank lines dropped."""
    text = _pytesseract().image_to_string(_upscaled(image, settings), lang=settings.lang,
                                          config=f"--psm {settings.psm}")
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def ocr_words(image: Image.Image, settings: OcrSettings = OcrSettings(),
              cache: WordBoxCache | None = None) -> WordBoxes:
    """Tesseract's words of ``image`` with their boxes ``(x0, y0, x1, y1)`` in ``image``'s own pixels (read
    upscaled by ``settings.upscale``, mapped back), empty words dropped; Tesseract's ``image_to_data``. With
    ``cache``, an image read before with these settings and this Tesseract comes from it, Tesseract not run."""
    key = cache.key(image, settings) if cache is not None else None
    if key is not None and (cached := cache.get(key)) is not None:
        return cached
    words = _tesseract_words(image, settings)
    if key is not None:
        cache.put(key, words)
    return words


def _tesseract_words(image: Image.Image, settings: OcrSettings) -> WordBoxes:
    scale = settings.upscale
    pytesseract = _pytesseract()
    data = pytesseract.image_to_data(_upscaled(image, settings), lang=settings.lang, config=f"--psm {settings.psm}",
                                     output_type=pytesseract.Output.DICT)
    return [(text.strip(), (left / scale, top / scale, (left + width) / scale, (top + height) / scale))
            for text, left, top, width, height in zip(data["text"], data["left"], data["top"], data["width"],
                                                      data["height"])
            if text.strip()]


def character_accuracy(hypothesis: str, reference: str) -> float:
    """``1 - CER``: one minus the Levenshtein distance over the reference length, on whitespace-normalised text
    (line breaks and runs of spaces count as one space), floored at 0. Order matters: a string read in another
    order than the reference lists it costs edits."""
    from rapidfuzz.distance import Levenshtein

    hypothesis, reference = " ".join(hypothesis.split()), " ".join(reference.split())
    if not reference:
        return float(not hypothesis)
    return max(0.0, 1 - Levenshtein.distance(hypothesis, reference) / len(reference))


@dataclass
class OcrReport:
    """What :func:`add_page_text` did, in pages: from the text layer, from the cache, OCRed now, failed.

    ``layer`` is the column taken as the text layer (``None``: every page OCRed), ``layer_kind`` what the card
    declares it (``text_layer`` when it declares nothing) and ``why`` the reason; ``splits`` holds, per
    config/split, the ``doc_id``s that took the layer, were OCRed, and failed.
    """

    pages: int = 0
    text_layer: int = 0
    cached: int = 0
    ocr: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)
    output: Path | None = None
    column: str = TEXT_COLUMN
    layer: str | None = None
    layer_kind: str = "text_layer"
    why: str = ""
    splits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> str | None:
        """What the written column holds, as a key of :data:`~hkrag.data.opendocvqa.TEXT_KINDS`; ``None`` for a
        mix of OCR and a column forced as the layer that is no text layer (``--text-layer`` against the card)."""
        if not self.text_layer:
            return "ocr"
        if self.text_layer == self.pages:
            return self.layer_kind
        return "text_layer+ocr" if self.layer_kind == "text_layer" else None

    def as_json(self) -> dict[str, Any]:
        """The report file's content: the counts, the layer decision and the per-page record."""
        return {"column": self.column, "kind": self.kind, "text_layer_column": self.layer, "why": self.why,
                "pages": self.pages, "from_text_layer": self.text_layer, "ocr": self.ocr + self.cached,
                "ocr_cached": self.cached, "failed": len(self.failed), "splits": self.splits}

    def summary(self, out: str | Path) -> str:
        """One line: how many pages were OCRed and how many took a text layer, and where the record is."""
        layer = f"from the text layer {self.layer!r}" if self.layer else "from a text layer"
        return (f"{self.column} of {self.pages} pages -> {out}: {self.ocr + self.cached} OCRed by Tesseract "
                f"({self.cached} from the cache), {self.text_layer} {layer}, {len(self.failed)} failed; "
                f"{self.why}; per page: {Path(out) / REPORT_FILE}")


class PageTextCache:
    """OCR results, one small file per page, keyed by the image bytes and the engine settings."""

    def __init__(self, root: str | Path, settings: OcrSettings):
        self.root = Path(root)
        self.settings = settings

    @cached_property
    def engine(self) -> str:
        """Settings and Tesseract version (looked up on first use, so a corpus read from its text layer needs none)."""
        return _engine(self.settings)

    def key(self, image: bytes) -> str:
        return hashlib.sha256(self.engine.encode() + b"\0" + image).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.txt"

    def get(self, key: str) -> str | None:
        path = self._path(key)
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def put(self, key: str, text: str) -> None:
        write_text(self._path(key), text)


def _engine(settings: OcrSettings, **output: str) -> str:
    """The settings and the installed Tesseract's version (and ``output``, what is read), as a cache key's part."""
    return json.dumps({**asdict(settings), "tesseract": check_tesseract(settings.lang), **output}, sort_keys=True)


def cache_home() -> Path:
    """The project's cache folder: ``$HKRAG_CACHE``, else ``~/.cache/hkrag``."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/hkrag").expanduser()


class WordBoxCache:
    """Tesseract's word boxes of images (:func:`ocr_words`), one JSON file per image and engine under ``root``
    (default ``$HKRAG_CACHE/ocr``), ``<root>/<2 hex>/<key>.words.json``.

    The key is the sha256 of the engine (:class:`OcrSettings`, the Tesseract version) and of the image's size and
    RGB pixels, what Tesseract is given: another setting or Tesseract never reuses an entry, and the same page
    decoded from another file does. Entries are written atomically (processes that write one entry at once each
    rename a whole file into place); one that cannot be read, does not parse or holds another key is read again
    by Tesseract with a warning, and one that cannot be written is skipped with a warning.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_home() / "ocr"
        self._engines: dict[OcrSettings, str] = {}

    def key(self, image: Image.Image, settings: OcrSettings) -> str:
        """The entry's key; :class:`OcrUnavailable` when Tesseract or a language of ``settings`` is missing."""
        if settings not in self._engines:
            self._engines[settings] = _engine(settings, output="words")
        rgb = image.convert("RGB")
        digest = hashlib.sha256(f"{self._engines[settings]}\0{rgb.width}x{rgb.height}\0".encode())
        digest.update(rgb.tobytes())
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.words.json"

    def get(self, key: str) -> WordBoxes | None:
        """The entry's words; ``None`` when there is none or it is damaged (warned: the caller reads again)."""
        path = self.path(key)
        try:
            entry = read_json(path, keys=("key", "words"), what="OCR cache entry")
            if entry["key"] != key:
                raise ValueError(f"it holds the entry {str(entry['key'])[:16]!r}…")
            return _word_boxes(entry["words"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            logger.warning("OCR cache entry %s cannot be read (%s); reading the page again", path, error)
            return None

    def put(self, key: str, words: WordBoxes) -> None:
        """Store ``words`` under ``key``; a cache that cannot be written is warned about, never fatal."""
        try:
            write_json(self.path(key), {"key": key, "words": [[text, *box] for text, box in words]}, indent=None)
        except WriteError as error:
            logger.warning("OCR word boxes not cached: %s", error)


def _word_boxes(rows: Any) -> WordBoxes:
    """``[[word, x0, y0, x1, y1], ...]`` as words; ``ValueError`` naming the first row that is not one."""
    if not isinstance(rows, list):
        raise ValueError(f"words is a {type(rows).__name__}, not a list")
    words = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in row[1:])):
            raise ValueError(f"a word is [text, x0, y0, x1, y1], got {row!r}"[:200])
        words.append((row[0], tuple(float(v) for v in row[1:])))
    return words


def add_page_text(
    source: str | Path,
    out: str | Path,
    column: str = TEXT_COLUMN,
    settings: OcrSettings = OcrSettings(),
    text_layer: str | None = AUTO,
    configs: Sequence[str] | None = None,
    splits: Sequence[str] | None = None,
    overwrite: bool = False,
    workers: int = 1,
    cache_dir: str | Path | None = None,
    batch_size: int = 64,
) -> OcrReport:
    """Copy the corpus ``source`` to ``out`` with each page's text in ``column`` (module docstring).

    ``text_layer``: :data:`AUTO` (the column the card declares a text layer; none declared: OCR every page), a
    column name, or ``None`` (OCR every page). ``configs``/``splits`` restrict the copy (default: every config and
    split of the source's card); ``workers`` > 1 OCRs in that many processes. ``column`` may not be ``doc_id`` or
    ``image``; an existing ``column`` is refused unless ``overwrite``. Returns the counts, the failed pages (also in
    ``out/ocr_failures.json``) and the per-page record (``out/ocr_report.json``).
    """
    source, out = local_or_hub(source), Path(out)
    if out.resolve() == Path(source).resolve():
        raise ValueError(f"--out {out} is the source corpus: write the copy to a new folder")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    _check_column(column)
    kinds = text_kinds(source)
    layer, why = text_layer_column(kinds, text_layer)
    todo = [(config, split, load_corpus(source, config, split))
            for config, split in corpus_splits(source, configs, splits)]
    for _, _, corpus in todo:
        _check_columns(corpus, column, layer, overwrite)
    cache = PageTextCache(cache_dir or out / CACHE_SUBDIR, settings)
    report = OcrReport(column=column, layer=layer, layer_kind=kinds.get(layer or "", "text_layer"), why=why)
    with _pool(workers) as executor:
        for config, split, corpus in todo:
            features = _features(corpus, column)
            rows = _rows(corpus, column, layer, cache, executor, batch_size, report, f"{config}/{split}")
            report.output = save_split(rows, out, config, split, features)
    written = {column: report.kind} if report.kind else {}
    declare_text_columns(out, {**{c: k for c, k in kinds.items() if c != column}, **written})
    write_json(out / FAILURES_FILE, report.failed)
    write_json(out / REPORT_FILE, report.as_json())
    logger.info("%s", report.summary(out))
    if report.failed:
        names = ", ".join(f"{f['config']}/{f['split']}:{f['doc_id']}" for f in report.failed[:10])
        logger.warning("%d pages could not be read and have empty text (listed in %s): %s%s", len(report.failed),
                       out / FAILURES_FILE, names, " ..." if len(report.failed) > 10 else "")
    return report


def text_layer_column(kinds: dict[str, str], text_layer: str | None = AUTO) -> tuple[str | None, str]:
    """The column to take as the text layer (``None``: OCR every page) and why, for a corpus whose card declares
    ``kinds`` (:func:`~hkrag.data.opendocvqa.text_kinds`) and the requested ``text_layer`` (:func:`add_page_text`)."""
    declared = ", ".join(f"{column}: {kind}" for column, kind in kinds.items())
    if text_layer is None:
        return None, "--text-layer none: every page OCRed"
    if text_layer != AUTO:
        if kinds.get(text_layer, "text_layer") != "text_layer":
            logger.warning("--text-layer %s: the corpus card declares %r %s, not a text layer; its pages are copied "
                           "as their text, not OCRed", text_layer, text_layer, kinds[text_layer])
        return text_layer, f"--text-layer {text_layer}: its non-blank pages taken as they are"
    layers = [column for column, kind in kinds.items() if kind == "text_layer"]
    if not layers:
        said = f"declares {{{declared}}}, no text layer" if kinds else "declares no text layer"
        return None, f"every page OCRed: the corpus card {said}"
    layer = TEXT_COLUMN if TEXT_COLUMN in layers else layers[0]
    return layer, f"the corpus card declares {layer!r} a text layer: its non-blank pages taken, the others OCRed"


def _check_column(column: str) -> None:
    """Refuse writing the text into a page's id or image column, or into a blank name."""
    if not column or not column.strip():
        raise ValueError("--column must name the column to write, got a blank name")
    if column in PROTECTED_COLUMNS:
        raise ValueError(f"--column {column}: {column!r} identifies or holds the page (the corpus's "
                         f"{'/'.join(PROTECTED_COLUMNS)} columns) and is never overwritten; write the text to another "
                         "column, e.g. --column ocr_text")


def _check_columns(corpus: Corpus, column: str, layer: str | None, overwrite: bool) -> None:
    """Refuse replacing a column without ``overwrite`` or one that is not text, and a text layer that is not text."""
    features = corpus.dataset.features
    if column in features and not _is_text(features[column]):
        raise ValueError(f"{corpus.name}: --column {column}: {column!r} is not a text column ({features[column]}) "
                         "and is never overwritten; write the text to another column, e.g. --column ocr_text")
    if column in features and not overwrite:
        raise ValueError(f"{corpus.name} already has a {column!r} column: pass overwrite (--overwrite) to "
                         "replace it, or write another --column")
    if layer in features and not _is_text(features[layer]):
        raise ValueError(f"{corpus.name}: --text-layer {layer}: {layer!r} is not a text column ({features[layer]})")


def _is_text(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def local_or_hub(source: str | Path) -> Path | str:
    """An existing folder as its absolute ``Path`` (the loader reads it locally, whatever its name looks like), else
    the hub id as given."""
    return Path(source).resolve() if Path(source).is_dir() else str(source)


def corpus_splits(
    source: str | Path, configs: Sequence[str] | None = None, splits: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """``(config, split)`` pairs of a corpus (a local folder's card, else a hub data set's configs), restricted to
    ``configs``/``splits`` when given.

    Raises :class:`~hkrag.data.opendocvqa.DataError` naming a requested config or split the corpus lacks.
    """
    source = local_or_hub(source)
    available = _local_splits(source) if isinstance(source, Path) else _hub_splits(source)
    for wanted, index, what in ((configs, 0, "config"), (splits, 1, "split")):
        unknown = sorted(set(wanted or ()) - {pair[index] for pair in available})
        if unknown:
            raise DataError(f"{source}: no {what} {unknown} (has {sorted({pair[index] for pair in available})})")
    chosen = [(c, s) for c, s in available if (not configs or c in configs) and (not splits or s in splits)]
    if not chosen:
        raise DataError(f"{source}: no split matches configs={configs} splits={splits} (has {available})")
    return chosen


def _local_splits(root: Path) -> list[tuple[str, str]]:
    if not (root / "README.md").is_file():
        raise DataError(f"{root} is not a corpus folder in the hub layout (no README.md card)")
    meta, _ = read_card(root / "README.md")
    return [(c["config_name"], f["split"]) for c in meta.get("configs", []) for f in c.get("data_files", [])]


def _hub_splits(source: str) -> list[tuple[str, str]]:
    try:
        return [(config, split) for config in datasets.get_dataset_config_names(source)
                for split in datasets.get_dataset_split_names(source, config)]
    except Exception as error:  # noqa: BLE001 - the hub client raises many types; the message names the source
        raise DataError(f"{source} is neither a corpus folder nor a loadable hub data set: "
                        f"{type(error).__name__}: {error}") from error


def _features(corpus: Corpus, column: str) -> datasets.Features:
    """The source's features (images written as stored, decoded again on load) plus the string ``column``."""
    features = dict(corpus.dataset.features)
    features["image"] = datasets.Image()
    features[column] = datasets.Value("string")
    return datasets.Features(features)


def _rows(
    corpus: Corpus, column: str, text_layer: str | None, cache: PageTextCache, executor: Executor | None,
    batch_size: int, report: OcrReport, name: str,
) -> Iterator[dict[str, Any]]:
    """The corpus's rows with ``column`` filled, ``batch_size`` pages at a time (OCRing the uncached ones)."""
    layer = text_layer if text_layer in corpus.dataset.column_names else None
    if text_layer and layer is None:
        logger.warning("%s has no text layer column %r: every page OCRed", corpus.name, text_layer)
    config, split = name.split("/", 1)
    record: dict[str, Any] = {"config": config, "split": split, "text_layer_column": layer,
                              "text_layer": [], "ocr": [], "failed": []}
    report.splits.append(record)
    with tqdm(total=len(corpus), desc=f"page text {name}", unit="page") as progress:
        for start in range(0, len(corpus), batch_size):
            rows = corpus.dataset[start:start + batch_size]
            rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
            texts, sources = _batch_texts(rows, layer, cache, executor, report, name, progress)
            for row, text, source in zip(rows, texts, sources):
                record[source].append(row["doc_id"])
                yield {**row, column: text}


def _batch_texts(
    rows: list[dict[str, Any]], layer: str | None, cache: PageTextCache, executor: Executor | None,
    report: OcrReport, name: str, progress: tqdm,
) -> tuple[list[str], list[str]]:
    """The rows' texts and where each came from (``text_layer``, ``ocr`` or ``failed``)."""
    texts: list[str | None] = [row[layer] if layer and (row[layer] or "").strip() else None for row in rows]
    sources = ["text_layer" if text is not None else "ocr" for text in texts]
    report.pages += len(rows)
    report.text_layer += sum(text is not None for text in texts)
    progress.update(sum(text is not None for text in texts))
    pending = []
    for i, row in enumerate(rows):
        if texts[i] is not None:
            continue
        data, problem = _image_bytes(row["image"])
        key = cache.key(data) if data is not None else None
        texts[i] = cache.get(key) if key else None
        if texts[i] is not None:
            report.cached += 1
            progress.update(1)
        elif problem:
            texts[i], sources[i] = _failed(report, name, row["doc_id"], problem, progress), "failed"
        else:
            pending.append((i, key, (row["doc_id"], data, cache.settings)))
    results = (executor.map if executor else map)(_read_page, [task for _, _, task in pending])
    for (i, key, (doc_id, _, _)), (text, problem) in zip(pending, results):
        if problem:
            texts[i], sources[i] = _failed(report, name, doc_id, problem, progress), "failed"
            continue
        cache.put(key, text)
        texts[i] = text
        report.ocr += 1
        progress.update(1)
    return texts, sources


def _failed(report: OcrReport, name: str, doc_id: str, problem: str, progress: tqdm) -> str:
    config, split = name.split("/", 1)
    report.failed.append({"config": config, "split": split, "doc_id": doc_id, "error": problem})
    progress.update(1)
    return ""


def _image_bytes(image: dict[str, Any]) -> tuple[bytes | None, str | None]:
    """The stored image's bytes (read from its path when stored as one), or the reason there are none."""
    if image.get("bytes"):
        return image["bytes"], None
    try:
        return Path(image.get("path") or "").read_bytes(), None
    except OSError as error:
        return None, f"image file cannot be read: {error}"


def _read_page(task: tuple[str, bytes, OcrSettings]) -> tuple[str, str | None]:
    """OCR one page in a worker: ``(text, None)``, or ``("", reason)`` when it cannot be read."""
    doc_id, data, settings = task
    try:
        return ocr_image(open_image(data, doc_id), settings), None
    except Exception as error:  # noqa: BLE001 - a page that fails is reported, never fatal
        return "", f"{type(error).__name__}: {error}".strip()


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[Executor | None]:
    """A process pool for ``workers`` > 1 (one Tesseract thread each), else ``None`` (OCR in this process)."""
    if workers == 1:
        yield None
        return
    with ProcessPoolExecutor(workers, initializer=_one_thread) as pool:
        yield pool


def _one_thread() -> None:
    """Tesseract's OpenMP threads would oversubscribe the cores the worker processes already share."""
    os.environ["OMP_THREAD_LIMIT"] = "1"


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = "corpus folder in the hub layout, or a hub id (owner/name)"
    parser.add_argument("source", nargs="?", help=where)
    parser.add_argument("--source", dest="source_option", metavar="SOURCE", help=f"{where} (same as SOURCE)")
    parser.add_argument("--out", required=True, type=Path, help="new corpus folder to write")
    parser.add_argument("--column", default=TEXT_COLUMN, help="column to write (default: text; never doc_id/image)")
    parser.add_argument("--overwrite", action="store_true", help="replace the column when the corpus has it")
    parser.add_argument("--text-layer", default=AUTO, metavar="auto|none|COLUMN",
                        help="auto (default): the column the corpus card declares a text layer (a PDF's text), "
                             "none declared: OCR every page; none: OCR every page; COLUMN: take its non-blank "
                             "pages instead of OCR")
    parser.add_argument("--config", action="append", dest="configs", help="config to copy (repeat; default: all)")
    parser.add_argument("--split", action="append", dest="splits", help="split to copy (repeat; default: all)")
    defaults = OcrSettings()
    parser.add_argument("--lang", default=defaults.lang, help=f"Tesseract languages (default: {defaults.lang})")
    parser.add_argument("--psm", type=int, default=defaults.psm, help=f"page segmentation mode ({defaults.psm})")
    parser.add_argument("--upscale", type=float, default=defaults.upscale, help=f"resize factor ({defaults.upscale})")
    parser.add_argument("--workers", type=int, default=1, help="OCR processes (default: 1)")
    parser.add_argument("--cache-dir", type=Path, help="OCR cache (default: <out>/.cache/ocr)")
    args = parser.parse_args(argv)
    if args.source and args.source_option and args.source != args.source_option:
        parser.error(f"two sources given: {args.source} and --source {args.source_option}")
    source = args.source or args.source_option
    if not source:
        parser.error("give the corpus to read: SOURCE or --source SOURCE")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = OcrSettings(args.lang, args.psm, args.upscale)
        report = add_page_text(
            source, args.out, args.column, settings, None if args.text_layer == "none" else args.text_layer,
            args.configs, args.splits, args.overwrite, args.workers, args.cache_dir)
    except (OcrUnavailable, DataError, ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(report.summary(args.out))
    if report.failed and not report.ocr + report.cached:
        print(f"error: no page was OCRed: all {len(report.failed)} pages that needed OCR failed (why, per page: "
              f"{Path(args.out) / FAILURES_FILE})", file=sys.stderr)
        return 1
    return 0 if report.pages else 1


if __name__ == "__main__":
    sys.exit(main())
