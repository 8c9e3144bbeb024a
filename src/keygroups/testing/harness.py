"""The test harness for keyed functions: a job's batches in this process, driven by the test.

:class:`KeyedFunctionHarness` runs a :class:`~keygroups.runtime.KeyedProcessFunction` the way ``KeyedJob`` runs it
on Spark, minus Spark: every call that moves the job on (:meth:`~KeyedFunctionHarness.process`,
:meth:`~KeyedFunctionHarness.advance_watermark`, :meth:`~KeyedFunctionHarness.advance_processing_time`) is one
micro-batch through the driver protocol (``begin_batch``, then ``run_keyed_subtask`` for every subtask with the
records of its key groups, then ``commit_batch``) over a checkpoint location in a temporary directory the harness
owns. So the function meets the code it meets in a job: a fresh unpickled copy per batch, its records grouped by
key in key-group order, late records held back, timers fired after the records, state snapshotted, restored and
rescaled by the same backends; and a snapshot is a real savepoint that ``restore`` brings back at another
parallelism, max parallelism or backend.

Time belongs to the test: the processing time starts where the harness is told (0 by default) and moves only with
``advance_processing_time``; it is the batch's processing time a job's driver fixes (``BatchPlan.processing_time``),
so processing-time timers and processing-time TTL follow it. The watermark moves with ``advance_watermark`` and, with
a ``watermark_strategy``, with the event times of the records, as in a job.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from keygroups._hashing import KeyType, assign_to_key_group
from keygroups._parquet import read_parquet
from keygroups._ranges import KeyGroupRange, check_parallelism, operator_index_for_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.planning import check_restore_max_parallelism
from keygroups.errors import KeyGroupsError
from keygroups.metrics.recorder import batch_listener
from keygroups.runtime.assignment import Assignment, resolve_assignment
from keygroups.runtime.backends import create_backend, key_type_for_schema
from keygroups.runtime.batch import JobDriver, JobOptions
from keygroups.runtime.driver import check_key_columns, check_output_schema
from keygroups.runtime.functions import KeyedProcessFunction, RuntimeContext
from keygroups.runtime.local import LocalExecutor
from keygroups.runtime.properties import BatchProperties
from keygroups.runtime.report import BatchReport, SubtaskReport, TimerFigures
from keygroups.runtime.sink import Sink, check_sink
from keygroups.runtime.spec import check_warm_heap_backends
from keygroups.runtime.state_reader import StateNotFoundError, keyed_state_metas, read_timers
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.runtime.watermarks import WatermarkStrategy, check_late_records
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.namespaced import backing_descriptor
from keygroups.state.timers import NO_WATERMARK, TimeDomain, TimerQueueRegistry, check_timestamp
from keygroups.testing._ddl import arrow_schema
from keygroups.testing._pickling import pickle_in_process

#: What ``process`` takes: records as dicts, an Arrow table or record batch, or a pandas DataFrame.
Records = Any


@dataclass(frozen=True)
class Timer:
    """One registered timer: its key, time domain and timestamp (epoch ms)."""

    key: Any
    domain: TimeDomain
    timestamp: int


@dataclass(frozen=True)
class HarnessBatch:
    """What one batch of the harness did, as a ``KeyedJob`` batch reports it: the committed checkpoint's metadata,
    its :class:`~keygroups.runtime.report.BatchReport` (the one a ``KeyedJob`` batch returns as
    ``BatchResult.report``: records, late, watermark before and after, restore modes, bytes, timers, state, seconds
    per phase) and the subtasks' reports (how each restored its state, its bytes, timers and seconds)."""

    checkpoint_id: int
    parallelism: int
    metadata: CheckpointMetadata = field(repr=False)
    reports: list[SubtaskReport] = field(repr=False)
    #: Seconds the batch took, as ``BatchResult.seconds``.
    seconds: float = 0.0
    #: ``seconds`` by phase: ``plan`` (locating the restore point, planning, placing the records), ``subtasks``
    #: (every subtask, one after another), ``commit`` and ``output`` (reading back the output and late files).
    phases: dict[str, float] = field(default_factory=dict)
    report: BatchReport = field(default=None, repr=False)  # type: ignore[assignment]  # always set by the harness

    @property
    def watermark(self) -> int:
        """The watermark the batch ended with (``NO_WATERMARK`` before any event time)."""
        after = self.report.watermark_after
        return NO_WATERMARK if after is None else after

    @property
    def processing_time(self) -> int:
        """The batch's processing time (epoch ms)."""
        return BatchProperties.of(self.metadata).processing_time

    @property
    def records_in(self) -> int:
        return self.report.records_in

    @property
    def records_late(self) -> int:
        """Records at or before the watermark the batch started with: they never reached the function."""
        return self.report.records_late

    @property
    def records_out(self) -> int:
        return self.report.records_out

    @property
    def timers(self) -> dict[str, TimerFigures]:
        """Per time domain (``"event-time"``, ``"processing-time"``): timers registered and fired in this batch,
        registered after it, queued, and the earliest still registered."""
        figures: dict[str, list[TimerFigures]] = {}
        for r in self.reports:
            for domain, t in r.timers.items():
                figures.setdefault(domain.value, []).append(t)
        return {domain: TimerFigures.total(parts) for domain, parts in figures.items()}

    @property
    def restored_bytes(self) -> list[int]:
        """Per subtask, bytes of checkpoint files it read to restore its state."""
        return [r.restored.bytes_read for r in self.reports]

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of keyed state files this checkpoint wrote (only what changed: checkpoints are incremental)."""
        return sum(r.snapshot_bytes for r in self.reports)

    @property
    def restored_modes(self) -> list[str]:
        """Per subtask, how its state came: ``warm``, ``caught-up``, ``moved``, ``cold`` or ``new``."""
        return [r.restored.mode for r in self.reports]


@dataclass(frozen=True, eq=False)
class HarnessSnapshot:
    """A harness's state at one point: a savepoint (the job's full snapshot format) in a directory of its own, plus
    the harness's clocks. Restore it with :meth:`KeyedFunctionHarness.restore`; read it like any savepoint (it is
    savepoint ``name`` of checkpoint location ``location``: ``keygroups inspect``, the state reader). The
    directory is deleted when the snapshot object is garbage collected."""

    location: str
    name: str
    metadata: CheckpointMetadata = field(repr=False)
    processing_time: int
    input_schema: pa.Schema | None = field(repr=False)

    def __post_init__(self) -> None:
        weakref.finalize(self, shutil.rmtree, self.location, True)

    @property
    def path(self) -> str:
        """The savepoint's directory."""
        return os.path.join(self.location, "savepoints", self.name)

    @property
    def watermark(self) -> int:
        return BatchProperties.of(self.metadata).watermark

    @property
    def max_parallelism(self) -> int:
        return self.metadata.max_parallelism

    @property
    def parallelism(self) -> int:
        return self.metadata.parallelism


