"""Named, deterministic page degradations, and degraded copies of a corpus (OHRBench's question for pages).

A degradation is written ``name:strength`` (``gaussian_blur:1.5``, ``jpeg:20``); strength 0 is no degradation
(the page's stored bytes are kept as they are). The same page, spec and seed always give the same bytes.

=================  =============================================================================================
``gaussian_blur``  Gaussian blur, standard deviation in pixels (>= 0)
``jpeg``           JPEG re-encoding at this quality (1-100; lower is worse; 0 = off)
``downscale``      shrink by this factor, then back to the original size (>= 1; 0 or 1 = off)
``salt_pepper``    this fraction of pixels set to black or white (0-1), drawn from a generator seeded by
                   the page's ``doc_id`` and ``seed``
``rotate``         rotation in degrees (-45 to 45; counter-clockwise), white fill, same page size
``fine_print_blur``  Gaussian blur (standard deviation in pixels) of the page's fine-print boxes only
=================  =============================================================================================

``fine_print_blur`` needs the boxes of the fine print: the built-in corpus records every string it drew with its
kind and pixel box in ``pages.jsonl`` beside its ``corpus`` folder (:mod:`hkrag.data.synthetic`), which
:func:`degrade_corpus` reads (``boxes=`` names another file in that format). Degraded pages are stored as PNG, so
the artifacts of each degradation are kept losslessly. See docs/evaluation.md ("Degraded pages").
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter
from tqdm.auto import tqdm

from hkrag.data.images import open_image, page_png
from hkrag.data.ocr import corpus_splits, local_or_hub
from hkrag.data.opendocvqa import CORPUS_FEATURES, Corpus, DataError, load_corpus
from hkrag.data.writer import save_split
from hkrag.io import read_jsonl, write_json

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]
FINE_PRINT = "fine_print"
PAGES_FILE = "pages.jsonl"
DONE_FILE = "degradation.json"
"""Written into the output folder: the degradation, its source and the splits already written (for resuming)."""


def _blur(image: Image.Image, sigma: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    return image.filter(ImageFilter.GaussianBlur(sigma))


def _jpeg(image: Image.Image, quality: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=round(quality))
    return Image.open(buffer).convert("RGB")


def _downscale(image: Image.Image, factor: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    small = (max(1, round(image.width / factor)), max(1, round(image.height / factor)))
    return image.resize(small, Image.Resampling.BOX).resize(image.size, Image.Resampling.BICUBIC)


def _salt_pepper(image: Image.Image, fraction: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big"))
    pixels = np.array(image)
    hit = rng.random(pixels.shape[:2]) < fraction
    pixels[hit] = np.where(rng.random(int(hit.sum())) < 0.5, 0, 255)[:, None].astype(pixels.dtype)
    return Image.fromarray(pixels)


def _rotate(image: Image.Image, degrees: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    return image.rotate(degrees, resample=Image.Resampling.BICUBIC, fillcolor=(255, 255, 255))


def _fine_print_blur(image: Image.Image, sigma: float, doc_id: str, seed: int, boxes: Sequence[Box]) -> Image.Image:
    if not boxes:
        raise DataError(f"page {doc_id!r} has no fine-print boxes for fine_print_blur")
    blurred, out = image.filter(ImageFilter.GaussianBlur(sigma)), image.copy()
    pad = math.ceil(sigma)
    for x0, y0, x1, y1 in boxes:
        box = (max(0, x0 - pad), max(0, y0 - pad), min(image.width, x1 + pad), min(image.height, y1 + pad))
        out.paste(blurred.crop(box), box)
    return out


@dataclass(frozen=True)
class _Kind:
    apply: Callable[[Image.Image, float, str, int, Sequence[Box]], Image.Image]
    low: float
    high: float
    meaning: str
    study: tuple[float, ...]
    """Strengths a study runs when given only the name (mild to harsh)."""
    off: tuple[float, ...] = (0.0,)


DEGRADATIONS: dict[str, _Kind] = {
    "gaussian_blur": _Kind(_blur, 0, 50, "standard deviation in pixels", (0.5, 1.0, 2.0)),
    "jpeg": _Kind(_jpeg, 1, 100, "JPEG quality (0 = off)", (20.0, 10.0, 5.0)),
    "downscale": _Kind(_downscale, 1, 64, "shrink factor (0 or 1 = off)", (1.5, 2.0, 3.0), off=(0.0, 1.0)),
    "salt_pepper": _Kind(_salt_pepper, 0, 1, "fraction of pixels", (0.005, 0.01, 0.02)),
    "rotate": _Kind(_rotate, -45, 45, "degrees counter-clockwise", (1.0, 2.0, 5.0)),
    "fine_print_blur": _Kind(_fine_print_blur, 0, 50, "standard deviation in pixels, fine print only",
                             (0.5, 1.0, 2.0)),
}
"""Every degradation by name (module docstring)."""


@dataclass(frozen=True)
class Degradation:
    """One named degradation at one strength; ``seed`` (with the page's ``doc_id``) seeds random ones."""

    name: str
    strength: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        kind = DEGRADATIONS.get(self.name)
        if kind is None:
            raise ValueError(f"unknown degradation {self.name!r}: choose from {', '.join(DEGRADATIONS)}")
        strength = self.strength
        if not isinstance(strength, (int, float)) or isinstance(strength, bool) or not math.isfinite(strength):
            raise ValueError(f"{self.name} strength must be a finite number, got {strength!r}")
        if strength not in kind.off and not kind.low <= strength <= kind.high:
            raise ValueError(f"{self.name} strength ({kind.meaning}) must be in [{kind.low:g}, {kind.high:g}]"
                             f"{'' if kind.low <= 0 <= kind.high else ' or 0 (off)'}, got {strength:g}")

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> Degradation:
        """``"name:strength"`` (``"gaussian_blur:1.5"``); a clear error names the bad spec."""
        name, sep, value = str(spec).partition(":")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"bad degradation {spec!r}: expected NAME:STRENGTH, e.g. gaussian_blur:1.5 "
                             f"(names: {', '.join(DEGRADATIONS)})")
        try:
            strength = float(value)
        except ValueError:
            raise ValueError(f"bad degradation {spec!r}: strength {value!r} is not a number") from None
        try:
            return cls(name.strip(), strength, seed)
        except ValueError as error:
            raise ValueError(f"bad degradation {spec!r}: {error}") from None

    @property
    def is_identity(self) -> bool:
        return self.strength in DEGRADATIONS[self.name].off

    @property
    def severity(self) -> float:
        """How strong it is, comparable within a name: 0 when off; JPEG's quality counts down (5 is worse than 20)."""
        if self.is_identity:
            return 0.0
        return 101 - self.strength if self.name == "jpeg" else abs(self.strength)

    @property
    def needs_boxes(self) -> bool:
        """Whether :meth:`apply` needs the page's fine-print boxes."""
        return self.name == "fine_print_blur" and not self.is_identity

    def __str__(self) -> str:
        return f"{self.name}:{self.strength:g}"

    def apply(self, image: Image.Image, doc_id: str = "", boxes: Sequence[Box] = ()) -> Image.Image:
        """The degraded page (RGB); strength 0 returns ``image`` itself. ``boxes``: fine-print boxes in pixels."""
        if self.is_identity:
            return image
        return DEGRADATIONS[self.name].apply(image.convert("RGB"), self.strength, doc_id, self.seed, boxes)


