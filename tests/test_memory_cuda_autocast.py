"""CUDA autocast's fp32 layer norms in the CLIP tower (issue 29): the term by hand, and emulated on the CPU.

CUDA autocast runs ``layer_norm`` in fp32 (its fp32 op list; CPU autocast's does not, so ``F.layer_norm`` of a bf16
tensor under CPU bf16 autocast stays bf16). The emulation patches ``F.layer_norm`` to cast its inputs to fp32, as
CUDA autocast does, and profiles a checkpointed CLIP layer with LoRA on q/k/v under CPU bf16 autocast."""

from contextlib import nullcontext

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_preflight import live_peak_per_element
from torch.utils.checkpoint import checkpoint
from transformers import CLIPVisionConfig
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from hkrag.training.memory import DROPOUT_MASK_BYTES, Architecture, Workload, clip_layer_bytes, cuda_layer_norms

WIDTH, TOKENS = 64, 1028  # 4 crops of 257 tokens; the tokens distinct from every width


def test_cuda_autocast_keeps_the_clip_residual_stream_in_fp32_by_hand():
    """Per CLIP layer with a gradient flowing: layer_norm1's and layer_norm2's saved inputs are the fp32 residual
    stream (4 bytes, 2 in bf16 on the CPU); LoRA's dropout mask is the device's own as before; fp32 weights keep an
    fp32 stream on either device, bf16 weights without autocast a bf16 one."""
    arch = tiny_arch()
    cuda = Workload(rows=4, page_tokens=1, crops=1, query_tokens=1, batch=0, device="cuda")
    cpu = Workload(**{**cuda.__dict__, "device": "cpu"})
    assert (cuda.clip_stream_bytes, cpu.clip_stream_bytes) == (4, 2)
    assert Workload(**{**cuda.__dict__, "dtype": "float32"}).clip_stream_bytes == 4
    assert Workload(**{**cuda.__dict__, "autocast": False}).clip_stream_bytes == 2  # bf16 weights, no autocast
    targets = {"q_proj", "k_proj", "v_proj"}
    extra = clip_layer_bytes(arch, cuda, targets, TOKENS, True) - clip_layer_bytes(arch, cpu, targets, TOKENS, True)
    dropout_masks = 3 * TOKENS * WIDTH * (4 - 1)  # the CPU kernel's fp32 noise against CUDA's bool mask
    assert extra + dropout_masks == 2 * TOKENS * WIDTH * (4 - 2)
    first = clip_layer_bytes(arch, cuda, targets, TOKENS, False) - clip_layer_bytes(arch, cpu, targets, TOKENS, False)
    assert first == TOKENS * WIDTH * (4 - 2)  # the first layer: its residual sum only, no gradient reaches its input


def tiny_arch() -> Architecture:
    return Architecture(hidden=8, intermediate=16, layers=1, heads=2, kv_heads=2, vocab=32, clip_hidden=WIDTH,
                        clip_intermediate=4 * WIDTH, clip_heads=4, clip_layers=1, clip_used_layers=1,
                        crop_tokens=257, crop_size=224, image_feature_dim=WIDTH)


def emulated_peak(fp32_norms: bool) -> float:
    """Peak live bytes per token x width of a checkpointed CLIP layer's forward and backward (LoRA on q/k/v, CPU
    bf16 autocast), its input from a layer norm as CLIP's ``pre_layrnorm`` gives it."""
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_attention_heads=4)
    config._attn_implementation = "sdpa"
    norm = torch.nn.LayerNorm(WIDTH).to(torch.bfloat16).requires_grad_(False)
    layer = get_peft_model(torch.nn.Sequential(CLIPEncoderLayer(config)).to(torch.bfloat16),
                           LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj"], lora_dropout=0.1))
    layer.train()
    embeddings = torch.randn(4, TOKENS // 4, WIDTH, dtype=torch.bfloat16)
    probe = torch.randn(4, TOKENS // 4, WIDTH)  # a loss whose gradient at the layer's output is a tensor

    def run() -> None:
        with torch.autocast("cpu", torch.bfloat16):
            stream = norm(embeddings).requires_grad_()  # a hidden state as the layer before gives it, a gradient
            out = checkpoint(layer.base_model.model[0], stream, None, use_reentrant=False)
            loss = (out.float() * probe).sum()
        del stream, out  # kept by the checkpoint; the output, the next layer's input, is not this layer's
        loss.backward()
        layer.zero_grad(set_to_none=True)

    patch = cuda_layer_norms() if fp32_norms else nullcontext()
    with patch:
        return live_peak_per_element(run, TOKENS * WIDTH)


def test_fp32_layer_norms_add_what_the_model_counts():
    """The emulated CUDA step's peak (a recomputed layer's backward, at quick_gelu) exceeds the CPU one by what the
    model adds on CUDA: layer_norm1's input (the checkpoint's kept input), layer_norm2's and the gradient arriving
    at the layer's output, each fp32 instead of bf16, 3 x (4 - 2) = 6 bytes per token x width (LoRA's dropout runs
    the CPU kernel in both, so its mask's difference is left out)."""
    arch, targets = tiny_arch(), {"q_proj", "k_proj", "v_proj"}
    cuda = Workload(rows=4, page_tokens=1, crops=1, query_tokens=1, batch=0, device="cuda")
    cpu = Workload(**{**cuda.__dict__, "device": "cpu"})
    masks = 3 * TOKENS * WIDTH * (DROPOUT_MASK_BYTES["cpu"] - DROPOUT_MASK_BYTES["cuda"])
    layer = clip_layer_bytes(arch, cuda, targets, TOKENS, True) + masks - clip_layer_bytes(arch, cpu, targets, TOKENS,
                                                                                           True)
    arriving = TOKENS * WIDTH * (cuda.clip_stream_bytes - cpu.clip_stream_bytes)
    assert (layer + arriving) / (TOKENS * WIDTH) == 6
    # per-token tensors (layer norms' statistics, SDPA's log-sum-exp) are 1/WIDTH of a byte here: 0.25 of slack;
    # saving each projection's bf16 cast, or layer_norm's fp32 output, would add 2 to 4 more
    assert emulated_peak(True) - emulated_peak(False) == pytest.approx(6, abs=0.25)
