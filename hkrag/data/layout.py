"""Layout regions (SCAN, arXiv 2505.14381): gold boxes of the built-in corpus, a detector, and regions for a corpus.

    python -m hkrag.data.layout train data/synthetic --out runs/layout --steps 600        # detector on train pages
    python -m hkrag.data.layout evaluate data/synthetic --model weights/layout_tiny/model # matching IoU, test split
    python -m hkrag.data.layout detect data/synthetic/corpus --model weights/layout_tiny/model --out data/regions
    python -m hkrag.data.layout select data/regions --out data/regions_t05 --threshold 0.5   # no detector
    python -m hkrag.data.layout train data/synthetic --out runs/layout_cf --folds 2      # + cross-fitting detectors
    python -m hkrag.data.layout detect data/synthetic/corpus --folds runs/layout_cf --out data/regions_cf

*Gold boxes* (:func:`gold_pages`) come from the built-in corpus (:mod:`hkrag.data.synthetic`): every page of
``pages.jsonl`` is drawn again from its recorded spec and the corpus's ``synthetic_config.json`` (the stored strings
must come back identical, else the folder was written by other code and is refused), and
:func:`~hkrag.data.synthetic.page_regions` gives its ``title``, ``semantic_box`` and ``footer`` boxes.

The *detector* is SCAN's own architecture, RT-DETR (Sec. 3.1.2), from the ``transformers`` library the project
already depends on (``RTDetrForObjectDetection``; Apache-2.0): a small random-initialised configuration
(:func:`new_detector`) trained on the built-in train split for a number of steps (the same weights on every run of
one seed and thread count, by default one thread, on one machine), or a user's detector loaded with ``--model
PATH`` from a folder in the library's own format (``save_pretrained``: ``config.json``, weights,
``preprocessor_config.json``; any ``transformers`` object-detection model whose labels are SCAN's classes). Its
boxes go through SCAN's selection (:func:`hkrag.data.regions.select`) and are scored by the matching-based IoU.
``ship`` writes a run with its evaluation and a manifest of sha256 (``weights/layout_tiny``, the shipped one),
checked whenever it is loaded.

``detect`` writes, for every config/split of a corpus, ``<out>/<config>/<split>.jsonl`` (one row per page:
``doc_id``, page ``size``, the ``detector`` folder that detected it, the detector's ``candidates`` and the
``selected`` boxes, each ``[x0, y0, x1, y1, class, score]``, rounded to 2 decimals), ``<out>/layout_report.json``
and ``<out>/layout_failures.json``. Detections are cached one file per page under ``<out>/.cache/layout``, keyed by
the stored image bytes and the detector folder's files; they are stored before selection, so a rerun (with any
selection settings) detects nothing again and an interrupted run resumes. A candidate with no area left after
clipping to the page and rounding, and a stored candidate that is no region of its page (outside it, of zero area,
not finite, a class SCAN does not have), is dropped and counted (``dropped_boxes``, a warning naming the page and
box), never raised on. A page that cannot be read, or has no box left after selection, is kept (empty boxes, its
``error``), listed in the failures file and retried by the next run. ``select`` is the selection stage on its own:
it reads a ``detect`` folder's candidates and writes the same files with the boxes other selection settings keep,
without the detector.

*Cross-fitting* (``train --folds K``, ``detect --folds``): K more detectors, each trained on the train pages
outside one fold of the documents (:func:`fold_of`), so that every training page is detected by a detector that
never trained on it (:class:`Detectors`; pages not in the folds, e.g. the test split, by the full detector): the
crops a region reader trains and chooses its recipe on are then as far from the detector's training data as the
test pages' are. ``train --jobs J`` trains J detectors at once, and a detector already in its folder with the
same pages and settings is kept (:func:`finished_detector`), so an interrupted run resumes. Each detector folder
lists the pages it trained on (:data:`TRAINED_ON`); without ``--folds``,
``detect`` counts the pages its detector trained on (``seen_in_training``) and warns.
See docs/data.md, "Region units (SCAN)".
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from hkrag.data.images import open_image, page_png
from hkrag.data.ocr import _image_bytes, corpus_splits
from hkrag.data.opendocvqa import DataError, load_corpus
from hkrag.data.regions import (
    ALPHA,
    BETA,
    CLASSES,
    MATCH_IOU,
    THRESHOLD,
    Region,
    check_region,
    corpus_matching_iou,
    matching_pairs,
    rounded,
    select,
)
from hkrag.data.splits import page_group
from hkrag.data.synthetic import (
    CONFIG_FILE,
    PageSpec,
    SyntheticConfig,
    TextItem,
    _font,
    page_regions,
    render_page,
)
from hkrag.io import atomic_directory, local_path, read_json, read_jsonl, write_bytes, write_json, write_text

logger = logging.getLogger(__name__)

REPORT_FILE = "layout_report.json"
FAILURES_FILE = "layout_failures.json"
CACHE_SUBDIR = Path(".cache") / "layout"
TRAIN_REPORT = "train_report.json"
TRAINED_ON = "trained_on.json"
"""In a detector folder ``train`` wrote: the doc ids of the pages it trained on (``detect`` checks it)."""
FOLDS_FILE = "folds.json"
"""In a ``train --folds`` folder: ``{"folds": K, "seed": s, "pages": {train page: fold}}``."""
STEPS = 600
BATCH_SIZE = 8
LR = 1e-3
MAX_STEPS = 10**7
THREADS = 1
"""The detector's training settings (``train``'s defaults; docs/data.md, "The detector")."""


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


def check_number(
    value: Any, name: str, low: float, high: float, integer: bool = False, open_low: bool = False,
) -> Any:
    """``value`` when it is a finite number (an integer when ``integer``) in ``[low, high]`` (``(low, high]`` when
    ``open_low``), else a :class:`LayoutError` naming ``name``, the value and the allowed range."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if ok and not isinstance(value, bool) and math.isfinite(value) and (low < value if open_low else low <= value) \
            and value <= high:
        return value
    bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
    raise LayoutError(f"{name} must be {kind} in {bound}, got {value!r}")


