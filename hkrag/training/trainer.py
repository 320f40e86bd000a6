"""The retriever training loop (paper §3.2 + DESIGN §9).

Per optimizer step, each rank embeds its slice of the global batch, the embeddings are all-gathered
with gradient (cross-device negatives), and the hybrid-mask loss is computed on the global batch.
With ``chunk_size`` set, gradient caching runs the encoder chunk by chunk so a global batch of 64 fits
on few devices (and on a CPU); gradient accumulation is deliberately absent — it would not add
negatives. Losses that are not finite stop the run before the optimizer step, so the adapter on disk
is never poisoned.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import get_scheduler

from hkrag.data.collators import RetrieverCollator
from hkrag.data.opendocvqa import Corpus, TrainingPair
from hkrag.distributed import gather_with_grad
from hkrag.gradcache import grad_cache_step, split_batch
from hkrag.losses import HybridMaskLoss, LossOutput
from hkrag.retriever import Phi3VRetriever
from hkrag.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from hkrag.training.reporting import RunLogger
from hkrag.training.sampler import GlobalBatchSampler

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN/inf; raised before the optimizer step touches the weights."""


@dataclass
class TrainerConfig:
    """Optimisation settings (config groups ``trainer`` and ``optim``). Paper: batch 64, 1 epoch.

    ``group_pattern``: a regex whose first group maps a positive doc id to its document (e.g.
    ``^(.*)-p\\d+$``); pages of one document are then batched together as hard negatives.
    """

    global_batch_size: int = 64
    chunk_size: int | None = None
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.1
    scheduler: str = "linear"
    max_grad_norm: float | None = 1.0
    seed: int = 42
    group_pattern: str | None = None
    log_every: int = 1
    save_every: int | None = None
    num_workers: int = 0


def document_groups(pairs: Sequence[TrainingPair], pattern: str) -> list[str]:
    """Document key of each pair's first positive: ``pattern``'s first group, else the doc id itself."""
    regex = re.compile(pattern)
    keys = []
    for pair in pairs:
        match = regex.match(pair.positives[0])
        keys.append(match.group(1) if match else pair.positives[0])
    return keys


class PairDataset(Dataset):
    """``(query text, positive page)`` of a training pair; the page is decoded on access."""

    def __init__(self, pairs: Sequence[TrainingPair], corpus: Corpus) -> None:
        self.pairs = pairs
        self.corpus = corpus
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[str, Any]:
        pair = self.pairs[index]
        return pair.query, self.corpus[pair.positive(self.epoch)].image


