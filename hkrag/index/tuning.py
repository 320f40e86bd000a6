"""Search-parameter tuning: the cheapest FAISS parameters meeting a recall target on held-out queries.

Recall@k here is agreement with exact search (``|top-k ∩ exact top-k| / k``), not relevance: it says how much
of the flat index's ranking a compressed index keeps. Exact neighbours are computed chunk by chunk over the
corpus, so a 1M x 3072 corpus never has to sit in memory next to its index. The parameter search is FAISS's
parameter space: ``ParameterSpace.initialize`` lists the index's parameters (``nprobe``, ``efSearch``,
``k_factor_rf`` of a refine stage, ...), every combination is timed on the tuning queries and collected as
FAISS ``OperatingPoints`` (Pareto front of time and recall); we take the fastest one whose one-sided normal lower
bound of the mean recall over the tuning queries (95 %, ``--confidence``) reaches the target, and store it with the
index (``index.json``: spec parameters plus a ``tuning`` record), so ``DocumentIndex.load`` and
``eval.index=tuned:<dir>`` search with it. That bound is computed on the queries the point was selected on, at the
selected point: a selection rule, optimistic as a guarantee. What a tuned index delivers is its recall on held-out
test queries, with its interval (``--test-queries``, also with ``--select``: :func:`held_out_recall`).

    python -m hkrag.index.tuning --index runs/index --shards runs/corpus --queries runs/tuning-queries \\
        --spec "faiss:PCA384,IVF2048,PQ96x4fs,Refine(PCA384,SQ8)" --target 0.95 --k 5

``--select auto`` (or ``--select FACTORY ...``) builds and tunes each candidate of the search space (inverted
lists and graph indexes, :func:`hkrag.index.spec.search_space`) and keeps the cheapest meeting the target
(:func:`select`). Without ``--spec`` the index already saved in ``--index`` is tuned and only its ``index.json``
is rewritten; ``--mmap`` then opens it with its stored vectors mapped from disk (an index larger than memory,
re-ranked from disk).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import NormalDist

import faiss
import numpy as np
from faiss.contrib.exhaustive_search import knn_ground_truth
from tqdm import tqdm

from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import load_shards, read_manifest
from hkrag.index.spec import META_FILE, search_space
from hkrag.ranges import CONFIDENCE, POSITIVE, POSITIVE_NUMBER, PROBABILITY
from hkrag.stats import bootstrap_interval

log = logging.getLogger(__name__)


def exact_neighbours(queries: np.ndarray, chunks: Iterable[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-``k`` over a corpus given as consecutive chunks: (scores, row numbers)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    chunks = (np.ascontiguousarray(c, dtype=np.float32) for c in chunks)
    return knn_ground_truth(queries, chunks, k, metric_type=faiss.METRIC_INNER_PRODUCT)


def query_recalls(rows: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Per query, the fraction of its exact top-k found in its top-k (``-1`` slots never match)."""
    k = exact.shape[1]
    return np.array([len(set(r[:k][r[:k] >= 0].tolist()) & set(e.tolist())) / k for r, e in zip(rows, exact)])


def recall_at_k(rows: np.ndarray, exact: np.ndarray) -> float:
    """Mean over queries of :func:`query_recalls`."""
    return float(query_recalls(rows, exact).mean())


def recall_lower_bound(recalls: np.ndarray, confidence: float) -> float:
    """One-sided normal lower bound of the mean of ``recalls`` (the mean itself at ``confidence`` 0.5).

    Tuning asks it, on the tuning queries, to reach the target: a point chosen because its sample recall just
    reaches the target often misses it on other queries (at 100k pages, 0.968 on 300 tuning queries gave 0.932
    on 500 test queries). It is a bound at one fixed point; over the grid's best point, picked on the same
    queries, it is optimistic (selection), so it is a margin, not a guarantee: :func:`held_out_recall` is.
    """
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    spread = recalls.std(ddof=1) / np.sqrt(len(recalls)) if len(recalls) > 1 else 0.0
    return float(recalls.mean() - NormalDist().inv_cdf(confidence) * spread)


