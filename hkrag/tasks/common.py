"""What every task composes from config: the accelerator, the shared run directory, data and the retriever; and
the job machinery of the commands made of many runs (:func:`run_jobs`).

``hkrag.tasks.training`` (``train.py``), ``hkrag.tasks.retrieval`` (``eval.py task=retrieval``) and the
RAG task build on these; entry points only call a task's ``run_*`` function. The replica, Table 6 and the chain
(``python -m hkrag.tasks.replica|table6|chain``) run their ``train.py`` / ``eval.py`` jobs through :func:`run_jobs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from hkrag.cli import existing, usage_errors
from hkrag.data.opendocvqa import ALL_POOL, check_pool_pages, load_corpus, pools
from hkrag.data.synthetic import CONFIG_FILE, SyntheticConfig, generate
from hkrag.io import (
    WriteError,
    atomic_directory,
    local_path,
    read_json,
    repository_locations,
    write_json,
    write_text,
)
from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VProcessor
from hkrag.models.phi3v.loading import save_processor, shipped_manifest, tiny_phi3v
from hkrag.rag.gold_evidence import EVIDENCE_FILE, write_evidence
from hkrag.retrieval.evaluation import RetrievalEvalConfig
from hkrag.retriever import HeadSettings, LoraSettings, Phi3VRetriever
from hkrag.tasks import run_eval_task
from hkrag.tasks.validation import ConfigError
from hkrag.training.checkpoint import (
    ADAPTER_DIR,
    CHECKPOINTS_DIR,
    FINAL_CHECKPOINT,
    STATE_FILE,
    CheckpointError,
    checkpoint_state,
    latest_checkpoint,
)

logger = logging.getLogger(__name__)


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra configs (``train.py`` and ``eval.py`` read them from here)."""


def make_accelerator(cpu: bool, **kwargs: Any) -> Accelerator:
    """An Accelerator on the CPU when asked or when CUDA is absent.

    Under ``accelerate launch`` without GPUs, only a CPU accelerator joins the (gloo) process group;
    otherwise every process would run alone, each thinking it is rank 0. Under a DeepSpeed config without
    CUDA the Accelerator must not be a CPU one (accelerate then ignores DeepSpeed): it gets the backend of
    DeepSpeed's CPU accelerator (gloo, or oneCCL when installed), without which it would see no process group.
    """
    if not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from deepspeed.accelerator import get_accelerator

        backend = InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name())
        return Accelerator(kwargs_handlers=[backend], **kwargs)
    return Accelerator(cpu=cpu or not torch.cuda.is_available(), **kwargs)


def shared_output_dir(accelerator: Accelerator, local_dir: str | Path) -> Path:
    """Rank 0's run directory, broadcast so every rank writes under the same path."""
    chosen = broadcast_object_list([str(local_dir)], from_process=0)[0] if accelerator.num_processes > 1 else local_dir
    return Path(chosen)


def prepare_data(data_cfg: DictConfig) -> None:
    """Generate the built-in synthetic corpus when absent or generated with other settings, with its gold evidence
    (``evidence.jsonl`` beside ``qa/``, :mod:`hkrag.rag.gold_evidence`).

    A folder is regenerated only if it carries the generator's own ``synthetic_config.json`` (so it
    is ours and deterministic from those settings); anything else at that path raises. A corpus already there
    without ``evidence.jsonl`` (``python -m hkrag.data.synthetic`` writes none) gets it (:func:`write_gold_evidence`).
    """
    if data_cfg.get("synthetic") is None:
        return
    root, config = Path(data_cfg.root), SyntheticConfig(**data_cfg.synthetic)
    marker = root / CONFIG_FILE
    if not marker.is_file() or read_json(marker) != dataclasses.asdict(config):
        if root.exists() and any(root.iterdir()):
            if not marker.is_file():
                raise FileExistsError(f"{root} exists but was not written by hkrag.data.synthetic; set data.root "
                                      "elsewhere")
            logger.warning("%s was generated with other settings: regenerating it", root)
        logger.info("generating the built-in synthetic corpus in %s", root)
        with atomic_directory(root) as tmp:  # a failed generation leaves the previous folder (or none)
            generate(tmp, config)
    if not (root / EVIDENCE_FILE).is_file():
        write_gold_evidence(root)


