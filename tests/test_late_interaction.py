"""Late interaction (ColPali on the tiny Phi3V): MaxSim, its losses and the paper's masks against hand-computed values
and colpali-engine; gradient caching over ragged token counts; the head's adapter round trip."""

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _colpali import colpali_module
from PIL import Image
from test_losses import ALPHA, BETA, PAIR_MASKS, TAU, D, Q
from torch import nn

from hkrag.late_interaction import (
    PAIRWISE_TAU,
    LateInteractionLoss,
    masked_maxsim,
    maxsim_mean,
    pairwise_loss,
    pooled,
    unpad,
)
from hkrag.losses import HybridMaskLoss, hybrid_mask, info_nce
from hkrag.models.phi3v.loading import tiny_phi3v
from hkrag.retriever import AdapterMismatchError, HeadSettings, LoraSettings, Phi3VRetriever
from hkrag.training.gradcache import grad_cache_step

# Padded multi-vector batch (zero rows are padding). By hand:
#   q0 = {(1,0), (0,1)}, q1 = {(.6,.8)}, q2 = {(0,-1)};  d0 = {(1,0), (.6,.8)}, d1 = {(0,1)}
#   S[0,0] = mean(max(1, .6), max(0, .8)) = .9      S[0,1] = mean(0, 1) = .5
#   S[1,0] = max(.6, 1.0) = 1.0                      S[1,1] = .8
#   S[2,0] = max(0, -.8) = 0                         S[2,1] = -1 (the padding row of d1 would give 0: masked)
QUERIES = [[[1, 0], [0, 1], [0, 0]], [[0.6, 0.8], [0, 0], [0, 0]], [[0, -1], [0, 0], [0, 0]]]
DOCS = [[[1, 0], [0.6, 0.8]], [[0, 1], [0, 0]]]
SCORES = [[0.9, 0.5], [1.0, 0.8], [0.0, -1.0]]


def batch():
    return torch.tensor(QUERIES, dtype=torch.float64), torch.tensor(DOCS, dtype=torch.float64)


def test_maxsim_matches_hand_values_and_masks_padding():
    q, d = batch()
    torch.testing.assert_close(maxsim_mean(q, d), torch.tensor(SCORES, dtype=torch.float64))
    assert [len(t) for t in unpad(q)] == [2, 1, 1]


def test_masked_maxsim_by_hand():
    """Pair (q0, d0) under M = (½, 1): d0's tokens become (.5, 0) and (.3, .8).
    dot: mean(max(.5, .3), max(0, .8)) = .65; cosine (each masked token re-normalised): (1, 0) and (.3, .8)/.854:
    mean(max(1, .351), max(0, .936)) = .968."""
    q, d = batch()
    mask = torch.tensor([0.5, 1.0], dtype=torch.float64).expand(3, 2, 2)
    assert masked_maxsim(q, d, mask)[0, 0].item() == pytest.approx(0.65)
    assert masked_maxsim(q, d, mask, renormalise=True)[0, 0].item() == pytest.approx((1 + 0.8 / math.hypot(.3, .8)) / 2)
    torch.testing.assert_close(masked_maxsim(q, d, torch.ones(3, 2, 2, dtype=torch.float64)), maxsim_mean(q, d))


def test_infonce_and_pairwise_over_maxsim_by_hand():
    """rows q0, q1 against d0, d1 at tau .1: InfoNCE = mean(log(1 + e^-4), log(1 + e^2)); the pairwise loss =
    mean(softplus((.5 - .9) / .1), softplus((1 - .8) / .1))."""
    q, d = batch()
    loss = LateInteractionLoss(tau=0.1, use_din=False, use_sin=False, infonce_weight=1.0)(q[:2], d)
    expected = (math.log1p(math.exp(-4)) + math.log1p(math.exp(2))) / 2
    assert loss.loss.item() == pytest.approx(expected)
    pairwise = LateInteractionLoss(use_din=False, use_sin=False, infonce_weight=1.0, pairwise=True, pairwise_tau=0.1)
    expected = (F.softplus(torch.tensor(-4.0)) + F.softplus(torch.tensor(2.0))).item() / 2
    assert pairwise(q[:2], d).loss.item() == pytest.approx(expected, rel=1e-6)
    assert pairwise_loss(maxsim_mean(q[:2], d), 0.1).item() == pytest.approx(expected, rel=1e-6)