def recall_summary(recalls: np.ndarray, confidence: float) -> dict[str, float]:
    """Mean recall over the tuning queries and its :func:`recall_lower_bound` at ``confidence`` (``recall_lower``:
    the tuning queries' normal lower bound, optimistic at a point selected on them)."""
    return {"recall": float(recalls.mean()), "recall_lower": recall_lower_bound(recalls, confidence)}


def held_out_recall(recalls: np.ndarray, confidence: float = 0.95) -> dict[str, float]:
    """Mean recall over held-out test queries (never used to tune) and its two-sided percentile bootstrap interval
    at ``confidence`` (:func:`hkrag.stats.bootstrap_interval`, queries resampled): what the tuned index delivers."""
    low, high = bootstrap_interval(recalls, confidence)
    return {"recall": float(np.mean(recalls)), "recall_low": low, "recall_high": high, "queries": len(recalls)}


def format_held_out(record: dict[str, float], confidence: float = 0.95) -> str:
    """``0.964 [0.955, 0.972]`` (95 % interval, n test queries)."""
    return (f"{record['recall']:.3f} [{record['recall_low']:.3f}, {record['recall_high']:.3f}] "
            f"({100 * confidence:g} % bootstrap interval, {record['queries']} test queries)")


def _timed_search(index: faiss.Index, queries: np.ndarray, k: int, repeats: int) -> tuple[float, int, np.ndarray]:
    """Fastest of ``repeats`` batched searches (the least disturbed run on a shared machine), the distances one
    search computed (FAISS's IVF and HNSW counters: codes scanned in inverted lists, graph nodes and coarse
    centroids visited) and its rows."""
    best = float("inf")
    for _ in range(repeats):
        faiss.cvar.indexIVF_stats.reset()
        faiss.cvar.hnsw_stats.reset()
        start = time.perf_counter()
        _, rows = index.search(queries, k)
        best = min(best, time.perf_counter() - start)
    return best, faiss.cvar.indexIVF_stats.ndis + faiss.cvar.hnsw_stats.ndis, rows


COSTS = ("ms_per_query", "distances_per_query")


def tune(
    index: DocumentIndex,
    queries: np.ndarray,
    exact: np.ndarray,
    *,
    target: float = 0.95,
    confidence: float = 0.95,
    repeats: int = 3,
    cost: str = "ms_per_query",
) -> dict:
    """Set the fastest parameters of ``index`` whose recall@k (k = ``exact.shape[1]``) on ``queries`` reaches
    ``target`` with the given ``confidence`` (:func:`recall_lower_bound`); return the tuning record also stored
    in ``index.tuning``.

    Every combination of the ranges ``faiss.ParameterSpace.initialize`` gives the index (powers of two for
    ``nprobe``, ``k_factor_rf``, ``efSearch``...) is measured: recall is not monotone in them with 4-bit PQ
    (more probed lists bring more candidates that can push true neighbours out of the refine list), so the
    autotuner's pruning could skip the cheapest good point. Time is the fastest of ``repeats`` batched searches
    where the recall bound meets the target (one search elsewhere: those never compete on time, and at 1M pages
    the slow, high-recall end of the grid dominates a tuning's wall time);
    ``cost`` (:data:`COSTS`) is what "cheapest" means: batched time or distances computed per query.
    When no combination reaches the target, the most accurate is set and the record says ``met: False``.
    """
    if index.spec.kind != "faiss":
        raise ValueError(f"only faiss: specs have tunable search parameters, not {index.spec}")
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    k = exact.shape[1]
    space = faiss.GpuParameterSpace() if index.on_gpu else faiss.ParameterSpace()
    space.initialize(index.faiss_index)
    if space.n_combinations() <= 1:
        raise ValueError(f"{index.spec.factory} has no search parameters to tune")
    points = faiss.OperatingPoints()
    measured = []
    for combination in tqdm(range(space.n_combinations()), desc="tuning", leave=False):
        key = space.combination_name(combination)
        space.set_index_parameters(index.faiss_index, key)
        seconds, distances, rows = _timed_search(index.faiss_index, queries, k, 1)
        recalls = query_recalls(rows, exact)
        if repeats > 1 and recall_lower_bound(recalls, confidence) >= target:  # only these compete on time
            seconds = min(seconds, _timed_search(index.faiss_index, queries, k, repeats - 1)[0])
        points.add(float(recalls.mean()), seconds, key)
        per_query = {"ms_per_query": 1000 * seconds / len(queries), "distances_per_query": distances / len(queries)}
        measured.append({"params": key, **recall_summary(recalls, confidence), **per_query})
    meeting = [m for m in measured if m["recall_lower"] >= target]
    best = min(meeting, key=lambda m: m[cost]) if meeting else max(measured, key=lambda m: m["recall"])
    index.search_params = best["params"]
    optimal = {points.optimal_pts.at(i).key for i in range(points.optimal_pts.size())}
    index.tuning = {
        **best,
        "target": target,
        "confidence": confidence,
        "k": k,
        "met": bool(meeting),
        "queries": len(queries),
        "measured": [m | {"pareto": m["params"] in optimal} for m in measured],
    }
    log.info(
        "%s: %s gives recall@%d %.4f on the %d tuning queries (one-sided normal lower bound %.4f at %.2f on those "
        "same queries, which selected it: optimistic; target %.2f)",
        index.spec.factory,
        best["params"],
        k,
        best["recall"],
        len(queries),
        best["recall_lower"],
        confidence,
        target,
    )
    if not meeting:
        log.warning("no parameters of %s reach recall@%d %.2f; using the most accurate", index.spec.factory, k, target)
    return index.tuning