def _as_table(records: Records, schema: pa.Schema | None) -> pa.Table:
    """``records`` as one Arrow table, of ``schema`` when it is known (the first batch's otherwise)."""
    if isinstance(records, pa.RecordBatch):
        records = pa.Table.from_batches([records])
    elif not isinstance(records, pa.Table):
        if type(records).__module__.split(".")[0] == "pandas" and hasattr(records, "columns"):
            records = pa.Table.from_pandas(records, preserve_index=False)
        elif isinstance(records, Mapping) or isinstance(records, (str, bytes)) or not isinstance(records, Iterable):
            raise TypeError(f"process takes records as a list of dicts, an Arrow table or record batch, or a pandas "
                            f"DataFrame; got {type(records).__name__}")
        else:
            rows = list(records)
            bad = next((r for r in rows if not isinstance(r, Mapping)), None)
            if bad is not None:
                raise TypeError(f"process takes records as dicts (column -> value); got {bad!r}")
            if schema is None:
                if not rows:
                    raise KeyGroupsError("the harness does not know the input's columns yet: give input_schema= "
                                         "when creating it, or records to process first")
                return pa.Table.from_pylist(rows)
            unknown = sorted({str(k) for r in rows for k in r} - set(schema.names))
            if unknown:
                raise ValueError(f"records have columns {unknown} that the input schema {schema.names} lacks "
                                 "(every batch of a job has the same columns)")
            return pa.Table.from_pylist(rows, schema=schema)
    if schema is None or records.schema.equals(schema):
        return records
    missing = [n for n in schema.names if n not in records.column_names]
    extra = [n for n in records.column_names if n not in schema.names]
    if missing or extra:
        raise ValueError(f"records have columns {records.column_names}; the harness's input schema has "
                         f"{schema.names} (missing {missing}, unknown {extra})")
    return records.select(schema.names).cast(schema)


