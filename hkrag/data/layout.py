"""Layout regions (SCAN, arXiv 2505.14381): gold boxes of the built-in corpus, a detector, and regions for a corpus.

    python -m hkrag.data.layout train data/synthetic --out runs/layout --minutes 10        # detector on train pages
    python -m hkrag.data.layout evaluate data/synthetic --model runs/layout/model          # matching IoU, test split
    python -m hkrag.data.layout detect data/synthetic/corpus --model runs/layout/model --out data/synthetic_regions
    python -m hkrag.data.layout select data/synthetic_regions --out data/regions_t05 --threshold 0.5   # no detector

*Gold boxes* (:func:`gold_pages`) come from the built-in corpus (:mod:`hkrag.data.synthetic`): every page of
``pages.jsonl`` is drawn again from its recorded spec and the corpus's ``synthetic_config.json`` (the stored strings
must come back identical, else the folder was written by other code and is refused), and
:func:`~hkrag.data.synthetic.page_regions` gives its ``title``, ``semantic_box`` and ``footer`` boxes.

The *detector* is SCAN's own architecture, RT-DETR (Sec. 3.1.2), from the ``transformers`` library the project
already depends on (``RTDetrForObjectDetection``; Apache-2.0): a small random-initialised configuration
(:func:`new_detector`) trained on the built-in train split, or a user's detector loaded with ``--model PATH`` from
a folder in the library's own format (``save_pretrained``: ``config.json``, weights, ``preprocessor_config.json``;
any ``transformers`` object-detection model whose labels are SCAN's classes). Its boxes go through SCAN's selection
(:func:`hkrag.data.regions.select`) and are scored by the matching-based IoU.

``detect`` writes, for every config/split of a corpus, ``<out>/<config>/<split>.jsonl`` (one row per page:
``doc_id``, page ``size``, the detector's ``candidates`` and the ``selected`` boxes, each ``[x0, y0, x1, y1, class,
score]``), ``<out>/layout_report.json`` and ``<out>/layout_failures.json``. Detections are cached one file per
page under ``<out>/.cache/layout``, keyed by the stored image bytes and the detector folder's files; they are
stored before selection, so a rerun (with any selection settings) detects nothing again and an interrupted run
resumes. A page that cannot be read, or has no box left after
selection, is kept (empty boxes, its ``error``), listed in the failures file and retried by the next run.
``select`` is the selection stage on its own: it reads a ``detect`` folder's candidates and writes the same files
with the boxes other selection settings keep, without the detector.
See docs/data.md, "Region units (SCAN)".
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from hkrag.data.images import open_image, page_png
from hkrag.data.ocr import _image_bytes, corpus_splits
from hkrag.data.opendocvqa import DataError, load_corpus
from hkrag.data.regions import ALPHA, BETA, CLASSES, THRESHOLD, Region, corpus_matching_iou, select
from hkrag.data.synthetic import (
    CONFIG_FILE,
    PageSpec,
    SyntheticConfig,
    TextItem,
    _font,
    page_regions,
    render_page,
)
from hkrag.io import atomic_directory, read_json, read_jsonl, write_bytes, write_json, write_text

logger = logging.getLogger(__name__)

REPORT_FILE = "layout_report.json"
FAILURES_FILE = "layout_failures.json"
CACHE_SUBDIR = Path(".cache") / "layout"
TRAIN_REPORT = "train_report.json"


class LayoutError(ValueError):
    """A detector folder or a layout input that cannot be used; the message names it."""


@dataclass(frozen=True)
class GoldPage:
    """One built-in page: its split, image, drawn SCAN boxes and drawn strings."""

    doc_id: str
    split: str
    image: Image.Image
    regions: tuple[Region, ...]
    items: tuple[TextItem, ...] = ()

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


@dataclass(frozen=True)
class SelectionSettings:
    """SCAN's selection settings (Sec. 3.2): minimum confidence, coverage and non-overlap weights."""

    threshold: float = THRESHOLD
    alpha: float = ALPHA
    beta: float = BETA