def select(
    ids: Sequence[str],
    docs: np.ndarray,
    queries: np.ndarray,
    exact: np.ndarray,
    specs: Sequence[str],
    *,
    target: float = 0.95,
    confidence: float = 0.95,
    max_ram: float | None = None,
    cost: str = "ms_per_query",
    repeats: int = 3,
    use_gpu: bool | None = False,
) -> tuple[DocumentIndex, list[dict]]:
    """Build and :func:`tune` every factory string of ``specs`` (e.g. :func:`hkrag.index.spec.search_space`:
    IVF and graph indexes) and keep the cheapest whose tuned recall bound reaches ``target`` and whose memory
    is at most ``max_ram`` of a flat float32 index; return it and one record per spec.

    ``cost`` is the tuned point's ``ms_per_query`` (batched wall time: what a deployment pays) or
    ``distances_per_query`` (codes compared, counted by FAISS: machine-independent, so a choice a shared or
    noisy machine cannot flip). IVF scans ``nprobe`` whole lists, a graph walks ``efSearch`` neighbourhoods: on
    weakly clustered data IVF needs many lists per query and a graph wins (bench/RESULTS.md).
    """
    if not specs:
        raise ValueError("select needs at least one spec")
    flat_bytes = 4 * docs.shape[0] * docs.shape[1]
    records, best, best_index = [], None, None
    for spec in specs:
        index = DocumentIndex.build(ids, docs, f"faiss:{spec}", use_gpu=use_gpu)
        tuned = tune(index, queries, exact, target=target, confidence=confidence, repeats=repeats, cost=cost)
        record = {"spec": spec, "ram_fraction": index.nbytes() / flat_bytes,
                  **{key: tuned[key] for key in ("params", "recall", "recall_lower", "met", *COSTS)}}
        record["eligible"] = record["met"] and (max_ram is None or record["ram_fraction"] <= max_ram)
        records.append(record)
        if record["eligible"] and (best is None or record[cost] < best[cost]):
            best, best_index = record, index
        del index
    if best is None:
        raise ValueError(
            f"no spec reaches recall@{exact.shape[1]} {target} (confidence {confidence})"
            + (f" within {max_ram} of flat's memory" if max_ram is not None else "")
            + ": " + "; ".join(f"{r['spec']}: recall {r['recall']:.3f}, RAM {r['ram_fraction']:.2f}" for r in records)
        )
    log.info("selected %s (%s %.4g) among %d specs", best["spec"], cost, best[cost], len(specs))
    return best_index, records


