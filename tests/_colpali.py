"""colpali-engine's modules for tests that compare with it, loaded without its package ``__init__`` (which imports
its models and needs torchvision, outside our pins). colpali-engine is a reference, not a dependency: a test using
:func:`colpali_module` is skipped when it is not installed (``pip install colpali-engine==0.3.18 --no-deps``)."""

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

INSTALL = "pip install colpali-engine==0.3.18 --no-deps"


@contextmanager
def colpali_module(name: str) -> Iterator[types.ModuleType]:
    """``colpali_engine.<name>`` with every package above it stubbed as a bare namespace (no ``__init__`` run);
    ``sys.modules`` restored afterwards."""
    spec = importlib.util.find_spec("colpali_engine")
    if spec is None:
        pytest.skip(f"colpali-engine is not installed ({INSTALL})")
    root = Path(spec.submodule_search_locations[0])
    parts = ["colpali_engine", *name.split(".")[:-1]]
    packages = [".".join(parts[: i + 1]) for i in range(len(parts))] + ["colpali_engine.utils"]
    saved = {package: sys.modules.get(package) for package in dict.fromkeys(packages)}
    for package in saved:
        stub = types.ModuleType(package)
        stub.__path__ = [str(root.joinpath(*package.split(".")[1:]))]
        sys.modules[package] = stub
    try:
        yield importlib.import_module(f"colpali_engine.{name}")
    finally:
        for package, module in saved.items():
            sys.modules.pop(package, None) if module is None else sys.modules.__setitem__(package, module)
        for loaded in [n for n in sys.modules if n.startswith("colpali_engine.") and n not in saved]:
            sys.modules.pop(loaded)
