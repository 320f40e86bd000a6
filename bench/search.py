"""Benchmark FAISS index kinds on synthetic clustered embeddings (not a test).

Builds each index over ``--n`` L2-normalised vectors drawn from a Gaussian mixture (like real
embeddings, which cluster), generated and added in chunks so the corpus is never held twice in
memory, then reports build time, index memory (growth of the process's resident set), code
bytes per vector, batched queries/s, single-query p50/p99 latency and recall@k against exact
search (the first spec, ``flat``).

    python bench/search.py --n 200000 --dim 3072
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from collections.abc import Iterator

import faiss
import numpy as np

from hkrag.index.faiss_index import DocumentIndex, IndexSpec, gpu_count

QUERY_STREAM = 2**31  # disjoint from the corpus streams 1.. and the training stream 0
DEFAULT_SPECS = ("flat", "sq8", "ivfpq:nlist=1024,m=64,nbits=8,nprobe=16")


class Mixture:
    """A Gaussian mixture on the unit sphere, sampled deterministically chunk by chunk."""

    def __init__(self, dim: int, clusters: int, spread: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.centers = rng.standard_normal((clusters, dim), dtype=np.float32) / np.sqrt(dim)
        self.noise = spread / np.sqrt(dim)
        self.seed = seed

    def sample(self, n: int, stream: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream])
        x = self.centers[rng.integers(len(self.centers), size=n)]
        x += rng.standard_normal(x.shape, dtype=np.float32) * np.float32(self.noise)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x

    def chunks(self, n: int, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, n, chunk):
            yield start, self.sample(min(chunk, n - start), stream=start // chunk + 1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def build(spec: str, data: Mixture, args: argparse.Namespace) -> tuple[DocumentIndex, float, int]:
    before = rss_bytes()
    start = time.perf_counter()
    index = DocumentIndex(args.dim, spec, use_gpu=None if args.gpu and gpu_count() else False)
    if not index.is_trained:
        index.train(data.sample(min(args.n, args.train), stream=0))
    for offset, chunk in data.chunks(args.n, args.chunk):
        index.add([str(offset + i) for i in range(len(chunk))], chunk)
    return index, time.perf_counter() - start, rss_bytes() - before


def measure(index: DocumentIndex, queries: np.ndarray, args: argparse.Namespace) -> dict[str, object]:
    start = time.perf_counter()
    _, rows = index.search_arrays(queries, args.k)
    batched_s = time.perf_counter() - start
    latencies = []
    for query in queries[: args.single]:
        start = time.perf_counter()
        index.search_arrays(query, args.k)
        latencies.append(time.perf_counter() - start)
    return {
        "rows": rows,
        "qps": len(queries) / batched_s,
        "batched_ms": 1000 * batched_s / len(queries),
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)),
    }


def recall_at_k(rows: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(r[r >= 0]) & set(e)) / len(e) for r, e in zip(rows, exact, strict=True)]))


def code_bytes(index: DocumentIndex) -> float:
    return float(index.cpu_index().sa_code_size())


def machine(args: argparse.Namespace) -> str:
    gpus = gpu_count()
    if args.gpu and not gpus:
        why = "FAISS has no GPU support" if not hasattr(faiss, "StandardGpuResources") else "no GPU visible"
        print(f"--gpu requested but unavailable ({why}); running on CPU")
    return (
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, FAISS threads {faiss.omp_get_max_threads()}; "
        f"faiss {faiss.__version__}; numpy {np.__version__}; "
        f"GPU: {f'{gpus} GPU(s) used' if args.gpu and gpus else 'none used'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="corpus vectors")
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--queries", type=int, default=1000, help="queries searched as one batch")
    parser.add_argument("--single", type=int, default=100, help="queries timed one by one")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--clusters", type=int, default=1000, help="mixture components")
    parser.add_argument("--spread", type=float, default=1.0, help="within-cluster noise / center norm")
    parser.add_argument("--train", type=int, default=65536, help="training vectors for quantisers")
    parser.add_argument("--chunk", type=int, default=50_000, help="vectors generated/added at a time")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS), help="first must be flat")
    parser.add_argument("--gpu", action="store_true", help="use FAISS GPU indexes when available")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if IndexSpec.parse(args.specs[0]).kind != "flat":
        parser.error("the first spec must be flat: it gives the exact neighbours recall is measured against")

    print(machine(args))
    print(f"n={args.n:,} dim={args.dim} queries={args.queries} single={args.single} k={args.k}\n")
    data = Mixture(args.dim, args.clusters, args.spread, args.seed)
    queries = data.sample(args.queries, stream=QUERY_STREAM)
    header = (
        "| index | build s | memory MiB | code B/vec | batched QPS | batched ms/q "
        f"| single p50 ms | single p99 ms | recall@{args.k} |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    exact = None
    for spec in args.specs:
        index, build_s, memory = build(spec, data, args)
        result = measure(index, queries, args)
        exact = result["rows"] if exact is None else exact
        lines.append(
            f"| {index.spec} | {build_s:.1f} | {memory / 2**20:,.0f} | {code_bytes(index):,.0f} "
            f"| {result['qps']:,.0f} | {result['batched_ms']:.2f} | {result['p50_ms']:.2f} "
            f"| {result['p99_ms']:.2f} | {recall_at_k(result['rows'], exact):.3f} |"
        )
        print(lines[-1], flush=True)
        del index
        gc.collect()
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