def fine_print_boxes(pages_file: str | Path) -> dict[str, list[Box]]:
    """``doc_id -> fine-print boxes`` from a ``pages.jsonl`` written by :mod:`hkrag.data.synthetic`."""
    path = Path(pages_file)
    if not path.is_file():
        raise DataError(f"fine_print_blur needs the fine-print boxes of every page: {path} does not exist "
                        f"(the built-in corpus writes it beside its corpus folder; pass boxes=<pages.jsonl>)")
    boxes = {}
    for page in read_jsonl(path, keys=("doc_id", "items")):
        boxes[page["doc_id"]] = [tuple(item["box"]) for item in page["items"] if item["kind"] == FINE_PRINT]
    return boxes


def degrade_corpus(
    source: str | Path,
    out: str | Path,
    degradation: Degradation | str,
    configs: Sequence[str] | None = None,
    splits: Sequence[str] | None = None,
    boxes: str | Path | None = None,
) -> Path:
    """Write a copy of the corpus ``source`` to ``out`` with every page degraded; doc_ids and order unchanged.

    Only ``doc_id`` and ``image`` are copied: a degraded page's text must be read again (``hkrag.data.ocr``).
    ``configs``/``splits`` restrict the copy (default: all of the source's card). Each split is written
    atomically and recorded in ``out/degradation.json``; a rerun with the same degradation and source skips
    the splits already written (resuming an interrupted run). Returns ``out``.
    """
    source, out = local_or_hub(source), Path(out)
    spec = Degradation.parse(degradation) if isinstance(degradation, str) else degradation
    if out.resolve() == Path(source).resolve():
        raise ValueError(f"out {out} is the source corpus: write the degraded copy to a new folder")
    pairs = corpus_splits(source, configs, splits)
    page_boxes = fine_print_boxes(boxes or Path(source).parent / PAGES_FILE) if spec.needs_boxes else {}
    record = {"degradation": str(spec), "seed": spec.seed, "source": str(source), "done": []}
    previous = _read_record(out / DONE_FILE)
    if {k: v for k, v in previous.items() if k != "done"} == {k: v for k, v in record.items() if k != "done"}:
        record["done"] = previous["done"]
    for config, split in pairs:
        if f"{config}/{split}" in record["done"] and any((out / config).glob(f"{split}-*.parquet")):
            logger.info("%s/%s of %s already written to %s", config, split, spec, out)
            continue
        corpus = load_corpus(source, config, split, max_pixels=None)
        save_split(_degraded_rows(corpus, spec, page_boxes), out, config, split, CORPUS_FEATURES)
        record["done"] = sorted({*record["done"], f"{config}/{split}"})
        write_json(out / DONE_FILE, record)
    return out


