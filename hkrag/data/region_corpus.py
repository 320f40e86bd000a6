"""Region units (SCAN Sec. 3.3): a corpus of page crops, one row per unit, in the page corpus's layout.

    python -m hkrag.data.region_corpus build data/synthetic/corpus --regions data/synthetic_regions \\
        --mode all-box --out data/units_det_all-box                          # detected boxes (layout detect)
    python -m hkrag.data.region_corpus build data/synthetic/corpus --gold data/synthetic \\
        --mode concatenation --out data/units_gold_concatenation             # the built-in corpus's own boxes
    python -m hkrag.data.region_corpus build data/synthetic/corpus --mode all-box \\
        --out data/units                                    # detect (the shipped weights/layout_tiny), cut: one command
    python -m hkrag.data.region_corpus build data/synthetic/corpus --mode all-box --out data/units_cf \\
        layout.model=runs/layout_cf/model layout.folds=runs/layout_cf        # training pages cross-fitted
    python -m hkrag.data.ocr data/units_det_all-box --out data/units_det_all-box_ocr --column ocr_text
    python -m hkrag.data.region_corpus stitch data/synthetic/corpus --units data/units_det_all-box_ocr \\
        --column ocr_text --out data/synthetic_region_ocr                    # page text from its units' text

Every config/split of the page corpus (or those named) becomes the same config/split of the region corpus, so the
pools line up. A row is ``doc_id`` (the unit's id, ``<page doc_id>#<k>``), ``image`` (the crop), ``page_id``,
``label`` (its SCAN class, ``semantic_box+global`` for a concatenation), ``box`` (``[x0, y0, x1, y1]`` in page
pixels) and ``crop`` (the page rectangle its own crop was cut from, margin included), and with ``--gold`` ``text``,
the drawn strings in the unit (declared ``drawn`` in the card, as the page corpus's);
:func:`hkrag.data.opendocvqa.load_corpus` reads it like any corpus. Units of a page are in reading order, by
upper-left corner (top, then left), as SCAN orders regions. The three modes are SCAN's:

- ``all-box``: every selected box is a unit, global boxes (title, footer, ...) included.
- ``semantic_box-only``: only semantic boxes are units.
- ``concatenation``: one unit per semantic box, the page's global crops appended below it (stacked top to bottom,
  left-aligned on white).

Without ``--regions`` or ``--gold``, the boxes come from Hydra settings given after the arguments
(``conf/region_units.yaml``): ``layout=rtdetr`` (the default) runs the detector ``layout.model`` (a ``transformers``
``save_pretrained`` folder; the shipped ``weights/layout_tiny/model`` by default; with ``layout.folds``, a ``train
--folds`` folder, each training page by the fold detector that never trained on it) with SCAN's selection
(``layout.threshold``, ``layout.alpha``, ``layout.beta``) into
``<out>/.layout`` (as ``python -m hkrag.data.layout detect`` does, cached by page and detector, so a rerun detects
nothing again), then cuts the units; ``layout=gold layout.root=<built-in corpus>`` takes the corpus's own boxes.

A page with no unit in the chosen mode (no selected box, or no semantic box for the last two) raises a DataError
naming it: a page without units could never be retrieved. Page-level metrics map a unit's score back to its
page by the maximum over the page's units (:func:`hkrag.data.regions.page_ranking`).

``stitch`` is SCAN's textual route (Sec. 3.3): the text of a page's units (e.g. ``python -m hkrag.data.ocr`` run
on the region corpus), joined one unit a line in the units' reading order, written as a copy of the page corpus
with that column (replacing a column of the name), for BM25 and text RAG beside whole-page OCR.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import datasets
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from PIL import Image

from hkrag.data.layout import LayoutError, SelectionSettings, gold_pages, write_regions
from hkrag.data.ocr import _check_column, _features, corpus_splits
from hkrag.data.opendocvqa import (
    CORPUS_FEATURES,
    PAGE_TEXT_FEATURES,
    TEXT_COLUMN,
    Corpus,
    DataError,
    load_corpus,
    text_kinds,
)
from hkrag.data.regions import GLOBAL_CLASSES, Region, check_region
from hkrag.data.synthetic import TextItem
from hkrag.data.writer import declare_text_columns, save_split
from hkrag.io import read_jsonl

MODES = ("all-box", "semantic_box-only", "concatenation")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.]*=")
"""A Hydra setting among ``build``'s arguments (``layout.model=...``; no option of this parser takes one)."""
DETECTIONS_DIR = ".layout"
"""Where ``build`` run with ``layout.model`` writes its detections (and their cache), inside ``--out``."""
PAGE_COLUMN = "page_id"
"""A unit's page: the column that maps region units back to the page they were cut from."""
CROP_COLUMN = "crop"
"""Where a unit's own crop lies on its page (``[x0, y0, x1, y1]``, whole pixels: its box widened, with the margin,
clipped to the page): words read on the crop are moved to page pixels by its corner (:mod:`hkrag.rag.evidence`)."""
UNIT_FEATURES = datasets.Features({**CORPUS_FEATURES, PAGE_COLUMN: datasets.Value("string"),
                                   "label": datasets.Value("string"),
                                   "box": datasets.Sequence(datasets.Value("float32")),
                                   CROP_COLUMN: datasets.Sequence(datasets.Value("float32"))})