def write_gold_evidence(root: Path) -> None:
    """Write the gold evidence of the built-in corpus at ``root``; a folder that cannot be written is warned about
    (a run then derives the gold evidence from ``pages.jsonl``, as :func:`hkrag.rag.gold_evidence.load_gold` does
    without the file)."""
    try:
        write_evidence(root)
    except WriteError as error:
        logger.warning("gold evidence not written beside the questions (runs derive it): %s", error)


def build_retriever(
    model_cfg: DictConfig, texts: list[str] | None = None, trainable: bool = True, save_base_to: Path | None = None
) -> Phi3VRetriever:
    """The tiny random retriever (``kind: tiny``) or the real checkpoint (``kind: phi3v``).

    ``model.adapter`` continues an existing adapter; otherwise ``model.lora`` adds a new one when
    ``trainable``. ``save_base_to`` writes the random tiny base (before any adapter) so that runs can
    be reloaded like real checkpoints.
    """
    adapter = local_adapter(model_cfg.get("adapter"))
    lora = LoraSettings(**model_cfg.lora) if trainable and model_cfg.get("lora") and not adapter else None
    head = HeadSettings.of(model_cfg)
    if not trainable:
        check_trained_head(model_cfg)
    elif adapter:
        check_adapter_lora(model_cfg)
    if model_cfg.kind == "tiny":
        model, processor = tiny_phi3v(texts=texts or (), num_crops=model_cfg.num_crops, seed=model_cfg.seed,
                                      **model_cfg.get("config", {}))
        if save_base_to is not None:
            save_tiny_base(model, processor, save_base_to)
        return Phi3VRetriever.wrap(model, processor, adapter, lora, trainable, head=head)
    if model_cfg.kind == "phi3v":
        return Phi3VRetriever.from_pretrained(
            model_cfg.base, adapter=adapter, lora=lora, trainable=trainable, num_crops=model_cfg.num_crops,
            dtype=getattr(torch, model_cfg.dtype), attn_implementation=model_cfg.get("attn_implementation"),
            gradient_checkpointing=trainable and model_cfg.gradient_checkpointing, head=head,
        )
    raise ValueError(f"model.kind must be 'tiny' or 'phi3v', got {model_cfg.kind!r}")


def save_tiny_base(model: Phi3VForCausalLM, processor: Phi3VProcessor, directory: Path) -> Path:
    """Write the random tiny base model + processor so ``eval.py`` can load it like a real checkpoint.

    The folder is replaced whole (:func:`hkrag.io.atomic_directory`): a failed write keeps the previous one.
    """
    with atomic_directory(directory) as tmp:
        model.save_pretrained(tmp)
        save_processor(processor, tmp)
    return directory


def eval_config(cfg: DictConfig) -> RetrievalEvalConfig:
    settings = OmegaConf.to_container(cfg.eval, resolve=True)
    return RetrievalEvalConfig(qa_source=cfg.data.qa_source, corpus_source=cfg.data.corpus_source, **settings)


def check_pools(cfg: RetrievalEvalConfig) -> None:
    """Before any encoding: every ``doc_id`` of a data set's own pool names the same page in ``all``
    (:func:`hkrag.data.opendocvqa.check_pool_pages`); only checked when both pools are evaluated."""
    if not {"single", "all"} <= set(cfg.pools):
        return
    union = load_corpus(cfg.corpus_source, ALL_POOL, cfg.split)
    for dataset in cfg.datasets:
        check_pool_pages(load_corpus(cfg.corpus_source, pools(dataset)["single"], cfg.split), union)


FINAL_ADAPTER = Path(CHECKPOINTS_DIR, FINAL_CHECKPOINT, ADAPTER_DIR)
BASE_DIR = "base"
RUN_CONFIG = Path(".hydra", "config.yaml")
"""Where a ``train.py`` (Hydra) run saves the config it ran with."""
TRAIN_RUN = existing("dir", (RUN_CONFIG,), "a train.py run")
"""The argparse ``type`` of a command's ``train.py`` run folder argument."""
"""A tiny-model training run's saved base model (the adapter's base)."""
TRAIN_RUNS = Path("outputs", "train")
UNGROUNDED = "rag.grounding.source=none"
"""The ``eval.py`` override of the batch commands that measure answers and their cost (chain, Table 6): the evidence
step OCRs every kept page (about 1 s a page on the CPU), which would dominate their time; ``bench/grounding.py``
measures grounding."""


