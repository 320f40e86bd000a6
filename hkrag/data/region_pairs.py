"""A reader's training and validation data on region units: each question's gold unit, held-out documents apart.

    python -m hkrag.data.region_pairs data/synthetic --units data/units_gold_all-box --out data/region_train
    python -m hkrag.data.region_pairs data/synthetic --units data/units_gold_all-box --boxes detected \
        --detected data/units_det_all-box --out data/region_train_det        # the detector's crops as positives

The shipped reader was trained on whole pages and does not read crops (docs/data.md, "Region units"); fine-tuning
it on crops needs ``query → gold region crop`` pairs. A question's **gold units** are, on each of its relevant
pages, the units whose text (the drawn strings of a region corpus built with ``--gold``) holds the most of the
question's words, title boxes left out: a page's title is shared by every page of its document, so a title crop
never tells the question's page from its siblings, while the unit naming the label, the source or the code does
(the built-in questions name a title and one such word, :data:`hkrag.data.synthetic.TEMPLATES`). A page none of
whose units holds a word of the question gives all its units (none is preferred).

A reader meets *detected* boxes at test time, whose crops differ from the drawn boxes by a few pixels (docs/data.md:
a reader trained on exact crops loses them). ``boxes`` chooses the training crops: ``gold`` (the corpus's own boxes),
``detected`` (a region corpus of the detector's selected boxes on the same pages, ``--detected``) or ``both``. A
detected unit is labelled with the gold unit it is paired with by the Hungarian matching of SCAN's matching-based IoU
(:func:`hkrag.data.regions.matching_pairs`) when their IoU is at least ``match_iou`` (0.5, the usual detection
threshold); a question's detected positives are the detected units labelled with its gold units. With ``detected``,
a question none of whose gold units was matched is dropped (counted); with ``both``, it keeps its gold units and the
others rotate between their detected and gold positives epoch by epoch (:meth:`hkrag.data.pairs.TrainingPair.positive`),
detected first; detected units are renamed ``<page>#d<k>`` beside the gold ``<page>#<k>``. With detected units the
validation pools are the detected units of the held-out pages, the units a reader meets at test time.

Recipes are chosen on held-out *training* documents (:class:`hkrag.data.splits.ValidationSplit`: ``--fraction``,
``--seed``), so ``out`` holds, in the hub layout, with ``page_id`` mapping units to pages as any region corpus:

- ``out/qa``: ``default/train``, the kept questions with their gold units as ``relevant_doc_ids`` (for
  ``train.py``), and ``<config>/validation`` per QA config, the held-out questions with their pages (page-level,
  for ``eval.py eval.split=validation``);
- ``out/units``: ``default/train``, the kept pages' units; ``<config>/validation`` and ``all/validation``, the
  held-out pages' units (each config's pool: the pages of its held-out documents);
- ``out/pages``: the held-out pages themselves in the same pools (the page units' baseline on validation).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import chain
from pathlib import Path

import datasets

from hkrag.data.ocr import corpus_splits
from hkrag.data.opendocvqa import ALL_POOL, QA_FEATURES, TEXT_COLUMN, Corpus, DataError, QAExample, load_corpus, load_qa
from hkrag.data.region_corpus import PAGE_COLUMN, unit_pages
from hkrag.data.regions import MATCH_IOU, check_box, matching_pairs
from hkrag.data.splits import ValidationSplit, page_group
from hkrag.data.writer import save_split

VALIDATION_SPLIT = "validation"
BOXES = ("gold", "detected", "both")
WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> set[str]:
    """Lower-cased runs of letters and digits (``"65%"`` → ``{"65"}``)."""
    return set(WORD.findall(text.lower()))


def gold_units(example: QAExample, units: dict[str, list[tuple[str, str, str]]]) -> tuple[str, ...]:
    """The question's gold units (module docstring) from ``units``: ``{page: [(unit id, label, text), ...]}``.

    Raises DataError naming the question and page when a relevant page has no units."""
    asked, gold = words(example.query), []
    for page in example.relevant_doc_ids:
        if page not in units:
            raise DataError(f"question {example.query_id!r}: its page {page!r} has no units")
        counts = [(len(asked & words(text)) if label != "title" else 0, unit) for unit, label, text in units[page]]
        best = max(count for count, _ in counts)
        gold += [unit for count, unit in counts if count == best]
    return tuple(gold)


def page_units(corpus: Corpus) -> dict[str, list[tuple[str, str, str]]]:
    """``{page: [(unit id, label, text), ...]}`` of a region corpus built with ``--gold`` (its ``text`` column)."""
    if TEXT_COLUMN not in corpus.dataset.column_names:
        raise DataError(f"{corpus.name} has no {TEXT_COLUMN!r} column: build the region corpus with --gold")
    pages = unit_pages(corpus)
    units: dict[str, list[tuple[str, str, str]]] = {}
    for unit, label, text in zip(corpus.doc_ids, corpus.dataset["label"][:], corpus.dataset[TEXT_COLUMN][:]):
        units.setdefault(pages[unit], []).append((unit, label, text or ""))
    return units


def matched_units(gold: Corpus, detected: Corpus, threshold: float = MATCH_IOU) -> dict[str, str]:
    """``{gold unit: detected unit}``: on each page, the two corpora's unit boxes (column ``box``) paired by the
    Hungarian matching of SCAN's matching-based IoU, a pair kept when its IoU is at least ``threshold``."""
    def boxes(corpus: Corpus) -> dict[str, list[tuple[str, tuple[float, ...]]]]:
        by_page: dict[str, list[tuple[str, tuple[float, ...]]]] = {}
        for unit, page, box in zip(corpus.doc_ids, corpus.dataset[PAGE_COLUMN][:], corpus.dataset["box"][:]):
            try:  # no page size is stored with a unit: a box is finite, of positive area, from the page's origin on
                by_page.setdefault(page, []).append((unit, check_box(box or (), (math.inf, math.inf), "")))
            except ValueError as error:
                raise DataError(f"{corpus.name}: unit {unit!r} of page {page!r}{error}") from None
        return by_page

    unit_pages(gold), unit_pages(detected)  # both must be region corpora (DataError naming the one that is not)
    found, matched = boxes(detected), {}
    for page, gold_boxes in boxes(gold).items():
        predicted = found.get(page, [])
        for i, j, iou in matching_pairs([b for _, b in predicted], [b for _, b in gold_boxes]):
            if iou >= threshold:
                matched[gold_boxes[j][0]] = predicted[i][0]
    return matched


