"""A memory model of one training step, from the configuration alone (issue 29; docs/training.md "Memory").

The peak of a step is the persistent state (frozen weights in ``model.dtype``, the LoRA adapter, its gradients
and AdamW's two moments, all fp32 as peft keeps adapters) plus the larger of two phases of one chunk of
``trainer.chunk_size`` rows: the vision tower's forward (CLIP keeps every hidden state, ``output_hidden_states``)
and the language model's backward (what autograd saved for the chunk, plus the backward's own working set).
Every activation term is a count of the tensors autograd keeps, layer by layer, for the code as written
(:mod:`hkrag.models.phi3v`, transformers' Phi-3 and CLIP layers, peft's LoRA with dropout): the terms are named
in :func:`lm_layer_bytes` and :func:`clip_layer_bytes`. The gradient cache adds the global batch's embeddings and
their gradients (fp32). The generator adds the LM head's logits (and the loss's fp32 copies); generation at
inference a KV cache.

The model predicts allocated bytes (``torch.cuda.max_memory_allocated`` on GPU); on CPU :func:`measure_step`
measures the same thing as the peak resident set with glibc's mmap threshold pinned (``MALLOC_MMAP_THRESHOLD_``),
so that freed tensors leave the resident set as they do the CUDA allocator's count.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import get_peft_model, get_peft_model_state_dict
from PIL import Image
from tqdm.auto import tqdm

from hkrag.data.collators import PretrainingCollator
from hkrag.data.generator_pairs import GeneratorPair
from hkrag.data.images import page_png
from hkrag.data.opendocvqa import CORPUS_FEATURES, Corpus
from hkrag.data.pairs import TrainingPair
from hkrag.losses import HybridMaskLoss
from hkrag.lvlm.phi3v import Phi3VBackend
from hkrag.models.phi3v import Phi3VConfig, Phi3VForCausalLM
from hkrag.retriever import (
    HeadSettings,
    LoraSettings,
    Phi3VRetriever,
    enable_checkpointing,
    freeze_unreachable,
    lora_modules,
)
from hkrag.training.generator import GeneratorDataset, GeneratorTrainer, GeneratorTrainerConfig, causal_lm_lora
from hkrag.training.gradcache import split_batch
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAPTER_BYTES = 4
"""peft keeps LoRA weights in fp32 over a bf16/fp16 base (``autocast_adapter_dtype``); their gradients and AdamW's
moments follow them."""
DROPOUT_MASK_BYTES = {"cuda": 1, "cpu": ADAPTER_BYTES}
"""What LoRA's dropout keeps per element of its input: CUDA's fused kernel a bool mask, the CPU kernel a noise
tensor in the input's dtype (fp32 after peft's cast)."""
GIB = 2**30
GPU_SIZES_GB = (24, 40, 80, 141)
"""The GPU memory sizes the preflight gives a verdict for (GB as the vendors count them)."""
CUDA_OVERHEAD = int(1.5 * GIB)
"""Not counted by ``max_memory_allocated`` but held on the GPU: the CUDA context and kernels (about 0.5-1 GiB)
and the caching allocator's slack; the preflight adds it before comparing with a GPU's memory."""
FRAGMENTATION = 0.10
"""Headroom on top of the predicted allocated peak for the caching allocator's fragmentation."""
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc setting under which the resident set tracks live tensors (see :func:`measure_step`)."""


@dataclass(frozen=True)
class Architecture:
    """The sizes of a Phi3V model that memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    clip_hidden: int
    clip_intermediate: int
    clip_heads: int
    clip_layers: int
    clip_used_layers: int
    crop_tokens: int
    crop_size: int
    image_feature_dim: int

    @classmethod
    def of(cls, config: Phi3VConfig) -> Architecture:
        vision = config.vision_config
        layer = config.img_processor.get("layer_idx", -2)
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, vocab=config.vocab_size,
            clip_hidden=vision.hidden_size, clip_intermediate=vision.intermediate_size,
            clip_heads=vision.num_attention_heads, clip_layers=vision.num_hidden_layers,
            clip_used_layers=layer % (vision.num_hidden_layers + 1),
            crop_tokens=config.patches_per_side**2 + 1, crop_size=config.crop_size,
            image_feature_dim=config.image_feature_dim,
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.hidden // self.heads


@dataclass(frozen=True)
class Parameters:
    """Parameter counts of the model as trained, counted by building it on the ``meta`` device with peft."""

    total: int
    trainable: int
    adapter: int
    modules: tuple[str, ...]
    rank: int = 0

    @property
    def frozen(self) -> int:
        return self.total - self.adapter

    def targets(self, where: str) -> frozenset[str]:
        """Leaf names LoRA wraps inside ``where`` (``language`` layers or the ``vision`` tower's layers)."""
        marker = ".vision_model.encoder.layers." if where == "vision" else ".model.layers."
        return frozenset(name.rsplit(".", 1)[-1] for name in self.modules if marker in name)


def count_parameters(config: Phi3VConfig, lora: LoraSettings | None) -> Parameters:
    """Total, trainable and adapter parameters and the wrapped modules' names, without allocating weights."""

    with torch.device("meta"):
        model = Phi3VForCausalLM(config)
        if lora is not None:
            model = get_peft_model(model, lora.peft_config())
        else:
            model.requires_grad_(False)
        freeze_unreachable(model)
    adapter = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    return Parameters(
        total=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        adapter=adapter, modules=tuple(lora_modules(model)), rank=lora.r if lora is not None else 0,
    )


