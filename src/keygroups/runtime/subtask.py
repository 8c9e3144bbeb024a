"""One keyed subtask of one micro-batch, as a Spark task runs it (no pyspark here, so it runs and tests alone).

restore its key groups from the previous checkpoint → run the user's function over its records, grouped by key, in
order → write its output → snapshot its state → report (a small JSON dict) to the driver, which commits the
checkpoint only once every subtask has reported.

Warm state: Spark reuses its Python worker processes between tasks, so a heap backend can outlive its batch. After
its batch it goes into the process's :class:`HeapBackendRegistry` (at most ``KeyedTaskSpec.warm_heap_backends`` of
them, the least recently used dropped first); the next task of the same job, location and key-group range takes it
out (no two tasks share one; failing that, the kept backend whose range overlaps the task's most) and resumes it
(``HeapKeyedStateBackend.resume``: only when it is exactly the committed state, reading just the blocks other
workers committed since and the chains of key groups that arrived), else restores a new one. RocksDB keeps its database
on local disk instead (``warm_dir``). The report's ``restored["mode"]`` says which: ``warm`` (nothing read),
``caught-up`` (newer blocks read), ``moved`` (a kept backend of an overlapping range: the key groups still owned stay
warm and catch up, those that arrived are restored, those that left are dropped), ``cold`` (restored), ``new`` (no
checkpoint to restore); its ``warm_key_groups``, ``caught_up_key_groups``, ``restored_key_groups`` and
``dropped_key_groups`` (``[start, end]`` runs) and ``bytes_caught_up``/``bytes_restored`` say which key groups came
how.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keygroups._hashing import KeyType, assign_key_groups, assign_key_groups_for_tuples, key_type_for_arrow
from keygroups._local_dirs import private_directory
from keygroups._ranges import KeyGroupRange, check_boundaries, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.raw_keyed import RawKeyedStateReader, write_raw_keyed_snapshot
from keygroups.errors import KeyGroupOutOfRangeError, StateMigrationError, UnsafeDeserializationError
from keygroups.runtime.assignment import CALLS_REPORT, RECORDS_REPORT, TIMERS_REPORT, encode_counts
from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext, TimerService
from keygroups.runtime.watermarks import LateRecords, check_late_records
from keygroups.state import HeapKeyedStateBackend
from keygroups.state._warm import WarmResume
from keygroups.state.kept import KeptRegistry
from keygroups.state.timers import (
    NO_WATERMARK,
    TIMER_QUEUES,
    TIMER_STATE_NAMES,
    QueueToken,
    TimeDomain,
    TimerQueueRegistry,
    TimerQueues,
)


def key_type_for_schema(schema: pa.Schema, key_columns: tuple[str, ...]) -> KeyType:
    """The key type (a name, or a tuple of names for several key columns) of the given Arrow columns: the names
    :func:`keygroups._hashing.key_type_for_arrow` gives, so a job hashes a column as ``assign_key_groups`` does."""
    names = []
    for column in key_columns:
        if column not in schema.names:
            raise ValueError(f"key column {column!r} is not in the input; its columns are {schema.names}")
        try:
            names.append(key_type_for_arrow(schema.field(column).type))
        except TypeError as e:
            raise TypeError(f"key column {column!r}: {e}") from None
    return names[0] if len(names) == 1 else tuple(names)


def key_serializer_for(key_type: KeyType) -> Any:
    """The serializer keyed state stores this job's keys with (deterministic bytes, compatible across runs)."""
    from keygroups import serializers as s

    if isinstance(key_type, tuple):
        return s.TupleSerializer(*(key_serializer_for(k) for k in key_type))
    return {
        "long": s.Int64Serializer,
        "int": s.Int32Serializer,
        "short": s.Int32Serializer,
        "byte": s.Int32Serializer,
        "boolean": s.BoolSerializer,
        "double": s.Float64Serializer,
        "float": s.Float64Serializer,
        "string": s.StrSerializer,
        "bytes": s.BytesSerializer,
    }[key_type]()


def read_cache_directory(local_dir: str | None) -> str:
    """Where this host caches the immutable state files it read from remote checkpoint storage (bounded; see
    ``CheckpointStorage(cache_dir=...)``): ``keygroups-cache-<uid>`` under ``local_dir`` (the system temporary
    directory by default), private to this user (mode 0700; one that someone else could change is refused for a
    private temporary directory, with a warning: see :mod:`keygroups._local_dirs`)."""
    return private_directory(os.path.join(_local_base(local_dir), f"keygroups-cache-{os.geteuid()}"),
                             what="read cache")


