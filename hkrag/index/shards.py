"""Corpus embeddings written in resumable, data-parallel shards.

Layout of an output directory::

    manifest.json            model, adapter, weights, config_hash, dtype, dim, count, shard_size, num_shards
    shard-00000.npy          vectors of rows [0, shard_size), dtype float16/float32
    shard-00000.json         {"shard", "start", "ids", "dim", "dtype", "fingerprint"}
    ...

A shard is the unit of work and of resumption: rank r of a world of size w encodes shards
s = r, r+w, r+2w, … with no communication (so ``accelerate launch`` data parallelism just works).
Each file is written to a temporary name and renamed (:mod:`hkrag.io`); the ``.json`` is renamed last
and marks the shard finished, so a job killed at any point restarts from its last finished shard.
A directory of another run, or a truncated / corrupt ``manifest.json``, ``.json`` or ``.npy``, raises
:class:`ShardError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hkrag.io import atomic_write, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DTYPES = ("float16", "float32")
# Manifest fields that identify what was encoded; a restart must agree on all of them.
IDENTITY = ("model", "adapter", "weights", "config_hash", "dtype", "count", "shard_size", "num_shards", "id_key")

EmbedFn = Callable[[list[Any]], Any]


class ShardError(ValueError):
    """An embedding directory that cannot be used (corrupt file, other run); the message names the file."""


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able config (key order does not matter)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def _row_id(row: Any, id_key: str) -> str:
    value = row[id_key] if isinstance(row, Mapping) else getattr(row, id_key)
    return str(value)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShardError(f"{path}: unreadable or corrupt JSON ({error}); delete it and re-run to re-encode") from error


def _read_vectors(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as error:
        raise ShardError(f"{path}: unreadable or truncated .npy ({error}); delete it and its .json, re-run") from error


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a shard directory; a clear error when there is none or it is corrupt."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {MANIFEST}; not an embedding shard directory")
    manifest = _read_json(path)
    required = ("model", "dtype", "count", "shard_size", "num_shards", "dim")
    missing = [k for k in required if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ShardError(f"{path}: missing fields {missing}; not a manifest written by encode_corpus")
    return manifest


def _check_agrees(existing: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> None:
    diff = {k: (existing.get(k), wanted[k]) for k in wanted if existing.get(k) != wanted[k]}
    if diff:
        details = ", ".join(f"{k}: on disk {old!r} vs now {new!r}" for k, (old, new) in diff.items())
        raise ShardError(
            f"{where} holds embeddings of a different run ({details}); use a fresh directory instead of mixing them"
        )


def _embed(embed_fn: EmbedFn, rows: list[Any], ids: list[str], dtype: str) -> np.ndarray:
    out = embed_fn(rows)
    if hasattr(out, "detach"):
        out = out.detach().float().cpu().numpy()
    out = np.asarray(out, dtype=np.float32)
    if out.ndim != 2 or len(out) != len(rows):
        raise ValueError(f"embed_fn returned shape {out.shape} for {len(rows)} rows; expected (n, dim)")
    bad = ~np.isfinite(out).all(axis=1)
    if bad.any():
        raise ValueError(f"non-finite embedding for documents {[i for i, b in zip(ids, bad) if b][:5]}")
    return out.astype(dtype)


def encode_corpus(
    items: Sequence[Any],
    embed_fn: EmbedFn,
    out_dir: str | Path,
    *,
    shard_size: int,
    manifest: Mapping[str, Any],
    dtype: str = "float16",
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    id_key: str = "doc_id",
    progress: bool = True,
) -> Path:
    """Embed ``items`` into ``out_dir`` shard by shard, skipping shards already finished.

    ``embed_fn(rows) -> (n, dim)`` tensor/array of L2-normalised embeddings. ``manifest`` names
    the run (``model``, ``adapter``, ``weights`` fingerprint, ``config_hash``; any extra keys are kept).
    This rank encodes shards ``s ≡ rank (mod world_size)``. Restarting into a directory written by a different run
    (model, adapter, config hash, dtype, sizes or dimension) raises instead of mixing vectors.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if shard_size <= 0 or batch_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"bad shard_size={shard_size}, batch_size={batch_size}, rank={rank}/{world_size}")
    missing = {"model", "config_hash"} - set(manifest)
    if missing:
        raise ValueError(f"manifest needs {sorted(missing)}")
    count = len(items)
    if count == 0:
        raise ValueError("cannot encode an empty corpus")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "adapter": None,
        "weights": None,
        **manifest,
        "dtype": dtype,
        "count": count,
        "shard_size": shard_size,
        "num_shards": -(-count // shard_size),
        "id_key": id_key,
    }
    if (out / MANIFEST).is_file():
        _check_agrees(read_manifest(out), {k: header[k] for k in IDENTITY}, out)

    todo = pending_shards(out, count, shard_size, rank, world_size)
    log.info("rank %d/%d: %d shard(s) to encode into %s", rank, world_size, len(todo), out)
    for shard in tqdm(todo, desc=f"encode (rank {rank})", unit="shard", disable=not progress):
        rows = [items[i] for i in range(shard * shard_size, min((shard + 1) * shard_size, count))]
        ids = [_row_id(row, id_key) for row in rows]
        vectors = np.concatenate(
            [
                _embed(embed_fn, rows[b : b + batch_size], ids[b : b + batch_size], dtype)
                for b in range(0, len(rows), batch_size)
            ]
        )
        _write_shard(out, shard, ids, vectors, header)
    return out


