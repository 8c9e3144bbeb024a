"""A savepoint built from rows, without a job (Flink's State Processor API bootstrap), Spark-free: what
``keygroups.spark.write_savepoint`` runs in its tasks and on its driver.

1. driver, :func:`plan_savepoint`: from the input's Arrow schema, the key columns and one :class:`StateColumn` per
   state, the state metas a backend would write (key serializer as a ``KeyedJob`` keys those columns, value
   serializers named or inferred from the column types, TTL); checks everything a task would otherwise fail on, and
   starts the savepoint's directory. The :class:`SavepointPlan` goes to every task.
2. task *i*, :func:`write_savepoint_subtask`: gets the rows of subtask *i*'s key groups (placed by key group, as a
   job places its input), encodes them per key group and state (a null value: the key has no entry in that state)
   and writes one full keyed snapshot file with the checkpoint layer's full snapshot writer.
3. driver, :func:`commit_savepoint`: the savepoint's ``_metadata`` from the tasks' handles, written last.

A job started with ``KeyedJob(..., restore_from_savepoint=name)`` restores it at any parallelism, as it restores a
savepoint of its own. Values of opaque serializers (pickle, ``ValueSerializer``, custom ones; see
:mod:`keygroups.runtime.state_types`) are given as their serialized bytes, as the reader shows them: a savepoint
read, transformed and written again keeps them byte for byte.
"""

from __future__ import annotations

import datetime
import itertools
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keygroups._hashing import KeyType, assign_key_groups, assign_key_groups_for_tuples
from keygroups._native import bulkframe
from keygroups._ranges import KeyGroupRange, check_parallelism, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, KeyedStateHandle
from keygroups.checkpoint.format import Packed, write_full_snapshot
from keygroups.errors import KeyGroupsError
from keygroups.runtime.state_reader import KEY_COLUMNS_PROPERTY
from keygroups.runtime.state_types import is_typed, python_values, serializer_for_arrow
from keygroups.runtime.backends import key_serializer_for, key_type_for_schema
from keygroups.serializers import BytesSerializer, SerializerSnapshot, TypeSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
    state_meta,
)
from keygroups.state._codec import ValueFraming

KINDS = ("value", "list", "map", "reducing", "aggregating")


class DuplicateKeyError(KeyGroupsError, ValueError):
    """Two input rows have one key: a savepoint holds one value (list, map) per key and state."""


@dataclass(frozen=True)
class StateColumn:
    """How one state of the savepoint comes from the input: its values are column ``column``.

    ``kind``: ``"value"``, ``"list"``, ``"map"``, ``"reducing"`` or ``"aggregating"``; by default ``"list"`` for an
    array column, ``"map"`` for a map column, else ``"value"``. ``serializer``: of the value (list element, map
    value), by default the typed serializer of the column's type (an int64 column: ``Int64Serializer``, a struct:
    a ``TupleSerializer``, ...); an opaque one (``PickleSerializer``, ``ValueSerializer``, a custom one) takes a
    binary column of serialized values. ``key_serializer``: of a map's keys, likewise. Name the serializers the job
    declares whenever the inferred ones could differ (a job's ``Int32Serializer`` for an int64 column, say).

    ``ttl``: the state's TTL config (the job must declare TTL too); each entry's timestamp comes from
    ``ttl_column`` (a timestamp column, or milliseconds as a long column; for a list an array of them, one per
    element, for a map a map from its keys, or one value for all) or, by default, the time of writing."""

    column: str
    kind: str | None = None
    serializer: TypeSerializer | None = None
    key_serializer: TypeSerializer | None = None
    ttl: StateTtlConfig | None = None
    ttl_column: str | None = None


@dataclass(frozen=True)
class _PlannedState:
    name: str
    column: str
    kind: str
    meta: dict[str, Any]
    #: Serializers the values are encoded with, by role: the state's own, or BytesSerializer for an opaque one
    #: (its values come serialized and are written as they are).
    encoders: dict[str, TypeSerializer]
    ttl: bool
    ttl_column: str | None


@dataclass(frozen=True)
class SavepointPlan:
    """Everything a writer task needs (small, picklable): where, the key, the states' metas and encoders."""

    location: str
    storage_options: dict[str, Any] | None
    name: str
    key_columns: tuple[str, ...]
    key_type: KeyType
    max_parallelism: int
    parallelism: int
    states: tuple[_PlannedState, ...]
    written_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.location, storage_options=self.storage_options)

    @property
    def directory(self) -> str:
        return f"savepoints/{self.name}"


