"""A built-in, seeded document-page corpus in the OpenDocVQA layout (no download needed).

Pages come in four styles (``synchart``, ``synslide``, ``syntable``, ``syninfo``). Each page
carries *salient* content (a large title, a highlighted colour label and a big headline
number) and *fine print* (a source line and a reference line in small type). Pages that
share a style and a title form a group whose members differ only in label, number and fine
print, so a ``fine_print`` query (which names a fine-print word) can only be resolved by
reading the fine print of its positive, while a ``salient`` query is resolved by large text.

A fifth data set, ``synfine`` (the fine-print split, paper Fig. 1's holistic knowledge gap), isolates
fine print: each of its groups repeats one page's salient content (layout, title, chart, headline
number, label) on every member, which differ only in fine print, and its questions name fine-print
words only (no title, no style noun). Title or chart matching cannot rank its pages; reading can.
It is drawn from its own random stream, so adding it leaves every other page and question unchanged.

Everything visible is drawn from small closed vocabularies, reused across pages and splits:
the test split holds new combinations of the same words, which a tiny random-initialised
vision-language model can learn on a CPU in minutes. See ``docs/data.md``.

    python -m hkrag.data.synthetic --out data/synthetic --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from hkrag.data.images import page_png
from hkrag.data.opendocvqa import ALL_POOL, PAGE_TEXT_FEATURES, QA_FEATURES, QUERY_PREFIX, TEXT_COLUMN, format_query
from hkrag.data.writer import declare_text_columns, save_split
from hkrag.io import read_jsonl, write_json, write_text

logger = logging.getLogger(__name__)

STYLES = {"synchart": "chart", "synslide": "slide", "syntable": "table", "syninfo": "infographic"}
"""Config name -> the noun queries use for pages of that style."""
FINE_PRINT_SPLIT = "synfine"
"""Config name of the fine-print split: groups of pages with identical salient content."""
TITLES = ("SALES", "ENERGY", "TRAFFIC", "RAINFALL", "EXPORTS", "BUDGET", "HOUSING", "TOURISM")
LABELS = {
    "RED": (214, 39, 40),
    "BLUE": (31, 119, 180),
    "GREEN": (44, 160, 44),
    "ORANGE": (255, 127, 14),
    "PURPLE": (148, 103, 189),
    "TEAL": (23, 170, 190),
    "PINK": (227, 119, 194),
    "BROWN": (140, 86, 75),
}
SOURCES = ("ALPHA", "BRAVO", "DELTA", "ECHO", "KILO", "LIMA", "OSCAR", "TANGO")
CODES = ("K7", "M2", "P9", "R4", "T5", "W3", "X8", "Z6")
YEARS = tuple(str(year) for year in range(2017, 2025))

REFERENCE_SIZE = (224, 168)
CONFIG_FILE = "synthetic_config.json"
"""Written into the output folder: the settings it was generated with (marks the folder as ours)."""
PAGES_FILE = "pages.jsonl"
"""Written into the output folder by :func:`generate`: every page's spec and drawn items, one JSON object a line."""
"""Layouts and font sizes are written for this page size and scale with the configured one."""
MIN_FINE_PRINT_PX = 9
"""Smallest accepted cap height of fine print, in pixels of the rendered page and of the model's input."""
INK = (25, 25, 25)
FINE_INK = (70, 70, 70)
PAPER = (255, 255, 255)


