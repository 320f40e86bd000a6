"""LVLM backends that return per-token probabilities (paper §3.3, docs/lvlm.md).

A backend is built from its config (``conf/lvlm/*.yaml``, the judge's ``backend`` block): ``_target_``
names the class, the other keys are its constructor's arguments, and :func:`build_backend` instantiates
it with Hydra. The class's module is imported only then, so the HTTP client does not pull in torch
models and vice versa.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from hydra.utils import instantiate

from .base import (
    GenerationSettings,
    LVLMBackend,
    LVLMContextError,
    LVLMError,
    LVLMHTTPError,
    LVLMRequest,
    LVLMResponseError,
    LVLMResult,
    LVLMTextError,
    LVLMTimeoutError,
    Message,
    PageImage,
    TokenLogprob,
)
from .uncertainty import Uncertainty, uncertainty

EXAMPLE_TARGET = "hkrag.lvlm.phi3v.Phi3VBackend"


def backend_class(target: object) -> type[LVLMBackend]:
    """The :class:`LVLMBackend` subclass that a config's ``_target_`` (``package.module.Class``) names.

    Imports its module; a :class:`ValueError` names the target and why it is unusable.
    """
    if not isinstance(target, str) or "." not in target.strip("."):
        raise ValueError(f"_target_={target!r}: expected the dotted path of an LVLMBackend class, "
                         f"e.g. {EXAMPLE_TARGET}")
    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"_target_={target!r}: cannot be imported ({type(error).__name__}: {error})") from error
    if not (isinstance(found, type) and issubclass(found, LVLMBackend)):
        raise ValueError(f"_target_={target!r}: not an LVLMBackend class")
    return found


def build_backend(config: Mapping[str, Any]) -> LVLMBackend:
    """The backend ``config`` describes: ``_target_`` (checked by :func:`backend_class`) plus its arguments.

    Nested values reach the constructor as plain lists and dicts. Errors of the constructor itself
    (``LVLMError``, ``TypeError`` for an unknown argument) propagate unchanged.
    """
    if not isinstance(config, Mapping) or "_target_" not in config:
        keys = sorted(config) if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(f"an LVLM config needs _target_, the backend class (e.g. {EXAMPLE_TARGET}; "
                         f"see conf/lvlm/), got {keys}")
    backend_class(config["_target_"])
    return instantiate(config, _partial_=True, _convert_="all")()


__all__ = [
    "GenerationSettings",
    "LVLMBackend",
    "LVLMContextError",
    "LVLMError",
    "LVLMHTTPError",
    "LVLMRequest",
    "LVLMResponseError",
    "LVLMResult",
    "LVLMTextError",
    "LVLMTimeoutError",
    "Message",
    "PageImage",
    "TokenLogprob",
    "Uncertainty",
    "backend_class",
    "build_backend",
    "uncertainty",
]
