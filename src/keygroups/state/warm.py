"""Warm state: what a Python worker process keeps between batches so that the next batch of the same subtask skips
rebuilding it (Spark reuses worker processes; Flink's local recovery, ``TaskLocalStateStoreImpl``, is the model).

* :class:`WarmRegistry` holds what is kept (heap backends, timer queues), under a key, bounded, least recently kept
  dropped first; taking an object removes it, so two tasks never share one.
* :class:`WarmResume` says what resuming a warm backend for a key-group range did, key group by key group: a range
  that moved keeps the key groups it still owns (issue 26).

A RocksDB backend keeps its database on local disk instead (its warm directory, see
:mod:`keygroups.state.rocksdb`); the runtime chooses between warm, caught up, moved and cold
(:mod:`keygroups.runtime.subtask_state`).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from keygroups.state._base import RestoreStats

T = TypeVar("T")

#: Every registry of this process, for :func:`kept_object_ids`.
_REGISTRIES: weakref.WeakSet[WarmRegistry[Any]] = weakref.WeakSet()
_REGISTRIES_LOCK = threading.Lock()


def kept_object_ids() -> frozenset[int]:
    """The ids of the objects every registry of this process keeps now (those its ``watch`` names). Why: a worker
    that freezes its long-lived objects for the cycle collector (``keygroups.spark._worker_gc``) compares these with
    those kept when it froze: one that is gone was dropped, and heap backends are reference cycles, so only a
    collection that does not skip frozen objects frees it."""
    with _REGISTRIES_LOCK:
        registries = list(_REGISTRIES)
    ids: set[int] = set()
    for registry in registries:
        with registry._lock:
            for value in registry._kept.values():
                ids.update(id(part) for part in registry._watch(value))
    return frozenset(ids)


class WarmRegistry(Generic[T]):
    """Objects kept under a key, bounded by the caller's ``limit``, the least recently kept dropped first.
    :meth:`take` removes the object, so two tasks never share one (a second task finds nothing and rebuilds)."""

    def __init__(self, watch: Callable[[T], Iterable[object]] | None = None) -> None:
        """``watch``: the parts of a kept object that only a collection frees once dropped (reference cycles), each
        the same object while it is kept again batch after batch; :func:`kept_object_ids` reports them (default:
        the kept object itself)."""
        self._watch: Callable[[T], Iterable[object]] = watch if watch is not None else (lambda value: (value,))
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[Hashable, T] = collections.OrderedDict()
        with _REGISTRIES_LOCK:
            _REGISTRIES.add(self)

    def take(self, key: Hashable) -> T | None:
        """The object kept under ``key``, now the caller's alone; None if there is none."""
        with self._lock:
            return self._kept.pop(key, None)

    def take_best(self, score: Callable[[Hashable, T], Any]) -> tuple[Hashable, T] | None:
        """The kept object that ``score(key, object)`` ranks highest (None: unsuitable; ties: the most recently
        kept), with its key, now the caller's alone; None if none is suitable."""
        with self._lock:
            best: Hashable = None
            best_score: Any = None
            for key, value in self._kept.items():
                s = score(key, value)
                if s is not None and (best_score is None or s >= best_score):
                    best, best_score = key, s
            if best_score is None:
                return None
            return best, self._kept.pop(best)

    def keep(self, key: Hashable, value: T, limit: int, spare: Callable[[Hashable], bool] | None = None,
             weight: Callable[[T], int] | None = None) -> None:
        """Keep ``value`` under ``key`` (replacing one kept there), then drop the least recently kept beyond
        ``limit`` (0 keeps nothing); those ``spare(key)`` names (another task of the batch is to take them over)
        go last. ``weight``: what each object counts towards ``limit`` (1 each by default); an object heavier than
        ``limit`` on its own is not kept, and drops nothing."""
        size: Callable[[T], int] = weight if weight is not None else (lambda _: 1)
        with self._lock:
            self._kept.pop(key, None)
            if limit <= 0 or size(value) > limit:
                return
            self._kept[key] = value
            spared = [] if spare is None else [k for k in self._kept if k != key and spare(k)]
            for k in spared:   # least recently kept, among the spared, stays first among them
                self._kept.move_to_end(k)
            total = sum(size(v) for v in self._kept.values())
            while total > limit:
                total -= size(self._kept.popitem(last=False)[1])

    def peek(self, key: Hashable) -> T | None:
        """The object kept under ``key`` (None: none), left kept."""
        with self._lock:
            return self._kept.get(key)

    def keys(self) -> list[Hashable]:
        """The keys of the kept objects, least recently kept first."""
        with self._lock:
            return list(self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


@dataclass(frozen=True)
class WarmResume(RestoreStats):
    """What resuming a warm backend for a key-group range read (``bytes_read``, ``key_groups`` read), and which key
    groups (absolute numbers) it kept: ``warm`` (kept, nothing read), ``caught_up`` (kept, the blocks committed
    since the backend's last snapshot read), ``restored`` (arrived from another range: their chains read from the
    checkpoint), ``dropped`` (left for another subtask; their entries discarded); bytes read per kind."""

    warm: tuple[int, ...] = ()
    caught_up: tuple[int, ...] = ()
    restored: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    bytes_caught_up: int = 0
    bytes_restored: int = 0


__all__ = ["WarmRegistry", "WarmResume", "kept_object_ids"]
