"""The retriever training loop (paper §3.2, docs/training.md).

Per optimizer step, each rank embeds its slice of the global batch, the embeddings are all-gathered
with gradient (cross-device negatives), and the hybrid-mask loss is computed on the global batch.
With ``chunk_size`` set, gradient caching runs the encoder chunk by chunk so a global batch of 64 fits
on few devices (and on a CPU); gradient accumulation is deliberately absent — it would not add
negatives. Losses that are not finite stop the run before the optimizer step, so the adapter on disk
is never poisoned.

The learning-rate scheduler is deliberately *not* passed through ``accelerator.prepare``: accelerate's
wrapper assumes every process consumed its own full batch (``split_batches=False``) and steps the
schedule ``num_processes`` times per optimizer step. Here the global batch is split over the ranks, so
one optimizer step is one scheduler step, whatever the number of processes (:meth:`optimizer_step`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import get_scheduler

from hkrag.data.images import ImageError
from hkrag.data.opendocvqa import Corpus
from hkrag.data.pairs import TrainingPair, read_hard_negatives, with_hard_negatives
from hkrag.distributed import gather_with_grad
from hkrag.late_interaction import LateInteractionLoss, pad_across_ranks
from hkrag.losses import HybridMaskLoss, LossOutput, PretrainingLoss
from hkrag.models.phi3v.image_processing_phi3v import check_image_size
from hkrag.retriever import Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.training.checkpoint import (
    ADAPTER_DIR,
    CHECKPOINTS_DIR,
    STATE_FILE,
    CheckpointError,
    TrainState,
    check_finite,
    checkpoint_state,
    hash_config,
    load_checkpoint,
    model_identity,
    rng_state,
    save_checkpoint,
)
from hkrag.training.diagnostics import batch_diagnostics, infonce_sin_gradient_cosine
from hkrag.training.gradcache import grad_cache_step, split_batch
from hkrag.training.sampler import GlobalBatchSampler

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN/inf; raised before the optimizer step touches the weights."""


@dataclass
class TrainerConfig:
    """Optimisation settings (config groups ``trainer`` and ``optim``). Paper: batch 64, 1 epoch.

    ``group_pattern``: a regex whose first group maps a positive doc id to its document (e.g.
    ``^(.*)-p\\d+$``); pages of one document are then batched together as hard negatives.
    ``num_threads``: intra-op CPU threads (``torch.set_num_threads``; null keeps torch's default). On a
    shared machine, fewer threads than cores avoids contention (timings: bench/RESULTS.md).
    ``hard_negatives``: mined negatives per query from ``negatives_file`` (``python -m hkrag.index.mine``) added
    to the batch's documents (0: in-batch negatives only). ``diagnostics_every``: log the loss diagnostics
    (:mod:`hkrag.training.diagnostics`) before every N-th optimizer step, from step 0 (0: off).
    ``eval_every``: call :meth:`RetrieverTrainer.fit`'s ``on_eval`` after every N-th optimizer step and log what it
    returns (the learning curve; 0: off).
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
    num_threads: int | None = None
    hard_negatives: int = 0
    negatives_file: str | None = None
    diagnostics_every: int = 0
    eval_every: int = 0


OPTIM_KEYS = ("lr", "weight_decay", "betas", "warmup_ratio", "scheduler", "max_grad_norm")
"""TrainerConfig fields that come from the ``optim`` config group (the others are ``trainer.*``)."""
RUN_KEYS = ("global_batch_size", "epochs", "max_steps", "seed", "group_pattern", *OPTIM_KEYS)
"""TrainerConfig fields that fix the data order or the optimisation, hence must not change on resume
(but for :data:`EXTENDABLE_KEYS`). ``chunk_size`` (memory only), logging, saving and loader workers may."""
EXTENDABLE_KEYS = ("trainer.max_steps", "trainer.epochs")
"""Run keys a resumed run may raise to train longer, as long as every finished step keeps its learning
rate (:meth:`RetrieverTrainer.continued_schedule`)."""


def total_optimizer_steps(config: TrainerConfig, steps_per_epoch: int, num_pairs: int) -> int:
    """Optimizer steps of the run: ``max_steps`` if set, else ``epochs`` over the data; at least 1."""
    by_epochs = steps_per_epoch * config.epochs
    total = by_epochs if config.max_steps is None else min(config.max_steps, by_epochs)
    if total < 1:
        raise ValueError(
            f"nothing to train: trainer.max_steps={config.max_steps}, trainer.epochs={config.epochs} and "
            f"{num_pairs} training pairs in global batches of trainer.global_batch_size={config.global_batch_size} "
            f"({steps_per_epoch} steps per epoch) give {total} optimizer steps; set trainer.max_steps >= 1 "
            "(or null for whole epochs) and trainer.epochs >= 1"
        )
    return total


def schedule_factors(name: str, schedule: Mapping[str, int], steps: int) -> list[float]:
    """Learning-rate factors of optimizer steps 1 .. ``steps + 1`` under ``transformers``' schedule ``name``
    with ``schedule``'s ``warmup_steps`` and ``total_steps`` (step ``k`` runs with factor ``lambda(k - 1)``)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = get_scheduler(name, optimizer, schedule["warmup_steps"], schedule["total_steps"]).lr_lambdas[0]
    return [factor(k) for k in range(steps + 1)]


