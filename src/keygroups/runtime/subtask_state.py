"""A keyed subtask's state for one batch: its backend, warm or restored, and its timer queues (Flink's
``StreamTaskStateInitializerImpl``, which builds a task's state from its restore point and runs no records).

Warm state: Spark reuses its Python worker processes between tasks, so a heap backend can outlive its batch. After
its batch it goes into the process's :class:`HeapBackendRegistry` (at most ``KeyedTaskSpec.warm_heap_backends`` of
them, the least recently used dropped first); the next task of the same job, location and key-group range takes it
out (no two tasks share one; failing that, the warm backend whose range overlaps the task's most) and resumes it
(``HeapKeyedStateBackend.resume``: only when it is exactly the committed state, reading just the blocks other
workers committed since and the chains of key groups that arrived), else restores a new one. What a resumed
backend does not keep of its range stays in the process as pieces split by key-group range, and a task assembles its
range from every piece there that holds part of it, so a rescale reads only the key groups no piece in the task's
process holds (:class:`HeapBackendRegistry`). RocksDB keeps its
database on local disk instead (``warm_dir``). The subtask's :class:`~keygroups.runtime.report.RestoreInfo` says
which: ``warm``, ``caught-up``, ``moved``, ``cold`` or ``new``, and which key groups came how.

Spark does not keep a subtask in one worker process: an executor's idle Python workers wait in a FIFO queue
(``PythonWorkerFactory.idleWorkers``), refilled as tasks release their workers and drawn as tasks ask for one, so with
two cores which process runs which subtask is the race of the two tasks' ends and starts: they swapped in about every
other batch in our runs. A heap backend lives in one process, so on its own a subtask Spark moves to a process that
never held its range restores cold, one moved back to a process that held it earlier catches up, and after a few swaps
each process holds a copy of both ranges (twice the memory). So a Spark task moves its batch to its state instead:
when another process of the host holds more of its range, that process runs the subtask
(:mod:`keygroups.runtime.warm_exchange`) and each range stays in one process. RocksDB keeps its database on the
host's disk, so any process of the host resumes it warm (``tests/test_spark_heap_warm.py`` checks both).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from keygroups._local_dirs import private_directory
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime.backends import create_backend
from keygroups.runtime.report import RestoreInfo, TimerFigures
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.state import HeapKeyedStateBackend
from keygroups.state.rocksdb_warm import sweep_unused_jobs
from keygroups.state.timers import (
    TIMER_QUEUES,
    TIMER_STATE_NAMES,
    QueueToken,
    TimeDomain,
    TimerQueueRegistry,
    TimerQueues,
)
from keygroups.state.warm import WarmRegistry, WarmResume


def read_cache_directory(local_dir: str | None) -> str:
    """Where this host caches the immutable state files it read from remote checkpoint storage (bounded; see
    ``CheckpointStorage(cache_dir=...)``): ``keygroups-cache-<uid>`` under ``local_dir`` (the system temporary
    directory by default), private to this user (mode 0700; one that someone else could change is refused for a
    private temporary directory, with a warning: see :mod:`keygroups._local_dirs`)."""
    return private_directory(os.path.join(_local_base(local_dir), f"keygroups-cache-{os.geteuid()}"),
                             what="read cache")


def warm_root(local_dir: str | None) -> str:
    """Where every job's warm RocksDB databases live on this host: ``keygroups-warm-<uid>`` under ``local_dir`` (the
    system temporary directory by default), private to this user as :func:`read_cache_directory` is."""
    return private_directory(os.path.join(_local_base(local_dir), f"keygroups-warm-{os.geteuid()}"),
                             what="warm state")


def warm_directory(local_dir: str | None, checkpoint_location: str, job_name: str) -> str:
    """Where a job's warm RocksDB databases live on this host: under :func:`warm_root`, keyed by checkpoint location
    (hashed) and job name, one directory per key-group range below. A job's directory that no backend claimed for
    two days is deleted by the next warm backend of the host
    (:func:`~keygroups.state.rocksdb_warm.sweep_unused_jobs`)."""
    location = hashlib.sha256(checkpoint_location.encode()).hexdigest()[:16]
    job = hashlib.sha256(job_name.encode()).hexdigest()[:16]  # job names may hold any character
    return os.path.join(warm_root(local_dir), location, job)


def _local_base(local_dir: str | None) -> str:
    return local_dir or tempfile.gettempdir()


class HeapBackendRegistry(WarmRegistry[HeapKeyedStateBackend]):
    """Heap backends kept warm in this process after their batch, for the next batch of the same subtask to resume.

    Keyed by what must match for the state to be the same (see :func:`heap_backend_key`); bounded by the caller's
    ``limit``, the least recently kept dropped first. :meth:`take` removes the backend, so two tasks never share one
    (a second task finds nothing and restores).

    A task that resumes a kept backend for a range without some of its key groups parks them here as pieces
    (``HeapKeyedStateBackend.split_off``), under their own range, for another subtask that Spark runs in this process
    (a rescale then reads only what no piece here holds; a piece of an older checkpoint catches up as any kept
    backend does). Pieces count towards the limit like any kept backend; they hold part of one, never a copy. When a
    task keeps its backend after its batch, the kept backends and pieces of the job whose ranges lie inside its range
    go: they hold older states of key groups this one holds newer, so a process holds each key group once or in few
    copies, as before."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces: dict[Any, int] = {}   # key of a parked piece -> the checkpoint id it was parked for

    def keep(self, key: Any, value: HeapKeyedStateBackend, limit: int, spare: Any = None,
             weight: Any = None) -> None:
        """See :meth:`WarmRegistry.keep`; also drops what is kept of the same job inside ``key``'s range (see the
        class docs)."""
        with self._lock:
            self._pieces.pop(key, None)
            if isinstance(key, tuple) and len(key) == 7:
                for other in [k for k in self._kept if k != key and _inside(k, key)]:
                    del self._kept[other]
                    self._pieces.pop(other, None)
        super().keep(key, value, limit, spare=spare, weight=weight)

    def park(self, key: tuple[Any, ...], piece: HeapKeyedStateBackend, checkpoint_id: int, limit: int) -> None:
        """Keep ``piece`` (split off a kept backend for a subtask that starts from checkpoint ``checkpoint_id``)
        under ``key``."""
        super().keep(key, piece, limit)
        with self._lock:
            self._pieces = {k: c for k, c in self._pieces.items() if k in self._kept}
            if key in self._kept:
                self._pieces[key] = checkpoint_id

    def pieces(self) -> dict[Any, int]:
        """The parked pieces' keys and the checkpoint each was parked for."""
        with self._lock:
            return {k: c for k, c in self._pieces.items() if k in self._kept}


