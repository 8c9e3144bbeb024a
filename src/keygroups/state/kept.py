"""What a Python worker process keeps between batches for the next task of the same subtask (heap backends, timer
queues): Spark reuses worker processes, so a subtask that lands on the same one can skip rebuilding."""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class KeptRegistry(Generic[T]):
    """Objects kept under a key, bounded by the caller's ``limit``, the least recently kept dropped first.
    :meth:`take` removes the object, so two tasks never share one (a second task finds nothing and rebuilds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[Hashable, T] = collections.OrderedDict()

    def take(self, key: Hashable) -> T | None:
        """The object kept under ``key``, now the caller's alone; None if there is none."""
        with self._lock:
            return self._kept.pop(key, None)

    def keep(self, key: Hashable, value: T, limit: int) -> None:
        """Keep ``value`` under ``key`` (replacing one kept there), then drop the least recently kept beyond
        ``limit`` (0 keeps nothing)."""
        with self._lock:
            self._kept.pop(key, None)
            if limit <= 0:
                return
            self._kept[key] = value
            while len(self._kept) > limit:
                self._kept.popitem(last=False)

    def keys(self) -> list[Hashable]:
        """The keys of the kept objects, least recently kept first."""
        with self._lock:
            return list(self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