class RetrieverTrainer:
    """Trains a LoRA retriever with :class:`HybridMaskLoss` under ``accelerate``."""

    def __init__(
        self,
        retriever: Phi3VRetriever,
        loss_fn: HybridMaskLoss,
        pairs: Sequence[TrainingPair],
        corpus: Corpus,
        config: TrainerConfig,
        accelerator: Accelerator,
        output_dir: str | Path,
        run_logger: RunLogger | None = None,
    ) -> None:
        self.config = config
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.loss_fn = loss_fn
        self.retriever = retriever
        self.collator = RetrieverCollator(retriever.processor)
        self.dataset = PairDataset(pairs, corpus)
        self.pairs = pairs
        self.sampler = GlobalBatchSampler(
            len(pairs), config.global_batch_size, accelerator.process_index, accelerator.num_processes, config.seed,
            groups=document_groups(pairs, config.group_pattern) if config.group_pattern else None,
        )
        self.total_steps = min(config.max_steps or math.inf, len(self.sampler) * config.epochs)
        params = [p for p in retriever.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the retriever has no trainable parameters: configure model.lora or model.adapter")
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas)
        scheduler = get_scheduler(
            config.scheduler, optimizer, int(config.warmup_ratio * self.total_steps), self.total_steps
        )
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None:  # no dataloader is prepared, so DeepSpeed cannot resolve "auto" batch sizes
            plugin.deepspeed_config.update(
                train_micro_batch_size_per_gpu=self.sampler.local_batch_size,
                train_batch_size=config.global_batch_size,
                gradient_accumulation_steps=1,
            )
        self.model, self.optimizer, self.scheduler = accelerator.prepare(retriever, optimizer, scheduler)
        self.run_logger = run_logger or RunLogger(self.output_dir, enabled=accelerator.is_main_process)
        self.state = TrainState()
        self._ignore: torch.Tensor | None = None

    def resume(self, checkpoint: str | Path) -> None:
        """Continue exactly where ``checkpoint`` stopped (weights, optimizer, scheduler, RNG, data position)."""
        self.state = load_checkpoint(
            checkpoint, self.retriever.model, self.optimizer, self.scheduler, self.accelerator.process_index
        )
        logger.info("resumed from %s at step %d", checkpoint, self.state.step)

    def embed(self, inputs) -> torch.Tensor:
        return self.model(**inputs)

    def shared_positives(self) -> torch.Tensor:
        """(B, B) mask of the global batch: rows whose positive is the same page (not negatives)."""
        epoch = self.state.epoch
        pages = [self.pairs[i].positive(epoch) for i in self.sampler.global_batch(epoch, self.state.step_in_epoch)]
        same = torch.tensor([[a == b for b in pages] for a in pages], device=self.accelerator.device)
        return same & ~torch.eye(len(pages), dtype=torch.bool, device=same.device)

    def global_loss(self, q: torch.Tensor, d: torch.Tensor) -> LossOutput:
        """Loss of the gathered global batch; the sub-mask split is seeded by the step on every rank."""
        generator = torch.Generator(device=q.device).manual_seed(self.config.seed * 100_003 + self.state.step)
        return self.loss_fn(gather_with_grad(q), gather_with_grad(d), generator=generator, ignore=self._ignore)

    def step(self, batch: dict[str, Any]) -> LossOutput:
        """Forward and backward of one global batch (gradient-cached when ``chunk_size`` is set)."""
        device = self.accelerator.device
        query, document = batch["query"].to(device), batch["document"].to(device)
        self._ignore = self.shared_positives()
        if self.config.chunk_size:
            size = self.config.chunk_size
            return grad_cache_step(
                self.embed, self.embed, split_batch(dict(query), size), split_batch(dict(document), size),
                self.global_loss, no_sync=lambda: self.accelerator.no_sync(self.model),
            )
        output = self.global_loss(self.embed(query), self.embed(document))
        self.accelerator.backward(output.loss)
        return output

    def optimizer_step(self, output: LossOutput) -> float | None:
        """Clip, step, schedule; refuses to step on a non-finite loss or gradient."""
        if not torch.isfinite(output.loss):
            raise NonFiniteLossError(
                f"loss is {output.loss.item()} at step {self.state.step}: lower optim.lr, check the data, or resume "
                "from the last checkpoint; the weights on disk were not touched"
            )
        norm = None
        if self.config.max_grad_norm:
            norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
            if not math.isfinite(norm):
                raise NonFiniteLossError(f"gradient norm is {norm} at step {self.state.step}; weights not updated")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def loader(self, epoch: int, start: int) -> DataLoader:
        """This rank's batches of ``epoch`` from step ``start``.

        The loader gets its own generator: creating an iterator otherwise draws from the global RNG,
        which would shift the dropout stream of a resumed run.
        """
        self.dataset.epoch = epoch
        return DataLoader(
            self.dataset, batch_sampler=list(self.sampler.batches(epoch, start)),
            collate_fn=self.collator, num_workers=self.config.num_workers,
            generator=torch.Generator().manual_seed(self.config.seed + epoch),
        )

    def fit(self, on_log: Callable[[dict[str, Any]], None] | None = None) -> TrainState:
        """Train until ``epochs`` or ``max_steps``; returns the final state."""
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train",
                   disable=not self.accelerator.is_main_process, dynamic_ncols=True)
        while self.state.step < self.total_steps:
            for batch in self.loader(self.state.epoch, self.state.step_in_epoch):
                started = time.perf_counter()
                output = self.step(batch)
                norm = self.optimizer_step(output)
                self.state.step += 1
                self.state.step_in_epoch += 1
                record = self._record(output, norm, time.perf_counter() - started)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if self.state.step % self.config.log_every == 0:
                    self.run_logger.log(record, self.state.step)
                    if on_log:
                        on_log(record)
                if self.config.save_every and self.state.step % self.config.save_every == 0:
                    self.save()
                if self.state.step >= self.total_steps:
                    break
            else:
                self.state.epoch += 1
                self.state.step_in_epoch = 0
        bar.close()
        return self.state

    def _record(self, output: LossOutput, norm: float | None, seconds: float) -> dict[str, Any]:
        record = {"loss": output.loss.item(), "lr": self.scheduler.get_last_lr()[0],
                  "samples_per_s": self.config.global_batch_size / seconds, "epoch": self.state.epoch,
                  "processes": self.accelerator.num_processes}
        record.update({f"loss/{k}": v.item() for k, v in output.components.items()})
        record.update({k: v.item() for k, v in output.metrics.items()})
        if norm is not None:
            record["grad_norm"] = norm
        return record

    def save(self, name: str | None = None) -> Path:
        """Checkpoint under ``<output>/checkpoints/<name or step-N>``."""
        directory = self.output_dir / "checkpoints" / (name or f"step-{self.state.step}")
        return save_checkpoint(
            directory, self.retriever.model, self.optimizer, self.scheduler, self.state,
            self.accelerator.process_index, self.accelerator.is_main_process, self.accelerator.wait_for_everyone,
        )