def detected_name(unit: str) -> str:
    """A detected unit's id beside gold units (``boxes=both``): ``<page>#<k>`` → ``<page>#d<k>``."""
    page, k = unit.rsplit("#", 1)
    return f"{page}#d{k}"


def _rows(corpus: Corpus, keep: Iterable[str], rename: Callable[[str], str] | None = None,
          columns: Iterable[str] | None = None) -> Iterator[dict]:
    """The stored rows (images as stored) of ``corpus`` whose doc id is in ``keep``, in corpus order, doc ids
    mapped by ``rename`` and only ``columns`` kept when given."""
    rows = sorted(corpus.index(doc_id) for doc_id in set(keep))
    columns = list(columns or corpus.dataset.column_names)
    for start in range(0, len(rows), 64):
        batch = corpus.dataset[rows[start:start + 64]]
        for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
            yield {**{c: row[c] for c in columns}, **({"doc_id": rename(row["doc_id"])} if rename else {})}


def _features(corpus: Corpus) -> datasets.Features:
    return datasets.Features({**corpus.dataset.features, "image": datasets.Image()})


def _qa_rows(examples: Sequence[QAExample]) -> list[dict]:
    return [{"query_id": e.query_id, "query": e.query, "answers": list(e.answers),
             "relevant_doc_ids": list(e.relevant_doc_ids), "evidence": e.evidence} for e in examples]


