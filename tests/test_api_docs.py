"""The API reference builds from the docstrings (pdoc, docs/build_api.py), as CI builds it: every public package has
its page, nothing pdoc cannot import or resolve, and a broken name does fail the build."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

BUILD = pathlib.Path(__file__).parents[1] / "docs" / "build_api.py"


def _build_module():
    spec = importlib.util.spec_from_file_location("build_api", BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_builds_with_a_page_per_package(tmp_path):
    result = subprocess.run([sys.executable, str(BUILD), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pdoc:" not in result.stderr
    for module in _build_module().MODULES:
        page = tmp_path.joinpath(*module.split(".")).with_suffix(".html")
        assert page.is_file(), f"no page for {module}"
    runtime = (tmp_path / "keygroups" / "runtime.html").read_text(encoding="utf-8")
    assert "get_list_state" in runtime and "ListStateDescriptor" in runtime   # signatures, typed
    state = (tmp_path / "keygroups" / "state.html").read_text(encoding="utf-8")
    assert "RocksDBKeyedStateBackend" in state and "ValueState" in state


def test_a_name_that_does_not_resolve_fails_the_build(tmp_path, monkeypatch):
    package = tmp_path / "src" / "brokendocs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package whose __all__ names what it lacks."""\n'
                                         '__all__ = ["present", "absent"]\n\n\ndef present() -> None:\n'
                                         '    """Here."""\n')
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    problems = _build_module().build(tmp_path / "out", ("brokendocs",))
    assert any("absent" in p for p in problems), problems