@dataclass(frozen=True)
class Workload:
    """What one forward of a step processes and how.

    ``rows``: rows per forward (the gradient cache's chunk, or the generator's batch); ``page_tokens``: LM tokens
    of one row (a page's prompt, or the generator's whole prompt); ``crops``: CLIP crops per row (the used crops
    plus the global view, over all of a row's pages); ``query_tokens``: a query's (the LM phase takes the longer
    of a page and a query); ``batch``: rows whose embeddings the gradient cache keeps (0: no gradient cache);
    ``lm_head_tokens``: tokens per row through the LM head (RCG, the generator); ``logits_transposed``: the loss
    takes them as ``(B, V, L)`` (RCG's :func:`hkrag.losses.causal_lm_loss`, the generator's ``loss_mean: example``;
    see :func:`head_bytes_per_logit`); ``autocast``: bf16 autocast (``trainer.precision``), under which LoRA inputs
    are kept in bf16; ``late_interaction``: the late-interaction head's settings (:func:`late_interaction_bytes`),
    ``None`` for the dense head.
    """

    rows: int
    page_tokens: int
    crops: int
    query_tokens: int
    batch: int
    dtype: str = "bfloat16"
    checkpointing: bool = True
    attention: str = "sdpa"
    lm_head_tokens: int = 0
    logits_transposed: bool = False
    lora_dropout: bool = True
    lora_rank: int = 8
    device: str = "cuda"
    autocast: bool = True
    late_interaction: LateInteractionHead | None = None

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def clip_stream_bytes(self) -> int:
        """Bytes per element of the CLIP tower's residual stream (its hidden states and their gradients).

        CUDA autocast runs ``layer_norm`` in fp32 (on its fp32 op list; CPU autocast's bf16 handling leaves it in
        bf16), so CLIP's ``pre_layrnorm`` returns fp32 and every residual add (fp32 + the bf16 attention or MLP
        output) promotes to fp32: each hidden state is fp32, each layer_norm's saved input is that fp32 stream
        (no further copy), and the gradients along it are fp32. The linears still run in bf16: a frozen
        projection's bf16 cast of an fp32 layer-norm output is not saved (autograd keeps a matmul's input only
        for its weight's gradient) and LoRA's saved input is autocast's bf16 copy either way (emulated on CPU,
        tests/test_memory_cuda_autocast.py)."""
        return 4 if self.device == "cuda" and self.autocast else self.bytes

    def lora_input(self, tokens: int, width: int, grad_in: bool) -> int:
        """A LoRA branch keeps its input cast to fp32 and dropped out (``lora_A``'s saved input; under bf16
        autocast the bf16 copy autocast makes for the matmul), ``lora_A``'s output (``lora_B``'s), and the
        dropout's mask when a gradient flows back through it."""
        mask = DROPOUT_MASK_BYTES[self.device] if grad_in and self.lora_dropout else 0
        saved = 2 if self.autocast else ADAPTER_BYTES
        return tokens * width * (saved + mask) + tokens * self.lora_rank * saved


def cast_bytes(source: int, target: int) -> int:
    """Bytes per element that casting a ``source``-byte tensor to ``target`` bytes allocates: none where the dtype is
    already the target's (``.to`` and ``.float()`` return the tensor itself)."""
    return target if source != target else 0


def head_bytes_per_logit(dtype_bytes: int, transposed: bool) -> int:
    """Peak bytes per logit of the LM head's cross-entropy: the larger of its forward and its backward.

    Forward: the logits in the model's dtype (``dtype_bytes``), the loss's fp32 copy of them (none in fp32, where
    ``.float()`` returns the tensor itself), ``log_softmax``'s fp32 output (saved for its backward) and, when the
    loss takes ``(B, V, L)`` logits (``transposed``), ``nll_loss``'s contiguous copy of them (ATen's
    ``nll_loss_nd`` makes a 3-D input contiguous for ``nll_loss2d``, which saves it). Backward: three fp32 tensors,
    the saved log-softmax, ``nll_loss``'s gradient and ``log_softmax``'s, the logits and their copies being freed by
    then. So 12 bytes in fp32 either way, and in bf16 12 (transformers' flat loss) or 14 (transposed); counted once
    as ``dtype_bytes + 4 + 4``, 10 in bf16, which under-predicted every bf16 step whose peak is the head (located
    with ``torch.profiler``'s memory events on CPU in bf16; docs/training.md "Memory").
    """
    forward = dtype_bytes + cast_bytes(dtype_bytes, 4) + 4 + (4 if transposed else 0)
    return max(forward, 3 * 4)


def eager_saved_bytes(dtype_bytes: int) -> int:
    """Bytes per attention score eager attention keeps for its backward: the fp32 probabilities
    (``softmax(..., dtype=torch.float32)``, saved by the softmax) and their cast to the model's dtype (saved by
    the product with the values; in fp32 the cast is the same tensor)."""
    return 4 + cast_bytes(4, dtype_bytes)


def eager_backward_bytes() -> int:
    """Peak bytes per attention score of eager attention's backward, the saved probabilities included, in any
    dtype: the saved fp32 probabilities, the gradient arriving at them cast to fp32 (the cast's backward) and the
    softmax's gradient, also fp32 (``softmax(..., dtype=torch.float32)`` runs on an fp32 copy of the scores):
    12 bytes (the model once added 4 + 4 + 2 to the saved 4 + 2 in bf16, 16; located on CPU with
    ``torch.profiler``'s memory events, bench/RESULTS.md)."""
    return 4 + 4 + 4


