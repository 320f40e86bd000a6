"""A multi-vector (late-interaction) page index: exact MaxSim, token pooling, compressed token codes, MUVERA.

Pages are given as the multi-vector shard format: ``vectors`` [total_tokens, dim] (float16 in shards),
``offsets`` int64 [n_pages + 1] (page ``i`` is ``vectors[offsets[i]:offsets[i + 1]]``) and ``ids``; queries the
same way. The score is ColBERT's late interaction (Khattab & Zaharia 2020, Eq. 3; ColPali's MaxSim)::

    s(q, d) = sum_i max_j q_i . d_j

:func:`exact_search` computes it over every page in batches (the reference for recall). :class:`MultiVectorIndex`
stores each page's vectors, optionally merged by token pooling (:func:`pool_tokens`, hierarchical clustering,
Clavié 2024, as colpali-engine's ``HierarchicalTokenPooler``) and compressed by a FAISS standalone codec (``SQfp16``
as given, ``SQ8``, ``PQ{m}x8``, ``RaBitQ``), and either scores every page by MaxSim over the decoded codes or
first finds ``candidates`` pages by MUVERA fixed-dimensional encodings (:class:`Muvera`, Dhulipala et al. 2024)
in a FAISS index, by ColBERT's token retrieval, or by PLAID's centroid interaction (:mod:`hkrag.index.plaid`, codes
then holding residuals from centroids) and re-ranks them by MaxSim. :meth:`MultiVectorIndex.bytes_per_page` counts
everything a search reads (codes, offsets, FDE index, centroids and inverted lists); docs/index.md and
bench/RESULTS.md give the measured settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import faiss
import numpy as np

from hkrag.index.faiss_index import deserialize_file
from hkrag.index.mmap import drop_from_page_cache, read_rows
from hkrag.index.plaid import CentroidInteraction, default_centroids, gather_pages
from hkrag.index.shards import check_multivectors
from hkrag.index.spec import SEARCH_COUNT, check_factory, check_search_parameters
from hkrag.io import atomic_write, read_array, read_json, write_json
from hkrag.ranges import Rule

MANIFEST = "multivector.json"
FORMAT = 1


def maxsim_sum(
    queries: np.ndarray, query_offsets: np.ndarray, pages: np.ndarray, page_offsets: np.ndarray
) -> np.ndarray:
    """MaxSim scores [n_queries, n_pages]: per query vector its best page vector's inner product, summed over the
    query's vectors (Eq. 3; :func:`hkrag.late_interaction.maxsim_mean` is this divided by the query's length)."""
    sim = np.asarray(queries, np.float32) @ np.asarray(pages, np.float32).T
    best = np.maximum.reduceat(sim, page_offsets[:-1] - page_offsets[0], axis=1)
    return np.add.reduceat(best, query_offsets[:-1] - query_offsets[0], axis=0)


def _page_chunks(offsets: np.ndarray, max_tokens: int) -> Iterator[tuple[int, int]]:
    """Consecutive page ranges ``[a, b)`` of at most ``max_tokens`` vectors (at least one page each)."""
    a, n = 0, len(offsets) - 1
    while a < n:
        b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + max_tokens, side="right")) - 1)
        yield a, min(b, n)
        a = min(b, n)


def _merge_top_k(best: tuple[np.ndarray, np.ndarray], scores: np.ndarray, rows: np.ndarray, k: int):
    """The top ``k`` of the running ``best`` (scores, rows) and new candidates, best first."""
    s, r = np.hstack([best[0], scores]), np.hstack([best[1], rows])
    keep = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, keep, 1), np.take_along_axis(r, keep, 1)


def _scan(
    queries: np.ndarray,
    query_offsets: np.ndarray,
    page_offsets: np.ndarray,
    fetch: Callable[[int, int], np.ndarray],
    k: int,
    memory: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` MaxSim over every page, reading page vectors ``fetch(first token, end token)`` in chunks whose
    similarity matrix stays within ``memory`` bytes."""
    n_queries = len(query_offsets) - 1
    best = (np.full((n_queries, 0), -np.inf, np.float32), np.zeros((n_queries, 0), np.int64))
    max_tokens = max(1, memory // (4 * len(queries)))
    for a, b in _page_chunks(page_offsets, max_tokens):
        scores = maxsim_sum(queries, query_offsets, fetch(page_offsets[a], page_offsets[b]), page_offsets[a : b + 1])
        top = min(k, b - a)
        part = np.argpartition(-scores, top - 1, axis=1)[:, :top]
        best = _merge_top_k(best, np.take_along_axis(scores, part, 1), part + a, k)
    missing = k - best[0].shape[1]  # fewer pages than k: rows -1, scores -inf, as a candidate stage leaves them
    return (np.pad(best[0], ((0, 0), (0, missing)), constant_values=-np.inf),
            np.pad(best[1], ((0, 0), (0, missing)), constant_values=-1))


def exact_search(
    queries: np.ndarray,
    query_offsets: np.ndarray,
    pages: np.ndarray,
    page_offsets: np.ndarray,
    k: int,
    *,
    memory: int = 256 << 20,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact MaxSim top-``k`` of every query over every page: (scores, page rows) [n_queries, k], best first
    (``k`` above the page count leaves rows ``-1``, scores ``-inf``).

    Batched: all query vectors against a chunk of pages at a time (one matrix product), the similarity matrix
    bounded by ``memory`` bytes; float16 pages are widened chunk by chunk.
    """
    queries, query_offsets = check_multivectors(queries, query_offsets, name="queries")
    pages, page_offsets = check_multivectors(pages, page_offsets, name="pages", dim=queries.shape[1])
    return _scan(queries, query_offsets, page_offsets, lambda a, b: pages[a:b], k, memory)


def pool_tokens(vectors: np.ndarray, offsets: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Hierarchical token pooling (Clavié et al. 2024) as colpali-engine's ``HierarchicalTokenPooler`` (0.3.18,
    tested against it): per page, the rows of ``1 - E @ E.T`` (float32) are the observations of a Ward linkage
    (Euclidean distances between rows, not a condensed distance), cut by ``fcluster(maxclust)`` into at most
    ``max(len // factor, 1)`` clusters; each cluster's mean is L2-renormalised (the vectors stay unit length for
    MaxSim), in cluster-label order. ``factor`` 1 returns the input; otherwise a page of one vector is refused, as
    colpali-engine refuses it."""
    if factor < 1:
        raise ValueError(f"pool factor must be >= 1, got {factor}")
    if factor == 1:
        return vectors, offsets
    pooled = [_pool_page(np.asarray(vectors[a:b], np.float32), factor, page)
              for page, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]
    lengths = [len(p) for p in pooled]
    return np.vstack(pooled), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _pool_page(page: np.ndarray, factor: int, number: int) -> np.ndarray:
    """One page's pooled vectors (:func:`pool_tokens`)."""
    from scipy.cluster.hierarchy import fcluster, linkage

    if len(page) < 2:
        raise ValueError(f"token pooling: page {number} has {len(page)} vector(s); pooling needs at least 2 "
                         f"(colpali-engine's HierarchicalTokenPooler refuses it too); use pool=1")
    distances = 1 - page @ page.T
    tree = linkage(distances, metric="euclidean", method="ward")
    labels = fcluster(tree, t=max(len(page) // factor, 1), criterion="maxclust")
    _, cluster = np.unique(labels, return_inverse=True)
    sums = np.zeros((cluster.max() + 1, page.shape[1]), np.float32)
    np.add.at(sums, cluster, page)
    means = sums / np.bincount(cluster)[:, None]
    return means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)


class Muvera:
    """MUVERA fixed-dimensional encodings (Dhulipala et al. 2024, §2): one vector per page or query whose inner
    product approximates MaxSim, so a single-vector index can find candidates.

    Per repetition ``r`` of ``reps``: ``ksim`` random hyperplanes split the space into ``2**ksim`` SimHash
    partitions; each vector is projected to ``dproj`` dimensions by a random ±1/sqrt(dproj) matrix (the inner
    projection); a page's block ``k`` is the mean of its projected vectors in partition ``k``, an empty partition
    taking the page vector nearest to it in Hamming distance of SimHash codes (``fill_empty_partitions``); a
    query's block is the sum (no fill). The blocks of all repetitions are concatenated (``reps * 2**ksim * dproj``
    dimensions) and, with ``final > 0``, count-sketched to ``final`` dimensions (the final projection).
    """

    def __init__(self, dim: int, reps: int, ksim: int, dproj: int, final: int = 0, seed: int = 0) -> None:
        if min(reps, ksim, dproj) < 1 or final < 0:
            raise ValueError(f"muvera: reps, ksim, dproj >= 1, final >= 0, got {reps} {ksim} {dproj} {final}")
        rng = np.random.default_rng([seed, 7])
        self.planes = rng.standard_normal((reps, dim, ksim), dtype=np.float32)
        self.projections = (rng.integers(0, 2, (reps, dim, dproj)) * 2 - 1).astype(np.float32) / np.sqrt(dproj)
        self.parts = 2**ksim
        self.raw_dim = reps * self.parts * dproj
        self.dim = final or self.raw_dim
        self.sketch = None
        if final:
            sketch = np.zeros((self.raw_dim, final), np.float32)
            sketch[np.arange(self.raw_dim), rng.integers(final, size=self.raw_dim)] = rng.choice([-1, 1], self.raw_dim)
            self.sketch = sketch
        self.center = np.zeros(dim, np.float32)
        bits = np.arange(self.parts)
        self.hamming = np.array([[bin(a ^ b).count("1") for b in bits] for a in bits], np.int64)

    def encode(self, vectors: np.ndarray, offsets: np.ndarray, *, query: bool, chunk: int = 4096) -> np.ndarray:
        """FDEs [n, dim] of the pages (``query=False``) or queries given as ``(vectors, offsets)``."""
        out = [self._encode(vectors, offsets[a : b + 1], query) for a, b in _page_chunks(offsets, chunk * 64)]
        return np.vstack(out)

    def _encode(self, vectors: np.ndarray, offsets: np.ndarray, query: bool) -> np.ndarray:
        x = np.asarray(vectors[offsets[0] : offsets[-1]], np.float32)
        lengths = np.diff(offsets)
        n, parts = len(lengths), self.parts
        page = np.repeat(np.arange(n), lengths)
        weights = 2 ** np.arange(self.planes.shape[2])
        blocks = []
        for planes, projection in zip(self.planes, self.projections):
            part = (((x - self.center) @ planes) > 0).astype(np.int64) @ weights
            projected = x @ projection
            key = page * parts + part
            sums = np.stack([np.bincount(key, w, minlength=n * parts) for w in projected.T], axis=1)
            if not query:
                counts = np.bincount(key, minlength=n * parts)
                sums /= np.maximum(counts, 1)[:, None]
                empty = np.flatnonzero(counts == 0)
                if len(empty):
                    longest = int(lengths.max())
                    position = np.arange(len(x)) - np.repeat(offsets[:-1] - offsets[0], lengths)
                    ranked = self.hamming[part] * longest + position[:, None]  # nearest partition, then first vector
                    nearest = np.minimum.reduceat(ranked, offsets[:-1] - offsets[0])
                    rows = offsets[empty // parts] - offsets[0] + nearest[empty // parts, empty % parts] % longest
                    sums[empty] = projected[rows]
            blocks.append(sums.reshape(n, -1))
        fde = np.hstack(blocks)
        return fde @ self.sketch if self.sketch is not None else fde


STAGES = ("", "muvera", "tokens", "plaid")
SPEC_RULES: dict[str, Rule] = {
    "pool": Rule(int, low=1, high=64), "candidates": SEARCH_COUNT, "reps": Rule(int, low=1, high=1000),
    "ksim": Rule(int, low=1, high=20), "dproj": Rule(int, low=1, high=4096), "final": Rule(int, low=0, high=2**20),
    "prune": Rule(int, low=0, high=2**20), "centroids": Rule(int, low=0, high=2**24), "nprobe": SEARCH_COUNT,
    "t_cs": Rule(float, low=-1, high=1), "ndocs": SEARCH_COUNT, "rerank": Rule(int, low=0, high=2**20),
    "seed": Rule(int, low=0),
}
"""Range of each numeric :class:`MultiVectorSpec` setting (``prune``, ``rerank``, ``final``, ``centroids``: 0 is
their documented "none" / "automatic", never a missing value)."""
SEARCH_SETTINGS = ("candidates", "stage_params", "prune", "nprobe", "t_cs", "ndocs", "rerank")


@dataclass(frozen=True)
class MultiVectorSpec:
    """How a :class:`MultiVectorIndex` stores and searches pages; written ``key=value;key=value``.

    ``codec``: FAISS standalone codec (``sa_encode``) of the stored vectors, ``SQfp16`` keeping float16 shards
    exactly; ``pool``: token pooling factor (1: none). ``stage`` picks the candidate stage before MaxSim
    re-ranking over the stored codes:

    - ``""``: none, every page is scored;
    - ``muvera``: page FDEs (``reps``, ``ksim``, ``dproj``, ``final`` as :class:`Muvera`) in the FAISS
      inner-product index ``stage_index`` (factory string, searched with ``stage_params``, e.g. ``efSearch=128``);
      the ``candidates`` best pages are re-ranked;
    - ``tokens``: ColBERT's end-to-end retrieval (Khattab & Zaharia 2020, §3.6): every stored vector in
      ``stage_index`` (e.g. ``IVF1024,PQ16x8``), each query vector's ``candidates`` nearest vectors name the
      pages to re-rank.

    - ``plaid``: PLAID (Santhanam et al. 2022; :class:`~hkrag.index.plaid.CentroidInteraction`): every vector
      stored as one of ``centroids`` k-means centroids (0: ColBERTv2's ``2^floor(log2(16 sqrt(vectors)))``) plus
      its residual in ``codec``; candidates from the ``nprobe`` nearest centroids of each query vector, scored by
      centroid interaction pruned at ``t_cs`` (the ``ndocs`` best kept), then unpruned (``ndocs / 4`` kept), then
      MaxSim over the decompressed vectors. The defaults (``nprobe`` 2, ``t_cs`` 0.45, ``ndocs`` 1024) are PLAID's
      for k = 100; tune ``t_cs`` on the data: it sets how many centroids stage 2 reads (bench/RESULTS.md).

    ``prune`` > 0 (``tokens`` stage) keeps the ``prune`` candidate pages of best approximate score before MaxSim:
    per query vector the best similarity among the page's retrieved vectors, a page none of whose vectors was
    retrieved for that query vector scoring the query vector's lowest retrieved similarity (XTR's missing-
    similarity imputation, Lee et al. 2023), summed over the query's vectors.

    ``rerank`` > 0 keeps the vectors as given (unpooled, float16) in a file mapped from disk and re-ranks the
    first pass's ``rerank`` best pages by exact MaxSim over them (PQ/binary codes with exact re-ranking):
    :meth:`MultiVectorIndex.bytes_per_page` counts them as disk bytes, not memory.
    """

    codec: str = "SQfp16"
    pool: int = 1
    stage: str = ""
    stage_index: str = "Flat"
    stage_params: str = ""
    candidates: int = 100
    reps: int = 20
    ksim: int = 5
    dproj: int = 16
    final: int = 0
    prune: int = 0
    centroids: int = 0
    nprobe: int = 2
    t_cs: float = 0.45
    ndocs: int = 1024
    rerank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown candidate stage {self.stage!r}; expected one of {STAGES}")
        for name, rule in SPEC_RULES.items():
            rule.check(f"multi-vector index setting {name}", getattr(self, name))
        check_factory(self.codec)
        check_factory(self.stage_index)
        check_search_parameters(self.stage_params)

    @classmethod
    def parse(cls, text: str | MultiVectorSpec) -> MultiVectorSpec:
        """``"codec=PQ16x8;pool=2;stage=muvera;candidates=200"`` (unnamed settings keep their defaults)."""
        if isinstance(text, MultiVectorSpec):
            return text
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(";"))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in types:
                raise ValueError(f"bad multi-vector index setting {item!r} in {text!r}; known: {sorted(types)}")
            rule = SPEC_RULES.get(key.strip())
            values[key.strip()] = rule.parse(f"multi-vector index setting {key.strip()}", value.strip()) if rule \
                else value.strip()
        return cls(**values)

    def __str__(self) -> str:
        names = ["codec", "pool"] + (["stage"] if self.stage else [])
        names += ["stage_index", "stage_params", "candidates"] if self.stage in ("muvera", "tokens") else []
        names += ["reps", "ksim", "dproj", "final"] if self.stage == "muvera" else []
        names += ["centroids", "nprobe", "t_cs", "ndocs"] if self.stage == "plaid" else []
        names += ["prune"] if self.prune else []
        names += ["rerank"] if self.rerank else []
        return ";".join(f"{n}={getattr(self, n)}" for n in names if getattr(self, n) != "")


def _serialized(index: faiss.Index) -> np.ndarray:
    return faiss.serialize_index(index)


class MultiVectorIndex:
    """Pages as stored token codes (+ an optional candidate stage), searched by MaxSim.

    Build with :meth:`build`, search with :meth:`search` (queries as ``(vectors, offsets)``), persist with
    :meth:`save` / :meth:`load` (a directory: ``multivector.json`` manifest, codes, offsets, ids, codec, stage).
    """

    def __init__(self, dim: int, spec: MultiVectorSpec | str) -> None:
        self.dim = dim
        self.spec = s = MultiVectorSpec.parse(spec)
        self.codec = faiss.index_factory(dim, s.codec, faiss.METRIC_INNER_PRODUCT)
        self.muvera = Muvera(dim, s.reps, s.ksim, s.dproj, s.final, s.seed) if s.stage == "muvera" else None
        stage_dim = self.muvera.dim if self.muvera is not None else dim
        self.stage = (faiss.index_factory(stage_dim, s.stage_index, faiss.METRIC_INNER_PRODUCT)
                      if s.stage in ("muvera", "tokens") else None)
        self.plaid: CentroidInteraction | None = None
        self.ids: list[str] = []
        self.codes = np.zeros((0, self.codec.sa_code_size()), np.uint8)
        self.offsets = np.zeros(1, np.int64)
        self.full: tuple[np.ndarray, np.ndarray] | None = None  # (float16 vectors, offsets) for exact re-ranking
        self.directory: Path | None = None  # where :meth:`load` mapped ``full`` from
        self.last_rerank_s = 0.0
        self.build_seconds: dict[str, float] = {}

    @classmethod
    def build(
        cls,
        ids: Sequence[str],
        vectors: np.ndarray,
        offsets: np.ndarray,
        spec: MultiVectorSpec | str = "",
        *,
        max_train: int = 65_536,
        kmeans_points: int = 16,
    ) -> MultiVectorIndex:
        """Pool, train the codec (and the stage's index) on a sample of at most ``max_train`` rows, encode, add.

        ``plaid``: k-means on ``max(max_train, kmeans_points * centroids)`` rows first; the codec then encodes
        each vector's residual from its centroid."""
        vectors, offsets = check_multivectors(vectors, offsets)
        if len(ids) != len(offsets) - 1:
            raise ValueError(f"pages: {len(ids)} ids for {len(offsets) - 1} pages (offsets)")
        index = cls(vectors.shape[1], spec)
        s, times = index.spec, index.build_seconds
        if s.rerank:
            index.full = (np.asarray(vectors, np.float16), offsets)
        start = time.perf_counter()
        vectors, offsets = pool_tokens(vectors, offsets, s.pool)
        times["pool_s"] = time.perf_counter() - start
        rng = np.random.default_rng(s.seed)

        def sample_rows(n: int) -> np.ndarray:
            return np.sort(rng.choice(len(vectors), min(n, len(vectors)), replace=False))

        if s.stage == "plaid":
            start = time.perf_counter()
            n_centroids = s.centroids or default_centroids(len(vectors))
            rows = sample_rows(max(max_train, kmeans_points * n_centroids))
            centroids = CentroidInteraction.train(np.asarray(vectors[rows], np.float32), n_centroids, seed=s.seed)
            index.plaid = CentroidInteraction(centroids, CentroidInteraction.assign(centroids, vectors), offsets)
            times["centroids_s"] = time.perf_counter() - start
        start = time.perf_counter()
        rows = sample_rows(max_train)
        sample = np.asarray(vectors[rows], np.float32)
        index.codec.train(index._residuals(sample, rows))
        index.codes = np.vstack([index.codec.sa_encode(index._residuals(np.asarray(vectors[i : i + 65536], np.float32),
                                                                        np.arange(i, min(i + 65536, len(vectors)))))
                                 for i in range(0, len(vectors), 65536)])
        index.offsets, index.ids = offsets, [str(i) for i in ids]
        times["encode_s"] = time.perf_counter() - start
        if index.stage is not None:
            start = time.perf_counter()
            if index.muvera is not None:
                index.muvera.center = sample.mean(axis=0)
                rows = index.muvera.encode(vectors, offsets, query=False)
                train = rows[np.sort(rng.choice(len(rows), min(max_train, len(rows)), replace=False))]
            else:
                rows, train = vectors, sample
            index.stage.train(train)
            for i in range(0, len(rows), 65536):
                index.stage.add(np.asarray(rows[i : i + 65536], np.float32))
            times["stage_s"] = time.perf_counter() - start
        index._apply_stage_params()
        return index

    def _residuals(self, vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """What the codec stores of vectors ``rows``: the vectors, or (plaid) their residuals from their centroids."""
        if self.plaid is None:
            return vectors
        return vectors - self.plaid.centroids[self.plaid.assignment[rows]]

    def set_search(self, settings: str) -> None:
        """Change search-time settings without rebuilding: ``"candidates=128;stage_params=nprobe=16"`` (``rerank``
        too where the index keeps its vectors)."""
        changed = MultiVectorSpec.parse(settings)
        names = {item.partition("=")[0].strip() for item in settings.split(";") if item.strip()}
        if not names <= set(SEARCH_SETTINGS):
            raise ValueError(f"only {', '.join(SEARCH_SETTINGS)} change at search time, not {sorted(names)}")
        if "rerank" in names and changed.rerank and self.full is None:
            raise ValueError("rerank needs the vectors kept at build (build with rerank > 0)")
        self.spec = replace(self.spec, **{name: getattr(changed, name) for name in names})
        self._apply_stage_params()

    def drop_cached_vectors(self) -> None:
        """Unmap the re-ranking vectors, drop their file from the page cache and map it again, so that the next
        search reads its re-ranked pages from disk (cold; bench/multivector.py ``--cold``). Only for an index
        :meth:`load` mapped them for; the codes and the candidate stage stay in memory."""
        if self.directory is None or self.full is None:
            raise ValueError("drop_cached_vectors: no re-ranking vectors mapped from disk (load an index saved with "
                             "rerank > 0)")
        offsets, path = self.full[1], self.directory / "vectors.npy"
        self.full = None  # the only reference to the mapping: released before the drop (a mapped page stays cached)
        drop_from_page_cache(path)
        self.full = (read_array(path, mmap=True), offsets)

    def _apply_stage_params(self) -> None:
        if self.stage is not None and self.spec.stage_params:
            faiss.ParameterSpace().set_index_parameters(self.stage, self.spec.stage_params)

    def __len__(self) -> int:
        return len(self.ids)

    def decode(self, first: int, end: int) -> np.ndarray:
        """Stored vectors ``[first, end)`` (token rows), decoded to float32."""
        return self._decode_rows(np.arange(first, end))

    def candidates(self, queries: np.ndarray, query_offsets: np.ndarray, k: int = 1) -> list[np.ndarray]:
        """The candidate stage's page rows for each query (sorted, unique); plaid passes on at least ``k``."""
        if self.plaid is not None:
            s = self.spec
            return [self.plaid.candidates(queries[a:b], s.nprobe, s.t_cs, s.ndocs, k)
                    for a, b in zip(query_offsets[:-1], query_offsets[1:])]
        if self.muvera is not None:
            fdes = self.muvera.encode(queries, query_offsets, query=True)
            _, pages = self.stage.search(fdes, self.spec.candidates)
            return [np.unique(p[p >= 0]) for p in pages]
        similarities, tokens = self.stage.search(np.ascontiguousarray(queries, np.float32), self.spec.candidates)
        pages = np.searchsorted(self.offsets, tokens, side="right") - 1
        found = []
        for p, t, sim in zip(*(np.split(a, query_offsets[1:-1]) for a in (pages, tokens, similarities))):
            unique, column = np.unique(p[t >= 0], return_inverse=True)
            if self.spec.prune and len(unique) > self.spec.prune:
                rows = np.nonzero(t >= 0)[0]
                lowest = sim.min(axis=1, initial=np.inf, where=t >= 0)
                approx = np.repeat(np.where(np.isfinite(lowest), lowest, 0)[:, None], len(unique), axis=1)
                np.maximum.at(approx, (rows, column), sim[t >= 0])
                unique = np.sort(unique[np.argsort(-approx.sum(axis=0), kind="stable")[: self.spec.prune]])
            found.append(unique)
        return found

    def search(
        self, queries: np.ndarray, query_offsets: np.ndarray, k: int, *, memory: int = 256 << 20
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` pages of every query: (MaxSim scores, page rows) [n_queries, k], best first.

        Without a candidate stage every page is scored over the stored codes (:func:`exact_search`'s batching);
        with one, each query's candidates are. With ``rerank`` the ``rerank`` best are then re-scored over the
        vectors on disk. Fewer than ``k`` candidates leave rows ``-1`` (score ``-inf``). ``self.last_rerank_s``:
        the seconds the last search spent re-ranking (reading the vectors included; 0 without ``rerank``)."""
        queries, query_offsets = check_multivectors(queries, query_offsets, name="queries", dim=self.dim)
        queries = np.asarray(queries, np.float32)
        self.last_rerank_s = 0.0
        if not self.spec.rerank:
            return self._first_pass(queries, query_offsets, k, memory)
        _, first = self._first_pass(queries, query_offsets, max(k, self.spec.rerank), memory)
        start = time.perf_counter()
        found = self._rerank(queries, query_offsets, first, k, lambda tokens: read_rows(self.full[0], tokens),
                             self.full[1])
        self.last_rerank_s = time.perf_counter() - start
        return found

    def _rerank(self, queries, query_offsets, candidates, k, fetch, offsets) -> tuple[np.ndarray, np.ndarray]:
        """Each query's ``candidates`` (page rows, -1 for none) re-scored by MaxSim over ``fetch(token rows)``."""
        scores = np.full((len(query_offsets) - 1, k), -np.inf, np.float32)
        rows = np.full((len(query_offsets) - 1, k), -1, np.int64)
        for q, pages in enumerate(candidates):
            pages = np.unique(pages[pages >= 0])
            tokens, page_offsets = gather_pages(offsets, pages)
            a, b = query_offsets[q], query_offsets[q + 1]
            found = maxsim_sum(queries[a:b], np.array([0, b - a]), fetch(tokens), page_offsets)[0]
            order = np.argsort(-found, kind="stable")[:k]
            scores[q, : len(order)], rows[q, : len(order)] = found[order], pages[order]
        return scores, rows

    def _first_pass(self, queries, query_offsets, k, memory) -> tuple[np.ndarray, np.ndarray]:
        if self.stage is None and self.plaid is None:
            return _scan(queries, query_offsets, self.offsets, self.decode, k, memory)
        candidates = self.candidates(queries, query_offsets, k)
        return self._rerank(queries, query_offsets, candidates, k, self._decode_rows, self.offsets)

    def _decode_rows(self, tokens: np.ndarray) -> np.ndarray:
        decoded = self.codec.sa_decode(np.ascontiguousarray(self.codes[tokens]))
        return decoded if self.plaid is None else decoded + self.plaid.centroids[self.plaid.assignment[tokens]]

    def bytes_per_page(self) -> float:
        """Memory a search holds per page: stored codes, offsets and the candidate stage's index (serialized; plaid:
        centroids, each vector's centroid id, inverted lists); the codec's codebooks (a fixed size, e.g. 128 KB for
        ``PQ8x8``) are left out."""
        stage = len(_serialized(self.stage)) if self.stage is not None else 0
        stage += self.plaid.nbytes() if self.plaid is not None else 0
        return (self.codes.nbytes + self.offsets.nbytes + stage) / max(1, len(self))

    def disk_bytes_per_page(self) -> float:
        """Bytes per page read from disk at search (the vectors kept for ``rerank``; 0 without)."""
        return 0.0 if self.full is None else (self.full[0].nbytes + self.full[1].nbytes) / max(1, len(self))

    def save(self, directory: str | Path) -> Path:
        """Write codes, offsets, ids, codec and stage index, then the manifest (last: a directory without it is
        incomplete and :meth:`load` refuses it)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {"codes.npy": self.codes, "offsets.npy": self.offsets}
        if self.full is not None:
            arrays |= {"vectors.npy": self.full[0], "vector_offsets.npy": self.full[1]}
        if self.muvera is not None:
            arrays["center.npy"] = self.muvera.center
        if self.plaid is not None:
            arrays |= {"centroids.npy": self.plaid.centroids, "assignment.npy": self.plaid.assignment}
        for name, array in arrays.items():
            atomic_write(directory / name, lambda f, a=array: np.save(f, a), "wb")
        parts = {"codec.faiss": self.codec, "stage.faiss": self.stage}
        for name, part in parts.items():
            if part is not None:
                atomic_write(directory / name, lambda f, p=part: f.write(_serialized(p).tobytes()), "wb")
        write_json(directory / "ids.json", self.ids, indent=None)
        manifest = {"format": FORMAT, "spec": asdict(self.spec), "dim": self.dim, "pages": len(self),
                    "vectors": len(self.codes), "bytes_per_page": self.bytes_per_page(),
                    "disk_bytes_per_page": self.disk_bytes_per_page(), "build": self.build_seconds}
        write_json(directory / MANIFEST, manifest)
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = False) -> MultiVectorIndex:
        """An index written by :meth:`save` (``mmap``: codes mapped from disk), its parts checked to agree."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no multi-vector index at {directory} ({path} is missing)")
        manifest = read_json(path, keys=("format",))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: format {manifest.get('format')!r}, this code reads {FORMAT}")
        index = cls(manifest["dim"], MultiVectorSpec(**manifest["spec"]))
        index.codec = deserialize_file(directory / "codec.faiss")
        if index.stage is not None:
            index.stage = deserialize_file(directory / "stage.faiss")
        if index.muvera is not None:
            index.muvera.center = read_array(directory / "center.npy")
        index.codes = read_array(directory / "codes.npy", mmap=mmap)
        index.offsets = read_array(directory / "offsets.npy")
        if index.spec.stage == "plaid":
            assignment = read_array(directory / "assignment.npy")
            if len(assignment) != len(index.codes):
                raise ValueError(f"{directory}: assignment.npy holds {len(assignment)} centroid ids for "
                                 f"{len(index.codes)} codes")
            index.plaid = CentroidInteraction(read_array(directory / "centroids.npy"), assignment, index.offsets)
        if index.spec.rerank:
            index.full = (read_array(directory / "vectors.npy", mmap=True),
                          read_array(directory / "vector_offsets.npy"))
            index.directory = directory
        index.ids = read_json(directory / "ids.json")
        index.build_seconds = manifest.get("build", {})
        stage_rows = {None: len(index.ids), "muvera": len(index.ids), "tokens": len(index.codes),
                      "plaid": len(index.ids)}[
            index.spec.stage or None]
        stage_count = index.stage.ntotal if index.stage is not None else stage_rows
        if not (len(index.ids) == len(index.offsets) - 1 == manifest["pages"] and stage_count == stage_rows
                and index.offsets[-1] == len(index.codes) == manifest["vectors"]):
            raise ValueError(
                f"{directory}: parts disagree: {len(index.ids)} ids, {len(index.offsets) - 1} pages in offsets, "
                f"{len(index.codes)} codes, {stage_count} rows in the candidate stage (expected {stage_rows}); "
                f"manifest {manifest['pages']} pages, {manifest['vectors']} vectors"
            )
        if index.full is not None and not (len(index.full[1]) == len(index.offsets) and
                                           index.full[1][-1] == len(index.full[0])):
            raise ValueError(f"{directory}: vectors.npy holds {len(index.full[0])} vectors and vector_offsets.npy "
                             f"{len(index.full[1]) - 1} pages ending at {index.full[1][-1]}; index: {len(index)}")
        index._apply_stage_params()
        return index
