"""Text grounding on the built-in corpus: the OCR settings chosen on training pages, then the test split read once.

    python bench/grounding.py --data data/synthetic --out docs/grounding

Stage 1 (validation): the gold answer of a sample of *training* questions located on its gold page by the text
source (Tesseract's word boxes, :class:`hkrag.rag.grounding.TextSource`) for every Tesseract page segmentation mode
x upscale x similarity threshold of the grid; the setting with the highest mean pixel F1 is chosen (ties: the
cheaper, smaller upscale). Stage 2 (test): the same with the chosen setting on every test question's gold page,
clean and under the degradations ``hkrag.data.degrade`` makes (JPEG 20, Gaussian blur 1.5): mean F1, precision,
recall and IoU >= 0.5 hits with 95 % intervals (bootstrap over questions; Wilson for hits), by data set, evidence
type and asked field (fine-print codes apart). The answer located is the gold answer (the localisation step alone);
generated answers are grounded by ``eval.py`` runs (``rag.grounding``), summarised with ``--runs NAME=RUN_DIR``.
Writes ``validation.json``, ``test.json``, ``test_queries.jsonl`` (one row a question and condition) and
``grounding.md``.

``--choose-threshold`` (with ``--chosen`` and ``--reuse-test``: no stage run again) chooses the text source's
threshold on *generated* answers instead (docs/grounding.md, "registered before the run"): HKRAG's agents on
``--lvlm`` answer the shipped generator's validation questions on their gold pages as ``eval.py task=generation``
does (a resumable trace under ``--work``), grounded at the run's threshold; each of :data:`CANDIDATES` is derived
from those records (:func:`hkrag.rag.grounding.at_threshold`) and scored by the balanced accuracy of "grounded ⇔
right"; the committed test rows (``runs/gold_agents.jsonl``, ``runs/top3_all_agents.jsonl``, and the gold answers'
``test_queries.jsonl`` when the default changes) are then read once at the chosen threshold. Writes
``threshold.json``, ``runs/validation_gold_agents.jsonl`` and ``runs/*_t<threshold>.jsonl``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from hkrag.data.degrade import Degradation
from hkrag.data.ocr import OcrSettings, check_tesseract, ocr_words
from hkrag.data.opendocvqa import load_corpus, load_qa, pools
from hkrag.data.splits import ValidationSplit
from hkrag.data.synthetic import FINE_PRINT_SPLIT, STYLES, question_kind
from hkrag.environment import environment
from hkrag.io import read_json, write_json, write_text
from hkrag.rag.evidence import Grounder, GroundingConfig
from hkrag.rag.gold_evidence import load_gold
from hkrag.rag.grounding import Evidence, GroundingPage, TextSource, Word, at_threshold, grounding_score
from hkrag.rag.records import QueryOutcome
from hkrag.rag.trace import MERGED_FILE, TraceWriter, load_trace, merge
from hkrag.stats import bootstrap_interval, wilson_interval

PSMS = (3, 6, 11)
UPSCALES = (1.5, 2.0, 3.0)
THRESHOLDS = (0.5, 0.75, 0.9)
CONDITIONS = ("clean", "jpeg:20", "gaussian_blur:1.5")
CANDIDATES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""Thresholds tried on generated validation answers (all derived from one run grounded at the lowest)."""
TEST_RUNS = ("gold_agents", "top3_all_agents")
"""The committed test runs' rows (``runs/<name>.jsonl``) read again at the chosen threshold."""


def questions(root: Path, split: str) -> list[tuple[str, object]]:
    """(data set, QA example) of a split: ``default`` for train, every test data set for test."""
    configs = ["default"] if split == "train" else [*STYLES, FINE_PRINT_SPLIT]
    return [(config, q) for config in configs for q in load_qa(root / "qa", config=config, split=split)]


def page_images(root: Path, split: str) -> dict[str, object]:
    config = "default" if split == "train" else "all"
    return {page.doc_id: page.image for page in load_corpus(root / "corpus", config=config, split=split)}