def missing_run_dir(run_dir: str | Path) -> str:
    """The message for a ``run_dir`` found nowhere, naming every place looked (absolute paths)."""
    looked = " and ".join(str(path.absolute()) for path in repository_locations(run_dir))
    return f"no such directory (looked in {looked})"


def local_adapter(adapter: str | None) -> str | None:
    """``model.adapter`` as loaded: the repository's folder for a relative path found only there
    (``weights/reader_tiny/checkpoints/final/adapter`` from any folder), else as given (a hub id stays one)."""
    if not adapter:
        return adapter
    return str(next((path for path in repository_locations(adapter) if path.is_dir()), adapter))


def resolve_run_dir(run_dir: str | Path, runs: Path = TRAIN_RUNS) -> Path:
    """Where ``run_dir`` is found (:func:`~hkrag.io.local_path`: as given, else under the repository), or for
    ``latest`` the newest finished ``train.py`` run under ``runs`` (by its stamp)."""
    if str(run_dir) != "latest":
        return local_path(run_dir)
    finished = sorted(path.parent.parent.parent for path in runs.glob(f"*/{FINAL_ADAPTER}") if path.is_dir())
    if not finished:
        raise FileNotFoundError(f"run_dir=latest: no finished train.py run under {runs}; run `python train.py` "
                                "first or give run_dir=PATH")
    return finished[-1]