def lm_layer_bytes(arch: Architecture, work: Workload, targets: Iterable[str], tokens: int, grad_in: bool) -> int:
    """Bytes autograd keeps for one Phi-3 decoder layer over ``tokens`` tokens (``rows`` rows).

    ``grad_in``: whether the layer's input carries a gradient (not so for the first layer when only the language
    model's LoRA trains: embeddings and image features are frozen). Terms, in forward order: the input RMSNorm's
    fp32 input; each wrapped projection's LoRA input; attention's qkv output (kept whole by the value view), the
    rotated query and key and the output (SDPA), or eager's fp32 probabilities and their cast; the post-attention
    RMSNorm's fp32 input; the MLP's gate_up output (kept by the gate and up views) and SiLU output.
    """
    targets = set(targets)
    h, s, t = arch.hidden, work.bytes, tokens
    length = tokens // work.rows
    total = 4 * t * h + 4 * t if grad_in else 0  # the fp32 input and its rsqrt
    if "qkv_proj" in targets:
        total += work.lora_input(t, h, grad_in)
    attention_grad = grad_in or "qkv_proj" in targets
    if attention_grad:
        total += t * (h + 2 * arch.kv_width) * s + t * (h + arch.kv_width) * s
        if work.attention == "eager":
            total += work.rows * arch.heads * length * length * eager_saved_bytes(s)
        else:
            total += t * h * s + work.rows * arch.heads * length * 4  # output and log-sum-exp
    if "o_proj" in targets:
        total += work.lora_input(t, h, attention_grad)
    return total + lm_mlp_bytes(arch, work, targets, tokens, attention_grad or "o_proj" in targets)


def lm_mlp_bytes(arch: Architecture, work: Workload, targets: Iterable[str], tokens: int, grad_in: bool) -> int:
    """The MLP's share of :func:`lm_layer_bytes` (from the post-attention RMSNorm on): freed by the layer's
    backward before its attention's backward runs."""
    targets = set(targets)
    h, i, s, t = arch.hidden, arch.intermediate, work.bytes, tokens
    total = 4 * t * h + 4 * t if grad_in else 0
    if "gate_up_proj" in targets:
        total += work.lora_input(t, h, grad_in)
    if grad_in or "gate_up_proj" in targets:
        total += 3 * t * i * s
    if "down_proj" in targets:
        total += work.lora_input(t, i, grad_in or "gate_up_proj" in targets)
    return total


def recompute_transients(arch: Architecture, work: Workload, targets: Iterable[str], tokens: int) -> int:
    """What a checkpointed Phi-3 layer's recomputation leaves alive beside its saved tensors when it stops (after
    the last saved tensor, ``down_proj``'s LoRA input, is recomputed): the forward's locals — the MLP's product
    (``down_proj``'s input), the post-attention norm's output, the residual sum where the norm keeps an fp32 copy of
    it instead (not in fp32) and, with LoRA on ``down_proj``, its base output and peft's fp32 copies (the input cast
    to the adapter's fp32 unless already fp32, and the dropout's fp32 output where autocast's bf16 copy is what
    ``lora_A`` saves) — and the gradient arriving at the layer (two tensors of the hidden width). Located with
    bench/memory_timeline.py in fp32 and under bf16 autocast (tests/test_preflight.py measures one layer)."""
    h, i, s, t = arch.hidden, arch.intermediate, work.bytes, tokens
    residual = t * h * s if cast_bytes(s, 4) else 0  # in fp32 the norm's copy is the residual itself
    total = t * i * s + t * h * s + residual + 2 * t * h * s  # product, norm output, residual; gradients
    if "down_proj" in set(targets):  # its base output; peft's fp32 input and, under autocast, dropout output
        total += t * h * s + t * i * (cast_bytes(s, 4) + (4 if work.autocast else 0))
    return total


def clip_layer_bytes(arch: Architecture, work: Workload, targets: Iterable[str], tokens: int, grad_in: bool) -> int:
    """Bytes autograd keeps for one CLIP encoder layer over ``tokens`` crop tokens: layer_norm1's input (a hidden
    state), each wrapped projection's LoRA input, SDPA's query, key, value and output, layer_norm2's input (the
    residual sum), and quick_gelu's input and sigmoid. The two layer norms' inputs are the residual stream, fp32
    under CUDA autocast (:attr:`Workload.clip_stream_bytes`)."""
    targets = set(targets)
    d, m, s, t = arch.clip_hidden, arch.clip_intermediate, work.bytes, tokens
    stream = work.clip_stream_bytes
    total = t * d * stream + 2 * t * 4 if grad_in else 0  # layer_norm1's input, mean and rstd
    for name in ("q_proj", "k_proj", "v_proj"):
        if name in targets:
            total += work.lora_input(t, d, grad_in)
    attention_grad = grad_in or bool(targets & {"q_proj", "k_proj", "v_proj"})
    if "out_proj" in targets:
        total += work.lora_input(t, d, attention_grad)
    if attention_grad or "out_proj" in targets:
        total += 4 * t * d * s + t * arch.clip_heads * 4 + t * d * stream + 2 * t * m * s + 2 * t * 4
    return total


@dataclass
class Estimate:
    """Predicted bytes by term, and the peak of one optimizer step."""

    terms: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def persistent(self) -> int:
        return sum(self.terms.values())

    @property
    def peak(self) -> int:
        return self.persistent + max(self.phases.values(), default=0)

    def required(self) -> int:
        """What a GPU must hold: the peak with fragmentation headroom plus the CUDA context."""
        return int(self.peak * (1 + FRAGMENTATION)) + CUDA_OVERHEAD


