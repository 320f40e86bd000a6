"""Loss diagnostics (hkrag/training/diagnostics.py) on hand-built embeddings, and their trainer logging."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.data.pairs import training_pairs
from hkrag.data.synthetic import SyntheticConfig, generate
from hkrag.losses import HybridMaskLoss
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.training.diagnostics import (
    batch_diagnostics,
    gradient_cosine,
    infonce_sin_gradient_cosine,
    logit_spread,
    mean_jaccard,
    participation_ratio,
)
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig


def test_one_dimensional_embeddings_have_participation_ratio_one():
    direction = F.normalize(torch.randn(8, generator=torch.Generator().manual_seed(0)), dim=0)
    rows = torch.tensor([-2.0, -1.0, 0.5, 3.0])[:, None] * direction
    assert participation_ratio(rows) == pytest.approx(1.0)
    assert participation_ratio(rows) / rows.shape[1] == pytest.approx(1 / 8)


def test_isotropic_embeddings_use_every_dimension():
    basis = torch.eye(4)
    assert participation_ratio(torch.cat([basis, -basis])) == pytest.approx(4.0)  # covariance ∝ identity
    # four one-hot rows: centring leaves three equal eigenvalues and a zero one
    assert participation_ratio(basis) == pytest.approx(3.0)
    assert participation_ratio(torch.ones(3, 4)) == 0.0
    with pytest.raises(ValueError, match=r"\(N >= 2, D\) embeddings, got shape \(4,\)"):
        participation_ratio(torch.ones(4))


def test_mean_jaccard_by_hand():
    same = torch.tensor([[1.0, 0.5, 0.0, 0.5]] * 3)
    assert mean_jaccard(same) == 1.0
    assert mean_jaccard(torch.eye(3)) == 0.0
    # {0,1}, {1,2}, {0,1,2,3}: 1/3, 2/4, 2/4
    supports = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]])
    assert mean_jaccard(supports) == pytest.approx((1 / 3 + 1 / 2 + 1 / 2) / 3)
    assert mean_jaccard(torch.zeros(2, 3)) == 1.0  # two empty masks are the same mask


def test_logit_spread_is_the_population_std_of_sim_over_tau():
    assert logit_spread(torch.eye(2), tau=0.5) == pytest.approx(1.0)  # logits 2, 0, 0, 2


def test_gradient_cosine_by_hand():
    w, unused = torch.nn.Parameter(torch.tensor([0.3, -0.7])), torch.nn.Parameter(torch.ones(1))
    along_x, diagonal = w @ torch.tensor([1.0, 0.0]), w @ torch.tensor([1.0, 1.0])
    assert gradient_cosine(along_x, diagonal, [w, unused]) == pytest.approx(1 / math.sqrt(2))
    assert gradient_cosine(along_x, -along_x, [w]) == pytest.approx(-1.0)
    assert w.grad is None  # no .grad is touched
    with pytest.raises(ValueError, match="share no trainable parameter"):
        gradient_cosine(along_x, unused.sum(), [w, unused])


def test_batch_diagnostics_of_orthonormal_pairs_by_hand():
    # q_i = d_i = e_i: plain and masked similarities are the identity (M_H(e_i, e_i) keeps dim i at 1, a
    # negative pair's |q ⊙ d| is constant, so its mask is empty and its similarity 0); with one sub-mask
    # L_SIN = L_DIN = log(e^(1/τ) + 3) − 1/τ per row.
    q = d = torch.eye(4, dtype=torch.float64)
    loss_fn = HybridMaskLoss(tau=1.0, alpha=1.0, num_sub_masks=1)
    values = batch_diagnostics(q, d, loss_fn)
    expected_loss = math.log(math.e + 3) - 1
    assert values["diag/ln_n"] == pytest.approx(math.log(4))
    assert values["diag/din"] == pytest.approx(expected_loss)
    assert values["diag/sin"] == pytest.approx(expected_loss)
    assert values["diag/sin_per_ln_n"] == pytest.approx(expected_loss / math.log(4))
    assert values["diag/logit_std_plain"] == pytest.approx(math.sqrt(3) / 4)  # 1 on 4 of 16 logits
    assert values["diag/logit_std_masked"] == pytest.approx(math.sqrt(3) / 4)
    assert values["diag/jaccard_dense"] == 1.0  # every positive mask is (1, ½, ½, ½) up to order
    assert values["diag/jaccard_sparse"] == 0.0  # salient dims: {i}, disjoint
    assert values["diag/pr_query"] == pytest.approx(3.0) and values["diag/pr_doc_per_dim"] == pytest.approx(0.75)


def test_batch_diagnostics_count_hard_negatives_in_ln_n():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(3, 8), dim=-1), F.normalize(torch.randn(9, 8), dim=-1)  # two negatives each
    assert batch_diagnostics(q, d, HybridMaskLoss(tau=0.1))["diag/ln_n"] == pytest.approx(math.log(9))


def test_sin_gradient_agrees_with_infonce_when_every_mask_is_half():
    # alpha -> inf: M_H = ½ everywhere, one sub-mask = M_H, cosine re-normalises: L_SIN is InfoNCE itself
    torch.manual_seed(0)
    encoder = torch.nn.Linear(6, 6)
    q, d = encoder(torch.randn(4, 6)), encoder(torch.randn(4, 6))
    loss_fn = HybridMaskLoss(tau=0.1, alpha=1e6, num_sub_masks=1)
    assert infonce_sin_gradient_cosine(q, d, loss_fn, encoder.parameters()) == pytest.approx(1.0)
    spread = infonce_sin_gradient_cosine(q, d, HybridMaskLoss(tau=0.1), encoder.parameters(), torch.Generator())
    assert -1.0 <= spread < 1.0


def test_trainer_logs_diagnostics_every_n_steps_without_changing_training(tmp_path):
    generate(tmp_path / "data", SyntheticConfig(n_train=16, n_test=4, train_groups_per_style=1,
                                                 test_groups_per_style=1, group_size=2))
    corpus = load_corpus(tmp_path / "data" / "corpus", "default", "train")
    pairs = training_pairs(load_qa(tmp_path / "data" / "qa", "default", "train"), corpus)

    def train(name, **settings):
        retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, dropout=0.1), num_crops=4, seed=0)
        config = TrainerConfig(global_batch_size=4, chunk_size=None, max_steps=3, lr=1e-3, seed=3, **settings)
        out = tmp_path / name
        RetrieverTrainer(retriever, HybridMaskLoss(tau=0.1), pairs, corpus, config, Accelerator(cpu=True), out,
                         RunLogger(out)).fit()
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    plain, logged = train("plain"), train("diagnosed", diagnostics_every=2)
    assert [row["loss"] for row in logged] == [row["loss"] for row in plain]  # same RNG streams, same weights
    with_diagnostics = [row["step"] for row in logged if "diag/pr_query" in row]
    assert with_diagnostics == [1, 3]  # before steps 0 and 2, logged with the step that follows
    row = logged[0]
    assert row["diag/ln_n"] == pytest.approx(math.log(4)) and -1 <= row["diag/grad_cos_infonce_sin"] <= 1
    assert not any(key.startswith("diag/") for key in plain[0])