def trained_model_config(model_cfg: DictConfig, run_dir: str | Path) -> DictConfig:
    """Model config that loads a ``train.py`` run (or ``latest``): its saved tiny base (if any) and final adapter.

    A run of the tiny random model saves its base in ``base/``; a ``model.kind=phi3v`` run names its base in
    its final checkpoint's ``state.json`` and ``model_cfg`` supplies it (a warning if they differ). A run
    lacking ``base/`` whose ``state.json`` does not say ``model.kind=phi3v`` is incomplete and refused
    (``FileNotFoundError`` naming the folder and what is missing) rather than evaluated on another base.
    """
    given, run_dir = run_dir, resolve_run_dir(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run_dir={str(given)!r}: {missing_run_dir(given)}")
    model_cfg = OmegaConf.create(OmegaConf.to_container(model_cfg, resolve=True))  # a tiny model's has no `base`
    adapter = run_dir / FINAL_ADAPTER
    if not adapter.is_dir():
        raise FileNotFoundError(f"{run_dir} has no checkpoints/final/adapter: is it a finished train.py run directory?")
    overrides = {"adapter": str(adapter), **trained_head(run_dir)}
    base = run_dir / BASE_DIR / "config.json"
    if base.is_file():
        overrides.update(kind="phi3v", base=str(base.parent), dtype="float32", num_crops=None)
        return OmegaConf.merge(model_cfg, overrides)
    trained = trained_model(run_dir)
    if trained.get("model.kind") != "phi3v":
        raise FileNotFoundError(
            f"run folder {run_dir} is incomplete: {base} is missing, the base model its adapter was trained on "
            f"(model.kind={trained.get('model.kind')}, a random model saved only there); copy the whole run folder "
            "(base/ and checkpoints/final/) or train again"
        )
    if trained.get("model.base") != model_cfg.get("base"):
        logger.warning("%s was trained on model.base=%s; evaluating its adapter on model.base=%s", run_dir,
                       trained.get("model.base"), model_cfg.get("base"))
    return OmegaConf.merge(model_cfg, overrides)


def trained_head(run_dir: Path) -> dict[str, Any]:
    """The late-interaction head a run trained with (``model.head``, ``model.late_interaction``) as model overrides,
    so ``run_dir=`` evaluates it with its own head (:func:`recorded_head`: its final checkpoint's ``state.json``, or a
    shipped folder's manifest); ``{}`` for a dense run or one that records no head (then ``model.head`` is the
    caller's)."""
    head = recorded_head(run_dir / FINAL_ADAPTER)
    if head is None or not head.late_interaction:
        return {}
    return {"head": head.head, "late_interaction": {"dim": head.dim, "query_augmentation": head.query_augmentation}}


def recorded_head(adapter: str | Path) -> HeadSettings | None:
    """The head an adapter folder was trained with: from its checkpoint's ``state.json`` (``train.py`` writes it
    beside ``adapter/``) or, shipped, from the config its manifest records; ``None`` where neither is there."""
    adapter = Path(adapter)
    if (adapter.parent / STATE_FILE).is_file():
        try:
            config = checkpoint_state(adapter.parent).config
        except CheckpointError:
            return None
        flat = {key: value for key, value in config.items() if key.startswith("model.")}
    else:
        root = next((f for f in adapter.resolve().parents if shipped_manifest(f) is not None), None)
        if root is None:
            return None
        model = (shipped_manifest(root).get("config") or {}).get("model") or {}
        flat = {"model.head": model.get("head"), **{f"model.late_interaction.{k}": v
                                                    for k, v in (model.get("late_interaction") or {}).items()}}
    late = {k.removeprefix("model.late_interaction."): v for k, v in flat.items()
            if k.startswith("model.late_interaction.") and k.rsplit(".", 1)[1] in ("dim", "query_augmentation")}
    return HeadSettings(head=flat.get("model.head") or "dense", **late)


LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules"}
"""``model.lora`` keys and their names in peft's ``adapter_config.json``."""


def check_adapter_lora(model_cfg: DictConfig) -> None:
    """Refuse ``model.lora`` settings other than those of the adapter a run continues (``model.adapter``, a local
    folder): the adapter keeps its own rank, so ``model.lora.r=8`` over a rank-16 adapter would be ignored, silently,
    in a new run and in a resumed one alike. Hub adapters (not readable here) pass."""
    path = Path(str(model_cfg.adapter)) / "adapter_config.json"
    lora = model_cfg.get("lora")
    if lora is None or not path.is_file():
        return
    saved = read_json(path)

    def norm(value: Any) -> Any:
        return sorted(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else value

    differ = [key for key, name in LORA_KEYS.items() if key in lora and name in saved
              and norm(lora[key]) != norm(saved[name])]
    if differ:
        given = ", ".join(f"model.lora.{k}={norm(lora[k])}" for k in differ)
        held = " ".join(f"model.lora.{k}={norm(saved[LORA_KEYS[k]])}" for k in differ)
        raise ConfigError(f"{given}, but model.adapter={model_cfg.adapter} holds {held}: a continued adapter keeps "
                          f"its own LoRA settings, so these would be ignored; pass {held}, or model.adapter=null to "
                          "train a new adapter with yours")


def check_trained_head(model_cfg: DictConfig) -> None:
    """Refuse to evaluate ``model.adapter`` with head settings other than those it was trained with
    (:func:`recorded_head`): a late-interaction adapter queried with another number of augmentation tokens (or
    another head) scores pages with queries it never learned from. The error names every setting to pass."""
    adapter = model_cfg.get("adapter")
    trained = recorded_head(adapter) if adapter else None
    if trained is None:
        return
    asked = HeadSettings.of(model_cfg)
    names = ("head", "dim", "query_augmentation") if trained.late_interaction or asked.late_interaction else ("head",)
    differ = [name for name in names if getattr(asked, name) != getattr(trained, name)]
    if differ:
        key = {"head": "model.head", "dim": "model.late_interaction.dim",
               "query_augmentation": "model.late_interaction.query_augmentation"}
        given = ", ".join(f"{key[n]}={getattr(asked, n)}" for n in differ)
        needed = " ".join(f"{key[n]}={getattr(trained, n)}" for n in names)
        raise ConfigError(f"the adapter {adapter} was trained with other head settings than asked ({given}): evaluate "
                          f"it with {needed} (or run_dir=<its run folder>, which reads them)")


def trained_model(run_dir: Path) -> dict[str, Any]:
    """The ``model.*`` settings a run trained with, from its final checkpoint's ``state.json``."""
    final = run_dir / FINAL_ADAPTER.parent
    try:
        config = checkpoint_state(final).config
    except CheckpointError as error:
        raise FileNotFoundError(
            f"run folder {run_dir} is incomplete: it has no base/ and its {final / STATE_FILE} cannot tell which "
            f"base model the adapter belongs to ({error})"
        ) from error
    return {key: value for key, value in config.items() if key.startswith("model.")}


def evaluated_model(cfg: DictConfig) -> tuple[DictConfig, dict[str, Any]]:
    """The model an evaluation loads (a ``train.py`` run's when ``run_dir`` is set) and the identity its
    embedding shards carry; one definition, so eval.py and the Slurm encoding array share shards."""
    model_cfg = trained_model_config(cfg.model, cfg.run_dir) if cfg.get("run_dir") else cfg.model
    return model_cfg, {"model": str(model_cfg.get("base", "tiny")), "adapter": model_cfg.get("adapter")}


def flat_summary(report: dict[str, Any]) -> dict[str, float]:
    """``{"<before|after>/<dataset>/<pool>/<evidence>/ndcg@5": value}`` of a training report's results."""
    return {key: value for when in ("before", "after") for key, value in flat_metrics(report.get(when), when).items()}


def flat_metrics(results: dict[str, Any] | None, prefix: str) -> dict[str, float]:
    """``{"<prefix>/<dataset>/<pool>/<evidence>/ndcg@5": value}`` of one evaluation's results."""
    return {f"{prefix}/{dataset}/{pool}/{label}/ndcg@5": metrics["ndcg@5"]
            for dataset, by_pool in (results or {}).items() for pool, result in by_pool.items()
            for label, metrics in result.items() if isinstance(metrics, dict)}


# The job machinery of the multi-run commands (hkrag.tasks.replica, .table6, .chain): each job a train.py or
# eval.py run into its own folder, skipped by a rerun once it finished.

REPORT_FILE = "report.json"
"""What a finished ``train.py`` run writes last: a job holding it is done."""

SEED_KEYS = ("trainer.seed", "generator_training.optim.seed")
"""The overrides each run's seed is given by (the retriever's, the generator's)."""


def check_seeds(seeds: Sequence[int], overrides: Sequence[str] = ()) -> None:
    """Refuse seeds that would count one run as several independent ones in the intervals: a seed given twice
    (``--seeds 0 0 1``), or an override fixing every run's seed (``trainer.seed=3``), naming them."""
    repeated = sorted({seed for seed in seeds if list(seeds).count(seed) > 1})
    if repeated:
        raise ValueError(f"seeds {list(seeds)} repeat {repeated}: each seed is one independent run in the intervals "
                         "(seeds x queries), so a repeated seed would be counted twice; give distinct seeds")
    fixed = [item for item in overrides if item.lstrip("+~").split("=", 1)[0] in SEED_KEYS]
    if fixed:
        raise ValueError(f"the override(s) {fixed} give every run the same seed, which the seeds {list(seeds)} must "
                         "vary: drop them (the seeds set them per run)")


def generator_conf(name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``conf/generator/<name>.yaml`` as ``eval.py generator=<name>`` composes it, with Hydra ``overrides`` of its
    keys (``threshold=0.4``; an unknown key is refused by name), resolved."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"generator={name}", *(f"generator.{override}" for override in overrides)])
    return OmegaConf.to_container(cfg.generator, resolve=True)


PIECES_FILE = "pieces.json"
"""A job's pieces: the seconds of each sitting that ran it (:func:`run_job`)."""


def run_job(folder: Path, overrides: Sequence[str], config: str = "train", done: str = REPORT_FILE) -> float:
    """``train.py`` (``eval.py`` with ``config="eval"``) with ``overrides`` into ``folder`` unless it finished there
    (``done`` exists); returns the seconds it took (0: skipped). An unfinished ``train.py`` run of the same
    overrides with a finished checkpoint continues from its latest one (``resume=latest``, exact: the trainers'
    resume tests), so a run too long for one sitting trains in pieces; anything else unfinished starts again. The
    seconds are every piece's (a piece stopped by an exception, Ctrl-C included, counts up to its stop), kept in
    the folder's :data:`PIECES_FILE`."""
    if (folder / done).is_file():
        return 0.0
    resume = config == "train" and resumable(folder, overrides)
    if not resume:
        shutil.rmtree(folder, ignore_errors=True)
    pieces = read_json(folder / PIECES_FILE) if resume and (folder / PIECES_FILE).is_file() else []
    start = time.perf_counter()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config, [*overrides, *(["resume=latest"] if resume else []), f"paths.output_dir={folder}"])
        (folder / ".hydra").mkdir(parents=True, exist_ok=True)
        write_text(folder / ".hydra" / "overrides.yaml", yaml.safe_dump(list(overrides)))
        write_text(folder / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))  # as Hydra saves it (ship records it)
        if config == "train":
            instantiate(cfg.run)(cfg, folder)  # what train.py does: the retriever's or the generator's training
        else:
            run_eval_task(cfg, folder)
    finally:
        pieces.append(time.perf_counter() - start)
        if folder.is_dir():
            write_json(folder / PIECES_FILE, pieces)
    return sum(pieces)


def resumable(folder: Path, overrides: Sequence[str]) -> bool:
    """Whether ``folder`` holds an unfinished ``train.py`` run of these ``overrides`` with a finished checkpoint."""
    started = folder / ".hydra" / "overrides.yaml"
    return (started.is_file() and yaml.safe_load(started.read_text()) == list(overrides)
            and latest_checkpoint(folder) is not None)


Job = tuple[Path, list[str], str, str]
"""``run_job``'s arguments: folder, overrides, config name and the file a finished run holds."""


Runner = Callable[[Path, Sequence[str], str, str], float]
"""What runs one job (:func:`run_job`; a module-level function, as spawned workers import it)."""


def run_jobs(jobs: Sequence[Job], workers: int = 1, desc: str = "replica jobs",
             needs: Mapping[Path, Sequence[Path]] | None = None, runner: Runner | None = None
             ) -> Iterator[tuple[str, float]]:
    """Run the unfinished ``jobs`` (one after the other, or ``workers`` processes side by side) and yield each one's
    ``(folder name, seconds)`` as it finishes. ``needs`` maps a job's folder to the folders of the jobs it needs
    (a chain: a reader, then the generator trained from it): a job starts once those have finished, in this call or
    before, so a chain's next job starts when its own previous one ends, not when a whole stage does; ready jobs
    start in the order given. A failing job stops the rest: running ones finish, queued ones are dropped, and the
    error is raised (a rerun resumes). ``ValueError`` for a need that names no job, or needs that form a cycle.
    ``runner`` runs one job (default :func:`run_job`). SIGTERM stops it as Ctrl-C does, and so does SIGINT where
    the shell started it ignored (a background job): every running job ends through its ``finally`` (a training
    run's piece is recorded), side by side ones too, and ``KeyboardInterrupt`` is raised."""
    waits, runner = _waits(jobs, needs or {}), runner or run_job
    todo = [job for job in jobs if not _finished(job)]
    with _stoppable(), tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc, unit="job") as progress:
        finished = (_side_by_side(todo, workers, waits, runner) if workers > 1 and len(todo) > 1
                    else _in_turn(todo, waits, runner))
        for name, seconds in finished:
            progress.update()
            yield name, seconds


