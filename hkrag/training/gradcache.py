"""Gradient caching (Gao et al., 2021) for a large contrastive batch on few devices.

A contrastive loss couples every embedding of the batch, so gradient accumulation cannot
add negatives. Gradient caching keeps the full batch in the loss while holding only one
chunk's activations at a time:

1. encode every chunk without gradient, recording the RNG state before each forward;
2. compute the loss on the detached embeddings and get ``∂L/∂embedding`` (the cache);
3. re-encode each chunk with gradient under its recorded RNG state (so dropout and LoRA
   dropout draw the same masks) and backpropagate the cached gradient into the encoder.

Parameter gradients equal those of one backward through the whole batch. Multi-vector (late-interaction)
embeddings ``(rows, tokens, dim)`` of chunks padded to different token counts are zero-padded to the longest for the
loss, and each chunk's cached gradient is cut back to its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from hkrag.late_interaction import concat_padded
from hkrag.losses import LossOutput

Encoder = Callable[[Any], Tensor]


@dataclass(frozen=True)
class RngState:
    """The CPU and (if initialised) CUDA random states, to replay a forward pass exactly."""

    cpu: Tensor
    cuda: tuple[Tensor, ...]

    @classmethod
    def capture(cls) -> RngState:
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        return cls(torch.get_rng_state(), cuda)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under this state; the surrounding RNG state is restored afterwards."""
        with torch.random.fork_rng(devices=range(len(self.cuda))):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


def split_batch(batch: Any, chunk_size: int) -> list[Any]:
    """Split a tensor, or a mapping of tensors (e.g. ``BatchFeature``), into row chunks.

    Mapping values that are tensors, lists or tuples are sliced along their first dimension;
    other values are repeated in every chunk. The mapping's type is kept.
    """
    if isinstance(batch, Tensor):
        return list(batch.split(chunk_size))
    if not isinstance(batch, Mapping):
        raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
    size = len(next(v for v in batch.values() if isinstance(v, (Tensor, list, tuple))))
    return [
        type(batch)({key: _rows(value, start, chunk_size) for key, value in batch.items()})
        for start in range(0, size, chunk_size)
    ]


def _rows(value: Any, start: int, size: int) -> Any:
    return value[start : start + size] if isinstance(value, (Tensor, list, tuple)) else value


def _as_output(result: Tensor | LossOutput) -> LossOutput:
    return result if isinstance(result, LossOutput) else LossOutput(loss=result)


def _encode_without_grad(encode: Encoder, chunks: Sequence[Any]) -> tuple[list[Tensor], list[RngState]]:
    embeddings, states = [], []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RngState.capture())
            embeddings.append(encode(chunk))
    return embeddings, states


def _replays(
    encode: Encoder, chunks: Sequence[Any], states: list[RngState], embeddings: list[Tensor], grad: Tensor
) -> list[tuple[Encoder, Any, RngState, Tensor]]:
    grads = [g[:, : e.shape[1]] if e.dim() == 3 else g for g, e in zip(grad.split([len(e) for e in embeddings]),
                                                                         embeddings, strict=True)]
    return [(encode, *job) for job in zip(chunks, states, grads, strict=True)]


def grad_cache_step(
    encode_query: Encoder,
    encode_doc: Encoder,
    query_chunks: Sequence[Any],
    doc_chunks: Sequence[Any],
    loss_fn: Callable[[Tensor, Tensor], Tensor | LossOutput],
    no_sync: Callable[[], AbstractContextManager] | None = None,
) -> LossOutput:
    """Accumulate into ``.grad`` the gradient of ``loss_fn(cat(q), cat(d))`` chunk by chunk.

    ``encode_query``/``encode_doc`` map one chunk (a tensor or a dict of tensors) to its
    embeddings; ``loss_fn`` gets the concatenated local embeddings and may all-gather them
    (:func:`hkrag.distributed.gather_with_grad`). ``no_sync`` (e.g. ``model.no_sync`` or
    ``lambda: accelerator.no_sync(model)``) wraps every re-forward and backward but the
    last, so DDP all-reduces once per step. Returns the loss output, detached.
    """
    queries, query_states = _encode_without_grad(encode_query, query_chunks)
    docs, doc_states = _encode_without_grad(encode_doc, doc_chunks)

    q = concat_padded(queries).requires_grad_()
    d = concat_padded(docs).requires_grad_()
    output = _as_output(loss_fn(q, d))
    q_grad, d_grad = torch.autograd.grad(output.loss, (q, d))

    replays = [
        *_replays(encode_query, query_chunks, query_states, queries, q_grad),
        *_replays(encode_doc, doc_chunks, doc_states, docs, d_grad),
    ]
    for index, (encode, chunk, state, grad) in enumerate(replays):
        last = index == len(replays) - 1
        with nullcontext() if last or no_sync is None else no_sync(), state.replay():
            encode(chunk).backward(grad)
    return replace(output, loss=output.loss.detach())