@dataclass(frozen=True)
class SelectionSettings:
    """SCAN's selection settings (Sec. 3.2): minimum confidence, coverage and non-overlap weights; each checked
    (:func:`check_number`: a confidence in [0, 1], weights finite and not negative)."""

    threshold: float = THRESHOLD
    alpha: float = ALPHA
    beta: float = BETA

    def __post_init__(self) -> None:
        check_number(self.threshold, "threshold", 0, 1)
        for name in ("alpha", "beta"):
            check_number(getattr(self, name), name, 0, 1e6)


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
    """A small random-initialised RT-DETR (ResNet-style backbone of one block per stage, 32 to 256 channels, 32-wide
    hybrid encoder, two decoder layers, 10 queries; 0.36 M parameters, 1.4 MiB of float32) and its image processor,
    which resizes pages of ``size`` (width, height) to the next multiples of 32 (the encoder's feature pyramid halves
    three times from stride 8). ``seed`` seeds torch's generator here: the initial weights and, in training, the
    denoising queries drawn from it."""
    import torch
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig
    from transformers.models.rt_detr.image_processing_pil_rt_detr import RTDetrImageProcessorPil

    backbone = RTDetrResNetConfig(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1])
    backbone.out_features = ["stage2", "stage3", "stage4"]
    config = RTDetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_hidden_dim=32,
        encoder_in_channels=[64, 128, 256], decoder_in_channels=[32, 32, 32], encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=2, num_queries=10,
        num_denoising=10, id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)})
    torch.manual_seed(seed)
    padded = {"height": -(-size[1] // 32) * 32, "width": -(-size[0] // 32) * 32}
    processor = RTDetrImageProcessorPil(do_resize=True, size=padded, do_normalize=False)
    return RTDetrForObjectDetection(config), processor


def load_detector(path: str | Path) -> tuple[Any, Any]:
    """A detector and its image processor from a ``save_pretrained`` folder (module docstring).

    Raises :class:`LayoutError` naming ``path`` when it is not one, or when a label is not one of SCAN's classes;
    a shipped detector (``weights/layout_tiny``) whose files differ from its manifest's sha256 is refused
    (``hkrag.models.phi3v.loading.verify_shipped``, as the shipped readers are). A relative path missing under the
    working directory is the repository's (``weights/layout_tiny/model`` from any folder: hkrag.io.local_path).
    """
    from transformers import AutoImageProcessor, AutoModelForObjectDetection

    from hkrag.models.phi3v.loading import CheckpointNotFoundError, verify_shipped

    path = local_path(path)
    try:
        verify_shipped(path)
    except CheckpointNotFoundError as error:
        raise LayoutError(str(error)) from None
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


def detect(model: Any, processor: Any, images: Sequence[Image.Image]) -> tuple[list[list[Region]], int]:
    """Every box the detector scores (the library's own post-processing: sigmoid scores, top queries), clipped to
    its page and rounded to :data:`~hkrag.data.regions.DECIMALS` decimals (as ``detect`` stores them, so evaluation
    and ``write_regions`` select on the same boxes), as candidates for :func:`~hkrag.data.regions.select`. A box
    with no area left after clipping and rounding (a sliver at the page's edge, e.g. ``(223.997, 40, 224, 60)``)
    is dropped: returns ``(candidates per page, boxes dropped)``."""
    import torch

    with torch.inference_mode():
        inputs = processor(images=list(images), return_tensors="pt")
        outputs = model(pixel_values=inputs["pixel_values"])
    sizes = [(image.height, image.width) for image in images]
    results = processor.post_process_object_detection(outputs, threshold=0.0, target_sizes=sizes)
    pages, dropped = [], 0
    for (height, width), result in zip(sizes, results):
        regions = []
        for score, label, box in zip(result["scores"].tolist(), result["labels"].tolist(), result["boxes"].tolist()):
            x0, y0, x1, y1 = rounded((max(0.0, box[0]), max(0.0, box[1]), min(float(width), box[2]),
                                      min(float(height), box[3])))
            if x0 < x1 and y0 < y1:
                regions.append(Region((x0, y0, x1, y1), model.config.id2label[label], score))
            else:
                dropped += 1
        pages.append(regions)
    return pages, dropped


def stored_candidates(row: dict[str, Any], where: str) -> tuple[list[Region], list[str]]:
    """The candidates of a ``detect`` row that are regions of its page (:func:`~hkrag.data.regions.check_region`)
    and, for each one that is not (zero area, outside the page, not finite, a class SCAN does not have, not a
    ``[x0, y0, x1, y1, class, score]`` entry), why, naming ``where`` (the page) and the box: stored candidates
    are dropped and counted, never raised on, so one damaged or stale entry cannot stop every rerun."""
    kept, problems = [], []
    for i, entry in enumerate(row.get("candidates") or []):
        try:
            if not isinstance(entry, list) or len(entry) != 6:
                raise ValueError(f"{where}, candidate {i}: {entry!r} is not [x0, y0, x1, y1, class, score]")
            kept.append(check_region(Region(rounded(entry[:4]), entry[4], entry[5]), tuple(row["size"]),
                                     f"{where}, candidate {i}"))
        except (TypeError, ValueError) as error:
            problems.append(str(error))
    return kept, problems


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


def training_steps(
    model: Any, processor: Any, pages: Sequence[GoldPage], steps: int, batch_size: int = BATCH_SIZE, lr: float = LR,
    seed: int = 0,
) -> Iterator[float]:
    """Train ``model`` on ``pages`` for exactly ``steps`` steps (AdamW at a constant ``lr``, gradients clipped to
    norm 0.1), yielding each step's loss. The batches are drawn by ``random.Random(seed)``; with
    :func:`new_detector`'s seeded weights the run is the same on every call on the same machine and thread count
    (tests/test_layout.py), and its first ``n`` steps are those of any longer run."""
    import torch

    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    rng = random.Random(seed)
    model.train()
    for step in range(steps):
        batch = rng.sample(list(pages), min(batch_size, len(pages)))
        pixels = processor(images=[p.image for p in batch], return_tensors="pt")["pixel_values"]
        loss = model(pixel_values=pixels, labels=_targets(batch)).loss
        if not math.isfinite(loss.item()):
            raise LayoutError(f"training diverged at step {step} (loss {loss.item()}): lower lr (got {lr})")
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimiser.step()
        yield loss.item()
    model.eval()


def fit_detector(
    pages: Sequence[GoldPage], out: str | Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
    seed: int = 0, threads: int = THREADS, **record: Any,
) -> dict[str, Any]:
    """:func:`new_detector` trained on ``pages`` (:func:`training_steps`) on ``threads`` intra-op threads (the
    float sums, so the weights, depend on the thread count: the default 1 fixes it; another CPU's vector
    instructions or another torch build may still change the last bits, not tested), written to ``<out>/model``
    (``save_pretrained``, with :data:`TRAINED_ON` naming the pages) and ``<out>/train_report.json`` (the settings,
    ``record`` and the loss); returns the report."""
    import torch

    steps = check_number(steps, "steps", 1, MAX_STEPS, integer=True)
    batch_size = check_number(batch_size, "batch size", 1, 4096, integer=True)
    lr = check_number(lr, "lr", 0, 1, open_low=True)
    threads = check_number(threads, "threads", 1, 1024, integer=True)
    out = Path(out)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, processor = new_detector(pages[0].size, seed)
        start = time.monotonic()
        losses = [round(loss, 4) for loss in training_steps(model, processor, pages, steps, batch_size, lr, seed)]
    finally:
        torch.set_num_threads(before)
    with atomic_directory(out / "model") as folder:
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        write_json(folder / TRAINED_ON, sorted(p.doc_id for p in pages))
    report = {**record, "train_pages": len(pages), "steps": steps, "batch_size": batch_size, "lr": lr,
              "seed": seed, "threads": threads, "seconds": round(time.monotonic() - start, 1),
              "loss_first": losses[:5], "loss_last": losses[-5:],
              "parameters": sum(p.numel() for p in model.parameters())}
    write_json(out / TRAIN_REPORT, report)
    return report


def _fit_listed(root: Path, out: Path, doc_ids: Sequence[str], settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`fit_detector` on the train pages ``doc_ids`` of ``root``, drawn again here (a process of its own)."""
    listed = set(doc_ids)
    return fit_detector([p for p in gold_pages(root, "train") if p.doc_id in listed], out, **settings)


def finished_detector(out: Path, doc_ids: Sequence[str], settings: dict[str, Any]) -> dict[str, Any] | None:
    """The report of a detector :func:`fit_detector` already wrote into ``out`` from the pages ``doc_ids`` with
    ``settings`` (each equal in its ``train_report.json``), else ``None``: a finished detector is kept, so an
    interrupted ``train --folds`` resumes with the first unfinished one, and a shipped detector copied into
    ``out`` (``model/`` and ``train_report.json``) stands for the full one."""
    try:
        report, trained_on = read_json(out / TRAIN_REPORT), read_json(out / "model" / TRAINED_ON)
    except (OSError, ValueError):
        return None
    expected = {"train_pages": len(doc_ids), **{key: value for key, value in settings.items() if key != "corpus"}}
    if not isinstance(report, dict) or any(report.get(key) != value for key, value in expected.items()) or (
            trained_on != sorted(doc_ids)):
        return None
    logger.info("%s already holds this detector (the same pages and settings): kept, not trained again", out)
    return report


def fold_of(doc_id: str, folds: int, seed: int = 0) -> int:
    """The cross-fitting fold of a page: by its document (:func:`hkrag.data.splits.page_group`, so a document's pages
    share one), from a hash of ``seed`` and the document's name (independent of order and corpus size)."""
    digest = hashlib.sha256(f"{seed}:{page_group(doc_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % folds


def train_detector(
    root: str | Path, out: str | Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
    seed: int = 0, folds: int = 0, threads: int = THREADS, jobs: int = 1,
) -> dict[str, Any]:
    """Train :func:`new_detector` on the built-in corpus's train pages for ``steps`` steps into ``<out>/model`` and
    ``<out>/train_report.json`` (:func:`fit_detector`). With ``folds`` K >= 2, also K cross-fitting detectors:
    ``<out>/fold-<k>/model`` trained on the train pages outside fold ``k`` (:func:`fold_of`), and
    ``<out>/folds.json`` mapping each train page to its fold, which ``detect --folds`` reads so that no page is
    detected by a detector that trained on it (module docstring). ``jobs`` > 1 trains that many detectors at once,
    each in its own process on ``threads`` threads (the same weights as one after the other); a detector already
    in ``out`` with these settings is kept (:func:`finished_detector`). Returns the full detector's report, with
    the folds' reports under ``folds``."""
    if not isinstance(folds, int) or folds == 1 or not 0 <= folds <= 1000:
        raise LayoutError(f"--folds {folds}: cross-fitting needs an integer in [2, 1000] (0: none)")
    jobs = check_number(jobs, "jobs", 1, 1024, integer=True)
    pages = gold_pages(root, "train")
    assignment = {p.doc_id: fold_of(p.doc_id, folds, seed) for p in pages} if folds else {}
    empty = sorted(set(range(folds)) - set(assignment.values()))
    if empty:  # checked before any training
        raise LayoutError(f"--folds {folds}: fold(s) {empty} of {root}'s train documents are empty; use fewer folds")
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "threads": threads,
                "corpus": str(root)}
    runs = [(Path(out), [p.doc_id for p in pages], {})] + [
        (Path(out) / f"fold-{k}", [p.doc_id for p in pages if assignment[p.doc_id] != k], {"fold": k, "folds": folds})
        for k in range(folds)]
    reports = [finished_detector(path, ids, settings | record) for path, ids, record in runs]
    todo = [(path, ids, settings | record) for (path, ids, record), done in zip(runs, reports) if done is None]
    if jobs == 1 or len(todo) < 2:
        by_id = {p.doc_id: p for p in pages}
        trained = [fit_detector([by_id[i] for i in ids], path, **options) for path, ids, options in todo]
    else:
        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            trained = list(pool.map(_fit_listed, [root] * len(todo), *zip(*todo)))
    fresh = iter(trained)
    reports = [done if done is not None else next(fresh) for done in reports]
    report = reports[0]
    if not folds:
        return report
    report["folds"] = reports[1:]
    write_json(Path(out) / FOLDS_FILE, {"folds": folds, "seed": seed, "pages": assignment})
    write_json(Path(out) / TRAIN_REPORT, report)
    return report


def evaluate_detector(
    root: str | Path, model_path: str | Path | None, split: str = "test",
    settings: SelectionSettings = SelectionSettings(), batch_size: int = 16,
) -> dict[str, Any]:
    """SCAN's matching-based IoU on a built-in split, after selection (also per style, the doc id's prefix) and for
    every candidate at or above the threshold, with :func:`class_agreement` of the selected boxes; ``model_path``
    None scores the gold boxes against themselves (1.0). Candidates are :func:`detect`'s (rounded, slivers dropped:
    ``dropped_boxes``), the very boxes ``detect`` stores and selects."""
    pages = gold_pages(root, split)
    dropped = 0
    if model_path is None:
        candidates = [list(p.regions) for p in pages]
    else:
        model, processor = load_detector(model_path)
        candidates = []
        for start in range(0, len(pages), batch_size):
            found, lost = detect(model, processor, [p.image for p in pages[start:start + batch_size]])
            candidates += found
            dropped += lost
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
            "class_agreement": class_agreement(pages, selected), "dropped_boxes": dropped,
            "boxes_per_page": {name: sum(map(len, boxes)) / len(pages)
                               for name, boxes in (("gold", gold), ("selected", selected), ("above_threshold", above))}}


def class_agreement(pages: Sequence[GoldPage], predicted: Sequence[Sequence[Region]],
                    min_iou: float = MATCH_IOU) -> dict[str, Any]:
    """Whether matched boxes agree on their class (the matching IoU pairs boxes whatever their classes): over the
    Hungarian pairs of the matching IoU with IoU >= ``min_iou`` (the usual detection threshold), ``pairs``, the
    share ``same_class`` whose predicted class is the gold one, and ``confusion`` (gold class -> predicted class ->
    pairs)."""
    confusion: dict[str, dict[str, int]] = {}
    for page, boxes in zip(pages, predicted):
        for i, j, iou in matching_pairs([r.box for r in boxes], [r.box for r in page.regions]):
            if iou >= min_iou:
                row = confusion.setdefault(page.regions[j].label, {})
                row[boxes[i].label] = row.get(boxes[i].label, 0) + 1
    pairs = sum(n for row in confusion.values() for n in row.values())
    same = sum(row.get(label, 0) for label, row in confusion.items())
    return {"min_iou": min_iou, "pairs": pairs, "same_class": same / pairs if pairs else None,
            "confusion": confusion}


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
    found, _ = detect(model, processor, [p.image for p in firsts])
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
    return [*rounded(region.box), region.label, round(region.score, 4)]


class Detectors:
    """The detector of each page: ``model`` for every page, or, with ``folds`` (a ``train --folds`` folder), each
    page :data:`FOLDS_FILE` lists detected by ``<folds>/fold-<k>/model`` for its fold ``k`` (a detector that never
    trained on it) and the other pages by ``model``. With ``folds``, a page whose detector lists it among the pages
    it trained on (:data:`TRAINED_ON`) is refused (:class:`LayoutError`): the cross-fitting is broken."""

    def __init__(self, model: str | Path, folds: str | Path | None = None) -> None:
        self.model, self.folds = local_path(model), Path(folds) if folds is not None else None
        self.fold: dict[str, int] = {}
        if self.folds is not None:
            path = self.folds / FOLDS_FILE
            try:
                self.fold = {str(page): int(k) for page, k in read_json(path)["pages"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise LayoutError(f"{path} is not a cross-fitting folder's {FOLDS_FILE} (python -m "
                                  f"hkrag.data.layout train ... --folds K): {type(error).__name__}: {error}") from None
        self._loaded: dict[Path, tuple[Any, Any, str, frozenset[str] | None]] = {}

    def path(self, doc_id: str) -> Path:
        """The detector folder that detects page ``doc_id``."""
        if doc_id in self.fold:
            return self.folds / f"fold-{self.fold[doc_id]}" / "model"
        return self.model

    def load(self, path: Path) -> tuple[Any, Any, str, frozenset[str] | None]:
        """``(model, processor, fingerprint, pages it trained on or None)`` of a detector folder, loaded once."""
        if path not in self._loaded:
            trained = path / TRAINED_ON
            seen = frozenset(read_json(trained)) if trained.is_file() else None
            self._loaded[path] = (*load_detector(path), _fingerprint(path), seen)
        return self._loaded[path]

    def seen(self, doc_id: str) -> bool:
        """Whether page ``doc_id``'s detector trained on it (False when its folder does not say)."""
        path = self.path(doc_id)
        trained = self.load(path)[3]
        if trained is None or doc_id not in trained:
            return False
        if self.folds is not None:
            raise LayoutError(f"page {doc_id!r} would be detected by {path}, which trained on it: {self.folds} does "
                              f"not cross-fit this corpus ({FOLDS_FILE} and the detectors' {TRAINED_ON} disagree)")
        return True


def write_regions(
    source: str | Path, out: str | Path, model_path: str | Path, settings: SelectionSettings = SelectionSettings(),
    configs: Sequence[str] | None = None, splits: Sequence[str] | None = None, batch_size: int = 16,
    folds: str | Path | None = None,
) -> dict[str, Any]:
    """Detect and select regions on every page of a corpus (module docstring), each page by its detector
    (:class:`Detectors`: ``model_path``, or with ``folds`` cross-fitted); returns the report: pages, detected,
    cached, ``seen_in_training`` (pages detected by a detector that trained on them, each warned about; 0 with
    ``folds``), ``dropped_boxes`` (slivers and stored candidates that are no region of their page) and failures."""
    out = Path(out)
    detectors = Detectors(model_path, folds)
    detectors.load(detectors.model)
    cache = out / CACHE_SUBDIR
    report: dict[str, Any] = {"source": str(source), "model": str(model_path), "folds": str(folds) if folds else None,
                              **dataclasses.asdict(settings), "pages": 0, "detected": 0, "cached": 0,
                              "seen_in_training": 0, "dropped_boxes": 0, "failed": []}
    for config, split in corpus_splits(source, configs, splits):
        corpus = load_corpus(source, config, split)
        rows = []
        for start in range(0, len(corpus), batch_size):
            batch = corpus.dataset[start:start + batch_size]
            pending: dict[Path, list[tuple[dict[str, Any], Path, Image.Image]]] = {}
            for doc_id, stored in zip(batch["doc_id"], batch["image"]):
                data, problem = _image_bytes(stored)
                path = detectors.path(doc_id)
                row = {"doc_id": doc_id, "size": None, "candidates": [], "selected": [], "detector": str(path)}
                rows.append(row)
                if detectors.seen(doc_id):
                    report["seen_in_training"] += 1
                if problem:
                    row["error"] = problem
                    continue
                key = hashlib.sha256(detectors.load(path)[2].encode() + b"\0" + data).hexdigest()
                cached = cache / key[:2] / f"{key}.json"
                if cached.is_file():
                    row.update(read_json(cached))
                    report["cached"] += 1
                    continue
                try:
                    pending.setdefault(path, []).append((row, cached, open_image(data, doc_id)))
                except Exception as error:  # noqa: BLE001 - a page that fails is reported, never fatal
                    row["error"] = f"{type(error).__name__}: {error}"
            for path, items in pending.items():
                model, processor, _, _ = detectors.load(path)
                found, dropped = detect(model, processor, [image for _, _, image in items])
                report["dropped_boxes"] += dropped
                for (row, cached, image), regions in zip(items, found):
                    row.update({"size": list(image.size), "candidates": [_row(r) for r in regions]})
                    write_json(cached, {"size": row["size"], "candidates": row["candidates"]}, indent=None)
                    report["detected"] += 1
        _select_rows(rows, settings, config, split, report)
        write_text(out / config / f"{split}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    if report["seen_in_training"]:
        logger.warning("%d page(s) were detected by a detector that trained on them (their boxes are better than a "
                       "new page's): give --folds (train --folds K) to cross-fit them", report["seen_in_training"])
    return _finish(out, report)


def _select_rows(rows: list[dict[str, Any]], settings: SelectionSettings, config: str, split: str,
                 report: dict[str, Any]) -> None:
    """SCAN's selection over each readable row's ``candidates`` (in place), those that are no region of the page
    dropped and counted in ``report["dropped_boxes"]`` with a warning (:func:`stored_candidates`); a row unread,
    or with no box kept, goes to ``report["failed"]`` with its ``error``."""
    report.setdefault("dropped_boxes", 0)
    for row in rows:
        report["pages"] += 1
        if "error" not in row:
            candidates, problems = stored_candidates(row, f"{config}/{split} {row['doc_id']}")
            for problem in problems:
                logger.warning("dropped: %s", problem)
            report["dropped_boxes"] += len(problems)
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
            size = row["size"]
            if size is not None and not (isinstance(size, list) and len(size) == 2
                                         and all(isinstance(v, int) and v > 0 for v in size)):
                raise LayoutError(f"{path}, line {number} ({row.get('doc_id')}): size {size!r} is not a page's "
                                  "[width, height] in whole pixels")
            if row["size"] is not None:
                row.pop("error", None)
            rows.append(row)
        _select_rows(rows, settings, path.parent.name, path.stem, report)
        write_text(out / path.parent.name / path.name, "".join(json.dumps(row) + "\n" for row in rows))
    return _finish(out, report)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = read_json(path)
    except (OSError, ValueError) as error:
        raise LayoutError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(value, dict):
        raise LayoutError(f"{path} is not a JSON object")
    return value


def train_command(report: dict[str, Any], out: str | Path) -> str:
    """The ``train`` command that makes a run of ``report``'s settings into ``out``."""
    folds = f" --folds {len(report['folds'])}" if report.get("folds") else ""
    return (f"python -m hkrag.data.layout train {report['corpus']} --out {out} --steps {report['steps']} "
            f"--batch-size {report['batch_size']} --lr {report['lr']} --seed {report['seed']} --threads "
            f"{report['threads']}{folds}")


def ship_detector(run: str | Path, out: str | Path, evaluation: str | Path, replace: bool = False) -> dict[str, Any]:
    """Ship a ``train`` run (``model/``, ``train_report.json``, with ``--folds`` the fold detectors and
    ``folds.json``) and its ``evaluate --out`` report into ``out`` as the readers are shipped (``weights/``): the
    files with a ``manifest.json`` naming the command that made them, the one that evaluates them, their settings,
    the evaluation and every file's sha256, which loading checks. ``out`` is written under a temporary name and
    renamed into place; an existing non-empty ``out`` is refused unless ``replace``."""
    from hkrag.models.phi3v.loading import SHIPPED_MANIFEST, file_sha256

    run, out = Path(run), Path(out)
    if not (run / TRAIN_REPORT).is_file() or not (run / "model" / "config.json").is_file():
        raise LayoutError(f"{run} is not a finished layout train run (needs model/ and {TRAIN_REPORT})")
    report, result = _read_json(run / TRAIN_REPORT), _read_json(Path(evaluation))
    if Path(result.get("model", "")).resolve() != (run / "model").resolve():
        raise LayoutError(f"{evaluation} evaluates {result.get('model')!r}, not {run / 'model'}")
    if out.exists() and any(out.iterdir()) and not replace:
        raise LayoutError(f"--out {out} exists and is not empty: pass --replace to replace what it holds")
    names = ["model", TRAIN_REPORT, *(f"fold-{k}" for k in range(len(report.get("folds") or ()))),
             *([FOLDS_FILE] if report.get("folds") else [])]
    with atomic_directory(out) as tmp:
        for name in names:
            for source in sorted((run / name).rglob("*")) if (run / name).is_dir() else [run / name]:
                if source.is_file():
                    target = tmp / source.relative_to(run)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(source.read_bytes())
        write_json(tmp / "evaluation.json", {**result, "model": str(out / "model")})
        settings = {key: report[key] for key in ("corpus", "steps", "batch_size", "lr", "seed")}
        manifest = {"command": train_command(report, run),
                    "evaluate": f"python -m hkrag.data.layout evaluate {report['corpus']} --model {out / 'model'} "
                                f"--split {result['split']} --threshold {result['threshold']} --alpha "
                                f"{result['alpha']} --beta {result['beta']}",
                    "config": {**settings, "threads": report["threads"], "folds": len(report.get("folds") or ())},
                    "matching_iou": result["selected"]["pooled"], "boxes_per_page": result["boxes_per_page"],
                    "files": {str(path.relative_to(tmp)): file_sha256(path)
                              for path in sorted(tmp.rglob("*")) if path.is_file()}}
        write_json(tmp / SHIPPED_MANIFEST, manifest)
    return manifest


def _settings(args: argparse.Namespace) -> SelectionSettings:
    return SelectionSettings(args.threshold, args.alpha, args.beta)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train the detector on a built-in corpus's train split")
    train.add_argument("corpus", type=Path, help="built-in corpus folder (python -m hkrag.data.synthetic)")
    train.add_argument("--out", required=True, type=Path, help="folder for model/ and train_report.json")
    train.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default: {STEPS})")
    train.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    train.add_argument("--lr", type=float, default=LR)
    train.add_argument("--seed", type=int, default=0, help="weights, denoising queries, batches and folds (default 0)")
    train.add_argument("--threads", type=int, default=THREADS,
                       help=f"intra-op threads; the weights depend on it (default {THREADS}: the same run anywhere)")
    train.add_argument("--folds", type=int, default=0,
                       help="also train K cross-fitting detectors, each without one fold of the documents (detect "
                            "--folds; default 0: none)")
    train.add_argument("--jobs", type=int, default=1,
                       help="detectors trained at once, a process each on --threads threads (the same weights; "
                            "default 1). A detector already in --out with these settings is kept")
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
    run.add_argument("--model", type=Path, help="detector folder (transformers save_pretrained; default with "
                                                 "--folds: <folds>/model)")
    run.add_argument("--folds", type=Path, help="a train --folds K folder: each page it lists is detected by the fold "
                                                "detector that never trained on it (cross-fitting)")
    run.add_argument("--out", required=True, type=Path, help="folder for <config>/<split>.jsonl and reports")
    run.add_argument("--config", action="append", dest="configs", help="config to read (repeat; default: all)")
    run.add_argument("--split", action="append", dest="splits", help="split to read (repeat; default: all)")
    shipping = commands.add_parser("ship", help="ship a train run and its evaluation with a manifest (weights/)")
    shipping.add_argument("run", type=Path, help="a train --out folder")
    shipping.add_argument("--evaluation", required=True, type=Path, help="its evaluate --out report")
    shipping.add_argument("--out", required=True, type=Path, help="folder to ship into (e.g. weights/layout_tiny)")
    shipping.add_argument("--replace", action="store_true", help="replace what --out holds")
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
            result = train_detector(args.corpus, args.out, args.steps, args.batch_size, args.lr, args.seed,
                                    args.folds, args.threads, args.jobs)
        elif args.command == "evaluate":
            result = evaluate_detector(args.corpus, args.model, args.split, _settings(args))
            if args.out:
                write_json(args.out, result)
        elif args.command == "ship":
            result = ship_detector(args.run, args.out, args.evaluation, args.replace)
        elif args.command == "figure":
            result = {"figure": str(figure(args.corpus, args.model, args.out, args.split, _settings(args)))}
        else:
            if args.command == "select":
                result = reselect(args.regions, args.out, _settings(args))
            else:
                if args.model is None and args.folds is None:
                    parser.error("detect needs --model (or --folds, whose model/ then detects the pages it lists not)")
                result = write_regions(args.source, args.out, args.model or args.folds / "model", _settings(args),
                                       args.configs, args.splits, folds=args.folds)
            result = {key: value for key, value in result.items() if key != "failed"} | {
                "failed": len(result["failed"])}
    except (LayoutError, DataError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