def data_fingerprint(pairs: Sequence[TrainingPair]) -> str:
    """Hash of the training pairs (ids, queries, positives, hard negatives if any): the data the sampler orders."""
    digest = hashlib.sha256()
    for pair in pairs:
        negatives = [list(pair.negatives)] if pair.negatives else []
        digest.update(json.dumps([pair.query_id, pair.query, list(pair.positives), *negatives]).encode())
    return digest.hexdigest()[:16]


def document_groups(pairs: Sequence[TrainingPair], pattern: str) -> list[str]:
    """Document key of each pair's first positive: ``pattern``'s first group, else the doc id itself."""
    regex = re.compile(pattern)
    keys = []
    for pair in pairs:
        match = regex.match(pair.positives[0])
        keys.append(match.group(1) if match else pair.positives[0])
    return keys


class PairDataset(Dataset):
    """``(query text, positive page)`` of a training pair, plus its hard-negative pages when it has any;
    pages are decoded on access."""

    def __init__(self, pairs: Sequence[TrainingPair], corpus: Corpus) -> None:
        self.pairs = pairs
        self.corpus = corpus
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[str, Any] | tuple[str, Any, list[Any]]:
        """The pair's query and page (and negative pages); a page the image processor would refuse raises
        :class:`ImageError` naming it here, where its ``doc_id`` is known (the collator only sees images)."""
        pair = self.pairs[index]
        image = self.image(pair.positive(self.epoch))
        if pair.negatives:
            return pair.query, image, [self.image(doc_id) for doc_id in pair.negatives]
        return pair.query, image

    def image(self, doc_id: str) -> Any:
        page = self.corpus[doc_id]
        try:
            check_image_size(page.image)
        except ValueError as error:
            raise ImageError(page.doc_id, f"cannot be encoded: {error}") from error
        return page.image


def check_extensions(config: TrainerConfig, loss_fn: Any, num_processes: int) -> None:
    """Refuse hard negatives and diagnostics where they are not supported, naming the setting."""
    if config.hard_negatives and not config.negatives_file:
        raise ValueError(f"trainer.hard_negatives={config.hard_negatives} needs trainer.negatives_file (mine one "
                         "with python -m hkrag.index.mine)")
    if (config.hard_negatives or config.diagnostics_every) and not isinstance(loss_fn, HybridMaskLoss):
        raise ValueError("trainer.hard_negatives and trainer.diagnostics_every work with the contrastive fine-tuning "
                         f"loss (HybridMaskLoss), not {type(loss_fn).__name__}")
    if config.diagnostics_every and isinstance(loss_fn, LateInteractionLoss):
        raise ValueError("trainer.diagnostics_every reads one vector per text: set it to 0 under "
                         "model.head=late_interaction")
    if config.diagnostics_every and num_processes > 1:
        raise ValueError(f"trainer.diagnostics_every runs on one process, got {num_processes}: set it to 0")


