"""Peak memory of the late-interaction loss (InfoNCE over MaxSim, forward and backward) per token score, the figure
the preflight's ``hkrag.training.memory.MAXSIM_BYTES_PER_SCORE`` uses.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/maxsim_memory.py 16 50 2000 128

Arguments: queries (= pages), query tokens, page tokens, dim. Prints the peak resident set above the start divided
by the score count ``queries x pages x query tokens x page tokens``. CPU only; run it as a fresh process per shape
(the resident-set peak is the process's), with glibc's mmap threshold pinned so freed tensors leave the resident set
as they leave CUDA's allocated count (hkrag.training.memory.MALLOC_ENV).
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.nn.functional as F

from hkrag.late_interaction import LateInteractionLoss


def peak_bytes_per_score(batch: int, query_tokens: int, page_tokens: int, dim: int) -> float:
    """Peak resident bytes of one loss forward and backward over random unit token vectors, per token score."""
    q = F.normalize(torch.randn(batch, query_tokens, dim), dim=-1).requires_grad_()
    d = F.normalize(torch.randn(batch, page_tokens, dim), dim=-1).requires_grad_()
    loss_fn = LateInteractionLoss(tau=0.05, use_din=False, use_sin=False, infonce_weight=1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss_fn(q, d).loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak - before) / (batch * batch * query_tokens * page_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("batch", "query_tokens", "page_tokens", "dim"):
        parser.add_argument(name, type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    value = peak_bytes_per_score(args.batch, args.query_tokens, args.page_tokens, args.dim)
    print(f"{args.batch} x {args.batch} x {args.query_tokens} x {args.page_tokens} (dim {args.dim}): "
          f"{value:.2f} bytes per token score")


if __name__ == "__main__":
    main()