def test_pairwise_temperature_defaults_to_colpali_engines():
    """colpali-engine's ColbertPairwiseCELoss defaults to temperature 1.0, whatever ``tau`` InfoNCE uses: at the
    default the loss is mean(softplus((.5 - .9) / 1), softplus((1 - .8) / 1)) on the hand batch."""
    q, d = batch()
    pairwise = LateInteractionLoss(tau=0.05, use_din=False, use_sin=False, infonce_weight=1.0, pairwise=True)
    assert pairwise.pairwise_tau == PAIRWISE_TAU == 1.0
    assert inspect.signature(pairwise_loss).parameters["tau"].default == PAIRWISE_TAU
    expected = (math.log1p(math.exp(-0.4)) + math.log1p(math.exp(0.2))) / 2
    assert pairwise(q[:2], d).loss.item() == pytest.approx(expected, rel=1e-6)
    assert pairwise.variant(use_sin=False).pairwise_tau == 1.0
    assert pairwise.settings()["pairwise_tau"] == 1.0 and "pairwise_tau" not in LateInteractionLoss().settings()
    with pytest.raises(ValueError, match="pairwise_tau must be > 0"):
        LateInteractionLoss(pairwise=True, pairwise_tau=0)


@pytest.fixture(scope="module")
def colpali():
    """colpali-engine's loss module (tests/_colpali.py; skipped when colpali-engine is not installed)."""
    with colpali_module("loss.late_interaction_losses") as module:
        yield module


def random_batch(rows: int, length: int, dim: int, seed: int) -> torch.Tensor:
    """Normalised token vectors with ragged lengths (trailing zero rows)."""
    generator = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(rows, length, dim, generator=generator, dtype=torch.float64), dim=-1)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    return x * (torch.arange(length)[None, :] < lengths[:, None]).unsqueeze(-1)


def test_losses_match_colpali_engine(colpali, monkeypatch):
    """Ragged queries, pages of full length: colpali-engine relies on zero padding (a page's padding row scores 0,
    which would beat real tokens that all score below 0), where MaxSim here masks it; the two agree without it."""
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    q, d = random_batch(5, 7, 16, 0), F.normalize(torch.randn(5, 11, 16, dtype=torch.float64), dim=-1)
    ours = LateInteractionLoss(tau=0.02, use_din=False, use_sin=False, infonce_weight=1.0)
    torch.testing.assert_close(ours(q, d).loss, colpali.ColbertLoss(temperature=0.02)(q, d))
    pairwise = LateInteractionLoss(tau=0.5, use_din=False, use_sin=False, infonce_weight=1.0, pairwise=True)
    torch.testing.assert_close(pairwise(q, d).loss, colpali.ColbertPairwiseCELoss()(q, d))  # both defaults
    pairwise = LateInteractionLoss(use_din=False, use_sin=False, infonce_weight=1.0, pairwise=True, pairwise_tau=0.5)
    torch.testing.assert_close(pairwise(q, d).loss, colpali.ColbertPairwiseCELoss(temperature=0.5)(q, d))
    default = inspect.signature(colpali.ColbertPairwiseCELoss).parameters["temperature"].default
    assert default == LateInteractionLoss(pairwise=True).pairwise_tau


