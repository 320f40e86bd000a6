"""Writing QA sets and page corpora in the OpenDocVQA hub layout that :mod:`hkrag.data.opendocvqa` reads.

The synthetic corpus and PDF ingestion write with :func:`save_split`, so the demo runs exactly the
loader path of the real data: one folder per config holding ``{split}-*.parquet`` files, registered in
the ``configs:`` front matter of the root ``README.md`` (docs/data.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from hkrag.data.images import warn_frames
from hkrag.data.opendocvqa import TEXT_COLUMNS_KEY, TEXT_KINDS, read_card
from hkrag.io import atomic_write, write_text

logger = logging.getLogger(__name__)


def save_split(
    rows: Iterable[dict[str, Any]],
    root: str | Path,
    config: str,
    split: str,
    features: datasets.Features,
    batch_size: int = 64,
) -> Path:
    """Stream ``rows`` into ``root/config/{split}-00000-of-00001.parquet`` and register it in README.md.

    Rows are encoded with ``features`` (images as PIL, bytes or paths) and written in batches,
    so large corpora need no more memory than one batch. Other configs in the card are kept. An in-memory
    PIL image holding several frames (a multi-page TIFF) is stored as its first frame, with a warning
    naming the document and the frame count.
    The file and the card are replaced atomically: a failure (full disk, bad row) leaves the previous
    version intact and raises naming the path.
    """
    root = Path(root)
    path = root / config / f"{split}-00000-of-00001.parquet"
    schema = features.arrow_schema
    count = 0

    def write(file) -> None:
        nonlocal count
        with pq.ParquetWriter(file, schema) as writer:
            for batch in _batched(rows, batch_size):
                for row in batch:
                    _warn_lost_frames(row)
                encoded = [features.encode_example(row) for row in batch]
                writer.write_table(pa.Table.from_pylist(encoded, schema=schema))
                count += len(batch)

    atomic_write(path, write, "wb")
    _register(root, config, split, f"{config}/{split}-*.parquet")
    logger.info("wrote %d rows to %s", count, path)
    return path


def _warn_lost_frames(row: dict[str, Any]) -> None:
    """Encoding keeps the first frame of an in-memory image (one opened from a file is stored as its path)."""
    image = row.get("image")
    if isinstance(image, Image.Image) and not getattr(image, "filename", ""):
        warn_frames(image, str(row.get("doc_id")), "stored")


def _batched(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _register(root: Path, config: str, split: str, pattern: str) -> None:
    """Add (or replace) ``config``/``split`` in the ``configs:`` front matter of root/README.md."""
    card = root / "README.md"
    meta, body = read_card(card)
    configs = meta.setdefault("configs", [])
    entry = next((c for c in configs if c["config_name"] == config), None)
    if entry is None:
        entry = {"config_name": config, "data_files": []}
        configs.append(entry)
    files = [f for f in entry["data_files"] if f["split"] != split] + [{"split": split, "path": pattern}]
    entry["data_files"] = sorted(files, key=lambda f: f["split"])
    configs.sort(key=lambda c: (c["config_name"] != "default", c["config_name"]))
    _write_card(card, meta, body)


def declare_text_columns(root: str | Path, kinds: dict[str, str]) -> None:
    """Record in root/README.md what the corpus's text columns hold (``text_columns``: column -> a TEXT_KINDS key).

    Replaces the previous declaration; hkrag.data.ocr reads it to tell a text layer from drawn strings.
    """
    unknown = {column: kind for column, kind in kinds.items() if kind not in TEXT_KINDS}
    if unknown:
        raise ValueError(f"unknown text kinds {unknown}: use one of {sorted(TEXT_KINDS)}")
    card = Path(root) / "README.md"
    meta, body = read_card(card)
    meta[TEXT_COLUMNS_KEY] = dict(kinds)
    _write_card(card, meta, body)


def _write_card(card: Path, meta: dict[str, Any], body: str) -> None:
    write_text(card, "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n" + body)