def _descriptor(name: str, kind: str, serializers: dict[str, TypeSerializer]) -> StateDescriptor:
    if kind == "list":
        return ListStateDescriptor(name, serializers["element"])
    if kind == "map":
        return MapStateDescriptor(name, serializers["map key"], serializers["map value"])
    if kind == "reducing":   # the function is the job's: a savepoint stores values only
        return ReducingStateDescriptor(name, _no_function, serializers["value"])
    if kind == "aggregating":
        return AggregatingStateDescriptor(name, _NoAggregate(), serializers["value"])
    return ValueStateDescriptor(name, serializers["value"])


def _no_function(a: Any, b: Any) -> Any:
    raise NotImplementedError("a savepoint writer never reduces")


class _NoAggregate(AggregateFunction):
    """A savepoint writer stores accumulators; it never aggregates (the function is the job's)."""

    def create_accumulator(self) -> Any:
        raise NotImplementedError("a savepoint writer never aggregates")

    add = get_result = merge = create_accumulator   # type: ignore[assignment]


def _plan_state(name: Any, spec: Any, schema: pa.Schema, key_serializer: TypeSerializer) -> _PlannedState:
    if isinstance(spec, str):
        spec = StateColumn(spec)
    if not isinstance(name, str) or not name:
        raise ValueError(f"state names must be non-empty strings, got {name!r}")
    if not isinstance(spec, StateColumn):
        raise TypeError(f"state {name!r}: give a column name or a StateColumn, got {spec!r}")
    if spec.column not in schema.names:
        raise ValueError(f"state {name!r}: column {spec.column!r} is not in the input; its columns: {schema.names}")
    arrow = schema.field(spec.column).type
    what = f"state {name!r} (column {spec.column!r})"
    kind = spec.kind or ("list" if pa.types.is_list(arrow) or pa.types.is_large_list(arrow)
                         else "map" if pa.types.is_map(arrow) else "value")
    if kind not in KINDS:
        raise ValueError(f"{what}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "list" and not (pa.types.is_list(arrow) or pa.types.is_large_list(arrow)):
        raise TypeError(f"{what}: a list state takes an array column, got {arrow}")
    if kind == "map" and not pa.types.is_map(arrow):
        raise TypeError(f"{what}: a map state takes a map column, got {arrow}")
    if kind == "list":
        sers = {"element": spec.serializer or serializer_for_arrow(arrow.value_type, f"{what} element")}
    elif kind == "map":
        sers = {"map key": spec.key_serializer or serializer_for_arrow(arrow.key_type, f"{what} key"),
                "map value": spec.serializer or serializer_for_arrow(arrow.item_type, f"{what} value")}
    else:
        if spec.key_serializer is not None:
            raise ValueError(f"{what}: key_serializer is for map states (the keys of each map), not {kind} states")
        sers = {"value": spec.serializer or serializer_for_arrow(arrow, what)}
    encoders: dict[str, TypeSerializer] = {}
    for role, ser in sers.items():
        if not isinstance(ser, TypeSerializer):
            raise TypeError(f"{what}: the {role} serializer must be a keygroups.serializers.TypeSerializer, got "
                            f"{ser!r}")
        opaque = not is_typed(ser.snapshot())
        part = {"element": arrow.value_type if kind == "list" else None,
                "map key": arrow.key_type if kind == "map" else None,
                "map value": arrow.item_type if kind == "map" else None}.get(role, arrow)
        if opaque and not (pa.types.is_binary(part) or pa.types.is_large_binary(part)):
            raise TypeError(f"{what}: {ser!r} is not a typed serializer, so its {role}s are given as their "
                            f"serialized bytes, a binary column (as the keygroups reader shows them); got {part}")
        encoders[role] = BytesSerializer() if opaque else ser
    descriptor = _descriptor(name, kind, sers)
    if spec.ttl is not None:
        descriptor.enable_time_to_live(spec.ttl)
    if spec.ttl_column is not None:
        if descriptor.ttl_config is None:
            raise ValueError(f"{what}: ttl_column {spec.ttl_column!r} is given but the state has no TTL: give ttl too")
        if spec.ttl_column not in schema.names:
            raise ValueError(f"{what}: ttl_column {spec.ttl_column!r} is not in the input; its columns: "
                             f"{schema.names}")
    return _PlannedState(name, spec.column, kind, state_meta(descriptor, key_serializer), encoders,
                         descriptor.ttl_config is not None, spec.ttl_column)


def plan_savepoint(schema: pa.Schema, location: str, name: str, *, key_columns: Sequence[str] | str,
                   states: Mapping[str, str | StateColumn], max_parallelism: int, parallelism: int,
                   storage_options: dict[str, Any] | None = None) -> SavepointPlan:
    """Check the request against the input's Arrow ``schema`` and start savepoint ``name`` in ``location``
    (ValueError if it exists; leftovers of an interrupted one are removed). ``states``: state name -> its column
    name, or a :class:`StateColumn`."""
    keys = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
    if not keys:
        raise ValueError("key_columns must name at least one column")
    if not isinstance(states, Mapping) or not states:
        raise ValueError("states must map at least one state name to its column (or a StateColumn)")
    p, mp = check_parallelism(parallelism, max_parallelism)
    key_type = key_type_for_schema(schema, keys)
    key_serializer = key_serializer_for(key_type)
    planned = tuple(_plan_state(n, s, schema, key_serializer) for n, s in states.items())
    storage = CheckpointStorage(location, storage_options=storage_options)
    storage.begin_savepoint(name)
    return SavepointPlan(storage.location, storage_options, name, keys, key_type, mp, p, planned)


# ---- one task ------------------------------------------------------------------------------------------------------


def _key_groups(table: pa.Table, plan: SavepointPlan) -> np.ndarray:
    columns = [table.column(c) for c in plan.key_columns]
    if len(columns) == 1:
        return np.asarray(assign_key_groups(columns[0], plan.max_parallelism, plan.key_type))  # type: ignore[arg-type]
    return np.asarray(assign_key_groups_for_tuples(columns, plan.max_parallelism, plan.key_type))


def _ms(v: Any, what: str) -> int:
    if isinstance(v, datetime.datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=datetime.timezone.utc)
        return int(v.timestamp() * 1000)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise TypeError(f"{what}: a TTL timestamp must be a timestamp or milliseconds (long), got {v!r}")


def _with_timestamps(kind: str, value: Any, stamps: Any, default_ms: int, what: str) -> Any:
    """``value`` in the in-memory TTL form (see ``keygroups.state._codec``): each part paired with its timestamp."""
    if kind == "list":
        if isinstance(stamps, list):
            if len(stamps) != len(value):
                raise ValueError(f"{what}: {len(value)} elements but {len(stamps)} TTL timestamps")
            return [(e, _ms(t, what) if t is not None else default_ms) for e, t in zip(value, stamps)]
        ts = default_ms if stamps is None else _ms(stamps, what)
        return [(e, ts) for e in value]
    if kind == "map":
        if isinstance(stamps, (list, dict)):
            by_key = dict(stamps)
            return {k: (x, _ms(by_key[k], what) if by_key.get(k) is not None else default_ms)
                    for k, x in value.items()}
        ts = default_ms if stamps is None else _ms(stamps, what)
        return {k: (x, ts) for k, x in value.items()}
    return (value, default_ms if stamps is None else _ms(stamps, what))


class _Encoder:
    """One state's rows -> its stored value bytes (the state framing over the encoders)."""

    def __init__(self, state: _PlannedState, default_ms: int) -> None:
        self.state = state
        self.framing = ValueFraming.for_state(state.name, state.kind, state.encoders, ttl=state.ttl)
        self.default_ms = default_ms
        self.what = f"state {state.name!r} (column {state.column!r})"
        # the snapshot of the column's values as a whole: a list state's column is a list of its elements, a map
        # state's a map (a typed list / map serializer of the element / key and value serializers)
        sers = state.meta["serializers"]
        if state.kind == "list":
            self.snapshot = SerializerSnapshot("list", 1, {}, (SerializerSnapshot.from_json(sers["element"]),))
        elif state.kind == "map":
            self.snapshot = SerializerSnapshot("map", 1, {}, (SerializerSnapshot.from_json(sers["map key"]),
                                                              SerializerSnapshot.from_json(sers["map value"])))
        else:
            self.snapshot = SerializerSnapshot.from_json(sers["value"])

    def values(self, column: pa.ChunkedArray) -> list[Any]:
        """The column's values as the framing encodes them (None for a null)."""
        try:
            values = python_values(column, self.snapshot)
        except TypeError as e:
            raise TypeError(f"{self.what}: {e}") from None
        if self.state.kind == "map":   # opaque keys or values come as pairs
            return [v if v is None or isinstance(v, dict) else dict(v) for v in values]
        return values

    def encode(self, values: list[Any], stamps: list[Any] | None) -> list[bytes]:
        out = []
        try:
            for i, v in enumerate(values):
                if self.state.ttl:
                    v = _with_timestamps(self.state.kind, v, stamps[i] if stamps is not None else None,
                                         self.default_ms, self.what)
                out.append(self.framing.encode(v))
        except (TypeError, ValueError, OverflowError) as e:
            raise type(e)(f"{self.what}: {e}") from None
        return out


#: Rows a writer task encodes at once (a chunk of whole key groups; a key group larger than this is one chunk on
#: its own). About 180 B of memory per row while encoded (two int64 states), so about 50 MB.
CHUNK_ROWS = 1 << 18

#: Rows gathered from the input, ordered by key group and spilled as one sorted run, once a task's input is larger
#: than one chunk.
RUN_ROWS = 1 << 16


def write_savepoint_subtask(plan: SavepointPlan, subtask: int, batches: Iterable[pa.RecordBatch], *,
                            chunk_rows: int = CHUNK_ROWS, spill_dir: str | None = None) -> KeyedStateHandle | None:
    """Write subtask ``subtask``'s keyed file of the savepoint from its rows (``batches``: those of its key groups
    only, in any order); None if it has no row. DuplicateKeyError if a key comes twice; KeyGroupsError if a row's
    key group belongs to another subtask (the rows were not placed by key group).

    Streaming, with memory bounded whatever the number of keys: an input of at most ``chunk_rows`` rows is encoded
    at once; a larger one is spilled as it arrives, in runs of ``RUN_ROWS`` rows each ordered by key group, to an
    Arrow IPC file in ``spill_dir`` (the temporary directory by default; removed at the end), then encoded chunk by
    chunk: the key groups in order, as many whole key groups per chunk as fit ``chunk_rows`` (a larger key group on
    its own), each chunk gathered from the runs' slices of its key groups (memory-mapped: only the chunk is copied).
    Peak memory is so about max(``chunk_rows``, the rows of the largest key group) encoded rows (~180 B each for two
    int64 states), plus one run being sorted; the file's bytes are the same however the input is cut. Every row's
    key group is checked before anything is written; a duplicate key or a value a serializer refuses in a later
    chunk raises after earlier chunks were written to the file (no ``_metadata`` names it, so it never counts).

    Each chunk in bulk, never row by row in Python: its rows ordered by key group, the keys serialized in one
    ``serialize_many`` call, and each state's values likewise (a list's elements, a map's keys and values: one
    call per role), framed with their TTL timestamps in compiled code; the writer takes every key group's keys and
    values as slices of those buffers (``Packed``). What only the value-by-value path reads (see ``_framed``: a
    null inside a list or map, a map repeating a key, TTL timestamps per map key) is encoded value by value."""
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    groups = key_group_range(plan.max_parallelism, plan.parallelism, subtask)
    with _SortedRuns(plan, subtask, groups, chunk_rows, spill_dir) as runs:
        for batch in batches:
            runs.add(batch)
        if not runs.rows:
            return None
        key_serializer = key_serializer_for(plan.key_type)
        encoders = [_Encoder(s, plan.written_ms) for s in plan.states]

        def key_groups() -> Iterator[tuple[int, list[tuple[int, Any, Any]]]]:
            for table, kgs in runs.chunks():
                yield from _encoded_key_groups(plan, key_serializer, encoders, table, kgs)

        encoded = key_groups()
        first = next(encoded, None)   # a one-chunk input raises every error before the file is opened
        storage = plan.storage
        relpath = f"{plan.directory}/keyed-{subtask}-{uuid.uuid4().hex}"
        metas = [s.meta for s in plan.states]
        return write_full_snapshot(storage, relpath, 0, subtask, groups, metas,
                                   itertools.chain(() if first is None else (first,), encoded))


class _SortedRuns:
    """A subtask's input, taken batch by batch: kept in memory while it fits one chunk, else spilled to an Arrow
    IPC file as runs ordered by key group (a run's key groups in a column of their own); :meth:`chunks` gives it
    back as (rows, their key groups) of whole key groups, ascending, each at most ``chunk_rows`` rows unless one
    key group is larger. Within a key group the rows keep the input's order, as one stable sort of all would."""

    def __init__(self, plan: SavepointPlan, subtask: int, groups: KeyGroupRange, chunk_rows: int,
                 spill_dir: str | None) -> None:
        self.plan = plan
        self.subtask = subtask
        self.groups = groups
        self.chunk_rows = chunk_rows
        self.spill_dir = spill_dir
        self.columns = list(dict.fromkeys([*plan.key_columns, *(s.column for s in plan.states),
                                           *(s.ttl_column for s in plan.states if s.ttl_column is not None)]))
        self.kg_column = "__key_group"
        while self.kg_column in self.columns:
            self.kg_column += "_"
        self.rows = 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.counts = np.zeros(len(groups), dtype=np.int64)   # rows per key group
        self.directory: tempfile.TemporaryDirectory[str] | None = None
        self.writer: pa.ipc.RecordBatchFileWriter | None = None
        self.path = ""

    def __enter__(self) -> _SortedRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.directory is not None:
                self.directory.cleanup()

    def add(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        self.pending.append(batch.select(self.columns))
        self.pending_rows += batch.num_rows
        self.rows += batch.num_rows
        if self.writer is None and self.rows > self.chunk_rows:
            self.directory = tempfile.TemporaryDirectory(prefix="keygroups-savepoint-", dir=self.spill_dir)
            self.path = os.path.join(self.directory.name, f"runs-{self.subtask}.arrow")
            schema = self.pending[0].schema.append(pa.field(self.kg_column, pa.int32()))
            self.writer = pa.ipc.new_file(self.path, schema)
            self._spill()   # the first chunk's rows, as one run
        elif self.writer is not None and self.pending_rows >= RUN_ROWS:
            self._spill()

    def _checked(self, table: pa.Table) -> np.ndarray:
        kgs = _key_groups(table, self.plan)
        outside = (kgs < self.groups.start) | (kgs > self.groups.end)
        if outside.any():
            raise KeyGroupsError(f"savepoint subtask {self.subtask} owns key groups {self.groups} but got a row of "
                                 f"key group {int(kgs[outside][0])}: place the rows with partition_by_key_group "
                                 f"first")
        return kgs

    def _spill(self) -> None:
        assert self.writer is not None
        table = pa.Table.from_batches(self.pending)
        self.pending, self.pending_rows = [], 0
        kgs = self._checked(table)
        self.counts += np.bincount(kgs - self.groups.start, minlength=len(self.groups))
        order = np.argsort(kgs, kind="stable")
        run = table.take(pa.array(order)).append_column(self.kg_column, pa.array(kgs[order], pa.int32()))
        for batch in run.combine_chunks().to_batches():
            self.writer.write_batch(batch)

    def chunks(self) -> Iterator[tuple[pa.Table, np.ndarray]]:
        if self.writer is None:   # it fits one chunk: as it came
            table = pa.Table.from_batches(self.pending)
            self.pending = []
            yield table, self._checked(table)
            return
        if self.pending:
            self._spill()
        self.writer.close()
        self.writer = None
        with pa.memory_map(self.path) as source:
            reader = pa.ipc.open_file(source)
            runs = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            run_kgs = [r.column(self.kg_column).to_numpy() for r in runs]
            runs = [r.select(self.columns) for r in runs]
            start = self.groups.start
            first = 0
            while first < len(self.counts):
                last, rows = first, int(self.counts[first])   # whole key groups up to chunk_rows (one at least)
                while last + 1 < len(self.counts) and rows + int(self.counts[last + 1]) <= self.chunk_rows:
                    last += 1
                    rows += int(self.counts[last])
                if rows:
                    parts, part_kgs = [], []
                    for run, kgs in zip(runs, run_kgs):
                        a, b = np.searchsorted(kgs, [start + first, start + last + 1]).tolist()
                        if b > a:
                            parts.append(run.slice(a, b - a))
                            part_kgs.append(kgs[a:b])
                    yield pa.Table.from_batches(parts), np.concatenate(part_kgs).astype(np.int64)
                first = last + 1


def _encoded_key_groups(plan: SavepointPlan, key_serializer: TypeSerializer, encoders: list[_Encoder],
                        table: pa.Table, kgs: np.ndarray) -> Iterator[tuple[int, list[tuple[int, Any, Any]]]]:
    """The key groups of ``table`` (rows of whole key groups, ``kgs`` theirs), ascending, as the snapshot writer
    takes them: ``(key group, [(state index, keys, values), ...])``."""
    order = np.argsort(kgs, kind="stable")
    table = table.take(pa.array(order))
    kgs = kgs[order]
    bounds = np.flatnonzero(np.diff(kgs)) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    stops = np.concatenate([bounds, [len(kgs)]]).astype(np.int64)
    key_parts = [_column_values(table.column(c)) for c in plan.key_columns]
    keys = key_parts[0] if len(key_parts) == 1 else list(zip(*key_parts))
    key_data, key_offsets = key_serializer.serialize_many(keys)
    key_offsets = np.asarray(key_offsets, dtype=np.int64)
    _check_unique(keys, memoryview(key_data), key_offsets, kgs)
    columns = [_state_column(enc, table, key_data, key_offsets) for enc in encoders]
    del keys, key_parts

    def packed(data: Any, offsets: np.ndarray, a: int, b: int) -> Packed:
        return Packed(data[int(offsets[a]):int(offsets[b])], offsets[a:b + 1] - offsets[a])

    key_view = memoryview(key_data)
    for a, b in zip(starts.tolist(), stops.tolist()):
        sections: list[tuple[int, Any, Any]] = []
        for index, column in enumerate(columns):
            if column.bulk is not None:   # the values serialized and framed at once
                data, offsets = column.bulk
                if column.rows is None:   # every row has a value
                    sections.append((index, packed(key_view, key_offsets, a, b), packed(data, offsets, a, b)))
                    continue
                p, q = np.searchsorted(column.rows, [a, b]).tolist()
                if q > p:
                    assert column.keys is not None
                    sections.append((index, packed(*column.keys, p, q), packed(data, offsets, p, q)))
                continue
            rows = (np.flatnonzero(column.present[a:b]) + a).tolist()
            if rows:
                encoded = column.encoder.encode([column.values[i] for i in rows],
                                                [column.stamps[i] for i in rows] if column.stamps else None)
                sections.append((index, [bytes(key_view[key_offsets[i]:key_offsets[i + 1]]) for i in rows],
                                 encoded))
        if sections:
            yield int(kgs[a]), sections


def _column_values(column: pa.ChunkedArray) -> list[Any]:
    """A key column's values as Python objects, through numpy for fixed-width numbers (several times faster than
    ``to_pylist``)."""
    if column.null_count == 0 and (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return column.to_numpy().tolist()
    return column.to_pylist()


@dataclass
class _StateColumn:
    """One state's input column, as the writer takes it: ``bulk``, the values of the rows that have one serialized
    and framed at once (buffer, offsets), the rows being ``rows`` (ascending row indexes; None: every row) with
    their keys ``keys`` (buffer, offsets); or else the values one by one (``values``, ``present``, TTL
    ``stamps``)."""

    encoder: _Encoder
    bulk: tuple[Any, np.ndarray] | None
    values: list[Any]
    present: np.ndarray
    stamps: list[Any] | None
    rows: np.ndarray | None = None
    keys: tuple[Any, np.ndarray] | None = None


def _state_column(enc: _Encoder, table: pa.Table, key_data: Any, key_offsets: np.ndarray) -> _StateColumn:
    column = table.column(enc.state.column)
    present = pc.is_valid(column).to_numpy(zero_copy_only=False)
    plain = enc.state.kind in ("value", "reducing", "aggregating") and not enc.state.ttl
    if plain and column.null_count == 0:
        values = _column_values(column) if is_typed(enc.snapshot) and not _is_struct(column) else enc.values(column)
        try:
            data, offsets = enc.framing.ser.serialize_many(values)
        except (TypeError, ValueError, OverflowError) as e:
            raise type(e)(f"{enc.what}: {e}") from None
        return _StateColumn(enc, (memoryview(data), np.asarray(offsets, dtype=np.int64)), [], present, None)
    rows = None if column.null_count == 0 else np.flatnonzero(present).astype(np.int64)
    bulk = _framed(enc, table, column, rows)
    if bulk is not None:
        keys = None
        if rows is not None:
            gathered, gathered_offsets = bulkframe.gather(key_data, key_offsets, rows)
            keys = (memoryview(gathered), gathered_offsets)
        return _StateColumn(enc, (memoryview(bulk[0]), bulk[1]), [], present, None, rows, keys)
    stamps = table.column(enc.state.ttl_column).to_pylist() if enc.state.ttl_column is not None else None
    return _StateColumn(enc, None, enc.values(column), present, stamps)


#: Errors of a serializer or a conversion that make the bulk path hand a column to the value-by-value one (which
#: raises them again, naming the value).
_UNBULKABLE = (TypeError, ValueError, OverflowError, UnicodeEncodeError, pa.ArrowException)


def _framed(enc: _Encoder, table: pa.Table, column: pa.ChunkedArray, rows: np.ndarray | None
            ) -> tuple[bytes, np.ndarray] | None:
    """The framed values of a list, map, TTL or partly null state column (``rows``: those that have one; None:
    all), built in bulk: each part (value, list element, map key and value) of every row serialized by one
    ``serialize_many`` call per role, the frames and TTL timestamps laid around them in compiled code
    (``_native/bulkframe.pyx``). None when the column needs the value-by-value path: a null inside a list or map,
    a map repeating a key (or holding NaN keys: one key, as a map state compares keys), TTL timestamps per map
    key, or bytes the bulk path cannot read; that path writes the same bytes, and raises the errors."""
    state = enc.state
    array = _one_array(column, rows)
    n = len(array)
    sers = state.meta["serializers"]
    try:
        if state.kind == "list":
            counts, parts = _list_parts(array, SerializerSnapshot.from_json(sers["element"]), enc.framing.ser)
            if parts is None:
                return None
            framed_keys = None
            kind = bulkframe.LIST
        elif state.kind == "map":
            if not pa.types.is_map(array.type) or array.null_count:
                return None
            bounds = _bounds(array)
            counts = np.diff(bounds)
            keys, items = _children(array, bounds)
            if items.null_count or (pa.types.is_floating(keys.type) and pc.any(pc.is_nan(keys)).as_py()):
                return None
            framed_keys = _serialized(keys, SerializerSnapshot.from_json(sers["map key"]), enc.framing.key_ser)
            parts = _serialized(items, SerializerSnapshot.from_json(sers["map value"]), enc.framing.ser)
            if bulkframe.has_repeated_keys(np.concatenate([[0], np.cumsum(counts)]), framed_keys):
                return None
            kind = bulkframe.MAP
        else:
            counts = np.ones(n, dtype=np.int64)
            values = (_column_values(pa.chunked_array([array])) if is_typed(enc.snapshot) and not _is_struct(column)
                      else enc.values(pa.chunked_array([array])))
            data, offsets = enc.framing.ser.serialize_many(values)
            parts = (data, np.asarray(offsets, dtype=np.int64))
            framed_keys = None
            kind = bulkframe.VALUE
        stamps = None
        if state.ttl:
            stamps = _stamps(table, state, rows, counts, enc.default_ms)
            if stamps is None:
                return None
        bounds = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        data, offsets = bulkframe.frame_values(kind, bounds, parts, framed_keys, stamps)
    except _UNBULKABLE:
        return None
    return data, offsets


def _one_array(column: pa.ChunkedArray, rows: np.ndarray | None) -> pa.Array:
    """A column as one array starting at offset 0 (children and offsets line up), of ``rows`` only if given."""
    array = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], type=column.type)
    return array if rows is None else array.take(pa.array(rows))


def _bounds(array: Any) -> np.ndarray:
    """A list or map array's offsets (n + 1) as positions into its flattened children."""
    offsets = np.asarray(array.offsets, dtype=np.int64)
    return offsets - offsets[0]


def _children(array: Any, bounds: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """A map array's keys and items, the parts of its maps only (a sliced array's children hold more)."""
    start = int(np.asarray(array.offsets)[0])
    length = int(bounds[-1])
    return array.keys.slice(start, length), array.items.slice(start, length)


def _list_parts(array: Any, snapshot: SerializerSnapshot, ser: TypeSerializer
                ) -> tuple[np.ndarray, tuple[Any, np.ndarray] | None]:
    """(elements per row, the elements serialized) of a list array; parts None when an element is null."""
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)) or array.null_count:
        return np.zeros(0, dtype=np.int64), None
    bounds = _bounds(array)
    start = int(np.asarray(array.offsets)[0])
    elements = array.values.slice(start, int(bounds[-1]))
    if elements.null_count:
        return np.diff(bounds), None
    return np.diff(bounds), _serialized(elements, snapshot, ser)


