"""Shared bench helpers: the machine, a model-FLOPs estimate, a measured matmul peak, timing."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hkrag.environment import cpu_model
from hkrag.models.phi3v import Phi3VConfig


def machine() -> str:
    """One line naming the hardware the figures came from."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu_model()}, {torch.get_num_threads()} threads; {gpu}; torch {torch.__version__}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 8192, repeats: int = 20) -> float:
    """Measured dense matmul FLOP/s on ``device`` in ``dtype`` (the denominator of MFU)."""
    if device.type == "cpu":
        n, repeats = 1024, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, repeats)


def forward_flops(config: Phi3VConfig, lengths: torch.Tensor, crops: int, backward: bool = False) -> float:
    """Model FLOPs of one forward (x3 with backward) of a batch whose sequences hold ``lengths`` tokens:
    2 x params x tokens plus attention scores, which grow with each sequence's length squared.

    LM tokens include the image tokens; the vision tower runs on ``crops`` crops of
    ``patches + 1`` tokens each. Embedding lookups and the unused LM head are not counted.
    """
    lm, vc = config, config.vision_config
    tokens, squares = int(lengths.sum()), int((lengths.long() ** 2).sum())
    lm_params = lm.num_hidden_layers * (4 * lm.hidden_size**2 + 3 * lm.hidden_size * lm.intermediate_size)
    lm_flops = 2 * lm_params * tokens + 4 * lm.num_hidden_layers * squares * lm.hidden_size / 2  # causal: half
    seq = config.patches_per_side**2 + 1
    vit_params = vc.num_hidden_layers * (4 * vc.hidden_size**2 + 2 * vc.hidden_size * vc.intermediate_size)
    vit_flops = crops * (2 * vit_params * seq + 4 * vc.num_hidden_layers * seq**2 * vc.hidden_size)
    proj_flops = 2 * tokens * (config.image_feature_dim + lm.hidden_size) * lm.hidden_size  # upper bound: all tokens
    total = lm_flops + vit_flops + proj_flops
    return 3 * total if backward else total


def used_crops(image_sizes: torch.Tensor, crop: int) -> int:
    """Crops the vision tower actually runs: the global view plus the HD grid of every image."""
    return sum(1 + (h // crop) * (w // crop) for h, w in image_sizes.tolist())


def print_mfu(flops: float, seconds: float, device: torch.device, dtype: torch.dtype) -> None:
    """Achieved model FLOP/s against the measured matmul peak of the same device and dtype."""
    peak = matmul_peak(device, dtype)
    print(f"model FLOPs {flops / seconds / 1e12:.3f} TFLOP/s; matmul peak {peak / 1e12:.3f} TFLOP/s; "
          f"MFU {flops / seconds / peak:.1%}")
