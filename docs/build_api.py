"""Build the API reference (HTML) from the docstrings with pdoc: ``python docs/build_api.py [OUTPUT_DIR]``.

Documents the public packages, each through its ``__all__``; needs the ``doc`` extra (pdoc) and, for
``keygroups.spark`` and ``RocksDBKeyedStateBackend``, the ``spark`` and ``rocksdb`` extras. Docstrings are
reStructuredText (``code``, :class:`roles`), which pdoc renders. Exits non-zero when pdoc warns, except for the
annotations it cannot evaluate (a ``NamedTuple`` whose annotations are strings: a pdoc limitation, not a missing
name), so a module that fails to import or a name in ``__all__`` that does not resolve fails the build.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

#: The public packages, in the order of the reference's index (the layers, bottom up).
MODULES = ("keygroups", "keygroups.serializers", "keygroups.checkpoint", "keygroups.state", "keygroups.sources",
           "keygroups.runtime", "keygroups.windows", "keygroups.spark", "keygroups.cli")

#: pdoc warnings that do not mean anything is missing from the reference.
TOLERATED = ("Error parsing type annotation",)


def build(output: pathlib.Path, modules: tuple[str, ...] = MODULES) -> list[str]:
    """Write the reference of ``modules`` under ``output``; the warnings pdoc gave that are not tolerated."""
    import pdoc
    import pdoc.render

    import keygroups.state

    # The optional RocksDB backend is a lazy attribute (rocksdict is imported only when asked for); resolve it so
    # that pdoc finds the name of keygroups.state.__all__ in the module.
    vars(keygroups.state).setdefault("RocksDBKeyedStateBackend", keygroups.state.RocksDBKeyedStateBackend)
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
