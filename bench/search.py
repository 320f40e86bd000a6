"""Benchmark tuned FAISS indexes on synthetic embeddings at up to a million pages (not a test).

The corpus (``--data embedding``: low-rank, clustered, anisotropic, with near duplicates, see
``hkrag.index.synthetic_embeddings``; ``--data isotropic``: the old stress case) is generated chunk by
chunk into one float32 ``.npy`` under ``--workdir`` and read back chunk by chunk, so 1M x 3072 (12.3 GB)
never sits in memory. Exact top-k of the held-out tuning and test queries is computed over those chunks.
Each spec is trained on a sample, filled chunk by chunk, tuned (``hkrag.index.tuning``: the fastest
parameters reaching ``--target`` recall@k on the tuning queries), then measured on the test queries:
build time, index size in memory (and its fraction of flat), batched QPS, single-query p50/p99 and
recall@k against exact search. The tuning column gives the tuning queries' recall and its one-sided normal lower
bound (the tuner's rule: optimistic, the parameters were selected on those queries); the test column the held-out
test queries' recall with its 95 % percentile bootstrap interval (``hkrag.index.tuning.held_out_recall``).

``--mmap`` saves each index and reopens it with its stored vectors memory-mapped
(``DocumentIndex.load(mmap=True)``): a ``Refine(Flat)`` stage then re-ranks from the file on disk, and the
test queries are timed cold (the file is dropped from the page cache and the index reopened before the
single and the batched queries), so every re-ranked vector is a read from disk unless an earlier query of
the same run read it.

``--save DIR`` keeps each tuned index (with its build cost and tuning recall in ``bench.json``); a rerun with
the same ``--save`` reopens it instead of building and tuning again, so a long build made on a busy machine can
be timed again on a quiet one. The corpus file is named by the generator's settings and the exact neighbours
of the queries are cached beside it, so a rerun skips both.

    nice -n 5 python bench/search.py --n 1000000 --specs "PCA384,IVF2048,PQ96x4fs,Refine(PCA384,SQ8)"
    nice -n 5 python bench/search.py --n 1000000 --mmap --specs "PCA384,IVF2048,SQ8,Refine(Flat)"
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from hkrag.environment import cpu_model
from hkrag.index.faiss_index import DocumentIndex, gpu_count
from hkrag.index.mmap import drop_from_page_cache
from hkrag.index.synthetic_embeddings import (
    QUERY_STREAM,
    TUNING_STREAM,
    EmbeddingLike,
    EmbeddingSettings,
    IsotropicMixture,
)
from hkrag.index.tuning import exact_neighbours, held_out_recall, query_recalls, recall_at_k, recall_summary, tune
from hkrag.io import atomic_write, write_json

DEFAULT_SPECS = ("PCA384,IVF2048,PQ96x4fs,Refine(PCA384,SQ8)",)


class VectorFile:
    """A float32 ``.npy`` matrix written and read in row chunks (plain reads: no mapped pages in the RSS)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, rows: int, dim: int, chunks: Iterator[tuple[int, np.ndarray]], total: int) -> None:
        header = {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)}

        def fill(f) -> None:
            np.lib.format.write_array_header_1_0(f, header)
            for _, chunk in tqdm(chunks, total=total, desc="generate", leave=False):
                f.write(np.ascontiguousarray(chunk, dtype="<f4").tobytes())

        atomic_write(self.path, fill, "wb")

    def chunks(self, chunk: int) -> Iterator[np.ndarray]:
        with open(self.path, "rb") as f:
            np.lib.format.read_magic(f)
            (rows, dim), _, _ = np.lib.format.read_array_header_1_0(f)
            for start in range(0, rows, chunk):
                count = min(chunk, rows - start) * dim
                yield np.fromfile(f, dtype="<f4", count=count).reshape(-1, dim)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine(args: argparse.Namespace) -> str:
    gpus = gpu_count() if args.gpu else 0
    return (
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, FAISS threads {faiss.omp_get_max_threads()} "
        f"(single queries: {args.single_threads}); load average at start {os.getloadavg()[0]:.1f}; "
        f"faiss {faiss.__version__}; numpy {np.__version__}; GPU: {f'{gpus} used' if gpus else 'none used'}"
    )


def generator(args: argparse.Namespace) -> EmbeddingLike | IsotropicMixture:
    if args.data == "isotropic":
        return IsotropicMixture(args.dim, args.clusters, args.spread, args.seed)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(EmbeddingSettings)}
    return EmbeddingLike(EmbeddingSettings(**overrides))