def gold_pages(root: str | Path, split: str | None = None) -> list[GoldPage]:
    """Every page (of ``split``, when given) of a built-in corpus folder with its drawn SCAN boxes.

    Raises :class:`LayoutError` naming the file when the folder is no built-in corpus, or naming the page when
    drawing its spec again does not give back the strings ``pages.jsonl`` recorded.
    """
    root = Path(root)
    for name in (CONFIG_FILE, "pages.jsonl"):
        if not (root / name).is_file():
            raise LayoutError(f"{root / name} is missing: gold boxes come from a built-in corpus folder "
                              f"(python -m hkrag.data.synthetic --out {root})")
    config = SyntheticConfig(**read_json(root / CONFIG_FILE))
    fields = [f.name for f in dataclasses.fields(PageSpec)]
    pages = []
    for line_no, row in enumerate(read_jsonl(root / "pages.jsonl", keys=(*fields, "split", "items")), start=1):
        if split is not None and row["split"] != split:
            continue
        spec = PageSpec(**{**{name: row[name] for name in fields}, "bars": tuple(row["bars"])})
        image, items = render_page(spec, config)
        if [(i.text, list(i.box)) for i in items] != [(i["text"], list(i["box"])) for i in row["items"]]:
            raise LayoutError(f"{root / 'pages.jsonl'}, line {line_no} ({spec.doc_id}): drawing the page again "
                              "does not give the recorded strings (written by another version?)")
        regions = tuple(Region(box, label) for label, box in page_regions(spec, config))
        pages.append(GoldPage(spec.doc_id, row["split"], image, regions, tuple(items)))
    if not pages:
        raise LayoutError(f"{root / 'pages.jsonl'} has no {split or ''} pages")
    return pages


