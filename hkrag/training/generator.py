"""Generator fine-tuning, VDocGenerator's recipe (DESIGN §11, docs/training.md "Generator fine-tuning").

Phi-3-vision with LoRA learns to answer from the top-k pages of each training query. The input is the
single-pass baseline's prompt, byte for byte (the caller renders it, :mod:`hkrag.tasks.generator_training`),
followed by the target ``"{answers[0]}<|end|>\\n<|endoftext|>"``; every prompt token (page placeholders
included) is labelled −100, so the causal-LM loss is the mean negative log-likelihood of the target tokens
only. Batches are right-padded (pads labelled −100; positions come from the attention mask, so either
side is safe). AdamW, ``batch_size`` × ``grad_accum`` examples per optimizer step (paper: 2 × 4), lr 1e-4,
one epoch; checkpoints are :func:`hkrag.training.checkpoint.save_checkpoint`'s, atomic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from peft import PeftModel, TaskType, get_peft_model
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import get_scheduler

from hkrag.data.collators import GENERATION_SUFFIX, IGNORE_INDEX
from hkrag.data.generator_pairs import GeneratorPair
from hkrag.data.opendocvqa import Corpus
from hkrag.lvlm.base import LVLMRequest, PageImage
from hkrag.lvlm.phi3v import phi3_chat
from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VProcessor
from hkrag.retriever import LoraSettings, freeze_unreachable, log_lora_modules
from hkrag.run_log import RunLogger
from hkrag.training.checkpoint import (
    CHECKPOINTS_DIR,
    TrainState,
    check_finite,
    load_checkpoint,
    model_identity,
    rng_state,
    save_checkpoint,
)

PromptRenderer = Callable[[str, Sequence[PageImage]], str]
"""``(question, pages) -> prompt``: the full chat prompt the single-pass baseline sends for these pages."""


def single_pass_prompt(generator_cfg: DictConfig) -> PromptRenderer:
    """The chat prompt the single-pass baseline sends for a question and its pages: its template
    (``generator.prompts.single_pass``, filled as ``agents.prompts.Prompts.render`` fills it), one user turn
    of pages then text (as ``agents.prompts.build_request``) and the backend's Phi-3 rendering (``phi3_chat``).
    ``agents`` is named only at the composition root, so tests/test_generator_training.py checks this against
    the request the single-pass generator really sends, byte for byte."""
    template = str(generator_cfg.prompts.single_pass)

    def render(question: str, pages: Sequence[PageImage]) -> str:
        return phi3_chat(LVLMRequest.user(*pages, template.format(question=question)).messages)

    return render



def target_text(answer: str) -> str:
    """VDocGenerator's supervised text for one query: its first gold answer, ``<|end|>``, ``<|endoftext|>``."""
    return f"{answer}{GENERATION_SUFFIX}"


def causal_lm_lora(model: Phi3VForCausalLM, lora: LoraSettings) -> PeftModel:
    """``model`` with a fresh causal-LM LoRA adapter (the retriever's target names, ``model.lora``)."""
    config = lora.peft_config()
    config.task_type = TaskType.CAUSAL_LM
    model = get_peft_model(model, config)
    freeze_unreachable(model)
    log_lora_modules(model)
    return model


