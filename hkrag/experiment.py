"""Compose runs from Hydra configs: what ``train.py`` and ``eval.py`` call (DESIGN §9).

Training: one shared run directory for all ranks; data (the built-in corpus is generated on first
use); retriever (tiny random model or the real checkpoint, optionally starting from an existing
adapter); loss; retrieval evaluation before training; training; a final checkpoint; evaluation after;
a report (``report.json`` + ``report.md``) written by rank 0.

Evaluation: a retriever (base + adapter, or a training run's directory) evaluated by the same
:func:`hkrag.evaluation.evaluate_retrieval` the training report used.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from omegaconf import DictConfig, OmegaConf

from hkrag.data.opendocvqa import load_corpus, load_qa, training_pairs
from hkrag.data.synthetic import CONFIG_FILE, SyntheticConfig, generate
from hkrag.evaluation import RetrievalEvalConfig, evaluate_retrieval
from hkrag.index.shards import config_hash
from hkrag.losses import HybridMaskLoss
from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VProcessor
from hkrag.models.phi3v.loading import save_processor, tiny_phi3v
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.training.checkpoint import latest_checkpoint
from hkrag.training.reporting import RunLogger
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig

logger = logging.getLogger(__name__)


def make_accelerator(cpu: bool, **kwargs: Any) -> Accelerator:
    """An Accelerator on the CPU when asked or when CUDA is absent.

    Under ``accelerate launch`` without GPUs, only a CPU accelerator joins the (gloo) process group;
    otherwise every process would run alone, each thinking it is rank 0.
    """
    return Accelerator(cpu=cpu or not torch.cuda.is_available(), **kwargs)


def shared_output_dir(accelerator: Accelerator, local_dir: str | Path) -> Path:
    """Rank 0's run directory, broadcast so every rank writes under the same path."""
    chosen = broadcast_object_list([str(local_dir)], from_process=0)[0] if accelerator.num_processes > 1 else local_dir
    return Path(chosen)


def prepare_data(data_cfg: DictConfig) -> None:
    """Generate the built-in synthetic corpus when absent or generated with other settings.

    A folder is regenerated only if it carries the generator's own ``synthetic_config.json`` (so it
    is ours and deterministic from those settings); anything else at that path raises.
    """
    if data_cfg.get("synthetic") is None:
        return
    root, config = Path(data_cfg.root), SyntheticConfig(**data_cfg.synthetic)
    marker = root / CONFIG_FILE
    if marker.is_file() and json.loads(marker.read_text()) == dataclasses.asdict(config):
        return
    if root.exists() and any(root.iterdir()):
        if not marker.is_file():
            raise FileExistsError(f"{root} exists but was not written by hkrag.data.synthetic; set data.root elsewhere")
        logger.warning("%s was generated with other settings: regenerating it", root)
        shutil.rmtree(root)
    logger.info("generating the built-in synthetic corpus in %s", root)
    generate(root, config)


def build_retriever(
    model_cfg: DictConfig, texts: list[str] | None = None, trainable: bool = True, save_base_to: Path | None = None
) -> Phi3VRetriever:
    """The tiny random retriever (``kind: tiny``) or the real checkpoint (``kind: phi3v``).

    ``model.adapter`` continues an existing adapter; otherwise ``model.lora`` adds a new one when
    ``trainable``. ``save_base_to`` writes the random tiny base (before any adapter) so that runs can
    be reloaded like real checkpoints.
    """
    adapter = model_cfg.get("adapter")
    lora = LoraSettings(**model_cfg.lora) if trainable and model_cfg.get("lora") and not adapter else None
    if model_cfg.kind == "tiny":
        model, processor = tiny_phi3v(texts=texts or (), num_crops=model_cfg.num_crops, seed=model_cfg.seed,
                                      **model_cfg.get("config", {}))
        if save_base_to is not None:
            save_tiny_base(model, processor, save_base_to)
        return Phi3VRetriever.wrap(model, processor, adapter, lora, trainable)
    if model_cfg.kind == "phi3v":
        return Phi3VRetriever.from_pretrained(
            model_cfg.base, adapter=adapter, lora=lora, trainable=trainable, num_crops=model_cfg.num_crops,
            dtype=getattr(torch, model_cfg.dtype), attn_implementation=model_cfg.get("attn_implementation"),
            gradient_checkpointing=trainable and model_cfg.gradient_checkpointing,
        )
    raise ValueError(f"model.kind must be 'tiny' or 'phi3v', got {model_cfg.kind!r}")


def save_tiny_base(model: Phi3VForCausalLM, processor: Phi3VProcessor, directory: Path) -> Path:
    """Write the random tiny base model + processor so ``eval.py`` can load it like a real checkpoint."""
    model.save_pretrained(directory)
    save_processor(processor, directory)
    return directory


def trainer_config(cfg: DictConfig) -> TrainerConfig:
    """``trainer`` + ``optim`` groups as a :class:`TrainerConfig` (``precision``/``cpu`` go to accelerate)."""
    values = {**OmegaConf.to_container(cfg.trainer, resolve=True), **OmegaConf.to_container(cfg.optim, resolve=True)}
    values["betas"] = tuple(values["betas"])
    return TrainerConfig(**{k: v for k, v in values.items() if k not in ("precision", "cpu")})


def eval_config(cfg: DictConfig) -> RetrievalEvalConfig:
    settings = OmegaConf.to_container(cfg.eval, resolve=True)
    return RetrievalEvalConfig(qa_source=cfg.data.qa_source, corpus_source=cfg.data.corpus_source, **settings)


