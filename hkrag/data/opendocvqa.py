"""OpenDocVQA QA sets and page corpora, read in the hub layout.

Everything goes through ``datasets.load_dataset(source, name=config, split=split)``, where
``source`` is a hub id (``NTT-hil-insight/OpenDocVQA``, ``NTT-hil-insight/OpenDocVQA-Corpus``)
or a local directory in the same layout: one folder per config holding
``{split}-*.parquet`` files and a ``README.md`` whose ``configs:`` front matter maps configs
and splits to files. The synthetic corpus and PDF ingestion write that layout with
:func:`hkrag.data.writer.save_split`, so the demo runs exactly the loader path of the real data.

QA rows: ``query_id, query, answers, relevant_doc_ids`` (+ optional ``evidence``).
Corpus rows: ``doc_id, image`` (+ optional ``text``: the page's text in reading order, written by the
synthetic corpus and PDF ingestion, read by VDocRAG pre-training, docs/training.md; the card's ``text_columns``
says whether it is drawn ground truth or a PDF text layer, :func:`text_kinds`).
Training uses the default config's ``train`` split (paired by
:mod:`hkrag.data.pairs`), tests use ``<dataset>`` / ``all`` configs with split ``test`` (see :func:`pools`).

A data set that cannot be used (not loadable, malformed card, empty split, missing column, null or
repeated id, a ``doc_id`` naming different pages in a data set's pool and in ``all``) raises
:class:`DataError` naming the source, config, split and row. ``answers`` and
``relevant_doc_ids`` stored as a plain string mean one element. Local folders are cached outside
the folder (``$HF_DATASETS_CACHE/hkrag-local/<key>``), so read-only copies load.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from hkrag.data.images import DEFAULT_MAX_PIXELS, open_image

logger = logging.getLogger(__name__)

QA_HUB_ID = "NTT-hil-insight/OpenDocVQA"
CORPUS_HUB_ID = "NTT-hil-insight/OpenDocVQA-Corpus"
DATASETS = ("chartqa", "slidevqa", "infovqa", "dude")
ALL_POOL = "all"
QUERY_PREFIX = "Instruct: I’m looking for an image that answers the question.\nQuery: "

QA_COLUMNS = ("query_id", "query", "answers", "relevant_doc_ids")
CORPUS_COLUMNS = ("doc_id", "image")
_strings = datasets.List(datasets.Value("string"))
QA_FEATURES = datasets.Features(
    {
        "query_id": datasets.Value("string"),
        "query": datasets.Value("string"),
        "answers": _strings,
        "relevant_doc_ids": _strings,
        "evidence": datasets.Value("string"),
    }
)
CORPUS_FEATURES = datasets.Features({"doc_id": datasets.Value("string"), "image": datasets.Image()})
TEXT_COLUMN = "text"
PAGE_TEXT_FEATURES = datasets.Features({**CORPUS_FEATURES, TEXT_COLUMN: datasets.Value("string")})
"""A corpus whose pages carry their text (optional column: corpora without it load as before)."""
TEXT_COLUMNS_KEY = "text_columns"
"""Card front-matter key mapping a corpus's text columns to their :data:`TEXT_KINDS` (``text: drawn``)."""
TEXT_KINDS = {
    "drawn": "the exact strings the synthetic corpus drew on the page (ground truth, not a text layer)",
    "text_layer": "a born-digital file's embedded text (a PDF's text layer; empty for a scanned page)",
    "ocr": "Tesseract's reading of the page image (hkrag.data.ocr)",
    "text_layer+ocr": "the text layer where the page has one, else Tesseract's reading (hkrag.data.ocr)",
}
"""What a text column can hold; only ``text_layer`` is a text layer that OCR may take instead of reading a page."""
PRETRAIN_HUB_ID = "NTT-hil-insight/VDocRetriever-Pretrain-DocStruct"
"""VDocRAG's pre-training pages: ``query`` (the page's OCR text) and ``image``, no ``doc_id``."""


class DataError(ValueError):
    """A data set that cannot be used as is; the message names it (source[config/split]) and the row."""