@dataclass(frozen=True)
class SyntheticConfig:
    """What to generate. Query counts are per split; pages = styles x groups x group_size."""

    seed: int = 0
    n_train: int = 320
    n_test: int = 100
    train_groups_per_style: int = 8
    test_groups_per_style: int = 4
    group_size: int = 6
    width: int = 224
    height: int = 168
    fine_print_size: int = 14
    train_fine_groups: int = 0
    test_fine_groups: int = 0
    layout: int = 2
    """Version of what is written (2: corpora carry the ``text`` column), so older folders are regenerated."""

    def __post_init__(self) -> None:
        if not 1 <= self.group_size <= min(len(LABELS), len(SOURCES), len(CODES)):
            raise ValueError(f"group_size must be in [1, {len(CODES)}], got {self.group_size}")
        for split in ("train", "test"):
            groups = getattr(self, f"{split}_groups_per_style")
            if groups < 1:
                raise ValueError(f"{split}_groups_per_style must be >= 1, got {groups}")
            if getattr(self, f"{split}_fine_groups") < 0:
                raise ValueError(f"{split}_fine_groups must be >= 0, got {getattr(self, f'{split}_fine_groups')}")
            pages = len(STYLES) * groups * self.group_size
            if not 0 <= getattr(self, f"n_{split}") <= 2 * pages:
                raise ValueError(f"n_{split} must be in [0, {2 * pages}] for {pages} {split} pages")


@dataclass(frozen=True)
class PageSpec:
    """The content of one page; ``render_page`` turns it into pixels."""

    doc_id: str
    style: str
    title: str
    label: str
    value: int
    source: str
    code: str
    year: str
    bars: tuple[int, ...]
    accent: int
    page_no: int
    layout: str = ""

    @property
    def renderer(self) -> str:
        """The style whose layout draws the page (``synfine`` pages borrow one of the four)."""
        return self.layout or self.style

    @property
    def fine_key(self) -> tuple[str, str, str]:
        """The fine-print words a ``synfine`` question names; unique among the test pages."""
        return self.source, self.code, self.year


@dataclass(frozen=True)
class TextItem:
    """A string drawn on a page, with the pixel size it was drawn at."""

    text: str
    kind: str
    font_size: int
    cap_height: int
    box: tuple[int, int, int, int]


@dataclass(frozen=True)
class SyntheticPaths:
    """Where ``generate`` wrote things: QA and corpus roots (load them with ``hkrag.data.opendocvqa``)."""

    root: Path
    qa: Path
    corpus: Path
    pages: Path


def generate(out_dir: str | Path, config: SyntheticConfig = SyntheticConfig()) -> SyntheticPaths:
    """Render pages and questions for both splits and write them in the OpenDocVQA layout.

    QA configs: ``default`` (train), one per style (train, test). Corpus configs: ``default``
    (train), one per style (test) and ``all`` (test). ``pages.jsonl`` records every drawn string. The corpus card
    declares ``text: drawn``: the ``text`` column is the exact drawn strings, not a text layer OCR may take.
    """
    root = Path(out_dir)
    paths = SyntheticPaths(root, root / "qa", root / "corpus", root / PAGES_FILE)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(config.seed)
    train = _page_specs(rng, config, "train", taken=set())
    test = _page_specs(rng, config, "test", taken={_signature(p) for p in train})
    queries = {"train": _queries(rng, train, config.n_train), "test": _queries(rng, test, config.n_test)}
    fine_rng = random.Random(f"{config.seed}:{FINE_PRINT_SPLIT}")  # its own stream: other pages stay the same
    fine_train = _fine_print_specs(fine_rng, config, "train", keys=set())
    fine_test = _fine_print_specs(fine_rng, config, "test", keys={p.fine_key for p in test})
    queries["train"] += _fine_print_queries(fine_rng, fine_train)
    queries["test"] += _fine_print_queries(fine_rng, fine_test)
    train, test = train + fine_train, test + fine_test
    rendered = {spec.doc_id: render_page(spec, config) for spec in tqdm(train + test, desc="render", leave=False)}
    images = {doc_id: page_png(image) for doc_id, (image, _) in rendered.items()}

    def corpus_rows(specs: list[PageSpec]) -> Iterator[dict]:
        return ({"doc_id": s.doc_id, "image": {"bytes": images[s.doc_id], "path": None},
                 "text": page_text(rendered[s.doc_id][1])} for s in specs)

    save_split(queries["train"], paths.qa, "default", "train", QA_FEATURES)
    save_split(corpus_rows(train), paths.corpus, "default", "train", PAGE_TEXT_FEATURES)
    save_split(corpus_rows(test), paths.corpus, ALL_POOL, "test", PAGE_TEXT_FEATURES)
    for style in data_sets(config):
        for split, rows in queries.items():
            style_rows = [q for q in rows if q["relevant_doc_ids"][0].startswith(f"{style}-")]
            save_split(style_rows, paths.qa, style, split, QA_FEATURES)
        style_pages = [s for s in test if s.style == style]
        save_split(corpus_rows(style_pages), paths.corpus, style, "test", PAGE_TEXT_FEATURES)
    declare_text_columns(paths.corpus, {TEXT_COLUMN: "drawn"})  # ground truth: OCR must read the pages
    splits = [(split, spec) for split, specs in (("train", train), ("test", test)) for spec in specs]
    lines = [json.dumps({"split": split, **dataclasses.asdict(spec),
                         "items": [dataclasses.asdict(item) for item in rendered[spec.doc_id][1]]})
             for split, spec in splits]
    write_text(paths.pages, "\n".join(lines) + "\n")
    write_json(root / CONFIG_FILE, dataclasses.asdict(config))  # last: marks a complete corpus
    counts = (len(train), len(test), len(queries["train"]), len(queries["test"]))
    logger.info("synthetic corpus: %d train / %d test pages, %d train / %d test queries in %s", *counts, root)
    return paths


