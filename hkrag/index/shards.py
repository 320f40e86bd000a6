"""Corpus embeddings written in resumable, data-parallel shards.

Layout of an output directory::

    manifest.json            model, adapter, weights, config_hash, dtype, dim, count, shard_size, num_shards
    shard-00000.npy          vectors of rows [0, shard_size), dtype float16/float32
    shard-00000.json         {"shard", "start", "ids", "dim", "dtype", "fingerprint"}
    ...

Multi-vector (late-interaction) embeddings, ``layout: multi_vector`` in the manifest, store a shard's token vectors
end to end and where each page's start::

    shard-00000.npy          vectors [total_tokens, dim], float16/float32, the pages' tokens in row order
    shard-00000.offsets.npy  int64 [rows + 1]: page i's vectors are rows offsets[i] .. offsets[i + 1] - 1

The layout is part of the identity: a directory of one layout refuses the other (and another dimension), so dense
and multi-vector shards are never mixed.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hkrag.io import atomic_write, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DTYPES = ("float16", "float32")
MULTI_VECTOR = "multi_vector"
"""The manifest's ``layout`` of multi-vector shards (absent for dense ones, so their identity is unchanged)."""
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


def _check_agrees(
    existing: Mapping[str, Any], wanted: Mapping[str, Any], where: Path, shard: str | None = None
) -> None:
    """Raise unless ``existing`` (a manifest on disk) has ``wanted``'s values; ``shard`` names the shard about to be
    written into ``where`` when the check guards that write."""
    diff = {k: (existing.get(k), wanted[k]) for k in wanted if existing.get(k) != wanted[k]}
    if diff:
        details = ", ".join(f"{k}: on disk {old!r} vs now {new!r}" for k, (old, new) in diff.items())
        refused = f"; {where / shard} not written" if shard else ""
        raise ShardError(
            f"{where} holds embeddings of a different run ({details}){refused}; use a fresh directory instead of "
            "mixing them"
        )


def _identity_of(header: Mapping[str, Any]) -> dict[str, Any]:
    """``header``'s identity with ``layout`` always present (``None`` for dense), so either layout refuses the other."""
    return {**identity(header), "layout": header.get("layout")}


def identity(header: Mapping[str, Any]) -> dict[str, Any]:
    """The identity fields of a manifest: :data:`IDENTITY`, and ``layout`` for multi-vector shards."""
    fields = {k: header.get(k) for k in IDENTITY}
    return {**fields, "layout": header["layout"]} if header.get("layout") else fields


def _embed_tokens(embed_fn: EmbedFn, rows: list[Any], dtype: str) -> list[np.ndarray]:
    """One ``(tokens, dim)`` array per row from a multi-vector ``embed_fn``, checked."""
    out = [np.asarray(t.detach().float().cpu().numpy() if hasattr(t, "detach") else t, dtype=np.float32)
           for t in embed_fn(rows)]
    if len(out) != len(rows) or any(t.ndim != 2 or len(t) == 0 or t.shape[1] != out[0].shape[1] for t in out):
        shapes = [t.shape for t in out[:3]]
        raise ValueError(f"embed_fn returned {len(out)} arrays (e.g. {shapes}) for {len(rows)} rows; expected one "
                         "(tokens >= 1, dim) array per row, one dim")
    return [t.astype(dtype) for t in out]