def read_words(images: dict, ids: Iterable[str], settings: OcrSettings, condition: str) -> dict[str, list[Word]]:
    degradation = None if condition == "clean" else Degradation.parse(condition)
    words = {}
    for doc_id in ids:
        image = images[doc_id] if degradation is None else degradation.apply(images[doc_id], doc_id)
        words[doc_id] = [Word(text, box) for text, box in ocr_words(image, settings)]
    return words


def ground(sample, gold, images, words, threshold: float) -> list[dict]:
    """One row a question: the gold answer located on its gold page, scored against the gold boxes."""
    rows = []
    source = TextSource(threshold=threshold)
    for dataset, question in sample:
        boxes = gold[(dataset, question.query_id)]
        if not boxes:
            continue
        page_id = question.relevant_doc_ids[0]
        page = GroundingPage(page_id, images[page_id].size, words[page_id])
        evidence = source.locate(question.answers[0], [page])
        score = grounding_score(evidence, boxes)
        kind = question_kind(question.query) or ("?", "?")
        rows.append({"dataset": dataset, "query_id": question.query_id, "evidence_type": kind[0], "field": kind[1],
                     "answer": question.answers[0], "evidence": [e.to_dict() for e in evidence], **score.to_dict()})
    return rows


def summary(rows: Sequence[dict]) -> dict:
    """Mean F1 / precision / recall with bootstrap intervals, hits with a Wilson interval (×100)."""
    out = {"n": len(rows)}
    for name in ("f1", "precision", "recall"):
        values = [row[name] for row in rows]
        out[name] = [100 * float(np.mean(values)), *(100 * v for v in bootstrap_interval(values))]
    hits = sum(row["hit"] for row in rows)
    out["hit"] = [100 * hits / len(rows), *(100 * v for v in wilson_interval(hits, len(rows)))]
    return out


def groups(rows: Sequence[dict]) -> dict[str, list[dict]]:
    keyed = {"all": list(rows)}
    for row in rows:
        keyed.setdefault(f"data set {row['dataset']}", []).append(row)
        keyed.setdefault(f"evidence {row['evidence_type']}", []).append(row)
        keyed.setdefault(f"field {row['field']}", []).append(row)
    return keyed


def validate(root: Path, sample_size: int, seed: int) -> dict:
    """Stage 1: every grid point on a fixed random sample of training questions."""
    rng = np.random.default_rng(seed)
    pool = questions(root, "train")
    sample = [pool[i] for i in sorted(rng.choice(len(pool), size=min(sample_size, len(pool)), replace=False))]
    images, gold = page_images(root, "train"), load_gold(root)
    ids = {q.relevant_doc_ids[0] for _, q in sample}
    grid = []
    for psm, upscale in itertools.product(PSMS, UPSCALES):
        words = read_words(images, ids, OcrSettings(psm=psm, upscale=upscale), "clean")
        for threshold in THRESHOLDS:
            rows = ground(sample, gold, images, words, threshold)
            grid.append({"psm": psm, "upscale": upscale, "threshold": threshold, **summary(rows)})
            print(f"psm {psm} upscale {upscale} threshold {threshold}: F1 {grid[-1]['f1'][0]:.1f}", flush=True)
    best = max(grid, key=lambda point: (point["f1"][0], -point["upscale"]))
    return {"questions": len(sample), "seed": seed, "grid": grid,
            "chosen": {key: best[key] for key in ("psm", "upscale", "threshold")}}


def test(root: Path, chosen: dict) -> tuple[dict, list[dict]]:
    """Stage 2: the chosen setting on every test question, clean and degraded."""
    sample = questions(root, "test")
    images, gold = page_images(root, "test"), load_gold(root)
    settings = OcrSettings(psm=chosen["psm"], upscale=chosen["upscale"])
    ids = {q.relevant_doc_ids[0] for _, q in sample}
    results, per_query = {}, []
    for condition in CONDITIONS:
        start = time.perf_counter()
        words = read_words(images, ids, settings, condition)
        rows = [{**row, "condition": condition} for row in ground(sample, gold, images, words, chosen["threshold"])]
        per_query += rows
        results[condition] = {name: summary(members) for name, members in groups(rows).items()}
        results[condition]["ocr_s_per_page"] = (time.perf_counter() - start) / len(ids)
    return results, per_query


