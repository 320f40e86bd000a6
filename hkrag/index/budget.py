"""Storage-budget sweep: retrieval quality against index bytes per document.

Following the budget-controlled evaluation of ArXivDocQA, index size is treated as a variable:
for each index spec we build the index over the same document embeddings, measure its
serialized size (vectors or codes, inverted lists, codebooks; doc-id strings excluded since
they are the same for every spec) divided by the number of documents, and evaluate the run.

    python -m hkrag.index.budget --shards runs/corpus --queries runs/queries --qrels qrels.json \\
        --specs flat fp16 sq8 ivfpq:m=64 ivfpq:m=16 --out runs/budget

``--queries`` is a shard directory of query embeddings (``encode_corpus(..., id_key="query_id")``);
``--qrels`` is JSON ``{qid: {docid: grade}}`` or a TREC qrels file. Writes ``budget.json``,
``budget.md`` and ``budget.png`` (nDCG@5 against bytes/doc, log x axis) into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import load_shards, read_manifest
from hkrag.io import atomic_write, write_json, write_text
from hkrag.metrics import Qrels, check_qrels, evaluate_run, load_qrels

log = logging.getLogger(__name__)

DEFAULT_SPECS = ("flat", "fp16", "sq8", "ivfpq:m=64", "ivfpq:m=16")


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
    """One row per spec: ``spec``, ``bytes_per_doc``, ``index_bytes``, ``build_s``, and the mean metrics."""
    check_qrels(qrels, doc_ids)
    rows = []
    for spec in specs:
        start = time.perf_counter()
        index = DocumentIndex.build(doc_ids, doc_vectors, spec, use_gpu=use_gpu)
        build_s = time.perf_counter() - start
        metrics = evaluate_run(index.to_run(query_ids, query_vectors, k), qrels)["mean"]
        size = index.nbytes()
        rows.append(
            {"spec": str(index.spec), "index_bytes": size, "bytes_per_doc": size / len(index), "build_s": build_s}
            | metrics
        )
        log.info("%s: %.1f bytes/doc, nDCG@5 %.4f", index.spec, size / len(index), metrics["ndcg@5"])
    return rows


def plot(rows: Sequence[dict], path: str | Path, *, metric: str = "ndcg@5", title: str | None = None) -> Path:
    """Scatter ``metric`` against bytes per document (log x) with each point labelled by its spec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["bytes_per_doc"] for r in rows]
    y = [r[metric] for r in rows]
    ax.plot(x, y, "o")
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
    lines = [
        "| index | bytes/doc | build s | " + " | ".join(metrics) + " |",
        "|---" * (3 + len(metrics)) + "|",
    ]
    for r in rows:
        values = " | ".join(f"{100 * r[m]:.1f}" for m in metrics)
        lines.append(f"| {r['spec']} | {r['bytes_per_doc']:,.1f} | {r['build_s']:.2f} | {values} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="shard directory of document embeddings")
    parser.add_argument("--queries", required=True, help="shard directory of query embeddings")
    parser.add_argument("--qrels", required=True, help="qrels JSON or TREC file")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS))
    parser.add_argument("--k", type=int, default=10)
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
        args.specs,
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