def _serialized(array: pa.Array, snapshot: SerializerSnapshot, ser: TypeSerializer) -> tuple[Any, np.ndarray]:
    """An array's values serialized back to back by one ``serialize_many`` call: (buffer, int64 offsets)."""
    column = pa.chunked_array([array], type=array.type)
    values = (_column_values(column) if is_typed(snapshot) and not _is_struct(column)
              else python_values(column, snapshot))
    data, offsets = ser.serialize_many(values)
    return data, np.asarray(offsets, dtype=np.int64)


def _stamps(table: pa.Table, state: _PlannedState, rows: np.ndarray | None, counts: np.ndarray,
            default_ms: int) -> np.ndarray | None:
    """The TTL timestamp (ms) of every part, in part order, as ``_with_timestamps`` gives them: the time of writing
    without a ``ttl_column``; else one per row (a timestamp of s, ms or us, or a long; null: the time of writing),
    or, for a list, an array of one per element. None for what only the value-by-value path reads (per map key,
    nanoseconds, other types): it writes the same bytes and raises the errors."""
    total = int(counts.sum())
    if state.ttl_column is None:
        return np.full(total, default_ms, dtype=np.int64)
    array = _one_array(table.column(state.ttl_column), rows)
    per_element = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
    if per_element:
        if state.kind != "list":
            return None
        valid = array.is_valid().to_numpy(zero_copy_only=False)
        bounds = _bounds(array)
        lengths = np.diff(bounds)
        if not (lengths[valid] == counts[valid]).all():
            return None   # the value-by-value path names the row
        start = int(np.asarray(array.offsets)[0])
        inner = _milliseconds(array.values.slice(start, int(bounds[-1])), default_ms)
        if inner is None:
            return None
        if valid.all():
            return inner
        out = np.full(total, default_ms, dtype=np.int64)
        parts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=parts[1:])
        for r in np.flatnonzero(valid).tolist():   # only rows with a stamp list (nulls take the default)
            out[parts[r]:parts[r + 1]] = inner[bounds[r]:bounds[r + 1]]
        return out
    per_row = _milliseconds(array, default_ms)
    if per_row is None:
        return None
    return np.repeat(per_row, counts)