#: This Python process's warm heap backends (Spark reuses a worker process for many tasks).
HEAP_BACKENDS = HeapBackendRegistry()


def _inside(key: Any, outer: tuple[Any, ...]) -> bool:
    """Whether registry key ``key`` is of the same job as ``outer`` (see :func:`heap_backend_key`), its range
    inside ``outer``'s."""
    return (isinstance(key, tuple) and len(key) == 7 and key[:3] == outer[:3] and key[5:] == outer[5:]
            and outer[3] <= key[3] and key[4] <= outer[4])


def heap_backend_key(spec: KeyedTaskSpec, key_groups: KeyGroupRange) -> tuple[Any, ...]:
    """What a warm heap backend must share with a task to be resumed by it: checkpoint location, job, max
    parallelism, key-group range, key type (which fixes the key serializer) and whether pickle may be read."""
    return (spec.checkpoint_location, spec.job_name, spec.max_parallelism, key_groups.start, key_groups.end,
            spec.key_type, spec.allow_pickle)


def _warm_candidates(registry: HeapBackendRegistry, key: tuple[Any, ...], subtask_index: int,
                     claims: tuple[tuple[int, int] | None, frozenset[tuple[int, int]]] = (None, frozenset())
                     ) -> Iterator[HeapKeyedStateBackend]:
    """The warm backends a task may resume, each taken out of ``registry`` as it is yielded: the one of the range
    the batch's takeover gives this subtask (``claims``: that range, and those given to other subtasks; see
    ``KeyedTaskSpec.warm_claims``), then the one of exactly ``key``'s range, then those of the same job whose ranges
    overlap it, the largest overlap first (the previous batch's backend of this subtask among equals), never one
    whose range the takeover gives another subtask; the key groups still owned stay warm (see
    ``HeapKeyedStateBackend.resume``)."""
    mine, others = claims
    start, end = key[3], key[4]
    if mine is not None:
        given = registry.take((*key[:3], mine[0], mine[1], *key[5:]))
        if given is not None:
            yield given
    if (start, end) != mine and (start, end) not in others:
        exact = registry.take(key)
        if exact is not None:
            yield exact

    def score(other: Any, backend: HeapKeyedStateBackend) -> tuple[int, bool] | None:
        # a range given to another subtask only when it can be split: what that subtask keeps stays parked here
        if other[:3] != key[:3] or other[5:] != key[5:] or ((other[3], other[4]) in others
                                                          and not backend.splittable):
            return None
        overlap = min(end, other[4]) - max(start, other[3]) + 1
        return (overlap, backend.subtask_index == subtask_index) if overlap > 0 else None

    while (found := registry.take_best(score)) is not None:
        yield found[1]