def _embed(embed_fn: EmbedFn, rows: list[Any], dtype: str) -> np.ndarray:
    out = embed_fn(rows)
    if hasattr(out, "detach"):
        out = out.detach().float().cpu().numpy()
    out = np.asarray(out, dtype=np.float32)
    if out.ndim != 2 or len(out) != len(rows):
        raise ValueError(f"embed_fn returned shape {out.shape} for {len(rows)} rows; expected (n, dim)")
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
    multi_vector: bool = False,
) -> Path:
    """Embed ``items`` into ``out_dir`` shard by shard, skipping shards already finished.

    ``embed_fn(rows) -> (n, dim)`` tensor/array of L2-normalised embeddings; with ``multi_vector`` a list of one
    ``(tokens, dim)`` array per row, stored as the module docstring says. ``manifest`` names
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
        **({"layout": MULTI_VECTOR} if multi_vector else {}),
    }
    if (out / MANIFEST).is_file():
        _check_agrees(read_manifest(out), _identity_of(header), out)

    todo = pending_shards(out, count, shard_size, rank, world_size)
    log.info("rank %d/%d: %d shard(s) to encode into %s", rank, world_size, len(todo), out)
    for shard in tqdm(todo, desc=f"encode (rank {rank})", unit="shard", disable=not progress):
        rows = [items[i] for i in range(shard * shard_size, min((shard + 1) * shard_size, count))]
        ids = [_row_id(row, id_key) for row in rows]
        embed = _embed_tokens if multi_vector else _embed
        parts = [embed(embed_fn, rows[b : b + batch_size], dtype)
                 for b in range(0, len(rows), batch_size)]
        offsets = None
        if multi_vector:
            pages = [tokens for part in parts for tokens in part]
            offsets = np.concatenate([[0], np.cumsum([len(t) for t in pages])]).astype(np.int64)
            parts = pages
        _write_shard(out, shard, ids, np.concatenate(parts), header, offsets)
    return out


def pending_shards(out_dir: str | Path, count: int, shard_size: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """Shards ``s ≡ rank (mod world_size)`` of a ``count``-row corpus not yet finished in ``out_dir``."""
    num_shards = -(-count // shard_size)
    return [s for s in range(rank, num_shards, world_size) if not Path(out_dir, f"{shard_name(s)}.json").is_file()]


def _write_shard(out: Path, shard: int, ids: list[str], vectors: np.ndarray, header: Mapping[str, Any],
                 offsets: np.ndarray | None = None) -> None:
    """Write one finished shard (vectors and any offsets, then ids as the completion marker) and the manifest.

    The manifest on disk is checked again here, identity and dimension, not only when the job started: another job
    that started into the same empty directory at the same time (e.g. a Slurm array task run with another
    ``model.head``) may have written it since, and this shard would then be of another run than its manifest."""
    check_finite(vectors, ids, f"{out}/{shard_name(shard)}", offsets, "not written: the model gave NaN or infinite "
                 "values (or values beyond the shard's dtype, e.g. float16's 65504), a numerical fault to fix first")
    dim = int(vectors.shape[1])
    if (out / MANIFEST).is_file():
        _check_agrees(read_manifest(out), {**_identity_of(header), "dim": dim}, out, shard_name(shard))
    else:
        write_json(out / MANIFEST, {**header, "dim": dim}, indent=1)
    meta = {
        "shard": shard,
        "start": shard * header["shard_size"],
        "ids": ids,
        "dim": dim,
        "dtype": header["dtype"],
        "fingerprint": config_hash(identity(header)),
    }
    if offsets is not None:
        atomic_write(out / f"{shard_name(shard)}.offsets.npy", lambda f: np.save(f, offsets), "wb")
    atomic_write(out / f"{shard_name(shard)}.npy", lambda f: np.save(f, vectors), "wb")
    write_json(out / f"{shard_name(shard)}.json", meta, indent=1)


def nonfinite_rows(vectors: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``vectors`` holding a NaN or an infinity. One reduction over the whole array first
    (float16: the exponent bits compared as integers, about 40x faster than ``np.isfinite``, which has no vector path
    for half floats; otherwise the sum, which a NaN or an infinity makes non-finite, and which an overflow of finite
    values only sends to the exact check); the rows are located only when that finds one."""
    if vectors.size == 0:
        return np.zeros(0, np.int64)
    if vectors.dtype == np.float16 and vectors.flags.c_contiguous:
        clean = (vectors.view(np.uint16) & np.uint16(0x7FFF)).max() < 0x7C00  # exponent all ones: inf or NaN
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            clean = bool(np.isfinite(vectors.sum()))
    return np.zeros(0, np.int64) if clean else np.flatnonzero(~np.isfinite(vectors).all(axis=1))


def check_finite(vectors: np.ndarray, ids: Sequence[str], name: str, offsets: np.ndarray | None = None,
                 advice: str = "delete the shard's files and re-run to re-encode it") -> None:
    """Refuse (:class:`ShardError`) a shard ``name`` with a NaN or infinite value, naming the first bad row (the page,
    for multi-vector ``offsets``), its page id and how many rows are bad."""
    rows = nonfinite_rows(vectors)
    if not len(rows):
        return
    pages = rows if offsets is None else np.unique(np.searchsorted(offsets, rows, side="right") - 1)
    row = int(pages[0])
    token = f", token {int(rows[0]) - int(offsets[row])}" if offsets is not None else ""
    raise ShardError(f"{name}: row {row} (page id {ids[row]!r}{token}) holds NaN or infinite values ({len(pages)} of "
                     f"{len(ids)} rows do); {advice}")