def _milliseconds(array: pa.Array, default_ms: int) -> np.ndarray | None:
    """TTL timestamps as ``_ms`` reads them (nulls: ``default_ms``), computed as it computes them: a timestamp
    through float seconds times 1000, truncated; a long as it is. None for other types (and nanoseconds)."""
    t = array.type
    if pa.types.is_timestamp(t) and t.unit in ("s", "ms", "us"):
        micros = pc.cast(pc.cast(array, pa.timestamp("us", t.tz)), pa.int64()).fill_null(0).to_numpy(
            zero_copy_only=False)
        ms = (micros.astype(np.float64) / 1e6 * 1000).astype(np.int64)
        far = np.flatnonzero(np.abs(micros) > 2**53)   # past 2255: no longer exact as a double, as Python divides
        if len(far):
            ms[far] = [int(m / 10**6 * 1000) for m in micros[far].tolist()]
    elif pa.types.is_integer(t):
        ms = pc.cast(array, pa.int64()).fill_null(default_ms).to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        return None
    if array.null_count:
        ms = np.where(array.is_valid().to_numpy(zero_copy_only=False), ms, default_ms)
    return np.asarray(ms, dtype=np.int64)


def _is_struct(column: pa.ChunkedArray) -> bool:
    return pa.types.is_struct(column.type) or pa.types.is_map(column.type) or pa.types.is_list(column.type)


