"""``train.py``: train the retriever and report retrieval before and after (docs/training.md).

One shared run directory for all ranks; data (the built-in corpus is generated on first use); retriever
(tiny random model or the real checkpoint, optionally starting from an existing adapter); loss;
retrieval evaluation before training; training; a final checkpoint; evaluation after; a report
(``report.json`` + ``report.md``) written by rank 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from hkrag.data.collators import PretrainingCollator
from hkrag.data.opendocvqa import Corpus, load_corpus, load_pretraining_corpus, load_qa
from hkrag.data.pairs import TrainingPair, field_pairs, pretraining_pairs, training_pairs
from hkrag.data.synthetic import load_page_items
from hkrag.environment import describe, environment
from hkrag.index.shards import config_hash
from hkrag.io import write_json, write_text
from hkrag.losses import PretrainingLoss
from hkrag.retrieval.evaluation import (
    AFTER_TRAINING_DIR,
    BEFORE_TRAINING_DIR,
    CURVE_DIR,
    PER_QUERY_FILE,
    TABLE_FILE,
    evaluate_retrieval,
)
from hkrag.retriever import HeadSettings, Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.tasks.common import (
    BASE_DIR,
    build_retriever,
    check_pools,
    eval_config,
    flat_metrics,
    flat_summary,
    make_accelerator,
    prepare_data,
    shared_output_dir,
)
from hkrag.tasks.retrieval import log_retrieval
from hkrag.tasks.validation import validate_config
from hkrag.training.checkpoint import ADAPTER_DIR, FINAL_CHECKPOINT, resolve_resume
from hkrag.training.objective import make_loss
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig


def trainer_config(cfg: DictConfig) -> TrainerConfig:
    """``trainer`` + ``optim`` groups as a :class:`TrainerConfig` (``precision``/``cpu`` go to accelerate)."""
    values = {**OmegaConf.to_container(cfg.trainer, resolve=True), **OmegaConf.to_container(cfg.optim, resolve=True)}
    values["betas"] = tuple(values["betas"])
    return TrainerConfig(**{k: v for k, v in values.items() if k not in ("precision", "cpu")})


def run_training(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; returns the report (rank 0) or ``{}``."""
    validate_config(cfg)
    accelerator = make_accelerator(cfg.trainer.get("cpu", False), mixed_precision=cfg.trainer.precision)
    output_dir = shared_output_dir(accelerator, output_dir)
    set_seed(cfg.trainer.seed)
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()

    loss_fn = make_loss(cfg.loss, HeadSettings.of(cfg.model))
    pairs, corpus, vocabulary = training_data(cfg, pretraining=isinstance(loss_fn, PretrainingLoss))
    evaluate = cfg.eval_before_after and cfg.get("eval") is not None
    if evaluate:
        check_pools(eval_config(cfg))  # before hours of training, not after
    if cfg.trainer.get("eval_every") and not evaluate:
        raise ValueError("trainer.eval_every needs the evaluation: set eval_before_after=true (and an eval group)")
    plugin = accelerator.state.deepspeed_plugin
    if evaluate and plugin is not None and plugin.zero_stage == 3:
        raise ValueError(
            "eval_before_after=true does not run under DeepSpeed ZeRO-3: the ranks encode different shards, so "
            "ZeRO-3's gathers of the partitioned weights would wait forever; set eval_before_after=false and evaluate "
            f"the final adapter with eval.py run_dir={output_dir}"
        )
    resume = resolve_resume(cfg.get("resume"), output_dir)
    keep_base = resume is not None and (output_dir / BASE_DIR).is_dir()  # a refused resume must not replace it
    tiny_base = output_dir / BASE_DIR if cfg.model.kind == "tiny" and accelerator.is_main_process and not keep_base \
        else None
    retriever = build_retriever(cfg.model, texts=vocabulary, save_base_to=tiny_base)
    base = output_dir / BASE_DIR if cfg.model.kind == "tiny" else cfg.model.base
    identity = {"model": str(base), "config": OmegaConf.to_container(cfg.model)}

    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"),
                           enabled=accelerator.is_main_process)
    trainer_cfg = trainer_config(cfg)
    collator = None
    if isinstance(loss_fn, PretrainingLoss):
        collator = PretrainingCollator(retriever.collator, loss_fn.max_query_length, loss_fn.max_target_length)
    trainer = RetrieverTrainer(retriever, loss_fn, pairs, corpus, trainer_cfg, accelerator, output_dir, run_logger,
                               run_config=run_settings(cfg), collator=collator)
    if resume:
        trainer.resume(resume)

    before = _evaluate(retriever, cfg, output_dir / BEFORE_TRAINING_DIR, identity) if evaluate and not resume else None
    trainer.fit(on_eval=learning_curve(retriever, cfg, output_dir, identity, accelerator) if evaluate else None)
    final = trainer.save(FINAL_CHECKPOINT)
    identity["adapter"] = str(final / ADAPTER_DIR)
    after = _evaluate(retriever, cfg, output_dir / AFTER_TRAINING_DIR, identity) if evaluate else None

    report = {}
    if accelerator.is_main_process:
        report = write_report(output_dir, cfg, before, after, trainer.state.step, final)
        run_logger.summary(flat_summary(report))
        log_report(run_logger, output_dir, {"before": before, "after": after})
    run_logger.finish()
    accelerator.wait_for_everyone()
    return report


