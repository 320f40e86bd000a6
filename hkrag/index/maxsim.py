"""Exact MaxSim search over multi-vector (late-interaction) page embeddings, for pools that fit in memory.

The pages are the token vectors of :func:`hkrag.index.shards.load_multi_vector_shards` (``vectors [tokens, dim]``,
``offsets [pages + 1]``). A query's score for a page is :func:`hkrag.late_interaction.maxsim`'s: the mean over the
query's tokens of the best dot product with any of the page's tokens, the score training optimises. Pages are
padded into blocks and scored in batches with torch, every page against every query: exact, the reference a
compressed multi-vector index is measured against. Its interface is :class:`~hkrag.index.faiss_index.DocumentIndex`'s
``to_run`` and ``len``, which :func:`hkrag.retrieval.evaluation.search_with_ties` reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hkrag.late_interaction import maxsim


def pad_pages(vectors: np.ndarray | torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """Pages ``offsets[i] .. offsets[i + 1]`` of ``vectors`` as one zero-padded ``(pages, longest, dim)`` float32
    tensor (the padding rows zero, as :func:`~hkrag.late_interaction.maxsim` expects)."""
    vectors = torch.as_tensor(np.asarray(vectors, dtype=np.float32))
    lengths = np.diff(offsets)
    out = torch.zeros(len(lengths), int(lengths.max(initial=0)), vectors.shape[1])
    for row, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        out[row, : end - start] = vectors[start:end]
    return out


class MaxSimIndex:
    """Exact MaxSim over ``ids``' pages (token ``vectors`` with ``offsets``), searched in blocks of pages holding at
    most ``max_elements`` token-pair scores per query batch."""

    def __init__(self, ids: Sequence[str], vectors: np.ndarray, offsets: np.ndarray, max_elements: int = 2**26):
        offsets = np.asarray(offsets, dtype=np.int64)
        ends = len(offsets) == len(ids) + 1 and offsets[0] == 0 and offsets[-1] == len(vectors)
        if not ends or (np.diff(offsets) < 1).any():
            raise ValueError(f"offsets must rise from 0 to the {len(vectors)} token vectors, one page of >= 1 token "
                             f"per id ({len(ids)} ids, {len(offsets)} offsets)")
        self.ids = [str(i) for i in ids]
        self.pages = pad_pages(vectors, offsets)
        self.max_elements = max_elements

    @classmethod
    def from_pages(cls, ids: Sequence[str], pages: Sequence[np.ndarray], **kwargs) -> MaxSimIndex:
        """From one ``(tokens, dim)`` array per page."""
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int64)
        return cls(ids, np.concatenate([np.asarray(p, dtype=np.float32) for p in pages]), offsets, **kwargs)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.pages.shape[-1])

    def scores(self, queries: Sequence[np.ndarray | torch.Tensor]) -> np.ndarray:
        """MaxSim of every query (one ``(tokens, dim)`` array each) against every page: ``(queries, pages)``."""
        if not queries:
            return np.zeros((0, len(self)), dtype=np.float32)
        rows = [torch.as_tensor(np.asarray(q, dtype=np.float32)) for q in queries]
        bad = [i for i, q in enumerate(rows) if q.ndim != 2 or q.shape[1] != self.dim or len(q) == 0]
        if bad:
            raise ValueError(f"query {bad[0]} has shape {tuple(rows[bad[0]].shape)}; expected (tokens >= 1, "
                             f"{self.dim}) like the pages")
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        per_page = padded.shape[0] * padded.shape[1] * self.pages.shape[1]
        block = max(1, self.max_elements // max(1, per_page))
        with torch.no_grad():
            out = [maxsim(padded, self.pages[start : start + block]) for start in range(0, len(self), block)]
        return torch.cat(out, dim=1).numpy()

    def to_run(self, query_ids: Sequence[str], queries: Sequence[np.ndarray], k: int) -> dict[str, dict[str, float]]:
        """The top ``k`` pages of each query as a TREC-style run ``{query_id: {doc_id: score}}`` (best first; ties
        in page order, as a stable sort leaves them)."""
        if len(query_ids) != len(queries):
            raise ValueError(f"{len(query_ids)} query ids for {len(queries)} queries")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        scores = self.scores(queries)
        top = np.argsort(-scores, axis=1, kind="stable")[:, : min(k, len(self))]
        return {str(qid): {self.ids[j]: float(row[j]) for j in order}
                for qid, row, order in zip(query_ids, scores, top, strict=True)}
