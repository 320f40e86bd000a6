"""``python -m hkrag.tasks.reader_on_pruner_calls``: the reader's own scores as classifiers of the Pruner's labels.

The Pruner's first question on the reader's top 3 (n = 1) is whether the reader's first page is relevant. Before a
generator is trained to answer it, the reader's scores over the corpus may already tell: its first page's cosine,
that page's margin over the second and its z-score among all the query's scores. Each is scored on the same calls
as the Pruner's P(yes) is (AUROC, percentile bootstrap over questions), beside P(yes) (docs/rerank/README.md,
"The reader's own scores on the Pruner's calls"). The calls are an ``agent_steps`` file of a generator-training
run (``<mode>-retrieved-pruner_calls.jsonl.gz``, validation or training split); the reader and its corpus
embeddings are the run's (``generator_training.retriever``, ``embeddings-train``: the shards are reused).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from hkrag.cli import existing, usage_errors
from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.io import read_jsonl, write_json, write_jsonl_gz, write_text
from hkrag.rag.step_report import auroc_interval
from hkrag.retrieval.generator_pairs import encode_training
from hkrag.tasks.common import RUN_CONFIG, TRAIN_RUN
from hkrag.tasks.generator_training import training_retriever

logger = logging.getLogger(__name__)
STATISTICS = ("cosine", "margin", "z")
ROWS_FILE, SUMMARY_FILE = "reader_calls.jsonl.gz", "reader_calls.json"


def reader_statistics(scores: np.ndarray) -> dict[str, float]:
    """One query's scores over the corpus (any order): the first page's ``cosine``, its ``margin`` over the second
    and its ``z``-score among all of them."""
    if scores.size < 2 or not np.isfinite(scores).all():
        raise ValueError(f"the reader's statistics need two or more finite scores, got {scores.tolist()[:5]}")
    ranked = np.sort(scores)[::-1]
    spread = float(ranked.std())
    return {"cosine": float(ranked[0]), "margin": float(ranked[0] - ranked[1]),
            "z": float((ranked[0] - ranked.mean()) / spread) if spread else 0.0}


def reader_rows(calls: Sequence[Mapping[str, Any]], scores: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """The n = 1 calls, each with its label, P(yes) and the reader's statistics of its query (``scores``: query id
    -> the reader's scores over the corpus)."""
    first = [call for call in calls if call["n"] == 1]
    if missing := sorted({call["query_id"] for call in first} - set(scores)):
        raise ValueError(f"no reader scores for {len(missing)} queries of the calls, e.g. {missing[0]!r}: are the "
                         "calls agent_steps' on this run's questions?")
    return [{"query_id": call["query_id"], "evidence": call.get("evidence", ""), "label": bool(call["label"]),
             "p_yes": call["p_yes"], **reader_statistics(scores[call["query_id"]])} for call in first]


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each statistic's AUROC (and P(yes)'s) over ``rows`` with its interval over questions."""
    labels, questions = [row["label"] for row in rows], [row["query_id"] for row in rows]
    return {name: auroc_interval([row[name] for row in rows], labels, questions) for name in (*STATISTICS, "p_yes")}


def markdown(summary: Mapping[str, Any], calls: Path) -> str:
    lines = [f"# The reader's scores on the Pruner's n = 1 calls ({calls})", "",
             "| classifier of the label | AUROC [95 %, questions] | calls (yes labels) |", "|---|---|---|"]
    for name, cell in summary.items():
        value = "—" if cell["auroc"] is None else f"{cell['auroc']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"
        lines.append(f"| {name} | {value} | {cell['n']} ({cell['positives']}) |")
    return "\n".join(lines) + "\n"


def query_scores(run: Path, query_ids: set[str]) -> dict[str, np.ndarray]:
    """The run's reader's cosine scores of each query over the training corpus (corpus shards reused)."""
    cfg = OmegaConf.load(run / RUN_CONFIG)
    retriever, identity = training_retriever(cfg.generator_training.retriever)
    corpus = load_corpus(cfg.data.corpus_source, cfg.data.train.corpus_config, cfg.data.train.split)
    queries = [ex for ex in load_qa(cfg.data.qa_source, cfg.data.train.qa_config, "train") if ex.query_id in query_ids]
    _, vectors, encoded = encode_training(retriever, queries, corpus, run, identity)
    return {ex.query_id: vectors @ row for ex, row in zip(queries, encoded)}


def evaluate(run: Path, calls_path: Path, out: Path) -> dict[str, Any]:
    """Rows and summary of the reader's statistics on ``calls_path``'s n = 1 calls, written to ``out``."""
    calls = read_jsonl(calls_path, keys=("query_id", "n", "label", "p_yes"))
    rows = reader_rows(calls, query_scores(run, {call["query_id"] for call in calls}))
    summary = summarise(rows)
    write_jsonl_gz(out / ROWS_FILE, rows)
    write_json(out / SUMMARY_FILE, {"run": str(run), "calls": str(calls_path), "summary": summary})
    write_text(out / "reader_calls.md", markdown(summary, calls_path))
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=TRAIN_RUN, help="the generator-training run whose agent_steps wrote the calls")
    parser.add_argument("--calls", type=existing(), required=True,
                        help="an agent_steps <mode>-retrieved-pruner_calls file")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with usage_errors(parser):
        evaluate(args.run, args.calls, args.out)
    print((args.out / "reader_calls.md").read_text())


if __name__ == "__main__":
    main()
