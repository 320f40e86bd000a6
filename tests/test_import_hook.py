"""``hkrag.import_hook.after_import``: a callback run once a module has been imported, without importing it (what
``import hkrag`` uses to register Phi-3-vision only when transformers is imported)."""

import builtins
import sys

import pytest

import hkrag
from hkrag.import_hook import _AfterImport, after_import


def waiting_for(name: str) -> list[_AfterImport]:
    return [finder for finder in sys.meta_path if isinstance(finder, _AfterImport) and finder.name == name]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh top-level package ``hook_probe`` on ``sys.path`` (not imported) that counts its executions; removed
    from ``sys.modules`` and ``sys.meta_path`` afterwards."""
    (tmp_path / "hook_probe").mkdir()
    (tmp_path / "hook_probe" / "__init__.py").write_text("import builtins\nvalue = 42\n"
                                                          "builtins.hook_probe_runs = "
                                                          "getattr(builtins, 'hook_probe_runs', 0) + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield "hook_probe"
    sys.modules.pop("hook_probe", None)
    vars(builtins).pop("hook_probe_runs", None)


def test_the_callback_runs_once_after_the_module_and_leaves_no_trace(package):
    seen = []
    after_import(package, lambda: seen.append(sys.modules[package].value))
    assert seen == [] and package not in sys.modules
    import hook_probe

    assert seen == [42]  # called during the import, after the module ran
    assert not waiting_for(package)
    assert not type(hook_probe.__spec__.loader).__name__.startswith("_Callback")
    assert not type(hook_probe.__loader__).__name__.startswith("_Callback")
    import hook_probe  # noqa: F811  (already imported: no second call)

    assert seen == [42]


def test_a_callback_may_import_the_module_itself(package):
    """The callback imports the module it waits for (``hkrag.models.phi3v`` imports transformers): no recursion."""
    seen = []
    after_import(package, lambda: seen.append(__import__(package).value))
    import hook_probe  # noqa: F401

    assert seen == [42] and builtins.hook_probe_runs == 1


def test_every_callback_runs_and_an_imported_module_calls_at_once(package):
    seen = []
    after_import(package, lambda: seen.append("first"))
    after_import(package, lambda: seen.append("second"))
    assert len(waiting_for(package)) == 1
    import hook_probe  # noqa: F401

    assert seen == ["first", "second"]
    after_import(package, lambda: seen.append("at once"))
    assert seen == ["first", "second", "at once"]


def test_a_failing_import_calls_nothing(package, tmp_path):
    (tmp_path / "hook_probe" / "__init__.py").write_text("raise RuntimeError('broken')\n")
    seen = []
    after_import(package, lambda: seen.append("called"))
    with pytest.raises(RuntimeError, match="broken"):
        import hook_probe  # noqa: F401
    assert seen == []


def test_registration_is_skipped_only_without_torch_or_transformers(monkeypatch):
    """Where torch or transformers is missing there is nothing to register; any other missing module is an error."""
    def missing(name):
        def raise_missing(_module):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return raise_missing

    for absent in ("torch", "transformers"):
        monkeypatch.setattr(hkrag.importlib, "import_module", missing(absent))
        assert hkrag.register_phi3v() is None
    monkeypatch.setattr(hkrag.importlib, "import_module", missing("PIL"))
    with pytest.raises(ModuleNotFoundError, match="PIL"):
        hkrag.register_phi3v()
