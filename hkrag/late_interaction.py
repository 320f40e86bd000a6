"""Late interaction (ColBERT / ColPali) for the Phi3V retriever: MaxSim scoring and its losses (docs/losses.md).

A late-interaction embedding is a ``(B, L, dim)`` float tensor of L2-normalised token vectors whose padding rows
are exactly zero (the convention colpali-engine's losses rely on too): a row is a real token iff it is non-zero.
:func:`maxsim_mean` scores every query against every document, ``S[i, j] = mean_n max_m q_in · d_jm`` over query ``i``'s
real tokens ``n`` and document ``j``'s real tokens ``m`` (ColPali's score divided by the query's token count,
colpali-engine's ``normalize_scores=True``), so scores lie in ``[-1, 1]`` like the dense cosine and the dense
temperatures carry over.

HKRAG's masks (Eqs. 1-5) act on the embedding's feature dimensions. For late interaction we compute the pair mask
``M_H(q_i, d_j)`` from the two sides' pooled vectors (the normalised mean of the real token vectors, :func:`pooled`)
and apply it to every document token of the pair: ``sim(q_i, d_j ⊙ M) = mean_n max_m q_in · (d_jm ⊙ M_ij)``
(``masked_similarity=dot``) or with each masked document token re-normalised (``cosine``, Eq. 3's literal
reading). Every token lives in the same projected space, so one feature mask per pair keeps Eq. 2's meaning (which
dimensions of this query-page pair are salient, detail, suppressed) and costs ``B·B·dim`` mask entries, where a mask
per token pair would cost ``Lq·Ld`` times more (docs/losses.md, "Late interaction").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hkrag.distributed import is_distributed
from hkrag.losses import HybridMaskLoss

HEADS = ("dense", "late_interaction")
"""``model.head`` values: one EOS vector per text (the paper's) or one projected vector per token (ColPali's)."""
PROJECTION = "custom_text_proj"
"""The projection's module name on the causal LM (ColPali's name); an adapter trained with it saves it (peft
``modules_to_save``), so its weights travel with the adapter."""
DEFAULT_DIM = 128
"""ColPali's projection size."""
QUERY_AUGMENTATION = 10
"""Query augmentation tokens appended after the query (ColBERT's [MASK] padding; colpali-engine appends ten copies
of ``query_augmentation_token``, ColQwen2's being its end-of-text token): we append ten EOS tokens, attended, whose
vectors join MaxSim."""
PAIRWISE_TAU = 1.0
"""colpali-engine's ``ColbertPairwiseCELoss`` default temperature (ColPali's training configs keep it)."""


def token_mask(x: Tensor) -> Tensor:
    """``(B, L)`` bool: the real (non-zero) token rows of a padded multi-vector batch."""
    return x.abs().amax(dim=-1) > 0


def pooled(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``(B, dim)``: the L2-normalised mean of each row's real token vectors (what the masks of Eqs. 1-2 read)."""
    mask = token_mask(x).unsqueeze(-1).to(x.dtype)
    return F.normalize((x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1), dim=-1, eps=eps)


def _max_over_document(tokens: Tensor, d_real: Tensor) -> Tensor:
    """``tokens`` ``(..., Bd, Lq, Ld)`` token similarities: max over each document's real tokens, ``(..., Bd, Lq)``."""
    return tokens.masked_fill(~d_real[:, None, :], float("-inf")).amax(dim=-1)


def _mean_over_query(best: Tensor, q_real: Tensor) -> Tensor:
    """``best`` ``(Bq, Bd, Lq)``: the mean over each query's real tokens, ``(Bq, Bd)`` (a document without any real
    token scores ``-inf`` there and so leaves every softmax)."""
    weights = q_real.to(best.dtype) / q_real.sum(dim=1, keepdim=True).clamp_min(1)
    best = torch.where(q_real[:, None, :], best, torch.zeros((), dtype=best.dtype, device=best.device))
    return (best * weights[:, None, :]).sum(dim=-1)


def maxsim_mean(q: Tensor, d: Tensor) -> Tensor:
    """MaxSim scores ``(Bq, Bd)`` of padded ``q`` ``(Bq, Lq, dim)`` and ``d`` ``(Bd, Ld, dim)``: per query token the
    best document token's dot product, averaged over the query's real tokens (padding masked on both sides)."""
    q_real, d_real = token_mask(q), token_mask(d)
    tokens = torch.einsum("ind,jmd->ijnm", q, d)
    return _mean_over_query(_max_over_document(tokens, d_real), q_real)


def masked_maxsim(q: Tensor, d: Tensor, mask: Tensor, renormalise: bool = False, eps: float = 1e-12) -> Tensor:
    """MaxSim of ``q`` against the documents under the pair masks ``mask`` ``(Bq, Bd, dim)``:
    ``mean_n max_m q_in · (d_jm ⊙ M_ij)``, each masked document token re-normalised when ``renormalise``
    (the ``cosine`` reading of ``sim(q, d ⊙ M)``; a fully masked token then scores 0). Unmasked (all ones) it
    equals :func:`maxsim_mean`."""
    q_real, d_real = token_mask(q), token_mask(d)
    tokens = torch.einsum("ind,ijd,jmd->ijnm", q, mask, d)
    if renormalise:
        norms = torch.einsum("ijd,jmd->ijm", mask * mask, d * d).clamp_min(eps**2).sqrt()
        tokens = tokens / norms[:, :, None, :]
    return _mean_over_query(_max_over_document(tokens, d_real), q_real)


def pad_tokens(x: Tensor, length: int) -> Tensor:
    """``x`` ``(B, L, dim)`` zero-padded to ``length`` tokens (a no-op at ``L == length``)."""
    return F.pad(x, (0, 0, 0, length - x.shape[1])) if x.shape[1] < length else x


def pad_across_ranks(x: Tensor) -> Tensor:
    """``x`` zero-padded to the longest token count of any rank, so DDP's all-gather gets equal shapes (each rank's
    batch is padded to its own longest text; the padding rows are zero and stay masked)."""
    if not is_distributed():
        return x
    length = torch.tensor([x.shape[1]], device=x.device)
    torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX)
    return pad_tokens(x, int(length))


