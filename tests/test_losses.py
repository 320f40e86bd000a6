"""Hybrid-masking losses (paper Eqs. 1-5) against values worked out by hand."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hkrag.losses import (
    HybridMaskLoss,
    correlation,
    hybrid_mask,
    info_nce,
    masked_cosine,
    masked_dot,
    split_mask,
)

# Two queries and two documents (rows normalised below). With alpha = 1 the pair masks follow
# from the pattern of |q_i ⊙ d_j| alone (the z-scores do not depend on the scale):
#   (1,1,1,1)⊙(4,1,1,1) -> |.| = (4,1,1,1):    one high, three low -> (1, ½, ½, ½)
#   (1,1,1,1)⊙(1,-3,3,3) -> (1,3,3,3):          one low, three high -> (0, ½, ½, ½)
#   (1,8,4,4)⊙(4,1,1,1) -> (4,8,4,4):           one high at dim 1   -> (½, 1, ½, ½)
#   (1,8,4,4)⊙(1,-3,3,3) -> (1,24,12,12): Cn = sigmoid(z) = (.200, .809, .492, .492),
#       μ = .499, σ = .215 -> thresholds .283 / .714                -> (0, 1, ½, ½)
Q = [[1.0, 1.0, 1.0, 1.0], [1.0, 8.0, 4.0, 4.0]]
D = [[4.0, 1.0, 1.0, 1.0], [1.0, -3.0, 3.0, 3.0]]
PAIR_MASKS = [
    [[1.0, 0.5, 0.5, 0.5], [0.0, 0.5, 0.5, 0.5]],
    [[0.5, 1.0, 0.5, 0.5], [0.0, 1.0, 0.5, 0.5]],
]
ALPHA, TAU, BETA = 1.0, 0.5, 0.7


def tensors(rows_q=Q, rows_d=D, requires_grad=False):
    q = F.normalize(torch.tensor(rows_q, dtype=torch.float64), dim=-1).requires_grad_(requires_grad)
    d = F.normalize(torch.tensor(rows_d, dtype=torch.float64), dim=-1).requires_grad_(requires_grad)
    return q, d


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def cos(u, v):
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))


def masked(doc, mask):
    return [a * m for a, m in zip(doc, mask, strict=True)]


def nce(sim, tau):
    """Eq. 3 by hand: mean over rows of -log softmax(row / tau)[diagonal]."""
    rows = range(len(sim))
    return sum(math.log(sum(math.exp(s / tau) for s in sim[i])) - sim[i][i] / tau for i in rows) / len(sim)


def transpose(sim):
    return [list(col) for col in zip(*sim, strict=True)]


def hand_similarities(mask_of):
    return [[cos(Q[i], masked(D[j], mask_of(i, j))) for j in range(2)] for i in range(2)]


PAIRWISE = hand_similarities(lambda i, j: PAIR_MASKS[i][j])
POSITIVE_ONLY = hand_similarities(lambda i, j: PAIR_MASKS[j][j])
PLAIN = [[cos(Q[i], D[j]) for j in range(2)] for i in range(2)]


def test_correlation_of_a_two_valued_pattern_is_sigmoid_of_plus_minus_root3():
    q, d = tensors()
    high, low = 1 / (1 + math.exp(-math.sqrt(3))), 1 / (1 + math.exp(1 / math.sqrt(3)))
    assert correlation(q[0], d[0]).tolist() == pytest.approx([high, low, low, low], abs=1e-5)
    assert correlation(q[0], d[1]).tolist() == pytest.approx([1 - high, 1 - low, 1 - low, 1 - low], abs=1e-5)


def test_hybrid_mask_pairs_match_hand_values():
    q, d = tensors()
    assert hybrid_mask(q[:, None], d[None], ALPHA).tolist() == PAIR_MASKS
    assert hybrid_mask(q, d, ALPHA).tolist() == [PAIR_MASKS[0][0], PAIR_MASKS[1][1]]


def test_hybrid_mask_scaling_moves_the_thresholds():
    q, d = tensors()
    # alpha < 1/sqrt(3): the three low dims of (4,1,1,1) fall below μ - α·σ
    assert hybrid_mask(q[0], d[0], 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]
    # alpha > sqrt(3): nothing passes μ + α·σ and nothing falls below μ - α·σ
    assert hybrid_mask(q[0], d[0], 2.0).tolist() == [0.5, 0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    ("positive_only", "sim"), [(False, PAIRWISE), (True, POSITIVE_ONLY)], ids=["pairwise", "positive-only"]
)
@pytest.mark.parametrize(("use_din", "use_sin"), [(False, False), (True, False), (False, True), (True, True)])
def test_loss_matches_hand_computation(positive_only, sim, use_din, use_sin):
    q, d = tensors()
    loss_fn = HybridMaskLoss(
        tau=TAU,
        alpha=ALPHA,
        beta=BETA,
        num_sub_masks=1,
        use_din=use_din,
        use_sin=use_sin,
        mask_positive_only=positive_only,
    )
    din = (nce(sim, TAU) + nce(transpose(sim), TAU)) / 2
    sin = nce(sim, TAU)  # one sub-mask: M_H^1 = M_H
    expected = (din if use_din else nce(PLAIN, TAU)) + (BETA * sin if use_sin else 0.0)
    out = loss_fn(q, d, generator=seeded())
    assert out.loss.item() == pytest.approx(expected, rel=1e-9)
    assert set(out.components) == {"din" if use_din else "infonce"} | ({"sin"} if use_sin else set())
    if use_din:
        assert out.components["din"].item() == pytest.approx(din, rel=1e-9)


def test_pairwise_and_positive_only_share_the_diagonal_but_not_the_negatives():
    q, d = tensors()
    pairwise = masked_cosine(q, d, hybrid_mask(q[:, None], d[None], ALPHA))
    positive = masked_cosine(q, d, hybrid_mask(q, d, ALPHA))
    assert torch.allclose(pairwise.diagonal(), positive.diagonal())
    assert not torch.allclose(pairwise, positive)
    assert pairwise.tolist() == [pytest.approx(row) for row in PAIRWISE]


def test_pairwise_equals_positive_only_where_it_must():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(2, 5, 16), dim=-1)

    def both(q, d, **kwargs):
        losses = (HybridMaskLoss(mask_positive_only=pos, **kwargs)(q, d, seeded(3)) for pos in (False, True))
        return [out.loss for out in losses]

    assert torch.allclose(*both(q[:1], d[:1]))  # one pair: its mask is the positive one
    assert torch.allclose(*both(q, d, alpha=100.0, use_sin=False))  # every mask is ½ everywhere
    assert not torch.allclose(*both(q, d))


def test_mask_entries_are_zero_half_or_one_and_carry_no_gradient():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(2, 8, 32), dim=-1).requires_grad_()
    mask = hybrid_mask(q[:, None], d[None], 0.5)
    assert set(mask.unique().tolist()) == {0.0, 0.5, 1.0}
    assert not mask.requires_grad


def test_split_mask_parts_are_disjoint_random_and_sum_to_the_mask():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(2, 6, 64), dim=-1)
    mask = hybrid_mask(q[:, None], d[None], 0.5)
    generator = seeded()
    parts = split_mask(mask, 3, generator)
    assert len(parts) == 3
    assert torch.equal(sum(parts), mask)
    assert ((torch.stack(parts) != 0).sum(0) <= 1).all()
    for part in parts:
        assert torch.equal(part[part != 0], mask[part != 0])
        assert (part != 0).any()
    assert not torch.equal(split_mask(mask, 3, generator)[0], parts[0])  # fresh split each call
    first, again, other = (split_mask(mask, 3, seeded(seed))[0] for seed in (1, 1, 2))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_din_with_huge_alpha_is_symmetric_infonce():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(2, 8, 32), dim=-1)
    sim = q @ d.T
    symmetric = (info_nce(sim, 0.05) + info_nce(sim.T, 0.05)) / 2
    for positive_only in (False, True):
        loss = HybridMaskLoss(tau=0.05, alpha=1e6, use_sin=False, mask_positive_only=positive_only)(q, d).loss
        assert torch.allclose(loss, symmetric)


def test_gradients_reach_both_sides_and_agree_with_finite_differences():
    torch.manual_seed(0)
    q, d = (F.normalize(torch.randn(4, 12, dtype=torch.float64), dim=-1).requires_grad_() for _ in range(2))
    for positive_only in (False, True):
        loss_fn = HybridMaskLoss(tau=0.5, mask_positive_only=positive_only)
        loss_fn(q, d, seeded()).loss.backward()
        for grad in (q.grad, d.grad):
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0
        q.grad = d.grad = None
        torch.autograd.gradcheck(lambda a, b, f=loss_fn: f(a, b, seeded()).loss, (q, d), fast_mode=True)


def test_chunked_pairwise_masks_give_the_same_loss_and_gradients():
    torch.manual_seed(0)
    q, d = (F.normalize(torch.randn(9, 16), dim=-1).requires_grad_() for _ in range(2))
    results = []
    for max_chunk_elements in (2**20, 40):  # one chunk vs one query row per chunk
        loss = HybridMaskLoss(tau=0.1, use_sin=False, max_chunk_elements=max_chunk_elements)(q, d).loss
        results.append((loss.detach(), *torch.autograd.grad(loss, (q, d))))
    for one, many in zip(*results, strict=True):
        assert torch.allclose(one, many, atol=1e-6)


def test_fully_masked_document_has_zero_similarity_and_finite_gradient():
    q, d = tensors(requires_grad=True)
    for mask in (torch.zeros(2, 4, dtype=q.dtype), torch.zeros(2, 2, 4, dtype=q.dtype)):
        sim = masked_cosine(q, d, mask)
        assert sim.abs().sum() == 0
        grads = torch.autograd.grad(sim.sum(), (q, d))
        assert all(torch.isfinite(g).all() for g in grads)


def test_half_precision_inputs_are_computed_in_float32():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(2, 4, 16), dim=-1)
    loss_fn = HybridMaskLoss(tau=0.1)
    full = loss_fn(q, d, seeded()).loss
    half = loss_fn(q.bfloat16(), d.bfloat16(), seeded()).loss
    assert half.dtype == torch.float32
    assert torch.allclose(full, half, atol=0.1)


def test_mask_statistics_are_shares_over_positive_pairs():
    q, d = tensors()
    metrics = HybridMaskLoss(alpha=ALPHA)(q, d).metrics
    # positive masks (1, ½, ½, ½) and (0, 1, ½, ½): two ones, five halves, one zero
    expected = {"mask/one": 2 / 8, "mask/half": 5 / 8, "mask/zero": 1 / 8}
    assert {name: value.item() for name, value in metrics.items()} == expected


def test_ignored_pairs_leave_the_softmax():
    """Two queries sharing one positive page: the duplicate column is not a negative of either row."""
    q = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    d = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # rows 0 and 1 share a page
    ignore = torch.tensor([[False, True, False], [True, False, False], [False, False, False]])
    sim = q @ d.T
    tau = 0.5
    # row 0: logits [1, -, 0]/tau; row 1: [-, 0.8, 0.6]/tau; row 2: [0, 0, 1]/tau
    expected = (
        -math.log(math.exp(2) / (math.exp(2) + 1))
        - math.log(math.exp(1.6) / (math.exp(1.6) + math.exp(1.2)))
        - math.log(math.exp(2) / (math.exp(2) + 2))
    ) / 3
    assert info_nce(sim, tau, ignore).item() == pytest.approx(expected, rel=1e-6)
    plain = HybridMaskLoss(tau=tau, use_din=False, use_sin=False)
    assert plain(q, d, ignore=ignore).loss.item() == pytest.approx(expected, rel=1e-6)
    assert plain(q, d).loss.item() > expected


def test_multi_positive_exclusion_is_transposed_for_the_document_to_query_term():
    """Query 0 has two positive pages, d0 (its row) and d1 (row 1's); queries 1 and 2 have one each.

    q->d: d1 is not a negative of query 0. d->q: query 0 is not a negative of d1 (d1 is relevant to it),
    but query 1 stays a negative of d0 (d0 is not relevant to query 1): the mask is not symmetric.
    """
    rows_q = [[1.0, 2.0, 3.0], [3.0, 1.0, 2.0], [2.0, 3.0, 1.0]]
    rows_d = [[1.0, 2.0, 4.0], [4.0, 1.0, 2.0], [2.0, 4.0, 1.0]]
    q, d = tensors(rows_q, rows_d)
    ignore = torch.tensor([[False, True, False], [False, False, False], [False, False, False]])
    sim = [[cos(rows_q[i], rows_d[j]) for j in range(3)] for i in range(3)]

    def nce_without(sim, skipped, tau):
        """Eq. 3 by hand, leaving the (row, column) pairs in ``skipped`` out of each row's softmax."""
        terms = [math.log(sum(math.exp(s / tau) for j, s in enumerate(row) if (i, j) not in skipped)) - row[i] / tau
                 for i, row in enumerate(sim)]
        return sum(terms) / len(terms)

    q_to_d = nce_without(sim, {(0, 1)}, TAU)  # row q0 drops d1
    d_to_q = nce_without(transpose(sim), {(1, 0)}, TAU)  # row d1 drops q0; row d0 keeps q1
    # alpha -> inf: every mask is ½ everywhere, so masked cosines are plain cosines (no |q ⊙ d| is constant)
    din = HybridMaskLoss(tau=TAU, alpha=1e6, use_sin=False)
    assert din(q, d, ignore=ignore).loss.item() == pytest.approx((q_to_d + d_to_q) / 2, rel=1e-9)
    both = {(0, 1), (1, 0)}  # the old, symmetric mask drops q1-d0 in both directions too
    symmetric = (nce_without(sim, both, TAU) + nce_without(transpose(sim), both, TAU)) / 2
    assert din(q, d, ignore=ignore | ignore.T).loss.item() != pytest.approx(din(q, d, ignore=ignore).loss.item())
    assert din(q, d, ignore=ignore | ignore.T).loss.item() == pytest.approx(symmetric, rel=1e-9)
    baseline = HybridMaskLoss(tau=TAU, use_din=False, use_sin=False)  # Eq. 3 is query-to-document only
    assert baseline(q, d, ignore=ignore).loss.item() == pytest.approx(q_to_d, rel=1e-9)


def dot(u, v):
    return sum(a * b for a, b in zip(u, v, strict=True))


def unit(v):
    return [a / math.sqrt(dot(v, v)) for a in v]


def loss_fn_of(**kwargs):
    return HybridMaskLoss(tau=TAU, alpha=ALPHA, beta=BETA, num_sub_masks=1, **kwargs)


@pytest.mark.parametrize("positive_only", [False, True], ids=["pairwise", "positive-only"])
def test_dot_similarity_does_not_renormalise_the_masked_document(positive_only):
    q, d = tensors()
    masks = PAIR_MASKS if not positive_only else [[PAIR_MASKS[j][j] for j in range(2)] for _ in range(2)]
    sim = [[dot(unit(Q[i]), masked(unit(D[j]), masks[i][j])) for j in range(2)] for i in range(2)]
    loss_fn = loss_fn_of(use_sin=False, masked_similarity="dot", mask_positive_only=positive_only)
    expected = (nce(sim, TAU) + nce(transpose(sim), TAU)) / 2
    assert loss_fn(q, d).loss.item() == pytest.approx(expected, rel=1e-9)
    assert loss_fn(q, d).loss.item() != pytest.approx(loss_fn_of(use_sin=False)(q, d).loss.item())
    assert masked_dot(q, d, torch.tensor(masks, dtype=q.dtype)).tolist() == [pytest.approx(r) for r in sim]
    assert torch.allclose(masked_dot(q, d), masked_cosine(q, d))  # unmasked the readings agree


def test_infonce_weight_adds_a_plain_infonce_term():
    q, d = tensors()
    din = (nce(PAIRWISE, TAU) + nce(transpose(PAIRWISE), TAU)) / 2
    out = loss_fn_of(infonce_weight=0.3)(q, d, generator=seeded())
    assert out.loss.item() == pytest.approx(0.3 * nce(PLAIN, TAU) + din + BETA * nce(PAIRWISE, TAU), rel=1e-9)
    assert out.components["infonce"].item() == pytest.approx(nce(PLAIN, TAU), rel=1e-9)
    sin_alone = loss_fn_of(use_din=False, infonce_weight=0.0)(q, d, generator=seeded())
    assert sin_alone.loss.item() == pytest.approx(BETA * nce(PAIRWISE, TAU), rel=1e-9)
    assert set(sin_alone.components) == {"sin"}


def test_infonce_weight_default_keeps_the_first_versions_objective():
    assert HybridMaskLoss().infonce_weight == 0.0
    assert HybridMaskLoss(use_din=False).infonce_weight == 1.0
    with pytest.raises(ValueError, match="no term"):
        HybridMaskLoss(use_din=False, use_sin=False, infonce_weight=0.0)
    with pytest.raises(ValueError, match="infonce_weight must be >= 0, got -1"):
        HybridMaskLoss(infonce_weight=-1)
    with pytest.raises(ValueError, match="masked_similarity must be one of \\['cosine', 'dot'\\], got 'l2'"):
        HybridMaskLoss(masked_similarity="l2")


def test_new_settings_enter_the_run_identity_only_when_they_change_the_objective():
    keys = {"tau", "alpha", "beta", "num_sub_masks", "use_din", "use_sin", "mask_positive_only", "eps"}
    assert HybridMaskLoss().settings().keys() == keys
    assert HybridMaskLoss(use_din=False, use_sin=False).settings().keys() == keys
    changed = HybridMaskLoss(use_din=False, infonce_weight=0, masked_similarity="dot", balanced_split=True)
    assert changed.settings().keys() - keys == {"infonce_weight", "masked_similarity", "balanced_split"}


def compose_loss(name):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return HybridMaskLoss(**compose(config_name="train", overrides=[f"loss={name}"]).loss)


def test_table5_configs_are_one_family_with_the_plain_term_only_in_the_baseline():
    terms = {}
    for name in ("hkrag", "no_sin", "no_din", "infonce"):
        loss_fn = compose_loss(name)
        terms[name] = (loss_fn.infonce_weight, loss_fn.use_din, loss_fn.use_sin)
    assert terms == {"hkrag": (0.0, True, True), "no_sin": (0.0, True, False), "no_din": (0.0, False, True),
                     "infonce": (1.0, False, False)}
    default = compose_loss("hkrag")
    assert default.settings() == HybridMaskLoss(tau=default.tau).settings()  # the default objective is unchanged


def test_balanced_split_halves_each_support_exactly():
    mask = torch.tensor([[1.0, 0.5, 0.0, 0.5, 1.0, 0.0, 0.5, 0.0],   # support 5 -> parts of 3 and 2
                         [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0]])  # support 6 -> 3 and 3
    parts = split_mask(mask, 2, seeded(), balanced=True)
    assert torch.equal(parts[0] + parts[1], mask)
    assert ((parts[0] != 0) & (parts[1] != 0)).sum() == 0
    assert [[int((p[row] != 0).sum()) for p in parts] for row in range(2)] == [[3, 2], [3, 3]]
    thirds = split_mask(torch.ones(2, 4, 7), 3, seeded(), balanced=True)
    assert [int((p != 0).sum(-1).unique()) for p in thirds] == [3, 2, 2]
    again, other = (split_mask(mask, 2, seeded(seed), balanced=True)[0] for seed in (0, 1))
    assert torch.equal(again, parts[0]) and not torch.equal(other, parts[0])


def test_balanced_split_loss_by_hand():
    # Two sub-masks that each keep exactly half of every pair mask's support; the loss is the mean of
    # their two InfoNCE terms with the very masks split_mask draws from the loss's seed.
    q, d = tensors()
    loss_fn = HybridMaskLoss(tau=TAU, alpha=ALPHA, use_din=False, infonce_weight=0, balanced_split=True)
    seed = int(torch.randint(2**62, (), generator=seeded(4)))
    parts = split_mask(torch.tensor(PAIR_MASKS, dtype=q.dtype), 2, seeded(seed), balanced=True)
    # pair masks with 4 / 3 non-zero dims (row i, column j): the first part takes the odd one
    assert [(part != 0).sum(-1).tolist() for part in parts] == [[[2, 2], [2, 2]], [[2, 1], [2, 1]]]
    sims = [[[cos(Q[i], masked(D[j], part[i][j].tolist())) for j in range(2)] for i in range(2)] for part in parts]
    expected = sum(nce(sim, TAU) for sim in sims) / 2
    assert loss_fn(q, d, generator=seeded(4)).loss.item() == pytest.approx(expected, rel=1e-9)


def test_mask_shares_are_logged_only_when_a_mask_is_applied():
    q, d = tensors()
    assert HybridMaskLoss(use_din=False, use_sin=False)(q, d).metrics == {}
    for kwargs in ({}, {"use_din": False}, {"use_sin": False}):
        assert set(HybridMaskLoss(**kwargs)(q, d).metrics) == {"mask/one", "mask/half", "mask/zero"}


NEGATIVES = [[1.0, 2.0, 1.0, -1.0], [2.0, 1.0, 0.0, 1.0]]  # one per query, query-major; no |q ⊙ d| constant


def test_hard_negatives_join_the_query_to_document_denominators():
    q, d = tensors(Q, D + NEGATIVES)
    docs = D + NEGATIVES
    plain = [[cos(Q[i], docs[j]) for j in range(4)] for i in range(2)]
    baseline = HybridMaskLoss(tau=TAU, use_din=False, use_sin=False)
    assert baseline(q, d).loss.item() == pytest.approx(nce(plain, TAU), rel=1e-9)
    # alpha -> inf: every mask is ½, masked cosines are plain; d->q scores the two positive documents only
    din = HybridMaskLoss(tau=TAU, alpha=1e6, use_sin=False)
    square = [row[:2] for row in plain]
    assert din(q, d).loss.item() == pytest.approx((nce(plain, TAU) + nce(transpose(square), TAU)) / 2, rel=1e-9)


def test_positive_only_masks_a_hard_negative_by_the_mask_of_its_query():
    q, d = tensors(Q, D + NEGATIVES)
    masks = torch.cat([hybrid_mask(q, d[:2], ALPHA), hybrid_mask(q, d[2:], ALPHA)])  # negative k belongs to query k
    sim = masked_cosine(q, d, masks)
    expected = (info_nce(sim, TAU) + info_nce(sim[:, :2].T, TAU)) / 2
    loss_fn = HybridMaskLoss(tau=TAU, alpha=ALPHA, use_sin=False, mask_positive_only=True)
    assert loss_fn(q, d).loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_hard_negative_batches_are_checked():
    q, d = tensors(Q, D + NEGATIVES[:1])
    with pytest.raises(ValueError, match=r"d of shape \(B·\(1 \+ N\), D\).*got q \(2, 4\) and d \(3, 4\)"):
        HybridMaskLoss()(q, d)
    q, d = tensors(Q, D + NEGATIVES)
    with pytest.raises(ValueError, match=r"ignore must have shape \(B, len\(d\)\) = \(2, 4\), got \(2, 2\)"):
        HybridMaskLoss()(q, d, ignore=torch.zeros(2, 2, dtype=torch.bool))
