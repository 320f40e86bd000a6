"""Exact MaxSim search for the retrieval evaluation of the late-interaction head.

The pages are the token vectors of :func:`hkrag.index.shards.load_multi_vector_shards` (``vectors [tokens, dim]``,
``offsets [pages + 1]``). The search is :func:`hkrag.index.multivector.exact_search` (every page, in chunks within a
memory bound); scores are reported as training computes them (:func:`hkrag.late_interaction.maxsim_mean`: the mean over
the query's tokens of the best dot product with any of the page's tokens, i.e. the multi-vector index's sum divided
by the query's length, which ranks alike). Its interface is :class:`~hkrag.index.faiss_index.DocumentIndex`'s
``to_run`` and ``len``, which :func:`hkrag.retrieval.evaluation.search_with_ties` reads.

``eval.index`` picks the search under the late-interaction head (:func:`multivector_spec`): ``flat``, exact
MaxSim; ``multivector:<spec>``, a :class:`~hkrag.index.multivector.MultiVectorIndex` built from the pages with that
spec (compressed codes, token pooling, a candidate stage, exact re-ranking: docs/index.md), its scores divided by
the query's length alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hkrag.index.multivector import MultiVectorIndex, MultiVectorSpec, check_multivectors, exact_search, maxsim_sum

MULTIVECTOR = "multivector:"
"""``eval.index``'s prefix of a multi-vector index spec (``multivector:codec=PQ16x8;rerank=64``)."""


def multivector_spec(setting: str) -> str | None:
    """The multi-vector index spec ``eval.index`` names under the late-interaction head: ``None`` for ``flat``
    (exact MaxSim); a ``ValueError`` naming the setting for anything else or a spec that does not parse."""
    if setting == "flat":
        return None
    if not setting.startswith(MULTIVECTOR):
        raise ValueError(f"eval.index={setting!r}: the late-interaction head is searched by exact MaxSim "
                         f"(eval.index=flat) or a multi-vector index ('eval.index=\"{MULTIVECTOR}<spec>\"', e.g. "
                         f"{MULTIVECTOR}codec=PQ16x8;rerank=64; docs/index.md)")
    spec = setting.removeprefix(MULTIVECTOR)
    try:
        MultiVectorSpec.parse(spec)
    except ValueError as error:
        raise ValueError(f"eval.index={setting!r}: {error}") from error
    return spec


class MaxSimIndex:
    """MaxSim over ``ids``' pages (token ``vectors`` with ``offsets``): exact, the similarity matrix of a chunk of
    pages held within ``memory`` bytes, or with ``spec`` through a
    :class:`~hkrag.index.multivector.MultiVectorIndex` built from them."""

    def __init__(self, ids: Sequence[str], vectors: np.ndarray, offsets: np.ndarray, memory: int = 256 << 20,
                 spec: str | None = None):
        self.vectors, self.offsets = check_multivectors(vectors, offsets, name="pages")
        if len(self.offsets) != len(ids) + 1:
            raise ValueError(f"{len(ids)} page ids for {len(self.offsets) - 1} pages of vectors")
        self.ids = [str(i) for i in ids]
        self.memory = memory
        self.index = None if spec is None else MultiVectorIndex.build(self.ids, self.vectors, self.offsets, spec)

    @classmethod
    def from_pages(cls, ids: Sequence[str], pages: Sequence[np.ndarray], **kwargs) -> MaxSimIndex:
        """From one ``(tokens, dim)`` array per page."""
        vectors, offsets = _stacked(pages)
        return cls(ids, vectors, offsets, **kwargs)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def _queries(self, queries: Sequence[np.ndarray], ids: Sequence[str] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """The queries as ``(vectors, offsets)``, checked; a query of padding only (no token, or only zero rows:
        it would score 0 against every page) is refused naming it (``ids``) or its position."""
        vectors, offsets = _stacked(queries)
        if vectors.ndim == 2 and vectors.shape[1] == self.dim:  # a shape error is check_multivectors' to name
            empty = [i for i, query in enumerate(queries) if not np.asarray(query).any()]
            if empty:
                name = repr(ids[empty[0]]) if ids is not None else f"#{empty[0]}"
                raise ValueError(f"query {name} is padding only ({len(empty)} of {len(queries)} queries are): no "
                                 "token vector to score pages with, so every page would score 0; its text tokenises "
                                 "to nothing (and model.late_interaction.query_augmentation=0 adds none)")
        return check_multivectors(vectors, offsets, name="queries", dim=self.dim)

    def scores(self, queries: Sequence[np.ndarray]) -> np.ndarray:
        """MaxSim of every query (one ``(tokens, dim)`` array each) against every page: ``(queries, pages)``."""
        if not len(queries):
            return np.zeros((0, len(self)), dtype=np.float32)
        vectors, offsets = self._queries(queries)
        return maxsim_sum(vectors, offsets, self.vectors, self.offsets) / np.diff(offsets)[:, None]

    def to_run(self, query_ids: Sequence[str], queries: Sequence[np.ndarray], k: int) -> dict[str, dict[str, float]]:
        """The top ``k`` pages of each query as a TREC-style run ``{query_id: {doc_id: score}}``, best first."""
        if len(query_ids) != len(queries):
            raise ValueError(f"{len(query_ids)} query ids for {len(queries)} queries")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if not len(queries):
            return {}
        vectors, offsets = self._queries(queries, query_ids)
        k = min(k, len(self))
        if self.index is None:
            scores, rows = exact_search(vectors, offsets, self.vectors, self.offsets, k, memory=self.memory)
        else:
            scores, rows = self.index.search(vectors, offsets, k, memory=self.memory)
        scores = scores / np.diff(offsets)[:, None]
        return {str(qid): {self.ids[j]: float(s) for s, j in zip(row_scores, row, strict=True) if j >= 0}
                for qid, row_scores, row in zip(query_ids, scores, rows, strict=True)}


def _stacked(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One ``(tokens, dim)`` float32 array per item as the shard format's ``(vectors, offsets)``."""
    arrays = [np.asarray(a, dtype=np.float32) for a in arrays]
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return np.concatenate(arrays) if arrays else np.zeros((0, 0), np.float32), offsets
