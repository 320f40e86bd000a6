"""The degraded-pages study: a retrieval metric against degradation strength, per retriever and evidence type.

OHRBench asks how OCR noise moves text RAG; this asks how page degradation moves visual retrieval, next to the
text retrievers that read the degraded pages through OCR. For each degradation (:mod:`hkrag.data.degrade`) and
strength, the evaluation corpus (the configs of ``cfg.datasets`` x ``cfg.pools``, split ``cfg.split``) is

1. degraded into ``<work_dir>/corpora/<spec>/pages`` (:func:`~hkrag.data.degrade.degrade_corpus`; strength 0
   copies the stored pages byte for byte),
2. read again by Tesseract into the ``text`` column of ``<work_dir>/corpora/<spec>/text``
   (:func:`~hkrag.data.ocr.add_page_text`, every page OCRed, one OCR cache for the whole study), so BM25 at
   strength 0 is BM25 over OCR text of clean pages, not over the drawn strings,
3. ranked by every ranker of ``rankers(work_dir)`` with :func:`~hkrag.retrieval.evaluation.evaluate_ranker`
   (fresh rankers per strength, so the dense one's embedding shards are per corpus).

Each point's result is saved in ``<work_dir>/<spec>/study_point.json`` and reused by a rerun (degraded copies and
OCR resume too). A BM25 ranker should set ``allow_empty=True``: heavily degraded pages can have no OCR text.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hkrag.data.degrade import DEGRADATIONS, Degradation, degrade_corpus
from hkrag.data.ocr import OcrSettings, add_page_text
from hkrag.data.opendocvqa import TEXT_COLUMN, pools
from hkrag.io import read_json, write_json, write_text
from hkrag.retrieval.evaluation import Ranker, RetrievalEvalConfig, evaluate_ranker

logger = logging.getLogger(__name__)

STUDY_FILE, STUDY_TABLE, POINT_FILE = "degradation.json", "degradation.md", "study_point.json"


@dataclasses.dataclass
class DegradationStudy:
    """Which degradations at which strengths; ``strengths`` is one list for all, or a list per name."""

    degradations: Sequence[str]
    strengths: Sequence[float] | Mapping[str, Sequence[float]]
    seed: int = 0
    ocr: OcrSettings = dataclasses.field(default_factory=OcrSettings)
    ocr_workers: int = 1
    metric: str = "ndcg@5"

    @classmethod
    def from_specs(cls, specs: str | Sequence[str], **settings: Any) -> DegradationStudy:
        """The study of ``specs``: ``NAME:STRENGTH`` items (``["gaussian_blur:1", "jpeg:20", "jpeg:5"]``), a name
        alone standing for its default strengths (``DEGRADATIONS[name].study``), in the order given; a bad spec
        fails naming it. ``settings``: the other fields (``seed``, ``ocr``, ...)."""
        specs = [specs] if isinstance(specs, str) else list(specs or ())
        if not specs:
            raise ValueError("a degradation study needs at least one degradation: NAME or NAME:STRENGTH "
                             f"(names: {', '.join(DEGRADATIONS)})")
        strengths: dict[str, list[float]] = {}
        for spec in map(str, specs):
            if ":" in spec:
                point = Degradation.parse(spec)
                strengths.setdefault(point.name, []).append(point.strength)
            elif spec.strip() in DEGRADATIONS:
                strengths.setdefault(spec.strip(), []).extend(DEGRADATIONS[spec.strip()].study)
            else:
                raise ValueError(f"bad degradation {spec!r}: expected NAME or NAME:STRENGTH "
                                 f"(names: {', '.join(DEGRADATIONS)})")
        return cls(list(strengths), strengths, **settings)

    def points(self) -> list[Degradation]:
        """Every (degradation, strength) to evaluate, validated before any work; mildest first (strength 0)."""
        points = []
        for name in self.degradations:
            strengths = self.strengths[name] if isinstance(self.strengths, Mapping) else self.strengths
            named = {Degradation(name, float(s), self.seed) for s in {0.0, *strengths}}
            points += sorted(named, key=lambda point: (point.severity, point.strength))
        return points


def run_study(
    study: DegradationStudy,
    rankers: Callable[[Path], Mapping[str, Ranker]],
    cfg: RetrievalEvalConfig,
    work_dir: str | Path,
) -> dict[str, Any]:
    """Evaluate every ranker on every degraded copy; writes and returns ``{"rows": [...], "table": Markdown}``.

    ``rankers(point_dir)`` builds the rankers for one degraded corpus (``{label: ranker}``); a row is
    ``{degradation, strength, retriever, dataset, pool, evidence, <metric>}`` with ``evidence`` ``all`` or a label.
    """
    work_dir = Path(work_dir)
    configs = sorted({pools(dataset)[pool] for dataset in cfg.datasets for pool in cfg.pools})
    rows = []
    for point in study.points():
        point_dir = work_dir / _key(point)
        saved = point_dir / POINT_FILE
        if not saved.is_file():
            corpus = _prepare_corpus(study, point, cfg, configs, work_dir)
            results = {label: evaluate_ranker(ranker, dataclasses.replace(cfg, corpus_source=str(corpus)),
                                              point_dir / label)["results"]
                       for label, ranker in rankers(point_dir).items()}
            write_json(saved, results)
        rows += _rows(point, read_json(saved), study.metric)
    table = study_table(rows, study.metric)
    write_json(work_dir / STUDY_FILE, rows)
    write_text(work_dir / STUDY_TABLE, table + "\n")
    return {"rows": rows, "table": table}


def _prepare_corpus(
    study: DegradationStudy, point: Degradation, cfg: RetrievalEvalConfig, configs: list[str], work_dir: Path
) -> Path:
    """The degraded copy of the evaluation pools with its pages read again into ``text``."""
    corpus_dir = work_dir / "corpora" / _key(point)
    pages = degrade_corpus(cfg.corpus_source, corpus_dir / "pages", point, configs, [cfg.split])
    add_page_text(pages, corpus_dir / "text", TEXT_COLUMN, study.ocr, text_layer=None, configs=configs,
                  splits=[cfg.split], overwrite=True, workers=study.ocr_workers, cache_dir=work_dir / "ocr-cache")
    return corpus_dir / "text"


def _key(point: Degradation) -> str:
    """A point's folder name; every strength-0 point is the one clean corpus, evaluated once."""
    return "clean" if point.is_identity else str(point).replace(":", "-")