def warm_directory(local_dir: str | None, checkpoint_location: str, job_name: str) -> str:
    """Where a job's warm RocksDB databases live on this host: ``keygroups-warm-<uid>`` under ``local_dir`` (the
    system temporary directory by default; private to this user as :func:`read_cache_directory` is), keyed by
    checkpoint location (hashed) and job name, one directory per key-group range below."""
    location = hashlib.sha256(checkpoint_location.encode()).hexdigest()[:16]
    job = hashlib.sha256(job_name.encode()).hexdigest()[:16]  # job names may hold any character
    root = private_directory(os.path.join(_local_base(local_dir), f"keygroups-warm-{os.geteuid()}"),
                             what="warm state")
    return os.path.join(root, location, job)


def _local_base(local_dir: str | None) -> str:
    return local_dir or tempfile.gettempdir()


#: The keyed state backends a job can run on: ``"heap"`` (Python objects in the worker's memory, copy-on-write
#: snapshots) or ``"rocksdb"`` (a local RocksDB database per subtask, through rocksdict: state larger than memory).
StateBackendName = Literal["heap", "rocksdb"]


def create_backend(kind: StateBackendName, key_group_range: Any, max_parallelism: int, key_type: KeyType, *,
                   subtask_index: int = 0, allow_pickle: bool = False, local_dir: str | None = None,
                   warm_dir: str | None = None, kept: bool = False) -> Any:
    """A keyed state backend for one subtask's key groups: ``"heap"`` or ``"rocksdb"`` (a local database under
    ``local_dir``, a temporary directory by default, or kept warm under ``warm_dir``; call ``dispose()`` when
    done). ``kept``: a heap backend that will be kept across batches (it compacts key groups it writes full)."""
    from keygroups import state

    key_serializer = key_serializer_for(key_type)
    common = {"key_type": key_type, "allow_pickle": allow_pickle, "subtask_index": subtask_index}
    if kind == "heap":
        return state.HeapKeyedStateBackend(key_group_range, max_parallelism, key_serializer,
                                           compact_full_groups=kept, **common)
    if kind == "rocksdb":
        return state.RocksDBKeyedStateBackend(key_group_range, max_parallelism, key_serializer, db_dir=local_dir,
                                              warm_dir=warm_dir, **common)
    raise ValueError(f"unknown state backend {kind!r}; allowed: 'heap', 'rocksdb'")


@dataclass(frozen=True)
class KeyedTaskSpec:
    """Everything a keyed subtask needs, shipped to it by Spark (small: no state, no metadata)."""

    job_name: str
    key_columns: tuple[str, ...]
    key_type: KeyType
    function: bytes  # the job's KeyedProcessFunction, pickled by the driver: each subtask unpickles a fresh copy
    input_schema: pa.Schema
    output_schema: pa.Schema
    max_parallelism: int
    parallelism: int
    checkpoint_location: str
    checkpoint_id: int
    restore_from: int | str | None   # a checkpoint id, a savepoint name, or None (no state yet)
    backend: StateBackendName = "heap"
    order_columns: tuple[str, ...] = ()
    #: The event-time column (a timestamp, or a long of epoch ms): ``context.timestamp``, lateness, the watermark.
    timestamp_column: str | None = None
    #: The watermark the batch started with: records at or before it are late (see ``late_records``).
    start_watermark: int = NO_WATERMARK
    #: The batch's watermark once its records are in: event-time timers up to it fire after the records.
    watermark: int = NO_WATERMARK
    #: The batch's processing time (epoch ms, fixed by the driver): processing-time timers up to it fire.
    processing_time: int = 0
    #: Late records are dropped (and counted) or written to the batch's late output.
    late_records: LateRecords = "drop"
    storage_options: dict[str, Any] | None = None
    allow_pickle: bool = False
    #: The executors' local directory for warm state (RocksDB keeps its database there between batches); None:
    #: the system temporary directory.
    local_dir: str | None = None
    #: Keep RocksDB databases warm between batches (False: a fresh database per batch, as before).
    warm_state: bool = True
    #: Heap backends a Python worker process keeps between batches (each holds one subtask's state in memory); 0:
    #: none, every batch restores.
    warm_heap_backends: int = 4
    #: The batch's ranges as boundaries (subtask i owns ``[b[i], b[i + 1] - 1]``; see
    #: :mod:`keygroups.runtime.assignment`); None: Flink's equal ranges.
    key_group_boundaries: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_warm_heap_backends(self.warm_heap_backends)
        check_late_records(self.late_records)
        if self.key_group_boundaries is not None:
            b = check_boundaries(self.key_group_boundaries, self.max_parallelism)
            if len(b) != self.parallelism + 1:
                raise ValueError(f"key_group_boundaries must hold parallelism + 1 = {self.parallelism + 1} "
                                 f"boundaries, got {len(b)}")
            object.__setattr__(self, "key_group_boundaries", b)

    def own_key_groups(self, subtask_index: int) -> KeyGroupRange:
        """The key groups subtask ``subtask_index`` owns this batch: its range of ``key_group_boundaries``, or
        Flink's ``key_group_range`` without them."""
        b = self.key_group_boundaries
        if b is None:
            return key_group_range(self.max_parallelism, self.parallelism, subtask_index)
        if not 0 <= subtask_index < self.parallelism:
            raise ValueError(f"subtask_index must be in [0, parallelism={self.parallelism}), got {subtask_index}")
        return KeyGroupRange(b[subtask_index], b[subtask_index + 1] - 1)