def _heap_backend(spec: KeyedTaskSpec, subtask_index: int, own_range: KeyGroupRange, storage: CheckpointStorage,
                  metadata: CheckpointMetadata | None, candidates: Iterator[HeapKeyedStateBackend],
                  registry: HeapBackendRegistry | None = None) -> tuple[HeapKeyedStateBackend, RestoreInfo]:
    """The task's heap backend: the first of the warm ``candidates`` that resumes at ``metadata`` (the restore
    point: it holds exactly that state of the key groups it keeps, plus the blocks committed since), else a new one
    restored from it. A candidate that cannot resume is dropped (it is of another checkpoint or lineage). Before a
    candidate resumes for ``own_range``, its key groups outside it are split off and parked in ``registry`` as
    pieces for the other subtasks of the checkpoint (see :class:`HeapBackendRegistry`)."""
    for warm in candidates if metadata is not None else ():
        moved = warm.key_group_range != own_range
        pieces: list[tuple[tuple[Any, ...], HeapKeyedStateBackend]] = []
        if moved and registry is not None:
            _park_rest(spec, registry, warm, own_range, metadata.checkpoint_id)   # type: ignore[union-attr]
            pieces = _take_pieces(spec, registry, warm.key_group_range, own_range,
                                  metadata.checkpoint_id)   # type: ignore[union-attr]
        stats = warm.resume(storage, metadata, own_range,   # type: ignore[arg-type]  # not None here
                            pieces=[piece for _, piece in pieces])
        if stats is None and registry is not None:   # the pieces are as they were: back for another candidate
            for piece_key, piece in pieces:
                registry.park(piece_key, piece, metadata.checkpoint_id,   # type: ignore[union-attr]
                              spec.warm_heap_backends)
        if stats is not None:
            # warm state belongs to a range, not a subtask number: with other ranges (or another parallelism) the
            # same range may be another subtask's, whose number the snapshot's handle must carry
            warm.subtask_index = subtask_index
            return warm, RestoreInfo.resumed("moved" if moved else "caught-up" if stats.bytes_read else "warm",
                                             stats)
    backend = create_backend("heap", own_range, spec.max_parallelism, spec.key_type, subtask_index=subtask_index,
                             allow_pickle=spec.allow_pickle, compact_full_groups=True)
    if metadata is None:
        return backend, RestoreInfo.new()
    stats = backend.restore(storage, metadata)
    return backend, RestoreInfo.cold(own_range, stats.bytes_read, stats.key_groups)


def _park_rest(spec: KeyedTaskSpec, registry: HeapBackendRegistry, warm: HeapKeyedStateBackend,
               own_range: KeyGroupRange, checkpoint_id: int) -> None:
    """Park the key groups of ``warm`` left and right of ``own_range`` as pieces (when it can be split)."""
    r = warm.key_group_range
    if not r.intersection(own_range):
        return
    for start, end in ((r.start, own_range.start - 1), (own_range.end + 1, r.end)):
        if start > end:
            continue
        part = KeyGroupRange(start, end)
        piece = warm.split_off(part)
        if piece is not None:
            registry.park(heap_backend_key(spec, part), piece, checkpoint_id, spec.warm_heap_backends)


