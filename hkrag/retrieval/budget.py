"""Storage-budget sweep: retrieval quality against index bytes per document.

Following the budget-controlled evaluation of ArXivDocQA, index size is treated as a variable:
for each index spec we build the index over the same document embeddings, measure its
serialized size (vectors or codes, inverted lists, codebooks, PCA matrices; doc-id strings
excluded since they are the same for every spec) divided by the number of documents, and
evaluate the run. Besides the :class:`~hkrag.index.spec.IndexSpec` kinds (PCA-reduced
vectors are ``faiss:PCA256,Flat`` or ``faiss:PCA256,SQ8``), ``binary`` keeps one sign bit per
dimension searched by Hamming distance, and ``binary:rerank=R`` re-scores its top ``R*k`` by the
float query against the ±1 codes (no extra bytes). The Pareto frontier (no other spec is both
smaller and better) is marked in the table and drawn on the plot.

    python -m hkrag.retrieval.budget --shards runs/corpus --queries runs/queries --qrels qrels.json \\
        --specs flat fp16 sq8 "faiss:PCA512,Flat" "faiss:PCA256,SQ8" binary binary:rerank=10 --out runs/budget

``--queries`` is a shard directory of query embeddings (``encode_corpus(..., id_key="query_id")``);
``--qrels`` is JSON ``{qid: {docid: grade}}`` or a TREC qrels file. Writes ``budget.json``,
``budget.md`` and ``budget.png`` (nDCG@5 against bytes/doc, log x axis) into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import load_shards, read_manifest
from hkrag.io import atomic_write, write_json, write_text
from hkrag.ranges import POSITIVE
from hkrag.retrieval.metrics import Qrels, check_qrels, evaluate_run, load_qrels

log = logging.getLogger(__name__)

DEFAULT_SPECS = (
    "flat",
    "fp16",
    "sq8",
    "faiss:PCA512,Flat",
    "faiss:PCA256,SQ8",
    "faiss:PCA128,SQ8",
    "ivfpq:m=64",
    "binary",
    "binary:rerank=10",
)


def fitting_defaults(dim: int, count: int, specs: Sequence[str] = DEFAULT_SPECS) -> list[str]:
    """The default specs that ``count`` documents of ``dim`` dimensions can build (the defaults are sized for
    paper-scale embeddings): PCA only to fewer dimensions than ``dim``, IVF-PQ only with ``m`` dividing ``dim`` and at
    least 2**8 documents to train its codebooks on. Specs named with ``--specs`` are never dropped."""
    def fits(spec: str) -> bool:
        pca = re.search(r"PCA(\d+)", spec)
        ivfpq = re.fullmatch(r"ivfpq:m=(\d+)", spec)
        return (not pca or int(pca.group(1)) < dim) and (not ivfpq or (dim % int(ivfpq.group(1)) == 0 and count >= 256))

    kept = [spec for spec in specs if fits(spec)]
    if len(kept) < len(specs):
        log.info("default specs skipped for %d documents of %d dimensions: %s", count, dim,
                 ", ".join(spec for spec in specs if spec not in kept))
    return kept


class SignIndex:
    """One bit per dimension (the sign), searched by Hamming distance with FAISS's binary flat index.

    With ``rerank=R`` the Hamming top ``R*k`` is re-scored by the inner product of the float query with the
    ±1 code vectors (asymmetric distance: only documents are binarised), which needs no bytes beyond the codes.
    """

    def __init__(self, ids: Sequence[str], vectors: np.ndarray, *, rerank: int = 0) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape[1] % 8:
            raise ValueError(f"binary codes need a dimension divisible by 8, got {vectors.shape[1]}")
        if rerank < 0:
            raise ValueError(f"rerank must be >= 0, got {rerank}")
        self.ids, self.rerank = [str(i) for i in ids], rerank
        self.codes = np.packbits(vectors > 0, axis=1)
        self.index = faiss.IndexBinaryFlat(vectors.shape[1])
        self.index.add(self.codes)
        self.spec = f"binary:rerank={rerank}" if rerank else "binary"

    @classmethod
    def parse(cls, spec: str) -> int | None:
        """The rerank factor of a ``binary[:rerank=R]`` spec, or None for any other spec."""
        kind, _, option = spec.strip().partition(":")
        if kind != "binary":
            return None
        key, _, value = option.partition("=")
        if option and key != "rerank":
            raise ValueError(f"bad binary option {option!r} in {spec!r}; expected binary or binary:rerank=R")
        return int(value) if option else 0

    def __len__(self) -> int:
        return len(self.ids)

    def search_arrays(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) best first: minus the Hamming distance, or the re-ranked inner product."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, len(self.ids))
        distances, rows = self.index.search(np.packbits(queries > 0, axis=1), min(k * max(self.rerank, 1), len(self)))
        if not self.rerank:
            return -distances.astype(np.float32), rows
        signs = np.unpackbits(self.codes[rows], axis=-1)[..., : queries.shape[1]].astype(np.float32) * 2 - 1
        scores = np.einsum("qd,qcd->qc", queries, signs)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)

    def to_run(self, query_ids: Sequence[str], queries: np.ndarray, k: int) -> dict[str, dict[str, float]]:
        scores, rows = self.search_arrays(queries, k)
        return {
            str(q): {self.ids[r]: float(v) for r, v in zip(row, sc, strict=True) if r >= 0}
            for q, row, sc in zip(query_ids, rows, scores, strict=True)
        }

    def nbytes(self) -> int:
        return int(faiss.serialize_index_binary(self.index).nbytes)


def build_index(doc_ids: Sequence[str], doc_vectors: np.ndarray, spec: str, *, use_gpu: bool | None = None):
    """A :class:`SignIndex` for ``binary`` specs, else a :class:`DocumentIndex`."""
    rerank = SignIndex.parse(spec)
    if rerank is not None:
        return SignIndex(doc_ids, doc_vectors, rerank=rerank)
    return DocumentIndex.build(doc_ids, doc_vectors, spec, use_gpu=use_gpu)


def pareto_frontier(rows: Sequence[dict], metric: str = "ndcg@5") -> list[bool]:
    """For each row, whether it is on the frontier: no other row has fewer-or-equal bytes and a higher metric
    (or equal metric with fewer bytes)."""
    return [
        not any(
            o["bytes_per_doc"] <= r["bytes_per_doc"]
            and o[metric] >= r[metric]
            and (o["bytes_per_doc"] < r["bytes_per_doc"] or o[metric] > r[metric])
            for o in rows
        )
        for r in rows
    ]


def sweep(
    doc_vectors: np.ndarray,
    doc_ids: Sequence[str],
    query_vectors: np.ndarray,
    query_ids: Sequence[str],
    qrels: Qrels,
    specs: Sequence[str] = DEFAULT_SPECS,
    *,
    k: int = 10,
    use_gpu: bool | None = None,
) -> list[dict]:
    """One row per spec: ``spec``, ``bytes_per_doc``, ``index_bytes``, ``build_s``, the mean metrics and
    ``pareto`` (on the nDCG@5 / bytes frontier)."""
    check_qrels(qrels, doc_ids)
    rows = []
    for spec in specs:
        start = time.perf_counter()
        index = build_index(doc_ids, doc_vectors, spec, use_gpu=use_gpu)
        build_s = time.perf_counter() - start
        metrics = evaluate_run(index.to_run(query_ids, query_vectors, k), qrels)["mean"]
        size = index.nbytes()
        rows.append(
            {"spec": str(index.spec), "index_bytes": size, "bytes_per_doc": size / len(index), "build_s": build_s}
            | metrics
        )
        log.info("%s: %.1f bytes/doc, nDCG@5 %.4f", index.spec, size / len(index), metrics["ndcg@5"])
    for row, on_frontier in zip(rows, pareto_frontier(rows), strict=True):
        row["pareto"] = on_frontier
    return rows


def plot(rows: Sequence[dict], path: str | Path, *, metric: str = "ndcg@5", title: str | None = None) -> Path:
    """Scatter ``metric`` against bytes per document (log x), each point labelled by its spec, with the
    Pareto frontier drawn as a line through its points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["bytes_per_doc"] for r in rows]
    y = [r[metric] for r in rows]
    ax.plot(x, y, "o", label="index")
    frontier = sorted((r["bytes_per_doc"], r[metric]) for r, on in zip(rows, pareto_frontier(rows, metric)) if on)
    ax.plot(*zip(*frontier), "-", color="tab:red", label="Pareto frontier")
    ax.legend(fontsize=7)
    for r in rows:
        ax.annotate(r["spec"], (r["bytes_per_doc"], r[metric]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("index bytes per document (log)")
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} vs storage budget")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=120), "wb")
    plt.close(fig)
    return path


def to_markdown(rows: Sequence[dict]) -> str:
    """The sweep as a Markdown table, metrics × 100."""
    metrics = [key for key in rows[0] if "@" in key]
    frontier = pareto_frontier(rows)
    lines = [
        "| index | bytes/doc | build s | " + " | ".join(metrics) + " | Pareto |",
        "|---" * (4 + len(metrics)) + "|",
    ]
    for r, on in zip(rows, frontier, strict=True):
        values = " | ".join(f"{100 * r[m]:.1f}" for m in metrics)
        mark = "yes" if on else ""
        lines.append(f"| {r['spec']} | {r['bytes_per_doc']:,.1f} | {r['build_s']:.2f} | {values} | {mark} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="shard directory of document embeddings")
    parser.add_argument("--queries", required=True, help="shard directory of query embeddings")
    parser.add_argument("--qrels", required=True, help="qrels JSON or TREC file")
    parser.add_argument("--specs", nargs="+", help="index specs (default: those of DEFAULT_SPECS that fit the "
                        "embeddings: PCA below their dimension, IVF-PQ from 256 documents)")
    parser.add_argument("--k", type=POSITIVE.arg, default=10)
    parser.add_argument("--out", default="budget", help="output directory")
    parser.add_argument("--cpu", action="store_true", help="never use a GPU")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    doc_ids, doc_vectors = load_shards(args.shards)
    model = read_manifest(args.shards)["model"]
    query_ids, query_vectors = load_shards(args.queries, expect={"dim": doc_vectors.shape[1], "model": model})
    rows = sweep(
        doc_vectors,
        doc_ids,
        query_vectors,
        query_ids,
        load_qrels(args.qrels),
        args.specs or fitting_defaults(doc_vectors.shape[1], len(doc_ids)),
        k=args.k,
        use_gpu=False if args.cpu else None,
    )
    out = Path(args.out)
    write_json(out / "budget.json", rows)
    write_text(out / "budget.md", to_markdown(rows) + "\n")
    plot(rows, out / "budget.png")
    print(to_markdown(rows))
    print(f"wrote {out / 'budget.png'}")


if __name__ == "__main__":
    main()