def _rows(point: Degradation, results: Mapping[str, Any], metric: str) -> list[dict[str, Any]]:
    return [{"degradation": point.name, "strength": point.strength, "retriever": label, "dataset": dataset,
             "pool": pool, "evidence": evidence, metric: values[metric]}
            for label, by_dataset in results.items() for dataset, by_pool in by_dataset.items()
            for pool, by_evidence in by_pool.items() for evidence, values in by_evidence.items()
            if isinstance(values, Mapping)]


def study_table(rows: Sequence[Mapping[str, Any]], metric: str = "ndcg@5") -> str:
    """Markdown: per degradation and pool, one row per retriever and evidence type, one column per strength (in the
    rows' order); cells are ``metric`` x 100 averaged over the data sets."""
    blocks = []
    for name in dict.fromkeys(r["degradation"] for r in rows):
        for pool in dict.fromkeys(r["pool"] for r in rows):
            block = [r for r in rows if r["degradation"] == name and r["pool"] == pool]
            strengths = list(dict.fromkeys(r["strength"] for r in block))  # mildest first, as run
            lines = [f"{metric} (x100), {name}, {pool} pool",
                     "", "| Retriever | Evidence | " + " | ".join(f"{s:g}" for s in strengths) + " |",
                     "|---" * (len(strengths) + 2) + "|"]
            for retriever in dict.fromkeys(r["retriever"] for r in block):
                for evidence in dict.fromkeys(r["evidence"] for r in block if r["retriever"] == retriever):
                    cells = [[r[metric] for r in block if (r["retriever"], r["evidence"], r["strength"])
                              == (retriever, evidence, s)] for s in strengths]
                    shown = [f"{100 * sum(c) / len(c):.1f}" if c else "–" for c in cells]
                    lines.append(f"| {retriever} | {evidence} | " + " | ".join(shown) + " |")
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
