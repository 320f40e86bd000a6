"""Region units (SCAN Sec. 3.3): a corpus of page crops, one row per unit, in the page corpus's layout.

    python -m hkrag.data.region_corpus data/synthetic/corpus --regions data/synthetic_regions \\
        --mode all-box --out data/synthetic_units_all-box                    # detected boxes (layout detect)
    python -m hkrag.data.region_corpus data/synthetic/corpus --gold data/synthetic \\
        --mode concatenation --out data/synthetic_units_gold_concat          # the built-in corpus's own boxes

Every config/split of the page corpus (or those named) becomes the same config/split of the region corpus, so the
pools line up. A row is ``doc_id`` (the unit's id, ``<page doc_id>#<k>``), ``image`` (the crop), ``page_id``,
``label`` (its SCAN class, ``semantic_box+global`` for a concatenation) and ``box`` (``[x0, y0, x1, y1]`` in page
pixels); :func:`hkrag.data.opendocvqa.load_corpus` reads it like any corpus. Units of a page are in reading order,
by upper-left corner (top, then left), as SCAN orders regions. The three modes are SCAN's:

- ``all-box``: every selected box is a unit, global boxes (title, footer, ...) included.
- ``semantic_box-only``: only semantic boxes are units.
- ``concatenation``: one unit per semantic box, the page's global crops appended below it (stacked top to bottom,
  left-aligned on white).

A page with no unit in the chosen mode (no selected box, or no semantic box for the last two) raises a DataError
naming it: a page without units could never be retrieved. Page-level metrics map a unit's score back to its
page by the maximum over the page's units (:func:`hkrag.data.regions.page_ranking`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import datasets
from PIL import Image

from hkrag.data.layout import LayoutError, gold_pages
from hkrag.data.ocr import corpus_splits
from hkrag.data.opendocvqa import CORPUS_FEATURES, DataError, load_corpus
from hkrag.data.regions import GLOBAL_CLASSES, Region
from hkrag.data.writer import save_split

MODES = ("all-box", "semantic_box-only", "concatenation")
UNIT_FEATURES = datasets.Features({**CORPUS_FEATURES, "page_id": datasets.Value("string"),
                                   "label": datasets.Value("string"),
                                   "box": datasets.Sequence(datasets.Value("float32"))})


def crop(image: Image.Image, box: Sequence[float]) -> Image.Image:
    """The pixels of ``box`` (edges widened to whole pixels)."""
    x0, y0, x1, y1 = box
    return image.crop((math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)))


def stack(images: Sequence[Image.Image]) -> Image.Image:
    """Images stacked top to bottom, left-aligned on a white canvas as wide as the widest."""
    canvas = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), (255, 255, 255))
    top = 0
    for image in images:
        canvas.paste(image.convert("RGB"), (0, top))
        top += image.height
    return canvas


def page_units(doc_id: str, image: Image.Image, regions: Sequence[Region], mode: str) -> list[dict]:
    """The unit rows of one page (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ordered = sorted(regions, key=lambda r: (r.box[1], r.box[0]))
    semantic = [r for r in ordered if r.label == "semantic_box"]
    if mode == "all-box":
        units = [(r.label, r.box, crop(image, r.box)) for r in ordered]
    else:
        globals_ = [crop(image, r.box) for r in ordered if r.label in GLOBAL_CLASSES]
        append = mode == "concatenation" and bool(globals_)
        units = [("semantic_box+global" if append else r.label, r.box,
                  stack([crop(image, r.box), *globals_]) if append else crop(image, r.box)) for r in semantic]
    if not units:
        what = "no selected box" if mode == "all-box" else "no semantic_box"
        raise DataError(f"page {doc_id!r} has {what}: it would have no {mode} unit")
    return [{"doc_id": f"{doc_id}#{k}", "image": unit, "page_id": doc_id, "label": label, "box": list(box)}
            for k, (label, box, unit) in enumerate(units)]


def detected_regions(folder: str | Path, config: str, split: str) -> dict[str, list[Region]]:
    """The selected boxes ``python -m hkrag.data.layout detect`` wrote for one config/split, by page."""
    path = Path(folder) / config / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path} is missing: run python -m hkrag.data.layout detect first")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["doc_id"]: [Region(tuple(b[:4]), b[4], b[5]) for b in row["selected"]] for row in rows}


def build_region_corpus(
    source: str | Path, out: str | Path, mode: str, regions: str | Path | None = None, gold: str | Path | None = None,
    configs: Sequence[str] | None = None, splits: Sequence[str] | None = None,
) -> dict[str, int]:
    """Write the region corpus of ``source`` to ``out`` (module docstring) from a ``detect`` output folder
    (``regions``) or a built-in corpus's own boxes (``gold``); returns the unit count per ``config/split``."""
    if (regions is None) == (gold is None):
        raise ValueError("give the boxes: regions (a layout detect folder) or gold (a built-in corpus folder)")
    gold_boxes = {p.doc_id: list(p.regions) for p in gold_pages(gold)} if gold is not None else None
    counts = {}
    for config, split in corpus_splits(source, configs, splits):
        boxes = gold_boxes if gold_boxes is not None else detected_regions(regions, config, split)
        corpus = load_corpus(source, config, split)

        def rows(corpus=corpus, boxes=boxes) -> Iterator[dict]:
            for page in corpus:
                if page.doc_id not in boxes:
                    raise DataError(f"page {page.doc_id!r} of {corpus.name} has no boxes in "
                                    f"{regions if gold is None else gold}")
                yield from page_units(page.doc_id, page.image, boxes[page.doc_id], mode)

        counted = [0]

        def counting(units: Iterator[dict], counted: list[int] = counted) -> Iterator[dict]:
            for unit in units:
                counted[0] += 1
                yield unit

        save_split(counting(rows()), out, config, split, UNIT_FEATURES)
        counts[f"{config}/{split}"] = counted[0]
    return counts


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="page corpus folder in the hub layout, or a hub id")
    parser.add_argument("--out", required=True, type=Path, help="region corpus folder to write")
    parser.add_argument("--mode", required=True, choices=MODES)
    boxes = parser.add_mutually_exclusive_group(required=True)
    boxes.add_argument("--regions", type=Path, help="folder written by python -m hkrag.data.layout detect")
    boxes.add_argument("--gold", type=Path, help="built-in corpus folder: its own boxes (the ceiling)")
    parser.add_argument("--config", action="append", dest="configs", help="config to read (repeat; default: all)")
    parser.add_argument("--split", action="append", dest="splits", help="split to read (repeat; default: all)")
    args = parser.parse_args(argv)
    try:
        counts = build_region_corpus(args.source, args.out, args.mode, args.regions, args.gold, args.configs,
                                     args.splits)
    except (DataError, LayoutError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