class RetrieverTrainer:
    """Trains a LoRA retriever with :class:`HybridMaskLoss` under ``accelerate``.

    With :class:`PretrainingLoss` (VDocRAG's RCR + RCG, docs/training.md) the pairs are (page text, page)
    and ``collator`` must be a :class:`~hkrag.data.collators.PretrainingCollator`: each step adds the RCG pass
    (:meth:`generation_step`) to the contrastive one. Pre-training runs on one process only.
    """

    def __init__(
        self,
        retriever: Phi3VRetriever,
        loss_fn: HybridMaskLoss | PretrainingLoss,
        pairs: Sequence[TrainingPair],
        corpus: Corpus,
        config: TrainerConfig,
        accelerator: Accelerator,
        output_dir: str | Path,
        run_logger: RunLogger | None = None,
        run_config: Mapping[str, Any] | None = None,
        collator: Callable[[Sequence[tuple[str, Any]]], dict[str, Any]] | None = None,
    ) -> None:
        if getattr(loss_fn, "generative", False) and accelerator.num_processes > 1:
            raise ValueError(
                f"pre-training (RCR + RCG) runs on one process, got {accelerator.num_processes}: the RCG pass's "
                "gradient synchronisation under DDP is not verified; launch train.py without accelerate launch"
            )
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        check_extensions(config, loss_fn, accelerator.num_processes)
        if config.hard_negatives:
            pairs = with_hard_negatives(pairs, read_hard_negatives(config.negatives_file), config.hard_negatives,
                                        corpus)
        self.loss_fn = loss_fn
        self.retriever = retriever
        self.collator = collator or retriever.collator  # the same truncation as encoding
        self.dataset = PairDataset(pairs, corpus)
        self.pairs = pairs
        self.sampler = GlobalBatchSampler(
            len(pairs), config.global_batch_size, accelerator.process_index, accelerator.num_processes, config.seed,
            groups=document_groups(pairs, config.group_pattern) if config.group_pattern else None,
        )
        self.total_steps = total_optimizer_steps(config, len(self.sampler), len(pairs))
        params = [p for p in retriever.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the retriever has no trainable parameters: configure model.lora or model.adapter")
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas)
        self._optimizer = optimizer  # unwrapped: what the scheduler steps
        schedule = {"warmup_steps": int(config.warmup_ratio * self.total_steps), "total_steps": self.total_steps}
        scheduler = self.make_scheduler(schedule)
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None:  # no dataloader is prepared, so DeepSpeed cannot resolve "auto" batch sizes
            plugin.deepspeed_config.update(
                train_micro_batch_size_per_gpu=self.sampler.local_batch_size,
                train_batch_size=config.global_batch_size,
                gradient_accumulation_steps=1,
                gradient_clipping=config.max_grad_norm or 0.0,  # the engine clips in its step
            )
        identity = self.run_config(run_config or {})  # before ZeRO-3 partitions the frozen base it fingerprints
        if plugin is not None:  # absent otherwise: a checkpoint resumes under DDP or DeepSpeed only where written
            identity["trainer.deepspeed_zero_stage"] = plugin.zero_stage
        self.model, self.optimizer = accelerator.prepare(retriever, optimizer)
        self.engine = self.model if plugin is not None else None  # the DeepSpeed engine, see optimizer_step
        if self.engine is not None and not hasattr(self.engine, "coalesce_grad_reduction"):  # used by step()
            raise ImportError("this DeepSpeed has no engine.coalesce_grad_reduction (gradient caching reduces once per "
                              "step with it): install deepspeed>=0.19.1, e.g. pip install -e '.[deepspeed]'")
        self.scheduler = scheduler  # stepped once per optimizer step by optimizer_step, see the module docstring
        self.run_logger = run_logger or RunLogger(self.output_dir, enabled=accelerator.is_main_process)
        self.state = TrainState(config=identity, config_hash=hash_config(identity), schedule=schedule)
        self._ignore: torch.Tensor | None = None

    def make_scheduler(self, schedule: Mapping[str, int]) -> Any:
        """``optim.scheduler`` over ``schedule``'s ``warmup_steps`` and ``total_steps``."""
        return get_scheduler(self.config.scheduler, self._optimizer, schedule["warmup_steps"], schedule["total_steps"])

    def run_config(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """Flat settings (Hydra key names) that fix the data order and the optimisation; stored in checkpoints.

        Derived from the objects actually trained (trainer and optim settings, the loss, the LoRA
        config of the model and a fingerprint of its frozen base (:func:`~hkrag.training.checkpoint.model_identity`),
        a fingerprint of the training pairs) plus ``extra`` from the caller (e.g.
        ``model.base``, ``data.train``). Resuming under a different value of any key is refused.
        """
        settings = asdict(self.config)
        identity = {f"{'optim' if k in OPTIM_KEYS else 'trainer'}.{k}": settings[k] for k in RUN_KEYS}
        if self.config.hard_negatives:  # absent otherwise: runs without them keep their earlier identity
            identity.update({f"trainer.{k}": settings[k] for k in ("hard_negatives", "negatives_file")})
        identity.update({f"loss.{k}": v for k, v in self.loss_fn.settings().items()})
        identity.update(model_identity(self.retriever.model))
        identity.update({"data.pairs": len(self.pairs), "data.fingerprint": data_fingerprint(self.pairs), **extra})
        return json.loads(json.dumps(identity, default=str))

    def resume(self, checkpoint: str | Path) -> None:
        """Continue exactly where ``checkpoint`` stopped (weights, optimizer, scheduler, RNG, data position).

        This run may be longer than the checkpoint's (``trainer.max_steps`` / ``trainer.epochs`` raised);
        see :meth:`continued_schedule`. Raises :class:`~hkrag.training.checkpoint.CheckpointError` if the
        checkpoint was written under another :meth:`run_config` (naming the keys), if this run is shorter or
        would change the learning rate of a finished step, or if any file is missing or broken (naming it).
        """
        if self.engine is not None:
            raise CheckpointError(
                f"{checkpoint}: resuming under DeepSpeed is not supported (a checkpoint holds rank 0's ZeRO optimizer "
                "partition only); start a new run from the checkpoint's adapter: "
                f"model.adapter={Path(checkpoint) / ADAPTER_DIR}"
            )
        saved = checkpoint_state(checkpoint, self.state.config, EXTENDABLE_KEYS)
        schedule = self.continued_schedule(Path(checkpoint) / STATE_FILE, saved)
        if schedule != self.state.schedule:
            self.scheduler = self.make_scheduler(schedule)
        state = load_checkpoint(
            checkpoint, self.retriever.model, self.optimizer, self.scheduler, self.accelerator.process_index
        )
        self.state = replace(state, config=self.state.config, config_hash=self.state.config_hash, schedule=schedule)
        logger.info("resumed from %s at step %d of %d", checkpoint, self.state.step, self.total_steps)

    def continued_schedule(self, path: Path, saved: TrainState) -> dict[str, int]:
        """The learning-rate schedule after resuming from ``saved``: the checkpoint's, over this run's total.

        The warmup keeps the checkpoint's length in steps. The total may grow (an extended run), never
        shrink; the extended schedule must give every finished step, and the step the run resumes with, the
        learning rate it had, else :class:`CheckpointError` names the step: a decay over the total (``linear``,
        ``cosine``) can only be extended during warmup, ``constant`` and ``constant_with_warmup`` always.
        """
        old = saved.schedule or self.checkpoint_schedule(saved)
        if self.total_steps < old["total_steps"]:
            raise CheckpointError(
                f"{path}: this run has {self.total_steps} optimizer steps, fewer than the checkpoint's run "
                f"({old['total_steps']}); a resumed run may be extended (raise trainer.max_steps or trainer.epochs), "
                "not shortened"
            )
        new = {"warmup_steps": old["warmup_steps"], "total_steps": self.total_steps}
        if new == old:
            return new
        pairs = zip(schedule_factors(self.config.scheduler, old, saved.step),
                    schedule_factors(self.config.scheduler, new, saved.step))
        for step, (before, after) in enumerate(pairs, start=1):
            if not math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-15):
                raise CheckpointError(
                    f"{path}: extending the run from {old['total_steps']} to {self.total_steps} steps would change "
                    f"the learning rate of step {step} ({before * self.config.lr:.3g} then, "
                    f"{after * self.config.lr:.3g} now) under optim.scheduler={self.config.scheduler}, whose decay "
                    "depends on the total; extend with optim.scheduler=constant_with_warmup (or constant), or start "
                    "a new run from the checkpoint's adapter (model.adapter=<checkpoint>/adapter)"
                )
        return new

    def checkpoint_schedule(self, saved: TrainState) -> dict[str, int]:
        """The schedule of a checkpoint written before checkpoints stored it, from its run's settings."""
        length = {k.split(".")[1]: saved.config.get(k) for k in EXTENDABLE_KEYS}
        total = total_optimizer_steps(replace(self.config, **length), len(self.sampler), len(self.pairs))
        return {"warmup_steps": int(self.config.warmup_ratio * total), "total_steps": total}

    def embed(self, inputs) -> torch.Tensor:
        return self.model(**inputs)

    def in_batch_positives(self) -> torch.Tensor:
        """(B, B·(1 + N)) bool mask of the global batch: ``[i, j]`` when document ``j`` is *a* positive of query ``i``.

        Such pages are not negatives of query ``i``: every page in its positive set leaves its softmax,
        not only the one row ``i`` drew this epoch (and, as a special case, a page drawn by two rows, or
        another query's hard negative). Columns: the rows' pages, then their ``N`` hard negatives each.
        The diagonal is false. The mask is not symmetric; the loss transposes it for the
        document-to-query term of Eq. 4.
        """
        epoch = self.state.epoch
        rows = [self.pairs[i] for i in self.sampler.global_batch(epoch, self.state.step_in_epoch)]
        pages = [pair.positive(epoch) for pair in rows] + [doc_id for pair in rows for doc_id in pair.negatives]
        relevant = torch.tensor([[page in pair.positives for page in pages] for pair in rows],
                                device=self.accelerator.device)
        return relevant & ~torch.eye(len(rows), len(pages), dtype=torch.bool, device=relevant.device)

    def loss_generator(self, device: torch.device) -> torch.Generator:
        """The sub-mask split's generator of this step, seeded alike on every rank."""
        return torch.Generator(device=device).manual_seed(self.config.seed * 100_003 + self.state.step)

    def global_loss(self, q: torch.Tensor, d: torch.Tensor) -> LossOutput:
        """Loss of the gathered global batch; the sub-mask split is seeded by the step on every rank.

        A rank's ``d`` holds its rows' pages, then their hard negatives: the two are gathered separately,
        so the global ``d`` is all positives (in global row order), then all negatives, query-major.
        """
        generator = self.loss_generator(q.device)
        if q.dim() == 3:  # late interaction: every rank's tokens padded to the longest of any rank
            q, d = pad_across_ranks(q), pad_across_ranks(d)
        q = gather_with_grad(q)
        if self.config.hard_negatives:
            local = len(d) // (1 + self.config.hard_negatives)
            d = torch.cat([gather_with_grad(d[:local]), gather_with_grad(d[local:])])
        else:
            d = gather_with_grad(d)
        return self.loss_fn(q, d, generator=generator, ignore=self._ignore)

    def diagnostics(self, batch: dict[str, Any]) -> dict[str, float]:
        """:mod:`hkrag.training.diagnostics` of ``batch`` under the current weights (one process).

        An extra forward of the whole batch with gradient (not chunked) and two gradients of the
        encoder, none of which touches ``.grad`` or the RNG streams the training step draws from.
        """
        device = self.accelerator.device
        query, document = batch["query"].to(device), batch["document"].to(device)
        ignore, generator = self.in_batch_positives(), self.loss_generator(device)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
            q, d = self.retriever(**query), self.retriever(**document)
            values = batch_diagnostics(q, d, self.loss_fn, generator, ignore)
            generator = self.loss_generator(device)
            values["diag/grad_cos_infonce_sin"] = infonce_sin_gradient_cosine(
                q, d, self.loss_fn, self.retriever.parameters(), generator, ignore
            )
        return values

    def step(self, batch: dict[str, Any]) -> LossOutput:
        """Forward and backward of one global batch (gradient-cached when ``chunk_size`` is set)."""
        device = self.accelerator.device
        query, document = batch["query"].to(device), batch["document"].to(device)
        self._ignore = self.in_batch_positives()
        if self.config.chunk_size:
            size = self.config.chunk_size
            chunks = split_batch(dict(query), size), split_batch(dict(document), size)
            if self.engine is None:
                output = grad_cache_step(self.embed, self.embed, *chunks, self.global_loss,
                                         no_sync=lambda: self.accelerator.no_sync(self.model))
            else:  # DeepSpeed reduces once, after the step's last backward (it hooks tensor.backward)
                with self.engine.coalesce_grad_reduction():
                    output = grad_cache_step(self.embed, self.embed, *chunks, self.global_loss)
        else:
            output = self.global_loss(self.embed(query), self.embed(document))
            self.backward(output.loss)
        if "generation" in batch:
            output = self.loss_fn.combine(output, self.generation_step(batch["generation"].to(device)))
        return output

    def generation_step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """VDocRAG's RCG term: the mean of the examples' causal-LM losses, back-propagated (in chunks of
        ``chunk_size`` rows when set, so memory is that of one chunk); returns it detached."""
        rows = len(batch["input_ids"])
        chunks = split_batch(dict(batch), self.config.chunk_size) if self.config.chunk_size else [dict(batch)]
        total = torch.zeros((), device=self.accelerator.device)
        for chunk in chunks:
            loss = self.model(**chunk).sum() / rows
            self.backward(loss)
            total = total + loss.detach()
        return total

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` into ``.grad``. Under DeepSpeed through the engine's own backward: accelerate's
        would also step the engine, and the step belongs to :meth:`optimizer_step` (gradient caching back-propagates
        several times per step; DeepSpeed hooks those ``tensor.backward`` calls itself)."""
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            self.accelerator.backward(loss)

    def optimizer_step(self, output: LossOutput) -> float | None:
        """Clip, step, schedule; refuses to step on a non-finite loss or gradient.

        The scheduler advances exactly once per optimizer step on every rank (not ``num_processes``
        times, as accelerate's prepared scheduler would), and not at all when a mixed-precision
        gradient scaler skipped the step.
        """
        if not torch.isfinite(output.loss):
            raise NonFiniteLossError(
                f"loss is {output.loss.item()} at step {self.state.step}: lower optim.lr, check the data, or resume "
                "from the last checkpoint; the weights on disk were not touched"
            )
        if self.engine is not None:
            return self.engine_step()
        norm = None
        if self.config.max_grad_norm:
            norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
            if not math.isfinite(norm):
                raise NonFiniteLossError(f"gradient norm is {norm} at step {self.state.step}; weights not updated")
        self.optimizer.step()
        if not self.accelerator.optimizer_step_was_skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def engine_step(self) -> float:
        """DeepSpeed's step: it clips to ``optim.max_grad_norm`` (its ``gradient_clipping``), steps and zeroes the
        gradients; returns the norm before clipping. Its optimizer steps before the norm is known, so a non-finite
        norm stops the run after the in-memory update, still before any checkpoint is written."""
        self.engine.step()
        norm = float(self.engine.get_global_grad_norm())
        if not math.isfinite(norm):
            raise NonFiniteLossError(f"gradient norm is {norm} at step {self.state.step} under DeepSpeed; the weights "
                                     "on disk were not touched")
        if not self.accelerator.optimizer_step_was_skipped:
            self.scheduler.step()
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

    def fit(
        self, on_log: Callable[[dict[str, Any]], None] | None = None,
        on_eval: Callable[[int], Mapping[str, float]] | None = None,
    ) -> TrainState:
        """Train until ``epochs`` or ``max_steps``; returns the final state. ``on_eval(step)`` (on every rank, the
        model in train mode before and after) runs every ``eval_every`` steps; its metrics are logged at that step."""
        self.model.train()
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="train",
                   disable=not self.accelerator.is_main_process, dynamic_ncols=True)
        while self.state.step < self.total_steps:
            for batch in self.loader(self.state.epoch, self.state.step_in_epoch):
                every = self.config.diagnostics_every
                diagnostics = self.diagnostics(batch) if every and self.state.step % every == 0 else {}
                started = time.perf_counter()
                output = self.step(batch)
                norm = self.optimizer_step(output)
                self.state.step += 1
                self.state.step_in_epoch += 1
                record = {**self._record(output, norm, time.perf_counter() - started), **diagnostics}
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if self.state.step % self.config.log_every == 0 or diagnostics:
                    self.run_logger.log(record, self.state.step)
                    if on_log:
                        on_log(record)
                if on_eval and self.config.eval_every and self.state.step % self.config.eval_every == 0:
                    self.run_logger.log(dict(on_eval(self.state.step)), self.state.step)
                if self.config.save_every and self.state.step % self.config.save_every == 0:
                    self.save()
                if self.state.step >= self.total_steps:
                    break
            else:
                self.state.epoch += 1
                self.state.step_in_epoch = 0
        bar.close()
        self.report_truncations()
        return self.state

    def report_truncations(self) -> dict[str, int]:
        """Log (and return) how many training queries and RCG targets this process's collator cut to their limits
        (counted in the main process: with ``num_workers`` > 0 the workers' copies count, unseen)."""
        counts = {"queries": getattr(self.collator, "truncated_queries", getattr(self.collator, "truncated", 0)),
                  "RCG targets": getattr(self.collator, "truncated_targets", 0)}
        counts = {what: n for what, n in counts.items() if n}
        if counts:
            logger.warning("training cut %s to their token limits (the first of each was logged when cut)",
                           " and ".join(f"{n} {what}" for what, n in counts.items()))
        return counts

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
        """Checkpoint under ``<output>/checkpoints/<name or step-N>`` (call on every rank).

        Every rank's RNG state is gathered to rank 0, which writes the folder atomically.
        """
        directory = self.output_dir / CHECKPOINTS_DIR / (name or f"step-{self.state.step}")
        with self.whole_adapter():
            check_finite(self.retriever.model)
            rngs = gather_object([rng_state()]) if self.accelerator.num_processes > 1 else [rng_state()]
            if self.accelerator.is_main_process:
                save_checkpoint(directory, self.retriever.model, self.optimizer, self.scheduler, self.state, rngs)
            self.accelerator.wait_for_everyone()
        return directory

    def whole_adapter(self) -> AbstractContextManager:
        """Under DeepSpeed ZeRO-3, which partitions parameters over the ranks (a rank's copy is then empty), gathers
        on every rank, for reading, those a checkpoint saves: the trainable ones and the rest of peft's
        ``modules_to_save`` copies, which the adapter holds too (call on every rank). Elsewhere they are whole."""
        if self.engine is None or self.engine.zero_optimization_stage() != 3:
            return nullcontext()
        import deepspeed

        saved = [p for n, p in self.retriever.named_parameters() if p.requires_grad or ".modules_to_save." in n]
        return deepspeed.zero.GatheredParameters(saved, modifier_rank=None)
