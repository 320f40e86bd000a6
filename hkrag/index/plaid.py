"""PLAID's centroid interaction (Santhanam et al. 2022, "PLAID: An Efficient Engine for Late Interaction
Retrieval"): the candidate stages of the ``stage=plaid`` multi-vector index (:mod:`hkrag.index.multivector`).

Every stored vector is assigned to one of ``C`` centroids (spherical k-means on a sample, ColBERTv2's codebook) and
kept as its centroid id plus a compressed residual (the index's FAISS codec over ``vector - centroid``). A query
``Q`` (vectors ``q_i``) first scores every centroid, ``S = Q C^T`` (PLAID §4.1), then:

1. candidate generation: the pages holding a vector of one of the ``nprobe`` nearest centroids of some ``q_i``
   (inverted lists centroid -> pages);
2. pruned centroid interaction (§4.2-4.3): each candidate ``d`` scored as
   ``sum_i max_{t in d, c(t) in K} S[i, c(t)]`` over the kept centroids ``K = {c : max_i S[i, c] >= t_cs}``
   (0 where ``d`` has none); the ``ndocs`` best are kept;
3. centroid interaction without pruning on those ``ndocs`` (every vector of ``d`` by its centroid's score); the
   ``ndocs / 4`` best go on to exact MaxSim over the decompressed vectors (centroid + decoded residual), done by
   the index.

Stage 2 is computed from the inverted lists of the kept centroids rather than per candidate (the same sum:
a candidate's kept centroids are exactly the kept lists it appears in), so its cost follows the size of those
lists, not the number of candidates times their length.
"""

from __future__ import annotations

import faiss
import numpy as np
import torch


def default_centroids(n_vectors: int) -> int:
    """ColBERTv2/PLAID's codebook size, ``2 ** floor(log2(16 * sqrt(n_vectors)))`` (2^15 for 6.4M vectors)."""
    return int(2 ** np.floor(np.log2(16 * np.sqrt(max(1, n_vectors)))))