def _check_unique(keys: Sequence[Any], key_data: memoryview, key_offsets: np.ndarray, kgs: np.ndarray) -> None:
    """DuplicateKeyError naming the first key that comes in two rows (keys compare as their serialized bytes; rows
    ordered by key group)."""
    n = len(kgs)
    widths = np.diff(key_offsets)
    if n and int(widths.min()) == int(widths.max()) <= 8:   # fixed-width keys: sorted as integers, no objects
        width = int(widths[0])
        padded = np.zeros((n, 8), dtype=np.uint8)
        if width:
            padded[:, :width] = np.frombuffer(key_data, dtype=np.uint8, count=n * width).reshape(n, width)
        as_int = padded.view(np.uint64).ravel()
        order = np.lexsort((as_int, kgs))
        same = (as_int[order][1:] == as_int[order][:-1]) & (kgs[order][1:] == kgs[order][:-1])
        if not same.any():
            return
        dup = keys[int(order[int(np.argmax(same))])]
    else:
        seen: set[bytes] = set()
        dup = None
        offsets = key_offsets.tolist()
        for i in range(n):
            kb = bytes(key_data[offsets[i]:offsets[i + 1]])
            if kb in seen:
                dup = keys[i]
                break
            seen.add(kb)
        else:
            return
    raise DuplicateKeyError(f"key {dup!r} comes in more than one row: a savepoint holds one value (list, map) per "
                            f"key and state; aggregate the rows per key first")


def commit_savepoint(plan: SavepointPlan, handles: Sequence[KeyedStateHandle | None]) -> CheckpointMetadata:
    """Write the savepoint's ``_metadata`` from the tasks' handles (one per subtask that had rows) and return it."""
    keyed = sorted((h for h in handles if h is not None), key=lambda h: h.subtask)
    subtasks = [h.subtask for h in keyed]
    if len(set(subtasks)) != len(subtasks):
        raise KeyGroupsError(f"savepoint {plan.name!r}: two files for one subtask ({subtasks}); nothing was "
                             "committed")
    metadata = CheckpointMetadata(
        checkpoint_id=0, job_id=f"savepoint-writer:{plan.name}", timestamp_ms=plan.written_ms,
        max_parallelism=plan.max_parallelism, parallelism=plan.parallelism, keyed_handles=keyed,
        properties={KEY_COLUMNS_PROPERTY: list(plan.key_columns),
                    "states": {s.name: s.column for s in plan.states}})
    plan.storage.commit_savepoint(metadata, plan.name)
    return metadata


__all__ = ["StateColumn", "SavepointPlan", "plan_savepoint", "write_savepoint_subtask", "commit_savepoint",
           "DuplicateKeyError", "KINDS"]
