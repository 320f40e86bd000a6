"""Memory-mapped FAISS indexes: which parts stay on disk, and reading re-ranking candidates ahead.

``DocumentIndex.load(dir, mmap=True)`` maps an index's flat code stores from its file; these helpers find
those stores among the index's parts, copy a refine stage's base and mapped IVF lists back into memory, and ask
the kernel for a query's re-ranking candidates all at once (``madvise``), and drop a file from the page cache to
time reads from disk cold; see docs/index.md, "Re-ranking from disk".
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import faiss
import numpy as np

LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # madvise for prefetching


def drop_from_page_cache(path: str | Path) -> None:
    """Drop ``path``'s pages from the page cache (``posix_fadvise(DONTNEED)``), so the next read comes from disk.

    The kernel keeps pages that a process maps or that are dirty: release every mapping of the file first (a
    file written just now is flushed here). Tested to empty the cache in this container (``fincore``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_rows(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``array[rows]``; an array memory-mapped from a ``.npy`` file is read with one ``pread`` per run of consecutive
    rows instead of through the mapping, whose page faults each read the kernel's readahead window around the
    fault (on this machine a cold gather of 20 pages of 64 float16 128-d vectors took 187 ms through the mapping,
    20 cold 16 KB ``pread``\ s 10-15 ms; bench/RESULTS.md)."""
    rows = np.asarray(rows, np.int64)
    if not isinstance(array, np.memmap) or array.filename is None or not array.flags.c_contiguous or not len(rows):
        return np.asarray(array[rows])
    shape = array.shape[1:]
    row_bytes = array.dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    firsts, lengths = rows[np.r_[0, breaks]], np.diff(np.r_[0, breaks, len(rows)])
    out = np.empty((len(rows), *shape), array.dtype)
    fd = os.open(array.filename, os.O_RDONLY)
    try:
        at = 0
        for first, count in zip(firsts.tolist(), lengths.tolist()):
            data = os.pread(fd, count * row_bytes, array.offset + first * row_bytes)
            if len(data) != count * row_bytes:
                raise OSError(f"{array.filename}: short read of rows {first}..{first + count}")
            out[at : at + count] = np.frombuffer(data, array.dtype).reshape(count, *shape)
            at += count
    finally:
        os.close(fd)
    return out


def index_parts(index: faiss.Index) -> Iterator[faiss.Index]:
    """``index`` and every sub-index it wraps (pre-transform, refine base and refine store, shards), downcast."""
    index = faiss.downcast_index(index)
    yield index
    if isinstance(index, faiss.IndexPreTransform):
        yield from index_parts(index.index)
    elif isinstance(index, faiss.IndexRefine):
        yield from index_parts(index.base_index)
        yield from index_parts(index.refine_index)
    elif isinstance(index, (faiss.IndexShards, faiss.IndexReplicas)):
        for i in range(index.count()):
            yield from index_parts(index.at(i))


def is_mapped_store(part: faiss.Index) -> bool:
    """Whether ``part`` is a flat code store whose codes are mapped from the index file (loaded with mmap)."""
    return isinstance(part, faiss.IndexFlatCodes) and not part.codes.is_owned


def mapped_refine_store(index: faiss.Index) -> faiss.IndexFlatCodes | None:
    """The memory-mapped flat store of an index's refine stage (``...,Refine(Flat)`` loaded with mmap), or None."""
    index = faiss.downcast_index(index)
    if not isinstance(index, faiss.IndexRefine):
        return None
    store = faiss.downcast_index(index.refine_index)
    return store if is_mapped_store(store) else None


def prefetch_candidates(index: faiss.IndexRefine, store: faiss.IndexFlatCodes, queries: np.ndarray, k: int) -> None:
    """Ask the kernel to read every re-ranking candidate's stored vector now, all at once (``MADV_WILLNEED``).

    FAISS's refine stage then finds them in the page cache. Without this it reads them one page fault at a
    time (the mapping is ``MADV_RANDOM``: a 12 KB vector is three or four faults). The base search runs
    twice, a small cost next to the faults saved (timings: bench/RESULTS.md).
    """
    _, rows = index.base_index.search(queries, int(k * index.k_factor))
    start = faiss.rev_swig_ptr(store.codes.data(), 1).ctypes.data
    for row in np.unique(rows[rows >= 0]):
        first = start + int(row) * store.code_size
        aligned = first - first % mmap.PAGESIZE
        LIBC.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(first + store.code_size - aligned), mmap.MADV_WILLNEED)


def own_refine_base(index: faiss.Index) -> None:
    """Read a mapped refine stage's base (its codes, IVF lists or HNSW graph) into memory, so that only the refine
    store stays on disk.

    ``IO_FLAG_MMAP_IFC`` maps an HNSW's links and codes too; a cold query then walked the graph one page fault a
    hop (1M pages: p99 0.34-0.40 s against 3.7-4.0 ms p50, bench/RESULTS.md), though the base is the part meant to
    be in memory. The base is copied through FAISS's own serialisation; the mapped original is freed.
    """
    index = faiss.downcast_index(index)
    if not isinstance(index, faiss.IndexRefine) or mapped_refine_store(index) is None:
        return
    mapped = index.base_index
    owned = faiss.deserialize_index(faiss.serialize_index(mapped))
    index.base_index = owned
    owned.this.disown()  # the refine index owns its base (own_fields)
    mapped.this.acquire()  # ... and no longer the mapped one: freed here
    del mapped


def own_inverted_lists(index: faiss.Index) -> None:
    """Copy memory-mapped IVF lists into memory, so that only flat code stores stay on disk.

    ``IO_FLAG_MMAP_IFC`` maps an IVF index's lists too; a cold probe then read its list one page fault at a
    time, most of a cold query (bench/RESULTS.md), though the lists are the small part meant to be in memory.
    """
    for part in index_parts(index):
        if not isinstance(part, faiss.IndexIVF):
            continue
        lists = faiss.downcast_InvertedLists(part.invlists)
        if not isinstance(lists, faiss.ArrayInvertedLists) or all(
            lists.codes.at(i).is_owned for i in range(lists.nlist)
        ):
            continue
        owned = faiss.ArrayInvertedLists(lists.nlist, lists.code_size)
        for i in range(lists.nlist):
            if lists.list_size(i):
                owned.add_entries(i, lists.list_size(i), lists.get_ids(i), lists.get_codes(i))
        part.replace_invlists(owned, True)
        owned.this.disown()  # the index owns it now