def pending_shards(out_dir: str | Path, count: int, shard_size: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """Shards ``s ≡ rank (mod world_size)`` of a ``count``-row corpus not yet finished in ``out_dir``."""
    num_shards = -(-count // shard_size)
    return [s for s in range(rank, num_shards, world_size) if not Path(out_dir, f"{shard_name(s)}.json").is_file()]


def _write_shard(out: Path, shard: int, ids: list[str], vectors: np.ndarray, header: Mapping[str, Any]) -> None:
    """Write one finished shard (vectors, then ids as the completion marker) and the manifest."""
    dim = int(vectors.shape[1])
    if (out / MANIFEST).is_file():
        _check_agrees(read_manifest(out), {"dim": dim}, out)
    else:
        write_json(out / MANIFEST, {**header, "dim": dim}, indent=1)
    meta = {
        "shard": shard,
        "start": shard * header["shard_size"],
        "ids": ids,
        "dim": dim,
        "dtype": header["dtype"],
        "fingerprint": config_hash({k: header[k] for k in IDENTITY}),
    }
    atomic_write(out / f"{shard_name(shard)}.npy", lambda f: np.save(f, vectors), "wb")
    write_json(out / f"{shard_name(shard)}.json", meta, indent=1)


def _shard_rows(manifest: Mapping[str, Any], shard: int) -> int:
    return min(manifest["shard_size"], manifest["count"] - shard * manifest["shard_size"])


def load_shards(directory: str | Path, *, expect: Mapping[str, Any] | None = None) -> tuple[list[str], np.ndarray]:
    """Read every shard into ``(ids, float32 vectors)`` after validating it against the manifest.

    Missing or unfinished shards, wrong shape/dtype, shards from another run, duplicate ids and
    manifest fields that disagree with ``expect`` (e.g. ``{"model": ..., "dim": 3072}``) raise.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if expect:
        _check_agrees(manifest, dict(expect), directory)
    fingerprint = config_hash({k: manifest.get(k) for k in IDENTITY})
    num, dim, dtype = manifest["num_shards"], manifest["dim"], manifest["dtype"]
    missing = [shard_name(s) for s in range(num) if not (directory / f"{shard_name(s)}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory}: {len(missing)} of {num} shard(s) missing or unfinished: {', '.join(missing[:10])}"
            " (re-run encode_corpus to finish them)"
        )
    vectors = np.empty((manifest["count"], dim), dtype=np.float32)
    ids: list[str] = []
    for shard in range(num):
        name = shard_name(shard)
        meta = _read_json(directory / f"{name}.json")
        if not isinstance(meta, dict) or not {"fingerprint", "ids"} <= set(meta):
            raise ShardError(f"{directory / name}.json: missing 'fingerprint' or 'ids'; delete it and re-run")
        block = _read_vectors(directory / f"{name}.npy")
        rows = _shard_rows(manifest, shard)
        if meta["fingerprint"] != fingerprint:
            raise ShardError(f"{directory}/{name} was written by a different run than {MANIFEST} describes")
        if block.shape != (rows, dim) or str(block.dtype) != dtype or len(meta["ids"]) != rows:
            raise ShardError(
                f"{directory}/{name}: vectors {block.shape} {block.dtype} with {len(meta['ids'])} ids; "
                f"manifest expects ({rows}, {dim}) {dtype}"
            )
        start = shard * manifest["shard_size"]
        vectors[start : start + rows] = block
        ids.extend(meta["ids"])
    if len(set(ids)) != len(ids):
        raise ShardError(f"{directory}: duplicate document ids across shards")
    return ids, vectors
