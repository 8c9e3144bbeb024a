"""Every compiled module ships a .pyi stub, and the stubs agree with the runtime (mypy's stubtest)."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import subprocess
import sys

import keygroups._native as native

ALLOWLIST = pathlib.Path(__file__).parent / "stubtest-allowlist.txt"


def compiled_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(native.__path__) if not m.ispkg)


def test_every_compiled_module_has_a_stub():
    modules = compiled_modules()
    assert "hashing" in modules
    for name in modules:
        module = importlib.import_module(f"keygroups._native.{name}")
        assert module.__name__ == f"keygroups._native.{name}"  # full dotted name: objects pickle to executors
        stub = pathlib.Path(native.__file__).parent / f"{name}.pyi"
        stub_in_src = pathlib.Path(__file__).parents[1] / "src" / "keygroups" / "_native" / f"{name}.pyi"
        assert stub.exists() or stub_in_src.exists(), f"keygroups._native.{name} has no .pyi stub"


def test_py_typed_is_shipped():
    assert (pathlib.Path(native.__file__).parents[1] / "py.typed").exists()


def test_stubs_match_runtime():
    modules = [f"keygroups._native.{name}" for name in compiled_modules()]
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--allowlist", str(ALLOWLIST), *modules],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
