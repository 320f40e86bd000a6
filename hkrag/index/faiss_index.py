"""FAISS document index: exact inner product by default, compressed variants for large pools.

Vectors are assumed L2-normalised, so inner product is cosine similarity. The index is placed
on GPU(s) when FAISS was built with GPU support and a GPU is present, otherwise on CPU; the
choice is logged. FAISS pads results with id -1 when fewer than k neighbours are found (k
larger than the corpus, or too few IVF lists probed); those slots are dropped, never mapped
to a document.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import faiss
import numpy as np

from hkrag.io import write_bytes, write_json

log = logging.getLogger(__name__)

KINDS = ("flat", "ivfpq", "sq8", "fp16")
# FAISS clones only these to GPU; its cloner would silently keep a flat scalar quantiser on CPU.
GPU_KINDS = ("flat", "ivfpq")
_INDEX_FILE = "index.faiss"
_IDS_FILE = "ids.json"
_META_FILE = "index.json"


@dataclass(frozen=True)
class IndexSpec:
    """What kind of FAISS index to build.

    ``kind`` is one of ``flat`` (exact), ``ivfpq`` (inverted lists + product quantiser: ``m``
    sub-quantisers of ``nbits`` bits each, ``nlist`` lists, ``nprobe`` probed at search),
    ``sq8`` (8-bit scalar quantiser) or ``fp16`` (16-bit float scalar quantiser). ``nlist=None``
    picks ``4*sqrt(n)`` bounded by the number of training vectors.
    """

    kind: str = "flat"
    nlist: int | None = None
    m: int = 64
    nbits: int = 8
    nprobe: int = 16

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown index kind {self.kind!r}; expected one of {KINDS}")

    @classmethod
    def parse(cls, text: str | IndexSpec) -> IndexSpec:
        """Parse ``"flat"``, ``"sq8"``, ``"fp16"`` or ``"ivfpq:nlist=1024,m=64,nbits=8,nprobe=32"``."""
        if isinstance(text, IndexSpec):
            return text
        kind, _, params = text.strip().partition(":")
        known = {f.name for f in fields(cls)} - {"kind"}
        values: dict[str, int] = {}
        for item in filter(None, params.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in known:
                raise ValueError(f"bad index parameter {item!r} in {text!r}; known: {sorted(known)}")
            values[key.strip()] = int(value)
        return cls(kind=kind.strip().lower(), **values)

    def __str__(self) -> str:
        if self.kind != "ivfpq":
            return self.kind
        return f"ivfpq:nlist={self.nlist},m={self.m},nbits={self.nbits},nprobe={self.nprobe}"

    def factory_string(self) -> str:
        """The ``faiss.index_factory`` description of this spec."""
        return {
            "flat": "Flat",
            "sq8": "SQ8",
            "fp16": "SQfp16",
            "ivfpq": f"IVF{self.nlist},PQ{self.m}x{self.nbits}",
        }[self.kind]

    def resolved(self, dim: int, num_train: int) -> IndexSpec:
        """Fill in ``nlist`` and check the spec against the data it will be trained on."""
        if self.kind != "ivfpq":
            return self
        if dim % self.m:
            raise ValueError(f"ivfpq: m={self.m} must divide the vector dimension {dim}")
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(num_train)), num_train // 39))
        needed = max(nlist, 2**self.nbits)
        if num_train < needed:
            raise ValueError(
                f"ivfpq: {num_train} training vectors are fewer than the {needed} centroids "
                f"(nlist={nlist}, 2**nbits={2**self.nbits}); lower nlist/nbits or use flat"
            )
        return replace(self, nlist=nlist)


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
        """Create an empty index; IVF kinds need :meth:`train` before :meth:`add`.

        ``use_gpu=None`` uses every GPU FAISS can see, ``False`` forces CPU, ``True`` requires a GPU.
        """
        if dim <= 0:
            raise ValueError(f"dimension must be positive, got {dim}")
        self.dim = dim
        self.spec = IndexSpec.parse(spec)
        self.ids: list[str] = []
        self._use_gpu = use_gpu
        self._index: faiss.Index | None = None
        self.on_gpu = False  # set by _place
        if self.spec.kind != "ivfpq":
            cpu = self._new_cpu_index(self.spec)
            self._index = self._place(cpu) if cpu.is_trained else None

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
        index = faiss.index_factory(self.dim, spec.factory_string(), faiss.METRIC_INNER_PRODUCT)
        if spec.kind == "ivfpq":
            # Polysemous codes only serve Hamming pre-filtering, unused here, and dominate training time.
            faiss.downcast_index(index).do_polysemous_training = False
        return index

    def _cpu_reason(self) -> str | None:
        """Why the index stays on CPU, or None to put it on the GPUs; raises if use_gpu=True can't be met."""
        if self._use_gpu is False:
            return "disabled by use_gpu=False"
        if gpu_count() == 0:
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
        limit = max_train or (64 * max(spec.nlist, 2**spec.nbits) if spec.kind == "ivfpq" else 65536)
        if len(vectors) > limit:
            rows = np.random.default_rng(seed).choice(len(vectors), size=limit, replace=False)
            vectors = vectors[np.sort(rows)]
        self.spec = spec.resolved(self.dim, len(vectors))
        cpu = self._new_cpu_index(self.spec)
        log.info("training %s on %d vectors", self.spec, len(vectors))
        cpu.train(vectors)
        self._index = self._place(cpu)
        if self.spec.kind == "ivfpq":
            self.nprobe = self.spec.nprobe

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

    def _check_dim(self, vectors: np.ndarray, name: str) -> None:
        if vectors.shape[1] != self.dim:
            raise ValueError(f"{name} have dimension {vectors.shape[1]} but the index has {self.dim}")

    def search_arrays(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw FAISS search: (scores, row numbers) of shape (nq, min(k, n)); -1 marks no result."""
        queries = _as_matrix(queries, "queries")
        self._check_dim(queries, "queries")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if not self.ids:
            raise ValueError("the index is empty: add documents before searching")
        return self._index.search(queries, min(k, len(self.ids)))

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

    def cpu_index(self) -> faiss.Index:
        """The index as a CPU FAISS index (a copy when it lives on GPU)."""
        if self._index is None:
            raise RuntimeError(f"{self.spec} index has not been trained")
        return faiss.index_gpu_to_cpu(self._index) if self.on_gpu else self._index

    def nbytes(self) -> int:
        """Size of the serialized FAISS index in bytes (vectors/codes, lists, codebooks; not the ids)."""
        return int(faiss.serialize_index(self.cpu_index()).nbytes)

    def save(self, directory: str | Path) -> Path:
        """Write ``index.faiss``, ``ids.json`` and ``index.json`` (spec, dim, count) into ``directory``."""
        directory = Path(directory)
        write_bytes(directory / _INDEX_FILE, faiss.serialize_index(self.cpu_index()).tobytes())
        write_json(directory / _IDS_FILE, self.ids, indent=None)
        write_json(directory / _META_FILE, {"spec": asdict(self.spec), "dim": self.dim, "count": len(self.ids)})
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, use_gpu: bool | None = None) -> DocumentIndex:
        """Load an index written by :meth:`save`, checking ids and vectors agree."""
        directory = Path(directory)
        meta = json.loads((directory / _META_FILE).read_text())
        ids = json.loads((directory / _IDS_FILE).read_text())
        cpu = faiss.read_index(str(directory / _INDEX_FILE))
        if not (cpu.ntotal == len(ids) == meta["count"] and cpu.d == meta["dim"]):
            raise ValueError(
                f"{directory}: index holds {cpu.ntotal} vectors of dim {cpu.d}, "
                f"ids.json {len(ids)}, index.json count {meta['count']} dim {meta['dim']}"
            )
        index = cls.__new__(cls)
        index.dim, index.spec, index.ids, index._use_gpu = cpu.d, IndexSpec(**meta["spec"]), ids, use_gpu
        index._index = index._place(cpu)
        if index.spec.kind == "ivfpq":
            index.nprobe = index.spec.nprobe
        return index
