"""``eval.py task=mteb benchmark=...``: our retriever on MTEB's benchmarks (ViDoRe v1/v2/v3, VisRAG) through
:mod:`hkrag.retrieval.mteb_adapter`; docs/evaluation.md, "MTEB / ViDoRe".

``benchmark`` names an MTEB benchmark (``ViDoRe(v1)``), an MTEB task (``VisRAGRetChartQA``), ``local`` (the
evaluation's own data sets and pools, ``data=`` / ``eval.*``, as local MTEB tasks: no hub needed) or a list of
these. Every task's data is loaded before the model, so a machine without hub access fails at once with the
task's name. Each page and query is encoded once for all the tasks (:class:`MTEBRetriever` keeps the embeddings:
``benchmark=local``'s tasks share their pages). MTEB writes its result files
(``results/<model>/<revision>/<Task>.json`` and ``model_meta.json``, the layout of a leaderboard submission) under
``<output_dir>/mteb``, and each task's ranking under
``mteb/predictions``; tasks already there are not run again (``task.overwrite_strategy``).
The main scores go to ``mteb.json`` / ``mteb.md`` and the run's summary. Importing this module needs MTEB (the
adapter says how to install it); ``eval.py`` imports it only for ``task=mteb``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from hkrag.data.opendocvqa import load_corpus, load_qa, pools
from hkrag.io import write_json, write_text
from hkrag.retrieval.mteb_adapter import MTEBRetriever, check_model_name, local_task, model_meta, model_name
from hkrag.run_log import RunLogger
from hkrag.tasks.common import build_retriever, eval_config, evaluated_model, make_accelerator, prepare_data
from hkrag.tasks.validation import validate_config

if TYPE_CHECKING:
    from mteb import AbsTask
    from mteb.evaluate import OverwriteStrategy
    from mteb.results.model_result import ModelResult

LOCAL = "local"
"""``benchmark=local``: the evaluation's own data as MTEB tasks (:func:`local_tasks`)."""
MTEB_DIR = "mteb"
PREDICTIONS_DIR = Path(MTEB_DIR, "predictions")
"""Each task's ranking, ``<Task>_predictions.json`` (``task.save_predictions``), for per-query comparisons."""
SUMMARY_FILE, TABLE_FILE = "mteb.json", "mteb.md"
VISUAL_BENCHMARKS = ("ViDoRe(v1)", "ViDoRe(v2)", "ViDoRe(v3)", "VisRAGRet* tasks", LOCAL)


