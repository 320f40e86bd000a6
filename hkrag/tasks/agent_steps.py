"""The agents' steps on held-out questions: a generator trained on the agents' curriculum, step by step.

    python -m hkrag.tasks.agent_steps outputs/generator_agents --out outputs/generator_agents/steps

For the run's held-out validation queries (``report.json``'s ``validation_queries``: documents the run never saw),
with ``--split training`` as many of the questions it trained on (a fit check: every k-th, k = ⌊training /
validation⌋) or, with ``--split test``, the test questions (the built-in corpus's five data sets), on each page
set of ``--pages`` (``gold``: the relevant page; ``retrieved``: the training reader's top 3 as the run ranked
them, validation and training only), two evaluations, each written as a trace (``<mode>-<pages>.jsonl``) with
its per-step report (:mod:`hkrag.rag.step_report`) in ``steps.{json,md}``:

- ``forced``: every step asked once with the curriculum's own request (the notes steps given the ground-truth
  notes), its reply compared with the curriculum's target: each step's skill, apart from what the others do;
- ``agents`` (and ``single_pass``): the real generators (``conf/generator/hkrag.yaml``, ``single_pass.yaml``)
  answering end to end, every call traced.

The run's curriculum is instantiated from its config (``generator_training.curriculum``), so the requests are
the ones the agents send. CPU, float32, greedy.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from hkrag.cli import existing
from hkrag.data.generator_pairs import read_pairs
from hkrag.data.opendocvqa import QAExample, load_corpus, load_qa
from hkrag.io import read_json, write_json, write_jsonl_gz, write_text
from hkrag.lvlm import LVLMBackend, PageImage
from hkrag.lvlm.phi3v import Phi3VBackend
from hkrag.lvlm.uncertainty import uncertainty
from hkrag.rag.metrics import rule_metrics
from hkrag.rag.records import CallRecord, PageTruth, Query, QueryOutcome, QueryTruth
from hkrag.rag.step_report import (
    PRUNER_CALLS_FILE,
    page_truth,
    pruner_rows,
    query_truth,
    step_markdown,
    step_report,
    summary_markdown,
    validation_threshold,
)
from hkrag.rag.trace import write_trace
from hkrag.ranges import POSITIVE
from hkrag.tasks.common import BASE_DIR, FINAL_ADAPTER, RUN_CONFIG, TRAIN_RUN, generator_conf
from hkrag.tasks.rag import answer_all, question_text

logger = logging.getLogger(__name__)
MODES = ("forced", "agents", "single_pass")
SPLITS = ("validation", "training", "test")
"""Held-out questions, a sample of the run's own training questions (the fit check), the test questions."""
PAGE_SETS = ("gold", "retrieved")
RETRIEVED_PAIRS = "generator_pairs_retrieved.jsonl"
STEPS = ("pruner", "answer", "single_pass", "verify", "salient", "fine_print", "decouple", "integrate")
"""Every step of ``agents.steps.STEPS`` (``forced`` asks each, trained or not; tests check the two agree)."""