def _finished(job: Job) -> bool:
    return (job[0] / job[3]).is_file()


def _waits(jobs: Sequence[Job], needs: Mapping[Path, Sequence[Path]]) -> dict[Path, set[Path]]:
    """Each job's unfinished needs (a finished one is met already); refuses needs naming no job, and cycles."""
    by_folder = {job[0]: job for job in jobs}
    unknown = sorted(str(need) for folder in needs for need in [folder, *needs[folder]] if need not in by_folder)
    if unknown:
        raise ValueError(f"needs name folders that are no job's: {unknown[:3]}")
    waits = {job[0]: {need for need in needs.get(job[0], ()) if not _finished(by_folder[need])} for job in jobs}
    met: set[Path] = set()
    while len(met) < len(waits):
        ready = {folder for folder, wanted in waits.items() if folder not in met and wanted <= met}
        if not ready:
            raise ValueError(f"the jobs' needs form a cycle: {sorted(str(f) for f in waits if f not in met)[:3]}")
        met |= ready
    return waits


def _ready(pending: Sequence[Job], waits: Mapping[Path, set[Path]], done: set[Path]) -> list[Job]:
    return [job for job in pending if waits[job[0]] <= done]


def _in_turn(jobs: Sequence[Job], waits: Mapping[Path, set[Path]], runner: Runner) -> Iterator[tuple[str, float]]:
    pending, done = list(jobs), set()
    while pending:
        job = _ready(pending, waits, done)[0]
        pending.remove(job)
        seconds = runner(*job)
        done.add(job[0])
        yield job[0].name, seconds