def format_query(question: str) -> str:
    """Prefix a question with the OpenDocVQA retrieval instruction."""
    return QUERY_PREFIX + question


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers and the pages that answer it."""

    query_id: str
    query: str
    answers: tuple[str, ...]
    relevant_doc_ids: tuple[str, ...]
    evidence: str | None = None


def load_qa(
    source: str | Path = QA_HUB_ID, config: str | None = None, split: str = "train", **load_kwargs: Any
) -> list[QAExample]:
    """Load a QA set. ``load_kwargs`` go to ``datasets.load_dataset`` (e.g. ``cache_dir``).

    An empty query (blank, or the instruction prefix alone), a null or repeated ``query_id`` is a
    broken data set, not a known gap, so it raises :class:`DataError` naming the row instead of
    quietly shrinking the evaluation.
    """
    dataset = _load(source, config, split, QA_COLUMNS, load_kwargs)
    name = _name(source, config, split)
    columns = [c for c in (*QA_COLUMNS, "evidence") if c in dataset.column_names]
    examples, seen = [], set()
    for index, row in enumerate(_decoded_rows(dataset.select_columns(columns), name, source, config, split)):
        example = QAExample(
            query_id=_identifier(row["query_id"], "query_id", index, name),
            query=row["query"] or "",
            answers=_strings_of(row["answers"]),
            relevant_doc_ids=_strings_of(row["relevant_doc_ids"]),
            evidence=row.get("evidence"),
        )
        if not example.query.removeprefix(QUERY_PREFIX).strip():
            raise DataError(f"{name}: query {example.query_id!r} has an empty query")
        if example.query_id in seen:
            raise DataError(f"{name}: duplicate query_id {example.query_id!r}")
        seen.add(example.query_id)
        examples.append(example)
    logger.info("loaded %d queries from %s", len(examples), _name(source, config, split))
    return examples


def _decoded_rows(dataset: datasets.Dataset, name: str, source: str | Path, config: str | None,
                  split: str) -> list[dict[str, Any]]:
    """The rows of ``dataset``; a stored string whose bytes are not UTF-8 (Arrow does not check what a parquet file
    holds) is a :class:`DataError` naming the data set, its parquet file(s), the row, its ``query_id`` and column,
    instead of the bare ``UnicodeDecodeError`` of reading the column."""
    try:
        return list(dataset)
    except UnicodeDecodeError:
        pass
    table = dataset.with_format("arrow")[:]
    ids = table.column("query_id").to_pylist() if "query_id" in table.column_names else None
    bad = []
    for column in table.column_names:
        for row, value in enumerate(table.column(column)):
            try:
                value.as_py()
            except UnicodeDecodeError as error:
                bad.append((row, column, f"{error.reason} at byte {error.start}"))
    row, column, reason = min(bad)
    files = (_split_files(Path(source), config, split) or sorted(Path(source).glob(f"**/{split}-*.parquet"))
             if _looks_local(source) else [])
    where = f" ({', '.join(map(str, files))})" if files else ""
    query = f" (query_id {ids[row]!r})" if ids is not None and column != "query_id" else ""
    raise DataError(f"{name}{where}: row {row}{query}, column {column!r} is not UTF-8 text ({reason}); {len(bad)} "
                    "value(s) in all: re-export the split with its text decoded as UTF-8")


def _strings_of(value: Any) -> tuple[str, ...]:
    """A list column as a tuple of strings; a plain string is one element (never its characters)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, int, float)):
        value = [value]
    return tuple(str(v) for v in value if v is not None)


