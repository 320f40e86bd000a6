"""HKRAG: holistic knowledge RAG over visually-rich documents.

Importing the package registers Phi-3-vision (``hkrag.models.phi3v``) with transformers' Auto classes,
so ``AutoModelForCausalLM`` / ``AutoProcessor.from_pretrained("microsoft/Phi-3-vision-128k-instruct")``
load our implementation without ``trust_remote_code``. The registration happens when transformers is imported
(at once if it already is; :mod:`hkrag.import_hook`), so that a command that never loads a model (``--help``)
does not wait for torch and transformers. Where transformers or torch is not installed (a client of an LVLM
server needs only ``hkrag.lvlm.openai_backend``), there is nothing to register. Likewise, when OmegaConf is imported,
the configs' ``hkrag.local_path`` resolver is registered (:func:`register_resolvers`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hkrag.import_hook import after_import


def register_phi3v() -> None:
    """Import :mod:`hkrag.models.phi3v`, which registers its classes; nothing where torch is not installed."""
    try:
        importlib.import_module("hkrag.models.phi3v")
    except ModuleNotFoundError as error:
        if error.name not in ("transformers", "torch"):
            raise


def __getattr__(name: str) -> ModuleType:
    """``hkrag.phi3v``: :mod:`hkrag.models.phi3v`, imported on first use."""
    if name == "phi3v":
        return importlib.import_module("hkrag.models.phi3v")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_resolvers() -> None:
    """The configs' ``${hkrag.local_path:weights}``: :func:`hkrag.io.local_path` (the path as given where it exists,
    else the repository's), so ``paths.weights_dir`` finds the shipped weights from any working folder."""
    from omegaconf import OmegaConf

    from hkrag.io import local_path

    if not OmegaConf.has_resolver("hkrag.local_path"):
        OmegaConf.register_new_resolver("hkrag.local_path", lambda path: str(local_path(path)))


after_import("transformers", register_phi3v)
after_import("omegaconf", register_resolvers)