def check_warm_heap_backends(n: Any) -> int:
    """``n`` if it is a valid number of heap backends to keep per worker process, else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"warm_heap_backends must be an int >= 0 (heap backends a worker process keeps between "
                         f"batches; 0 keeps none), got {n!r}")
    return n


class HeapBackendRegistry(KeptRegistry[HeapKeyedStateBackend]):
    """Heap backends kept in this process after their batch, for the next batch of the same subtask to resume.

    Keyed by what must match for the state to be the same (see :func:`heap_backend_key`); bounded by the caller's
    ``limit``, the least recently kept dropped first. :meth:`take` removes the backend, so two tasks never share one
    (a second task finds nothing and restores)."""


#: This Python process's kept heap backends (Spark reuses a worker process for many tasks).
HEAP_BACKENDS = HeapBackendRegistry()


def heap_backend_key(spec: KeyedTaskSpec, key_groups: KeyGroupRange) -> tuple[Any, ...]:
    """What a kept heap backend must share with a task to be resumed by it: checkpoint location, job, max
    parallelism, key-group range, key type (which fixes the key serializer) and whether pickle may be read."""
    return (spec.checkpoint_location, spec.job_name, spec.max_parallelism, key_groups.start, key_groups.end,
            spec.key_type, spec.allow_pickle)


def _kept_heap_backends(registry: HeapBackendRegistry, key: tuple[Any, ...], subtask_index: int
                        ) -> Iterator[HeapKeyedStateBackend]:
    """The kept backends a task may resume, each taken out of ``registry`` as it is yielded: the one of exactly
    ``key``'s range, then those of the same job whose ranges overlap it, the largest overlap first (the previous
    batch's backend of this subtask among equals: its key groups stay with their owner); the key groups still
    owned stay warm (see ``HeapKeyedStateBackend.resume``)."""
    exact = registry.take(key)
    if exact is not None:
        yield exact
    start, end = key[3], key[4]

    def score(other: Any, backend: HeapKeyedStateBackend) -> tuple[int, bool] | None:
        if other[:3] != key[:3] or other[5:] != key[5:]:
            return None
        overlap = min(end, other[4]) - max(start, other[3]) + 1
        return (overlap, backend.subtask_index == subtask_index) if overlap > 0 else None

    while (found := registry.take_best(score)) is not None:
        yield found[1]


def _load_function(spec: KeyedTaskSpec) -> KeyedProcessFunction:
    # The job's own code, pickled by the driver that submitted this task (as Spark ships every function): never
    # bytes read from a checkpoint or an input file.
    function = pickle.loads(spec.function)
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"the job's function must be a KeyedProcessFunction, got {type(function).__name__}")
    return function


def check_restored_states(function: bytes, metadata: CheckpointMetadata, *, key_type: KeyType,
                          job_name: str, max_parallelism: int, allow_pickle: bool, checkpoint_id: int) -> None:
    """Run the job's ``open`` on the driver against an empty heap backend that holds only ``metadata``'s state
    metas (no state is read): every state it declares is matched with the restored one as a task would match it, so
    a changed kind, TTL, key or value serializer raises StateMigrationError (and stored pickled serializers without
    ``allow_pickle`` UnsafeDeserializationError) before any task starts. States a function declares only while processing records are checked by the tasks, as before;
    any other error of ``open`` is left for the tasks to raise where it belongs."""
    metas: dict[str, dict[str, Any]] = {}
    for handle in sorted(metadata.keyed_handles, key=lambda h: h.checkpoint_id):
        for meta in handle.states:
            metas[meta["name"]] = meta
    if not metas:
        return
    user = pickle.loads(function)   # the job's own function, pickled by this driver: never bytes from a checkpoint
    everything = key_group_range(max_parallelism, 1, 0)
    with create_backend("heap", everything, max_parallelism, key_type, allow_pickle=allow_pickle) as backend:
        for meta in metas.values():
            backend._restore_target(meta)   # as a restore meets each state: the key serializer checked
        try:
            user.open(RuntimeContext(backend, job_name=job_name, subtask_index=0, parallelism=1,
                                     max_parallelism=max_parallelism, checkpoint_id=checkpoint_id))
        except (StateMigrationError, UnsafeDeserializationError):
            raise
        except Exception:   # noqa: BLE001  # open may need what only an executor has: the tasks will say
            return


def _key_groups(table: pa.Table, spec: KeyedTaskSpec) -> np.ndarray:
    columns = [table.column(c) for c in spec.key_columns]
    if len(columns) == 1:
        return assign_key_groups(columns[0], spec.max_parallelism, spec.key_type)  # type: ignore[arg-type]
    return assign_key_groups_for_tuples(columns, spec.max_parallelism, spec.key_type)


_CANONICAL_NAN_BITS = {pa.float16(): 0x7E00, pa.float32(): 0x7FC00000, pa.float64(): 0x7FF8000000000000}
_BITS = {pa.float16(): np.int16, pa.float32(): np.int32, pa.float64(): np.int64}


def _java_equality_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A key column as Java's ``equals`` groups it: floats by their IEEE bits with one canonical NaN (every NaN is
    one key; -0.0 is not 0.0), anything else as it is (the same object)."""
    if not pa.types.is_floating(column.type):
        return column
    values = column.to_numpy(zero_copy_only=False)
    bits = values.view(_BITS[column.type]).astype(np.int64)
    bits[np.isnan(values)] = _CANONICAL_NAN_BITS[column.type]
    return pa.chunked_array([pa.array(bits, mask=column.is_null().to_numpy(zero_copy_only=False))])


