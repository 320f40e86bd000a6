"""Gradient caching gives the gradients of one backward through the whole batch."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BatchFeature

from hkrag.losses import HybridMaskLoss
from hkrag.training.gradcache import RngState, grad_cache_step, split_batch

BATCH, DIM_IN, DIM_OUT, CHUNK = 6, 5, 8, 2


class DictEncoder(nn.Module):
    """Takes BatchFeature-like inputs, with dropout so that replaying the RNG matters."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM_IN, DIM_OUT)
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs) -> torch.Tensor:
        return F.normalize(self.dropout(self.proj(inputs["x"] * inputs["scale"])), dim=-1)


def batch(offset: float = 0.0) -> BatchFeature:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, DIM_IN, generator=generator) + offset
    return BatchFeature({"x": x, "ids": list(range(BATCH)), "scale": 2.0})


def loss_fn(q, d):
    return HybridMaskLoss(tau=0.1, beta=0.5)(q, d, torch.Generator().manual_seed(1))


def gradients(model: nn.Module, cached: bool, seed: int = 0, chunk: int = CHUNK):
    """Loss and flat gradient; uncached encodes the same chunks in the same order with grad."""
    model.zero_grad()
    queries, docs = split_batch(batch(), chunk), split_batch(batch(0.3), chunk)
    torch.manual_seed(seed)
    if cached:
        loss = grad_cache_step(model, model, queries, docs, loss_fn).loss
    else:
        q = torch.cat([model(c) for c in queries])
        d = torch.cat([model(c) for c in docs])
        loss = loss_fn(q, d).loss
        loss.backward()
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_split_batch_slices_rows_and_keeps_the_mapping_type():
    chunks = split_batch(batch(), 4)
    assert [type(c) for c in chunks] == [BatchFeature, BatchFeature]
    assert [c["ids"] for c in chunks] == [[0, 1, 2, 3], [4, 5]]
    assert torch.equal(torch.cat([c["x"] for c in chunks]), batch()["x"])
    assert all(c["scale"] == 2.0 for c in chunks)
    assert [len(c) for c in split_batch(torch.zeros(5, 2), 2)] == [2, 2, 1]


@pytest.mark.parametrize("chunk", [1, 2, BATCH])
def test_cached_gradients_equal_one_backward_through_the_batch(chunk):
    model = DictEncoder(dropout=0.0)
    loss, grads = gradients(model, cached=True, chunk=chunk)
    expected_loss, expected = gradients(model, cached=False, chunk=BATCH)
    torch.testing.assert_close(loss, expected_loss.detach())
    torch.testing.assert_close(grads, expected)
    assert not loss.requires_grad


def test_dropout_is_replayed_exactly():
    model = DictEncoder(dropout=0.5)
    loss, grads = gradients(model, cached=True)
    expected_loss, expected = gradients(model, cached=False)
    torch.testing.assert_close(grads, expected)
    torch.testing.assert_close(loss, expected_loss.detach())
    _, other_masks = gradients(model, cached=False, seed=1)
    assert not torch.allclose(grads, other_masks)  # dropout changes the gradients: the test is sensitive


def test_no_sync_wraps_every_backward_but_the_last():
    model = DictEncoder(dropout=0.0)
    entered = []

    @contextmanager
    def no_sync():
        entered.append(True)
        yield

    out = grad_cache_step(model, model, split_batch(batch(), CHUNK), split_batch(batch(0.3), CHUNK), loss_fn, no_sync)
    assert len(entered) == 2 * BATCH // CHUNK - 1
    assert set(out.components) == {"din", "sin"} and "mask/one" in out.metrics


def test_rng_replay_restores_the_surrounding_state():
    torch.manual_seed(0)
    state = RngState.capture()
    first = torch.rand(3)
    after = torch.get_rng_state()
    with state.replay():
        assert torch.equal(torch.rand(3), first)
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_is_replayed_and_the_loss_matches_cpu():
    model = DictEncoder(dropout=0.5).cuda()
    chunks = [{**c, "x": c["x"].cuda()} for c in split_batch(batch(), CHUNK)]
    docs = [{**c, "x": c["x"].cuda()} for c in split_batch(batch(0.3), CHUNK)]

    def cuda_loss(q, d):
        return HybridMaskLoss(tau=0.1)(q, d, torch.Generator(device="cuda").manual_seed(1))

    torch.cuda.manual_seed(0)
    out = grad_cache_step(model, model, chunks, docs, cuda_loss)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    torch.cuda.manual_seed(0)
    q, d = torch.cat([model(c) for c in chunks]), torch.cat([model(c) for c in docs])
    expected = cuda_loss(q, d)
    expected.loss.backward()
    torch.testing.assert_close(grads, torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(out.loss, expected.loss.detach())
    cpu = HybridMaskLoss(tau=0.1, use_sin=False)
    torch.testing.assert_close(cpu(q.detach().cpu(), d.detach().cpu()).loss, cpu(q.detach(), d.detach()).loss.cpu())
