"""Gold evidence boxes for the built-in corpus: where on its page each question's answer is drawn.

The corpus records every drawn string with its box, kind and font size (``pages.jsonl`` ``items``). A question's
gold evidence is the drawn *span* of its answer: the first gold answer (in the question's order) that occurs as
whole words of an item (``relaxed_normalize``d, so ``"P.3"`` is found in ``"REF K7  P.3"`` and ``"3"`` is not found
in ``"2023"``), boxed by the font's own metrics (the width of the text before it and of the span; the item's line
height). The whole item's box is kept beside it (``item_box``). A question whose answers are drawn on none of its
pages (nothing in ``items`` holds them) has no gold evidence, which reports count apart, never as a miss.

``python -m hkrag.rag.gold_evidence --root DIR`` writes ``DIR/evidence.jsonl`` (one line a question of every split),
beside ``qa/``; ``eval.py`` and ``train.py`` write it with the built-in corpus they generate, or into one that lacks it
(:func:`hkrag.tasks.common.prepare_data`). Both files are read through :func:`hkrag.io.read_jsonl`: a non-UTF-8 or
damaged line is a :class:`~hkrag.io.FileFormatError` naming the file and the line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hkrag.data.synthetic import FINE_PRINT_SPLIT, PAGES_FILE, STYLES, _font
from hkrag.io import read_jsonl, write_text
from hkrag.rag.grounding import Evidence
from hkrag.rag.metrics import relaxed_normalize
from hkrag.rag.records import WORD

EVIDENCE_FILE = "evidence.jsonl"
EVIDENCE_KEYS = ("query_id", "dataset", "evidence")
"""What :func:`load_gold` needs of each row of :data:`EVIDENCE_FILE`."""
GOLD = "gold"
"""The ``source`` of a gold evidence box."""


def answer_span(answer: str, text: str) -> tuple[int, int] | None:
    """Character offsets in ``text`` of the first run of whole words that normalises to ``answer``'s form."""
    target = relaxed_normalize(answer)
    if not target:
        return None
    spans = [match.span() for match in WORD.finditer(text)]
    length = len(target.split())
    for start in range(len(spans) - length + 1):
        run = spans[start:start + length]
        if relaxed_normalize(text[run[0][0]:run[-1][1]]) == target:
            return run[0][0], run[-1][1]
    return None


def span_box(item: Mapping[str, Any], span: tuple[int, int]) -> tuple[float, float, float, float]:
    """The pixel box of ``item["text"][span]`` as the corpus drew it: the font's advance up to the span and the
    span's ink, from the item's left ink edge; the item's own top and bottom."""
    font = _font(int(item["font_size"]))
    text = item["text"]
    x0, y0, _, y1 = item["box"]
    origin = x0 - font.getbbox(text)[0]
    left = origin + font.getlength(text[:span[0]])
    ink = font.getbbox(text[span[0]:span[1]])
    return (float(left + ink[0]), float(y0), float(left + ink[2]), float(y1))


def gold_evidence(answers: Sequence[str], page_id: str, items: Sequence[Mapping[str, Any]]) -> list[Evidence]:
    """The drawn spans of the first answer found on the page (module docstring); ``[]`` when none is drawn."""
    for answer in answers:
        found = [Evidence(page_id, span_box(item, span), GOLD, 1.0)
                 for item in items if (span := answer_span(answer, item["text"]))]
        if found:
            return found
    return []


def _pages(root: Path) -> dict[str, list[dict]]:
    """``doc_id -> items`` of ``root/pages.jsonl``; a damaged or non-UTF-8 line is a
    :class:`~hkrag.io.FileFormatError` naming the file and the line."""
    path = root / PAGES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no drawn items; gold evidence exists for the built-in corpus only "
                                "(python -m hkrag.data.synthetic --out DIR)")
    return {row["doc_id"]: row["items"] for row in read_jsonl(path, keys=("doc_id", "items"))}


def question_evidence(question: Any, pages: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Evidence]:
    """Gold evidence of a QA example (``answers``, ``relevant_doc_ids``) over its relevant pages."""
    return [box for page_id in question.relevant_doc_ids if page_id in pages
            for box in gold_evidence(question.answers, page_id, pages[page_id])]


def evidence_rows(root: str | Path) -> Iterator[dict[str, Any]]:
    """One row a question of every split and data set of ``root``: query id, data set, split, gold boxes. A split
    without questions (a small corpus's data set that drew none) adds no row."""
    from hkrag.data.opendocvqa import load_qa, stored_rows

    root = Path(root)
    pages = _pages(root)
    for split, config in (("train", "default"), *(("test", name) for name in _test_configs(root))):
        if stored_rows(root / "qa", config, split) == 0:
            continue
        for question in load_qa(root / "qa", config=config, split=split):
            boxes = question_evidence(question, pages)
            yield {"query_id": question.query_id, "dataset": config, "split": split,
                   "drawn": bool(boxes), "evidence": [box.to_dict() for box in boxes]}


def _test_configs(root: Path) -> list[str]:
    """The test data sets the folder has (the four styles, and ``synfine`` when it was generated)."""
    return [name for name in (*STYLES, FINE_PRINT_SPLIT) if (root / "qa" / name).is_dir()]


def load_gold(root: str | Path) -> dict[tuple[str, str], list[Evidence]]:
    """(data set, query id) -> gold evidence, from ``root/evidence.jsonl`` when written, else derived. A damaged
    or non-UTF-8 file is a :class:`~hkrag.io.FileFormatError` naming it and the line."""
    path = Path(root) / EVIDENCE_FILE
    rows = read_jsonl(path, keys=EVIDENCE_KEYS) if path.is_file() else evidence_rows(root)
    return {(row["dataset"], row["query_id"]): [Evidence.from_dict(box) for box in row["evidence"]] for row in rows}


def write_evidence(root: str | Path) -> Path:
    """Write ``root/evidence.jsonl`` atomically; returns its path."""
    root = Path(root)
    text = "".join(json.dumps(row) + "\n" for row in evidence_rows(root))
    return write_text(root / EVIDENCE_FILE, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the gold evidence boxes of a built-in corpus folder.")
    parser.add_argument("--root", required=True, type=Path, help="a folder made by python -m hkrag.data.synthetic")
    args = parser.parse_args(argv)
    path = write_evidence(args.root)
    rows = read_jsonl(path)
    print(f"{path}: {len(rows)} questions, {sum(row['drawn'] for row in rows)} with drawn evidence")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
