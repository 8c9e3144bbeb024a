"""Pickling a user's function for the harness's subtasks, in this process only.

A job pickles its function once on the driver and every subtask unpickles a fresh copy each batch, so nothing a
function keeps in its own attributes survives from one batch to the next: only state does. The harness keeps that
(its subtasks run ``run_keyed_subtask``, which unpickles), but test code defines functions where the standard pickle
cannot find them by name (inside a test, in a notebook or an ``exec``'d guide), and Spark's cloudpickle is not ours
to import below ``keygroups.spark``. The bytes here never leave the process, so a class or function that cannot be
found by name is pickled as a reference into :data:`_OBJECTS`, which the harness keeps alive while it uses them."""

from __future__ import annotations

import io
import itertools
import pickle
import sys
import types
import weakref
from typing import Any

#: Objects the standard pickle cannot find by name, by token: alive as long as a harness holds its function.
_OBJECTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


def _registered(token: int) -> Any:
    try:
        return _OBJECTS[token]
    except KeyError:
        raise pickle.UnpicklingError(f"object {token} of a harness's function is gone (its harness was closed and "
                                     "the function collected)") from None


def _findable(obj: Any) -> bool:
    """Whether the standard pickle finds ``obj`` (a class or function) again by its module and qualified name."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None:
        return False
    found: Any = module
    for part in getattr(obj, "__qualname__", "").split("."):
        if part == "<locals>":
            return False
        found = getattr(found, part, None)
    return found is obj


class _InProcessPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.referenced: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and not _findable(obj):
            token = next(_TOKENS)
            _OBJECTS[token] = obj
            self.referenced.append(obj)
            return _registered, (token,)
        return NotImplemented


def pickle_in_process(obj: Any) -> tuple[bytes, list[Any]]:
    """``obj`` as bytes that ``pickle.loads`` turns into a fresh copy in this process, wherever its classes and
    functions were defined; and the objects those bytes refer to by token, which the caller keeps while it may
    load them."""
    buffer = io.BytesIO()
    pickler = _InProcessPickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.referenced