def _take_pieces(spec: KeyedTaskSpec, registry: HeapBackendRegistry, primary: KeyGroupRange, own_range: KeyGroupRange,
                 checkpoint_id: int) -> list[tuple[tuple[Any, ...], HeapKeyedStateBackend]]:
    """Pieces of the kept backends of this process that hold key groups of ``own_range`` outside ``primary`` (the
    range of the backend the task resumes), disjoint from it and from each other, taken out of ``registry`` (the
    largest first): what ``HeapKeyedStateBackend.resume`` assembles instead of reading those key groups. Of each
    backend taken, the key groups it is not used for are split off and parked again, so a key group given to another
    subtask of the batch stays here for it. Only backends that can be split (their state is exactly their last
    snapshot's) are taken."""
    job = heap_backend_key(spec, own_range)
    taken: list[tuple[tuple[Any, ...], HeapKeyedStateBackend]] = []
    gaps = _without(own_range, primary)

    def best_part(key: Any) -> KeyGroupRange | None:
        parts = [KeyGroupRange(key[3], key[4]).intersection(g) for g in gaps]
        return max((part for part in parts if part), key=len, default=None)

    def score(key: Any, backend: HeapKeyedStateBackend) -> int | None:
        if key[:3] != job[:3] or key[5:] != job[5:] or not backend.splittable:
            return None
        part = best_part(key)
        return None if part is None else len(part)

    while gaps and (found := registry.take_best(score)) is not None:
        key: Any = found[0]
        backend = found[1]
        part = best_part(key)
        assert part is not None
        if backend.key_group_range != part:
            inside = backend.split_off(part)
            if inside is None:   # cannot happen for a splittable backend; kept whole for another task
                registry.park(key, backend, checkpoint_id, spec.warm_heap_backends)
                break
            _park_rest(spec, registry, backend, part, checkpoint_id)   # its other key groups stay parked
            key, backend = heap_backend_key(spec, part), inside
        gaps = [rest for g in gaps for rest in _without(g, part)]
        taken.append((key, backend))
    return taken


def _without(r: KeyGroupRange, other: KeyGroupRange) -> list[KeyGroupRange]:
    """The parts of ``r`` left and right of ``other`` (``r`` itself when they do not meet)."""
    if not r.intersection(other):
        return [r]
    return [KeyGroupRange(a, b) for a, b in ((r.start, other.start - 1), (other.end + 1, r.end)) if a <= b]


class TaskTimers:
    """The task's timer queues, made when first needed: at the start when the restored state holds timers (or a
    warm queue reflects it), else on the function's first timer call; kept warm for the next batch after the
    snapshot."""

    def __init__(self, spec: KeyedTaskSpec, own_range: KeyGroupRange, metadata: CheckpointMetadata | None,
                 registry: TimerQueueRegistry) -> None:
        self.registry = registry
        self.key = (spec.backend, *heap_backend_key(spec, own_range))
        self.limit = spec.warm_heap_backends
        self.warm = registry.take_matching(self.key, metadata, own_range)
        self.queues: TimerQueues | None = None
        self.backend: Any = None

    def attach(self, backend: Any) -> None:
        """Use ``backend`` (restored); build or adopt the queues now if it holds timers."""
        self.backend = backend
        if self.warm is not None or any(backend.has_state(n) for n in TIMER_STATE_NAMES.values()):
            self.get()

    def get(self) -> TimerQueues:
        if self.queues is None:
            self.queues = TimerQueues(self.backend, reuse=self.warm)
            self.warm = None
        return self.queues

    def keep(self, checkpoint_id: int, handle: Any) -> None:
        if self.queues is not None:
            token = QueueToken(checkpoint_id, handle.file if handle is not None else None)
            self.registry.keep(self.key, (token, self.queues), self.limit)

    def figures(self) -> dict[TimeDomain, TimerFigures]:
        """Per time domain, this batch's figures (none without queues: no timer was ever registered)."""
        if self.queues is None:
            return {}
        out = {}
        for domain in TimeDomain:
            t = self.queues.of(domain)
            out[domain] = TimerFigures(registered=t.registered, fired=t.fired, pending=t.pending,
                                       queued=len(t.queue), earliest=t.earliest(), rebuilt=self.queues.rebuilt)
        return out