def _identifier(value: Any, column: str, row: int, name: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{name}: row {row} has a null or empty {column}")
    return str(value)


@dataclass(frozen=True)
class CorpusPage:
    """A page; ``text`` is its text layer when the corpus has a ``text`` column, else ``None``."""

    doc_id: str
    image: Image.Image
    text: str | None = None


class Corpus:
    """A page corpus indexed by position and by ``doc_id``, decoding one image at a time.

    Only the ``doc_id`` column is read up front (an id -> row map); images stay encoded in the
    Arrow table until a page is requested, so a 200k-page corpus never sits in memory decoded.
    ``corpus[i]`` and ``corpus["doc id"]`` both return a :class:`CorpusPage`.
    """

    def __init__(self, dataset: datasets.Dataset, name: str = "corpus", max_pixels: int | None = DEFAULT_MAX_PIXELS):
        _require_columns(dataset, CORPUS_COLUMNS, name)
        image_feature = dataset.features["image"]
        if isinstance(image_feature, datasets.Image) and image_feature.decode:
            dataset = dataset.cast_column("image", datasets.Image(decode=False))
        self.dataset = dataset
        self.name = name
        self.max_pixels = max_pixels
        self.doc_ids = [_identifier(doc_id, "doc_id", row, name) for row, doc_id in enumerate(dataset["doc_id"][:])]
        self.has_text = TEXT_COLUMN in dataset.column_names
        self._rows: dict[str, int] = {}
        for row, doc_id in enumerate(self.doc_ids):
            if doc_id in self._rows:
                raise DataError(f"{name}: duplicate doc_id {doc_id!r} (rows {self._rows[doc_id]} and {row})")
            self._rows[doc_id] = row

    def __len__(self) -> int:
        return len(self.doc_ids)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._rows

    def __iter__(self) -> Iterator[CorpusPage]:
        return (self[row] for row in range(len(self)))

    def __getitem__(self, key: int | str) -> CorpusPage:
        row = self.index(key) if isinstance(key, str) else key
        doc_id = self.doc_ids[row]
        record = self.dataset[row]
        image = open_image(record["image"], doc_id, max_pixels=self.max_pixels)
        return CorpusPage(doc_id, image, record.get(TEXT_COLUMN))

    def texts(self) -> list[str | None]:
        """Every page's text in row order (without decoding images); all ``None`` without a ``text`` column."""
        return list(self.dataset[TEXT_COLUMN][:]) if self.has_text else [None] * len(self)

    def fingerprints(self) -> list[str]:
        """A short hash of each page's stored image (bytes, else path), in row order, without decoding.

        Tells whether two corpora hold the same page under one ``doc_id`` (evaluation reuses embeddings
        across pools only then). Reads the image column batch by batch, never the whole corpus at once.
        """
        table = self.dataset.select_columns(["image"]).with_format("arrow")[:]
        digests = []
        for batch in table.to_batches(max_chunksize=256):
            column = batch.column(0)
            if pa.types.is_struct(column.type):
                keys = [data or str(path).encode() for data, path in
                        zip(column.field("bytes").to_pylist(), column.field("path").to_pylist())]
            else:
                keys = [value if isinstance(value, bytes) else str(value).encode() for value in column.to_pylist()]
            digests.extend(hashlib.sha1(key).hexdigest()[:16] for key in keys)
        return digests

    def index(self, doc_id: str) -> int:
        """Row of ``doc_id``; ``KeyError`` naming the id and corpus if absent."""
        try:
            return self._rows[doc_id]
        except KeyError:
            raise KeyError(f"doc_id {doc_id!r} is not in {self.name}") from None

    def __repr__(self) -> str:
        return f"Corpus(name={self.name!r}, pages={len(self)})"


def load_corpus(
    source: str | Path = CORPUS_HUB_ID,
    config: str | None = None,
    split: str = "train",
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    **load_kwargs: Any,
) -> Corpus:
    """Load a page corpus (``doc_id, image``) as a lazily decoding :class:`Corpus`."""
    dataset = _load(source, config, split, CORPUS_COLUMNS, load_kwargs)
    corpus = Corpus(dataset, name=_name(source, config, split), max_pixels=max_pixels)
    logger.info("loaded %s", corpus)
    return corpus


def load_pretraining_corpus(
    source: str | Path = PRETRAIN_HUB_ID,
    config: str | None = None,
    split: str = "train",
    text_column: str = "query",
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    **load_kwargs: Any,
) -> Corpus:
    """Pages with their text for VDocRAG pre-training, as a :class:`Corpus` whose pages carry ``text``.

    ``text_column`` names the text (``query`` in VDocRetriever-Pretrain-DocStruct, ``text`` in our
    corpora); a set without ``doc_id`` gets the row numbers (``"0"``, ``"1"``, ...) as ids.
    """
    dataset = _load(source, config, split, (text_column, "image"), load_kwargs)
    if text_column != TEXT_COLUMN:
        dataset = dataset.remove_columns([c for c in (TEXT_COLUMN,) if c in dataset.column_names])
        dataset = dataset.rename_column(text_column, TEXT_COLUMN)
    if "doc_id" not in dataset.column_names:
        dataset = dataset.add_column("doc_id", [str(row) for row in range(len(dataset))])
    corpus = Corpus(dataset, name=_name(source, config, split), max_pixels=max_pixels)
    logger.info("loaded %s with page texts", corpus)
    return corpus


def check_pool_pages(pool: Corpus, union: Corpus) -> None:
    """Refuse a ``doc_id`` that names one page in a data set's ``pool`` and another in ``union`` (``all``).

    Both pools are scored with one set of relevance judgements, so a ``doc_id`` must be one page. Stored
    images are compared by a hash of their bytes; pages whose bytes differ are decoded and compared pixel
    by pixel, so the same page encoded twice passes. Raises :class:`DataError` naming the ids and both corpora.
    """
    theirs = dict(zip(union.doc_ids, union.fingerprints()))
    differing = [doc_id for doc_id, mine in zip(pool.doc_ids, pool.fingerprints())
                 if theirs.get(doc_id, mine) != mine and not _same_pixels(pool[doc_id].image, union[doc_id].image)]
    if differing:
        raise DataError(
            f"doc_id {differing[0]!r} holds different pages in {pool.name} and {union.name}"
            + (f" (and {len(differing) - 1} more: {differing[1:6]})" if len(differing) > 1 else "")
            + "; a doc_id must name one page in every corpus config: fix the page or rename one of them"
        )


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def pools(dataset: str) -> dict[str, str]:
    """Corpus configs to search for a QA config: its own pages, and every data set's pages."""
    return {"single": dataset, "all": ALL_POOL}


def qrels(qa: Iterable[QAExample]) -> dict[str, dict[str, int]]:
    """Binary relevance judgements ``{query_id: {doc_id: 1}}`` from ``relevant_doc_ids``."""
    return {ex.query_id: dict.fromkeys(ex.relevant_doc_ids, 1) for ex in qa}


def _load(
    source: str | Path, config: str | None, split: str, required: tuple[str, ...], load_kwargs: dict[str, Any]
) -> datasets.Dataset:
    if _looks_local(source) and not Path(source).exists():
        raise FileNotFoundError(
            f"data path {source} does not exist: give a local copy in the hub layout or a hub id like owner/name"
        )
    if _looks_local(source):
        load_kwargs = {"cache_dir": str(_local_cache_dir(Path(source))), **load_kwargs}
    name = _name(source, config, split)
    try:
        dataset = datasets.load_dataset(str(source), name=config, split=split, **load_kwargs)
    except Exception as error:
        if _looks_local(source) and stored_rows(Path(source), config, split) == 0:
            raise _empty(name, config, split) from error
        raise DataError(f"{name} could not be loaded: {_explain(error, split)}") from error
    if len(dataset) == 0:
        raise _empty(name, config, split)
    _require_columns(dataset, required, name)
    return dataset


def _empty(name: str, config: str | None, split: str) -> DataError:
    return DataError(f"{name} is empty: split {split!r} of config {config or 'default'!r} has no rows; "
                     "regenerate or re-export it")


def stored_rows(root: Path, config: str | None, split: str) -> int | None:
    """Rows in the parquet files a local folder's card maps ``config``/``split`` to; ``None`` if unknown.

    ``datasets`` reports an empty split in many ways (a zero-row file fails with "An error occurred while
    generating the dataset"); counting the rows tells an empty split from a broken one.
    """
    files = _split_files(root, config, split)
    try:
        return sum(pq.ParquetFile(path).metadata.num_rows if path.stat().st_size else 0 for path in files) \
            if files else None
    except (OSError, pa.ArrowException):
        return None


def _split_files(root: Path, config: str | None, split: str) -> list[Path]:
    """The parquet files a local folder's card maps ``config``/``split`` to (``[]`` when it cannot tell)."""
    try:
        meta, _ = read_card(root / "README.md")
        entry = next(c for c in meta.get("configs", []) if c.get("config_name") == (config or "default"))
        patterns = [f["path"] for f in entry.get("data_files", []) if f.get("split") == split]
        return sorted({p for pattern in patterns for pat in _as_list(pattern) for p in root.glob(pat)})
    except (DataError, StopIteration, OSError, TypeError, AttributeError):
        return []


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _explain(error: Exception, split: str) -> str:
    """The loader's error in words that name what to fix."""
    text = str(error).strip()
    if f'"{split}" corresponds to no data' in text:
        return "the split has no rows (empty parquet files)"
    if isinstance(error, yaml.YAMLError):
        return f"README.md has malformed YAML front matter ({text.splitlines()[0]})"
    return f"{type(error).__name__}: {text}"


def _local_cache_dir(root: Path) -> Path:
    """A cache folder outside ``root``, keyed by its location and its files' relative paths, sizes and mtimes.

    ``datasets`` keys its cache of a local folder on the folder's name and layout, so two different
    ``.../qa`` folders (or one rewritten in place) would silently share one cached copy. The cache
    lives under ``$HF_DATASETS_CACHE/hkrag-local`` so a read-only data folder loads.
    """
    root = root.expanduser().resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts)
    stamp = hashlib.sha256(str(root).encode())
    for path in files:
        info = path.stat()
        stamp.update(f"{path.relative_to(root)}|{info.st_size}|{info.st_mtime_ns}\n".encode())
    return Path(os.fspath(datasets.config.HF_DATASETS_CACHE)) / "hkrag-local" / stamp.hexdigest()[:16]


