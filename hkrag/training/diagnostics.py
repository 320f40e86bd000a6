"""Diagnostics that tell the readings of the hybrid-mask loss apart (issue 20, docs/losses.md "Diagnostics").

A Table-5 run from random weights can measure how fast each loss leaves its starting point rather than
what it learns: tiny embeddings start nearly one-dimensional, masks then hardly depend on the pair, and
``L_SIN`` starts far above chance. These pure functions say whether that is the case for a batch:

- ``L_DIN`` and ``L_SIN`` against ``ln n`` (chance: a softmax over ``n`` equally scored documents);
- the spread (std) of the masked logits against the plain ones (a mask that rescales or flattens logits);
- the overlap (mean Jaccard index) of the positive pairs' masks (1: the masks do not depend on the pair);
- the effective dimension (participation ratio) of query and document embeddings (1: one-dimensional);
- the cosine between the gradients of plain InfoNCE and of ``L_SIN`` on the shared parameters.

:meth:`hkrag.training.trainer.RetrieverTrainer.diagnostics` logs them every ``trainer.diagnostics_every`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from hkrag.losses import HybridMaskLoss, hybrid_mask, masked_cosine


def participation_ratio(x: Tensor) -> float:
    """Effective dimension ``(Σλ)² / Σλ²`` of the covariance eigenvalues ``λ`` of the rows of ``x`` ``(N, D)``.

    It is 1 when the rows vary along one direction only and ``D`` when they vary equally along all ``D``
    (divide by ``D`` for a share of the dimensions); 0 when they do not vary at all. The eigenvalues are the
    squared singular values of the centred rows (the ``1 / N`` of the covariance cancels in the ratio).
    """
    if x.dim() != 2 or len(x) < 2:
        raise ValueError(f"participation_ratio needs (N >= 2, D) embeddings, got shape {tuple(x.shape)}")
    rows = x.detach().double()
    eigenvalues = torch.linalg.svdvals(rows - rows.mean(dim=0)) ** 2
    total = eigenvalues.sum()
    return float(total**2 / (eigenvalues**2).sum()) if total > 0 else 0.0


def mean_jaccard(supports: Tensor) -> float:
    """Mean Jaccard index ``|A ∩ B| / |A ∪ B|`` over all pairs of rows of ``supports`` (``(P, D)``, non-zero = in).

    1 when every row selects the same dimensions, 0 when no two rows share one. Two empty rows count as
    identical (1).
    """
    if supports.dim() != 2 or len(supports) < 2:
        raise ValueError(f"mean_jaccard needs (P >= 2, D) supports, got shape {tuple(supports.shape)}")
    member = (supports != 0).double()
    shared = member @ member.T
    sizes = member.sum(dim=1)
    union = sizes[:, None] + sizes[None] - shared
    jaccard = torch.where(union > 0, shared / union.clamp_min(1), torch.ones_like(union))
    rows, cols = torch.triu_indices(len(member), len(member), offset=1)
    return float(jaccard[rows, cols].mean())


def logit_spread(similarities: Tensor, tau: float) -> float:
    """Population standard deviation of the logits ``similarities / tau`` over all query-document pairs."""
    return float((similarities.detach() / tau).std(correction=0))


def gradient_cosine(loss_a: Tensor, loss_b: Tensor, parameters: Iterable[torch.nn.Parameter]) -> float:
    """Cosine between the gradients of two scalar losses over the parameters both depend on.

    Neither loss's graph is freed and no ``.grad`` is touched (:func:`torch.autograd.grad`). 0 when either
    gradient vanishes; a :class:`ValueError` when the losses share no trainable parameter.
    """
    params = [p for p in parameters if p.requires_grad]
    grads_a = torch.autograd.grad(loss_a, params, retain_graph=True, allow_unused=True)
    grads_b = torch.autograd.grad(loss_b, params, retain_graph=True, allow_unused=True)
    shared = [(a, b) for a, b in zip(grads_a, grads_b) if a is not None and b is not None]
    if not shared:
        raise ValueError("the two losses share no trainable parameter: nothing to compare")
    a = torch.cat([g.flatten().double() for g, _ in shared])
    b = torch.cat([g.flatten().double() for _, g in shared])
    norm = a.norm() * b.norm()
    return float(a @ b / norm) if norm > 0 else 0.0


@torch.no_grad()
def batch_diagnostics(
    q: Tensor, d: Tensor, loss_fn: HybridMaskLoss, generator: torch.Generator | None = None,
    ignore: Tensor | None = None,
) -> dict[str, float]:
    """Every embedding-level diagnostic of one batch (``q`` ``(B, D)``, ``d`` positives then hard negatives).

    ``L_DIN`` and ``L_SIN`` are evaluated with ``loss_fn``'s settings whatever terms it trains with, so an
    InfoNCE run reports them too. Keys (``diag/`` prefixed): ``ln_n`` (``n`` = documents per query softmax),
    ``din``/``sin`` and their ratios to it ``din_per_ln_n``/``sin_per_ln_n``; ``logit_std_plain`` and
    ``logit_std_masked`` (plain cosine against ``M_H``-masked similarities under the loss's reading);
    ``jaccard_dense`` / ``jaccard_sparse`` (positive masks' non-zero / salient dims); ``pr_query``,
    ``pr_doc`` and their shares of ``D``, ``pr_query_per_dim`` and ``pr_doc_per_dim``.
    """
    batch, dim = q.shape
    probe = loss_fn.variant(use_din=True, use_sin=True, infonce_weight=0.0)
    components = probe(q, d, generator, ignore).components
    ln_n = math.log(len(d))
    masks = hybrid_mask(q, d[:batch], loss_fn.alpha, loss_fn.eps)
    masked = loss_fn.variant(use_din=True, use_sin=False, infonce_weight=0.0).masked_similarities(q, d)[0]
    values = {
        "ln_n": ln_n,
        "din": float(components["din"]),
        "sin": float(components["sin"]),
        "din_per_ln_n": float(components["din"]) / ln_n,
        "sin_per_ln_n": float(components["sin"]) / ln_n,
        "logit_std_plain": logit_spread(masked_cosine(q, d), loss_fn.tau),
        "logit_std_masked": logit_spread(masked, loss_fn.tau),
        "jaccard_dense": mean_jaccard(masks > 0) if batch > 1 else 1.0,
        "jaccard_sparse": mean_jaccard(masks == 1) if batch > 1 else 1.0,
    }
    for name, rows in (("query", q), ("doc", d)):
        ratio = participation_ratio(rows) if len(rows) > 1 else 0.0
        values.update({f"pr_{name}": ratio, f"pr_{name}_per_dim": ratio / dim})
    return {f"diag/{key}": value for key, value in values.items()}


def infonce_sin_gradient_cosine(
    q: Tensor, d: Tensor, loss_fn: HybridMaskLoss, parameters: Iterable[torch.nn.Parameter],
    generator: torch.Generator | None = None, ignore: Tensor | None = None,
) -> float:
    """Cosine between the gradients of plain InfoNCE (Eq. 3) and of ``L_SIN`` (Eq. 5, ``loss_fn``'s settings)
    on ``parameters``, for embeddings ``q``, ``d`` computed from them with gradient. Negative: ``L_SIN`` pulls
    the shared weights away from where InfoNCE would move them."""
    infonce = loss_fn.variant(use_din=False, use_sin=False, infonce_weight=1.0)(q, d, ignore=ignore).loss
    sin = loss_fn.variant(use_din=False, use_sin=True, infonce_weight=0.0)(q, d, generator, ignore).loss
    return gradient_cosine(infonce, sin, parameters)