def crop_box(size: tuple[int, int], box: Sequence[float], margin: int | Sequence[int] = 0) -> tuple[int, ...]:
    """The page rectangle :func:`crop` cuts: ``box``'s edges widened to whole pixels, with ``margin`` pixels of the
    page around it (one number, or one per edge: left, top, right, bottom) where the ``size`` page has them."""
    x0, y0, x1, y1 = box
    left, top, right, bottom = (margin,) * 4 if isinstance(margin, int) else margin
    return (max(0, math.floor(x0) - left), max(0, math.floor(y0) - top), min(size[0], math.ceil(x1) + right),
            min(size[1], math.ceil(y1) + bottom))


def crop(image: Image.Image, box: Sequence[float], margin: int | Sequence[int] = 0) -> Image.Image:
    """The pixels of :func:`crop_box`."""
    return image.crop(crop_box(image.size, box, margin))


def jittered(margin: int, jitter: int, key: str) -> tuple[int, int, int, int]:
    """``margin`` plus, on each edge, 0 to ``jitter`` pixels drawn from a generator seeded by ``key`` (a unit's
    box): the same crops on every build, each edge moved independently, as a detector's boxes are."""
    rng = random.Random(key)
    return tuple(margin + rng.randint(0, jitter) for _ in range(4))


def stack(images: Sequence[Image.Image]) -> Image.Image:
    """Images stacked top to bottom, left-aligned on a white canvas as wide as the widest."""
    canvas = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), (255, 255, 255))
    top = 0
    for image in images:
        canvas.paste(image.convert("RGB"), (0, top))
        top += image.height
    return canvas


