"""Run a function once a top-level module has been imported, without importing it: :func:`after_import`.

``import hkrag`` uses it to register Phi-3-vision with transformers' Auto classes when (and only when) transformers
is imported, so that commands that never touch a model (``python -m hkrag.tasks.preflight --help``) do not pay the
seconds torch and transformers take to import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once the top-level module ``name`` has finished executing: at once if it already has,
    otherwise right after its first import (from inside that import, so the importer sees its effects)."""
    if name in sys.modules:
        callback()
        return
    waiting = [finder for finder in sys.meta_path if isinstance(finder, _AfterImport) and finder.name == name]
    if waiting:
        waiting[0].callbacks.append(callback)
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A meta-path finder that finds ``name`` with the finders after it and wraps the loader of what they found, so
    that executing the module calls its callbacks (after removing this finder: a callback may import ``name``)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callbacks = name, [callback]

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in [finder for finder in sys.meta_path if finder is not self]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallbackLoader(spec.loader, self)
                return spec
        return None

    def executed(self, spec: importlib.machinery.ModuleSpec, loader: importlib.abc.Loader) -> None:
        """The module has run: restore its own loader, step out of the import system, call back."""
        spec.loader = loader
        module = sys.modules.get(spec.name)  # the module may have replaced itself (transformers' lazy module)
        if module is not None and isinstance(getattr(module, "__loader__", None), _CallbackLoader):
            module.__loader__ = loader
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for callback in self.callbacks:
            callback()


class _CallbackLoader:
    """``loader`` (every attribute delegated to it), whose ``exec_module`` then tells its :class:`_AfterImport`."""

    def __init__(self, loader: importlib.abc.Loader, finder: _AfterImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.finder.executed(module.__spec__, self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