def _looks_local(source: str | Path) -> bool:
    """A path rather than a hub id (``owner/name``)."""
    text = str(source)
    return isinstance(source, Path) or text.startswith(("/", ".", "~")) or text.count("/") != 1


def _require_columns(dataset: datasets.Dataset, required: tuple[str, ...], name: str) -> None:
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise DataError(f"{name}: missing columns {missing} (has {dataset.column_names})")


def _name(source: str | Path, config: str | None, split: str) -> str:
    return f"{source}[{config or 'default'}/{split}]"


def text_kinds(source: str | Path) -> dict[str, str]:
    """What each text column of a local corpus holds, as its card declares (``text_columns``; :data:`TEXT_KINDS`).

    A hub id, or a card that declares nothing (OpenDocVQA, corpora written before the key existed), gives ``{}``.
    Raises :class:`DataError` naming the card when the declaration is malformed or names an unknown kind.
    """
    if not Path(source).is_dir():
        return {}
    card = Path(source) / "README.md"
    declared = read_card(card)[0].get(TEXT_COLUMNS_KEY) or {}
    if not isinstance(declared, dict) or any(kind not in TEXT_KINDS for kind in declared.values()):
        raise DataError(f"{card}: {TEXT_COLUMNS_KEY} must map column names to one of {sorted(TEXT_KINDS)}, "
                        f"got {declared!r}")
    return {str(column): kind for column, kind in declared.items()}


def read_card(card: Path) -> tuple[dict[str, Any], str]:
    """A data set card's front matter and body; no card reads as no configs and a default body."""
    if not card.exists():
        return {}, "Pages and questions in the OpenDocVQA layout, written by `hkrag.data`.\n"
    text = card.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return {}, text
    front, _, body = text[4:].partition("\n---\n")
    try:
        meta = yaml.safe_load(front) or {}
    except yaml.YAMLError as error:
        raise DataError(f"{card}: malformed YAML front matter ({str(error).splitlines()[0]})") from error
    if not isinstance(meta, dict) or not isinstance(meta.get("configs", []), list):
        raise DataError(f"{card}: front matter must be a mapping with a 'configs' list")
    return meta, body