def run_rows(run_dir: Path, outcomes: Iterable[QueryOutcome] | None = None) -> list[dict]:
    """The grounding of an ``eval.py`` run's answers (its trace, or ``outcomes`` grounded again), one row a scored
    query."""
    rows = []
    for outcome in load_trace(run_dir / MERGED_FILE) if outcomes is None else outcomes:
        score = (outcome.grounding or {}).get("score")
        if score:
            right = bool((outcome.metrics or {}).get("relaxed_accuracy"))
            rows.append({"dataset": outcome.dataset, "pool": outcome.pool, "query_id": outcome.query_id,
                         "answer": outcome.answer, "right": right, "source": outcome.grounding["source"],
                         "evidence": outcome.evidence, **score})
    return rows


def run_summary(rows: Sequence[dict]) -> dict:
    out = summary(rows)
    out["wrong_page"] = sum(row["wrong_page"] for row in rows)
    out["right_ungrounded"] = sum(row["right"] and not row["hit"] for row in rows)
    out["grounded_wrong"] = sum(row["hit"] and not row["right"] for row in rows)
    out["right"] = sum(row["right"] for row in rows)
    out["source"] = "/".join(sorted({row.get("source", "text") for row in rows}))
    return out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def text_grounded(run_dir: Path) -> list[QueryOutcome]:
    """A finished ``eval.py`` run's answers grounded again by the text source at the default settings, on the pages
    or region units each read (the run's corpora, from its saved config): the same answers, another source."""
    from omegaconf import OmegaConf

    from hkrag.tasks.rag import PageStore

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    configs = sorted({pools(ds)[pool] for ds in cfg.rag.datasets for pool in cfg.rag.pools} | set(cfg.rag.datasets))
    store = PageStore([load_corpus(cfg.data.corpus_source, config, cfg.rag.split) for config in configs])
    settings = GroundingConfig()
    grounder = Grounder(settings.make_source(), store.view, load_gold(cfg.data.root),
                        OcrSettings(psm=settings.psm, upscale=settings.upscale), settings.word_cache())
    return [grounder.annotate(outcome) for outcome in load_trace(run_dir / MERGED_FILE)]


def answer_validation(root: Path, lvlm: str, work: Path, threshold: float) -> list[dict]:
    """HKRAG's agents on ``lvlm`` answering the validation questions its generator was not trained on (the
    shipped manifest's ``generator_training.validation``) on their gold pages, as ``eval.py task=generation``
    answers and grounds them (at ``threshold``): one :func:`run_rows` row a question. The trace under ``work``
    keeps every finished answer, so a killed run resumes."""
    from omegaconf import OmegaConf

    from agents import build_generator  # the bench is a composition root
    from hkrag.lvlm import build_backend
    from hkrag.tasks.fit import compose_config
    from hkrag.tasks.rag import PageStore, PlannedQuery, answer_queries, build_grounder

    cfg = compose_config(["task=generation", "retrieval=gold", f"lvlm={lvlm}", f"data.root={root}",
                          f"rag.grounding.threshold={threshold}"], name="eval")
    manifest = read_json(Path(cfg.lvlm.base).parent / "manifest.json", keys=("config",), what="generator manifest")
    split = ValidationSplit(**manifest["config"]["generator_training"]["validation"])
    _, queries = split.split(load_qa(root / "qa", "default", "train"))
    store = PageStore([load_corpus(root / "corpus", "default", "train")])
    plan = [PlannedQuery(q, "default", "gold", list(q.relevant_doc_ids[: cfg.rag.top_k])) for q in queries]
    backend = build_backend(OmegaConf.to_container(cfg.lvlm, resolve=True))
    try:
        generator = build_generator(OmegaConf.to_container(cfg.generator, resolve=True), backend)
        answer_queries(plan, store, generator.answer, None, TraceWriter(work), 0, 1, True,
                       grounder=build_grounder(cfg, store, backend.name))
    finally:
        backend.close()
    merge(work, [item.key for item in plan])
    return run_rows(work)


