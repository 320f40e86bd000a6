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


@dataclass(frozen=True)
class MultiVectorSettings:
    """Parameters of :class:`MultiVectorPages`.

    - ``dim`` 128: ColBERT's and ColPali's projection width.
    - ``tokens`` 64 vectors per page on average, lengths uniform in ``tokens * (1 ± length_spread)`` (ragged
      offsets as real pages have). ColPali keeps ~1,030 patch vectors per page; 64 keeps 100k pages in memory on
      this machine (6.4M vectors, 1.6 GB in float16) while MaxSim still takes a max over many vectors.
    - ``words`` token clusters ("visual words": ColBERT's token embeddings gather around a vocabulary of
      centroids, which PLAID's 2^16 centroids exploit), drawn as :class:`EmbeddingLike` vectors (anisotropic,
      low-rank), so the clustering is neither trivial nor isotropic.
    - ``topics`` themes of ``topic_words`` words each: a ``topic_share`` of a page's tokens are its topic's words,
      the rest any word. Pages of one topic then share most words (hard negatives, like sibling pages of one
      document) and differ by each token's own deviation ``token_noise`` from its word: the fine print.
    - queries of ``query_tokens`` vectors (ColPali's queries are ~20 tokens with augmentation): a ``query_share``
      paraphrase tokens of one source page (the token plus ``query_noise``), the rest are words of its topic.
      The source page is the one relevant page (qrels by construction).
    """

    dim: int = 128
    tokens: int = 64
    length_spread: float = 0.25
    words: int = 4096
    topics: int = 1000
    topic_words: int = 48
    topic_share: float = 0.7
    token_noise: float = 0.5
    query_tokens: int = 16
    query_share: float = 0.25
    query_noise: float = 0.5
    seed: int = 0


class MultiVectorPages:
    """Synthetic late-interaction pages and queries (:class:`MultiVectorSettings`), as (vectors, offsets) arrays.

    Page vectors are ``normalise(word + token_noise * e)``, ``e ~ N(0, I_dim / dim)``; query vectors are
    ``normalise(source + query_noise * e)`` with ``source`` a token of the relevant page or a word of its topic.
    Chunk ``i`` of a corpus (``chunks``) is stream ``i + 1``, as for the single-vector generators.
    """

    def __init__(self, settings: MultiVectorSettings | None = None, **overrides: float) -> None:
        s = MultiVectorSettings(**{**(settings or MultiVectorSettings()).__dict__, **overrides})
        if not 0 <= s.length_spread < 1 or s.tokens < 1:
            raise ValueError(f"tokens must be >= 1 and length_spread in [0, 1), got {s.tokens}, {s.length_spread}")
        self.settings = s
        self.dim = s.dim
        self.words = EmbeddingLike(dim=s.dim, rank=min(64, s.dim), topics=max(1, s.words // 8), duplicates=0,
                                   seed=s.seed).sample(s.words, stream=0)
        rng = np.random.default_rng([s.seed, 1])
        self.topic_words = np.stack([rng.choice(s.words, s.topic_words, replace=False) for _ in range(s.topics)])

    def _noisy(self, x: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
        return _normalise(x + rng.standard_normal(x.shape, dtype=np.float32) * np.float32(noise / np.sqrt(self.dim)))

    def sample(self, n: int, stream: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` pages of ``stream``: float32 vectors [tokens, dim], int64 offsets [n + 1], topic of each page."""
        s = self.settings
        rng = np.random.default_rng([s.seed, stream])
        low, high = max(1, round(s.tokens * (1 - s.length_spread))), round(s.tokens * (1 + s.length_spread))
        lengths = rng.integers(low, high + 1, size=n)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        topics = rng.integers(s.topics, size=n)
        token_topic = np.repeat(topics, lengths)
        own = self.topic_words[token_topic, rng.integers(s.topic_words, size=len(token_topic))]
        words = np.where(rng.random(len(own)) < s.topic_share, own, rng.integers(s.words, size=len(own)))
        return self._noisy(self.words[words], s.token_noise, rng), offsets, topics

    def chunks(self, n: int, chunk: int) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """``(first page, sample)`` pairs covering pages ``[0, n)`` in chunks of ``chunk`` pages."""
        for start in range(0, n, chunk):
            yield start, self.sample(min(chunk, n - start), stream=start // chunk + 1)

    def corpus(self, n: int, chunk: int = 10_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All ``n`` pages at once: float16 vectors (the shard format), int64 offsets, topics."""
        parts = [sample for _, sample in self.chunks(n, chunk)]
        vectors = np.concatenate([p[0].astype(np.float16) for p in parts])
        starts = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
        offsets = np.concatenate([[0]] + [p[1][1:] + start for p, start in zip(parts, starts)])
        return vectors, offsets.astype(np.int64), np.concatenate([p[2] for p in parts])

    def queries(
        self, vectors: np.ndarray, offsets: np.ndarray, topics: np.ndarray, n: int, stream: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` queries about pages of the corpus ``(vectors, offsets, topics)``: float32 vectors, int64 offsets
        (``query_tokens`` each) and the row of each query's relevant page."""
        s = self.settings
        rng = np.random.default_rng([s.seed, stream])
        pages = rng.integers(len(offsets) - 1, size=n)
        from_page = rng.random((n, s.query_tokens)) < s.query_share
        lengths = offsets[pages + 1] - offsets[pages]
        page_tokens = offsets[pages][:, None] + (rng.random((n, s.query_tokens)) * lengths[:, None]).astype(np.int64)
        topic_words = self.topic_words[topics[pages][:, None], rng.integers(s.topic_words, size=(n, s.query_tokens))]
        topic_tokens = self.words[topic_words]
        sources = np.where(from_page[..., None], vectors[page_tokens].astype(np.float32), topic_tokens)
        q = self._noisy(sources.reshape(-1, s.dim), s.query_noise, rng)
        return q, np.arange(0, n * s.query_tokens + 1, s.query_tokens, dtype=np.int64), pages
