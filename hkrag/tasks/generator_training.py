"""``python train.py experiment=generator_tiny|generator_vdocrag``: fine-tune the generator (VDocGenerator's
recipe, DESIGN §11, docs/training.md "Generator fine-tuning (VDocGenerator)").

Data (the built-in corpus is generated on first use); the training top-k of every training query
(``generator_training.pages``: ``retrieved`` by a retriever as VDocRAG does, or ``gold``), kept in
``generator_pairs.jsonl``; the base model (the tiny random one is saved in ``base/``; with
``generator_training.init_from=<train.py run>`` that run's base with its adapter merged in, saved there) with a fresh
LoRA; training on the single-pass baseline's own prompt; the final adapter in
``checkpoints/final/adapter``, which ``lvlm=phi3v lvlm.base=<base> lvlm.adapter=<adapter>`` serves
(``report.json`` names both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from hkrag.data.generator_pairs import GeneratorPair
from hkrag.data.opendocvqa import Corpus, QAExample, load_corpus, load_qa
from hkrag.data.splits import ValidationSplit
from hkrag.io import write_json
from hkrag.lvlm import LVLMRequest, PageImage
from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VProcessor
from hkrag.models.phi3v.loading import load_phi3v, load_processor, tiny_phi3v
from hkrag.rag.records import QueryTruth
from hkrag.rag.step_report import page_truth, query_truth
from hkrag.retrieval.generator_pairs import build_generator_pairs
from hkrag.retriever import LoraSettings, Phi3VRetriever, enable_checkpointing, load_adapter
from hkrag.run_log import RunLogger
from hkrag.tasks.common import BASE_DIR, build_retriever, prepare_data, save_tiny_base, trained_model_config
from hkrag.tasks.rag import generator_problems, question_text
from hkrag.tasks.validation import validate_config
from hkrag.training.checkpoint import ADAPTER_DIR, FINAL_CHECKPOINT, resolve_resume
from hkrag.training.generator import (
    GeneratorDataset,
    GeneratorTrainer,
    GeneratorTrainerConfig,
    RequestDataset,
    causal_lm_lora,
    single_pass_prompt,
)

PAIRS_FILE = "generator_pairs.jsonl"


def generator_base(model_cfg: DictConfig, texts: Sequence[str], save_to: Path,
                   save: bool = True) -> tuple[Phi3VForCausalLM, Phi3VProcessor, str]:
    """The model to fine-tune, its processor and the base folder/id that serves it (a tiny one is saved, unless
    ``save`` is false: a resumed run keeps the folder its checkpoints were trained on)."""
    if model_cfg.kind == "tiny":
        model, processor = tiny_phi3v(texts=texts, num_crops=model_cfg.num_crops, seed=model_cfg.seed,
                                      **model_cfg.get("config", {}))
        return model, processor, str(save_tiny_base(model, processor, save_to) if save else save_to)
    if model_cfg.kind == "phi3v":
        model = load_phi3v(model_cfg.base, dtype=getattr(torch, model_cfg.dtype),
                           attn_implementation=model_cfg.get("attn_implementation"))
        return model, load_processor(model_cfg.base, model_cfg.num_crops), str(model_cfg.base)
    raise ValueError(f"model.kind must be 'tiny' or 'phi3v', got {model_cfg.kind!r}")


def merged_base(run_dir: str | Path, model_cfg: DictConfig, save_to: Path,
                save: bool = True) -> tuple[Phi3VForCausalLM, Phi3VProcessor, str]:
    """A ``train.py`` run's base with its final adapter merged in (``generator_training.init_from``), saved to
    ``save_to`` (when ``save``) as the generator's base: the generator starts from the weights a retriever learned
    to read with."""
    settings = trained_model_config(model_cfg, run_dir)
    model = load_phi3v(settings.base, dtype=getattr(torch, settings.dtype),
                       attn_implementation=settings.get("attn_implementation"))
    model = load_adapter(model, settings.adapter).merge_and_unload()
    processor = load_processor(settings.base, settings.num_crops)
    return model, processor, str(save_tiny_base(model, processor, save_to) if save else save_to)


def training_retriever(settings: DictConfig) -> tuple[Phi3VRetriever, dict[str, Any]]:
    """The retriever ranking the training pages (``generator_training.retriever``: a ``train.py`` ``run_dir``
    or ``model`` settings) and its identity (base, adapter)."""
    model_cfg = settings.model
    if settings.get("run_dir"):
        model_cfg = trained_model_config(model_cfg, settings.run_dir)
    identity = {"model": str(model_cfg.get("base", "tiny")), "adapter": model_cfg.get("adapter"),
                "seed": model_cfg.get("seed")}
    return build_retriever(model_cfg, trainable=False), identity


RESUMABLE_KEYS = ("log_every", "save_every", "num_workers")
"""Optimizer settings a resumed run may change (the others fix the data order and the optimisation)."""


def page_sources(gen: DictConfig) -> list[str]:
    """``generator_training.pages``: one source (``gold``, ``retrieved`` or ``sampled``: page sets drawn from the
    retriever's top ``generator_training.sampled.depth``) or a list of them (each query then trains on each of its
    page sets: the agents' curriculum)."""
    return [gen.pages] if isinstance(gen.pages, str) else list(gen.pages)


def training_page_sets(cfg: DictConfig, qa: Sequence[QAExample], corpus: Corpus,
                       output_dir: Path) -> dict[str, list[GeneratorPair]]:
    """Each page source's pairs for ``qa``, built once into the run folder and reused by a rerun
    (``generator_pairs.jsonl`` for one source, ``generator_pairs_<source>.jsonl`` for several)."""
    gen, sources = cfg.generator_training, page_sources(cfg.generator_training)
    if len(sources) > 1 and not gen.get("curriculum"):
        raise ValueError(f"generator_training.pages={sources}: several page sources need generator_training.curriculum"
                         " (the single-pass recipe trains on one)")
    sets = {}
    sampling = gen.get("sampled")
    sampling = OmegaConf.to_container(sampling, resolve=True) if isinstance(sampling, DictConfig) else sampling
    for source in sources:
        identity = training_retriever(gen.retriever)[1] if source != "gold" else None
        path = output_dir / (PAIRS_FILE if len(sources) == 1 else f"generator_pairs_{source}.jsonl")
        sets[source] = build_generator_pairs(path, qa, corpus, source, cfg.generator.top_k, question_text,
                                             retriever=lambda: training_retriever(gen.retriever)[0], identity=identity,
                                             sampling=sampling)
    return sets


def curriculum_examples(cfg: DictConfig, curriculum: Any, sets: dict[str, list[GeneratorPair]],
                        truths: dict[str, QueryTruth], corpus: Corpus, split: ValidationSplit | None,
                        seed: int = 0) -> list[tuple[str, tuple[str, LVLMRequest, str]]]:
    """The curriculum's examples of the queries of ``truths`` on each of their page sets (held-out pages dropped:
    no page of a validation group is in any training example), resampled as the curriculum's mixture says
    (``curriculum.select`` with ``seed``: balanced Pruner labels, a dedicated stage's share), as
    ``(step, (query_id, request, target))``."""
    items = page_truth(cfg.data.root, cfg.data.train.split) if curriculum.needs_items else None
    pages: dict[str, PageImage] = {}

    def page(doc_id: str) -> PageImage:
        if doc_id not in pages:
            pages[doc_id] = PageImage(corpus[doc_id].image, doc_id)
        return pages[doc_id]

    page_sets: dict[str, list[list[PageImage]]] = {query_id: [] for query_id in truths}
    for pairs in sets.values():
        for pair in pairs:
            if pair.query_id in truths:
                kept = [doc_id for doc_id in pair.doc_ids if split is None or not split.held_out(doc_id)]
                page_sets[pair.query_id].append([page(doc_id) for doc_id in kept])
    examples = [example for query_id, truth in tqdm(truths.items(), desc="curriculum", leave=False)
                for example in curriculum.examples(truth, truth.question, page_sets[query_id], items)]
    return [(example.step, (example.query_id, example.request, example.target))
            for example in curriculum.select(examples, seed)]


def run_generator_training(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Build the training top-k, fine-tune the generator's LoRA and save it; returns the report."""
    validate_config(cfg, extra=generator_problems(cfg))
    output_dir, gen = Path(output_dir), cfg.generator_training
    torch.manual_seed(gen.optim.seed)
    prepare_data(cfg.data)
    qa = load_qa(cfg.data.qa_source, cfg.data.train.qa_config, cfg.data.train.split)[: gen.max_queries or None]
    corpus = load_corpus(cfg.data.corpus_source, cfg.data.train.corpus_config, cfg.data.train.split)
    sets = training_page_sets(cfg, qa, corpus, output_dir)
    split = ValidationSplit(**gen.validation) if gen.get("validation") else None
    train_qa, validation_qa = split.split(qa) if split else (list(qa), [])
    trained = {example.query_id for example in train_qa}
    pairs = [pair for pair in next(iter(sets.values())) if pair.query_id in trained]
    if gen.get("curriculum"):
        curriculum = instantiate(gen.curriculum, generator=OmegaConf.to_container(cfg.generator, resolve=True),
                                 _convert_="all")
        truths = {example.query_id: query_truth(example) for example in train_qa}
        tagged = curriculum_examples(cfg, curriculum, sets, truths, corpus, split, gen.optim.seed)
        dataset, steps = RequestDataset([example for _, example in tagged]), list(curriculum.steps)
        per_step = dict(Counter(step for step, _ in tagged))
        pruner_targets = dict(Counter(target for step, (_, _, target) in tagged if step == "pruner"))
        texts = [target for _, (_, _, target) in tagged]
    else:
        dataset, steps = GeneratorDataset(pairs, corpus, single_pass_prompt(cfg.generator)), ["single_pass"]
        per_step, texts, pruner_targets = {"single_pass": len(pairs)}, [], {}
    resume = resolve_resume(cfg.get("resume"), output_dir)
    save = resume is None or not (output_dir / BASE_DIR).is_dir()  # a resume refused for another base keeps base/
    if gen.get("init_from"):
        model, processor, base = merged_base(gen.init_from, cfg.model, output_dir / BASE_DIR, save)
    else:
        texts += [text for pair in pairs for text in (pair.question, *pair.answers)]  # a tiny base's vocabulary
        model, processor, base = generator_base(cfg.model, texts, output_dir / BASE_DIR, save)
    device = torch.device(gen.device if gen.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = causal_lm_lora(model, LoraSettings(**cfg.model.lora)).to(device)
    if cfg.model.get("gradient_checkpointing") and device.type == "cuda":
        enable_checkpointing(model)
    run_logger = RunLogger(output_dir, project=cfg.logger.project, wandb_mode=cfg.logger.wandb_mode,
                           config=OmegaConf.to_container(cfg, resolve=True), name=cfg.get("run_name"))
    config = GeneratorTrainerConfig(**OmegaConf.to_container(gen.optim, resolve=True))
    run_config = {"base": base, **({"init_from": str(gen.init_from)} if gen.get("init_from") else {}),
                  "pages": gen.pages if isinstance(gen.pages, str) else page_sources(gen),
                  "top_k": cfg.generator.top_k, "examples": len(dataset),
                  **({"trained_steps": steps} if gen.get("curriculum") else {}),
                  **{f"optim.{k}": v for k, v in OmegaConf.to_container(gen.optim, resolve=True).items()
                     if k not in RESUMABLE_KEYS}}
    trainer = GeneratorTrainer(model, processor, dataset, config, output_dir, run_logger, run_config=run_config)
    if resume:
        trainer.resume(resume)
    trainer.fit()
    final = trainer.save(FINAL_CHECKPOINT)
    report = {"steps": trainer.state.step, "examples": len(dataset), "examples_per_step": per_step,
              **({"pruner_targets": pruner_targets} if pruner_targets else {}),
              "trained_steps": steps, "queries": len(trained),
              "validation_queries": [example.query_id for example in validation_qa],
              "pages": gen.pages if isinstance(gen.pages, str) else page_sources(gen), "base": base,
              "adapter": str(final / ADAPTER_DIR),
              "serve": f"lvlm=phi3v lvlm.base={base} lvlm.adapter={final / ADAPTER_DIR}"}
    write_json(output_dir / "report.json", report)
    run_logger.finish()
    print(f"generator adapter: {final / ADAPTER_DIR}\nserve it with: {report['serve']}")
    return report