def rethreshold(rows: Sequence[dict], gold: dict, threshold: float, run_threshold: float) -> list[dict]:
    """``rows`` grounded by the text source at ``run_threshold`` as grounded at ``threshold``: evidence and scores
    (:func:`hkrag.rag.grounding.at_threshold`, against ``gold``)."""
    out = []
    for row in rows:
        evidence = at_threshold([Evidence.from_dict(item) for item in row["evidence"]], threshold, run_threshold)
        score = grounding_score(evidence, gold[(row["dataset"], row["query_id"])])
        out.append({**row, "evidence": [item.to_dict() for item in evidence], **score.to_dict()})
    return out


def balanced_accuracy(rows: Sequence[dict]) -> float | None:
    """½ (hits among right answers / right + misses among wrong / wrong); ``None`` without both kinds."""
    right = [row["hit"] for row in rows if row["right"]]
    wrong = [row["hit"] for row in rows if not row["right"]]
    if not right or not wrong:
        return None
    return (sum(right) / len(right) + (len(wrong) - sum(wrong)) / len(wrong)) / 2


def choose_threshold(rows: Sequence[dict], gold: dict, run_threshold: float) -> dict:
    """Every candidate's balanced accuracy on ``rows`` and the chosen threshold: the highest (within 1e-9),
    ties to the lower threshold; ``run_threshold`` when it is undefined (docs/grounding.md, registered rule)."""
    table = []
    for threshold in CANDIDATES:
        at = rethreshold(rows, gold, threshold, run_threshold)
        boxed_wrong = sum(bool(row["evidence"]) and not row["right"] for row in at)
        table.append({"threshold": threshold, "balanced_accuracy": balanced_accuracy(at), "boxed_wrong": boxed_wrong,
                      **run_summary(at)})
    defined = [point for point in table if point["balanced_accuracy"] is not None]
    if not defined:
        return {"candidates": table, "chosen": run_threshold}
    best = max(point["balanced_accuracy"] for point in defined)
    chosen = min(point["threshold"] for point in defined if point["balanced_accuracy"] >= best - 1e-9)
    return {"candidates": table, "chosen": chosen}


def by_group(rows: Sequence[dict], condition: str) -> dict:
    members = [row for row in rows if row["condition"] == condition]
    return {name: summary(group) for name, group in groups(members).items()}


def same_scores(rows: Sequence[dict], again: Sequence[dict]) -> bool:
    return all(abs(a["f1"] - b["f1"]) < 1e-9 and a["hit"] == b["hit"] for a, b in zip(rows, again, strict=True))


def threshold_stage(out: Path, root: Path, lvlm: str, work: Path) -> dict:
    """The threshold chosen on generated validation answers, then the committed test rows read at it (module
    docstring). Each test file is first re-derived at the run's own threshold, which must give its scores back."""
    run_threshold = CANDIDATES[0]
    start = time.perf_counter()
    rows = answer_validation(root, lvlm, work, run_threshold)
    write_rows(out / "runs" / "validation_gold_agents.jsonl", rows)
    gold = load_gold(root)
    choice = choose_threshold(rows, gold, run_threshold)
    chosen = choice["chosen"]
    report = {"lvlm": lvlm, "questions": len(rows), "run_threshold": run_threshold, **choice,
              "validation_s": time.perf_counter() - start, "load": list(os.getloadavg()), "test": {}}
    files = {name: out / "runs" / f"{name}.jsonl" for name in TEST_RUNS}
    if chosen != run_threshold:
        files["gold_answer"] = out / "test_queries.jsonl"
    for name, path in files.items():
        committed = read_rows(path)
        if not same_scores(committed, rethreshold(committed, gold, run_threshold, run_threshold)):
            raise ValueError(f"{path}: its evidence at threshold {run_threshold} does not give its scores back")
        at = rethreshold(committed, gold, chosen, run_threshold)
        write_rows(out / "runs" / f"{path.stem}_t{chosen}.jsonl", at)
        if name == "gold_answer":
            report["test"][name] = {condition: {"before": by_group(committed, condition),
                                                "after": by_group(at, condition)} for condition in CONDITIONS}
        else:
            report["test"][name] = {"before": run_summary(committed), "after": run_summary(at)}
    return report