def chunk_phases(arch: Architecture, params: Parameters, work: Workload) -> dict[str, int]:
    """Peak bytes above the persistent state while one chunk runs: the vision tower's forward, and the language
    model's backward (everything the chunk's forward kept, plus the backward's working set).

    The vision tower's forward holds every hidden state (``output_hidden_states``), the pixels (fp32 and cast) and
    quick_gelu's three intermediates of one layer; a trained tower (LoRA in CLIP) adds what autograd keeps of its
    layers up to the used one (their inputs are those hidden states). The backward's working set is two gradients
    of the MLP's width (the base and LoRA paths of ``down_proj`` before they are summed).

    A trained tower under checkpointing adds a third phase, its backward, which runs after the language model's
    (whose layers' inputs are freed by then; it was once summed with the recomputed language-model layer, 19-21 %
    over the generator's measured step): the used layers' kept inputs and the pixels, the gradient arriving at the
    used CLIP layer's output, one recomputed CLIP layer (one whose input carries a gradient: not the first, unless it
    is the only one), and quick_gelu's backward
    (three tensors of the MLP's width: the gradient of ``fc2``'s input and the two products of the gate's backward;
    the phases were located on CPU with ``torch.profiler``'s memory timeline, bench/memory_timeline.py).

    With gradient checkpointing the language model keeps each layer's input plus one layer recomputed (never at
    the same time as the LM head's logits and log-softmax, RCG's and the generator's, nor the final norm's input:
    their backward runs and frees them before the first layer is recomputed), and a trained vision tower's
    checkpointed layers keep their inputs, one hidden state per used CLIP layer (fp32 on CUDA,
    :attr:`Workload.clip_stream_bytes`), until the backward. A frozen tower is not in the graph and keeps nothing.
    The recomputed layer's peak is the larger of the backward's working set and what the recomputation leaves
    alive when it stops (:func:`recompute_transients`); without checkpointing nothing is recomputed and a layer's
    backward adds its working set alone.
    Eager attention's backward peaks at the softmax's, when the MLP, the output projection's LoRA input and qkv's
    output have been freed (``torch.profiler``: bench/memory_timeline.py).
    """
    s, rows = work.bytes, work.rows
    clip_tokens = rows * work.crops * arch.crop_tokens
    clip_targets, lm_targets = params.targets("vision"), params.targets("language")
    clip_grad = bool(clip_targets)
    state = clip_tokens * arch.clip_hidden * work.clip_stream_bytes
    hidden_states = (arch.clip_layers + 1) * state
    pixels = rows * work.crops * 3 * arch.crop_size**2 * (4 + cast_bytes(4, s))  # fp32 pixels, their cast
    gelu = 3 * clip_tokens * arch.clip_intermediate * s
    clip_graph = sum(clip_layer_bytes(arch, work, clip_targets, clip_tokens, layer > 0)
                     for layer in range(arch.clip_used_layers)) if clip_grad and not work.checkpointing else 0
    inputs_in_graph = (arch.clip_used_layers - 1) * state if clip_graph else 0  # layer_norm1's inputs
    clip_phase = pixels + hidden_states + gelu + clip_graph - inputs_in_graph

    tokens = rows * max(work.page_tokens, work.query_tokens)  # a query chunk has no vision tower, only its tokens
    layers = [lm_layer_bytes(arch, work, lm_targets, tokens, clip_grad or layer > 0) for layer in range(arch.layers)]
    recompute_clip = 0
    if work.checkpointing:
        kept_clip = arch.clip_used_layers * state if clip_grad else 0  # each used layer's input
        kept = kept_clip + arch.layers * tokens * arch.hidden * s + max(layers)
        if clip_grad:  # the largest recomputed layer: one whose input carries a gradient, unless only the first is
            grad_in = arch.clip_used_layers > 1
            recompute_clip = clip_layer_bytes(arch, work, clip_targets, clip_tokens, grad_in)
    else:
        kept = clip_graph + sum(layers)
    projection = tokens * arch.hidden * s if clip_grad else 0  # the image projection's GELU input (an upper bound)
    final_norm = 4 * tokens * arch.hidden + 4 * tokens
    head = rows * work.lm_head_tokens * arch.vocab * head_bytes_per_logit(s, work.logits_transposed)
    backward = 2 * tokens * arch.intermediate * s  # the base and LoRA paths' gradients of down_proj's input
    if work.checkpointing:  # only a recomputation leaves the forward's locals alive beside the saved tensors
        backward = max(backward, recompute_transients(arch, work, lm_targets, tokens))
    top = max(layers)
    if work.attention == "eager":  # the softmax's backward: the probabilities' and the scores' gradients
        scores = rows * arch.heads * (tokens // rows) ** 2
        # freed by then: the MLP, the output projection's LoRA input, and qkv's output (the value's view keeps it
        # whole until the product with the probabilities has run its backward)
        freed = lm_mlp_bytes(arch, work, lm_targets, tokens, True) + tokens * (arch.hidden + 2 * arch.kv_width) * s
        if "o_proj" in lm_targets:
            freed += work.lora_input(tokens, arch.hidden, True)
        attention_backward = scores * (eager_backward_bytes() - eager_saved_bytes(s))
        recomputed = max(top + backward, top - freed + attention_backward)
    else:
        recomputed = top + backward
    if work.checkpointing:  # the head's backward (with the final norm's) is done before any layer is recomputed
        lm_phase = kept - top + projection + max(final_norm + head, recomputed)
    else:
        lm_phase = kept - top + projection + final_norm + head + recomputed
    lm_phase += rows * work.crops * 3 * arch.crop_size**2 * 4  # the chunk's fp32 pixels, alive until its end
    phases = {"vision tower forward (one chunk)": clip_phase, "language model backward (one chunk)": lm_phase}
    if recompute_clip:  # after the language model's backward has freed its layers' inputs
        arriving = state  # the gradient at the used layer's output
        clip_backward = 3 * clip_tokens * arch.clip_intermediate * s
        phases["vision tower backward (one chunk, a recomputed layer)"] = (
            kept_clip + pixels + arriving + recompute_clip + clip_backward)
    return phases


def estimate(arch: Architecture, params: Parameters, work: Workload) -> Estimate:
    """The memory model of one optimizer step (see the module docstring)."""
    terms = {
        f"frozen weights ({work.dtype})": params.frozen * work.bytes,
        "LoRA adapter (fp32)": params.adapter * ADAPTER_BYTES,
        "LoRA gradients (fp32)": params.trainable * ADAPTER_BYTES,
        "AdamW moments (2 x fp32)": 2 * params.trainable * ADAPTER_BYTES,
    }
    phases = chunk_phases(arch, params, work)
    if work.late_interaction is not None:  # its own terms and phase, replacing the dense gradient cache's
        late_terms, late_phases = late_interaction_bytes(arch, work, work.late_interaction)
        terms.update(late_terms)
        for name, value in late_phases.items():
            phases[name] = phases.get(name, 0) + value
    elif work.batch:
        terms["gradient cache: embeddings + gradients (fp32)"] = 2 * 2 * work.batch * arch.hidden * 4
    return Estimate(terms, phases)


@dataclass(frozen=True)
class LateInteractionHead:
    """What the late-interaction head (``model.head=late_interaction``, :mod:`hkrag.late_interaction`) adds to a
    step: its projection ``hidden -> dim``, a query's ``query_tokens`` (its text's and the augmentation tokens), and
    the loss's score matrix of ``queries`` x ``pages`` (the global batch, its pages with any hard negatives: every
    rank scores the gathered batch)."""

    dim: int
    query_tokens: int
    queries: int
    pages: int
    scores: bool = True
    """Whether the loss scores the plain MaxSim matrix (InfoNCE, pairwise: ``loss.infonce_weight`` > 0); the masked
    terms are computed in checkpointed chunks of a bounded size and are not counted."""


MAXSIM_BYTES_PER_SCORE = 13
"""Bytes a MaxSim loss holds per token score ``(query, page, query token, page token)`` at its peak, the backward
of :func:`hkrag.late_interaction.maxsim_mean`: the padding-masked fp32 token scores amax keeps for its backward, amax's
bool mask of the maxima, its fp32 gradient and masked_fill's fp32 gradient (4 + 1 + 4 + 4). Measured on CPU
(``bench/maxsim_memory.py``: peak RSS, glibc's mmap threshold pinned) for InfoNCE over MaxSim at
16 x 16 x 50 x 2,000 / x 4,000 and 32 x 32 x 40 x 1,000: 12.6 to 13.0 bytes per score."""


MAXSIM_PHASE = "MaxSim loss over the global batch (token scores)"
"""The phase of :func:`late_interaction_bytes` that a smaller chunk does not shrink (it scores the whole batch)."""


def projection_parameters(hidden: int, dim: int) -> int:
    """The late-interaction projection's parameters, ``Linear(hidden, dim)``: weight and bias."""
    return hidden * dim + dim


def late_interaction_bytes(
    arch: Architecture, work: Workload, head: LateInteractionHead
) -> tuple[dict[str, int], dict[str, int]]:
    """The late-interaction head's persistent terms and phases (added to :func:`estimate`'s).

    Persistent: the projection as peft keeps a ``modules_to_save`` module, a frozen original and a trained copy
    in the model's dtype, the copy's gradient and AdamW's two moments (each counted at fp32, an upper bound in
    bf16); the gradient cache's embeddings and their gradients (fp32), now every token's ``dim``-d vector of each
    cached query and page, ``batch x (query_tokens + page_tokens) x dim``, instead of one ``hidden`` vector.
    Phases: the MaxSim loss over the gathered batch, run between the cache's forward and its re-forward (so beside
    the persistent state only), :data:`MAXSIM_BYTES_PER_SCORE` bytes per token score; and, in the language model's
    backward of one chunk, what the projection keeps: its input (the last hidden state of every token, where the
    dense head keeps one row) and its output, fp32 copy and normalised vectors.
    """
    projection = projection_parameters(arch.hidden, head.dim)
    tokens = head.query_tokens + work.page_tokens
    terms = {
        "late-interaction projection (frozen + trained copy, gradient, AdamW)":
            projection * (2 * work.bytes + 3 * ADAPTER_BYTES),
        "gradient cache: token vectors + gradients (fp32)": 2 * work.batch * tokens * head.dim * 4,
    }
    chunk_tokens = work.rows * max(work.page_tokens, head.query_tokens)
    phases = {"language model backward (one chunk)": chunk_tokens * (arch.hidden * work.bytes
                                                                    + head.dim * (work.bytes + 4 + 4))}
    if head.scores:
        scores = head.queries * head.pages * head.query_tokens * work.page_tokens
        phases[MAXSIM_PHASE] = scores * MAXSIM_BYTES_PER_SCORE
    return terms, phases


def kv_cache_bytes(arch: Architecture, tokens: int, dtype: str = "bfloat16", rows: int = 1) -> int:
    """A generation's key/value cache: two tensors of ``kv_width`` per layer and token."""
    return 2 * arch.layers * arch.kv_width * tokens * rows * DTYPE_BYTES[dtype]


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """Reset the resident-set high-water mark (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


@dataclass(frozen=True)
class Measurement:
    """Figures of one measured training step on CPU (bytes, seconds) and its adapter's save/reload check."""

    weights: int
    step_peak: int
    seconds: float
    loss: float
    parameters: int
    trainable: int
    page_tokens: int
    malloc_pinned: bool
    adapter_bytes: int = 0
    adapter_round_trip: bool = False
    reserved_peak: int = 0
    """On CUDA: ``torch.cuda.max_memory_reserved()`` after the step (the caching allocator's peak, fragmentation
    included), what :data:`FRAGMENTATION` assumes beyond ``max_memory_allocated``; 0 on CPU."""
    outside_allocator: int = 0
    """On CUDA: the device memory in use outside the caching allocator (the CUDA context and kernels), what
    :data:`CUDA_OVERHEAD` assumes; 0 on CPU."""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def cuda_reserved() -> dict[str, int]:
    """What ``max_memory_allocated`` does not count, after a measured CUDA step: :attr:`Measurement.reserved_peak`
    and :attr:`Measurement.outside_allocator` (the device's used memory, of every process on it, less this process's
    reserved memory: measure on an otherwise idle GPU)."""
    free, total = torch.cuda.mem_get_info()
    return {"reserved_peak": torch.cuda.max_memory_reserved(),
            "outside_allocator": total - free - torch.cuda.memory_reserved()}


def noise_pages(count: int, size: tuple[int, int] = (850, 1100), seed: int = 0) -> list[Image.Image]:
    """``count`` seeded random-noise RGB pages of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count)]


def random_pages(count: int, size: tuple[int, int] = (850, 1100), seed: int = 0) -> Any:
    """A :class:`~hkrag.data.opendocvqa.Corpus` of ``count`` random-noise pages ``page-<i>``."""
    rows: dict[str, list] = {"doc_id": [], "image": []}
    for index, image in enumerate(noise_pages(count, size, seed)):
        rows["doc_id"].append(f"page-{index}")
        rows["image"].append({"bytes": page_png(image), "path": None})
    return Corpus(datasets.Dataset.from_dict(rows, features=CORPUS_FEATURES), name="preflight")


def _allocated(cuda: bool) -> int:
    """Live bytes: the CUDA allocator's count, or the resident set on CPU."""
    return torch.cuda.memory_allocated() if cuda else _status("VmRSS")


def adapter_round_trip(model: Any) -> tuple[int, bool]:
    """Save ``model``'s (a peft model's) adapter, load it back as a second adapter and compare: the saved bytes,
    and whether every reloaded tensor equals the trained one (same names, same values)."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
        model.load_adapter(directory, adapter_name="reloaded")
    trained = get_peft_model_state_dict(model, adapter_name="default")
    reloaded = get_peft_model_state_dict(model, adapter_name="reloaded")
    equal = trained.keys() == reloaded.keys() and all(torch.equal(trained[k], reloaded[k]) for k in trained)
    model.delete_adapter("reloaded")
    return size, bool(trained) and equal


STEP_RANGE = "hkrag.measured_step"
"""The ``torch.profiler`` range around each measured optimizer step (``bench/memory_timeline.py`` reads the live
tensors within it)."""


def _peak_of_steps(step: Any, steps: int, cuda: bool) -> tuple[int, float, float]:
    """Run ``step()`` (one optimizer step, returning its loss) ``steps`` times; the peak bytes of the last above
    the bytes live before the first, its seconds and its loss."""
    before = _allocated(cuda)
    seconds, loss = 0.0, float("nan")
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak()
        started = time.perf_counter()
        with torch.profiler.record_function(STEP_RANGE):
            loss = step()
        seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - before
    return peak, seconds, loss


@contextmanager
def cuda_layer_norms() -> Iterator[None]:
    """Run ``F.layer_norm`` as CUDA autocast does, its floating inputs cast to fp32 and an fp32 output (CPU autocast
    leaves it in bf16): a CPU step in bf16 then keeps CLIP's residual stream in fp32 as a GPU step does
    (:attr:`Workload.clip_stream_bytes`; tests/test_memory_cuda_autocast.py, bench/memory_timeline.py)."""
    layer_norm = F.layer_norm

    def fp32(x, shape, weight=None, bias=None, eps=1e-5):
        return layer_norm(x.float(), shape, None if weight is None else weight.float(),
                          None if bias is None else bias.float(), eps)

    F.layer_norm = fp32
    try:
        yield
    finally:
        F.layer_norm = layer_norm


def _malloc_pinned() -> bool:
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]


def measured_dtype(device: str, dtype: str | None = None) -> str:
    """The weights' dtype of a measured step: ``dtype`` when given, else bf16 on CUDA and fp32 on CPU. A bf16
    step runs under bf16 autocast on either device (``--measure --dtype bfloat16`` rehearses the CUDA step's
    dtypes on the CPU)."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    return dtype or ("bfloat16" if device == "cuda" else "float32")


def _random_model(config: Phi3VConfig, device: str, dtype: str | None = None) -> Phi3VForCausalLM:
    """The model of ``config`` with seeded random weights on ``device`` in :func:`measured_dtype` (SDPA unless
    set)."""
    config._attn_implementation = config._attn_implementation or "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Phi3VForCausalLM(config)
    return model.to(getattr(torch, measured_dtype(device, dtype)))


def measure_step(
    config: Phi3VConfig, processor: Any, lora: LoraSettings, batch: int, chunk: int, checkpointing: bool,
    query: str, steps: int = 1, device: str = "cpu", loss: Any = None, dtype: str | None = None,
    head: HeadSettings | None = None,
) -> Measurement:
    """Run ``steps`` optimizer steps of the retriever's trainer (gradient cache, ``loss`` — the HKRAG loss unless
    given; VDocRAG's :class:`~hkrag.losses.PretrainingLoss` with its collator as ``train.py`` builds them, ``query``
    then being the page text — AdamW) on random weights and pages, and measure the frozen model's bytes and the
    peak above them during the last step.

    On CPU in fp32: the resident set (call it in a fresh process started with :data:`MALLOC_ENV`, as ``python -m
    hkrag.tasks.preflight --measure`` does: glibc otherwise keeps freed tensors of up to 32 MiB in its heap and the
    resident set overstates live memory, by 2 GiB at 1 layer and 4 crops, measured). On CUDA in bf16 under
    accelerate's bf16 autocast: ``max_memory_allocated``. ``dtype``: see :func:`measured_dtype` (bf16 on CPU:
    bf16 weights under accelerate's CPU bf16 autocast).
    """
    cuda = device == "cuda"
    start = _allocated(cuda)
    model = _random_model(config, device, dtype)
    retriever = Phi3VRetriever.wrap(model, processor, lora=lora, trainable=True,
                                    gradient_checkpointing=checkpointing, head=head)
    weights = _allocated(cuda) - start
    loss = loss if loss is not None else HybridMaskLoss()
    collator = PretrainingCollator(retriever.collator, loss.max_query_length, loss.max_target_length) \
        if getattr(loss, "generative", False) else None
    pairs = [TrainingPair(f"q{i}", query, (f"page-{i}",)) for i in range(batch)]
    settings = TrainerConfig(global_batch_size=batch, chunk_size=chunk, epochs=steps + 1, seed=0)
    bf16 = measured_dtype(device, dtype) == "bfloat16"
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if bf16 else "no")
    trainer = RetrieverTrainer(retriever, loss, pairs, random_pages(batch), settings,
                               accelerator, "/nonexistent-preflight-output", collator=collator)
    inputs = next(iter(trainer.loader(0, 0)))
    trainer.model.train()
    with torch.no_grad(), accelerator.autocast():  # one-time allocations (thread pools, oneDNN) before the baseline
        trainer.embed(split_batch(dict(inputs["document"].to(accelerator.device)), 1)[0])

    def step() -> float:
        output = trainer.step(inputs)
        trainer.optimizer_step(output)
        return float(output.loss)

    peak, seconds, last = _peak_of_steps(step, steps, cuda)
    reserved = cuda_reserved() if cuda else {}  # before the adapter's round trip allocates
    adapter_bytes, round_trip = adapter_round_trip(retriever.model)
    return Measurement(
        weights=weights, step_peak=peak, seconds=seconds, loss=last,
        parameters=sum(p.numel() for p in retriever.parameters()),
        trainable=sum(p.numel() for p in retriever.parameters() if p.requires_grad),
        page_tokens=int(inputs["document"]["attention_mask"][0].sum()), malloc_pinned=_malloc_pinned(),
        adapter_bytes=adapter_bytes, adapter_round_trip=round_trip, **reserved,
    )