def _java_key(value: Any) -> Any:
    """A key as Java's ``equals`` compares it (floats by their bits, one NaN), to find a key among read rows."""
    if isinstance(value, float):
        return ("double", 0x7FF8000000000000 if math.isnan(value) else struct.unpack("<q", struct.pack("<d", value))[0])
    if isinstance(value, tuple):
        return tuple(_java_key(v) for v in value)
    return value


class _RecordingBackend:
    """A backend as a function's ``open`` sees it, noting every descriptor the function registers (and, for a
    namespaced state, its namespace serializer), so the harness reads a state as the function declared it."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.descriptors: dict[str, tuple[StateDescriptor, Any]] = {}

    def get_state(self, descriptor: StateDescriptor, *args: Any, **kwargs: Any) -> Any:
        namespaced = bool(args) or "namespace" in kwargs
        serializer = kwargs.get("namespace_serializer", args[1] if len(args) > 1 else None)
        if not namespaced or descriptor.name not in self.descriptors or serializer is not None:
            self.descriptors[descriptor.name] = (descriptor, serializer if namespaced else None)
        return self._backend.get_state(descriptor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class KeyedFunctionHarness:
    """Unit-test a keyed function without Spark: the job's own subtask code, batch by batch, with time and
    parallelism in the test's hands.

    The arguments are ``KeyedJob``'s (see there): ``function``, ``key_columns`` (a name or names), ``output_schema``
    (a pyarrow schema, a Spark DDL string such as ``"user string, total long"`` or a Spark ``StructType``),
    ``max_parallelism`` (128 here by default), ``backend`` (``"heap"`` or ``"rocksdb"``), ``order_by``,
    ``timestamp_column``, ``watermark_strategy``, ``late_records``, ``allow_pickle``, ``warm_heap_backends``; and
    ``parallelism``, which a job takes per batch and the harness keeps (change it with :meth:`snapshot` and
    :meth:`restore`); ``assignment`` (``"flink"``, ``"balanced"`` or an assignment object such as
    ``BalancedRanges(...)``) chooses each batch's key-group ranges as a job's does, from the load the earlier batches
    measured. ``sink`` (a :class:`~keygroups.sinks.Sink`) gets each batch's output in the subtasks and commits it
    with the checkpoint, as in a job (the harness's :meth:`output` still shows every record). ``input_schema`` fixes the input's columns (a schema as ``output_schema`` takes it; by default
    the first batch's, inferred from its records); ``processing_time`` is where the processing-time clock starts
    (epoch ms). ``name`` is the job's name in the checkpoints. ``directory`` is where the harness makes its own
    temporary directory (checkpoints, RocksDB's local state): by default ``/dev/shm`` where the host has one
    (memory: a checkpoint's fsyncs cost nothing), else the system temporary directory.

    Every :meth:`process` and ``advance_*`` call is one micro-batch and one checkpoint; it returns the batch's
    :class:`HarnessBatch`. Output and late records collect until :meth:`output` and :meth:`late` take them.

    Within a batch, records reach the function as a job hands them over: per subtask (in subtask order), by key group,
    then key, then ``order_by``; records equal in all of these keep the order given (Spark's shuffle does not: give
    ``order_by`` whenever order matters, in tests as in the job). The output comes in the same order, each subtask's
    timers after its records.

    Close the harness (or use it as a context manager) to delete its directory; the ``keygroups_harness`` pytest
    fixture does so after each test."""

    def __init__(self, function: KeyedProcessFunction, key_columns: Sequence[str] | str, *, output_schema: Any,
                 input_schema: Any = None, max_parallelism: int = 128, parallelism: int = 1,
                 backend: str = "heap", order_by: Sequence[str] = (), timestamp_column: str | None = None,
                 watermark_strategy: WatermarkStrategy | None = None, late_records: str = "drop",
                 processing_time: int = 0, allow_pickle: bool = False, warm_heap_backends: int = 4,
                 name: str = "harness", directory: str | os.PathLike[str] | None = None,
                 assignment: str | Assignment = "flink", sink: Sink | None = None) -> None:
        if not isinstance(function, KeyedProcessFunction):
            raise TypeError(f"function must be a KeyedProcessFunction instance, got {type(function).__name__}")
        self.key_columns = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
        if not self.key_columns or not all(isinstance(c, str) for c in self.key_columns):
            raise ValueError(f"key_columns must name one or more input columns, got {key_columns!r}")
        check_key_columns(self.key_columns)
        if isinstance(order_by, str):
            raise TypeError(f"order_by takes a sequence of column names, got the string {order_by!r}; write "
                            f"order_by=[{order_by!r}]")
        self.order_by = tuple(order_by)
        self.output_schema = check_output_schema(arrow_schema(output_schema))
        self.parallelism, self.max_parallelism = check_parallelism(parallelism, max_parallelism)
        if backend not in ("heap", "rocksdb"):
            raise ValueError(f"unknown state backend {backend!r}; allowed: 'heap', 'rocksdb'")
        self.backend = backend
        if watermark_strategy is not None and not isinstance(watermark_strategy, WatermarkStrategy):
            raise TypeError(f"watermark_strategy must be a keygroups.runtime.WatermarkStrategy, got "
                            f"{watermark_strategy!r}")
        if watermark_strategy is not None and timestamp_column is None:
            raise ValueError("a watermark_strategy needs the event-time column: give timestamp_column too")
        self.timestamp_column = timestamp_column
        self.watermark_strategy = watermark_strategy
        self.late_records = check_late_records(late_records)
        self.allow_pickle = allow_pickle
        self.warm_heap_backends = check_warm_heap_backends(warm_heap_backends)
        self.assignment = resolve_assignment(assignment)
        self.sink = check_sink(sink)
        self.name = name
        self.function = function
        self._pickled, self._referenced = pickle_in_process(function)
        self._input_schema = None if input_schema is None else arrow_schema(input_schema)
        if input_schema is not None:
            self._key_type()   # the key columns are checked now
        self._processing_time = check_timestamp(processing_time, "processing_time")
        self._root = tempfile.mkdtemp(prefix="keygroups-harness-", dir=_scratch_directory(directory))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        self.storage = CheckpointStorage(os.path.join(self._root, "checkpoints"), retain=1)
        self._local_dir = os.path.join(self._root, "local")
        self._heaps = HeapBackendRegistry()
        self._timer_queues = TimerQueueRegistry()
        self._restore_point: CheckpointMetadata | None = None   # the latest checkpoint, or the savepoint restored
        self._savepoint: str | None = None                       # restored before the first batch
        self._driver: JobDriver | None = None                    # made at the first batch
        self._output: list[pa.Table] = []
        self._late: list[pa.Table] = []
        #: Harnesses restored from this one and its descendants (closed with it by the pytest fixture).
        self._family: list[KeyedFunctionHarness] = [self]

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the harness's checkpoints and local state (snapshots taken stay until they are collected)."""
        self._heaps = HeapBackendRegistry()
        self._timer_queues = TimerQueueRegistry()
        self._cleanup()

    @property
    def closed(self) -> bool:
        return not self._cleanup.alive

    def __enter__(self) -> KeyedFunctionHarness:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise KeyGroupsError("this harness is closed; create a new one, or restore a snapshot")

    # ---- clocks -------------------------------------------------------------------------------------------------
    @property
    def watermark(self) -> int:
        """The current watermark (epoch ms; ``NO_WATERMARK`` before any event time)."""
        if self._restore_point is None:
            return NO_WATERMARK
        return BatchProperties.of(self._restore_point).watermark

    @property
    def processing_time(self) -> int:
        """The current processing time (epoch ms): every batch runs at it until ``advance_processing_time``."""
        return self._processing_time

    @property
    def input_schema(self) -> pa.Schema | None:
        """The input's schema: given, or the first batch's (None before it)."""
        return self._input_schema

    @property
    def checkpoint(self) -> CheckpointMetadata | None:
        """The latest checkpoint's metadata (a restored harness: the savepoint's until its first batch)."""
        return self._restore_point

    # ---- batches ------------------------------------------------------------------------------------------------
    def process(self, records: Records) -> HarnessBatch:
        """Run one micro-batch over ``records`` (a list of dicts, an Arrow table or record batch, or a pandas
        DataFrame, with the input's columns): records at or before the current watermark are late; the others go
        to the function; then, with a ``watermark_strategy``, the watermark moves on by the batch's largest event
        time and the event-time timers up to it fire, and the processing-time timers up to the current processing
        time fire. Returns the batch's report."""
        self._check_open()
        table = _as_table(records, self._input_schema)
        if self._input_schema is None:
            self._input_schema = table.schema
            self._key_type()
        return self._run(table, advance_to=None)

    def advance_watermark(self, timestamp: int) -> HarnessBatch:
        """Move the watermark to ``timestamp`` (epoch ms) in a batch without records: the event-time timers at or
        before it fire, and records at or before it are late from now on. ValueError if it would go back."""
        self._check_open()
        ts = check_timestamp(timestamp, "a watermark")
        if ts < self.watermark:
            raise ValueError(f"the watermark is {self.watermark} and cannot go back to {ts}")
        return self._run(None, advance_to=ts)

    def advance_processing_time(self, timestamp: int) -> HarnessBatch:
        """Move the processing time to ``timestamp`` (epoch ms) and run a batch without records: the
        processing-time timers at or before it fire, and processing-time TTL measures from it. ValueError if it
        would go back."""
        self._check_open()
        ts = check_timestamp(timestamp, "a processing time")
        if ts < self._processing_time:
            raise ValueError(f"the processing time is {self._processing_time} and cannot go back to {ts}")
        self._processing_time = ts
        return self._run(None, advance_to=None)

    def _key_type(self) -> KeyType:
        assert self._input_schema is not None
        return key_type_for_schema(self._input_schema, self.key_columns)

    def _job_driver(self) -> JobDriver:
        if self._driver is None:
            assert self._input_schema is not None
            # Late records are always written (the job's "output" mode): the harness shows them whatever the mode,
            # and the function sees the same records either way.
            options = JobOptions(
                name=self.name, key_columns=self.key_columns, function=self._pickled,
                output_schema=self.output_schema, max_parallelism=self.max_parallelism,
                backend="rocksdb" if self.backend == "rocksdb" else "heap",
                order_by=self.order_by, timestamp_column=self.timestamp_column,
                watermark_strategy=self.watermark_strategy, late_records="output", allow_pickle=self.allow_pickle,
                local_dir=self._local_dir, warm_heap_backends=self.warm_heap_backends, assignment=self.assignment,
                restore_from_savepoint=self._savepoint, sink=self.sink, checkpoint_output=True)
            self._driver = JobDriver(options, self.storage, fence=False, background_retention=False,
                                     on_commit=batch_listener(self, enabled_by_default=False))   # once asked
        return self._driver

    def _run(self, table: pa.Table | None, *, advance_to: int | None) -> HarnessBatch:
        """One batch through the job's spine (:class:`~keygroups.runtime.batch.JobDriver`) on a local executor; a
        batch that only moves time (``advance_to``: the watermark it moves to) has no records."""
        if self._input_schema is None:
            raise KeyGroupsError("the harness does not know the input's columns yet: give input_schema= when "
                                 "creating it, or process records before moving time on")
        started = time.perf_counter()
        driver = self._job_driver()
        if table is None:
            table = self._input_schema.empty_table()
        executor = LocalExecutor(table, warm=self._heaps, warm_timers=self._timer_queues)
        batch = driver.run(executor, parallelism=self.parallelism, processing_time=self._processing_time,
                           watermark=advance_to)
        ran = time.perf_counter()
        metadata = batch.metadata
        self._restore_point, self._savepoint = metadata, None
        self._output.extend(self._read(metadata.outputs, self.output_schema))
        self._late.extend(self._read(metadata.late_outputs, self._input_schema))
        done = time.perf_counter()
        seconds = batch.report.seconds
        plan = seconds.read + seconds.plan
        phases = {"plan": plan, "subtasks": ran - started - plan - seconds.commit, "commit": seconds.commit,
                  "output": done - ran}
        return HarnessBatch(metadata.checkpoint_id, metadata.parallelism, metadata, list(batch.reports),
                            done - started, phases, batch.report)

    def _read(self, files: Sequence[str], schema: pa.Schema) -> list[pa.Table]:
        tables = []
        for f in files:
            table = read_parquet(self.storage.open_buffer(f))   # a copy Arrow owns: see keygroups._parquet
            if table.num_rows:
                tables.append(table if table.schema.equals(schema) else table.cast(schema))
        return tables

    # ---- what came out ------------------------------------------------------------------------------------------
    def output_table(self) -> pa.Table:
        """What the function emitted since the last ``output``/``output_table`` call, in order, as an Arrow table of
        the output schema (then forgotten)."""
        tables, self._output = self._output, []
        if not tables:
            return self.output_schema.empty_table()
        return pa.concat_tables(tables)

    def output(self) -> list[dict[str, Any]]:
        """What the function emitted since the last ``output``/``output_table`` call, in order, one dict per
        record (then forgotten)."""
        rows: list[dict[str, Any]] = self.output_table().to_pylist()
        return rows

    def late(self) -> list[dict[str, Any]]:
        """The records that came at or before the watermark since the last call (they never reached the function;
        a job drops them or writes them to its late output, per ``late_records``), in order (then forgotten)."""
        tables, self._late = self._late, []
        return [row for t in tables for row in t.to_pylist()]

    # ---- state and timers ---------------------------------------------------------------------------------------
    def _key_group(self, key: Any) -> int:
        return assign_to_key_group(key, self.max_parallelism, self._key_type())

    def state(self, key: Any, name: str) -> Any:
        """State ``name`` of ``key`` as the function would read it now, at the current watermark and processing
        time (TTL respected: an expired entry reads as absent): a value state's value (None when unset), a list
        state's list, a map state's dict, a reducing or aggregating state's result; a namespaced state (e.g. per
        window) as a dict namespace -> what it holds there. A key of several key columns is a tuple.

        The state comes from the latest checkpoint through a backend restored for the key's key group alone, and
        the function's own ``open`` declares it (so its serializers, defaults and TTL apply). StateNotFoundError
        naming the states there are if the function declares no state ``name`` in ``open``."""
        self._check_open()
        if self._input_schema is None:
            raise KeyGroupsError("nothing was processed yet: the harness has no state")
        group = self._key_group(key)
        own = KeyGroupRange(group, group)
        owner = operator_index_for_key_group(self.max_parallelism, self.parallelism, group)
        with create_backend("heap", own, self.max_parallelism, self._key_type(), subtask_index=owner,
                            allow_pickle=self.allow_pickle) as backend:
            if self._restore_point is not None:
                backend.restore(self.storage, self._restore_point)
            backend.watermark = self.watermark
            backend.processing_time = self._processing_time
            recording = _RecordingBackend(backend)
            function = _load(self._pickled)
            function.open(RuntimeContext(recording, job_name=self.name, subtask_index=owner,
                                         parallelism=self.parallelism, max_parallelism=self.max_parallelism,
                                         checkpoint_id=self._restore_point.checkpoint_id
                                         if self._restore_point is not None else 0))
            if name not in recording.descriptors:
                stored = sorted(keyed_state_metas(self._restore_point)) if self._restore_point is not None else []
                raise StateNotFoundError(
                    f"{type(function).__name__}.open() declares no state {name!r}; it declares "
                    f"{sorted(recording.descriptors) or 'none'} (the checkpoint holds "
                    f"{[s for s in stored if not s.startswith('_timers/')] or 'none'})")
            descriptor, namespace_serializer = recording.descriptors[name]
            backend.set_current_key(key)
            if namespace_serializer is not None:
                backing = backend.get_state(backing_descriptor(descriptor, namespace_serializer))
                if descriptor.kind != "map":
                    return dict(backing.items())
                nested: dict[Any, dict[Any, Any]] = {}
                for (namespace, user_key), value in backing.items():
                    nested.setdefault(namespace, {})[user_key] = value
                return nested
            state = backend.get_state(descriptor)
            if descriptor.kind == "value":
                return state.value()
            if descriptor.kind == "map":
                return dict(state.items())
            return state.get()

    def timers(self, key: Any = None) -> list[Timer]:
        """The registered timers (of ``key`` only, when given), earliest first (then event time before processing
        time, then by key): read from the latest checkpoint as the state reader (and Spark's
        ``readRegisteredTimers``) reads them."""
        self._check_open()
        if self._restore_point is None:
            return []
        own = None
        if key is not None:   # the key's group where it is stored (a restored harness: at the savepoint's max p.)
            group = assign_to_key_group(key, self._restore_point.max_parallelism, self._key_type())
            own = KeyGroupRange(group, group)
        rows = read_timers(self.storage, self._restore_point, own, key_columns=list(self.key_columns)).to_pylist()
        wanted = _java_key(key) if key is not None else None
        timers = []
        for row in rows:
            k = row[self.key_columns[0]] if len(self.key_columns) == 1 else tuple(row[c] for c in self.key_columns)
            if key is None or _java_key(k) == wanted:
                timers.append(Timer(k, TimeDomain(row["domain"]), row["timestamp"]))
        order = {TimeDomain.EVENT_TIME: 0, TimeDomain.PROCESSING_TIME: 1}
        return sorted(timers, key=lambda t: (t.timestamp, order[t.domain], _java_key(t.key)))

    # ---- snapshot and restore -----------------------------------------------------------------------------------
    def snapshot(self) -> HarnessSnapshot:
        """The state now, as a savepoint of the latest checkpoint (a self-contained full snapshot in the job's
        format, restorable at any parallelism, by either backend), in a directory of its own, with the clocks."""
        self._check_open()
        if self._restore_point is None:
            raise KeyGroupsError("nothing to snapshot yet: no batch has run (process records first)")
        name = f"snapshot-{self._restore_point.checkpoint_id}-{uuid.uuid4().hex[:8]}"
        if self._savepoint is not None:   # restored, no batch since: the savepoint is the state
            source = os.path.join(self.storage.location, "savepoints", self._savepoint)
        else:
            source = self.storage.savepoint(self._restore_point, name)
        location = tempfile.mkdtemp(prefix="keygroups-snapshot-", dir=os.path.dirname(self._root))
        target = os.path.join(location, "savepoints", name)
        if self._savepoint is not None:
            shutil.copytree(source, target, copy_function=_link_or_copy)
        else:
            os.makedirs(os.path.dirname(target))
            shutil.move(source, target)
        metadata = CheckpointStorage(location).load_savepoint(name)
        return HarnessSnapshot(location, name, metadata, self._processing_time, self._input_schema)

    def restore(self, snapshot: HarnessSnapshot, *, parallelism: int | None = None,
                max_parallelism: int | None = None, backend: str | None = None,
                function: KeyedProcessFunction | None = None) -> KeyedFunctionHarness:
        """A new harness that continues from ``snapshot`` as a job restarted from a savepoint would: at
        ``parallelism``, ``max_parallelism`` (the snapshot's times or divided by an integer factor; others are
        refused with StateMigrationError) and ``backend``, with ``function`` (e.g. a new version of it; this
        harness's by default), everything else as this harness. Its clocks continue from the snapshot's; its first
        batch restores the savepoint (each subtask reading only its key groups)."""
        if not isinstance(snapshot, HarnessSnapshot):
            raise TypeError(f"restore takes a HarnessSnapshot (from snapshot()), got {type(snapshot).__name__}")
        mp = snapshot.max_parallelism if max_parallelism is None else max_parallelism
        check_restore_max_parallelism(snapshot.metadata, mp)
        restored = KeyedFunctionHarness(
            self.function if function is None else function, self.key_columns, output_schema=self.output_schema,
            input_schema=snapshot.input_schema or self._input_schema, max_parallelism=mp,
            parallelism=self.parallelism if parallelism is None else parallelism,
            backend=self.backend if backend is None else backend, order_by=self.order_by,
            timestamp_column=self.timestamp_column, watermark_strategy=self.watermark_strategy,
            late_records=self.late_records, processing_time=snapshot.processing_time,
            allow_pickle=self.allow_pickle, warm_heap_backends=self.warm_heap_backends, name=self.name,
            assignment=self.assignment, sink=self.sink)
        target = os.path.join(restored.storage.location, "savepoints", snapshot.name)
        shutil.copytree(snapshot.path, target, copy_function=_link_or_copy)
        restored._savepoint = snapshot.name
        restored._restore_point = restored.storage.load_savepoint(snapshot.name)
        restored._family = self._family
        self._family.append(restored)
        return restored


#: Memory-backed file systems, where the fsync of every file a checkpoint writes costs nothing (a harness keeps
#: nothing past its test, so durability buys it nothing).
_MEMORY_DIRECTORIES = ("/dev/shm",)


def _scratch_directory(directory: str | os.PathLike[str] | None) -> str | None:
    """Where a harness makes its directory: ``directory`` if given, else a memory-backed file system if the host
    has a writable one, else the system temporary directory (None)."""
    if directory is not None:
        return os.fspath(directory)
    for candidate in _MEMORY_DIRECTORIES:
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return None


def _link_or_copy(src: str, dst: str) -> None:
    """Savepoint files never change once written: a hard link is a copy that costs nothing."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _load(pickled: bytes) -> KeyedProcessFunction:
    import pickle

    function = pickle.loads(pickled)   # our own bytes, pickled in this process from the harness's function
    assert isinstance(function, KeyedProcessFunction)
    return function


__all__ = ["KeyedFunctionHarness", "HarnessBatch", "HarnessSnapshot", "Timer"]