def render_page(spec: PageSpec, config: SyntheticConfig = SyntheticConfig()) -> tuple[Image.Image, list[TextItem]]:
    """Draw one page; returns the image and every string drawn on it (for tests and oracles)."""
    canvas = _draw_page(spec, config)
    return canvas.image, canvas.items


def page_regions(spec: PageSpec, config: SyntheticConfig = SyntheticConfig()) -> list[tuple[str, tuple[int, ...]]]:
    """The page's SCAN boxes as drawn, ``(class, (x0, y0, x1, y1))`` in drawing order (docs/data.md, "Region units
    (SCAN)"): ``title`` (the title, with the slide's title band), one ``semantic_box`` (everything drawn about the
    page's one topic: its chart, table or figure and the headline value and label describing it) and ``footer`` (the
    two fine-print lines). Page backgrounds and the slide's separator rule belong to no box. Boxes are the bounding
    boxes of the pixels drawn (right/bottom edges exclusive), clipped to the page."""
    return _draw_page(spec, config).regions


def _draw_page(spec: PageSpec, config: SyntheticConfig) -> _Canvas:
    canvas = _Canvas(config.width, config.height, config.fine_print_size)
    _RENDERERS[spec.renderer](canvas, spec)
    canvas.fine_print(spec)
    return canvas


def page_text(items: list[TextItem]) -> str:
    """Every string drawn on a page in reading order (top to bottom, then left to right), one per line.

    The corpus's ``text`` column: the page text VDocRAG's pre-training (RCR, RCG) learns from.
    """
    return "\n".join(item.text for item in sorted(items, key=lambda item: (item.box[1], item.box[0])))


PAGE_FIELDS = ("title", "label", "value", "source", "code", "year", "page_no")
"""The :class:`PageSpec` fields :func:`load_page_items` returns (as drawn: strings)."""


def load_page_items(root: str | Path, split: str | None = None) -> dict[str, dict]:
    """Each page's drawn strings by kind, in reading order (:func:`page_text`'s), and its fields, from
    ``<root>/pages.jsonl``: doc id -> ``{"doc_id", "salient": [...], "fine_print": [...], "fields": {...}}`` (the
    fields of ``hkrag.rag.records.PageTruth``); ``split`` keeps one split's pages. A folder without the file (a
    corpus other than the built-in one) is an error naming it: its pages carry no items to learn notes from."""
    path = Path(root) / PAGES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the agents' note targets (salient, fine_print, decouple) are read "
                                "from the built-in corpus's drawn items; a corpus without them can train the answer "
                                "and Pruner steps only (generator_training.curriculum.steps)")
    pages = {}
    for number, row in enumerate(read_jsonl(path, keys=("doc_id",)), 1):
        if split is not None and row.get("split") != split:
            continue
        if "items" not in row:
            raise ValueError(f"{path}, line {number} (page {row.get('doc_id')!r}) has no 'items'")
        items = sorted(row["items"], key=lambda item: (item["box"][1], item["box"][0]))
        by_kind = {kind: [item["text"] for item in items if item["kind"] == kind] for kind in ("salient", "fine_print")}
        pages[row["doc_id"]] = {"doc_id": row["doc_id"], **by_kind,
                                "fields": {name: str(row[name]) for name in PAGE_FIELDS if name in row}}
    return pages