def new_detector(size: tuple[int, int], seed: int = 0) -> tuple[Any, Any]:
    """A small random-initialised RT-DETR (ResNet-style backbone of one block per stage, 64-wide hybrid encoder,
    two decoder layers, 30 queries) and its image processor, which resizes pages of ``size`` (width, height) to the
    next multiples of 32 (the encoder's feature pyramid halves three times from stride 8)."""
    import torch
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig
    from transformers.models.rt_detr.image_processing_pil_rt_detr import RTDetrImageProcessorPil

    backbone = RTDetrResNetConfig(embedding_size=32, hidden_sizes=[64, 128, 256, 512], depths=[1, 1, 1, 1])
    backbone.out_features = ["stage2", "stage3", "stage4"]
    config = RTDetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, d_model=64, encoder_hidden_dim=64,
        encoder_in_channels=[128, 256, 512], decoder_in_channels=[64, 64, 64], encoder_ffn_dim=128,
        decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=2, num_queries=30,
        num_denoising=10, id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)})
    torch.manual_seed(seed)
    padded = {"height": -(-size[1] // 32) * 32, "width": -(-size[0] // 32) * 32}
    processor = RTDetrImageProcessorPil(do_resize=True, size=padded, do_normalize=False)
    return RTDetrForObjectDetection(config), processor


def load_detector(path: str | Path) -> tuple[Any, Any]:
    """A detector and its image processor from a ``save_pretrained`` folder (module docstring).

    Raises :class:`LayoutError` naming ``path`` when it is not one, or when a label is not one of SCAN's classes.
    """
    from transformers import AutoImageProcessor, AutoModelForObjectDetection

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "preprocessor_config.json").is_file():
        raise LayoutError(f"{path} is not a detector folder in the transformers format (needs config.json, "
                          "preprocessor_config.json and weights, as save_pretrained writes)")
    try:
        model, info = AutoModelForObjectDetection.from_pretrained(path, output_loading_info=True)
        processor = AutoImageProcessor.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - loaders raise many types (safetensors' own among them)
        raise LayoutError(f"{path} is not a transformers object detector: {type(error).__name__}: {error}") from error
    unloaded = sorted({str(key[0] if isinstance(key, tuple) else key)
                       for kind in ("missing_keys", "mismatched_keys") for key in info.get(kind) or ()})
    if unloaded:  # the library would start these weights from random values and only warn
        raise LayoutError(f"{path}: its weights do not fit its config.json ({len(unloaded)} tensors missing or of "
                          f"another shape, e.g. {unloaded[:3]})")
    unknown = sorted(set(model.config.id2label.values()) - set(CLASSES))
    if unknown:
        raise LayoutError(f"{path}: labels {unknown} are not SCAN's classes {list(CLASSES)}")
    return model.eval(), processor


def detect(model: Any, processor: Any, images: Sequence[Image.Image]) -> list[list[Region]]:
    """Every box the detector scores (the library's own post-processing: sigmoid scores, top queries), clipped to
    its page, as candidates for :func:`~hkrag.data.regions.select`; boxes with no area left are dropped."""
    import torch

    with torch.inference_mode():
        inputs = processor(images=list(images), return_tensors="pt")
        outputs = model(pixel_values=inputs["pixel_values"])
    sizes = [(image.height, image.width) for image in images]
    results = processor.post_process_object_detection(outputs, threshold=0.0, target_sizes=sizes)
    pages = []
    for (height, width), result in zip(sizes, results):
        regions = []
        for score, label, box in zip(result["scores"].tolist(), result["labels"].tolist(), result["boxes"].tolist()):
            x0, y0, x1, y1 = max(0.0, box[0]), max(0.0, box[1]), min(float(width), box[2]), min(float(height), box[3])
            if x0 < x1 and y0 < y1:
                regions.append(Region((x0, y0, x1, y1), model.config.id2label[label], score))
        pages.append(regions)
    return pages


def _targets(pages: Sequence[GoldPage]) -> list[dict[str, Any]]:
    """Gold boxes as RT-DETR's training labels: class indices and normalised (centre x, centre y, width, height)."""
    import torch

    targets = []
    for page in pages:
        width, height = page.size
        boxes = [((x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height)
                 for x0, y0, x1, y1 in (r.box for r in page.regions)]
        targets.append({"class_labels": torch.tensor([CLASSES.index(r.label) for r in page.regions]),
                        "boxes": torch.tensor(boxes, dtype=torch.float32)})
    return targets


def train_detector(
    root: str | Path, out: str | Path, minutes: float = 10.0, max_steps: int | None = None, batch_size: int = 8,
    lr: float = 1e-3, seed: int = 0,
) -> dict[str, Any]:
    """Train :func:`new_detector` on the built-in corpus's train pages for ``minutes`` of wall time (or
    ``max_steps``), then write ``<out>/model`` (``save_pretrained``) and ``<out>/train_report.json``."""
    import torch

    pages = gold_pages(root, "train")
    model, processor = new_detector(pages[0].size, seed)
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    rng = random.Random(seed)
    model.train()
    start, step, losses = time.monotonic(), 0, []
    while (max_steps is None or step < max_steps) and time.monotonic() - start < minutes * 60:
        batch = rng.sample(pages, min(batch_size, len(pages)))
        pixels = processor(images=[p.image for p in batch], return_tensors="pt")["pixel_values"]
        loss = model(pixel_values=pixels, labels=_targets(batch)).loss
        if not math.isfinite(loss.item()):
            raise LayoutError(f"training diverged at step {step} (loss {loss.item()}): lower lr (got {lr})")
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimiser.step()
        losses.append(round(loss.item(), 4))
        step += 1
    out = Path(out)
    with atomic_directory(out / "model") as folder:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
    report = {"corpus": str(root), "train_pages": len(pages), "steps": step, "batch_size": batch_size, "lr": lr,
              "seed": seed, "seconds": round(time.monotonic() - start, 1), "loss_first": losses[:5],
              "loss_last": losses[-5:], "parameters": sum(p.numel() for p in model.parameters())}
    write_json(out / TRAIN_REPORT, report)
    return report


def evaluate_detector(
    root: str | Path, model_path: str | Path | None, split: str = "test",
    settings: SelectionSettings = SelectionSettings(), batch_size: int = 16,
) -> dict[str, Any]:
    """SCAN's matching-based IoU on a built-in split, after selection (also per style, the doc id's prefix) and for
    every candidate at or above the threshold; ``model_path`` None scores the gold boxes against themselves (1.0)."""
    pages = gold_pages(root, split)
    if model_path is None:
        candidates = [list(p.regions) for p in pages]
    else:
        model, processor = load_detector(model_path)
        candidates = [regions for start in range(0, len(pages), batch_size)
                      for regions in detect(model, processor, [p.image for p in pages[start:start + batch_size]])]
    selected = [select(c, p.size, **dataclasses.asdict(settings), page=p.doc_id) for c, p in zip(candidates, pages)]
    gold = [[r.box for r in p.regions] for p in pages]

    def score(predicted: list[list[Region]]) -> dict[str, float]:
        return corpus_matching_iou((p.doc_id, [r.box for r in boxes], g) for p, boxes, g in zip(pages, predicted, gold))

    above = [[r for r in c if r.score >= settings.threshold] for c in candidates]
    styles = sorted({p.doc_id.split("-")[0] for p in pages})
    by_style = {style: corpus_matching_iou((p.doc_id, [r.box for r in boxes], g)
                                           for p, boxes, g in zip(pages, selected, gold)
                                           if p.doc_id.startswith(style + "-"))["pooled"] for style in styles}
    return {"split": split, "model": str(model_path) if model_path else "gold", **dataclasses.asdict(settings),
            "selected": score(selected), "above_threshold": score(above), "selected_by_style": by_style,
            "boxes_per_page": {name: sum(map(len, boxes)) / len(pages)
                               for name, boxes in (("gold", gold), ("selected", selected), ("above_threshold", above))}}


CLASS_COLOURS = {"semantic_box": (214, 39, 40), "title": (31, 119, 180), "header": (148, 103, 189),
                 "footer": (44, 160, 44), "date": (255, 127, 14), "author": (140, 86, 75)}


def draw_regions(image: Image.Image, regions: Sequence[Region], scale: int = 2) -> Image.Image:
    """The page enlarged ``scale`` times with each box outlined in its class's colour and labelled with its class
    (and confidence, when below 1)."""
    from PIL import ImageDraw

    page = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(page)
    for region in regions:
        colour = CLASS_COLOURS[region.label]
        x0, y0, x1, y1 = (v * scale for v in region.box)
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), outline=colour, width=2)
        name = region.label if region.score >= 1 else f"{region.label} {region.score:.2f}"
        draw.text((x0 + 3, y1 - 3), name, fill=colour, font=_font(11), anchor="ld")
    return page


def figure(
    root: str | Path, model_path: str | Path, out: str | Path, split: str = "test",
    settings: SelectionSettings = SelectionSettings(),
) -> Path:
    """A PNG of the first page of every style of a built-in split: gold boxes (left) beside the detector's
    selected boxes (right)."""
    pages = gold_pages(root, split)
    firsts = list({p.doc_id.split("-")[0]: p for p in reversed(pages)}.values())[::-1]
    model, processor = load_detector(model_path)
    found = detect(model, processor, [p.image for p in firsts])
    panels = [(draw_regions(p.image, p.regions),
               draw_regions(p.image, select(c, p.size, **dataclasses.asdict(settings), page=p.doc_id)))
              for p, c in zip(firsts, found)]
    width, height = panels[0][0].size
    sheet = Image.new("RGB", (2 * width + 12, len(panels) * (height + 12)), (255, 255, 255))
    for row, (gold, chosen) in enumerate(panels):
        sheet.paste(gold, (0, row * (height + 12)))
        sheet.paste(chosen, (width + 12, row * (height + 12)))
    return write_bytes(out, page_png(sheet))


def _fingerprint(model_path: Path) -> str:
    """A hash of the detector folder's files (names and bytes): a changed detector never reads a stale cache."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_path.rglob("*") if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _row(region: Region) -> list[Any]:
    return [*[round(v, 2) for v in region.box], region.label, round(region.score, 4)]


def write_regions(
    source: str | Path, out: str | Path, model_path: str | Path, settings: SelectionSettings = SelectionSettings(),
    configs: Sequence[str] | None = None, splits: Sequence[str] | None = None, batch_size: int = 16,
) -> dict[str, Any]:
    """Detect and select regions on every page of a corpus (module docstring); returns the report."""
    model_path, out = Path(model_path), Path(out)
    model, processor = load_detector(model_path)
    cache = out / CACHE_SUBDIR
    engine = _fingerprint(model_path)
    report: dict[str, Any] = {"source": str(source), "model": str(model_path), **dataclasses.asdict(settings),
                              "pages": 0, "detected": 0, "cached": 0, "failed": []}
    for config, split in corpus_splits(source, configs, splits):
        corpus = load_corpus(source, config, split)
        rows = []
        for start in range(0, len(corpus), batch_size):
            batch = corpus.dataset[start:start + batch_size]
            pending = []
            for doc_id, stored in zip(batch["doc_id"], batch["image"]):
                data, problem = _image_bytes(stored)
                row = {"doc_id": doc_id, "size": None, "candidates": [], "selected": []}
                rows.append(row)
                if problem:
                    row["error"] = problem
                    continue
                key = hashlib.sha256(engine.encode() + b"\0" + data).hexdigest()
                cached = cache / key[:2] / f"{key}.json"
                if cached.is_file():
                    row.update(json.loads(cached.read_text()))
                    report["cached"] += 1
                    continue
                try:
                    pending.append((row, cached, open_image(data, doc_id)))
                except Exception as error:  # noqa: BLE001 - a page that fails is reported, never fatal
                    row["error"] = f"{type(error).__name__}: {error}"
            if pending:
                found = detect(model, processor, [image for _, _, image in pending])
                for (row, cached, image), regions in zip(pending, found):
                    row.update({"size": list(image.size), "candidates": [_row(r) for r in regions]})
                    write_json(cached, {"size": row["size"], "candidates": row["candidates"]}, indent=None)
                    report["detected"] += 1
        _select_rows(rows, settings, config, split, report)
        write_text(out / config / f"{split}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    return _finish(out, report)


def _select_rows(rows: list[dict[str, Any]], settings: SelectionSettings, config: str, split: str,
                 report: dict[str, Any]) -> None:
    """SCAN's selection over each readable row's ``candidates`` (in place); a row unread, or with no box kept, goes
    to ``report["failed"]`` with its ``error``."""
    for row in rows:
        report["pages"] += 1
        if "error" not in row:
            candidates = [Region(tuple(c[:4]), c[4], c[5]) for c in row["candidates"]]
            row["selected"] = [_row(r) for r in select(candidates, tuple(row["size"]),
                                                       **dataclasses.asdict(settings), page=row["doc_id"])]
            if not row["selected"]:
                row["error"] = f"no box at or above confidence {settings.threshold}"
        if "error" in row:
            report["failed"].append({"config": config, "split": split, "doc_id": row["doc_id"],
                                     "error": row["error"]})


def _finish(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Write the failures and the report beside the regions; warn once per failed page."""
    write_json(out / FAILURES_FILE, report["failed"])
    write_json(out / REPORT_FILE, report)
    for failure in report["failed"]:
        logger.warning("%s/%s %s: %s", failure["config"], failure["split"], failure["doc_id"], failure["error"])
    return report


def reselect(regions: str | Path, out: str | Path, settings: SelectionSettings = SelectionSettings()) -> dict[str, Any]:
    """SCAN's selection again, with ``settings``, over the candidates a ``detect`` run stored in ``regions``
    (``<config>/<split>.jsonl``), written to ``out`` in the same layout; no detector is loaded. Pages ``detect``
    could not read stay failed; a page that kept no box before is selected again."""
    regions, out = Path(regions), Path(out)
    if regions.resolve() == out.resolve():
        raise LayoutError(f"--out {out} is the detect folder it reads: write the new selection elsewhere")
    files = sorted(path for path in regions.glob("*/*.jsonl") if not path.parent.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{regions} holds no <config>/<split>.jsonl: run `python -m hkrag.data.layout "
                                "detect ... --out` on the corpus first")
    report: dict[str, Any] = {"source": str(regions), **dataclasses.asdict(settings), "pages": 0, "failed": []}
    for path in files:
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except ValueError as error:
                raise LayoutError(f"{path}, line {number} is not JSON ({error})") from None
            if not isinstance(row, dict) or "size" not in row or not isinstance(row.get("candidates"), list):
                raise LayoutError(f"{path}, line {number} is not a detect row (doc_id, size, candidates)")
            if row["size"] is not None:
                row.pop("error", None)
            rows.append(row)
        _select_rows(rows, settings, path.parent.name, path.stem, report)
        write_text(out / path.parent.name / path.name, "".join(json.dumps(row) + "\n" for row in rows))
    return _finish(out, report)


def _settings(args: argparse.Namespace) -> SelectionSettings:
    return SelectionSettings(args.threshold, args.alpha, args.beta)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train the detector on a built-in corpus's train split")
    train.add_argument("corpus", type=Path, help="built-in corpus folder (python -m hkrag.data.synthetic)")
    train.add_argument("--out", required=True, type=Path, help="folder for model/ and train_report.json")
    train.add_argument("--minutes", type=float, default=10.0, help="wall-time budget (default: 10)")
    train.add_argument("--max-steps", type=int, help="stop after this many steps (default: the budget decides)")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    evaluate = commands.add_parser("evaluate", help="matching-based IoU on a built-in split")
    evaluate.add_argument("corpus", type=Path, help="built-in corpus folder")
    evaluate.add_argument("--model", type=Path, help="detector folder (default: the gold boxes themselves)")
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument("--out", type=Path, help="write the report here as JSON")
    sheet = commands.add_parser("figure", help="PNG of a page per style: gold and selected boxes side by side")
    sheet.add_argument("corpus", type=Path, help="built-in corpus folder")
    sheet.add_argument("--model", required=True, type=Path, help="detector folder")
    sheet.add_argument("--split", default="test")
    sheet.add_argument("--out", required=True, type=Path, help="PNG file to write")
    run = commands.add_parser("detect", help="write regions for every page of a corpus")
    run.add_argument("source", help="corpus folder in the hub layout, or a hub id")
    run.add_argument("--model", required=True, type=Path, help="detector folder (transformers save_pretrained)")
    run.add_argument("--out", required=True, type=Path, help="folder for <config>/<split>.jsonl and reports")
    run.add_argument("--config", action="append", dest="configs", help="config to read (repeat; default: all)")
    run.add_argument("--split", action="append", dest="splits", help="split to read (repeat; default: all)")
    again = commands.add_parser("select", help="SCAN's selection again over a detect folder's candidates")
    again.add_argument("regions", type=Path, help="a detect --out folder")
    again.add_argument("--out", required=True, type=Path, help="folder for the new <config>/<split>.jsonl")
    for command in (evaluate, sheet, run, again):
        command.add_argument("--threshold", type=float, default=THRESHOLD, help=f"minimum confidence ({THRESHOLD})")
        command.add_argument("--alpha", type=float, default=ALPHA, help=f"coverage weight ({ALPHA})")
        command.add_argument("--beta", type=float, default=BETA, help=f"non-overlap weight ({BETA})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "train":
            result = train_detector(args.corpus, args.out, args.minutes, args.max_steps, args.batch_size, args.lr,
                                    args.seed)
        elif args.command == "evaluate":
            result = evaluate_detector(args.corpus, args.model, args.split, _settings(args))
            if args.out:
                write_json(args.out, result)
        elif args.command == "figure":
            result = {"figure": str(figure(args.corpus, args.model, args.out, args.split, _settings(args)))}
        else:
            if args.command == "select":
                result = reselect(args.regions, args.out, _settings(args))
            else:
                result = write_regions(args.source, args.out, args.model, _settings(args), args.configs, args.splits)
            result = {key: value for key, value in result.items() if key != "failed"} | {
                "failed": len(result["failed"])}
    except (LayoutError, DataError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