def page_units(
    doc_id: str, image: Image.Image, regions: Sequence[Region], mode: str, items: Sequence[TextItem] | None = None,
    margin: int = 0, jitter: int = 0,
) -> list[dict]:
    """The unit rows of one page (module docstring), each crop with ``margin`` pixels of page around its box (and
    with ``jitter``, up to that many more on each edge, :func:`jittered`). A region that is no box of the page
    (outside it, of zero area, not finite) or of a class SCAN does not have raises a DataError naming the page and
    the box (:func:`hkrag.data.regions.check_region`), before any pixel is cut. With
    the page's drawn ``items`` (built-in pages), each row also gets ``text``: the strings whose centre lies in the
    unit's box(es), box by box, each top to bottom then left to right."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for i, region in enumerate(regions):
        try:
            check_region(region, image.size, f"page {doc_id!r}, region {i}")
        except ValueError as error:
            raise DataError(f"{error}: no unit is cut from it (fix the regions, or select again: python -m "
                            "hkrag.data.layout select)") from None
    ordered = sorted(regions, key=lambda r: (r.box[1], r.box[0]))
    semantic = [r for r in ordered if r.label == "semantic_box"]
    if mode == "all-box":
        units = [(r.label, r, [r]) for r in ordered]
    else:
        globals_ = [r for r in ordered if r.label in GLOBAL_CLASSES] if mode == "concatenation" else []
        units = [("semantic_box+global" if globals_ else r.label, r, [r, *globals_]) for r in semantic]
    if not units:
        what = "no selected box" if mode == "all-box" else "no semantic_box"
        raise DataError(f"page {doc_id!r} has {what}: it would have no {mode} unit")
    rows = []
    for k, (label, region, members) in enumerate(units):
        rects = [crop_box(image.size, m.box, jittered(margin, jitter, f"{doc_id}#{k}/{i}") if jitter else margin)
                 for i, m in enumerate(members)]
        row = {"doc_id": f"{doc_id}#{k}", "image": stack([image.crop(rect) for rect in rects]),
               PAGE_COLUMN: doc_id, "label": label, "box": list(region.box), CROP_COLUMN: list(rects[0])}
        if items is not None:
            row[TEXT_COLUMN] = "\n".join(item.text for m in members for item in sorted(
                (i for i in items if _centre_in(i.box, m.box)), key=lambda i: (i.box[1], i.box[0])))
        rows.append(row)
    return rows


def _centre_in(inner: Sequence[float], outer: Sequence[float]) -> bool:
    x, y = (inner[0] + inner[2]) / 2, (inner[1] + inner[3]) / 2
    return outer[0] <= x < outer[2] and outer[1] <= y < outer[3]


def unit_pages(corpus: Corpus) -> dict[str, str]:
    """``{unit doc_id: page doc_id}`` of a region corpus; DataError naming the corpus when it has no ``page_id``."""
    if PAGE_COLUMN not in corpus.dataset.column_names:
        raise DataError(f"{corpus.name} has no {PAGE_COLUMN!r} column: region units come from "
                        "python -m hkrag.data.region_corpus build")
    return dict(zip(corpus.doc_ids, corpus.dataset[PAGE_COLUMN][:]))


def corpus_pages(corpus: Corpus) -> list[str]:
    """The pages a corpus can retrieve: its ``page_id`` values for a region corpus, else its doc ids."""
    return sorted(set(unit_pages(corpus).values())) if PAGE_COLUMN in corpus.dataset.column_names else corpus.doc_ids


def detected_regions(folder: str | Path, config: str, split: str) -> dict[str, list[Region]]:
    """The selected boxes ``python -m hkrag.data.layout detect`` wrote for one config/split, by page; a line that
    is no detect row (or a box no ``[x0, y0, x1, y1, class, score]`` entry) raises a DataError naming the file and
    line (the boxes themselves are checked against their page where they are cut, :func:`page_units`)."""
    path = Path(folder) / config / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path} is missing: run python -m hkrag.data.layout detect first")
    rows = read_jsonl(path, keys=("doc_id", "selected"))  # a damaged line or a missing key: FileFormatError
    numbers = [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    boxes = {}
    for number, row in zip(numbers, rows):
        try:
            boxes[row["doc_id"]] = [_region(entry) for entry in row["selected"]]
        except (ValueError, TypeError) as error:
            raise DataError(f"{path}, line {number} is not a detect row with selected boxes [x0, y0, x1, y1, class, "
                            f"score] ({type(error).__name__}: {error})") from None
    return boxes


def _region(entry: object) -> Region:
    if not isinstance(entry, list) or len(entry) != 6:
        raise ValueError(f"{entry!r} is not [x0, y0, x1, y1, class, score]")
    return Region(tuple(entry[:4]), entry[4], entry[5])


def build_region_corpus(
    source: str | Path, out: str | Path, mode: str, regions: str | Path | None = None, gold: str | Path | None = None,
    configs: Sequence[str] | None = None, splits: Sequence[str] | None = None, margin: int = 0, jitter: int = 0,
) -> dict[str, int]:
    """Write the region corpus of ``source`` to ``out`` (module docstring) from a ``detect`` output folder
    (``regions``) or a built-in corpus's own boxes (``gold``), crops with ``margin`` pixels of page around their
    boxes; returns the unit count per ``config/split``."""
    if (regions is None) == (gold is None):
        raise ValueError("give the boxes: regions (a layout detect folder) or gold (a built-in corpus folder)")
    gold_boxes = {p.doc_id: p for p in gold_pages(gold)} if gold is not None else None
    counts = {}
    for config, split in corpus_splits(source, configs, splits):
        boxes = ({doc_id: list(p.regions) for doc_id, p in gold_boxes.items()} if gold_boxes is not None
                 else detected_regions(regions, config, split))
        corpus = load_corpus(source, config, split)

        def rows(corpus=corpus, boxes=boxes) -> Iterator[dict]:
            for page in corpus:
                if page.doc_id not in boxes:
                    raise DataError(f"page {page.doc_id!r} of {corpus.name} has no boxes in "
                                    f"{regions if gold is None else gold}")
                items = gold_boxes[page.doc_id].items if gold_boxes is not None else None
                yield from page_units(page.doc_id, page.image, boxes[page.doc_id], mode, items, margin, jitter)

        counted = [0]

        def counting(units: Iterator[dict], counted: list[int] = counted) -> Iterator[dict]:
            for unit in units:
                counted[0] += 1
                yield unit

        features = UNIT_FEATURES if gold is None else datasets.Features({**UNIT_FEATURES, **PAGE_TEXT_FEATURES})
        save_split(counting(rows()), out, config, split, features)
        counts[f"{config}/{split}"] = counted[0]
    if gold is not None:
        declare_text_columns(out, {TEXT_COLUMN: "drawn"})
    return counts


def stitch_text(
    source: str | Path, units: str | Path, out: str | Path, column: str,
    configs: Sequence[str] | None = None, splits: Sequence[str] | None = None,
) -> dict[str, int]:
    """Copy the page corpus ``source`` to ``out`` with ``column`` holding, for each page, the ``column`` text of its
    units in the region corpus ``units`` (module docstring); returns the page count per ``config/split``.

    Raises DataError naming the units corpus when it lacks ``column`` or ``page_id``, or naming a page without
    units there."""
    _check_column(column)
    counts = {}
    for config, split in corpus_splits(source, configs, splits):
        pages, pieces = load_corpus(source, config, split), load_corpus(units, config, split)
        missing = sorted({column, PAGE_COLUMN} - set(pieces.dataset.column_names))
        if missing:
            raise DataError(f"{pieces.name} has no column {missing} (a region corpus with a text column, e.g. "
                            "from python -m hkrag.data.ocr)")
        texts: dict[str, list[str]] = {}
        for page_id, text in zip(pieces.dataset[PAGE_COLUMN][:], pieces.dataset[column][:]):
            texts.setdefault(page_id, []).append(text or "")

        def rows(pages=pages, texts=texts, name=pieces.name) -> Iterator[dict]:
            for start in range(0, len(pages), 64):
                batch = pages.dataset[start:start + 64]
                for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
                    if row["doc_id"] not in texts:
                        raise DataError(f"page {row['doc_id']!r} of {pages.name} has no units in {name}")
                    yield {**row, column: "\n".join(texts[row["doc_id"]])}

        save_split(rows(), out, config, split, _features(pages, column))
        counts[f"{config}/{split}"] = len(pages)
    kinds = text_kinds(source)
    declare_text_columns(out, {**{c: k for c, k in kinds.items() if c != column},
                               **{c: k for c, k in text_kinds(units).items() if c == column}})
    return counts


def layout_boxes(
    source: str | Path, out: str | Path, overrides: Sequence[str], configs: Sequence[str] | None = None,
    splits: Sequence[str] | None = None,
) -> tuple[Path | None, Path | None]:
    """``(regions, gold)`` for :func:`build_region_corpus` from the Hydra settings ``overrides`` (module docstring):
    a detector's regions written into ``<out>/.layout``, or a built-in corpus's folder."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        layout = compose("region_units", list(overrides)).layout
    if layout.model is None:
        if not layout.get("root"):
            raise ValueError("layout.model=null takes the built-in corpus's own boxes: give layout.root (layout=gold)")
        return None, Path(layout.root)
    detections = Path(out) / DETECTIONS_DIR
    settings = SelectionSettings(layout.threshold, layout.alpha, layout.beta)
    report = write_regions(source, detections, layout.model, settings, configs, splits, folds=layout.get("folds"))
    if report["failed"]:
        first = report["failed"][0]
        raise DataError(f"layout.model={layout.model}: {len(report['failed'])} page(s) have no box, e.g. "
                        f"{first['doc_id']!r} of {first['config']}/{first['split']}: {first['error']} (listed in "
                        f"{detections / 'layout_failures.json'}; a rerun retries them)")
    return detections, None


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="a corpus of region crops")
    build.add_argument("--mode", required=True, choices=MODES)
    boxes = build.add_mutually_exclusive_group()
    boxes.add_argument("--regions", type=Path, help="folder written by python -m hkrag.data.layout detect")
    boxes.add_argument("--gold", type=Path, help="built-in corpus folder: its own boxes (the ceiling)")
    build.add_argument("--margin", type=int, default=0,
                       help="pixels of page kept around each box (default 0, SCAN's crops; Tesseract reads tight "
                            "crops poorly, docs/data.md)")
    build.add_argument("--jitter", type=int, default=0,
                       help="up to this many more pixels on each edge of each crop, drawn per unit and edge "
                            "(training crops that vary as detected boxes do; default 0)")
    stitch = commands.add_parser("stitch", help="page text stitched from a region corpus's text column")
    stitch.add_argument("--units", required=True, type=Path, help="region corpus with the text column")
    stitch.add_argument("--column", required=True, help="text column to read from the units and write")
    for command in (build, stitch):
        command.add_argument("source", help="page corpus folder in the hub layout, or a hub id")
        command.add_argument("--out", required=True, type=Path, help="corpus folder to write")
        command.add_argument("--config", action="append", dest="configs", help="config (repeat; default: all)")
        command.add_argument("--split", action="append", dest="splits", help="split (repeat; default: all)")
    parser.epilog = ("build without --regions or --gold takes Hydra settings of the boxes after its arguments "
                     "(conf/region_units.yaml), e.g. layout.model=runs/layout/model layout.folds=runs/layout or "
                     "layout=gold (default: the shipped weights/layout_tiny/model)")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [item for item in argv if OVERRIDE.match(item)]
    args = parser.parse_args([item for item in argv if not OVERRIDE.match(item)])
    if overrides and args.command != "build":
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    try:
        if args.command == "build":
            regions, gold = args.regions, args.gold
            if regions is None and gold is None:
                regions, gold = layout_boxes(args.source, args.out, args.overrides, args.configs, args.splits)
            elif args.overrides:
                raise ValueError(f"settings {args.overrides} apply only without --regions or --gold")
            counts = build_region_corpus(args.source, args.out, args.mode, regions, gold, args.configs,
                                         args.splits, args.margin, args.jitter)
        else:
            counts = stitch_text(args.source, args.units, args.out, args.column, args.configs, args.splits)
    except (DataError, LayoutError, FileNotFoundError, ValueError, HydraException) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(counts))
    return 0

if __name__ == "__main__":
    sys.exit(main())