@dataclass
class TaskState:
    """A subtask's state for one batch: its ``backend``, how it came (``restored``), its ``timers``, the
    checkpoint ``storage`` and the ``restore_point`` (None: nothing to restore)."""

    backend: Any
    restored: RestoreInfo
    timers: TaskTimers
    storage: CheckpointStorage
    restore_point: CheckpointMetadata | None


@contextlib.contextmanager
def task_state(spec: KeyedTaskSpec, subtask_index: int, own_range: KeyGroupRange, *,
               warm: HeapBackendRegistry | None = None,
               warm_timers: TimerQueueRegistry | None = None) -> Iterator[TaskState]:
    """The state of subtask ``subtask_index`` (owning ``own_range``) for the batch of ``spec``: a heap backend from,
    and after a batch that went through back to, ``warm`` (this process's :data:`HEAP_BACKENDS` by default); timer
    queues likewise from ``warm_timers`` (:data:`~keygroups.state.timers.TIMER_QUEUES`). A RocksDB backend is
    disposed of when the block ends (its local database deleted, or kept warm on disk for the next batch)."""
    storage = CheckpointStorage(spec.checkpoint_location, storage_options=spec.storage_options,
                                cache_dir=read_cache_directory(spec.local_dir))
    metadata = spec.shipped_restore_point()
    if metadata is None and spec.restore_from is not None:
        metadata = storage.load_restore_point(spec.restore_from)
    timers = TaskTimers(spec, own_range, metadata, warm_timers if warm_timers is not None else TIMER_QUEUES)
    if spec.backend == "heap" and spec.warm_heap_backends > 0:
        registry = warm if warm is not None else HEAP_BACKENDS
        key = heap_backend_key(spec, own_range)
        backend, restored = _heap_backend(spec, subtask_index, own_range, storage, metadata,
                                          _warm_candidates(registry, key, subtask_index,
                                                           spec.warm_claims(subtask_index)), registry)
        yield TaskState(backend, restored, timers, storage, metadata)
        backend.compact()  # what a full rewrite made obsolete goes before the backend waits for its next batch
        others = spec.warm_claims(subtask_index)[1]
        registry.keep(key, backend, spec.warm_heap_backends,   # only after a batch that went through
                      spare=lambda k: k[:3] == key[:3] and k[5:] == key[5:] and (k[3], k[4]) in others)
        return
    warm_dir = None
    if spec.warm_state:
        warm_dir = warm_directory(spec.local_dir, spec.checkpoint_location, spec.job_name)
        sweep_unused_jobs(warm_root(spec.local_dir), keep=warm_dir)   # ended jobs' databases
    with create_backend(spec.backend, own_range, spec.max_parallelism, spec.key_type,
                        subtask_index=subtask_index, allow_pickle=spec.allow_pickle, local_dir=spec.local_dir,
                        warm_dir=warm_dir, warm_takeover=spec.warm_claims(subtask_index),
                        write_back_batches=spec.write_back_batches) as backend:
        restored = RestoreInfo.new()
        if metadata is not None:
            stats = backend.restore(storage, metadata)
            if isinstance(stats, WarmResume):   # taken over from an overlapping range, or caught up
                restored = RestoreInfo.resumed("moved" if stats.restored or stats.dropped
                                               else "caught-up" if stats.caught_up else "warm", stats)
            elif backend.warm:
                restored = RestoreInfo.kept(own_range, stats.bytes_read, stats.key_groups)
            else:
                restored = RestoreInfo.cold(own_range, stats.bytes_read, stats.key_groups)
        yield TaskState(backend, restored, timers, storage, metadata)


__all__ = ["HEAP_BACKENDS", "HeapBackendRegistry", "TaskState", "TaskTimers", "heap_backend_key",
           "read_cache_directory", "task_state", "warm_directory", "warm_root"]
