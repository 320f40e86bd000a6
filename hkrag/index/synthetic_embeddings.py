"""Synthetic corpora of unit vectors for index benchmarks, generated chunk by chunk.

Two generators with the same interface (``sample(n, stream)``, ``chunks(n, chunk)``):

- :class:`EmbeddingLike` behaves like retriever embeddings: a low-dimensional latent space (``rank`` directions
  with power-law variances, exponent ``decay``) holding ``topics`` clusters, a shared mean direction (embeddings of
  one model are anisotropic: random pairs have positive cosine), small isotropic noise in the ambient dimensions,
  and near duplicates (a ``duplicates`` fraction of rows copies an earlier row of its chunk plus ``duplicate_noise``,
  like consecutive pages of one document or one template). Defaults are set from the statistics
  :func:`embedding_stats` measures on the project's trained demo retriever (docs/index.md, bench/RESULTS.md).
- :class:`IsotropicMixture` is the old stress case: cluster centres and noise both isotropic in all dimensions, so
  there is no low-dimensional structure for PCA or PQ to exploit.

Every chunk is drawn from its own seeded stream, so a corpus is the same whether generated at once or in pieces,
and query streams (``QUERY_STREAM``, ``TUNING_STREAM``) never overlap corpus streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

QUERY_STREAM = 2**31  # held-out test queries; corpus chunks use streams 1.., training samples 0
TUNING_STREAM = 2**31 + 1  # held-out tuning queries, disjoint from the test queries


def _normalise(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


class _Chunked:
    """Chunked generation shared by both generators: chunk ``i`` of a corpus is stream ``i + 1``."""

    def sample(self, n: int, stream: int) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def chunks(self, n: int, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(offset, vectors)`` pairs covering rows ``[0, n)`` in chunks of ``chunk`` rows."""
        for start in range(0, n, chunk):
            yield start, self.sample(min(chunk, n - start), stream=start // chunk + 1)


@dataclass(frozen=True)
class EmbeddingSettings:
    """Parameters of :class:`EmbeddingLike` (see the module docstring for their meaning)."""

    dim: int = 3072
    rank: int = 128
    decay: float = 0.5
    topics: int = 2000
    topic_spread: float = 0.6
    mean_norm: float = 1.0
    noise: float = 0.25
    duplicates: float = 0.1
    duplicate_noise: float = 0.05
    seed: int = 0


class EmbeddingLike(_Chunked):
    """Unit vectors ``normalise(mean + (topic + spread * z) @ (scales * basis) + noise * e)``.

    ``z ~ N(0, I_rank)`` and ``e ~ N(0, I_dim / dim)``; ``basis`` is a random orthonormal ``rank x dim`` frame and
    ``scales[i] ∝ (i + 1) ** -decay`` normalised to unit total variance, so the signal has norm ~1 before the mean
    and noise are added.
    """

    def __init__(self, settings: EmbeddingSettings | None = None, **overrides: float) -> None:
        s = settings or EmbeddingSettings()
        s = EmbeddingSettings(**{**s.__dict__, **overrides})
        if not 0 < s.rank <= s.dim:
            raise ValueError(f"rank must be in [1, dim={s.dim}], got {s.rank}")
        if not 0 <= s.duplicates < 1:
            raise ValueError(f"duplicates is a fraction in [0, 1), got {s.duplicates}")
        self.settings = s
        self.dim = s.dim
        rng = np.random.default_rng(s.seed)
        basis, _ = np.linalg.qr(rng.standard_normal((s.dim, s.rank)).astype(np.float32))
        scales = (np.arange(1, s.rank + 1, dtype=np.float32)) ** -np.float32(s.decay)
        scales /= np.sqrt(np.sum(scales**2) * (1 + s.topic_spread**2))
        self.frame = np.ascontiguousarray((basis * scales).T)  # (rank, dim): latent -> ambient
        self.topics = rng.standard_normal((s.topics, s.rank), dtype=np.float32)
        mean = rng.standard_normal(s.dim, dtype=np.float32)
        self.mean = mean * np.float32(s.mean_norm / np.linalg.norm(mean))

    def sample(self, n: int, stream: int) -> np.ndarray:
        """``n`` unit vectors of ``stream`` (deterministic in ``(seed, stream)``)."""
        s = self.settings
        rng = np.random.default_rng([s.seed, stream])
        latent = self.topics[rng.integers(s.topics, size=n)]
        latent += rng.standard_normal(latent.shape, dtype=np.float32) * np.float32(s.topic_spread)
        copies = np.flatnonzero(rng.random(n) < s.duplicates)
        copies = copies[copies > 0]
        if len(copies):
            sources = (rng.random(len(copies)) * copies).astype(np.int64)  # an earlier row of this chunk
            latent[copies] = latent[sources] + np.float32(s.duplicate_noise) * rng.standard_normal(
                (len(copies), s.rank), dtype=np.float32
            )
        x = latent @ self.frame
        x += self.mean
        x += rng.standard_normal(x.shape, dtype=np.float32) * np.float32(s.noise / np.sqrt(s.dim))
        return _normalise(x)


class IsotropicMixture(_Chunked):
    """A Gaussian mixture on the unit sphere with isotropic centres and noise: the stress case for compression."""

    def __init__(self, dim: int, clusters: int = 1000, spread: float = 1.0, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.seed = seed
        self.centers = rng.standard_normal((clusters, dim), dtype=np.float32) / np.float32(np.sqrt(dim))
        self.noise = np.float32(spread / np.sqrt(dim))

    def sample(self, n: int, stream: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream])
        x = self.centers[rng.integers(len(self.centers), size=n)]
        x += rng.standard_normal(x.shape, dtype=np.float32) * self.noise
        return _normalise(x)


def embedding_stats(vectors: np.ndarray, *, neighbours: int = 10) -> dict[str, float]:
    """Spectrum and neighbour statistics of unit vectors, to compare generated and real embeddings.

    - ``participation_ratio`` = (Σλ)² / Σλ² of the centred covariance, as a fraction of the dimension (an effective
      dimension: 1/dim for one direction, 1 for isotropic data); ``dims_90``: fraction of dimensions holding 90% of
      the variance;
    - ``mean_cos``: mean cosine of distinct pairs (anisotropy); ``nn1_cos`` / ``nnk_cos``: mean cosine to the
      nearest / ``neighbours``-th nearest other row; ``near_duplicates``: fraction of rows whose nearest other row
      has cosine > 0.95.
    """
    x = np.asarray(vectors, dtype=np.float64)
    n, dim = x.shape
    if n <= neighbours:
        raise ValueError(f"need more than neighbours={neighbours} rows, got {n}")
    eig = np.clip(np.linalg.eigvalsh(np.cov(x, rowvar=False)), 0, None)[::-1]
    gram = x @ x.T
    np.fill_diagonal(gram, -np.inf)
    nearest = -np.sort(-gram, axis=1)[:, :neighbours]
    off_diagonal = gram[~np.eye(n, dtype=bool)]
    return {
        "n": float(n),
        "dim": float(dim),
        "participation_ratio": float(eig.sum() ** 2 / (eig**2).sum() / dim),
        "dims_90": float((np.searchsorted(np.cumsum(eig) / eig.sum(), 0.9) + 1) / dim),
        "mean_cos": float(off_diagonal.mean()),
        "nn1_cos": float(nearest[:, 0].mean()),
        "nnk_cos": float(nearest[:, -1].mean()),
        "near_duplicates": float((nearest[:, 0] > 0.95).mean()),
    }