def unused_name(names: Sequence[str], wanted: str) -> str:
    """``wanted``, or ``wanted`` with a numbered suffix if a column of that name exists."""
    taken = set(names)
    name, n = wanted, 0
    while name in taken:
        n += 1
        name = f"{wanted}_{n}"
    return name


def _key_runs(table: pa.Table, key_columns: tuple[str, ...]) -> np.ndarray:
    """Start offsets of the runs of equal keys (equal as Java compares them) in a table sorted by key (plus the
    end offset)."""
    n = table.num_rows
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    change = np.zeros(n - 1, dtype=bool)
    for name in key_columns:
        col = _java_equality_column(table.column(name))
        change |= pc.not_equal(col.slice(1), col.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.flatnonzero(change) + 1, [n]]).astype(np.int64)


def _to_table(outputs: list[Any], schema: pa.Schema) -> pa.Table:
    """The function's output records as one table of ``schema``, in order. A record is a dict with exactly the
    schema's field names, a tuple (or list) of its width in its order, or an Arrow table holding at least its columns
    (others are dropped). Anything else raises, naming the record and the schema: a misspelled field must never
    become a silent null."""
    names = schema.names
    wanted = frozenset(names)
    parts: list[pa.Table] = []
    dicts: list[dict[str, Any]] = []
    tuples: list[Any] = []

    def flush() -> None:
        if dicts:
            parts.append(pa.Table.from_pylist(dicts, schema=schema))
            dicts.clear()
        if tuples:
            columns = list(zip(*tuples))
            parts.append(pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, schema)],
                                              schema=schema))
            tuples.clear()

    for record in outputs:
        if isinstance(record, dict):
            if record.keys() != wanted:
                unknown = sorted(str(k) for k in record.keys() - wanted)
                missing = [n for n in names if n not in record]
                raise ValueError(f"output record {record!r} does not match the output schema {names}: "
                                 f"unknown fields {unknown}, missing fields {missing} (give every field, None for "
                                 "a null)")
            if tuples:
                flush()
            dicts.append(record)
        elif isinstance(record, (tuple, list)):
            if len(record) != len(names):
                raise ValueError(f"output record {record!r} has {len(record)} fields; the output schema has "
                                 f"{len(names)}: {names}")
            if dicts:
                flush()
            tuples.append(record)
        elif isinstance(record, pa.Table):
            flush()
            missing = [n for n in names if n not in record.column_names]
            if missing:
                raise ValueError(f"an output table lacks the output schema's columns {missing}; it has "
                                 f"{record.column_names}, the schema {names}")
            parts.append(record.select(names).cast(schema))
        else:
            raise TypeError(f"output record {record!r} is a {type(record).__name__}; records are dicts (field "
                            f"names {names}), tuples in that order, or Arrow tables")
    flush()
    if not parts:
        return schema.empty_table()
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def run_keyed_subtask(spec: KeyedTaskSpec, subtask_index: int, batches: Iterable[pa.RecordBatch], *,
                      kept: HeapBackendRegistry | None = None,
                      kept_timers: TimerQueueRegistry | None = None) -> dict[str, Any]:
    """Run one subtask of one micro-batch; returns its report (JSON-able) for the driver's commit. A heap backend
    comes from, and after the batch goes back to, ``kept`` (this process's :data:`HEAP_BACKENDS` by default); timer
    queues likewise from ``kept_timers`` (:data:`~keygroups.state.timers.TIMER_QUEUES`)."""
    own_range = spec.own_key_groups(subtask_index)
    start = time.perf_counter()
    storage = CheckpointStorage(spec.checkpoint_location, storage_options=spec.storage_options,
                                cache_dir=read_cache_directory(spec.local_dir))
    metadata = storage.load_restore_point(spec.restore_from) if spec.restore_from is not None else None
    timers = _TimerQueuesOfTask(spec, own_range, metadata,
                                kept_timers if kept_timers is not None else TIMER_QUEUES)
    if spec.backend == "heap" and spec.warm_heap_backends > 0:
        registry = kept if kept is not None else HEAP_BACKENDS
        key = heap_backend_key(spec, own_range)
        backend, restored = _heap_backend(spec, subtask_index, own_range, storage, metadata,
                                          _kept_heap_backends(registry, key, subtask_index))
        report = _run_on_backend(spec, subtask_index, batches, backend, own_range, storage, restored,
                                 time.perf_counter() - start, timers, metadata)
        backend.compact()  # what a full rewrite made obsolete goes before the backend waits for its next batch
        registry.keep(key, backend, spec.warm_heap_backends)  # only after a batch that went through
        return report
    # Disposed on the way out (RocksDB: its local database is deleted, or kept warm for the next batch).
    warm_dir = warm_directory(spec.local_dir, spec.checkpoint_location, spec.job_name) if spec.warm_state else None
    with create_backend(spec.backend, own_range, spec.max_parallelism, spec.key_type,
                        subtask_index=subtask_index, allow_pickle=spec.allow_pickle, local_dir=spec.local_dir,
                        warm_dir=warm_dir) as backend:
        restored = _restored("new", 0, 0, False)
        if metadata is not None:
            stats = backend.restore(storage, metadata)
            if isinstance(stats, WarmResume):   # the kept database of an overlapping range, taken over
                restored = {**_restored("moved", stats.bytes_read, stats.key_groups, True), **stats.report()}
            else:
                restored = {**_restored("warm" if backend.warm else "cold", stats.bytes_read, stats.key_groups,
                                        backend.warm),
                            **(WarmResume(0, 0, warm=tuple(own_range)).report() if backend.warm
                               else cold_restore_report(own_range, stats.bytes_read))}
        return _run_on_backend(spec, subtask_index, batches, backend, own_range, storage, restored,
                               time.perf_counter() - start, timers, metadata)