def run_mteb(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.benchmark`` with the evaluated retriever (one process); returns :func:`task_scores`."""
    from mteb import ResultCache, evaluate

    validate_config(cfg)
    output_dir = Path(output_dir)
    model_cfg, identity = evaluated_model(cfg)
    name = check_model_name(cfg.task.get("model_name") or model_name(identity["model"], identity["adapter"]))
    overwrite = overwrite_strategy(cfg.task.overwrite_strategy)
    accelerator = make_accelerator(cfg.get("cpu", False))
    if accelerator.num_processes > 1:
        raise ValueError(f"task=mteb runs in one process (MTEB encodes and scores in it), got "
                         f"{accelerator.num_processes}: start it with `python eval.py`, not `accelerate launch`")
    tasks = mteb_tasks(cfg)
    retriever = build_retriever(model_cfg, trainable=False)
    retriever.model.to(accelerator.device)
    encoder = MTEBRetriever(retriever, model_meta(retriever, name, cfg.task.get("revision"), model_cfg.get("base"),
                                                  identity["adapter"]))
    result = evaluate(encoder, tasks, cache=ResultCache(output_dir / MTEB_DIR),
                      encode_kwargs={"batch_size": cfg.eval.doc_batch_size},
                      overwrite_strategy=overwrite,
                      prediction_folder=output_dir / PREDICTIONS_DIR if cfg.task.save_predictions else None)
    summary = {"model": name, "revision": encoder.mteb_model_meta.revision,
               "results": str(output_dir / MTEB_DIR / "results"), "scores": task_scores(result)}
    write_json(output_dir / SUMMARY_FILE, summary)
    table = score_table(summary["scores"])
    write_text(output_dir / TABLE_FILE, table + "\n")
    print(table)
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    run_logger.summary({f"mteb/{task}": by["main_score"] for task, by in summary["scores"].items()})
    run_logger.finish()
    return summary["scores"]


def overwrite_strategy(value: str) -> OverwriteStrategy:
    """MTEB's ``OverwriteStrategy`` named ``value`` (``task.overwrite_strategy``), or an error listing them."""
    from mteb.evaluate import OverwriteStrategy

    try:
        return OverwriteStrategy(value)
    except ValueError as error:
        raise ValueError(f"task.overwrite_strategy={value!r}: expected one of "
                         f"{[strategy.value for strategy in OverwriteStrategy]}") from error


def mteb_tasks(cfg: DictConfig) -> list[AbsTask]:
    """The MTEB tasks ``cfg.benchmark`` names, their data loaded (a task whose data cannot be fetched raises
    ``ConnectionError`` naming it and the need for hub access)."""
    import mteb

    names = cfg.get("benchmark")
    names = list(names) if isinstance(names, ListConfig | list | tuple) else [names]
    if not names or any(not isinstance(name, str) or not name for name in names):
        raise ValueError(f"benchmark={cfg.get('benchmark')!r}: name an MTEB benchmark or task, or a list of them "
                         f"(visual document retrieval: {', '.join(VISUAL_BENCHMARKS)})")
    benchmarks = {benchmark.name: benchmark for benchmark in mteb.get_benchmarks()}
    tasks = []
    for name in names:
        if name == LOCAL:
            tasks += local_tasks(cfg)
        elif name in benchmarks:
            tasks += benchmarks[name].tasks
        else:
            try:
                tasks.append(mteb.get_task(name))
            except KeyError as error:
                raise ValueError(f"benchmark={name!r} is neither an MTEB benchmark nor an MTEB task ({error}); "
                                 f"visual document retrieval: {', '.join(VISUAL_BENCHMARKS)}") from error
    for task in tasks:
        load_task_data(task)
    return tasks


def load_task_data(task: AbsTask) -> None:
    """Load an MTEB task's data from the Hugging Face Hub (or the local hub cache), or say why it cannot."""
    try:
        task.load_data()
    except OSError as error:  # ConnectionError (offline, no network), FileNotFoundError (not in the cache)
        dataset = task.metadata.dataset
        raise ConnectionError(
            f"MTEB task {task.metadata.name}: cannot load its data {dataset['path']}@{dataset.get('revision')} from "
            f"the Hugging Face Hub ({error}). task=mteb needs hub access for MTEB's tasks: run it on a machine that "
            "reaches huggingface.co with HF_HUB_OFFLINE unset (or with the data already in the hub cache); "
            "benchmark=local runs offline on the evaluation's own data"
        ) from error


def local_tasks(cfg: DictConfig) -> list[AbsTask]:
    """One MTEB task per data set and pool of the evaluation config (``HKRAG-<dataset>-<pool>``), its data
    generated first when it is the built-in corpus."""
    prepare_data(cfg.data)
    settings = eval_config(cfg)
    tasks = []
    for dataset in settings.datasets:
        qa = load_qa(settings.qa_source, dataset, settings.split)
        for pool in settings.pools:
            corpus = load_corpus(settings.corpus_source, pools(dataset)[pool], settings.split)
            tasks.append(local_task(qa, corpus, f"HKRAG-{dataset}-{pool}", settings.split))
    return tasks


def task_scores(result: ModelResult) -> dict[str, dict[str, Any]]:
    """``{task: {"main_score": mean over subsets and splits (MTEB's leaderboard score), "ndcg_at_5": likewise,
    "subsets": {"<subset>/<split>": main score}}}`` of an MTEB ``ModelResult``."""
    return {task.task_name: {
        "main_score": float(task.get_score()),
        "ndcg_at_5": float(task.get_score(getter=lambda scores: scores["ndcg_at_5"])),
        "subsets": {f"{row['hf_subset']}/{split}": row["main_score"] for split, rows in task.scores.items()
                    for row in rows},
    } for task in result.task_results}


def score_table(scores: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per task (its main score, x100) and their average."""
    rows = [f"| {task} | {100 * by['main_score']:.1f} |" for task, by in scores.items()]
    mean = sum(by["main_score"] for by in scores.values()) / len(scores)
    return "\n".join(["| MTEB task | main score (x100) |", "|---|---|", *rows, f"| Average | {100 * mean:.1f} |"])
