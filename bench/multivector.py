"""Benchmark multi-vector index settings against exact MaxSim on synthetic late-interaction pages (not a test).

Pages and queries come from ``hkrag.index.synthetic_embeddings.MultiVectorPages`` (128-d vectors, ~64 a page,
topic structure; the relevant page of a query is the page it was drawn from). For every ``--specs`` setting
(``hkrag.index.multivector.MultiVectorSpec`` strings) it prints build time, memory and disk bytes per page
(and their fraction of exact MaxSim's float16 vectors + offsets), recall@k against exact MaxSim's top-k,
nDCG@k against the constructed qrels beside exact MaxSim's, single-query p50/p99 (``--single`` queries, one
FAISS/BLAS thread) and the part of it spent re-ranking (``rerank``: reading the vectors and exact MaxSim), and the
machine. ``--split val`` reads the validation queries (choose settings there),
``--split test`` the held-out test queries (``--split val test``: both, from one build). ``--vary`` re-searches
each built index with other search-time settings (candidates, stage parameters, rerank depth). ``--cache DIR``
saves each built index under ``DIR`` (named by pages, seed and setting) and loads it on a later run instead of
building it again (the build seconds then come from its manifest). ``--cold`` searches every index as saved and
loaded back, its re-ranking vectors (``rerank``) mapped from the file and dropped from the page cache
(``posix_fadvise``) before the batch and before every timed query, so each re-ranked page is read from disk.

    OMP_NUM_THREADS=1 nice -n 10 python bench/multivector.py --pages 10000 --split val \\
        --specs "codec=PQ16x6" "codec=PQ16x6;rerank=20"
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import tempfile
import time

import faiss
import numpy as np

from hkrag.environment import cpu_model
from hkrag.index.multivector import MultiVectorIndex, exact_search
from hkrag.index.synthetic_embeddings import QUERY_STREAM, TUNING_STREAM, MultiVectorPages
from hkrag.index.tuning import recall_at_k


def built(ids: list[str], vectors: np.ndarray, offsets: np.ndarray, spec: str, cache: str | None, seed: int,
          cold: bool = False):
    """The index of ``spec`` and its build seconds: loaded from ``cache`` when saved there, else built (and saved).
    ``cold``: always the saved index loaded back, its re-ranking vectors mapped from the file (not the built array)."""
    directory = cache and os.path.join(cache, f"{len(ids)}-seed{seed}-" + re.sub(r"[^A-Za-z0-9=,.-]+", "_", spec))
    if directory and os.path.isfile(os.path.join(directory, "multivector.json")):
        index = MultiVectorIndex.load(directory)
        print(f"loaded {directory}", flush=True)
        return index, sum(index.build_seconds.values())
    start = time.perf_counter()
    index = MultiVectorIndex.build(ids, vectors, offsets, spec)
    build_s = time.perf_counter() - start
    if directory:
        index.save(directory)
        if cold:
            index = MultiVectorIndex.load(directory)
    return index, build_s


def ndcg_at_k(rows: np.ndarray, relevant: np.ndarray, k: int) -> float:
    """Mean nDCG@k with one relevant page per query (ideal DCG 1): 1 / log2(rank + 1) where it is found."""
    hits = rows[:, :k] == relevant[:, None]
    return float((hits / np.log2(np.arange(2, k + 2))).sum(axis=1).mean())


def measure(index: MultiVectorIndex, queries, query_offsets, relevant, exact, exact_bytes: float, args) -> str:
    """The table cells after the setting: bytes, single-query latency (one thread), recall and nDCG. ``--cold``:
    the re-ranking vectors are dropped from the page cache before the batch and before every timed query."""
    cold = args.cold and index.full is not None
    if cold:
        index.drop_cached_vectors()
    _, rows = index.search(queries, query_offsets, args.k)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    latencies, reranks = [], []
    for q in range(min(args.single, len(query_offsets) - 1)):
        a, b = query_offsets[q], query_offsets[q + 1]
        if cold:
            index.drop_cached_vectors()
        start = time.perf_counter()
        index.search(queries[a:b], np.array([0, b - a]), args.k)
        latencies.append(time.perf_counter() - start)
        reranks.append(index.last_rerank_s)
    faiss.omp_set_num_threads(threads)
    ram, disk = index.bytes_per_page(), index.disk_bytes_per_page()
    return (f"{ram:,.0f} | 1/{exact_bytes / ram:.1f} | {disk:,.0f} | {1000 * np.percentile(latencies, 50):.1f} "
            f"| {1000 * np.percentile(latencies, 99):.1f} | {1000 * np.percentile(reranks, 50):.2f} "
            f"| {1000 * np.percentile(reranks, 99):.2f} | {recall_at_k(rows, exact):.3f} "
            f"| {ndcg_at_k(rows, relevant, args.k):.4f} | {ndcg_at_k(exact, relevant, args.k):.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=300, help="queries searched as one batch")
    parser.add_argument("--single", type=int, default=100, help="queries timed one by one")
    parser.add_argument("--split", nargs="+", choices=("val", "test"), default=["val"])
    parser.add_argument("--vary", nargs="+", help="search-time settings tried on each built index "
                        "(MultiVectorIndex.set_search), e.g. 'candidates=128;stage_params=nprobe=16'")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--specs", nargs="+", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", help="directory to save built indexes in and load them from")
    parser.add_argument("--cold", action="store_true", help="search each index as saved and loaded back, its "
                        "re-ranking vectors mapped from disk and dropped from the page cache before every query "
                        "(with --cache; without, a temporary directory)")
    args = parser.parse_args()
    if args.cold and not args.cache:
        args.cache = tempfile.mkdtemp(prefix="multivector-cold-")

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, FAISS threads {faiss.omp_get_max_threads()}, "
          f"load average at start {os.getloadavg()[0]:.1f}; faiss {faiss.__version__}; numpy {np.__version__}")
    data = MultiVectorPages(seed=args.seed)
    start = time.perf_counter()
    vectors, offsets, topics = data.corpus(args.pages)
    print(f"data: {data.settings}; {args.pages:,} pages, {len(vectors):,} vectors "
          f"({time.perf_counter() - start:.0f} s to generate)", flush=True)
    splits = {}
    for split in args.split:
        stream = TUNING_STREAM if split == "val" else QUERY_STREAM
        queries, query_offsets, relevant = data.queries(vectors, offsets, topics, args.queries, stream)
        start = time.perf_counter()
        _, exact = exact_search(queries, query_offsets, vectors, offsets, args.k)
        exact_s = time.perf_counter() - start
        splits[split] = queries, query_offsets, relevant, exact
        print(f"exact MaxSim (batched, {split} queries): {1000 * exact_s / args.queries:.1f} ms/query, "
              f"nDCG@{args.k} {ndcg_at_k(exact, relevant, args.k):.4f}", flush=True)
    exact_bytes = (vectors.nbytes + offsets.nbytes) / args.pages
    print(f"exact MaxSim bytes: {exact_bytes:,.0f} B/page (float16 vectors + int64 offsets)")
    ids = [str(i) for i in range(args.pages)]
    header = (f"| split | setting | build s | RAM B/page | / exact | disk B/page | p50 ms | p99 ms | re-rank p50 ms "
              f"| re-rank p99 ms | recall@{args.k} | nDCG@{args.k} | exact nDCG@{args.k} |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for spec in args.specs:
        index, build_s = built(ids, vectors, offsets, spec, args.cache, args.seed, args.cold)
        for search in args.vary or [""]:
            if search:
                index.set_search(search)
            for split, (queries, query_offsets, relevant, exact) in splits.items():
                lines.append(f"| {split} | {index.spec} | {build_s:.0f} | "
                             + measure(index, queries, query_offsets, relevant, exact, exact_bytes, args))
                print(lines[-1] + f" load average {os.getloadavg()[0]:.1f}", flush=True)
        del index
    print("\n" + "\n".join(lines))
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB; "
          f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