def _page_specs(rng: random.Random, config: SyntheticConfig, split: str, taken: set[tuple]) -> list[PageSpec]:
    """Documents of pages sharing (style, title); within one, labels, values and fine print differ.

    Doc ids read ``<style>-<split>-d<document>-p<page>``, like pages of a multi-page document.
    """
    groups = getattr(config, f"{split}_groups_per_style")
    specs = []
    for style in STYLES:
        style_specs: list[PageSpec] = []
        for group, title in enumerate(_titles(rng, groups)):
            values = rng.sample(range(10, 100), config.group_size)
            fillers = [v for v in range(20, 96) if v not in values]
            columns = zip(
                rng.sample(list(LABELS), config.group_size),
                rng.sample(SOURCES, config.group_size),
                rng.sample(CODES, config.group_size),
                values,
                strict=True,
            )
            for page, (label, source, code, value) in enumerate(columns, start=1):
                spec = PageSpec(
                    doc_id=f"{style}-{split}-d{group:03d}-p{page}",
                    style=style,
                    title=title,
                    label=label,
                    value=value,
                    source=source,
                    code=code,
                    year=rng.choice(YEARS),
                    bars=tuple(rng.choices(fillers, k=4)),
                    accent=rng.randrange(4),
                    page_no=rng.randint(1, 9),
                )
                while _signature(spec) in taken:
                    spec = dataclasses.replace(spec, year=rng.choice(YEARS), page_no=rng.randint(1, 9))
                taken.add(_signature(spec))
                style_specs.append(spec)
        specs += style_specs
    return specs


def data_sets(config: SyntheticConfig) -> list[str]:
    """QA / corpus config names the corpus holds: the four styles, then ``synfine`` when it has test pages."""
    return [*STYLES, *([FINE_PRINT_SPLIT] if config.test_fine_groups else [])]


def _fine_print_specs(rng: random.Random, config: SyntheticConfig, split: str, keys: set[tuple]) -> list[PageSpec]:
    """``synfine`` groups: one page's salient content repeated on every member, which differ only in fine print.

    Sources and codes are distinct within a group; the (source, code, year) key of every page is new to
    ``keys`` (on return ``keys`` holds them too), so a question naming it picks out one page of any pool
    that ``keys`` covered.
    """
    specs = []
    for group, title in enumerate(_titles(rng, getattr(config, f"{split}_fine_groups"))):
        layout = rng.choice(list(STYLES))
        salient = dict(title=title, label=rng.choice(list(LABELS)), value=rng.randrange(10, 100),
                       bars=tuple(rng.choices(range(20, 96), k=4)), accent=rng.randrange(4))
        members: list[PageSpec] = []
        for page in range(1, config.group_size + 1):
            doc_id = f"{FINE_PRINT_SPLIT}-{split}-d{group:03d}-p{page}"
            free = [(s, c, y) for s in SOURCES for c in CODES for y in YEARS if (s, c, y) not in keys
                    and all(s != m.source and c != m.code for m in members)]
            if not free:
                raise ValueError(f"no unused (source, code, year) left for {doc_id}: lower {split}_fine_groups "
                                 f"(got {getattr(config, f'{split}_fine_groups')})")
            source, code, year = rng.choice(free)
            keys.add((source, code, year))
            members.append(PageSpec(doc_id=doc_id, style=FINE_PRINT_SPLIT, source=source, code=code, year=year,
                                    page_no=rng.randint(1, 9), layout=layout, **salient))
        specs += members
    return specs


def _fine_print_queries(rng: random.Random, specs: list[PageSpec]) -> list[dict]:
    """One ``fine_print`` question per ``synfine`` page, naming its (source, code, year) key only."""
    return [_query_row(spec, "fine_print", *rng.choice(FINE_PRINT_TEMPLATES)) for spec in specs]