def training_data(cfg: DictConfig, pretraining: bool) -> tuple[list[TrainingPair], Corpus, list[str]]:
    """Pairs, their corpus, and the texts the tiny model's offline tokenizer is built from.

    Fine-tuning: OpenDocVQA-style questions and pages (``data.train``). Pre-training (VDocRAG RCR + RCG): the
    pages of ``data.pretrain`` with their text as queries. The tiny tokenizer is built from the training
    questions whenever the data set has them, so a tiny pre-trained adapter fine-tunes on the same vocabulary.
    """
    questions = None
    if cfg.data.get("qa_source") and cfg.data.get("train"):
        questions = load_qa(cfg.data.qa_source, cfg.data.train.qa_config, cfg.data.train.split)
    if pretraining:
        source = cfg.data.get("pretrain")
        if source is None:
            raise ValueError("loss=pretrain needs data.pretrain (source, config, split, text_column): use "
                             "data=synthetic or data=pretrain_docstruct")
        corpus = load_pretraining_corpus(source.source, source.config, source.split, source.text_column)
        pairs = pretraining_pairs(corpus, source.text_column)
    else:
        corpus = load_corpus(cfg.data.corpus_source, cfg.data.train.corpus_config, cfg.data.train.split)
        pairs = training_pairs(questions, corpus)
        if cfg.data.get("field_queries"):
            items = load_page_items(cfg.data.root, cfg.data.train.split)
            fields = {doc_id: row["fields"] for doc_id, row in items.items()}
            pairs += field_pairs(fields, list(cfg.data.field_queries), corpus)
    vocabulary = [ex.query for ex in questions] if questions is not None else [pair.query for pair in pairs]
    return pairs, corpus, vocabulary


RUN_MODEL_KEYS = ("kind", "base", "adapter", "seed", "config", "num_crops", "dtype")
"""``model`` keys that change what is trained (LoRA settings are read from the model itself)."""


def run_settings(cfg: DictConfig) -> dict[str, Any]:
    """Config values a resumed run must share with its checkpoint, beyond what the trainer derives itself."""
    model = {f"model.{k}": cfg.model.get(k) for k in RUN_MODEL_KEYS if k in cfg.model}
    if HeadSettings.of(cfg.model).late_interaction:  # absent for the dense head: its runs keep their identity
        model.update({"model.head": cfg.model.head, "model.late_interaction": cfg.model.late_interaction})
    data = {k: cfg.data.get(k) for k in ("synthetic", "train")}  # the content itself is fingerprinted by the trainer
    return {**_flatten(model), **_flatten(data, "data."), "trainer.precision": cfg.trainer.get("precision")}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, DictConfig):
        tree = OmegaConf.to_container(tree, resolve=True)
    if not isinstance(tree, dict) or not tree:
        return {prefix.rstrip("."): tree} if prefix else {}
    return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}


def learning_curve(
    retriever: Phi3VRetriever, cfg: DictConfig, output_dir: Path, identity: dict, accelerator: Accelerator
) -> Callable[[int], dict[str, float]]:
    """The trainer's ``on_eval``: the retrieval evaluation at a step into ``eval-step-<n>/`` (report and per-query
    scores; the page embeddings are removed, one set per point would fill the disk), as ``curve/...`` metrics."""
    def evaluate(step: int) -> dict[str, float]:
        work_dir = output_dir / CURVE_DIR.format(step=step)
        result = _evaluate(retriever, cfg, work_dir, {**identity, "step": step})
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for shards in work_dir.glob("embeddings-*"):
                shutil.rmtree(shards)
            write_text(work_dir / TABLE_FILE, result["table"] + "\n")
        return flat_metrics(result and result["results"], "curve")
    return evaluate


