"""Every compiled module ships a .pyi stub, and the stubs agree with the runtime (mypy's stubtest)."""

from __future__ import annotations

import importlib
import importlib.machinery
import pathlib
import pkgutil
import subprocess
import sys

import keygroups._native as native

ALLOWLIST = pathlib.Path(__file__).parent / "stubtest-allowlist.txt"
#: The Cython sources the build compiles, one module each (CMakeLists.txt globs them). They list the compiled modules
#: whatever the install: in an editable one, ``keygroups._native.__path__`` may hold only ``src/`` (pytest's
#: assertion-rewriting hook, not scikit-build-core's finder, makes the package's spec when keygroups is a pytest
#: plugin), so ``pkgutil`` finds no extension module there although each one imports.
SOURCES = pathlib.Path(__file__).parents[1] / "_native"


def compiled_modules() -> list[str]:
    """Every compiled module: those the build compiles (``_native/*.pyx``) and those the package's path holds."""
    built = {p.stem for p in SOURCES.glob("*.pyx")}
    found = {m.name for m in pkgutil.iter_modules(native.__path__) if not m.ispkg}
    return sorted(built | found)


def test_every_compiled_module_has_a_stub():
    modules = compiled_modules()
    assert "hashing" in modules
    for name in modules:
        module = importlib.import_module(f"keygroups._native.{name}")
        assert module.__name__ == f"keygroups._native.{name}"  # full dotted name: objects pickle to executors
        origin = str(module.__spec__.origin if module.__spec__ is not None else "")
        assert origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), \
            f"keygroups._native.{name} imports from {origin!r}, not from a compiled module"
        # Beside the package as imported: src/ in an editable install, site-packages for a wheel (so it ships).
        stub = pathlib.Path(native.__file__).parent / f"{name}.pyi"
        assert stub.exists(), f"keygroups._native.{name} has no .pyi stub at {stub}"


def test_py_typed_is_shipped():
    assert (pathlib.Path(native.__file__).parents[1] / "py.typed").exists()


def test_stubs_match_runtime():
    modules = [f"keygroups._native.{name}" for name in compiled_modules()]
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--allowlist", str(ALLOWLIST), *modules],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