def held_out_queries(run: Path, cfg: Any, split: str) -> list[QAExample]:
    """The run's validation queries (training split, held-out documents), as many of the questions it trained on
    (every k-th, k = ⌊training / validation⌋, in the QA file's order) or the test questions."""
    if split in ("validation", "training"):
        ids = set(read_json(run / "report.json", keys=("validation_queries",))["validation_queries"])
        if not ids:
            raise ValueError(f"{run} held out no validation queries (generator_training.validation was not set)")
        qa = load_qa(cfg.data.qa_source, cfg.data.train.qa_config, "train")
        if split == "validation":
            return [ex for ex in qa if ex.query_id in ids]
        trained = [ex for ex in qa if ex.query_id not in ids]
        return trained[::max(1, len(trained) // len(ids))][:len(ids)]
    return [ex for dataset in cfg.data.eval_datasets for ex in load_qa(cfg.data.qa_source, dataset, "test")]


def page_sets(run: Path, cfg: Any, split: str, queries: Sequence[QAExample], which: str) -> dict[str, list[str]]:
    """Each query's ranked page ids: its gold page, or the training reader's top 3 (validation and training
    queries only)."""
    if which == "gold":
        return {ex.query_id: list(ex.relevant_doc_ids[:1]) for ex in queries}
    if split == "test":
        raise ValueError("--pages retrieved is for the validation and training splits; on the test split run "
                         "eval.py task=rag and python -m hkrag.rag steps on its run directory")
    ranked = {pair.query_id: list(pair.doc_ids) for pair in read_pairs(run / RETRIEVED_PAIRS)}
    return {ex.query_id: ranked[ex.query_id] for ex in queries}


def forced_outcome(curriculum: Any, backend: LVLMBackend, truth: QueryTruth, pages: list[PageImage],
                   items: dict[str, PageTruth], estimator: str) -> QueryOutcome:
    """Every curriculum example of one query asked once; each reply recorded as the step's call."""
    outcome = QueryOutcome(truth.query_id, truth.question, list(truth.answers), retrieved=[p.key for p in pages],
                           route="forced")
    for example in curriculum.examples(truth, truth.question, [pages], items):
        result = backend(example.request)
        keys = [page.key for page in example.request.images]
        record = CallRecord.from_result(example.step, "", keys, result, step=example.step, iteration=example.iteration)
        curriculum.record(example.step, result, record)
        if example.step == "answer":
            record.uncertainty, record.estimator = uncertainty(result, estimator).value, estimator
        outcome.calls.append(record)
    return outcome


def evaluate(run: Path, out: Path, split: str, pages: Sequence[str], modes: Sequence[str],
             max_queries: int | None = None, threshold_from: Path | None = None,
             generator_overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The traces and per-step reports of every (mode, page set); returns ``steps.json``'s content. The Pruner's
    P(yes) threshold is ``threshold_from``'s (a validation ``steps.json``) when given, else chosen on each report;
    ``generator_overrides`` change the end-to-end generators' config (e.g. the Judger's ``threshold``)."""
    cfg = OmegaConf.load(run / RUN_CONFIG)
    queries = held_out_queries(run, cfg, split)[:max_queries]
    corpus_split = "test" if split == "test" else "train"
    corpus_configs = ["all"] if split == "test" else [cfg.data.train.corpus_config]
    corpora = [load_corpus(cfg.data.corpus_source, name, corpus_split) for name in corpus_configs]
    truths = {ex.query_id: query_truth(ex) for ex in queries}
    evidence = {ex.query_id: ex.evidence for ex in queries}
    threshold = {} if threshold_from is None else {"threshold": validation_threshold(threshold_from),
                                                   "threshold_source": str(threshold_from)}
    items = page_truth(cfg.data.root, corpus_split)
    backend = Phi3VBackend(base=str(run / BASE_DIR), adapter=str(run / FINAL_ADAPTER), device="cpu",
                           dtype="float32")
    curriculum = instantiate(cfg.generator_training.curriculum, _convert_="all", steps=list(STEPS),
                             generator=OmegaConf.to_container(cfg.generator, resolve=True))
    images: dict[str, PageImage] = {}

    def page(doc_id: str) -> PageImage:
        if doc_id not in images:
            corpus = next(c for c in corpora if doc_id in c)
            images[doc_id] = PageImage(corpus[doc_id].image, doc_id)
        return images[doc_id]

    results = {}
    for which in pages:
        ranked = page_sets(run, cfg, split, queries, which)
        for mode in modes:
            name = f"{mode}-{which}"
            if mode == "forced":
                outcomes = [forced_outcome(curriculum, backend, truths[ex.query_id], [page(d) for d in
                            ranked[ex.query_id]], items, cfg.generator.estimator) for ex in tqdm(queries, desc=name)]
            else:
                config = generator_conf("hkrag" if mode == "agents" else "single_pass", generator_overrides)
                asked = [Query(ex.query_id, question_text(ex), [page(d) for d in ranked[ex.query_id]],
                               list(ex.answers)) for ex in queries]
                outcomes = answer_all(config, backend, tqdm(asked, desc=name))
            for outcome in outcomes:
                outcome.metrics = outcome.metrics or rule_metrics(outcome.answer, outcome.gold)
            write_trace(out / f"{name}.jsonl", outcomes)
            write_jsonl_gz(out / f"{name}-{PRUNER_CALLS_FILE}", pruner_rows(outcomes, truths, evidence))
            results[name] = step_report(outcomes, truths, items, final=mode != "forced", evidence=evidence,
                                        **threshold)
    backend.close()
    report = {"run": str(run), "split": split, "queries": len(queries),
              "generator_overrides": list(generator_overrides), "reports": results}
    write_json(out / "steps.json", report)
    write_text(out / "steps.md", f"# Per-step report: {run}, {split} split, {len(queries)} queries\n\n"
               + summary_markdown(results) + "\n" + "\n".join(step_markdown(r, f"{name} ({split})")
                                                             for name, r in results.items()))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=TRAIN_RUN, help="a train.py run of experiment=generator_agents_tiny (or a sibling)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--split", choices=SPLITS, default="validation",
                        help="validation: the run's held-out questions; training: as many it trained on (fit check)")
    parser.add_argument("--pages", nargs="+", choices=PAGE_SETS, default=["gold"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--max-queries", type=POSITIVE.arg, default=None, help="the first N queries only")
    parser.add_argument("--threshold-from", type=existing(), default=None,
                        help="a validation steps.json whose Pruner P(yes) threshold is applied")
    parser.add_argument("--generator", nargs="+", default=[], metavar="KEY=VALUE", dest="generator_overrides",
                        help="overrides of conf/generator's keys for the agents and the single pass (threshold=0.4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = evaluate(args.run, args.out, args.split, args.pages, args.modes, args.max_queries, args.threshold_from,
                      args.generator_overrides)
    print((args.out / "steps.md").read_text())
    logger.info("%d queries; reports in %s", report["queries"], args.out)


if __name__ == "__main__":
    main()