def split_tokens(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """(B, D) unit rows as `tokens` unit vectors each, whose mean points along the row: ``normalize(x ± e)`` with e
    orthogonal to x (so the mask of Eqs. 1-2, computed on the pooled vectors, is the dense test's)."""
    e = torch.zeros_like(x)
    e[:, 0], e[:, 1] = -x[:, 1], x[:, 0]  # orthogonal to x in the first two coordinates
    e = 0.3 * F.normalize(e - (e * x).sum(-1, keepdim=True) * x, dim=-1)
    parts = [F.normalize(x + e, dim=-1), F.normalize(x - e, dim=-1)][:tokens]
    return torch.stack(parts, dim=1)


def hand_masked_maxsim(q: torch.Tensor, d: torch.Tensor, masks, cosine: bool) -> torch.Tensor:
    """``sim(q_i, d_j ⊙ M_ij)`` by explicit loops over pairs and tokens."""
    out = torch.zeros(len(q), len(d), dtype=q.dtype)
    for i, q_tokens in enumerate(unpad(q)):
        for j, d_tokens in enumerate(unpad(d)):
            masked = d_tokens * masks[i][j]
            if cosine:
                masked = F.normalize(masked, dim=-1)
            out[i, j] = sum(max(float(t @ m) for m in masked) for t in q_tokens) / len(q_tokens)
    return out


@pytest.mark.parametrize("sim", ["cosine", "dot"])
def test_din_over_maxsim_by_hand(sim):
    """The masks of Eqs. 1-2 come from the pooled vectors (here along Q and D, so they are test_losses's hand
    PAIR_MASKS) and mask every document token of the pair; L_DIN of Eq. 4 over the masked MaxSim scores."""
    q_rows, d_rows = (F.normalize(torch.tensor(rows, dtype=torch.float64), dim=-1) for rows in (Q, D))
    q, d = split_tokens(q_rows, 2), split_tokens(d_rows, 2)
    torch.testing.assert_close(pooled(q), q_rows)
    masks = torch.tensor(PAIR_MASKS, dtype=torch.float64)
    torch.testing.assert_close(hybrid_mask(pooled(q)[:, None], pooled(d)[None], ALPHA), masks)
    sims = hand_masked_maxsim(q, d, masks, cosine=sim == "cosine")
    expected = (info_nce(sims, TAU) + info_nce(sims.T, TAU)) / 2
    loss = LateInteractionLoss(tau=TAU, alpha=ALPHA, use_sin=False, masked_similarity=sim)(q, d)
    assert loss.loss.item() == pytest.approx(expected.item())
    assert set(loss.components) == {"din"}


@pytest.mark.parametrize("sim", ["cosine", "dot"])
@pytest.mark.parametrize("positive_only", [False, True])
def test_one_token_per_text_is_the_dense_loss(sim, positive_only):
    """With one token per text MaxSim is the cosine and the pooled vector the token: L = L_DIN + β·L_SIN equals the
    dense loss, sub-mask draws included."""
    q, d = (F.normalize(torch.tensor(rows, dtype=torch.float64), dim=-1) for rows in (Q, D))
    settings = dict(tau=TAU, alpha=ALPHA, beta=BETA, masked_similarity=sim, mask_positive_only=positive_only)
    dense = HybridMaskLoss(**settings)(q, d, torch.Generator().manual_seed(3))
    late = LateInteractionLoss(**settings)(q[:, None], d[:, None], torch.Generator().manual_seed(3))
    assert late.loss.item() == pytest.approx(dense.loss.item())
    assert late.components.keys() == dense.components.keys() == {"din", "sin"}


def test_losses_refuse_the_other_kind_of_embedding():
    q, d = batch()
    with pytest.raises(ValueError, match="model.head=late_interaction"):
        HybridMaskLoss()(q[:2], d)
    with pytest.raises(ValueError, match="late interaction needs"):
        LateInteractionLoss()(q[:2, 0], d[:, 0])
    assert LateInteractionLoss(pairwise=True).variant(use_sin=False).pairwise  # diagnostics' copies keep it


class TokenEncoder(nn.Module):
    """Rows of ``x`` (B, L, D_in) with ``lengths`` to padded token vectors, cut to the chunk's longest row (so chunks
    of one batch have different token counts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(5, 8)

    def forward(self, inputs) -> torch.Tensor:
        longest = int(inputs["lengths"].max())
        x = inputs["x"][:, :longest]
        keep = torch.arange(longest)[None, :] < inputs["lengths"][:, None]
        return F.normalize(self.proj(x), dim=-1) * keep.unsqueeze(-1)


def token_inputs(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 9, 5, generator=generator), "lengths": torch.tensor([2, 9, 3, 1, 4, 6])}


def test_gradient_caching_over_ragged_token_counts_equals_one_backward():
    model, loss_fn = TokenEncoder(), LateInteractionLoss(tau=0.1, beta=0.5)
    queries, docs = token_inputs(0), token_inputs(1)

    def chunks(inputs):
        return [{key: value[start : start + 2] for key, value in inputs.items()} for start in range(0, 6, 2)]

    def loss(q, d):
        return loss_fn(q, d, torch.Generator().manual_seed(1))

    cached = grad_cache_step(model, model, chunks(queries), chunks(docs), loss)
    cached_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = loss(model(queries), model(docs))
    whole.loss.backward()
    torch.testing.assert_close(cached.loss, whole.loss.detach())
    for got, expected in zip(cached_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, expected)


LATE = HeadSettings("late_interaction", dim=16)


def tiny_late(adapter=None, trainable=False, head=LATE):
    model, processor = tiny_phi3v(texts=["what is the total"], num_crops=4, seed=0)
    lora = LoraSettings(r=4, alpha=8, dropout=0.0) if adapter is None else None
    return Phi3VRetriever.wrap(model, processor, adapter, lora, trainable or adapter is None, head=head)


PAGE = Image.new("RGB", (112, 84), "white")


def test_the_head_embeds_every_token_and_augments_queries():
    retriever = tiny_late().eval()
    dense = Phi3VRetriever.tiny(num_crops=4, texts=["what is the total"])
    [query] = retriever.encode_queries(["what is the total"])
    plain = dense.query_inputs(["what is the total"])["input_ids"]
    assert query.shape == (plain.shape[1] + 10, 16)  # ten query augmentation tokens
    assert torch.allclose(query.norm(dim=-1), torch.ones(len(query)))
    [page] = retriever.encode_documents([PAGE])
    assert page.shape == (retriever.document_inputs([PAGE])["input_ids"].shape[1], 16)
    trained = {n for n, p in retriever.named_parameters() if p.requires_grad and "lora" not in n}
    projection = "model.base_model.model.custom_text_proj.modules_to_save.default"
    assert trained == {f"{projection}.weight", f"{projection}.bias"}


def test_the_projection_travels_with_the_adapter(tmp_path):
    retriever = tiny_late()
    with torch.no_grad():
        retriever.causal_lm.custom_text_proj.modules_to_save["default"].weight.mul_(-2)  # "trained"
    retriever.eval().save(tmp_path / "late")
    [before] = retriever.encode_documents([PAGE])
    [after] = tiny_late(tmp_path / "late").eval().encode_documents([PAGE])
    torch.testing.assert_close(after, before)
    with pytest.raises(AdapterMismatchError, match="evaluate it with model.head=late_interaction"):
        tiny_late(tmp_path / "late", head=None)
    Phi3VRetriever.tiny(lora=LoraSettings(r=4, alpha=8), num_crops=4, texts=["what is the total"]).save(tmp_path / "d")
    with pytest.raises(AdapterMismatchError, match="no late-interaction projection"):
        tiny_late(tmp_path / "d")
    warm = tiny_late(tmp_path / "d", trainable=True)  # a dense warm start gets a new, trainable projection
    assert warm.late_interaction and "custom_text_proj" in warm.model.peft_config["default"].modules_to_save


def test_head_settings_are_checked():
    with pytest.raises(ValueError, match="model.head must be one of"):
        HeadSettings("colbert")
    with pytest.raises(ValueError, match="model.late_interaction.dim"):
        HeadSettings("late_interaction", dim=0)


def test_exact_maxsim_index_ranks_by_maxsim():
    from hkrag.index.maxsim import MaxSimIndex

    pages = [np.asarray(t) for t in unpad(random_batch(9, 6, 8, 2).float())]
    queries = [np.asarray(t) for t in unpad(random_batch(4, 5, 8, 3).float())]
    index = MaxSimIndex.from_pages([f"p{i}" for i in range(9)], pages, memory=4 * 5 * 12)  # several page chunks
    expected = np.array([[np.mean([max(float(t @ s) for s in page) for t in query]) for page in pages]
                         for query in queries])
    np.testing.assert_allclose(index.scores(queries), expected, rtol=1e-5)
    run = index.to_run(["a", "b", "c", "d"], queries, 3)
    assert list(run["a"]) == [f"p{j}" for j in np.argsort(-expected[0], kind="stable")[:3]]
    with pytest.raises(ValueError, match="queries: vectors have dim 4, expected 8"):
        index.scores([np.zeros((2, 4), dtype=np.float32)])
    with pytest.raises(ValueError, match="query #1 is padding only"):
        index.scores([queries[0], np.zeros((0, 8), dtype=np.float32)])


def test_train_encode_and_evaluate_with_the_late_interaction_head(tmp_path):
    """train.py with model.head=late_interaction (gradient caching on), then eval.py on its run folder: the run's head
    is read from its checkpoint, the pages go to multi-vector shards, and exact MaxSim gives the training report's
    figures; the report table has Table 2's layout."""
    from test_experiment import SMALL_DATA, config

    from hkrag.index.shards import load_multi_vector_shards, read_manifest
    from hkrag.tasks.retrieval import run_retrieval_evaluation
    from hkrag.tasks.training import run_training

    data = [f"paths.data_dir={tmp_path / 'data'}", *SMALL_DATA]
    report = run_training(config("train", [
        *data, f"paths.output_dir={tmp_path / 'run'}", "model.num_crops=4", "model.head=late_interaction",
        "model.late_interaction.dim=16", "trainer.global_batch_size=8", "trainer.chunk_size=3", "trainer.max_steps=2",
        "trainer.save_every=null", "eval.doc_batch_size=16", "eval.pools=[all]"]), tmp_path / "run")
    assert report["steps"] == 2
    shards = tmp_path / "run" / "eval-after" / "embeddings-all"
    assert read_manifest(shards)["layout"] == "multi_vector" and read_manifest(shards)["dim"] == 16
    ids, _, offsets = load_multi_vector_shards(shards)
    assert len(ids) == len(offsets) - 1 and (np.diff(offsets) > 1).all()
    evaluated = run_retrieval_evaluation(config("eval", [
        *data, f"paths.output_dir={tmp_path / 'eval'}", f"run_dir={tmp_path / 'run'}", "eval.doc_batch_size=5",
        "eval.pools=[all]"]), tmp_path / "eval")
    for dataset, by_pool in report["after"].items():
        assert evaluated["results"][dataset]["all"]["all"] == pytest.approx(by_pool["all"]["all"], abs=1e-6)
    assert "| Method | synchart All | syninfo All | Avg. All |" in evaluated["table"]


def test_the_loss_follows_the_head():
    """train.py's loss: the loss group over MaxSim under the late-interaction head; colbert_pairwise only there."""
    from test_experiment import config

    from hkrag.retriever import HeadSettings
    from hkrag.training.objective import make_loss

    late = config("train", ["experiment=reader_li_tiny", "loss=colbert_pairwise"])
    loss = make_loss(late.loss, HeadSettings.of(late.model))
    assert isinstance(loss, LateInteractionLoss) and loss.pairwise and loss.tau == 0.05 and not loss.use_din
    assert loss.pairwise_tau == PAIRWISE_TAU  # the experiment's tau is InfoNCE's, not the pairwise loss's
    assert type(make_loss(config("train", []).loss)) is HybridMaskLoss
    with pytest.raises(ValueError, match="loss.pairwise=true .* needs model.head=late_interaction"):
        make_loss(late.loss, HeadSettings.of(config("train", ["model.head=dense"]).model))
    with pytest.raises(ValueError, match="not hkrag.losses.PretrainingLoss"):
        make_loss(config("train", ["loss=pretrain"]).loss, HeadSettings.of(late.model))