class _Records:
    """A run logger that keeps the generator trainer's records (its step's loss) in memory."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.records.append(dict(metrics))


def measure_generator_step(
    config: Phi3VConfig, processor: Any, lora: LoraSettings, batch_size: int, pages: int, question: str,
    answer: str, render: Any, checkpointing: bool, steps: int = 1, device: str = "cpu", dtype: str | None = None,
) -> Measurement:
    """Run ``steps`` optimizer steps of generator fine-tuning (:mod:`hkrag.training.generator`: causal-LM LoRA,
    its dataset, collator and trainer; ``batch_size`` examples of ``pages`` random pages each, the prompt from
    ``render``, grad_accum 1; ``checkpointing`` as generator training enables it on CUDA) on random weights and
    measure as :func:`measure_step` does. ``page_tokens``: the tokens of one example (prompt, pages and target);
    ``dtype``: see :func:`measured_dtype` (bf16 on CPU: the trainer's bf16 autocast, which real runs use on CUDA
    only, switched on for the CPU)."""
    cuda = device == "cuda"
    start = _allocated(cuda)
    model = _random_model(config, device, dtype)
    model = causal_lm_lora(model, lora)
    if checkpointing:  # as generator training does on CUDA (it trains without on CPU)
        enable_checkpointing(model)
    weights = _allocated(cuda) - start
    doc_ids = tuple(f"page-{i}" for i in range(pages))
    pairs = [GeneratorPair(f"q{i}", question, (answer,), doc_ids) for i in range(batch_size * steps)]
    dataset = GeneratorDataset(pairs, random_pages(pages), render)
    records = _Records()
    settings = GeneratorTrainerConfig(batch_size=batch_size, grad_accum=1, max_steps=steps, log_every=1,
                                      autocast_cpu=measured_dtype(device, dtype) == "bfloat16")
    trainer = GeneratorTrainer(model, processor, dataset, settings, "/nonexistent-preflight-output", records)
    batch = next(iter(trainer.loader(0)))
    trainer.model.train()
    with torch.no_grad():  # one-time allocations (thread pools, oneDNN) before the baseline
        trainer.loss(batch)
    batches = iter(trainer.loader(0))
    bar = tqdm(disable=True)

    def step() -> float:
        trainer.optimizer_step(batches, bar)
        return float(records.records[-1]["loss"])

    peak, seconds, last = _peak_of_steps(step, steps, cuda)
    reserved = cuda_reserved() if cuda else {}  # before the adapter's round trip allocates
    adapter_bytes, round_trip = adapter_round_trip(model)
    return Measurement(
        weights=weights, step_peak=peak, seconds=seconds, loss=last,
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        page_tokens=int(batch["attention_mask"][0].sum()), malloc_pinned=_malloc_pinned(),
        adapter_bytes=adapter_bytes, adapter_round_trip=round_trip, **reserved,
    )


@dataclass(frozen=True)
class InferenceMeasurement:
    """Figures of one measured inference path on CPU (bytes, seconds): one encoding batch of the retriever or
    one query of the agentic generator. ``page_tokens``: LM tokens of one page (its encoding prompt, or its
    image tokens in the generator's prompt); ``prompt_tokens``: of one query (encoding) or of all the query's
    prompts (generation); ``detail``: the path's own counts (calls, route, generated tokens, seconds by part)."""

    weights: int
    step_peak: int
    seconds: float
    parameters: int
    page_tokens: int
    prompt_tokens: int
    malloc_pinned: bool
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def measure_encoding(config: Phi3VConfig, processor: Any, pages: int, queries: int, query: str,
                     page_size: tuple[int, int], device: str = "cpu") -> InferenceMeasurement:
    """One encoding batch of the retriever as ``task=retrieval`` runs it (:meth:`Phi3VRetriever.encode_documents`
    over ``pages`` random-noise pages of ``page_size``, then :meth:`~Phi3VRetriever.encode_queries` over
    ``queries`` copies of ``query``; no gradient) on random weights: the frozen model's bytes, the peak above
    them and the seconds of each part (measured as :func:`measure_step` does)."""
    cuda = device == "cuda"
    start = _allocated(cuda)
    retriever = Phi3VRetriever.wrap(_random_model(config, device), processor).eval()
    weights = _allocated(cuda) - start
    images = noise_pages(pages, page_size)
    texts = [query] * queries
    with torch.no_grad():  # one-time allocations (thread pools, oneDNN) before the baseline
        retriever.encode_queries(texts[:1])
    seconds: dict[str, float] = {}

    def encode() -> float:
        started = time.perf_counter()
        retriever.encode_documents(images, batch_size=pages)
        seconds["documents_s"] = time.perf_counter() - started
        started = time.perf_counter()
        retriever.encode_queries(texts, batch_size=queries)
        seconds["queries_s"] = time.perf_counter() - started
        return 0.0

    peak, total, _ = _peak_of_steps(encode, 1, cuda)
    page_batch, query_batch = retriever.document_inputs(images[:1]), retriever.query_inputs(texts[:1])
    return InferenceMeasurement(
        weights=weights, step_peak=peak, seconds=total, parameters=sum(p.numel() for p in retriever.parameters()),
        page_tokens=int(page_batch["attention_mask"][0].sum()),
        prompt_tokens=int(query_batch["attention_mask"][0].sum()),
        malloc_pinned=_malloc_pinned(), detail={**seconds, "pages": pages, "queries": queries},
    )


def measure_query(config: Phi3VConfig, processor: Any, backend_settings: dict[str, Any], page: Image.Image,
                  answer: Callable[[Any], Any], device: str = "cpu") -> InferenceMeasurement:
    """One query of the agentic generator through the local backend (:class:`~hkrag.lvlm.phi3v.Phi3VBackend`
    over the random-weight model of ``config`` with ``processor``'s tokenizer and crops, its caches as
    ``backend_settings``): ``answer(backend)`` runs it (the preflight passes the RAG task's own loop) and returns
    its :class:`~hkrag.rag.records.QueryOutcome`; ``page``: one of its pages, whose image tokens are counted.
    Measured as :func:`measure_step` does; the outcome's calls, route and tokens go to ``detail``."""
    cuda = device == "cuda"
    start = _allocated(cuda)
    backend = Phi3VBackend.from_model(_random_model(config, device), processor, "preflight (random weights)",
                                      **backend_settings)
    weights = _allocated(cuda) - start
    outcomes: list[Any] = []

    def run() -> float:
        outcomes.append(answer(backend))
        return 0.0

    peak, seconds, _ = _peak_of_steps(run, 1, cuda)
    outcome = outcomes[0]
    page_tokens = int(processor.image_processor([page])["num_img_tokens"][0])
    return InferenceMeasurement(
        weights=weights, step_peak=peak, seconds=seconds, parameters=sum(p.numel() for p in backend.lm.parameters()),
        page_tokens=page_tokens, prompt_tokens=outcome.prompt_tokens, malloc_pinned=_malloc_pinned(),
        detail={"calls": outcome.num_calls, "route": outcome.route, "completion_tokens": outcome.completion_tokens,
                "failed": outcome.failed, "failure": outcome.failure, "context_length": backend.context_length},
    )


def describe_bytes(value: int) -> str:
    """``value`` in GiB with two decimals."""
    return f"{value / GIB:.2f} GiB"


def format_terms(rows: Sequence[tuple[str, int]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {describe_bytes(value):>11}" for name, value in rows]