def _side_by_side(jobs: Sequence[Job], workers: int, waits: Mapping[Path, set[Path]], runner: Runner
                  ) -> Iterator[tuple[str, float]]:
    threads = max(1, (os.cpu_count() or 1) // workers)  # more would spin-wait on shared cores (docs/training.md)
    pending, done, running = list(jobs), set(), {}
    with ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker, (threads,)) as pool:
        try:
            while pending or running:
                for job in _ready(pending, waits, done)[:workers - len(running)]:
                    pending.remove(job)
                    running[pool.submit(_run_stoppably, runner, *job)] = job[0]
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    folder = running.pop(future)
                    seconds = future.result()
                    done.add(folder)
                    yield folder.name, seconds
        except KeyboardInterrupt:
            for worker in multiprocessing.active_children():  # a Ctrl-C from a terminal reached them already
                worker.terminate()
            raise
        finally:
            pool.shutdown(cancel_futures=True)


STOPS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run of jobs through their ``finally`` (:func:`run_jobs`)."""


def _interrupt(signum: int, frame: Any) -> None:
    """Raise ``KeyboardInterrupt`` for a stop signal, ignoring further ones so that no ``finally`` is cut short."""
    for stop in STOPS:
        signal.signal(stop, signal.SIG_IGN)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def _stoppable() -> Iterator[None]:
    """Within it, SIGINT and SIGTERM raise ``KeyboardInterrupt`` (once); the handlers before are restored after.
    Only the main thread can set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {stop: signal.signal(stop, _interrupt) for stop in STOPS}
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)


