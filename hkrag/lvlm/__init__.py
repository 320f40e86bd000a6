"""LVLM backends that return per-token probabilities (paper §3.3, DESIGN §7).

``build_backend(kind, **settings)`` makes one by name; the modules are imported on demand so that the
HTTP client does not pull in torch models and vice versa.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import (
    GenerationSettings,
    LVLMBackend,
    LVLMError,
    LVLMHTTPError,
    LVLMRequest,
    LVLMResponseError,
    LVLMResult,
    LVLMTimeoutError,
    Message,
    PageImage,
    TokenLogprob,
)
from .uncertainty import Uncertainty, uncertainty

BACKENDS = {
    "phi3v": "hkrag.lvlm.phi3v:Phi3VBackend",
    "qwen2_5_vl": "hkrag.lvlm.qwen2_5_vl:Qwen2_5_VLBackend",
    "openai": "hkrag.lvlm.openai_backend:OpenAIBackend",
    "scripted": "hkrag.lvlm.scripted:ScriptedBackend",
}


def build_backend(kind: str, **settings: Any) -> LVLMBackend:
    """The backend ``kind`` (one of :data:`BACKENDS`) built from ``settings`` (its constructor's arguments)."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown LVLM backend {kind!r}; choose from {sorted(BACKENDS)}")
    module, name = BACKENDS[kind].split(":")
    return getattr(importlib.import_module(module), name)(**settings)


__all__ = [
    "BACKENDS",
    "GenerationSettings",
    "LVLMBackend",
    "LVLMError",
    "LVLMHTTPError",
    "LVLMRequest",
    "LVLMResponseError",
    "LVLMResult",
    "LVLMTimeoutError",
    "Message",
    "PageImage",
    "TokenLogprob",
    "Uncertainty",
    "build_backend",
    "uncertainty",
]