def encode_example(processor: Phi3VProcessor, prompt: str, num_img_tokens: Sequence[int],
                   answer: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + target and labels: −100 on every prompt token, the target's ids on the rest.

    The prompt is tokenised as at inference (:meth:`Phi3VProcessor.prompt_ids`), the target alone without
    special tokens, so the labels are exactly the ids a greedy decoder must produce after the prompt.
    """
    prompt_ids = processor.prompt_ids(prompt, num_img_tokens)
    target_ids = processor.tokenizer(target_text(answer), add_special_tokens=False)["input_ids"]
    return prompt_ids + target_ids, [IGNORE_INDEX] * len(prompt_ids) + target_ids


@dataclass(frozen=True)
class GeneratorExample:
    """One training input: the rendered prompt, its pages (in prompt order) and the answer to learn."""

    prompt: str
    images: list[Image.Image]
    answer: str


class GeneratorDataset(Dataset):
    """The pairs as :class:`GeneratorExample`: pages read from ``corpus``, prompts from ``render``."""

    def __init__(self, pairs: Sequence[GeneratorPair], corpus: Corpus, render: PromptRenderer) -> None:
        missing = sorted({d for p in pairs for d in p.doc_ids if d not in corpus})
        if missing:
            raise KeyError(f"{len(missing)} training page(s) are not in {corpus.name}, e.g. {missing[:3]}")
        self.pairs, self.corpus, self.render = list(pairs), corpus, render

    def __len__(self) -> int:
        return len(self.pairs)

    def query_id(self, index: int) -> str:
        return self.pairs[index].query_id

    def __getitem__(self, index: int) -> GeneratorExample:
        pair = self.pairs[index]
        images = [self.corpus[doc_id].image for doc_id in pair.doc_ids]
        pages = [PageImage(image, doc_id) for image, doc_id in zip(images, pair.doc_ids)]
        return GeneratorExample(self.render(pair.question, pages), images, pair.answers[0])


class RequestDataset(Dataset):
    """Training examples given as requests: ``(query_id, request, target)``, each prompt the Phi-3 chat text the
    Phi3V backend renders for the request (:func:`hkrag.lvlm.phi3v.phi3_chat`), its pages the request's images.

    The agents' curriculum (``agents.curriculum``) builds the requests with the very code the agents send them
    with, so the prompt learnt is the prompt sent, for every step."""

    def __init__(self, examples: Sequence[tuple[str, LVLMRequest, str]]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def query_id(self, index: int) -> str:
        return self.examples[index][0]

    def __getitem__(self, index: int) -> GeneratorExample:
        _, request, target = self.examples[index]
        return GeneratorExample(phi3_chat(request.messages), [page.image for page in request.images], target)


def check_lengths(dataset: GeneratorDataset | RequestDataset, processor: Phi3VProcessor, context: int | None) -> None:
    """Refuse to train when an example's prompt (pages included) plus its target exceeds the model's ``context``.

    Cutting the target would teach a wrong (cut) answer, and training past the context positions the model
    was never given; so a :class:`ValueError` names how many examples do not fit, the longest ones (query id,
    prompt and target tokens) and the limit (``max_position_embeddings``), before any step. Page tokens are
    counted from the pages' sizes (:meth:`~hkrag.models.phi3v.Phi3VImageProcessor.num_image_tokens`).
    """
    if context is None:
        return
    over = []
    for index in range(len(dataset)):
        example = dataset[index]
        counts = [processor.image_processor.num_image_tokens(*image.size) for image in example.images]
        ids, labels = encode_example(processor, example.prompt, counts, example.answer)
        if len(ids) > context:
            target = sum(label != IGNORE_INDEX for label in labels)
            over.append((len(ids), dataset.query_id(index), len(ids) - target, target))
    if over:
        worst = "; ".join(f"query {qid!r}: prompt {prompt} + target {target} tokens"
                          for _, qid, prompt, target in sorted(over, reverse=True)[:3])
        raise ValueError(
            f"{len(over)} of {len(dataset)} generator training example(s) are longer than the model's context "
            f"(max_position_embeddings={context} tokens), e.g. {worst}: shorten those answers or questions, or give "
            "fewer pages (generator.top_k) or fewer crops per page (model.num_crops)"
        )


@dataclass
class GeneratorCollator:
    """Right-padded batches of :class:`GeneratorExample`: ids, mask, labels and the pages' pixels."""

    processor: Phi3VProcessor

    def __call__(self, examples: Sequence[GeneratorExample]) -> dict[str, torch.Tensor]:
        images = [image for ex in examples for image in ex.images]
        vision = self.processor.image_processor(images, return_tensors="pt") if images else None
        counts = [int(n) for n in vision["num_img_tokens"]] if vision else []
        ids, labels, start = [], [], 0
        for ex in examples:
            row_ids, row_labels = encode_example(self.processor, ex.prompt, counts[start:start + len(ex.images)],
                                                 ex.answer)
            ids.append(row_ids)
            labels.append(row_labels)
            start += len(ex.images)
        batch = dict(self.processor.pad(ids, padding_side="right"))
        longest = batch["input_ids"].shape[1]
        batch["labels"] = torch.tensor([row + [IGNORE_INDEX] * (longest - len(row)) for row in labels])
        if vision:
            batch["pixel_values"], batch["image_sizes"] = vision["pixel_values"], vision["image_sizes"]
        return batch


LOSS_MEANS = ("token", "example")


def example_mean_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM NLL averaged over each example's target tokens, then over the examples that have any: token t
    predicts label t + 1, labels −100 are ignored (``loss_mean: example``)."""
    targets = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                            reduction="none")
    counted = (targets != IGNORE_INDEX).sum(dim=1)
    rows = counted > 0
    return (nll.sum(dim=1)[rows] / counted[rows]).mean()


@dataclass
class GeneratorTrainerConfig:
    """Optimisation settings (``generator_training.optim``); paper: 2 × 4 per step, lr 1e-4, one epoch."""

    batch_size: int = 2
    grad_accum: int = 4
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    scheduler: str = "linear"
    max_grad_norm: float | None = 1.0
    epochs: int = 1
    max_steps: int | None = None
    seed: int = 42
    log_every: int = 1
    save_every: int = 0
    num_workers: int = 0
    precision: str = "bf16"
    """``bf16`` autocasts on CUDA; the CPU always trains in float32 (unless ``autocast_cpu``)."""
    autocast_cpu: bool = False
    """``bf16`` autocasts on the CPU too: the preflight's bf16 rehearsal of a CUDA step (bf16 weights on CPU)."""
    loss_mean: str = "token"
    """``token``: the mean over every target token of a batch (VDocGenerator's); ``example``: each example's mean,
    then their mean (:func:`example_mean_nll`)."""

    def __post_init__(self) -> None:
        if self.loss_mean not in LOSS_MEANS:
            raise ValueError(f"generator_training.optim.loss_mean={self.loss_mean!r}: expected one of {LOSS_MEANS}")
        for name in ("batch_size", "grad_accum", "epochs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"generator_training.optim.{name} must be a positive integer, got "
                                 f"{getattr(self, name)!r}")


class GeneratorTrainer:
    """Trains the LoRA adapter of a :class:`PeftModel` causal LM on a :class:`GeneratorDataset`."""

    def __init__(self, model: PeftModel, processor: Phi3VProcessor, dataset: Dataset, config: GeneratorTrainerConfig,
                 output_dir: str | Path, run_logger: RunLogger, run_config: dict[str, Any] | None = None) -> None:
        if not len(dataset):
            raise ValueError("the generator's training set is empty")
        if isinstance(dataset, (GeneratorDataset, RequestDataset)):
            check_lengths(dataset, processor, getattr(model.config, "max_position_embeddings", None))
        self.model, self.dataset, self.config = model, dataset, config
        self.collator = GeneratorCollator(processor)
        self.output_dir, self.run_logger = Path(output_dir), run_logger
        self.device = next(p for p in model.parameters() if p.requires_grad).device
        per_epoch = math.ceil(len(dataset) / (config.batch_size * config.grad_accum))
        self.total_steps = config.max_steps or per_epoch * config.epochs
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = get_scheduler(config.scheduler, self.optimizer,
                                       num_warmup_steps=int(config.warmup_ratio * self.total_steps),
                                       num_training_steps=self.total_steps)
        identity = {**model_identity(model), "model.num_crops": processor.image_processor.num_crops}
        self.state = TrainState(config={**identity, **(run_config or {})})

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean NLL of the target tokens of ``batch`` (labels −100 elsewhere): over all its target tokens
        (``loss_mean: token``), or per example first, then over the examples (``loss_mean: example``), so that a
        long target (the agents' notes) weighs no more than a short one (an answer, a yes)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        autocast = self.config.precision == "bf16" and (self.device.type == "cuda" or self.config.autocast_cpu)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            if self.config.loss_mean == "token":
                return self.model.get_base_model()(**batch, use_cache=False).loss
            labels = batch.pop("labels")
            logits = self.model.get_base_model()(**batch, use_cache=False).logits
        return example_mean_nll(logits.float(), labels)

    def loader(self, epoch: int, start: int = 0) -> DataLoader:
        """The epoch's micro-batches (a permutation seeded by ``seed + epoch``) from optimizer step ``start`` on."""
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.config.seed + epoch))
        batches = [order[i:i + self.config.batch_size].tolist() for i in range(0, len(order), self.config.batch_size)]
        return DataLoader(self.dataset, batch_sampler=batches[start * self.config.grad_accum:],
                          collate_fn=self.collator, num_workers=self.config.num_workers)

    def fit(self) -> TrainState:
        """Train for ``epochs`` (or ``max_steps``) optimizer steps of ``grad_accum`` micro-batches each."""
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="generator", dynamic_ncols=True)
        while self.state.step < self.total_steps:
            batches = iter(self.loader(self.state.epoch, self.state.step_in_epoch))
            while self.state.step < self.total_steps and self.optimizer_step(batches, bar):
                pass
            if self.state.step < self.total_steps or not self.state.step_in_epoch:
                self.state.epoch, self.state.step_in_epoch = self.state.epoch + 1, 0
        bar.close()
        return self.state

    def resume(self, checkpoint: str | Path) -> None:
        """Continue exactly where ``checkpoint`` stopped (adapter, optimizer, scheduler, RNG, data position); a
        checkpoint of a run with other settings (``run_config``, the LoRA settings, the crops per page, the frozen
        base's weights) is refused naming them (:class:`~hkrag.training.checkpoint.CheckpointError`)."""
        state = load_checkpoint(checkpoint, self.model, self.optimizer, self.scheduler, 0, self.state.config)
        self.state = state

    def optimizer_step(self, batches, bar: tqdm) -> bool:
        """One step over up to ``grad_accum`` micro-batches (the epoch's last may be short); False at the end."""
        started, losses = time.perf_counter(), []
        for batch in batches:
            loss = self.loss(batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"generator loss is {loss.item()} at step {self.state.step}; lower the lr")
            (loss / self.config.grad_accum).backward()
            losses.append(loss.item())
            if len(losses) == self.config.grad_accum:
                break
        if not losses:
            return False
        norm = None
        if self.config.max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.step_in_epoch += 1
        record = {"loss": sum(losses) / len(losses), "lr": self.scheduler.get_last_lr()[0], "epoch": self.state.epoch,
                  "seconds": time.perf_counter() - started, **({"grad_norm": norm} if norm is not None else {})}
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        if self.state.step % self.config.log_every == 0:
            self.run_logger.log(record, self.state.step)
        if self.config.save_every and self.state.step % self.config.save_every == 0:
            self.save()
        return len(losses) == self.config.grad_accum

    def save(self, name: str | None = None) -> Path:
        """Checkpoint under ``<output>/checkpoints/<name or step-N>`` (adapter in ``adapter/``), atomically."""
        check_finite(self.model)
        directory = self.output_dir / CHECKPOINTS_DIR / (name or f"step-{self.state.step}")
        return save_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.state, [rng_state()])