def _shard_rows(manifest: Mapping[str, Any], shard: int) -> int:
    return min(manifest["shard_size"], manifest["count"] - shard * manifest["shard_size"])


def load_shards(directory: str | Path, *, expect: Mapping[str, Any] | None = None) -> tuple[list[str], np.ndarray]:
    """Read every shard into ``(ids, float32 vectors)`` after validating it against the manifest.

    Missing or unfinished shards, wrong shape/dtype, shards from another run, duplicate ids and
    manifest fields that disagree with ``expect`` (e.g. ``{"model": ..., "dim": 3072}``) raise.
    """
    directory = Path(directory)
    manifest = _finished_manifest(directory, expect, multi_vector=False)
    num, dim, dtype = manifest["num_shards"], manifest["dim"], manifest["dtype"]
    vectors = np.empty((manifest["count"], dim), dtype=np.float32)
    ids: list[str] = []
    for shard in range(num):
        name = shard_name(shard)
        meta = _shard_meta(directory, manifest, shard)
        block = _read_vectors(directory / f"{name}.npy")
        rows = _shard_rows(manifest, shard)
        if block.shape != (rows, dim) or str(block.dtype) != dtype or len(meta["ids"]) != rows:
            raise ShardError(
                f"{directory}/{name}: vectors {block.shape} {block.dtype} with {len(meta['ids'])} ids; "
                f"manifest expects ({rows}, {dim}) {dtype}"
            )
        check_finite(block, meta["ids"], f"{directory}/{name}")
        start = shard * manifest["shard_size"]
        vectors[start : start + rows] = block
        ids.extend(meta["ids"])
    _check_unique(directory, ids)
    return ids, vectors


def _check_unique(directory: Path, ids: list[str]) -> None:
    if len(set(ids)) != len(ids):
        raise ShardError(f"{directory}: duplicate document ids across shards")


