"""The generator's training examples: each training query with its answers and top-k pages (docs/training.md).

VDocGenerator (DESIGN §11) is trained on the top-3 pages a retriever returns for each OpenDocVQA training
query; :mod:`hkrag.retrieval.generator_pairs` ranks them, this module holds the records and their file:
one JSON object per line, a first line with the settings that produced it (so a rerun with the same
settings reuses the file and other settings are refused), written atomically.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hkrag.io import read_jsonl, write_text

from .opendocvqa import QAExample

logger = logging.getLogger(__name__)
PAGE_SOURCES = ("retrieved", "gold", "sampled")


@dataclass(frozen=True)
class GeneratorPair:
    """One training query: the question the generator sees, its gold answers, its pages in rank order."""

    query_id: str
    question: str
    answers: tuple[str, ...]
    doc_ids: tuple[str, ...]


def gold_pairs(qa: Sequence[QAExample], top_k: int, question: Callable[[QAExample], str]) -> list[GeneratorPair]:
    """Pairs on each query's first ``top_k`` relevant pages (``pages=gold``: ablation and smoke runs); queries with
    fewer relevant pages train on those they have, counted in one warning (:func:`warn_few_pages`)."""
    pairs = [pair_of(ex, ex.relevant_doc_ids[:top_k], question) for ex in qa]
    warn_few_pages({pair.query_id: len(pair.doc_ids) for pair in pairs}, top_k, "generator.top_k",
                   "trained on the relevant pages they have (pages=gold)")
    return pairs


def sampled_pairs(ranked: Sequence[GeneratorPair], top_k: int, draws: int, seed: int) -> list[GeneratorPair]:
    """``draws`` page sets a query, each ``top_k`` of its ranked pages drawn without replacement in random order
    (``pages=sampled``): more distinct page sets than the one ranked top-k gives (a dedicated Pruner stage's
    examples, docs/rerank/README.md). The draws are distinct; a query whose pages allow no more than ``draws``
    ordered sets gets every one of them (in a seeded order), a query without pages none. A query's draws depend
    only on ``seed`` and its id."""
    if top_k < 1 or draws < 1:
        raise ValueError(f"sampled page sets need top_k >= 1 and draws >= 1, got top_k={top_k}, draws={draws}")
    pairs = []
    for pair in [pair for pair in ranked if pair.doc_ids]:
        rng, size = random.Random(f"{seed}/{pair.query_id}"), min(top_k, len(pair.doc_ids))
        if math.perm(len(pair.doc_ids), size) <= draws:
            drawn = list(itertools.permutations(pair.doc_ids, size))
            rng.shuffle(drawn)
        else:
            found: dict[tuple[str, ...], None] = {}
            while len(found) < draws:
                found[tuple(rng.sample(pair.doc_ids, size))] = None
            drawn = list(found)
        pairs += [GeneratorPair(pair.query_id, pair.question, pair.answers, doc_ids) for doc_ids in drawn]
    return pairs


def warn_few_pages(counts: Mapping[str, int], wanted: int, setting: str, consequence: str) -> int:
    """One warning when some queries have fewer than ``wanted`` pages (``counts``: query id -> pages), naming the
    ``setting`` that asked for them, how many queries, the fewest and what happens to them; returns that number."""
    short = {query_id: n for query_id, n in counts.items() if n < wanted}
    if short:
        fewest = min(short, key=short.__getitem__)
        logger.warning("%d of %d queries have fewer than %s=%d pages (query %s has %d): %s", len(short), len(counts),
                       setting, wanted, fewest, short[fewest], consequence)
    return len(short)


def pair_of(example: QAExample, doc_ids: Sequence[str], question: Callable[[QAExample], str]) -> GeneratorPair:
    if not example.answers:
        raise ValueError(f"training query {example.query_id!r} has no answer: the generator's target is answers[0]")
    return GeneratorPair(example.query_id, question(example), tuple(example.answers), tuple(doc_ids))


def write_pairs(path: str | Path, pairs: Sequence[GeneratorPair], settings: Mapping[str, Any]) -> Path:
    """``settings`` as the first line, then one pair per line; replaced whole (:func:`hkrag.io.write_text`)."""
    lines = [json.dumps({"settings": dict(settings)}, sort_keys=True)]
    lines += [json.dumps(asdict(pair), ensure_ascii=False) for pair in pairs]
    return write_text(path, "\n".join(lines) + "\n")


def read_pairs(path: str | Path, settings: Mapping[str, Any] | None = None) -> list[GeneratorPair]:
    """The pairs of a :func:`write_pairs` file; with ``settings``, a file made with others is an error naming them."""
    lines = read_jsonl(path)
    if not lines or "settings" not in lines[0]:
        raise ValueError(f"{path} is not a generator pairs file (its first line must hold the settings)")
    saved = lines[0]["settings"]
    if settings is not None and saved != json.loads(json.dumps(dict(settings))):
        differ = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
        raise ValueError(f"{path} was built with other settings ({differ}); delete it or choose another path")
    rows = lines[1:]
    return [GeneratorPair(r["query_id"], r["question"], tuple(r["answers"]), tuple(r["doc_ids"])) for r in rows]
