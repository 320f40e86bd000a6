"""Hybrid-masking contrastive losses of HKRAG-Ret (paper §3.2, Eqs. 1-5).

All functions take L2-normalised embeddings ``q`` (queries) and ``d`` (documents) of shape
``(B, D)`` whose row ``i`` pairs are the positives, i.e. the *global* batch after
:func:`hkrag.distributed.gather_with_grad`. Masks exist only in training; at inference the
embeddings are indexed as they are. See ``docs/losses.md`` for the interpretation taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hkrag.data.collators import IGNORE_INDEX


def _at_least_float32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def correlation(q: Tensor, d: Tensor, eps: float = 1e-6) -> Tensor:
    """Scaled correlation ``Cn`` of Eq. 1, per pair over the last (embedding) dimension.

    ``C = |q ⊙ d|`` and ``Cn = sigmoid((C - mean(C)) / (std(C) + eps))``. The paper calls the
    scale "variance"; we use the (population) standard deviation, which makes the argument a
    z-score and ``Cn`` invariant to the scale of ``q`` and ``d``. Leading dimensions broadcast,
    so ``correlation(q[:, None], d[None])`` gives all ``(B, B, D)`` pairs.
    """
    c = (q * d).abs()
    mean = c.mean(dim=-1, keepdim=True)
    std = c.std(dim=-1, correction=0, keepdim=True)
    return torch.sigmoid((c - mean) / (std + eps))


@torch.no_grad()
def hybrid_mask(q: Tensor, d: Tensor, alpha: float, eps: float = 1e-6) -> Tensor:
    """Hybrid mask ``M_H`` of Eq. 2, values in {0, ½, 1}; computed without gradient.

    ``M_H = (1[Cn > μ - α·σ] + 1[Cn > μ + α·σ]) / 2`` with μ, σ the mean and (population)
    standard deviation of ``Cn`` over the embedding dimension of each pair. The first
    indicator is the paper's dense mask (keeps all but the least correlated dims), the
    second its sparse mask (the most correlated dims), so 1 = salient, ½ = kept detail, 0 =
    suppressed. Shape: the broadcast of ``q`` and ``d``; dtype: that of ``q``.
    """
    cn = correlation(_at_least_float32(q), _at_least_float32(d), eps)
    mean = cn.mean(dim=-1, keepdim=True)
    spread = alpha * cn.std(dim=-1, correction=0, keepdim=True)
    mask = ((cn > mean - spread).float() + (cn > mean + spread).float()) / 2
    return mask.to(q.dtype)


@torch.no_grad()
def split_mask(mask: Tensor, n: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """Split the support of ``mask`` into ``n`` disjoint random parts (the ``M_H^i`` of Eq. 5).

    Every non-zero entry is assigned to one of the ``n`` parts uniformly at random and keeps
    its value (½ or 1), so the parts are disjoint, sum to ``mask`` and hold ``|support| / n``
    entries in expectation (an exactly balanced split would need a sort, much slower at
    ``B×B×D`` scale). Each call draws a fresh split from ``generator`` (global RNG if ``None``).
    """
    part = torch.randint(n, mask.shape, generator=generator, device=mask.device)
    return [mask * (part == k) for k in range(n)]


def masked_cosine(q: Tensor, d: Tensor, mask: Tensor | None = None, eps: float = 1e-12) -> Tensor:
    """Cosine similarities ``sim(q_i, d_j ⊙ M)`` of shape ``(B_q, B_d)``.

    ``mask`` is ``None`` (plain cosine), ``(B_d, D)`` (one mask per document, shared by all
    queries) or ``(B_q, B_d, D)`` (one mask per query-document pair). Masked documents are
    re-normalised; a fully masked document has similarity 0 (and a finite gradient). The
    pairwise case contracts ``q ⊙ M`` with ``d`` instead of materialising ``d ⊙ M`` twice.
    """
    q = F.normalize(q, dim=-1, eps=eps)
    if mask is None:
        return q @ F.normalize(d, dim=-1, eps=eps).T
    if mask.dim() == 2:
        return q @ F.normalize(d * mask, dim=-1, eps=eps).T
    dot = torch.einsum("id,ijd,jd->ij", q, mask, d)
    norm = torch.einsum("ijd,jd->ij", mask * mask, d * d).clamp_min(eps**2).sqrt()
    return dot / norm


def info_nce(sim: Tensor, tau: float, ignore: Tensor | None = None) -> Tensor:
    """InfoNCE ``L_IN`` of Eq. 3 from similarities whose diagonal holds the positives.

    Row ``i`` of ``sim`` is scored against all columns, target ``i``, mean over rows.
    ``L_IN(a, b)`` is ``info_nce(sim(a, b))`` and ``L_IN(b, a)`` is ``info_nce(sim(a, b).T)``.
    ``ignore`` (bool, same shape, never on the diagonal) drops logits that are not negatives, e.g.
    column ``j`` when document ``j`` is one of query ``i``'s positive pages. For ``sim.T`` pass
    ``ignore.T``: the roles of rows and columns swap with it.
    """
    logits = sim / tau
    if ignore is not None:
        logits = logits.masked_fill(ignore, float("-inf"))
    target = torch.arange(sim.shape[0], device=sim.device)
    return F.cross_entropy(logits, target)


@dataclass
class LossOutput:
    """A loss with its detached, unweighted terms and statistics for logging."""

    loss: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)


def mask_statistics(mask: Tensor) -> dict[str, Tensor]:
    """Shares of mask entries equal to 1 (salient), ½ (detail) and 0 (suppressed)."""
    return {
        f"mask/{name}": (mask == value).float().mean() for name, value in (("one", 1.0), ("half", 0.5), ("zero", 0.0))
    }


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class HybridMaskLoss(nn.Module):
    """HKRAG-Ret objective ``L = L_DIN + β·L_SIN`` (Eqs. 4-5) and its Table 5 ablations.

    ======================================  ==================================
    constructor                             loss
    ======================================  ==================================
    ``use_din=True,  use_sin=True``         ``L_DIN + β·L_SIN`` (HKRAG-Ret)
    ``use_din=True,  use_sin=False``        ``L_DIN`` (w/o L_SIN)
    ``use_din=False, use_sin=True``         ``L_IN(q, d) + β·L_SIN`` (w/o L_DIN)
    ``use_din=False, use_sin=False``        ``L_IN(q, d)`` (baseline, Eq. 3)
    ======================================  ==================================

    ``L_IN(q, d)`` is the one-directional query-to-document InfoNCE of Eq. 3, the paper's
    baseline. ``alpha = 0.5`` and ``beta = 1.0`` are our defaults (the paper gives neither).
    Because ``C >= 0``, ``Cn`` is bounded below, and for near-isotropic embeddings the lower
    threshold of Eq. 2 drops below every ``Cn`` just under ``alpha = 1``: nothing is ever
    suppressed. ``alpha = 0.5`` populates all three levels (about 25% one, 31% half, 44%
    zero); the ``mask/*`` metrics show the shares actually reached. ``beta = 1`` weights two
    InfoNCE terms of the same scale equally.

    Masks are pairwise by default: the similarity of query ``i`` and document ``j`` uses
    ``M_H(q_i, d_j)``, computed in chunks of at most ``max_chunk_elements`` mask entries that
    are recomputed in backward, so memory stays bounded for any batch. With
    ``mask_positive_only=True`` document ``j`` is masked by its positive pair's mask
    ``M_H(q_j, d_j)`` against every query. The sub-mask split is drawn from ``generator``;
    ranks computing the same global loss must pass identically seeded generators.
    """

    def __init__(
        self,
        tau: float = 0.01,
        alpha: float = 0.5,
        beta: float = 1.0,
        num_sub_masks: int = 2,
        use_din: bool = True,
        use_sin: bool = True,
        mask_positive_only: bool = False,
        max_chunk_elements: int = 2**24,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_sub_masks < 1:
            raise ValueError(f"num_sub_masks must be >= 1, got {num_sub_masks}")
        self.tau = tau
        self.alpha = alpha
        self.beta = beta
        self.num_sub_masks = num_sub_masks
        self.use_din = use_din
        self.use_sin = use_sin
        self.mask_positive_only = mask_positive_only
        self.max_chunk_elements = max_chunk_elements
        self.eps = eps

    def settings(self) -> dict[str, float | int | bool]:
        """The settings that define the objective (``max_chunk_elements`` only bounds memory)."""
        names = ("tau", "alpha", "beta", "num_sub_masks", "use_din", "use_sin", "mask_positive_only", "eps")
        return {name: getattr(self, name) for name in names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.settings().items())

    def forward(
        self, q: Tensor, d: Tensor, generator: torch.Generator | None = None, ignore: Tensor | None = None
    ) -> LossOutput:
        """Loss of the global batch ``q, d`` (``(B, D)``, positives on the diagonal).

        ``ignore`` (``(B, B)`` bool, false on the diagonal) marks query-document pairs that are not
        negatives: ``ignore[i, j]`` when document ``j`` is one of query ``i``'s positives (with several
        positives per query it is not symmetric). Such a pair leaves query ``i``'s softmax in every
        query-to-document term, and query ``i`` leaves document ``j``'s softmax in the
        document-to-query term of Eq. 4, which therefore uses ``ignore.T``.
        """
        q, d = _at_least_float32(q), _at_least_float32(d)
        positive_mask = hybrid_mask(q, d, self.alpha, self.eps)
        sims = self._masked_similarities(q, d, positive_mask, generator)
        if self.use_din:
            ignore_t = None if ignore is None else ignore.T
            loss = (info_nce(sims[0], self.tau, ignore) + info_nce(sims[0].T, self.tau, ignore_t)) / 2
            components = {"din": loss}
        else:
            loss = info_nce(masked_cosine(q, d), self.tau, ignore)
            components = {"infonce": loss}
        if self.use_sin:
            sub_losses = [info_nce(sim, self.tau, ignore) for sim in sims[-self.num_sub_masks :]]
            components["sin"] = torch.stack(sub_losses).mean()
            loss = loss + self.beta * components["sin"]
        return LossOutput(
            loss=loss,
            components={name: value.detach() for name, value in components.items()},
            metrics=mask_statistics(positive_mask),
        )

    def _masked_similarities(
        self, q: Tensor, d: Tensor, positive_mask: Tensor, generator: torch.Generator | None
    ) -> Tensor | None:
        """Stacked ``(K, B, B)`` similarities under ``M_H`` (if DIN) then each ``M_H^i`` (if SIN)."""
        if not (self.use_din or self.use_sin):
            return None
        device = generator.device if generator is not None else None
        seed = int(torch.randint(2**62, (), generator=generator, device=device))
        if self.mask_positive_only:
            return self._similarities(q, d, positive_mask, seed)
        rows = max(1, self.max_chunk_elements // d.numel())
        chunks = [
            checkpoint(self._pairwise_similarities, q_chunk, d, seed + k, use_reentrant=False, preserve_rng_state=False)
            for k, q_chunk in enumerate(q.split(rows))
        ]
        return torch.cat(chunks, dim=1)

    def _pairwise_similarities(self, q: Tensor, d: Tensor, seed: int) -> Tensor:
        mask = hybrid_mask(q[:, None], d[None], self.alpha, self.eps)
        return self._similarities(q, d, mask, seed)

    def _similarities(self, q: Tensor, d: Tensor, mask: Tensor, seed: int) -> Tensor:
        masks = [mask] if self.use_din else []
        if self.use_sin:
            masks += split_mask(mask, self.num_sub_masks, _seeded_generator(seed, mask.device))
        return torch.stack([masked_cosine(q, d, m) for m in masks])


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row mean next-token NLL, ``(B,)``: position ``t`` predicts ``labels[t + 1]``; ``-100`` is skipped.

    Each row is its own mean (a row without any label gives 0), so a batch's loss is the mean of its
    examples' losses whatever their lengths, as VDocRAG's per-device batch of 1 with accumulation gives.
    """
    logits, labels = _at_least_float32(logits[:, :-1]), labels[:, 1:]
    nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
    counted = labels != IGNORE_INDEX
    return (nll * counted).sum(dim=1) / counted.sum(dim=1).clamp_min(1)


class PretrainingLoss(nn.Module):
    """VDocRAG's pre-training objective ``L = L_RCR + L_RCG`` (VDocRAG §3.2; DESIGN §11, docs/training.md).

    RCR (representation compression via retrieval) is Eq. 3's InfoNCE with a page's text as the query
    and the page image as its document (``tau = 0.01``, EOS pooling, L2 norm: the retriever's own
    embeddings). RCG (representation compression via generation) is the causal-LM loss of the page text
    generated from the image through the EOS token (:func:`causal_lm_loss`, per-example means); the
    trainer computes it in a separate forward pass (:meth:`hkrag.retriever.Phi3VRetriever.generation_loss`).
    :meth:`forward` is RCR with :class:`HybridMaskLoss`'s interface; :meth:`combine` adds RCG, unweighted.
    """

    generative = True

    def __init__(self, tau: float = 0.01, max_target_length: int = 512) -> None:
        super().__init__()
        if max_target_length < 1:
            raise ValueError(f"loss.max_target_length must be >= 1, got {max_target_length}")
        self.tau = tau
        self.max_target_length = max_target_length

    def settings(self) -> dict[str, float | int]:
        return {"tau": self.tau, "max_target_length": self.max_target_length}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.settings().items())

    def forward(
        self, q: Tensor, d: Tensor, generator: torch.Generator | None = None, ignore: Tensor | None = None
    ) -> LossOutput:
        """RCR of the global batch (``generator`` is unused: nothing is drawn)."""
        rcr = info_nce(masked_cosine(_at_least_float32(q), _at_least_float32(d)), self.tau, ignore)
        return LossOutput(loss=rcr, components={"rcr": rcr.detach()})

    @staticmethod
    def combine(rcr: LossOutput, rcg: Tensor) -> LossOutput:
        """``L_RCR + L_RCG`` for logging and the finiteness check (each term was back-propagated already)."""
        rcg = rcg.detach()
        return LossOutput(loss=rcr.loss.detach() + rcg, components={**rcr.components, "rcg": rcg}, metrics=rcr.metrics)