def concat_padded(parts: list[Tensor]) -> Tensor:
    """Row-wise concatenation of multi-vector chunks of different token counts (zero-padded to the longest); 2-D
    tensors are concatenated as they are."""
    if parts and parts[0].dim() == 3:
        length = max(p.shape[1] for p in parts)
        parts = [pad_tokens(p, length) for p in parts]
    return torch.cat(parts)


class LateInteractionLoss(HybridMaskLoss):
    """:class:`~hkrag.losses.HybridMaskLoss` over MaxSim: the same terms and Table 5 family, the dense cosine
    replaced by :func:`maxsim_mean` and the masked similarities by :func:`masked_maxsim` under pair masks from the
    pooled vectors (module docstring). ``q`` ``(B, Lq, dim)``, ``d`` ``(B·(1 + N), Ld, dim)``, zero-padded.

    The plain term (``infonce_weight``) is colpali-engine's ``ColbertLoss`` (InfoNCE over MaxSim scores normalised
    by query length, temperature ``tau``) over the gathered global batch, so every other row of every rank is a
    negative; ``pairwise=True`` makes it their ``ColbertPairwiseCELoss``: ``softplus((s_neg - s_pos) /
    pairwise_tau)`` with ``s_neg`` the hardest negative of each query (pages in ``ignore`` are not negatives) and
    ``pairwise_tau`` its own temperature, colpali-engine's default :data:`PAIRWISE_TAU` unless set (``tau`` stays
    the masked terms' and InfoNCE's).
    """

    extra_settings = ("pairwise", "pairwise_tau")

    def __init__(self, *args: Any, pairwise: bool = False, pairwise_tau: float = PAIRWISE_TAU, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if pairwise_tau <= 0:
            raise ValueError(f"pairwise_tau must be > 0, got {pairwise_tau}")
        self.pairwise = pairwise
        self.pairwise_tau = pairwise_tau

    def settings(self) -> dict[str, float | int | bool | str]:
        values = {**super().settings(), "head": "late_interaction", "pairwise": self.pairwise}
        return values | ({"pairwise_tau": self.pairwise_tau} if self.pairwise else {})

    def check_batch(self, q: Tensor, d: Tensor) -> None:
        if q.dim() != 3 or d.dim() != 3 or q.shape[-1] != d.shape[-1]:
            raise ValueError(f"late interaction needs q (B, Lq, dim) and d (B·(1 + N), Ld, dim), got q "
                             f"{tuple(q.shape)} and d {tuple(d.shape)}: train with model.head=late_interaction")

    def similarity(self, q: Tensor, d: Tensor) -> Tensor:
        return maxsim_mean(q, d)

    def plain_term(self, q: Tensor, d: Tensor, ignore: Tensor | None) -> Tensor:
        if not self.pairwise:
            return super().plain_term(q, d, ignore)
        return pairwise_loss(maxsim_mean(q, d), self.pairwise_tau, ignore)

    def pooled(self, x: Tensor) -> Tensor:
        return pooled(x)

    def masked(self, q: Tensor, d: Tensor, mask: Tensor) -> Tensor:
        if mask.dim() == 2:  # one mask per document (mask_positive_only), the same against every query
            mask = mask.expand(len(q), *mask.shape)
        return masked_maxsim(q, d, mask, renormalise=self.masked_similarity == "cosine", eps=self.eps)

    def chunk_rows(self, q: Tensor, d: Tensor) -> int:
        return max(1, self.max_chunk_elements // (d.numel() * q.shape[1]))


def pairwise_loss(scores: Tensor, tau: float = PAIRWISE_TAU, ignore: Tensor | None = None) -> Tensor:
    """colpali-engine's ``ColbertPairwiseCELoss`` on a score matrix whose diagonal holds the positives:
    ``mean_i softplus((max_{j≠i, not ignored} S_ij - S_ii) / tau)``."""
    off = torch.eye(*scores.shape, dtype=torch.bool, device=scores.device)
    if ignore is not None:
        off = off | ignore
    negatives = scores.masked_fill(off, float("-inf")).amax(dim=1)
    return F.softplus((negatives - scores.diagonal()) / tau).mean()


def make_projection(hidden_size: int, dim: int = DEFAULT_DIM, seed: int = 0) -> nn.Linear:
    """The ColPali projection ``hidden -> dim``, initialised as ``nn.Linear`` does but from its own generator, so a
    base model carries the same untrained projection in every process and run."""
    projection = nn.Linear(hidden_size, dim)
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(hidden_size)
    with torch.no_grad():
        projection.weight.uniform_(-bound, bound, generator=generator)
        projection.bias.uniform_(-bound, bound, generator=generator)
    return projection


def project_tokens(projection: nn.Module, hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """``projection(hidden)`` L2-normalised per token, in float32, padding rows exactly zero."""
    tokens = F.normalize(projection(hidden).float(), dim=-1)
    return tokens * attention_mask.unsqueeze(-1).to(tokens.dtype)


def unpad(x: Tensor) -> list[Tensor]:
    """The real token rows of each item of a padded batch."""
    return [row[keep] for row, keep in zip(x, token_mask(x), strict=True)]