def corpus_name(data, args: argparse.Namespace) -> str:
    """The corpus file's name: its size and a digest of every generator setting, so other settings never reuse it."""
    if isinstance(data, EmbeddingLike):
        settings = dataclasses.asdict(data.settings)
    else:
        settings = {"dim": args.dim, "clusters": args.clusters, "spread": args.spread, "seed": args.seed}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"corpus-{args.data}-{args.n}x{args.dim}-{args.seed}-{digest}"


def cached_exact(path: Path, queries: np.ndarray, corpus: VectorFile, args: argparse.Namespace) -> np.ndarray:
    """Exact top-k rows of the queries over the corpus, computed once and kept at ``path``."""
    if path.exists():
        print(f"exact neighbours: {path} (cached)")
        return np.load(path)
    start = time.perf_counter()
    _, exact = exact_neighbours(queries, corpus.chunks(args.chunk), args.k)
    seconds = time.perf_counter() - start
    print(f"exact search (flat, batched, chunked): {len(exact) / seconds:.1f} QPS, {seconds:.0f} s", flush=True)
    atomic_write(path, lambda f: np.save(f, exact), "wb")
    return exact


def build(spec: str, data, corpus: VectorFile, args: argparse.Namespace) -> tuple[DocumentIndex, dict]:
    before = rss_bytes()
    index = DocumentIndex(args.dim, f"faiss:{spec}", use_gpu=None if args.gpu else False)
    start = time.perf_counter()
    train = args.train or index.spec.default_max_train()
    index.train(data.sample(min(args.n, train), stream=0))
    trained = time.perf_counter()
    offset = 0
    for chunk in tqdm(corpus.chunks(args.chunk), total=-(-args.n // args.chunk), desc="add", leave=False):
        index.add([str(offset + i) for i in range(len(chunk))], chunk)
        offset += len(chunk)
    done = time.perf_counter()
    return index, {"train_s": trained - start, "add_s": done - trained, "rss_growth": rss_bytes() - before}


def reopen(directory: Path) -> DocumentIndex:
    """The saved index opened with its stored vectors mapped, none of them in the page cache (cold)."""
    index = DocumentIndex.load(directory, use_gpu=False, mmap=True)
    drop_from_page_cache(directory / "index.faiss")
    return index


def measure(open_index: Callable[[], DocumentIndex], queries: np.ndarray, exact: np.ndarray, args) -> dict:
    """Batched QPS, single-query latency and recall of the test queries, each phase on its own ``open_index()``
    (a mapped index is reopened cold: the previous one is released first, so none of its pages stay mapped)."""
    index = open_index()
    start = time.perf_counter()
    _, rows = index.search_arrays(queries, args.k)
    batched_s = time.perf_counter() - start
    del index
    index = open_index()
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(args.single_threads)
    latencies = []
    for query in queries[: args.single]:
        start = time.perf_counter()
        index.search_arrays(query, args.k)
        latencies.append(time.perf_counter() - start)
    faiss.omp_set_num_threads(threads)
    return {
        "qps": len(queries) / batched_s,
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "recall": recall_at_k(rows, exact),
        "test": held_out_recall(query_recalls(rows, exact)),
    }


def kept(index: DocumentIndex) -> Callable[[], DocumentIndex]:
    """An ``open_index`` for :func:`measure` that gives the index already in memory."""
    return lambda: index


def main() -> None:
    defaults = EmbeddingSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="corpus vectors")
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--data", choices=("embedding", "isotropic"), default="embedding")
    for field in dataclasses.fields(EmbeddingSettings):
        if field.name not in ("dim", "seed"):
            parser.add_argument(
                f"--{field.name.replace('_', '-')}",
                type=type(field.default),
                default=field.default,
                help="embedding generator setting",
            )
    parser.add_argument("--clusters", type=int, default=1000, help="isotropic mixture components")
    parser.add_argument("--spread", type=float, default=1.0, help="isotropic within-cluster noise / centre norm")
    parser.add_argument("--tuning-queries", type=int, default=500, help="held-out queries the parameters are tuned on")
    parser.add_argument("--queries", type=int, default=1000, help="held-out test queries, searched as one batch")
    parser.add_argument("--single", type=int, default=300, help="test queries timed one by one")
    parser.add_argument("--single-threads", type=int, default=1, help="FAISS threads for single queries")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.95, help="recall@k the tuning must reach")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the tuning recall's lower bound")
    parser.add_argument("--train", type=int, default=0, help="training vectors (0: the spec's default)")
    parser.add_argument("--chunk", type=int, default=50_000, help="vectors generated/read at a time")
    parser.add_argument(
        "--specs",
        nargs="+",
        default=list(DEFAULT_SPECS),
        help="faiss.index_factory strings, each tuned unless it carries its parameters (SPEC;nprobe=8)",
    )
    parser.add_argument("--workdir", default="/tmp/hkrag-search", help="where the corpus .npy is written")
    parser.add_argument("--keep", action="store_true", help="keep the corpus file afterwards")
    parser.add_argument("--save", help="save each tuned index under this directory (index.json holds the params)")
    parser.add_argument(
        "--mmap",
        action="store_true",
        help="save each index, reopen it with its stored vectors mapped from disk, time it cold",
    )
    parser.add_argument("--gpu", action="store_true", help="use FAISS GPU indexes when available")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(machine(args))
    data = generator(args)
    if isinstance(data, EmbeddingLike):
        print(f"data: embedding-like {dataclasses.asdict(data.settings)}")
    else:
        print(f"data: isotropic mixture dim={args.dim} clusters={args.clusters} spread={args.spread}")
    print(
        f"n={args.n:,} tuning queries={args.tuning_queries} test queries={args.queries} "
        f"single={args.single} k={args.k} target={args.target}\n",
        flush=True,
    )
    corpus = VectorFile(Path(args.workdir) / f"{corpus_name(data, args)}.npy")
    exact_file = corpus.path.with_name(f"{corpus.path.stem}-exact-{args.tuning_queries}-{args.queries}-k{args.k}.npy")
    try:
        start = time.perf_counter()
        if not corpus.path.exists():
            corpus.write(args.n, args.dim, data.chunks(args.n, args.chunk), -(-args.n // args.chunk))
        print(f"corpus: {corpus.path} ({time.perf_counter() - start:.0f} s to generate)")
        tuning_q = data.sample(args.tuning_queries, stream=TUNING_STREAM)
        test_q = data.sample(args.queries, stream=QUERY_STREAM)
        exact = cached_exact(exact_file, np.vstack([tuning_q, test_q]), corpus, args)
        tuning_exact, test_exact = exact[: len(tuning_q)], exact[len(tuning_q) :]
        flat_bytes = 4 * args.n * args.dim
        header = (
            f"| index (tuned params) | train s | add s | RAM MB | / flat | disk MB | batched QPS | single p50 ms "
            f"| single p99 ms | recall@{args.k} tuning (normal lower bound, selected on them) "
            f"| recall@{args.k} test [95 % bootstrap interval] |"
        )
        lines = [header, "|" + "---|" * (header.count("|") - 1)]
        for spec in args.specs:
            directory = Path(args.save or args.workdir) / re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")
            if args.save and (directory / "bench.json").exists():
                saved = json.loads((directory / "bench.json").read_text())
                cost, record = saved["cost"], saved["record"]
                print(f"{spec}: reopened from {directory} (built and tuned by an earlier run)", flush=True)
                index = reopen(directory) if args.mmap else DocumentIndex.load(directory, use_gpu=False)
            else:
                index, cost = build(spec, data, corpus, args)
                if args.mmap:
                    index.save(directory)
                    index = reopen(directory)
                if index.spec.params:  # given after the spec's ';': measured on the tuning queries, not tuned
                    recalls = query_recalls(index.search_arrays(tuning_q, args.k)[1], tuning_exact)
                    record = recall_summary(recalls, args.confidence)
                else:
                    record = tune(index, tuning_q, tuning_exact, target=args.target, confidence=args.confidence)
                if args.save:
                    (index.save_meta if args.mmap else index.save)(directory)
                    write_json(directory / "bench.json", {"cost": cost, "record": record})
            disk = index.mapped_bytes()
            ram = index.nbytes() - disk
            name = str(index.spec)
            if args.mmap:
                index.save_meta(directory)
                open_index = partial(reopen, directory)  # the tuned index's mapping holds the pages tuning read
            else:
                open_index = kept(index)
            del index
            result = measure(open_index, test_q, test_exact, args)
            del open_index
            lines.append(
                f"| {name} | {cost['train_s']:.0f} | {cost['add_s']:.0f} | {ram / 1e6:,.0f} "
                f"| 1/{flat_bytes / ram:.1f} | {disk / 1e6:,.0f} | {result['qps']:,.0f} | {result['p50_ms']:.2f} "
                f"| {result['p99_ms']:.2f} | {record['recall']:.3f} (≥{record['recall_lower']:.3f}) "
                f"| {result['recall']:.3f} [{result['test']['recall_low']:.3f}, {result['test']['recall_high']:.3f}] |"
            )
            print(lines[-1], f"(RSS growth {cost['rss_growth'] / 2**20:,.0f} MiB)", flush=True)
            if args.mmap and not args.save:
                shutil.rmtree(directory)
        print("\n" + "\n".join(lines))
        print(
            f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB; "
            f"load average at end {os.getloadavg()[0]:.1f}"
        )
    finally:
        if not args.keep:
            corpus.path.unlink(missing_ok=True)
            exact_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