class _TimerQueuesOfTask:
    """The task's timer queues, made when first needed: at the start when the restored state holds timers (or a
    kept queue reflects it), else on the function's first timer call; kept for the next batch after the snapshot."""

    def __init__(self, spec: KeyedTaskSpec, own_range: KeyGroupRange, metadata: CheckpointMetadata | None,
                 registry: TimerQueueRegistry) -> None:
        self.registry = registry
        self.key = (spec.backend, *heap_backend_key(spec, own_range))
        self.limit = spec.warm_heap_backends
        self.kept = registry.take_matching(self.key, metadata, own_range)
        self.queues: TimerQueues | None = None
        self.backend: Any = None

    def attach(self, backend: Any) -> None:
        """Use ``backend`` (restored); build or adopt the queues now if it holds timers."""
        self.backend = backend
        if self.kept is not None or any(backend.has_state(n) for n in TIMER_STATE_NAMES.values()):
            self.get()

    def get(self) -> TimerQueues:
        if self.queues is None:
            self.queues = TimerQueues(self.backend, reuse=self.kept)
            self.kept = None
        return self.queues

    def keep(self, checkpoint_id: int, handle: Any) -> None:
        if self.queues is not None:
            token = QueueToken(checkpoint_id, handle.file if handle is not None else None)
            self.registry.keep(self.key, (token, self.queues), self.limit)

    def report(self) -> dict[str, Any]:
        return self.queues.report() if self.queues is not None else {}