def _finished_manifest(directory: Path, expect: Mapping[str, Any] | None, multi_vector: bool) -> dict[str, Any]:
    """The manifest of a directory whose every shard is finished, in the layout asked for, agreeing with
    ``expect``; else a :class:`ShardError` (another layout, another run) or ``FileNotFoundError`` (unfinished)."""
    manifest = read_manifest(directory)
    check_layout(directory, multi_vector, manifest)
    if expect:
        _check_agrees(manifest, dict(expect), directory)
    num = manifest["num_shards"]
    missing = [shard_name(s) for s in range(num) if not (directory / f"{shard_name(s)}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory}: {len(missing)} of {num} shard(s) missing or unfinished: {', '.join(missing[:10])}"
            " (re-run encode_corpus to finish them)"
        )
    return manifest


def check_layout(directory: str | Path, multi_vector: bool, manifest: Mapping[str, Any] | None = None) -> None:
    """Refuse (:class:`ShardError`) a shard directory whose ``manifest`` (read from ``directory`` when not given; no
    manifest passes) holds the other layout than ``multi_vector`` asks for. Needs no model, so a job whose shards
    are all finished still refuses another head's folder before it reports nothing left to do."""
    if manifest is None:
        if not (Path(directory) / MANIFEST).is_file():
            return
        manifest = read_manifest(directory)
    layout = manifest.get("layout")
    if (layout == MULTI_VECTOR) != multi_vector:
        found, wanted = ("multi-vector", "dense") if layout == MULTI_VECTOR else ("dense", "multi-vector")
        raise ShardError(f"{directory} holds {found} embeddings, not the {wanted} ones asked for (model.head "
                         "differs from the run that encoded it); use a fresh directory or the matching head")


def _shard_meta(directory: Path, manifest: Mapping[str, Any], shard: int) -> dict[str, Any]:
    """A finished shard's ``.json``, checked to belong to the run the manifest describes."""
    name = shard_name(shard)
    meta = _read_json(directory / f"{name}.json")
    if not isinstance(meta, dict) or not {"fingerprint", "ids"} <= set(meta):
        raise ShardError(f"{directory / name}.json: missing 'fingerprint' or 'ids'; delete it and re-run")
    if meta["fingerprint"] != config_hash(identity(manifest)):
        raise ShardError(f"{directory}/{name} was written by a different run than {MANIFEST} describes")
    return meta


def check_multivectors(
    vectors: np.ndarray, offsets: np.ndarray, *, name: str = "pages", dim: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(vectors, offsets)`` checked as the shard format, with an error naming ``name`` and the bad row."""
    vectors, offsets = np.asarray(vectors), np.asarray(offsets)
    if vectors.ndim != 2 or not np.issubdtype(vectors.dtype, np.floating):
        raise ValueError(f"{name}: vectors must be a float [tokens, dim] array, got {vectors.dtype} {vectors.shape}")
    if dim is not None and vectors.shape[1] != dim:
        raise ValueError(f"{name}: vectors have dim {vectors.shape[1]}, expected {dim} (dim mismatch)")
    if offsets.ndim != 1 or len(offsets) < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(f"{name}: offsets must be an integer [n_pages + 1] array, got {offsets.dtype} {offsets.shape}")
    if offsets[0] != 0 or offsets[-1] != len(vectors):
        raise ValueError(
            f"{name}: offsets must run from 0 to the {len(vectors)} vectors, got {offsets[0]}..{offsets[-1]}"
        )
    ragged = np.flatnonzero(np.diff(offsets) <= 0)
    if len(ragged):
        row = int(ragged[0])
        raise ValueError(
            f"{name}: offsets must increase strictly (every page holds a vector); page {row} spans "
            f"offsets[{row}]={offsets[row]}..offsets[{row + 1}]={offsets[row + 1]}"
        )
    return vectors, offsets.astype(np.int64, copy=False)


def iter_multi_vector_shards(
    directory: str | Path, *, expect: Mapping[str, Any] | None = None
) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """Each shard of a multi-vector directory as ``(ids, vectors, offsets)``: ``vectors`` the memory-mapped
    ``[tokens, dim]`` array as stored, ``offsets`` int64 ``[rows + 1]`` into it. Checked as :func:`load_shards`
    checks dense shards (a dense directory is refused); offsets must start at 0, rise and end at the row count."""
    directory = Path(directory)
    manifest = _finished_manifest(directory, expect, multi_vector=True)
    dim, dtype = manifest["dim"], manifest["dtype"]
    for shard in range(manifest["num_shards"]):
        name = shard_name(shard)
        meta = _shard_meta(directory, manifest, shard)
        block = _read_vectors(directory / f"{name}.npy")
        offsets = np.asarray(_read_vectors(directory / f"{name}.offsets.npy"))
        rows = _shard_rows(manifest, shard)
        try:
            check_multivectors(block, offsets, name=f"{directory}/{name}", dim=dim)
            valid = offsets.shape == (rows + 1,) and offsets.dtype == np.int64
        except ValueError:
            valid = False
        if not valid or str(block.dtype) != dtype or len(meta["ids"]) != rows:
            raise ShardError(
                f"{directory}/{name}: vectors {block.shape} {block.dtype}, offsets {offsets.shape} {offsets.dtype} "
                f"with {len(meta['ids'])} ids; manifest expects {rows} pages of (tokens >= 1, {dim}) {dtype} vectors "
                "with int64 offsets from 0 to the token count; delete the shard's files and re-run"
            )
        check_finite(block, meta["ids"], f"{directory}/{name}", offsets)
        yield list(meta["ids"]), block, offsets


def load_multi_vector_shards(
    directory: str | Path, *, expect: Mapping[str, Any] | None = None
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Every multi-vector shard read into ``(ids, float32 vectors [tokens, dim], int64 offsets [pages + 1])``
    (:func:`iter_multi_vector_shards`; for pools that fit in memory)."""
    ids: list[str] = []
    blocks, offsets = [], [np.zeros(1, dtype=np.int64)]
    for shard_ids, block, shard_offsets in iter_multi_vector_shards(directory, expect=expect):
        ids += shard_ids
        offsets.append(shard_offsets[1:] + offsets[-1][-1])
        blocks.append(np.asarray(block, dtype=np.float32))
    _check_unique(Path(directory), ids)
    return ids, np.concatenate(blocks), np.concatenate(offsets)
