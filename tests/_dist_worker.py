"""Shared scenarios for the multi-process loss tests: a tiny linear dual encoder in DDP.

Imported by the tests for the single-process reference, spawned by them with gloo, and
runnable under accelerate::

    accelerate launch --cpu --num_processes 2 tests/_dist_worker.py OUT_DIR

Each rank writes ``OUT_DIR/rank{r}.pt``: per scenario the loss and the parameter gradients.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from hkrag.distributed import gather_with_grad, rank, world_size
from hkrag.late_interaction import LateInteractionLoss, concat_padded, pad_across_ranks
from hkrag.losses import HybridMaskLoss, LossOutput
from hkrag.training.gradcache import grad_cache_step

BATCH, DIM_IN, DIM_OUT, CHUNK = 8, 6, 12, 2
UNEVEN = (5, 3)  # rows held by rank 0 and rank 1 in the "uneven" scenario


def data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x_q = torch.randn(BATCH, DIM_IN, generator=generator)
    return x_q, x_q + 0.5 * torch.randn(BATCH, DIM_IN, generator=generator)


def encoder(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM_IN, DIM_OUT), nn.Dropout(dropout))


def encode(model: nn.Module, x: Tensor) -> Tensor:
    return F.normalize(model(x), dim=-1)


def global_loss(q: Tensor, d: Tensor) -> LossOutput:
    """The loss every rank computes identically on the gathered batch (same split seed)."""
    loss_fn = HybridMaskLoss(tau=0.1, alpha=0.5, beta=0.7)
    return loss_fn(gather_with_grad(q), gather_with_grad(d), torch.Generator().manual_seed(1))


def step(model: nn.Module, x_q: Tensor, x_d: Tensor, cached: bool, seed: int = 0) -> dict[str, Tensor]:
    """One training step's loss and gradients, encoding in chunks of ``CHUNK`` rows.

    Uncached, chunks are encoded with gradient in the same order as gradient caching's first
    pass, so both draw the same dropout masks from the same ``seed``.
    """
    torch.manual_seed(seed)
    encode_fn = partial(encode, model)
    if cached:
        no_sync = model.no_sync if isinstance(model, DistributedDataParallel) else None
        out = grad_cache_step(encode_fn, encode_fn, x_q.split(CHUNK), x_d.split(CHUNK), global_loss, no_sync)
    else:
        q = torch.cat([encode_fn(chunk) for chunk in x_q.split(CHUNK)])
        d = torch.cat([encode_fn(chunk) for chunk in x_d.split(CHUNK)])
        out = global_loss(q, d)
        out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"loss": out.loss.detach(), "grads": grads}


TOKENS = 5
LENGTHS = torch.tensor([2, 5, 1, 3, 4, 1, 2, 3])  # rank 0's rows are longer than rank 1's: ragged across ranks


def token_data() -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Late interaction: each row ``TOKENS`` token inputs of which its ``LENGTHS`` are real."""
    generator = torch.Generator().manual_seed(0)
    x_q = torch.randn(BATCH, TOKENS, DIM_IN, generator=generator)
    x_d = x_q + 0.5 * torch.randn(BATCH, TOKENS, DIM_IN, generator=generator)
    return {"x": x_q, "lengths": LENGTHS}, {"x": x_d, "lengths": LENGTHS.flip(0)}


def encode_tokens(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """Normalised token vectors cut to the chunk's longest row, padding rows zero (the head's convention)."""
    longest = int(inputs["lengths"].max())
    keep = torch.arange(longest)[None, :] < inputs["lengths"][:, None]
    return F.normalize(model(inputs["x"][:, :longest]), dim=-1) * keep.unsqueeze(-1)


def late_loss(q: Tensor, d: Tensor) -> LossOutput:
    """MaxSim InfoNCE + the masks' terms on the gathered batch, every rank's tokens padded to the longest."""
    loss_fn = LateInteractionLoss(tau=0.1, alpha=0.5, beta=0.7, infonce_weight=1.0)
    q, d = pad_across_ranks(q), pad_across_ranks(d)
    return loss_fn(gather_with_grad(q), gather_with_grad(d), torch.Generator().manual_seed(1))


def late_step(model: nn.Module, queries: dict[str, Tensor], docs: dict[str, Tensor], cached: bool) -> dict:
    """:func:`step` for the late-interaction scenarios (chunks of ``CHUNK`` rows)."""
    def chunks(inputs):
        return [{k: v[s : s + CHUNK] for k, v in inputs.items()} for s in range(0, len(inputs["x"]), CHUNK)]

    encode_fn = partial(encode_tokens, model)
    if cached:
        no_sync = model.no_sync if isinstance(model, DistributedDataParallel) else None
        out = grad_cache_step(encode_fn, encode_fn, chunks(queries), chunks(docs), late_loss, no_sync)
    else:
        q = concat_padded([encode_fn(chunk) for chunk in chunks(queries)])
        d = concat_padded([encode_fn(chunk) for chunk in chunks(docs)])
        out = late_loss(q, d)
        out.loss.backward()
    return {"loss": out.loss.detach(), "grads": torch.cat([p.grad.flatten() for p in model.parameters()])}


def local_rows(sizes: tuple[int, ...]) -> slice:
    start = sum(sizes[: rank()])
    return slice(start, start + sizes[rank()])


def scenarios(wrap: Callable[[nn.Module], nn.Module]) -> dict[str, dict[str, Tensor]]:
    """Run every scenario on this rank's share of the batch; ``wrap`` makes the DDP model."""
    x_q, x_d = data()
    even = local_rows((BATCH // world_size(),) * world_size())
    uneven = local_rows(UNEVEN)
    return {
        "plain": step(wrap(encoder()), x_q[even], x_d[even], cached=False),
        "cached": step(wrap(encoder()), x_q[even], x_d[even], cached=True),
        "uneven": step(wrap(encoder()), x_q[uneven], x_d[uneven], cached=False),
        "dropout": step(wrap(encoder(0.3)), x_q[even], x_d[even], cached=False, seed=rank()),
        "dropout-cached": step(wrap(encoder(0.3)), x_q[even], x_d[even], cached=True, seed=rank()),
        "late": late_step(wrap(encoder()), *(_rows(t, even) for t in token_data()), cached=False),
        "late-cached": late_step(wrap(encoder()), *(_rows(t, even) for t in token_data()), cached=True),
    }


def _rows(inputs: dict[str, Tensor], rows: slice) -> dict[str, Tensor]:
    return {key: value[rows] for key, value in inputs.items()}


def spawned(local_rank: int, world: int, store: str, out_dir: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn`` (file rendezvous, no port to pick)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=local_rank, world_size=world)
    try:
        torch.save(scenarios(DistributedDataParallel), Path(out_dir) / f"rank{local_rank}.pt")
    finally:
        dist.destroy_process_group()


def launched(out_dir: str) -> None:
    """Entry point under ``accelerate launch`` (accelerate sets up the process group and DDP)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.save(scenarios(accelerator.prepare), Path(out_dir) / f"rank{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    launched(sys.argv[1])
