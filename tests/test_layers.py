"""The one-way layers of ``hkrag/`` and ``agents/`` (README "Layout"), checked from the source with ``ast``.

A module may import its own layer or a lower one, never a higher one. ``agents/`` (the paper's method), like
any generator package beside it, uses only the LVLM interface and the RAG record types; ``hkrag`` names a
generator package only at the composition root, so another generator can sit beside ``agents/`` without
touching ``hkrag``. Every import counts: top-level,
inside functions and ``TYPE_CHECKING`` blocks, relative ones resolved. Modules named by string (a config's
``_target_``, ``importlib``) are not imports and are not checked.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATORS = ("agents",)  # generator packages beside hkrag (layer 6); a second one goes here
PACKAGES = ("hkrag", *GENERATORS)

# Lowest first. An entry covers its module and everything under it; the bare "hkrag" entry covers only
# hkrag/__init__.py (it registers the Phi3V Auto classes), so a new module must be placed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hkrag.io", "hkrag.stats", "hkrag.run_log", "hkrag.distributed", "hkrag.environment", "hkrag.import_hook",
     "hkrag.ranges"),
    ("hkrag", "hkrag.models", "hkrag.cli"),
    ("hkrag.data",),
    ("hkrag.lvlm", "hkrag.losses", "hkrag.late_interaction", "hkrag.retriever", "hkrag.index"),
    ("hkrag.training",),
    ("hkrag.retrieval", "hkrag.rag"),
    GENERATORS,
    ("hkrag.tasks",),
)

# The only hkrag modules that may import a generator package: the RAG task wires retrieval, generator, judge; Table 6
# composes the generator configurations it ablates and reads their routes to decide "identical by construction".
COMPOSITION_ROOTS = frozenset({"hkrag.tasks.rag", "hkrag.tasks.table6"})

# What a generator package may import of hkrag: the LVLM interface (and its submodules) and the RAG record types.
GENERATORS_MAY_IMPORT = ("hkrag.lvlm", "hkrag.rag.records")


def _covers(entry: str, module: str) -> bool:
    """Whether ``entry`` names ``module`` or one of its parent packages (bare ``hkrag`` names only itself)."""
    return module == entry or (entry != "hkrag" and module.startswith(entry + "."))


def layer_of(module: str) -> tuple[int, str] | None:
    """The layer and the table entry of ``module`` (the longest covering entry), or None when unplaced."""
    found = [(level, entry) for level, entries in enumerate(LAYERS) for entry in entries if _covers(entry, module)]
    return max(found, key=lambda item: len(item[1]), default=None)


def module_name(path: Path) -> str:
    """``hkrag/lvlm/base.py`` -> ``hkrag.lvlm.base``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module under the packages, by dotted name."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules that ``source`` (the module ``module``) imports anywhere, relative ones resolved.

    ``from a import b`` imports ``a.b`` when that is a module in ``known``, else ``a``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return [name for name in found if name.split(".")[0] in PACKAGES]


def _imports() -> list[tuple[str, str, str]]:
    """(importing file, importing module, imported module) for every project import."""
    modules = source_modules()
    known = set(modules)
    return [
        (str(path.relative_to(ROOT)), module, target)
        for module, path in modules.items()
        for target in imported_modules(path.read_text(), module, path.name == "__init__.py", known)
    ]


def _named(level: int) -> str:
    return f"layer {level} ({', '.join(LAYERS[level])})"


def test_every_module_has_one_layer():
    unplaced = sorted(str(path.relative_to(ROOT)) for module, path in source_modules().items() if not layer_of(module))
    assert not unplaced, f"modules in no layer (add them to LAYERS in tests/test_layers.py): {unplaced}"
    entries = [entry for entries in LAYERS for entry in entries]
    assert len(entries) == len(set(entries)), "an entry appears in two layers"


def test_no_module_imports_a_higher_layer():
    upward = []
    for path, module, target in _imports():
        importer, imported = layer_of(module), layer_of(target)
        if importer is None or imported is None:
            continue  # named by test_every_module_has_one_layer
        if imported[0] > importer[0]:
            upward.append(f"{path} imports {target}: {_named(importer[0])} may not import {_named(imported[0])}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph: dict[str, set[str]] = {}
    for _, module, target in _imports():
        if not (module == target or target.startswith(module + ".") or module.startswith(target + ".")):
            graph.setdefault(module, set()).add(target)  # a package and its own modules are one unit, not a circle
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        pytest.fail(f"modules that import each other in a circle: {' -> '.join(error.args[1])}")


def test_hkrag_names_a_generator_only_at_the_composition_root():
    wrong = [
        f"{path} imports {target}; only {sorted(COMPOSITION_ROOTS)} may"
        for path, module, target in _imports()
        if module.split(".")[0] == "hkrag" and target.split(".")[0] in GENERATORS and module not in COMPOSITION_ROOTS
    ]
    assert not wrong, "\n".join(wrong)


def test_generators_import_only_the_lvlm_interface_and_the_rag_records():
    wrong = [
        f"{path} imports {target}; {module.split('.')[0]}/ may import only {GENERATORS_MAY_IMPORT} of hkrag"
        for path, module, target in _imports()
        if module.split(".")[0] in GENERATORS
        and target.split(".")[0] == "hkrag"
        and not any(_covers(allowed, target) for allowed in GENERATORS_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("from . import BACKENDS", "hkrag.lvlm.serve", False, ["hkrag.lvlm"]),
        ("from .base import PageImage", "hkrag.lvlm", True, ["hkrag.lvlm.base"]),
        ("from ..rag import records", "hkrag.tasks.rag", False, ["hkrag.rag.records"]),
        ("def f():\n    import agents.pipeline\n", "hkrag.io", False, ["agents.pipeline"]),
        ("import torch\nfrom hkrag import models", "hkrag", True, ["hkrag.models"]),
    ],
)
def test_imports_are_resolved(source, module, is_package, expected):
    known = {"hkrag.lvlm.base", "hkrag.rag.records", "hkrag.models"}
    assert imported_modules(source, module, is_package, known) == expected


def test_both_packages_import_in_a_fresh_interpreter():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", "import agents, hkrag"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", ["hkrag.tasks.preflight", "hkrag.training.memory"])
def test_the_preflight_imports_without_search_or_scoring_libraries(module, tmp_path):
    """The GPU machines a preflight runs on need not have FAISS or trec_eval (the H200 image had neither): the
    preflight and the memory model must not import them."""
    for missing in ("faiss", "pytrec_eval"):
        (tmp_path / f"{missing}.py").write_text(f"raise ImportError('{missing} is not installed here')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