def _chunks(vectors: np.ndarray, size: int) -> Iterable[np.ndarray]:
    return (vectors[i : i + size] for i in range(0, len(vectors), size))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="index directory (written when --spec is given)")
    parser.add_argument("--shards", required=True, help="shard directory of the indexed document embeddings")
    parser.add_argument("--queries", required=True, help="shard directory of held-out tuning query embeddings")
    parser.add_argument("--spec", help="build this index over --shards first (e.g. faiss:...)")
    parser.add_argument(
        "--select",
        nargs="+",
        metavar="FACTORY",
        help="build and tune each factory string, keep the cheapest meeting the target (select); 'auto': "
        "spec.search_space (IVF, HNSW32, IVF_HNSW32 over SQ8) for the corpus size",
    )
    parser.add_argument("--max-ram", type=POSITIVE_NUMBER.arg,
                        help="with --select: largest index memory, a fraction of flat")
    parser.add_argument("--cost", choices=COSTS, default="ms_per_query", help="what --select minimises")
    parser.add_argument("--target", type=PROBABILITY.arg, default=0.95, help="recall@k against exact search to reach")
    parser.add_argument(
        "--confidence",
        type=CONFIDENCE.arg,
        default=0.95,
        help="the target must hold for the tuning queries' one-sided normal lower bound of recall at this level "
        "(0.5: the mean); a selection rule, optimistic after selection: --test-queries measures the tuned index",
    )
    parser.add_argument("--test-queries", help="shard directory of held-out test query embeddings (never tuned on): "
                        "the tuned (or --select'ed) index's recall on them with its 95 %% interval")
    parser.add_argument("--k", type=POSITIVE.arg, default=5)
    parser.add_argument("--chunk", type=POSITIVE.arg, default=65536, help="documents per exact-search chunk")
    parser.add_argument("--cpu", action="store_true", help="never use a GPU")
    parser.add_argument(
        "--mmap", action="store_true", help="open the saved index with its stored vectors mapped from disk"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    doc_ids, docs = load_shards(args.shards)
    _, queries = load_shards(args.queries, expect={"dim": docs.shape[1], "model": read_manifest(args.shards)["model"]})
    use_gpu = False if args.cpu else None
    if args.select:
        specs = search_space(*docs.shape) if args.select == ["auto"] else args.select
        _, exact = exact_neighbours(queries, _chunks(docs, args.chunk), args.k)
        index, records = select(doc_ids, docs, queries, exact, specs, target=args.target, confidence=args.confidence,
                                max_ram=args.max_ram, cost=args.cost, use_gpu=use_gpu)
        for record in records:
            log.info("%s", record)
        index.save(args.index)
        print(f"selected {index.spec} among {len(specs)}; written to {Path(args.index) / META_FILE}")
        _print_test_recall(index, docs, args)
        return
    if args.spec:
        start = time.perf_counter()
        index = DocumentIndex.build(doc_ids, docs, args.spec, use_gpu=use_gpu)
        log.info("built %s over %d documents in %.1f s", index.spec, len(index), time.perf_counter() - start)
    else:
        index = DocumentIndex.load(args.index, use_gpu=False if args.mmap else use_gpu, mmap=args.mmap)
        if index.ids != doc_ids:
            raise ValueError(f"{args.index} does not index the documents of {args.shards} (ids differ)")
    _, exact = exact_neighbours(queries, _chunks(docs, args.chunk), args.k)
    record = tune(index, queries, exact, target=args.target, confidence=args.confidence)
    if args.spec:
        index.save(args.index)
    else:
        index.save_meta(args.index)
    print(
        f"{index.spec}: recall@{args.k} {record['recall']:.4f} on the tuning queries (target {args.target} for their "
        f"normal lower bound {record['recall_lower']:.4f}, met {record['met']}; optimistic, the parameters were "
        f"selected on them), {record['ms_per_query']:.3f} ms/query batched; written to "
        f"{Path(args.index) / META_FILE}"
    )
    _print_test_recall(index, docs, args)


def _print_test_recall(index: DocumentIndex, docs: np.ndarray, args: argparse.Namespace) -> None:
    """Print the tuned (or selected) index's recall on --test-queries with its interval, when they are given."""
    if not args.test_queries:
        return
    expect = {"dim": docs.shape[1], "model": read_manifest(args.shards)["model"]}
    _, test = load_shards(args.test_queries, expect=expect)
    _, test_exact = exact_neighbours(test, _chunks(docs, args.chunk), args.k)
    recalls = query_recalls(index.search_arrays(test, args.k)[1], test_exact)
    print(f"held-out test recall@{args.k}: {format_held_out(held_out_recall(recalls))}")


if __name__ == "__main__":
    main()