def _read_record(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _degraded_rows(corpus: Corpus, spec: Degradation, boxes: dict[str, list[Box]]) -> Iterator[dict[str, Any]]:
    images = corpus.dataset.select_columns(["doc_id", "image"])
    for row in tqdm(images, total=len(corpus), desc=f"{spec} {corpus.name}", unit="page"):
        doc_id = row["doc_id"]
        if spec.is_identity:
            yield {"doc_id": doc_id, "image": row["image"]}
            continue
        if spec.needs_boxes and doc_id not in boxes:
            raise DataError(f"{corpus.name}: page {doc_id!r} has no fine-print boxes in the pages file")
        image = spec.apply(open_image(row["image"], doc_id, max_pixels=None), doc_id, boxes.get(doc_id, ()))
        yield {"doc_id": doc_id, "image": {"bytes": page_png(image), "path": None}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="corpus folder in the hub layout, or a hub id (owner/name)")
    parser.add_argument("degradation", help=f"NAME:STRENGTH, NAME one of {', '.join(DEGRADATIONS)}")
    parser.add_argument("--out", required=True, type=Path, help="new corpus folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of random degradations (default: 0)")
    parser.add_argument("--config", action="append", dest="configs", help="config to copy (repeat; default: all)")
    parser.add_argument("--split", action="append", dest="splits", help="split to copy (repeat; default: all)")
    parser.add_argument("--boxes", type=Path, help="pages.jsonl with fine-print boxes (default: beside the source)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        spec = Degradation.parse(args.degradation, args.seed)
        degrade_corpus(args.source, args.out, spec, args.configs, args.splits, args.boxes)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
