"""The API reference builds from the docstrings (pdoc, docs/build_api.py), as CI builds it: every public package has
its page, every name of every public module's ``__all__`` is in it, nothing pdoc cannot import or resolve, and a
broken name does fail the build."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import pkgutil

import pytest

BUILD = pathlib.Path(__file__).parents[1] / "docs" / "build_api.py"


def _build_module():
    spec = importlib.util.spec_from_file_location("build_api", BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(api_reference_build) -> pathlib.Path:
    """The reference, built once for the module's tests as CI builds it (``python docs/build_api.py`` in a separate
    process, started in the background when collection ends: tests/background.py)."""
    result = api_reference_build
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pdoc:" not in result.stderr
    return result.directory / "api"


def _page(reference: pathlib.Path, module: str) -> pathlib.Path:
    return reference.joinpath(*module.split(".")).with_suffix(".html")


def test_the_api_reference_builds_with_a_page_per_package(reference):
    for module in _build_module().PACKAGES:
        assert _page(reference, module).is_file(), f"no page for {module}"
    runtime = (reference / "keygroups" / "runtime.html").read_text(encoding="utf-8")
    assert "get_list_state" in runtime and "ListStateDescriptor" in runtime   # signatures, typed
    state = (reference / "keygroups" / "state.html").read_text(encoding="utf-8")
    assert "RocksDBKeyedStateBackend" in state and "ValueState" in state
    flink = (reference / "keygroups" / "flink.html").read_text(encoding="utf-8")
    assert "import_savepoint" in flink and "allow_paths_outside" in flink


def _public_modules_with_all() -> list[str]:
    """Found here, independently of docs/build_api.py: every keygroups module without a leading underscore in its
    name that defines ``__all__``."""
    import keygroups

    names = ["keygroups"]
    for info in pkgutil.walk_packages(keygroups.__path__, "keygroups."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return [n for n in names if hasattr(importlib.import_module(n), "__all__")]


def test_every_name_of_every_public_modules_all_is_in_the_reference(reference):
    modules = _public_modules_with_all()
    assert {"keygroups.flink", "keygroups.testing", "keygroups.serializers.schema",
            "keygroups.serializers.schema_formats"} <= set(modules)
    missing = []
    for name in modules:
        page = _page(reference, name)
        if not page.is_file():
            missing.append(f"{name}: no page")
            continue
        html = page.read_text(encoding="utf-8")
        module = importlib.import_module(name)
        for attribute in module.__all__:
            if f'id="{attribute}"' not in html:
                missing.append(f"{name}.{attribute}")
    assert not missing, missing


def test_a_name_that_does_not_resolve_fails_the_build(tmp_path, monkeypatch):
    package = tmp_path / "src" / "brokendocs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package whose __all__ names what it lacks."""\n'
                                         '__all__ = ["present", "absent"]\n\n\ndef present() -> None:\n'
                                         '    """Here."""\n')
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    problems = _build_module().build(tmp_path / "out", ("brokendocs",))
    assert any("absent" in p for p in problems), problems
