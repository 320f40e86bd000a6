"""Process-group helpers and the gradient-preserving all-gather for cross-device negatives.

All helpers are no-ops in a single process (torch.distributed not initialised, or world
size 1), so the same training code runs on a laptop, under ``accelerate launch`` and under
torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    """Whether this is rank 0, the one that writes reports."""
    return rank() == 0


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        sizes = _gather_sizes(x)
        ctx.start = sum(sizes[: dist.get_rank()])
        ctx.size = x.shape[0]
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start : ctx.start + ctx.size]


def _gather_sizes(x: Tensor) -> list[int]:
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    return [int(s) for s in sizes]


def gather_with_grad(x: Tensor) -> Tensor:
    """All-gather ``x`` along dim 0 in rank order, keeping the gradient to the local rows.

    Ranks may hold different numbers of rows. Every rank gets the same global tensor ``X``.
    Let rank ``r`` compute a loss ``L_r(X)`` and DDP (or DeepSpeed) average the parameter
    gradients over the ``W`` ranks, so the optimised objective is ``L = (1/W) Σ_r L_r``.
    Rank ``r``'s parameters reach ``L`` only through its own rows ``x_r`` of ``X``, and
    ``∂L/∂x_r = (1/W) Σ_s ∂L_s/∂X [rows of r]``. The backward therefore all-reduces (sums)
    the incoming gradient ``∂L_s/∂X`` over ranks and keeps this rank's slice: the local
    parameter gradient is then ``Σ_s ∂L_s/∂x_r · ∂x_r/∂θ``, and DDP's division by ``W``
    yields exactly ``∂L/∂θ``. In particular, when every rank computes the same global loss
    ``L_r = L_global`` (what :class:`hkrag.losses.HybridMaskLoss` does), the sum gives
    ``W · ∂L_global/∂x_r``, DDP divides by ``W``, and the gradients equal those of one
    process on the concatenated batch. Without the sum (local slice only) they would be
    ``W`` times too small; the built-in ``all_gather`` keeps no gradient at all.

    Returns ``x`` unchanged when not distributed.
    """
    if not is_distributed():
        return x
    return _GatherWithGrad.apply(x)