def gather_pages(offsets: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token rows of ``pages`` (concatenated) and their offsets within that selection."""
    lengths = offsets[pages + 1] - offsets[pages]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return np.repeat(offsets[pages] - starts[:-1], lengths) + np.arange(starts[-1]), starts


class CentroidInteraction:
    """The codebook, each stored vector's centroid and the inverted lists centroid -> pages (unique, sorted)."""

    def __init__(self, centroids: np.ndarray, assignment: np.ndarray, offsets: np.ndarray) -> None:
        self.centroids = np.ascontiguousarray(centroids, np.float32)
        self.assignment = assignment
        self.offsets = offsets
        n_pages = len(offsets) - 1
        page = np.repeat(np.arange(n_pages, dtype=np.int64), np.diff(offsets))
        pairs = np.unique(assignment.astype(np.int64) * n_pages + page)
        self.list_pages = (pairs % n_pages).astype(np.int32)
        self.list_offsets = np.searchsorted(pairs // n_pages, np.arange(len(centroids) + 1)).astype(np.int64)

    @classmethod
    def train(cls, sample: np.ndarray, n_centroids: int, *, seed: int = 0, iterations: int = 10) -> np.ndarray:
        """Spherical k-means centroids [n_centroids, dim] of ``sample`` (FAISS ``Kmeans``)."""
        if not 1 <= n_centroids <= len(sample):
            raise ValueError(f"plaid: {n_centroids} centroids need 1 to {len(sample)} (the training sample)")
        kmeans = faiss.Kmeans(sample.shape[1], n_centroids, niter=iterations, spherical=True, seed=seed,
                              max_points_per_centroid=len(sample))
        kmeans.train(np.ascontiguousarray(sample, np.float32))
        return kmeans.centroids

    @staticmethod
    def assign(centroids: np.ndarray, vectors: np.ndarray, *, chunk: int = 65_536) -> np.ndarray:
        """Each vector's centroid of largest inner product. Above 4,096 centroids by an IVF over the centroids
        (``C / 64`` lists, 16 probed: ~1/12 of the exhaustive products); an occasional second-best centroid
        only enlarges that vector's residual."""
        dim, n = centroids.shape[1], len(centroids)
        if n <= 4096:
            search = faiss.IndexFlatIP(dim)
        else:
            search = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, n // 64, faiss.METRIC_INNER_PRODUCT)
            search.train(centroids)
            search.nprobe = 16
        search.add(centroids)
        dtype = np.uint16 if n <= 1 << 16 else np.int32
        return np.concatenate([search.search(np.asarray(vectors[a : a + chunk], np.float32), 1)[1][:, 0]
                               for a in range(0, len(vectors), chunk)]).astype(dtype)

    def nbytes(self) -> int:
        """Memory held: centroids, assignment and inverted lists."""
        return sum(a.nbytes for a in (self.centroids, self.assignment, self.list_pages, self.list_offsets))

    def _lists(self, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The concatenated inverted lists of ``centroids`` and, per entry, the position of its centroid."""
        rows, starts = gather_pages(self.list_offsets, centroids)
        return self.list_pages[rows], np.repeat(np.arange(len(centroids)), np.diff(starts))

    def pruned_interaction(self, scores: np.ndarray, pages: np.ndarray, t_cs: float) -> np.ndarray:
        """Stage 2 (PLAID §4.3): per page of ``pages`` (unique) ``sum_i max S[i, c(t)]`` over its vectors
        ``t`` whose centroid is kept (``max_i S[i, c] >= t_cs``), each max starting from 0 (so 0 where none is
        kept), as PLAID's kernel; ``scores`` is ``S`` [n_q, C]."""
        kept = np.flatnonzero(scores.max(axis=0) >= t_cs)
        entries, centroid = self._lists(kept)
        slot = np.full(len(self.offsets) - 1, -1, np.int64)
        slot[pages] = np.arange(len(pages))
        slot = slot[entries]
        inside = slot >= 0
        best = torch.zeros(len(pages), len(scores))
        index = torch.from_numpy(slot[inside])[:, None].expand(-1, len(scores))
        best.scatter_reduce_(0, index, torch.from_numpy(scores[:, kept].T[centroid[inside]]), "amax")
        return best.sum(dim=1).numpy()

    def interaction(self, scores: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Stage 3: per page ``sum_i max_t S[i, c(t)]`` over all its vectors (MaxSim with each vector replaced by
        its centroid)."""
        tokens, starts = gather_pages(self.offsets, pages)
        return np.maximum.reduceat(scores[:, self.assignment[tokens]], starts[:-1], axis=1).sum(axis=0)

    def candidates(self, query: np.ndarray, nprobe: int, t_cs: float, ndocs: int, keep: int) -> np.ndarray:
        """Stages 1-3 for one query [n_q, dim]: the best ``max(keep, ndocs // 4)`` page rows by centroid
        interaction (sorted), from the ``ndocs`` best by pruned centroid interaction (``keep``: the pages the
        caller needs, e.g. its k)."""
        scores = query @ self.centroids.T  # S [n_q, C]
        nprobe = min(nprobe, scores.shape[1])
        probed = np.unique(np.argpartition(-scores, nprobe - 1, axis=1)[:, :nprobe])
        pages = np.unique(self._lists(probed)[0])
        if not len(pages):
            return pages
        pages = _top(pages, self.pruned_interaction(scores, pages, t_cs), ndocs)
        return np.sort(_top(pages, self.interaction(scores, pages), max(keep, ndocs // 4)))


def _top(pages: np.ndarray, scores: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` ``pages`` of highest ``scores`` (all of them when there are fewer)."""
    if len(pages) <= n:
        return pages
    return pages[np.argpartition(-scores, n - 1)[:n]]