def cell(values: Sequence[float]) -> str:
    return f"{values[0]:.1f} [{values[1]:.1f}, {values[2]:.1f}]"


def markdown(report: dict) -> str:
    chosen = report["validation"]["chosen"]
    lines = ["# Text grounding on the built-in corpus", "",
             f"`python bench/grounding.py --data {report['data']} --out docs/grounding` on {report['machine']}, "
             f"{report['date']}; Tesseract {report['tesseract']}. Per-query rows: `test_queries.jsonl`"
             + (", `runs/*.jsonl`" if report.get("runs") else "") + ".", "",
             f"**Chosen on {report['validation']['questions']} training questions** (seed "
             f"{report['validation']['seed']}; grid psm {PSMS} × upscale {UPSCALES} × threshold {THRESHOLDS}, highest "
             f"mean F1): psm {chosen['psm']}, upscale {chosen['upscale']}, threshold {chosen['threshold']}.", "",
             "**Test split, read once** (the gold answer located on its gold page; ×100, 95 % intervals):", "",
             "| condition | group | n | F1 | precision | recall | IoU ≥ 0.5 |", "|---|---|---|---|---|---|---|"]
    for condition, by_group in report["test"].items():
        for name, group in by_group.items():
            if name == "ocr_s_per_page":
                continue
            lines.append(f"| {condition} | {name} | {group['n']} | {cell(group['f1'])} | {cell(group['precision'])} | "
                         f"{cell(group['recall'])} | {cell(group['hit'])} |")
    if report.get("runs"):
        lines += ["", "**Generated answers** (`eval.py` runs; the text source at the threshold of the day, 0.5 before "
                  "the threshold was chosen on generated answers, 0.6 after):", "",
                  "| run | source | n | right | F1 | IoU ≥ 0.5 | wrong page | right, ungrounded | grounded, wrong |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, run in report["runs"].items():
            lines.append(f"| {name} | {run.get('source', 'text')} | {run['n']} | {run['right']} | {cell(run['f1'])} | "
                         f"{cell(run['hit'])} | "
                         f"{run['wrong_page']} | {run['right_ungrounded']} | {run['grounded_wrong']} |")
    if report.get("threshold"):
        lines += threshold_markdown(report["threshold"])
    return "\n".join(lines) + "\n"


def threshold_markdown(choice: dict) -> list[str]:
    """The threshold chosen on generated validation answers and the test rows read again at it."""
    chosen, before = choice["chosen"], choice["run_threshold"]
    lines = ["", f"**The threshold chosen on generated answers** (`python bench/grounding.py --data data/synthetic "
             f"--out docs/grounding --chosen docs/grounding/validation.json --reuse-test --choose-threshold --lvlm "
             f"{choice['lvlm']}`, {choice['validation_s']:.0f} s, load average {choice['load'][0]:.2f} at its end; "
             f"{choice['questions']} validation questions on their gold pages, HKRAG's agents; the balanced accuracy "
             f"of \"grounded ⇔ right\", ties to the lower): **{chosen}**.", "",
             "| threshold | balanced accuracy | right | F1 | IoU ≥ 0.5 | right, ungrounded | grounded, wrong "
             "| wrong answers boxed |", "|---|---|---|---|---|---|---|---|"]
    for point in choice["candidates"]:
        accuracy = point["balanced_accuracy"]
        lines.append(f"| {point['threshold']} | {'–' if accuracy is None else f'{100 * accuracy:.1f}'} | "
                     f"{point['right']} / {point['n']} | {cell(point['f1'])} | {cell(point['hit'])} | "
                     f"{point['right_ungrounded']} | {point['grounded_wrong']} | {point['boxed_wrong']} |")
    lines += ["", f"**Test split read once at {chosen}** (the committed rows' answers; threshold {before} → {chosen}):",
              "", "| run | n | F1 | IoU ≥ 0.5 | wrong page | right, ungrounded | grounded, wrong |",
              "|---|---|---|---|---|---|---|"]
    for name, figures in choice["test"].items():
        if name == "gold_answer":
            for condition, pair in figures.items():
                old, new = pair["before"]["all"], pair["after"]["all"]
                lines.append(f"| gold answer, {condition} | {new['n']} | {cell(old['f1'])} → {cell(new['f1'])} | "
                             f"{cell(old['hit'])} → {cell(new['hit'])} | – | – | – |")
            continue
        old, new = figures["before"], figures["after"]
        lines.append(f"| {name} | {new['n']} | {cell(old['f1'])} → {cell(new['f1'])} | {cell(old['hit'])} → "
                     f"{cell(new['hit'])} | {old['wrong_page']} → {new['wrong_page']} | {old['right_ungrounded']} → "
                     f"{new['right_ungrounded']} | {old['grounded_wrong']} → {new['grounded_wrong']} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/synthetic"), help="a built-in corpus folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--validation-questions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chosen", type=Path, help="a validation.json to reuse instead of running stage 1")
    parser.add_argument("--reuse-test", action="store_true",
                        help="keep --out's test.json and test_queries.jsonl: no second read of the test split")
    parser.add_argument("--runs", nargs="*", default=[], metavar="NAME=RUN_DIR",
                        help="eval.py run folders whose traces carry grounding, summarised beside the test figures")
    parser.add_argument("--text-runs", nargs="*", default=[], metavar="NAME=RUN_DIR",
                        help="eval.py runs whose answers are grounded again by the text source (default settings)")
    parser.add_argument("--choose-threshold", action="store_true",
                        help="choose the text threshold on generated validation answers, then read --out's test rows")
    parser.add_argument("--lvlm", default="phi3v_agents_tiny", help="the generator's lvlm config (--choose-threshold)")
    parser.add_argument("--work", type=Path, default=Path("outputs/grounding_validation"),
                        help="where --choose-threshold keeps its validation trace (resumable)")
    args = parser.parse_args(argv)
    if args.validation_questions < 1:
        parser.error(f"--validation-questions must be >= 1, got {args.validation_questions}")
    tesseract = check_tesseract()
    validation = json.loads(args.chosen.read_text()) if args.chosen else validate(args.data, args.validation_questions,
                                                                                  args.seed)
    write_json(args.out / "validation.json", validation)
    previous = json.loads((args.out / "test.json").read_text()) if args.reuse_test else {}
    if args.reuse_test:  # the test figures already read (summarise more runs beside them, no second read)
        results, per_query = previous["test"], read_rows(args.out / "test_queries.jsonl")
    else:
        results, per_query = test(args.data, validation["chosen"])
    runs = dict(previous.get("runs", {}))
    for spec in args.runs + args.text_runs:
        name, _, folder = spec.partition("=")
        rows = run_rows(Path(folder), text_grounded(Path(folder)) if spec in args.text_runs else None)
        write_rows(args.out / "runs" / f"{name}.jsonl", rows)
        runs[name] = run_summary(rows)
    env = environment()
    machine = f"{env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores)"
    threshold = threshold_stage(args.out, args.data, args.lvlm, args.work) if args.choose_threshold \
        else previous.get("threshold")
    report = {"data": str(args.data), "machine": machine, "date": time.strftime("%Y-%m-%d"),
              "tesseract": tesseract, "environment": env, "validation": validation, "test": results, "runs": runs,
              "threshold": threshold}
    write_json(args.out / "test.json", report)
    write_rows(args.out / "test_queries.jsonl", per_query)
    write_text(args.out / "grounding.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