def run_training(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Train and evaluate as ``cfg`` says; returns the report (rank 0) or ``{}``."""
    accelerator = make_accelerator(cfg.trainer.get("cpu", False), mixed_precision=cfg.trainer.precision)
    output_dir = shared_output_dir(accelerator, output_dir)
    set_seed(cfg.trainer.seed)
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()

    train_qa = load_qa(cfg.data.qa_source, cfg.data.train.qa_config, cfg.data.train.split)
    corpus = load_corpus(cfg.data.corpus_source, cfg.data.train.corpus_config, cfg.data.train.split)
    pairs = training_pairs(train_qa, corpus)
    tiny_base = output_dir / "base" if cfg.model.kind == "tiny" and accelerator.is_main_process else None
    retriever = build_retriever(cfg.model, texts=[ex.query for ex in train_qa], save_base_to=tiny_base)
    base = output_dir / "base" if cfg.model.kind == "tiny" else cfg.model.base
    identity = {"model": str(base), "config": OmegaConf.to_container(cfg.model)}

    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"),
                           enabled=accelerator.is_main_process)
    trainer_cfg = trainer_config(cfg)
    loss_fn = HybridMaskLoss(**cfg.loss)
    trainer = RetrieverTrainer(retriever, loss_fn, pairs, corpus, trainer_cfg, accelerator, output_dir, run_logger)
    resume = _resume_path(cfg.get("resume"), output_dir)
    if resume:
        trainer.resume(resume)

    evaluate = cfg.eval_before_after and cfg.get("eval") is not None
    before = _evaluate(retriever, cfg, output_dir / "eval-before", identity) if evaluate and not resume else None
    trainer.fit()
    final = trainer.save("final")
    identity["adapter"] = str(final / "adapter")
    after = _evaluate(retriever, cfg, output_dir / "eval-after", identity) if evaluate else None

    report = {}
    if accelerator.is_main_process:
        report = write_report(output_dir, cfg, before, after, trainer.state.step, final)
        run_logger.summary(_flat_summary(report))
    run_logger.finish()
    accelerator.wait_for_everyone()
    return report


def _resume_path(resume: str | None, output_dir: Path) -> Path | None:
    if not resume:
        return None
    if resume == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise FileNotFoundError(f"resume=latest but {output_dir}/checkpoints holds no finished checkpoint")
        return found
    return Path(resume)


def _evaluate(retriever: Phi3VRetriever, cfg: DictConfig, work_dir: Path, identity: dict) -> dict | None:
    return evaluate_retrieval(retriever, eval_config(cfg), work_dir, identity) or None


def write_report(output_dir: Path, cfg: DictConfig, before: dict | None, after: dict | None, steps: int,
                 checkpoint: Path) -> dict[str, Any]:
    """``report.json`` and ``report.md`` with the before/after retrieval tables."""
    report = {"steps": steps, "checkpoint": str(checkpoint), "config_hash": config_hash(OmegaConf.to_container(cfg)),
              "before": before and before["results"], "after": after and after["results"]}
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Retriever training report\n\nsteps: {steps}; checkpoint: `{checkpoint}`\n"]
    for title, result in (("Before training", before), ("After training", after)):
        if result:
            lines += [f"## {title}\n", result["table"], ""]
    text = "\n".join(lines)
    (output_dir / "report.md").write_text(text)
    print(text)
    return report


def _flat_summary(report: dict[str, Any]) -> dict[str, float]:
    out = {}
    for when in ("before", "after"):
        for dataset, by_pool in (report.get(when) or {}).items():
            for pool, result in by_pool.items():
                for label, metrics in result.items():
                    if isinstance(metrics, dict):
                        out[f"{when}/{dataset}/{pool}/{label}/ndcg@5"] = metrics["ndcg@5"]
    return out


def trained_model_config(model_cfg: DictConfig, run_dir: str | Path) -> DictConfig:
    """Model config that loads a ``train.py`` run: its saved tiny base (if any) and final adapter."""
    run_dir = Path(run_dir)
    adapter = run_dir / "checkpoints" / "final" / "adapter"
    if not adapter.is_dir():
        raise FileNotFoundError(f"{run_dir} has no checkpoints/final/adapter: is it a finished train.py run directory?")
    overrides = {"adapter": str(adapter)}
    if (run_dir / "base" / "config.json").is_file():
        overrides.update(kind="phi3v", base=str(run_dir / "base"), dtype="float32", num_crops=None)
    return OmegaConf.merge(model_cfg, overrides)


def run_evaluation(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """``eval.py task=retrieval``: encode, search single and all pools, write ``retrieval.{json,md}``."""
    if cfg.task != "retrieval":
        raise ValueError(f"task={cfg.task!r} is not available yet; use task=retrieval")
    accelerator = make_accelerator(cfg.get("cpu", False))
    output_dir = shared_output_dir(accelerator, output_dir)
    model_cfg = trained_model_config(cfg.model, cfg.run_dir) if cfg.get("run_dir") else cfg.model
    if accelerator.is_main_process:
        prepare_data(cfg.data)
    accelerator.wait_for_everyone()
    retriever = build_retriever(model_cfg, trainable=False)
    retriever.model.to(accelerator.device)
    identity = {"model": str(model_cfg.get("base", "tiny")), "adapter": model_cfg.get("adapter")}
    result = evaluate_retrieval(retriever, eval_config(cfg), output_dir, identity)
    if accelerator.is_main_process:
        (output_dir / "retrieval.json").write_text(json.dumps(result["results"], indent=2))
        (output_dir / "retrieval.md").write_text(result["table"] + "\n")
        print(result["table"])
        run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                               config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
        run_logger.summary(_flat_summary({"after": result["results"]}))
        run_logger.finish()
    return result