def _restored(mode: str, bytes_read: int, key_groups: int, warm: bool) -> dict[str, Any]:
    """The report's ``restored``: how the state came (``warm``, ``caught-up``, ``cold``, ``new``), bytes read from
    checkpoint files, key groups read, and whether nothing had to be rebuilt (warm or caught up)."""
    return {"mode": mode, "bytes_read": int(bytes_read), "key_groups": int(key_groups), "warm": warm}


def _heap_backend(spec: KeyedTaskSpec, subtask_index: int, own_range: KeyGroupRange, storage: CheckpointStorage,
                  metadata: CheckpointMetadata | None, candidates: Iterator[HeapKeyedStateBackend]
                  ) -> tuple[HeapKeyedStateBackend, dict[str, Any]]:
    """The task's heap backend: the first of the kept ``candidates`` that resumes at ``metadata`` (the restore
    point: it holds exactly that state of the key groups it keeps, plus the blocks committed since), else a new one
    restored from it. A candidate that cannot resume is dropped (it is of another checkpoint or lineage)."""
    for kept in candidates if metadata is not None else ():
        moved = kept.key_group_range != own_range
        stats = kept.resume(storage, metadata, own_range)
        if stats is not None:
            # warm state belongs to a range, not a subtask number: with other ranges (or another parallelism) the
            # same range may be another subtask's, whose number the snapshot's handle must carry
            kept.subtask_index = subtask_index
            mode = "moved" if moved else "caught-up" if stats.bytes_read else "warm"
            return kept, {**_restored(mode, stats.bytes_read, stats.key_groups, True), **stats.report()}
    backend = create_backend("heap", own_range, spec.max_parallelism, spec.key_type, subtask_index=subtask_index,
                             allow_pickle=spec.allow_pickle, kept=True)
    if metadata is None:
        return backend, _restored("new", 0, 0, False)
    stats = backend.restore(storage, metadata)
    return backend, {**_restored("cold", stats.bytes_read, stats.key_groups, False),
                     **cold_restore_report(own_range, stats.bytes_read)}


def cold_restore_report(own_range: KeyGroupRange, bytes_read: int) -> dict[str, Any]:
    """The key-group fields of a report's ``restored`` for a backend restored whole (see ``WarmResume.report``)."""
    return WarmResume(bytes_read, len(own_range), restored=tuple(own_range), bytes_restored=bytes_read).report()