def _evaluate(retriever: Phi3VRetriever, cfg: DictConfig, work_dir: Path, identity: dict) -> dict | None:
    return evaluate_retrieval(retriever, eval_config(cfg), work_dir, identity) or None


STYLES = ("synchart", "synslide", "syntable", "syninfo")
"""The built-in corpus's four styles, averaged in the README's demo table."""
DEMO_ROWS = ("styles, fine-print evidence (the title is named)", "styles, salient evidence", "styles, all",
             "`synfine`: fine print only, no title (chance: 12.3 / 2.5)")
"""The README demo table's rows: the four styles' nDCG@5 per evidence type, averaged over styles; then synfine."""
DEMO_COLUMNS = {"before (the shipped reader), single": ("before", "single"), "before, all": ("before", "all"),
                "after 324 steps, single": ("after", "single"), "after, all": ("after", "all")}
"""The README demo table's columns: (``report.json`` key, pool)."""


def demo_figures(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The README demo table's figures (nDCG@5 x100 per pool and row) from one evaluation's ``results``
    (``report.json``'s ``before`` or ``after``): the styles' per-evidence nDCG@5 averaged over the four styles."""
    def styles(pool: str, evidence: str) -> float:
        return 100 * sum(results[name][pool][evidence]["ndcg@5"] for name in STYLES) / len(STYLES)

    return {pool: dict(zip(DEMO_ROWS, (styles(pool, "fine_print"), styles(pool, "salient"), styles(pool, "all"),
                                       100 * results["synfine"][pool]["all"]["ndcg@5"])))
            for pool in ("single", "all")}


def demo_cell(values: list[float]) -> str:
    """A README demo-table cell: ``lo–hi`` at one decimal over runs, one value when they agree."""
    lo, hi = f"{min(values):.1f}", f"{max(values):.1f}"
    return lo if lo == hi else f"{lo}–{hi}"


def demo_figures_from_per_query(per_query: dict[str, Any]) -> dict[str, dict[str, float]]:
    """:func:`demo_figures` from an evaluation's ``per_query.json``: each cell the mean of its queries' nDCG@5."""
    def means(rows: dict[str, dict]) -> dict[str, dict[str, float]]:
        groups: dict[str, list[float]] = {"all": []}
        for row in rows.values():
            groups["all"].append(row["ndcg@5"])
            groups.setdefault(row["evidence"], []).append(row["ndcg@5"])
        return {key: {"ndcg@5": sum(values) / len(values)} for key, values in groups.items()}

    return demo_figures({name: {pool: means(rows) for pool, rows in pools.items()}
                         for name, pools in per_query.items()})


def log_report(run_logger: RunLogger, output_dir: Path, results: dict[str, dict | None]) -> None:
    """The report in W&B (no-op without it): Table 2 and the per-query rows of each evaluation (``before`` /
    ``after``, as in ``report.json``) as tables, the report and the per-query files as an artifact."""
    for key, result in results.items():
        if result:
            log_retrieval(run_logger, result, key)
    per_query = [f"{folder}/{PER_QUERY_FILE}" for folder in (BEFORE_TRAINING_DIR, AFTER_TRAINING_DIR)]
    run_logger.artifact("training-report", "report", output_dir, ["report.json", "report.md", *per_query])


def write_report(output_dir: Path, cfg: DictConfig, before: dict | None, after: dict | None, steps: int,
                 checkpoint: Path) -> dict[str, Any]:
    """``report.json`` and ``report.md`` with the before/after retrieval tables."""
    report = {"steps": steps, "checkpoint": str(checkpoint), "config_hash": config_hash(OmegaConf.to_container(cfg)),
              "before": before and before["results"], "after": after and after["results"],
              "environment": environment()}
    write_json(output_dir / "report.json", report)
    lines = [f"# Retriever training report\n\nsteps: {steps}; checkpoint: `{checkpoint}`\n",
             f"Machine: {describe(report['environment'])}\n"]
    for title, result in (("Before training", before), ("After training", after)):
        if result:
            lines += [f"## {title}\n", result["table"], ""]
    text = "\n".join(lines)
    write_text(output_dir / "report.md", text)
    print(text)
    return report
