"""Hybrid-masking contrastive losses of HKRAG-Ret (paper §3.2, Eqs. 1-5).

All functions take L2-normalised embeddings ``q`` (queries) and ``d`` (documents) of shape
``(B, D)`` whose row ``i`` pairs are the positives, i.e. the *global* batch after
:func:`hkrag.distributed.gather_with_grad`. Masks exist only in training; at inference the
embeddings are indexed as they are. See ``docs/losses.md`` for the interpretation taken.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

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
def split_mask(
    mask: Tensor, n: int, generator: torch.Generator | None = None, balanced: bool = False
) -> list[Tensor]:
    """Split the support of ``mask`` into ``n`` disjoint random parts (the ``M_H^i`` of Eq. 5).

    Every non-zero entry goes to one of the ``n`` parts and keeps its value (½ or 1), so the parts
    are disjoint and sum to ``mask``. Default: each entry picks its part uniformly at random, so a
    part holds ``|support| / n`` entries in expectation (one draw, cheap at ``B×B×D`` scale). With
    ``balanced`` the support of every mask vector (last dimension) is put in a random order and its
    ``r``-th entry goes to part ``r mod n``: the parts hold exactly ``⌊s/n⌋`` or ``⌈s/n⌉`` of its ``s``
    entries, the lower-numbered parts taking the remainder (two sorts per call). Each call draws a
    fresh split from ``generator`` (global RNG if ``None``).
    """
    if balanced:
        keys = torch.rand(mask.shape, generator=generator, device=mask.device).masked_fill(mask == 0, 2.0)
        part = keys.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True) % n
    else:
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


def masked_dot(q: Tensor, d: Tensor, mask: Tensor | None = None, eps: float = 1e-12) -> Tensor:
    """Dot products ``q_i · (d_j ⊙ M)`` of the L2-normalised ``q`` and ``d``, shape ``(B_q, B_d)``.

    The other reading of ``sim(q, d ⊙ M)`` (the VDocRAG/Tevatron code scores by dot product): the
    masked document is *not* re-normalised, so a mask shrinks the similarity by the share of the
    document's norm it removes. Unmasked it equals :func:`masked_cosine`. ``mask`` as there.
    """
    q, d = F.normalize(q, dim=-1, eps=eps), F.normalize(d, dim=-1, eps=eps)
    if mask is None:
        return q @ d.T
    if mask.dim() == 2:
        return q @ (d * mask).T
    return torch.einsum("id,ijd,jd->ij", q, mask, d)


MASKED_SIMILARITIES = {"cosine": masked_cosine, "dot": masked_dot}
"""``loss.masked_similarity`` readings of ``sim(q, d ⊙ M)`` (docs/losses.md)."""


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

    The loss is ``w·L_IN(q, d) + [use_din]·L_DIN + [use_sin]·β·L_SIN`` with ``w = infonce_weight``.
    ``L_IN(q, d)`` is the one-directional, unmasked query-to-document InfoNCE of Eq. 3, the paper's
    baseline. ``infonce_weight=None`` keeps the rule of the first version: ``w = 1`` exactly when
    ``use_din`` is off (the plain term stood in for ``L_DIN``). The Table 5 configs set ``w``
    explicitly as one family (conf/loss/*.yaml, docs/losses.md):

    ===============================================  ==================================
    constructor                                      loss
    ===============================================  ==================================
    ``use_din=True,  use_sin=True,  w=0``            ``L_DIN + β·L_SIN`` (HKRAG-Ret)
    ``use_din=True,  use_sin=False, w=0``            ``L_DIN`` (w/o L_SIN)
    ``use_din=False, use_sin=True,  w=0``            ``β·L_SIN`` (w/o L_DIN)
    ``use_din=False, use_sin=False, w=1``            ``L_IN(q, d)`` (baseline, Eq. 3)
    ===============================================  ==================================

    ``alpha = 0.5`` and ``beta = 1.0`` are our defaults (the paper gives neither).
    Because ``C >= 0``, ``Cn`` is bounded below, and for near-isotropic embeddings the lower
    threshold of Eq. 2 drops below every ``Cn`` just under ``alpha = 1``: nothing is ever
    suppressed. ``alpha = 0.5`` populates all three levels (about 25% one, 31% half, 44%
    zero); the ``mask/*`` metrics show the shares actually reached. ``beta = 1`` weights two
    InfoNCE terms of the same scale equally. ``masked_similarity`` reads ``sim(q, d ⊙ M)`` as the
    cosine of the re-normalised masked document (``"cosine"``, Eq. 3's literal reading) or as the
    dot product with it (``"dot"``, :func:`masked_dot`); ``balanced_split`` makes the sub-masks of
    Eq. 5 exactly equal in size (:func:`split_mask`).

    Masks are pairwise by default: the similarity of query ``i`` and document ``j`` uses
    ``M_H(q_i, d_j)``, computed in chunks of at most ``max_chunk_elements`` mask entries that
    are recomputed in backward, so memory stays bounded for any batch. With
    ``mask_positive_only=True`` document ``j`` is masked by its positive pair's mask
    ``M_H(q_j, d_j)`` against every query (a hard negative by the mask of the query it was mined
    for). The sub-mask split is drawn from ``generator``; ranks computing the same global loss must
    pass identically seeded generators.
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
        infonce_weight: float | None = None,
        masked_similarity: str = "cosine",
        balanced_split: bool = False,
    ) -> None:
        super().__init__()
        if num_sub_masks < 1:
            raise ValueError(f"num_sub_masks must be >= 1, got {num_sub_masks}")
        if masked_similarity not in MASKED_SIMILARITIES:
            choices = sorted(MASKED_SIMILARITIES)
            raise ValueError(f"masked_similarity must be one of {choices}, got {masked_similarity!r}")
        weight = (0.0 if use_din else 1.0) if infonce_weight is None else float(infonce_weight)
        if weight < 0:
            raise ValueError(f"infonce_weight must be >= 0, got {infonce_weight}")
        if not (use_din or use_sin or weight):
            raise ValueError("the loss has no term: set use_din, use_sin or infonce_weight > 0")
        self.tau = tau
        self.alpha = alpha
        self.beta = beta
        self.num_sub_masks = num_sub_masks
        self.use_din = use_din
        self.use_sin = use_sin
        self.mask_positive_only = mask_positive_only
        self.max_chunk_elements = max_chunk_elements
        self.eps = eps
        self.infonce_weight = weight
        self.masked_similarity = masked_similarity
        self.balanced_split = balanced_split

    def settings(self) -> dict[str, float | int | bool | str]:
        """The settings that define the objective (``max_chunk_elements`` only bounds memory).

        ``infonce_weight``, ``masked_similarity`` and ``balanced_split`` appear only where they change the
        objective of the version before them, so checkpoints written then still resume (same run identity).
        """
        names = ("tau", "alpha", "beta", "num_sub_masks", "use_din", "use_sin", "mask_positive_only", "eps")
        values = {name: getattr(self, name) for name in names}
        earlier = {"infonce_weight": 0.0 if self.use_din else 1.0, "masked_similarity": "cosine",
                   "balanced_split": False}
        values.update({name: getattr(self, name) for name, value in earlier.items() if getattr(self, name) != value})
        return values

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.settings().items())

    def variant(self, **changes: Any) -> HybridMaskLoss:
        """A copy with ``changes`` to its settings (e.g. the terms a diagnostic evaluates), checked as at init."""
        names = [*inspect.signature(HybridMaskLoss).parameters, *self.extra_settings]
        return type(self)(**{**{name: getattr(self, name) for name in names}, **changes})

    # The similarity hooks: a dense embedding here; hkrag.late_interaction.LateInteractionLoss scores by MaxSim.
    extra_settings: tuple[str, ...] = ()
    """Constructor arguments of a subclass beyond this class's (what :meth:`variant` copies)."""

    def check_batch(self, q: Tensor, d: Tensor) -> None:
        """Refuse embeddings of another kind than this loss scores (shapes are checked by :func:`_check_batch`)."""
        if q.dim() != 2 or d.dim() != 2:
            raise ValueError(f"expected one vector per query and document, got q {tuple(q.shape)} and d "
                             f"{tuple(d.shape)} (multi-vector embeddings train with model.head=late_interaction)")

    def similarity(self, q: Tensor, d: Tensor) -> Tensor:
        """Unmasked similarities ``(len(q), len(d))``: the cosine."""
        return masked_cosine(q, d)

    def plain_term(self, q: Tensor, d: Tensor, ignore: Tensor | None) -> Tensor:
        """The unmasked term ``L_IN(q, d)`` of Eq. 3."""
        return info_nce(self.similarity(q, d), self.tau, ignore)

    def pooled(self, x: Tensor) -> Tensor:
        """The vectors the masks of Eqs. 1-2 are computed from: the embedding itself."""
        return x

    def masked(self, q: Tensor, d: Tensor, mask: Tensor) -> Tensor:
        """``sim(q, d ⊙ M)`` under ``loss.masked_similarity``."""
        return MASKED_SIMILARITIES[self.masked_similarity](q, d, mask)

    def chunk_rows(self, q: Tensor, d: Tensor) -> int:
        """Query rows per chunk of the pairwise masked similarities (at most ``max_chunk_elements`` mask entries)."""
        return max(1, self.max_chunk_elements // d.numel())

    def forward(
        self, q: Tensor, d: Tensor, generator: torch.Generator | None = None, ignore: Tensor | None = None
    ) -> LossOutput:
        """Loss of the global batch: ``q`` ``(B, D)``, ``d`` ``(B·(1 + N), D)``, positives on the diagonal.

        ``d``'s first ``B`` rows are the positives; the ``B·N`` rows after them (``N >= 0``) are hard
        negatives, query-major (rows ``B + i·N … B + i·N + N − 1`` were mined for query ``i``). They join
        every query-to-document denominator; the document-to-query term of Eq. 4 scores the ``B``
        positive documents only (a hard negative has no query of its own).

        ``ignore`` (``(B, len(d))`` bool, false on the diagonal) marks query-document pairs that are not
        negatives: ``ignore[i, j]`` when document ``j`` is one of query ``i``'s positives (with several
        positives per query it is not symmetric). Such a pair leaves query ``i``'s softmax in every
        query-to-document term, and query ``i`` leaves document ``j``'s softmax in the
        document-to-query term of Eq. 4, which therefore uses ``ignore.T``.
        """
        q, d = _at_least_float32(q), _at_least_float32(d)
        self.check_batch(q, d)
        batch = _check_batch(q, d, ignore)
        positive_mask = hybrid_mask(self.pooled(q), self.pooled(d[:batch]), self.alpha, self.eps)
        sims = self._masked_similarities(q, d, positive_mask, generator)
        terms = {}
        if self.infonce_weight:
            terms["infonce"] = self.plain_term(q, d, ignore)
        if self.use_din:
            ignore_t = None if ignore is None else ignore[:, :batch].T
            backward = info_nce(sims[0][:, :batch].T, self.tau, ignore_t)
            terms["din"] = (info_nce(sims[0], self.tau, ignore) + backward) / 2
        if self.use_sin:
            sub_losses = [info_nce(sim, self.tau, ignore) for sim in sims[-self.num_sub_masks :]]
            terms["sin"] = torch.stack(sub_losses).mean()
        weights = {"infonce": self.infonce_weight, "din": 1.0, "sin": self.beta}
        loss = sum(weights[name] * value for name, value in terms.items())
        return LossOutput(
            loss=loss,
            components={name: value.detach() for name, value in terms.items()},
            metrics=mask_statistics(positive_mask) if sims is not None else {},
        )

    def masked_similarities(self, q: Tensor, d: Tensor, generator: torch.Generator | None = None) -> Tensor | None:
        """The masked similarities the loss scores, ``(K, B, len(d))``: under ``M_H`` (if DIN), then each
        sub-mask (if SIN); ``None`` without a masked term. For diagnostics (:mod:`hkrag.training.diagnostics`)."""
        q, d = _at_least_float32(q), _at_least_float32(d)
        self.check_batch(q, d)
        positive_mask = hybrid_mask(self.pooled(q), self.pooled(d[: _check_batch(q, d, None)]), self.alpha, self.eps)
        return self._masked_similarities(q, d, positive_mask, generator)

    def _masked_similarities(
        self, q: Tensor, d: Tensor, positive_mask: Tensor, generator: torch.Generator | None
    ) -> Tensor | None:
        """Stacked ``(K, B, len(d))`` similarities under ``M_H`` (if DIN) then each ``M_H^i`` (if SIN)."""
        if not (self.use_din or self.use_sin):
            return None
        device = generator.device if generator is not None else None
        seed = int(torch.randint(2**62, (), generator=generator, device=device))
        if self.mask_positive_only:
            return self._similarities(q, d, self._document_masks(q, d, positive_mask), seed)
        rows = self.chunk_rows(q, d)
        chunks = [
            checkpoint(self._pairwise_similarities, q_chunk, d, seed + k, use_reentrant=False, preserve_rng_state=False)
            for k, q_chunk in enumerate(q.split(rows))
        ]
        return torch.cat(chunks, dim=1)

    def _document_masks(self, q: Tensor, d: Tensor, positive_mask: Tensor) -> Tensor:
        """One mask per document: a positive's pair mask, a hard negative's with the query it was mined for."""
        if len(d) == len(q):
            return positive_mask
        negatives_per_query = len(d) // len(q) - 1
        owners = torch.arange(len(q), device=q.device).repeat_interleave(negatives_per_query)
        pooled_q, pooled_d = self.pooled(q), self.pooled(d[len(q) :])
        return torch.cat([positive_mask, hybrid_mask(pooled_q[owners], pooled_d, self.alpha, self.eps)])

    def _pairwise_similarities(self, q: Tensor, d: Tensor, seed: int) -> Tensor:
        mask = hybrid_mask(self.pooled(q)[:, None], self.pooled(d)[None], self.alpha, self.eps)
        return self._similarities(q, d, mask, seed)

    def _similarities(self, q: Tensor, d: Tensor, mask: Tensor, seed: int) -> Tensor:
        masks = [mask] if self.use_din else []
        if self.use_sin:
            generator = _seeded_generator(seed, mask.device)
            masks += split_mask(mask, self.num_sub_masks, generator, self.balanced_split)
        return torch.stack([self.masked(q, d, m) for m in masks])


def _check_batch(q: Tensor, d: Tensor, ignore: Tensor | None) -> int:
    """``B``, after checking that ``d`` holds ``B`` positives and ``B·N`` negatives, ``ignore`` ``(B, len(d))``."""
    batch = len(q)
    if q.dim() != d.dim() or q.shape[-1] != d.shape[-1] or batch == 0 or len(d) % batch:
        raise ValueError(
            f"expected q of shape (B, D) and d of shape (B·(1 + N), D) (positives, then N hard negatives per "
            f"query), got q {tuple(q.shape)} and d {tuple(d.shape)}"
        )
    if ignore is not None and ignore.shape != (batch, len(d)):
        raise ValueError(f"ignore must have shape (B, len(d)) = {(batch, len(d))}, got {tuple(ignore.shape)}")
    return batch


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

    def __init__(self, tau: float = 0.01, max_target_length: int = 512, max_query_length: int = 512) -> None:
        super().__init__()
        for name, value in (("max_target_length", max_target_length), ("max_query_length", max_query_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"loss.{name} must be an integer >= 1, got {value!r}")
        self.tau = tau
        self.max_target_length = max_target_length
        self.max_query_length = max_query_length
        """RCR's query (the page text + EOS) is cut to this many tokens, its own limit (VDocRAG's query_max_len)."""

    def settings(self) -> dict[str, float | int]:
        return {"tau": self.tau, "max_target_length": self.max_target_length,
                "max_query_length": self.max_query_length}

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