def write_region_training(
    root: str | Path, units_source: str | Path, out: str | Path, fraction: float = 0.15, seed: int = 0,
    configs: Sequence[str] | None = None, train_config: str = "default", split: str = "train",
    detected: str | Path | None = None, boxes: str = "gold", match_iou: float = MATCH_IOU,
) -> dict[str, int]:
    """Write ``out``'s ``qa``, ``units`` and ``pages`` (module docstring) from the built-in corpus folder ``root``
    (``qa/`` and ``corpus/``) and the region corpus ``units_source`` of its ``train_config``/``split`` pages (built
    with ``--gold``), training on the crops ``boxes`` names (``detected`` and ``both`` read the region corpus
    ``detected`` of the same pages); ``configs`` are the QA configs whose held-out questions form the validation
    pools (default: every config with a ``split`` split but ``train_config``). Returns the row count of each
    written ``folder/config/split``, and with detected units ``matched``/``gold_units`` (gold units of the kept
    pages with a detected unit, all of them) and ``qa/unmatched`` (kept questions with no matched gold unit)."""
    if boxes not in BOXES:
        raise ValueError(f"boxes must be one of {BOXES}, got {boxes!r}")
    if (boxes == "gold") != (detected is None):
        raise ValueError(f"boxes={boxes} " + ("takes no detected units" if boxes == "gold" else
                                              "needs the detected units (a region corpus of the detector's boxes)"))
    root, out = Path(root), Path(out)
    held = ValidationSplit(fraction, seed)
    units = load_corpus(units_source, train_config, split)
    pages = load_corpus(root / "corpus", train_config, split)
    found = units if detected is None else load_corpus(detected, train_config, split)
    by_page = page_units(units)
    train_qa, _ = held.split(load_qa(root / "qa", train_config, split))
    train_qa = [replace(e, relevant_doc_ids=gold_units(e, by_page)) for e in train_qa]
    kept_pages = {p for p in pages.doc_ids if not held.held_out(p)}
    kept_units = [u for u, p in unit_pages(units).items() if p in kept_pages]
    counts = {}
    if detected is None:
        rows = _rows(units, kept_units)
        features = _features(units)
    else:
        matched = matched_units(units, found, match_iou)
        rename = detected_name if boxes == "both" else None
        name = rename or str
        counts["matched"], counts["gold_units"] = sum(u in matched for u in kept_units), len(kept_units)
        counts["qa/unmatched"] = sum(not any(u in matched for u in e.relevant_doc_ids) for e in train_qa)
        train_qa = [replace(e, relevant_doc_ids=tuple(name(matched[u]) for u in e.relevant_doc_ids if u in matched)
                            + (e.relevant_doc_ids if boxes == "both" else ())) for e in train_qa]
        train_qa = [e for e in train_qa if e.relevant_doc_ids]
        kept_found = [u for u, p in unit_pages(found).items() if p in kept_pages]
        features = _features(found)
        rows = _rows(found, kept_found, rename, features)
        if boxes == "both":
            rows = chain(_rows(units, kept_units, columns=features), rows)
        kept_units = kept_found + (kept_units if boxes == "both" else [])
    counts["qa/default/train"] = len(train_qa)
    save_split(_qa_rows(train_qa), out / "qa", "default", "train", QA_FEATURES)
    save_split(rows, out / "units", "default", "train", features)
    counts["units/default/train"] = len(kept_units)
    configs = configs or [c for c in _qa_configs(root / "qa", split) if c != train_config]
    pools: dict[str, set[str]] = {}
    for config in configs:
        _, validation = held.split(load_qa(root / "qa", config, split))
        if not validation:
            raise DataError(f"{root / 'qa'}[{config}/{split}] has no question in a held-out document "
                            f"(--fraction {fraction}, --seed {seed}): raise the fraction or change the seed")
        save_split(_qa_rows(validation), out / "qa", config, VALIDATION_SPLIT, QA_FEATURES)
        counts[f"qa/{config}/{VALIDATION_SPLIT}"] = len(validation)
        groups = {page_group(p) for e in validation for p in e.relevant_doc_ids}
        pools[config] = {p for p in pages.doc_ids if held.held_out(p) and page_group(p) in groups}
    pools[ALL_POOL] = set().union(*pools.values())
    unit_of_page: dict[str, list[str]] = {}
    for unit, page in unit_pages(found).items():
        unit_of_page.setdefault(page, []).append(unit)
    for config, pool in pools.items():
        missing = sorted(pool - set(unit_of_page))
        if missing:
            raise DataError(f"page {missing[0]!r} of {pages.name} has no units in {found.name}")
        pool_units = [u for p in pool for u in unit_of_page[p]]
        save_split(_rows(found, pool_units), out / "units", config, VALIDATION_SPLIT, _features(found))
        save_split(_rows(pages, pool), out / "pages", config, VALIDATION_SPLIT, _features(pages))
        counts[f"units/{config}/{VALIDATION_SPLIT}"] = len(pool_units)
        counts[f"pages/{config}/{VALIDATION_SPLIT}"] = len(pool)
    return counts


def _qa_configs(qa_root: Path, split: str) -> list[str]:
    return [config for config, s in corpus_splits(qa_root) if s == split]


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="built-in corpus folder (qa/ and corpus/; python -m "
                                                "hkrag.data.synthetic)")
    parser.add_argument("--units", required=True, type=Path,
                        help="region corpus of its training pages built with --gold (python -m "
                             "hkrag.data.region_corpus build)")
    parser.add_argument("--boxes", choices=BOXES, default="gold",
                        help="training crops: the corpus's own boxes (default), the detector's (--detected) or both")
    parser.add_argument("--detected", type=Path,
                        help="region corpus of the same pages from the detector's selected boxes (all-box)")
    parser.add_argument("--match-iou", type=float, default=MATCH_IOU,
                        help=f"IoU a detected box needs with the gold box it is paired with (default {MATCH_IOU})")
    parser.add_argument("--out", required=True, type=Path, help="folder for qa/, units/ and pages/")
    parser.add_argument("--fraction", type=float, default=0.15,
                        help="share of documents held out (default 0.15: at seed 0, 2 to 5 documents of each style)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out documents (default 0)")
    parser.add_argument("--config", action="append", dest="configs",
                        help="QA config of a validation pool (repeat; default: all but default)")
    args = parser.parse_args(argv)
    try:
        counts = write_region_training(args.root, args.units, args.out, args.fraction, args.seed, args.configs,
                                       detected=args.detected, boxes=args.boxes, match_iou=args.match_iou)
    except (DataError, FileNotFoundError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
