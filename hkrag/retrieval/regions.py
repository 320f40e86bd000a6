"""Pages ranked from region units (SCAN Sec. 3.3): retrieval over a corpus of page crops, scored per page.

A region corpus (:mod:`hkrag.data.region_corpus`) holds one row per unit with the ``page_id`` it was cut from.
:class:`RegionRanker` lets another ranker (the evaluated model's dense one, ``retriever=regions_dense``, or any
ranker given as ``inner``, e.g. BM25 over the units' text, ``retriever=regions_bm25``) rank the units, then gives
each page the maximum score over its units (:func:`hkrag.data.regions.page_ranking`) and keeps the top ``depth``
pages with the pages tied at the cut, so the run, qrels and metrics stay page-level and Table 2's layout compares
page units and region units side by side (``data.corpus_source=<region corpus>``). The units' own ranking is kept
(:meth:`RegionRanker.unit_runs`), so ``eval.py task=rag`` hands the generator the top crops, SCAN's visual RAG,
while its retrieval metrics stay page-level. See docs/data.md, "Region units (SCAN)".
"""

from __future__ import annotations

from collections.abc import Sequence

from hkrag.data.opendocvqa import Corpus, QAExample, pools
from hkrag.data.region_corpus import unit_pages
from hkrag.data.regions import page_ranking
from hkrag.retrieval.evaluation import Ranker, Run
from hkrag.retrieval.metrics import cut_with_ties


class RegionRanker:
    """Pages scored by the maximum over their units as ``inner`` (or ``dense``, which the retrieval task hands in)
    ranks them (module docstring). ``unit_depth`` units per query are ranked before mapping (at least ``depth``)."""

    def __init__(self, dense: Ranker | None = None, inner: Ranker | None = None, name: str = "regions",
                 unit_depth: int = 100):
        if (dense is None) == (inner is None):
            raise ValueError("RegionRanker ranks units with one ranker: give inner (or the task's dense), not both")
        if unit_depth < 1:
            raise ValueError(f"unit_depth must be >= 1, got {unit_depth}")
        self.inner: Ranker = inner if inner is not None else dense
        self.name, self.unit_depth = name, unit_depth
        self.ranked_units: dict[str, Run] = {}
        """Each ranked query's units and their scores, by corpus key (config): what :meth:`unit_runs` reads."""

    def rank(self, qa: Sequence[QAExample], corpus: Corpus, depth: int, corpus_key: str) -> Run:
        page_of = unit_pages(corpus)
        run = self.inner.rank(qa, corpus, max(depth, self.unit_depth), corpus_key)
        self.ranked_units.setdefault(corpus_key, {}).update(run)
        pages = {query: dict(page_ranking(sorted(units.items(), key=lambda item: -item[1]), page_of))
                 for query, units in run.items()}
        return cut_with_ties(pages, depth)

    def unit_runs(self, runs: dict[str, dict[str, Run]]) -> dict[str, dict[str, Run]]:
        """``runs[dataset][pool][query]`` of pages (as :func:`~hkrag.retrieval.evaluation.evaluate_ranker` returns
        them) as the same queries' ranked units: what a generator reading the retrieved crops gets."""
        return {dataset: {pool: {query: self.ranked_units[pools(dataset)[pool]][query] for query in run}
                          for pool, run in by_pool.items()} for dataset, by_pool in runs.items()}