def event_time_millis(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """An event-time column as int64 epoch milliseconds (nulls as ``NO_WATERMARK``): a timestamp of any unit and
    time zone, or an integer column already in epoch ms. TypeError naming the column and the allowed types
    otherwise."""
    t = column.type
    if pa.types.is_timestamp(t):
        column = pc.cast(column, pa.timestamp("ms", t.tz), safe=False).cast(pa.int64())
    elif not pa.types.is_integer(t):
        raise TypeError(f"event-time column {name!r} is {t}; it must be a timestamp, or a long of epoch "
                        "milliseconds")
    return np.asarray(pc.fill_null(column.cast(pa.int64()), NO_WATERMARK).to_numpy(zero_copy_only=False),
                      dtype=np.int64)


def _run_on_backend(spec: KeyedTaskSpec, subtask_index: int, batches: Iterable[pa.RecordBatch], backend: Any,
                    own_range: Any, storage: CheckpointStorage, restored: dict[str, Any],
                    restore_seconds: float, timers: _TimerQueuesOfTask,
                    metadata: CheckpointMetadata | None = None) -> dict[str, Any]:
    timings: dict[str, float] = {"restore": restore_seconds}

    t = time.perf_counter()
    function = _load_function(spec)
    table = pa.Table.from_batches(list(batches), schema=spec.input_schema)
    records_in = table.num_rows
    late = spec.input_schema.empty_table()
    event_times = np.zeros(0, dtype=np.int64)
    event_time_range = None
    if records_in and spec.timestamp_column is not None:
        event_times = event_time_millis(table.column(spec.timestamp_column), spec.timestamp_column)
        stamped = event_times[event_times != NO_WATERMARK]
        if len(stamped):   # late records included: the range of what arrived
            event_time_range = [int(stamped.min()), int(stamped.max())]
        if spec.start_watermark != NO_WATERMARK:
            is_late = function.late_mask(event_times, spec.start_watermark) & (event_times != NO_WATERMARK)
            if is_late.any():
                late = table.filter(pa.array(is_late))
                table = table.filter(pa.array(~is_late))
                event_times = event_times[~is_late]
    groups = np.zeros(0, dtype=np.int32)
    records_per_group = np.zeros(len(own_range), dtype=np.int64)   # the load figures (runtime.assignment)
    if table.num_rows:
        groups = _key_groups(table, spec)
        outside = (groups < own_range.start) | (groups > own_range.end)
        if outside.any():
            pos = int(np.argmax(outside))
            key = tuple(table.column(c)[pos].as_py() for c in spec.key_columns)
            raise KeyGroupOutOfRangeError(
                f"subtask {subtask_index} of {spec.parallelism} owns key groups {own_range} but received key "
                f"{key if len(key) > 1 else key[0]!r} of key group {int(groups[pos])}: the input was not partitioned "
                "by key group (or the key's hash is not deterministic)"
            )
        records_per_group = np.bincount(groups - own_range.start, minlength=len(own_range))
        group_column = unused_name(table.column_names, "__key_group")   # input columns may have any name
        table = table.append_column(group_column, pa.array(groups, pa.int16()))
        sort_keys = [(group_column, "ascending")]
        for i, c in enumerate(spec.key_columns):
            column = _java_equality_column(table.column(c))
            if column is table.column(c):
                sort_keys.append((c, "ascending"))
            else:   # a float key sorts by its bits, so that -0.0 and 0.0 do not interleave
                bits_column = unused_name(table.column_names, f"__key_bits_{i}")
                table = table.append_column(bits_column, column)
                sort_keys.append((bits_column, "ascending"))
        sort_keys += [(c, "ascending") for c in spec.order_columns]
        order = pc.sort_indices(table, sort_keys=sort_keys)
        table = table.take(order).select(list(spec.input_schema.names))
        groups = groups[order.to_numpy()]
        if len(event_times):
            event_times = event_times[order.to_numpy()]
    timings["prepare"] = time.perf_counter() - t

    t = time.perf_counter()
    backend.watermark = spec.start_watermark
    backend.processing_time = spec.processing_time
    timers.attach(backend)
    function.open(RuntimeContext(backend, job_name=spec.job_name, subtask_index=subtask_index,
                                 parallelism=spec.parallelism, max_parallelism=spec.max_parallelism,
                                 checkpoint_id=spec.checkpoint_id))
    if metadata is not None and metadata.raw_keyed_handles:   # a fresh function object every batch: always read
        function.restore_raw_keyed_state(RawKeyedStateReader(storage, metadata, own_range,
                                                             max_parallelism=spec.max_parallelism))
    timer_service = TimerService(timers.get, watermark=spec.start_watermark, processing_time=spec.processing_time)
    context = ProcessContext(checkpoint_id=spec.checkpoint_id, subtask_index=subtask_index,
                             timer_service=timer_service)
    outputs: list[Any] = []
    vectorized = type(function).process_key_batch is not KeyedProcessFunction.process_key_batch
    batched = type(function).process_batch is not KeyedProcessFunction.process_batch
    runs = _key_runs(table, spec.key_columns)
    # the work per key group (the load figures): a step per key (the switch to it, its state), and one per record
    # when the function is called per record
    calls_per_group = np.bincount(groups[runs[:-1]] - own_range.start, minlength=len(own_range))
    if not (vectorized or batched):
        calls_per_group = calls_per_group + records_per_group
    # One Python key per run of equal keys, not per record.
    starts = pa.array(runs[:-1])
    run_keys = [table.column(c).take(starts).to_pylist() for c in spec.key_columns]
    keys = run_keys[0] if len(run_keys) == 1 else list(zip(*run_keys))
    if keys:
        backend.prefetch(keys, groups[runs[:-1]])
    rows: list[dict[str, Any]] = []
    if table.num_rows and not vectorized and not batched:
        names = table.column_names
        columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
        rows = [dict(zip(names, values)) for values in zip(*columns)]
    stamps = event_times.tolist() if spec.timestamp_column is not None else None
    process = function.process_element
    if batched and keys:
        def select_key(i: int) -> None:
            backend.set_current_key(keys[i])
            context.current_key, context.current_key_group = keys[i], backend.current_key_group

        result = function.process_batch(table, runs, keys, select_key, context)
        if result is not None:
            outputs.extend(result)
    for i, key in enumerate(() if batched else keys):
        lo, hi = int(runs[i]), int(runs[i + 1])
        backend.set_current_key(key)
        context.current_key, context.current_key_group = key, backend.current_key_group
        if vectorized:
            result = function.process_key_batch(key, table.slice(lo, hi - lo), context)
            if result is not None:
                outputs.append(result) if isinstance(result, pa.Table) else outputs.extend(result)
            continue
        for j in range(lo, hi):
            if stamps is not None:
                stamp = stamps[j]
                context._timestamp = None if stamp == NO_WATERMARK else stamp   # the slot: no property call per record
            result = process(rows[j], context)
            if result is not None:
                outputs.extend(result)
    timings["process"] = time.perf_counter() - t

    t = time.perf_counter()
    timer_service._watermark = backend.watermark = spec.watermark
    fired_groups: list[int] = []
    if timers.queues is not None:
        _fire_timers(function, backend, timers.queues, context, outputs,
                     ((TimeDomain.EVENT_TIME, spec.watermark), (TimeDomain.PROCESSING_TIME, spec.processing_time)),
                     fired_groups)
    function.close()
    timings["timers"] = time.perf_counter() - t

    t = time.perf_counter()
    output = _to_table(outputs, spec.output_schema)
    output_file = storage.new_file(spec.checkpoint_id, f"output-{subtask_index}") + ".parquet"
    with storage.open_write(output_file) as f:
        pq.write_table(output, f)
    late_file = None
    if late.num_rows and spec.late_records == "output":
        late_file = storage.new_file(spec.checkpoint_id, f"late-{subtask_index}") + ".parquet"
        with storage.open_write(late_file) as f:
            pq.write_table(late, f)
    timer_report = timers.report()  # before the snapshot: it reads state
    raw_handle = None
    if type(function).snapshot_raw_keyed_state is not KeyedProcessFunction.snapshot_raw_keyed_state:
        raw_handle = write_raw_keyed_snapshot(
            storage, storage.new_file(spec.checkpoint_id, f"raw-keyed-{subtask_index}"), subtask=subtask_index,
            key_groups=own_range, write=function.snapshot_raw_keyed_state)
    handle = backend.snapshot(spec.checkpoint_id, storage).result()
    timings["snapshot"] = time.perf_counter() - t
    timers.keep(spec.checkpoint_id, handle)
    live = event_times[event_times != NO_WATERMARK]
    return {
        "subtask": subtask_index,
        "key_group_range": [own_range.start, own_range.end],
        "keyed_handle": handle.to_json() if handle is not None else None,
        "raw_keyed_handle": raw_handle.to_json() if raw_handle is not None else None,
        "output_file": output_file,
        "late_file": late_file,
        "records_in": records_in,
        "records_late": late.num_rows,
        "records_out": output.num_rows,
        "max_event_time": int(live.max()) if len(live) else None,
        "event_time_range": event_time_range,
        "timers": timer_report,
        "restored": restored,
        "snapshot_bytes": int(handle.size) if handle is not None else 0,
        "raw_keyed_bytes": int(raw_handle.size) if raw_handle is not None else 0,
        "state_entries": backend.estimated_entries(),
        "seconds": timings,
        RECORDS_REPORT: encode_counts(records_per_group),
        CALLS_REPORT: encode_counts(calls_per_group),
        TIMERS_REPORT: encode_counts(np.bincount(np.asarray(fired_groups, dtype=np.int64) - own_range.start,
                                                 minlength=len(own_range))),
    }


def _fire_timers(function: KeyedProcessFunction, backend: Any, queues: TimerQueues, context: ProcessContext,
                 outputs: list[Any], domains: Iterable[tuple[TimeDomain, int]], fired_groups: list[int]) -> None:
    """Fire each domain's timers due by its time, in timestamp order, after the batch's records (the keys of the
    due timers are prefetched together first: one read per batch, not per timer, on RocksDB); the key group of
    each timer fired goes to ``fired_groups`` (the load figures)."""
    def prefetch(keys: list[Any], groups: list[int]) -> None:
        backend.prefetch(keys, np.asarray(groups, dtype=np.int32))

    for domain, until in domains:
        context.time_domain = domain
        for timestamp, key in queues.of(domain).due(until, prefetch):
            context.current_key, context.current_key_group = key, backend.current_key_group
            fired_groups.append(context.current_key_group)
            context._timestamp = timestamp
            result = function.on_timer(timestamp, context)
            if result is not None:
                outputs.extend(result)
    context.time_domain = None