def _titles(rng: random.Random, groups: int) -> list[str]:
    """``groups`` titles: shuffled passes over TITLES, so beyond 8 groups titles repeat across groups."""
    passes = -(-groups // len(TITLES))
    return [title for _ in range(passes) for title in rng.sample(TITLES, len(TITLES))][:groups]


def _signature(spec: PageSpec) -> tuple:
    """What makes two pages the same document; test pages never repeat a train page."""
    return (spec.style, spec.title, spec.label, spec.value, spec.source, spec.code, spec.year, spec.page_no)


def _queries(rng: random.Random, specs: list[PageSpec], n: int) -> list[dict]:
    """Half fine-print, half salient questions, each on a distinct random page, in page order."""
    n_fine = n // 2
    chosen = [(spec, "fine_print") for spec in rng.sample(specs, n_fine)]
    chosen += [(spec, "salient") for spec in rng.sample(specs, n - n_fine)]
    order = {spec.doc_id: i for i, spec in enumerate(specs)}
    chosen.sort(key=lambda item: (order[item[0].doc_id], item[1]))
    return [_query_row(spec, evidence, *rng.choice(TEMPLATES[evidence])) for spec, evidence in chosen]


def _query_row(spec: PageSpec, evidence: str, question: str, answers: tuple[str, ...]) -> dict:
    """A QA row (OpenDocVQA schema plus ``evidence``) from format strings over PageSpec's fields and ``noun``."""
    fields = {**dataclasses.asdict(spec), "noun": STYLES.get(spec.style, "page")}
    return {
        "query_id": f"{spec.doc_id}-{evidence}",
        "query": format_query(question.format(**fields)),
        "answers": [answer.format(**fields) for answer in answers],
        "relevant_doc_ids": [spec.doc_id],
        "evidence": evidence,
    }


TEMPLATES = {
    "salient": [
        ("What is the {label} value on the {title} {noun}?", ("{value}%", "{value}")),
        ("Which colour shows {value}% on the {title} {noun}?", ("{label}",)),
    ],
    "fine_print": [
        ("What is the reference code of the {title} {noun} sourced from {source}?", ("{code}",)),
        ("In which year was the {title} {noun} with reference {code} published?", ("{year}",)),
    ],
}
"""(question, answers) format strings per evidence type; fields are PageSpec's plus ``noun``.
Salient questions name large text only, fine-print questions name a fine-print word."""
FINE_PRINT_TEMPLATES = [
    ("Which page number has reference {code} from {source}, {year}?", ("P.{page_no}", "{page_no}")),
    ("On which page is the {year} note from {source} with reference {code}?", ("P.{page_no}", "{page_no}")),
]
"""``synfine`` questions: they name the fine-print key (source, code, year) and nothing salient."""


def question_kind(question: str) -> tuple[str, str] | None:
    """``(evidence, field)`` of a built-in question: the evidence type of the template it was made from
    (``salient`` or ``fine_print``) and the page field it asks for (``label``, ``value``, ``code``, ``year``,
    ``page_no``: its first answer's); ``None`` for any other question. Reports split answer accuracy by them, since
    the fields differ in what they take to read (relaxed accuracy's 5 % tolerance, for one, counts every year of
    2017–2024 as any other)."""
    question = question.removeprefix(QUERY_PREFIX).strip()
    return next((kind for pattern, kind in _QUESTION_PATTERNS if pattern.fullmatch(question)), None)


def question_field(question: str) -> str | None:
    """The page field a built-in question asks for (:func:`question_kind`); ``None`` for any other question."""
    kind = question_kind(question)
    return kind[1] if kind else None


def _question_pattern(template: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{\w+\\\}", ".+?", re.escape(template)))


_QUESTION_PATTERNS = [(_question_pattern(question), (evidence, re.search(r"\{(\w+)\}", answers[0]).group(1)))
                      for evidence, templates in (*TEMPLATES.items(), ("fine_print", FINE_PRINT_TEMPLATES))
                      for question, answers in templates]


class _Canvas:
    """An RGB page that records every string it draws, and the box of every ``region`` drawn; coordinates are in
    REFERENCE_SIZE units."""

    def __init__(self, width: int, height: int, fine_print_size: int):
        self.image = Image.new("RGB", (width, height), PAPER)
        self.draw = _MarkingDraw(ImageDraw.Draw(self.image), self)
        self.sx, self.sy = width / REFERENCE_SIZE[0], height / REFERENCE_SIZE[1]
        self.fine_print_size = fine_print_size
        self.items: list[TextItem] = []
        self.regions: list[tuple[str, tuple[int, ...]]] = []
        self._marks: list[tuple[int, ...]] | None = None

    @contextmanager
    def region(self, label: str) -> Iterator[None]:
        """Record the bounding box of everything drawn inside the block as one ``label`` box."""
        self._marks = []
        yield
        marks, self._marks = self._marks, None
        width, height = self.image.size
        box = (max(0, min(m[0] for m in marks)), max(0, min(m[1] for m in marks)),
               min(width, max(m[2] for m in marks)), min(height, max(m[3] for m in marks)))
        self.regions.append((label, box))

    def mark(self, box: tuple[int, ...]) -> None:
        """Note a drawn box (right/bottom exclusive) for the open region, if any."""
        if self._marks is not None:
            self._marks.append(tuple(box))

    def xy(self, x: float, y: float) -> tuple[int, int]:
        return round(x * self.sx), round(y * self.sy)

    def box(self, x0: float, y0: float, x1: float, y1: float) -> tuple[int, int, int, int]:
        return (*self.xy(x0, y0), *self.xy(x1, y1))

    def text(self, x: float, y: float, text: str, size: int, kind: str, fill=INK, anchor: str = "la") -> None:
        font = _font(max(1, round(size * min(self.sx, self.sy))))
        left, top, right, bottom = font.getbbox("H")
        box = self.draw.textbbox(self.xy(x, y), text, font=font, anchor=anchor)
        self.draw.text(self.xy(x, y), text, font=font, fill=fill, anchor=anchor)
        self.items.append(TextItem(text, kind, int(font.size), bottom - top, box))
        self.mark(box)

    def fine_print(self, spec: PageSpec) -> None:
        """Source and reference lines in small type at the foot of every page (its ``footer`` region)."""
        lines = (f"SOURCE: {spec.source} / {spec.year}", f"REF {spec.code}  P.{spec.page_no}")
        with self.region("footer"):
            for y, line in zip((128, 148), lines, strict=True):
                self.text(8, y, line, self.fine_print_size, "fine_print", fill=FINE_INK)


class _MarkingDraw:
    """Pillow's ImageDraw, marking the pixel box of every rectangle, ellipse and line on its canvas."""

    def __init__(self, draw: ImageDraw.ImageDraw, canvas: _Canvas):
        self._draw, self._canvas = draw, canvas

    def __getattr__(self, name: str):
        return getattr(self._draw, name)

    def _shape(self, name: str, xy, **kwargs) -> None:
        xs, ys = ([p[0] for p in xy], [p[1] for p in xy]) if isinstance(xy[0], tuple) else (xy[0::2], xy[1::2])
        self._canvas.mark((min(xs), min(ys), max(xs) + 1, max(ys) + 1))  # Pillow fills both corner pixels
        getattr(self._draw, name)(xy, **kwargs)

    def rectangle(self, xy, **kwargs) -> None:
        self._shape("rectangle", xy, **kwargs)

    def ellipse(self, xy, **kwargs) -> None:
        self._shape("ellipse", xy, **kwargs)

    def line(self, xy, **kwargs) -> None:
        self._shape("line", xy, **kwargs)


@cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's bundled scalable font: identical on every machine, no system fonts needed."""
    return ImageFont.load_default(size=size)


def _tint(colour: tuple[int, int, int], amount: float) -> tuple[int, int, int]:
    return tuple(round(c + (255 - c) * amount) for c in colour)


def _chart(c: _Canvas, s: PageSpec) -> None:
    with c.region("title"):
        c.text(8, 4, s.title, 22, "salient")
    with c.region("semantic_box"):
        c.draw.line([c.xy(10, 120), c.xy(140, 120)], fill=INK, width=1)
        for i, height in enumerate(s.bars):
            fill = LABELS[s.label] if i == s.accent else (190, 190, 190)
            c.draw.rectangle(c.box(16 + 31 * i, 120 - height * 0.85, 38 + 31 * i, 119), fill=fill)
        c.text(148, 40, f"{s.value}%", 30, "salient")
        c.text(148, 80, s.label, 16, "salient", fill=LABELS[s.label])


def _slide(c: _Canvas, s: PageSpec) -> None:
    with c.region("title"):
        c.draw.rectangle(c.box(0, 0, 224, 34), fill=(30, 50, 90))
        c.text(8, 6, s.title, 22, "salient", fill=PAPER)
    with c.region("semantic_box"):
        c.text(10, 44, f"{s.value}%", 40, "salient")
        c.draw.rectangle(c.box(124, 52, 140, 68), fill=LABELS[s.label])
        c.text(146, 52, s.label, 16, "salient", fill=LABELS[s.label])
        for i, width in enumerate(s.bars[:2]):
            c.draw.rectangle(c.box(124, 84 + 12 * i, 124 + width, 90 + 12 * i), fill=(200, 200, 200))
    c.draw.line([c.xy(0, 124), c.xy(224, 124)], fill=(120, 120, 120), width=1)


def _table(c: _Canvas, s: PageSpec) -> None:
    with c.region("title"):
        c.text(8, 4, s.title, 22, "salient")
    rows = [("Q1", f"{s.bars[0]}%", "filler"), ("Q2", f"{s.bars[1]}%", "filler")]
    rows.insert(s.accent % 3, (s.label, f"{s.value}%", "salient"))
    with c.region("semantic_box"):
        for i, (name, value, kind) in enumerate(rows):
            top = 34 + 28 * i
            if kind == "salient":
                c.draw.rectangle(c.box(8, top, 216, top + 28), fill=_tint(LABELS[s.label], 0.6))
            c.draw.rectangle(c.box(8, top, 216, top + 28), outline=INK, width=1)
            c.text(14, top + 6, name, 16, kind)
            c.text(130, top + 6, value, 16, kind)
        c.draw.line([c.xy(120, 34), c.xy(120, 118)], fill=INK, width=1)


def _infographic(c: _Canvas, s: PageSpec) -> None:
    c.draw.rectangle(c.box(0, 0, 224, 168), fill=_tint(LABELS[s.label], 0.85))
    with c.region("title"):
        c.text(8, 4, s.title, 22, "salient")
    with c.region("semantic_box"):
        c.draw.ellipse(c.box(20, 38, 96, 114), fill=LABELS[s.label])
        c.text(58, 76, f"{s.value}%", 24, "salient", fill=PAPER, anchor="mm")
        c.text(108, 44, s.label, 16, "salient", fill=LABELS[s.label])
        for i in range(s.bars[2] // 20):
            c.draw.rectangle(c.box(108 + 18 * i, 80, 120 + 18 * i, 92), fill=LABELS[s.label])


_RENDERERS = {"synchart": _chart, "synslide": _slide, "syntable": _table, "syninfo": _infographic}


DEMO = SyntheticConfig(n_train=1536, train_groups_per_style=32, train_fine_groups=32, test_fine_groups=4)
"""The corpus ``python train.py`` generates (``conf/data/synthetic.yaml``) and the command line's default, so
``python -m hkrag.data.synthetic --out data/synthetic`` writes the folder the demo reads (tests/test_synthetic.py
checks the two agree)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output dir (qa/, corpus/, pages.jsonl)")
    for field in dataclasses.fields(SyntheticConfig):
        flag, default = "--" + field.name.replace("_", "-"), getattr(DEMO, field.name)
        parser.add_argument(flag, type=int, default=default, help=f"default: {default} (the demo's corpus)")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = args.pop("out")
    generate(out, SyntheticConfig(**args))


if __name__ == "__main__":
    main()
