"""FAISS document index: exact inner product by default, compressed variants for large pools.

Vectors are assumed L2-normalised, so inner product is cosine similarity. The index is placed
on GPU(s) when FAISS was built with GPU support and a GPU is present, otherwise on CPU; the
choice is logged. Besides the named kinds, any ``faiss.index_factory`` description can be used
(``faiss:PCA384,IVF2048,PQ96x4fs,Refine(PCA384,SQ8)``), with FAISS search parameters after a semicolon
(``...;nprobe=32,k_factor_rf=4``, as :mod:`hkrag.index.tuning` writes them), or ``tuned:<dir>`` to
take the spec and tuned parameters saved with another index (:mod:`hkrag.index.spec` parses them). A
saved index can be loaded with its stored vectors memory-mapped (``DocumentIndex.load(dir, mmap=True)``,
:mod:`hkrag.index.mmap`): with a ``Refine(Flat)`` stage the compressed base is searched in memory and
only the candidates' exact vectors are read from disk.
FAISS pads results with id -1 when fewer than k neighbours are found (k larger than the corpus, or too
few IVF lists probed); those slots are dropped, never mapped to a document.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from hkrag.io import FileFormatError, atomic_write, read_json, write_json

logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its INFO lines list every SIMD variant it tried
import faiss  # noqa: E402

from hkrag.index.mmap import (  # noqa: E402
    LIBC,
    index_parts,
    is_mapped_store,
    mapped_refine_store,
    own_inverted_lists,
    own_refine_base,
    prefetch_candidates,
)
from hkrag.index.shards import nonfinite_rows  # noqa: E402
from hkrag.index.spec import META_FILE, IndexSpec, read_meta  # noqa: E402

log = logging.getLogger(__name__)

# FAISS clones only these to GPU; its cloner would silently keep a flat scalar quantiser on CPU.
# A faiss: spec is tried too: whatever part of it FAISS can clone goes to GPU (checked after cloning).
GPU_KINDS = ("flat", "ivfpq", "faiss")
_INDEX_FILE = "index.faiss"
_IDS_FILE = "ids.json"


def read_faiss(path: Path, size: int | None, mmap: bool = False) -> faiss.Index:
    """The FAISS index in ``path``, checked first against the ``size`` :meth:`DocumentIndex.save` recorded (a
    truncated file mapped from disk would crash the process at its first search); FAISS's own read errors are
    re-raised naming the file."""
    actual = path.stat().st_size if path.is_file() else None
    if actual is None:
        raise FileNotFoundError(f"{path} is missing: the index folder is incomplete; rebuild the index")
    if size is not None and actual != size:
        raise FileFormatError(path, f"holds {actual} bytes, {size} were written (truncated or replaced); rebuild "
                                    "the index or copy the file again")
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise FileFormatError(path, f"not a readable FAISS index (truncated or corrupt): {reason}") from None


def deserialize_file(path: Path) -> faiss.Index:
    """The FAISS index serialized in ``path`` (``faiss.serialize_index`` bytes); a damaged file is named."""
    try:
        return faiss.deserialize_index(np.fromfile(path, np.uint8))
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise FileFormatError(path, f"not a readable FAISS index (truncated or corrupt): {reason}") from None


def _has_gpu_part(index: faiss.Index) -> bool:
    """Whether ``index`` or a sub-index it wraps lives on a GPU."""
    return any(type(part).__name__.startswith("Gpu") for part in index_parts(index))


def gpu_count() -> int:
    """Number of GPUs FAISS can use (0 for a CPU-only FAISS build)."""
    return faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0


def _as_matrix(vectors: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(vectors.detach().cpu() if hasattr(vectors, "detach") else vectors)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n, dim), got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.float32)


class DocumentIndex:
    """A FAISS index over documents, searched by inner product and answering with doc ids."""

    def __init__(self, dim: int, spec: IndexSpec | str = "flat", *, use_gpu: bool | None = None) -> None:
        """Create an empty index; quantising kinds need :meth:`train` before :meth:`add`.

        ``use_gpu=None`` uses every GPU FAISS can see, ``False`` forces CPU, ``True`` requires a GPU.
        """
        if dim <= 0:
            raise ValueError(f"dimension must be positive, got {dim}")
        self.dim = dim
        self.spec = IndexSpec.parse(spec)
        self.ids: list[str] = []
        self._use_gpu = use_gpu
        self.mmap = False  # set by load(mmap=True)
        self._prefetch_store: faiss.IndexFlatCodes | None = None  # a mapped refine store, set by load(mmap=True)
        self._index: faiss.Index | None = None
        self.on_gpu = False  # set by _place
        self.tuning: dict | None = None  # how the search parameters were chosen (hkrag.index.tuning)
        if self.spec.kind != "ivfpq":
            cpu = self._new_cpu_index(self.spec)
            self._index = self._place(cpu) if cpu.is_trained else None
            self._apply_search_parameters()

    @classmethod
    def build(
        cls,
        ids: Sequence[str],
        vectors: np.ndarray,
        spec: IndexSpec | str = "flat",
        *,
        use_gpu: bool | None = None,
        max_train: int | None = None,
        seed: int = 0,
    ) -> DocumentIndex:
        """Build an index over ``vectors`` (n, dim), training compressed kinds on (a sample of) them."""
        vectors = _as_matrix(vectors, "document vectors")
        if len(vectors) == 0:
            raise ValueError("cannot build an index over an empty corpus")
        index = cls(vectors.shape[1], spec, use_gpu=use_gpu)
        if not index.is_trained:
            index.train(vectors, max_train=max_train, seed=seed)
        index.add(ids, vectors)
        return index

    def _new_cpu_index(self, spec: IndexSpec) -> faiss.Index:
        try:
            index = faiss.index_factory(self.dim, spec.factory_string(), spec.metric)
        except RuntimeError as error:
            raise ValueError(f"FAISS cannot build {spec} in dimension {self.dim}: {error}") from error
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None and isinstance(faiss.downcast_index(ivf), faiss.IndexIVFPQ):
            # Polysemous codes only serve Hamming pre-filtering, unused here, and dominate training time.
            faiss.downcast_index(ivf).do_polysemous_training = False
        return index

    def _cpu_reason(self) -> str | None:
        """Why the index stays on CPU, or None to put it on the GPUs; raises if use_gpu=True can't be met."""
        if self._use_gpu is False:
            return "disabled by use_gpu=False"
        if self.mmap:
            reason = "its stored vectors are memory-mapped from disk (mmap=True)"
        elif gpu_count() == 0:
            reason = "FAISS has no GPU support or sees no GPU"
        elif self.spec.kind not in GPU_KINDS:
            reason = f"FAISS has no GPU {self.spec.kind} index"
        else:
            return None
        if self._use_gpu:
            raise RuntimeError(f"use_gpu=True but {reason}")
        return reason

    def _place(self, index: faiss.Index) -> faiss.Index:
        self.on_gpu = False
        reason = self._cpu_reason()
        if reason:
            log.info("FAISS %s index on CPU (%s)", self.spec, reason)
            return index
        options = faiss.GpuMultipleClonerOptions()
        options.shard = True
        options.useFloat16LookupTables = True
        try:
            placed = faiss.index_cpu_to_all_gpus(index, co=options)
        except RuntimeError as error:
            if self._use_gpu:
                raise
            log.warning("FAISS %s index not supported on GPU (%s); using CPU", self.spec, error)
            return index
        if not _has_gpu_part(placed):
            if self._use_gpu:
                raise RuntimeError(f"use_gpu=True but FAISS has no GPU version of any part of {self.spec}")
            log.info("FAISS %s index on CPU (FAISS has no GPU version of its parts)", self.spec)
            return index
        log.info("FAISS %s index sharded over %d GPU(s)", self.spec, gpu_count())
        self.on_gpu = True
        return placed

    @property
    def is_trained(self) -> bool:
        """Whether vectors can be added (quantising kinds need :meth:`train` first)."""
        return self._index is not None

    def __len__(self) -> int:
        return len(self.ids)

    def train(self, vectors: np.ndarray, *, max_train: int | None = None, seed: int = 0) -> None:
        """Train a quantising index on a random sample of ``vectors``; no-op when already trained.

        ``max_train`` defaults to 64 vectors per IVF/PQ centroid (enough for k-means and the PQ
        codebooks) and 65,536 for the scalar quantiser's per-dimension ranges.
        """
        if self.is_trained:
            return
        vectors = _as_matrix(vectors, "training vectors")
        self._check_dim(vectors, "training vectors")
        spec = self.spec.resolved(self.dim, len(vectors))
        limit = max_train or spec.default_max_train()
        if len(vectors) > limit:
            rows = np.random.default_rng(seed).choice(len(vectors), size=limit, replace=False)
            vectors = vectors[np.sort(rows)]
        self.spec = spec.resolved(self.dim, len(vectors))
        cpu = self._new_cpu_index(self.spec)
        log.info("training %s on %d vectors", self.spec, len(vectors))
        cpu.train(vectors)
        self._index = self._place(cpu)
        self._apply_search_parameters()

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """Append documents; ids must be unique across the whole index."""
        vectors = _as_matrix(vectors, "document vectors")
        self._check_dim(vectors, "document vectors")
        ids = [str(i) for i in ids]
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        if not self.is_trained:
            raise RuntimeError(f"{self.spec} index must be trained before adding vectors")
        if len(set(ids)) != len(ids) or not set(ids).isdisjoint(self.ids):
            raise ValueError("duplicate document ids: every document must appear once in the index")
        self._index.add(vectors)
        self.ids.extend(ids)

    @property
    def nprobe(self) -> int | None:
        return self.spec.nprobe if self.spec.kind == "ivfpq" else None

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        if self.spec.kind != "ivfpq":
            raise ValueError(f"nprobe only applies to ivfpq indexes, not {self.spec}")
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        space.set_index_parameter(self._index, "nprobe", int(value))
        self.spec = replace(self.spec, nprobe=int(value))

    @property
    def search_params(self) -> str:
        """FAISS ``ParameterSpace`` string used at search time (``faiss:`` specs), e.g. ``nprobe=32,k_factor_rf=4``."""
        return self.spec.params

    @search_params.setter
    def search_params(self, value: str) -> None:
        if self.spec.kind != "faiss":
            raise ValueError(f"search parameters apply to faiss: specs only, not {self.spec} (use nprobe for ivfpq)")
        self.spec = replace(self.spec, params=value.strip())
        self._apply_search_parameters()

    def _apply_search_parameters(self) -> None:
        """Set the spec's nprobe (ivfpq) or ParameterSpace string (faiss) on the trained index."""
        if self._index is None:
            return
        if self.spec.kind == "ivfpq":
            self.nprobe = self.spec.nprobe
        if self.spec.kind != "faiss" or not self.spec.params:
            return
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        try:
            space.set_index_parameters(self._index, self.spec.params)
        except RuntimeError as error:
            bad = f"cannot set search parameters {self.spec.params!r} on {self.spec.factory}"
            raise ValueError(f"{bad}: {error}") from error

    def _check_dim(self, vectors: np.ndarray, name: str) -> None:
        if vectors.shape[1] != self.dim:
            raise ValueError(f"{name} have dimension {vectors.shape[1]} but the index has {self.dim}")

    def search_arrays(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw FAISS search: (scores, row numbers) of shape (nq, min(k, n)); -1 marks no result."""
        queries = _as_matrix(queries, "queries")
        self._check_dim(queries, "queries")
        bad = nonfinite_rows(queries)
        if len(bad):
            raise ValueError(f"query row {int(bad[0])} holds NaN or infinite values ({len(bad)} of {len(queries)} "
                             "rows do): FAISS would rank pages for it by chance")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if not self.ids:
            raise ValueError("the index is empty: add documents before searching")
        k = min(k, len(self.ids))
        if self._prefetch_store is not None:
            prefetch_candidates(faiss.downcast_index(self._index), self._prefetch_store, queries, k)
        scores, rows = self._index.search(queries, k)
        if self._index.metric_type == faiss.METRIC_L2:
            scores = 1.0 - scores / 2.0  # unit vectors: |q - x|^2 = 2 - 2 q·x
        return scores, rows

    def search(self, queries: np.ndarray, k: int) -> tuple[list[np.ndarray], list[list[str]]]:
        """Top-k documents per query, best first, as (scores, doc ids) with FAISS's -1 slots dropped."""
        scores, rows = self.search_arrays(queries, k)
        keep = rows >= 0
        return (
            [s[m] for s, m in zip(scores, keep, strict=True)],
            [[self.ids[r] for r in row[m]] for row, m in zip(rows, keep, strict=True)],
        )

    def to_run(self, query_ids: Sequence[str], queries: np.ndarray, k: int) -> dict[str, dict[str, float]]:
        """Search and return a TREC-style run ``{query_id: {doc_id: score}}``."""
        queries = _as_matrix(queries, "queries")
        if len(query_ids) != len(queries):
            raise ValueError(f"{len(query_ids)} query ids for {len(queries)} query vectors")
        scores, doc_ids = self.search(queries, k)
        return {
            str(qid): {d: float(s) for d, s in zip(docs, sc, strict=True)}
            for qid, docs, sc in zip(query_ids, doc_ids, scores, strict=True)
        }

    @property
    def faiss_index(self) -> faiss.Index:
        """The live FAISS index (on GPU when placed there), e.g. for ``ParameterSpace`` exploration."""
        if self._index is None:
            raise RuntimeError(f"{self.spec} index has not been trained")
        return self._index

    def cpu_index(self) -> faiss.Index:
        """The index as a CPU FAISS index (a copy when it lives on GPU)."""
        if self._index is None:
            raise RuntimeError(f"{self.spec} index has not been trained")
        return faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index

    def nbytes(self) -> int:
        """Size of the serialized FAISS index in bytes (vectors/codes, lists, codebooks; not the ids).

        Counted while FAISS streams the index out, so a 12 GB index is never copied in memory.
        """
        size = 0

        def count(chunk: bytes) -> int:
            nonlocal size
            size += len(chunk)
            return len(chunk)

        faiss.write_index(self.cpu_index(), faiss.PyCallbackIOWriter(count))
        return size

    def mapped_bytes(self) -> int:
        """Bytes of stored vectors/codes read from the index file on demand rather than held in memory
        (the flat code stores of an index loaded with ``mmap=True``, e.g. a ``Refine(Flat)`` stage; 0 otherwise)."""
        return sum(part.codes.size() for part in index_parts(self.cpu_index()) if is_mapped_store(part))

    def save(self, directory: str | Path) -> Path:
        """Write ``index.faiss``, ``ids.json`` and ``index.json`` (spec with its search parameters, dim,
        count, tuning record) into ``directory``; the index is streamed to its file, never copied in memory."""
        directory = Path(directory)
        cpu = self.cpu_index()
        atomic_write(directory / _INDEX_FILE, lambda f: faiss.write_index(cpu, faiss.PyCallbackIOWriter(f.write)), "wb")
        write_json(directory / _IDS_FILE, self.ids, indent=None)
        self.save_meta(directory)
        return directory

    def save_meta(self, directory: str | Path) -> Path:
        """Rewrite only ``index.json`` (after tuning an index already saved in ``directory``)."""
        index_file = Path(directory) / _INDEX_FILE
        meta = {"spec": asdict(self.spec), "dim": self.dim, "count": len(self.ids), "tuning": self.tuning,
                "index_bytes": index_file.stat().st_size if index_file.is_file() else None}
        return write_json(Path(directory) / META_FILE, meta)

    @classmethod
    def load(cls, directory: str | Path, *, use_gpu: bool | None = None, mmap: bool = False) -> DocumentIndex:
        """Load an index written by :meth:`save`, checking ids and vectors agree.

        ``mmap=True`` maps the flat code stores (``Flat``, ``SQ`` and ``PQ`` without lists, and refine stages
        such as ``Refine(Flat)``) from ``index.faiss`` instead of reading them into memory: a base (IVF or HNSW)
        searched in memory with exact re-ranking from disk (:meth:`mapped_bytes` says how much stays on disk). Such an
        index stays on CPU.
        """
        directory = Path(directory)
        meta = read_meta(directory)
        ids = read_json(directory / _IDS_FILE)
        cpu = read_faiss(directory / _INDEX_FILE, meta.get("index_bytes"), mmap)
        if mmap:
            own_refine_base(cpu)
            own_inverted_lists(cpu)
        if not (cpu.ntotal == len(ids) == meta["count"] and cpu.d == meta["dim"]):
            raise ValueError(
                f"{directory}: index holds {cpu.ntotal} vectors of dim {cpu.d}, "
                f"ids.json {len(ids)}, index.json count {meta['count']} dim {meta['dim']}"
            )
        index = cls.__new__(cls)
        index.dim, index.spec, index.ids, index._use_gpu = cpu.d, IndexSpec(**meta["spec"]), ids, use_gpu
        index.tuning = meta.get("tuning")
        index.mmap = mmap
        index._prefetch_store = mapped_refine_store(cpu) if mmap and LIBC is not None else None
        index._index = index._place(cpu)
        index._apply_search_parameters()
        return index
