"""Build the API reference (HTML) from the docstrings with pdoc: ``python docs/build_api.py [OUTPUT_DIR]``.

Documents the public packages and every public module that declares its names (``__all__``): each page lists what
its ``__all__`` names (``public_modules``). Needs the ``doc`` extra (pdoc) and, for ``keygroups.spark`` and
``RocksDBKeyedStateBackend``, the ``spark`` and ``rocksdb`` extras. Docstrings are
reStructuredText (``code``, :class:`roles`), which pdoc renders. Exits non-zero when pdoc warns, except for the
annotations it cannot evaluate (a ``NamedTuple`` whose annotations are strings: a pdoc limitation, not a missing
name), so a module that fails to import or a name in ``__all__`` that does not resolve fails the build.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import sys
import warnings

#: The public packages, in the order of the reference's index (the layers, bottom up).
PACKAGES = ("keygroups", "keygroups.serializers", "keygroups.checkpoint", "keygroups.state", "keygroups.sources",
            "keygroups.runtime", "keygroups.sinks", "keygroups.windows", "keygroups.metrics", "keygroups.flink", "keygroups.testing",
            "keygroups.spark", "keygroups.cli")


def public_modules() -> tuple[str, ...]:
    """Every public module of keygroups that declares its names: no part of its name starts with ``_`` and it
    defines ``__all__`` (the packages too, whether or not they do), each package followed by its modules."""
    import keygroups

    found = []
    for info in pkgutil.walk_packages(keygroups.__path__, "keygroups."):
        if any(part.startswith("_") for part in info.name.split(".")) or info.name in PACKAGES:
            continue
        if hasattr(importlib.import_module(info.name), "__all__"):
            found.append(info.name)

    def place(name: str) -> tuple[int, str]:
        owner = max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len)
        return PACKAGES.index(owner), name

    return tuple(sorted([*PACKAGES, *found], key=place))


#: What the reference documents, in the order of its index.
MODULES = public_modules()

#: pdoc warnings that do not mean anything is missing from the reference.
TOLERATED = ("Error parsing type annotation",)


def build(output: pathlib.Path, modules: tuple[str, ...] = MODULES) -> list[str]:
    """Write the reference of ``modules`` under ``output``; the warnings pdoc gave that are not tolerated."""
    import pdoc
    import pdoc.render

    # Lazy attributes (a module's __getattr__: the optional RocksDB backend, which imports rocksdict only when asked
    # for; keygroups.testing's harness, which a pytest plugin loads at start) are resolved, so that pdoc finds every
    # name of __all__ in its module.
    for name in modules:
        module = importlib.import_module(name)
        for attribute in getattr(module, "__all__", ()):
            if attribute not in vars(module) and hasattr(module, attribute):
                vars(module)[attribute] = getattr(module, attribute)
    pdoc.render.configure(docformat="restructuredtext", footer_text="keygroups")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=output)
    return [str(w.message) for w in caught if not str(w.message).startswith(TOLERATED)]


def main(argv: list[str]) -> int:
    output = pathlib.Path(argv[0] if argv else "build/api")
    problems = build(output)
    for message in problems:
        print(f"pdoc: {message}", file=sys.stderr)
    print(f"API reference: {output / 'index.html'}" + (f" ({len(problems)} problems)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