def _start_worker(threads: int) -> None:
    """A side-by-side worker: ``threads`` threads, stop signals ignored between jobs (an idle worker killed by
    one would break the pool, which then kills the others mid-``finally``)."""
    torch.set_num_threads(threads)
    for stop in STOPS:
        signal.signal(stop, signal.SIG_IGN)


def _run_stoppably(runner: Runner, *job: Any) -> float:
    """``runner(*job)`` in a worker, stopped through its ``finally`` by SIGINT or SIGTERM."""
    with _stoppable():
        return runner(*job)


TIMINGS_FILE = "timings.json"


def read_timings(out: Path) -> dict[str, float]:
    """The compute recorded in ``out`` so far (``{}`` before the first run)."""
    path = out / TIMINGS_FILE
    return read_json(path) if path.is_file() else {}


def record_time(timings: dict[str, float], out: Path, name: str, seconds: float) -> None:
    """Record a part's compute in ``out``'s timings (a skipped part keeps the time it took when it ran)."""
    if seconds:
        timings[name] = seconds
        write_json(out / TIMINGS_FILE, timings)


def invocation(module: str, argv: Sequence[str] | None) -> str:
    """The command line a batch command was started with (recorded in its report)."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def run_report_command(parser: argparse.ArgumentParser, make_config: Callable[[], Any],
                       run: Callable[[Any], dict[str, Any]], refused: type[Exception],
                       markdown: Callable[[Any], Path]) -> dict[str, Any]:
    """A batch command's run from its parsed arguments: a bad setting (``ValueError`` from ``make_config``) is a
    usage error, a ``refused`` run exits 2 naming why, and the report's Markdown (``markdown(config)``) is printed."""
    try:
        config = make_config()
    except ValueError as error:
        parser.error(str(error))
    with usage_errors(parser, refused):
        report = run(config)
    print(markdown(config).read_text())
    return report
