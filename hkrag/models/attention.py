"""The attention kernel models load with when a config names none (Phi3V and Qwen2.5-VL checkpoints alike)."""

from __future__ import annotations

import importlib.util

import torch


def default_attn_implementation() -> str:
    """``flash_attention_2`` when flash-attn is installed and CUDA is present, else ``sdpa``."""
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"
