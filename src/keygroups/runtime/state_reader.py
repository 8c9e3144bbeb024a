"""Stored state as Arrow record batches, without Spark and without the job's classes: what the ``keygroups`` Spark
data source serves (``keygroups.spark.state_source`` is a thin adapter over this module).

A restore point is a complete checkpoint (the latest, or one by id) or a savepoint (:func:`load_restore_point`).

* Keyed state (:class:`KeyedStateReader`): one row per key of one state, with the key column(s), ``key_group``, the
  value, and its TTL timestamp when the state has TTL; or, flattened, one row per list element (with its ``index``)
  or map entry (``map_key``). Each key group's chain is applied as a restore applies it (the newest full block,
  then its deltas: a put replaces a key, a delete removes it; keys compare as stored bytes), so the rows are the
  state a backend restored from the same point holds, expired TTL entries not cleaned up yet included (as Flink's
  State Processor API shows them). :meth:`KeyedStateReader.partitions` cuts the key groups into contiguous runs of
  about equal stored bytes; :meth:`KeyedStateReader.read` reads one run: one ranged read per file of its chains.
* :func:`key_group_entries`: each key group's live entries per state, still as stored (keys and framed values back to
  back, with offsets: :class:`LiveEntries`), one key group read at a time: what a bulk consumer that decodes or
  transcodes the bytes itself streams through (the Flink export does); :func:`value_framing` decodes them.
* :func:`metadata_table`: per key group and state, what is stored (kind, serializers, TTL, keys, entries, bytes,
  the chain's blocks and bytes).
* :func:`operator_state_table`: one operator state's elements per subtask as stored, with the distribution mode.
* Timers (:func:`read_timers`, Spark's ``readRegisteredTimers``): one row per registered timer, key, time domain and
  timestamp, read from the job's hidden timer states (``_timers/event-time``, ``_timers/processing-time``, map
  states like any other, also readable with :class:`KeyedStateReader`); :func:`timer_counts` per key group.

Values are decoded only through the stored serializers and the state framing (``keygroups.state._codec``); see
:mod:`keygroups.runtime.state_types` for the column types. Nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups._native import splitter
from keygroups._ranges import KeyGroupRange, operator_indexes_for_boundaries
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    DistributionMode,
    ElementRun,
    KeyedStateHandle,
    chain_stats,
    plan_keyed_restore,
    read_key_group_offsets,
    read_operator_runs,
)
from keygroups.checkpoint.metadata import EMPTY_BLOCK_SIZE
from keygroups.checkpoint.state_meta import check_state_metas
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError, KeyGroupsError
from keygroups.runtime.assignment import checkpoint_boundaries
from keygroups.runtime.state_types import arrow_type, is_typed, reading_serializer
from keygroups.serializers import SerializerSnapshot, TypeSerializer
from keygroups.state._codec import ValueFraming
from keygroups.state.timers import TIMER_STATE_NAMES, TimeDomain
from keygroups.state.ttl import EVENT_TIME_NOT_STARTED

#: Keyed state kinds whose value is one object per key.
SINGLE_VALUE_KINDS = ("value", "reducing", "aggregating")
#: The property a savepoint written by ``keygroups.runtime.state_writer`` keeps its key column names in.
KEY_COLUMNS_PROPERTY = "key_columns"
#: TTL timestamps (milliseconds of the writing backend's clock) as a column.
TTL_TYPE = pa.timestamp("ms", tz="UTC")


def _ttl_stamp(t: int) -> int | None:
    """An entry's TTL timestamp as the reader shows it: None for an event-time value written before the job's
    first watermark (its clock has not started; see ``EVENT_TIME_NOT_STARTED``)."""
    return None if t == EVENT_TIME_NOT_STARTED else t
#: Rows per record batch (a batch may hold more: one key group's rows are never split).
DEFAULT_BATCH_ROWS = 1 << 16


class StateNotFoundError(KeyGroupsError, ValueError):
    """The restore point holds no state of the asked name (the message lists those it holds)."""


def load_restore_point(storage: CheckpointStorage, *, checkpoint_id: int | None = None,
                       savepoint: str | None = None) -> CheckpointMetadata:
    """The metadata of savepoint ``savepoint``, of checkpoint ``checkpoint_id``, or (neither given) of the latest
    complete checkpoint. CheckpointNotFoundError naming what exists when there is none; ValueError for both."""
    if checkpoint_id is not None and savepoint is not None:
        raise ValueError(f"give a checkpoint id ({checkpoint_id!r}) or a savepoint name ({savepoint!r}), not both")
    if savepoint is not None:
        return storage.load_savepoint(savepoint)
    if checkpoint_id is not None:
        return storage.load(checkpoint_id)
    latest = storage.latest()
    if latest is None:
        raise CheckpointNotFoundError(
            f"{storage.location} holds no complete checkpoint (a directory chk-<id> with a _metadata file), so there "
            f"is no state to read; savepoints there: {storage.savepoint_names() or 'none'}. Point the path at a "
            f"job's checkpoint location, or name a savepoint")
    return latest


def _where(metadata: CheckpointMetadata) -> str:
    return f"savepoint {metadata.base.split('/', 1)[1]!r}" if metadata.base.startswith("savepoints/") else (
        f"checkpoint {metadata.checkpoint_id}")


def keyed_state_metas(metadata: CheckpointMetadata) -> dict[str, dict[str, Any]]:
    """Each keyed state's meta (kind, serializer snapshots, TTL), by name: that of the newest file holding it.
    CorruptSnapshotError naming the state if a meta is malformed."""
    check_state_metas(metadata)
    metas: dict[str, dict[str, Any]] = {}
    for h in sorted(metadata.keyed_handles, key=lambda h: h.checkpoint_id):
        for meta in h.states:
            metas[meta["name"]] = meta
    return metas


def operator_state_names(metadata: CheckpointMetadata) -> list[str]:
    """The names of the operator states the restore point holds."""
    return sorted({name for h in metadata.operator_handles for name in h.states})


def _not_found(metadata: CheckpointMetadata, state: Any, what: str) -> StateNotFoundError:
    return StateNotFoundError(
        f"{_where(metadata)} holds no {what} state named {state!r}; its keyed states: "
        f"{sorted(keyed_state_metas(metadata)) or 'none'}, its operator states: "
        f"{operator_state_names(metadata) or 'none'}")


def _snapshot(meta: dict[str, Any], role: str) -> SerializerSnapshot:
    stored = meta.get("serializers", {}).get(role)
    if stored is None:
        raise CorruptSnapshotError(f"state {meta.get('name')!r} ({meta.get('kind')}) has no {role!r} serializer in "
                                   f"its meta: {json.dumps(meta)[:200]}")
    return SerializerSnapshot.from_json(stored)


def _roles(kind: str) -> tuple[str, ...]:
    if kind == "list":
        return ("element",)
    if kind == "map":
        return ("map key", "map value")
    if kind in SINGLE_VALUE_KINDS:
        return ("value",)
    raise CorruptSnapshotError(f"unknown keyed state kind {kind!r}; known: value, list, map, reducing, aggregating")


def value_framing(meta: dict[str, Any]) -> ValueFraming:
    """The framing that splits the stored values of the state whose meta is ``meta`` (list elements, map entries,
    TTL timestamps; see ``keygroups.state._codec``) and decodes them with its reading serializers.
    CorruptSnapshotError naming the state if the meta lacks a serializer."""
    sers = {role: reading_serializer(_snapshot(meta, role)) for role in _roles(meta["kind"])}
    return ValueFraming.for_state(meta["name"], meta["kind"], sers, ttl=meta.get("ttl") is not None)


def _key_fields(key: SerializerSnapshot, names: Sequence[str] | None) -> list[pa.Field]:
    """The key column(s): a typed tuple key gives one column per field (``key_1``, ``key_2``, ... unless named),
    any other key one column (``key`` unless named)."""
    if _split_key(key):
        types = [arrow_type(n) for n in key.nested]
        default = [f"key_{i + 1}" for i in range(len(types))]
    else:
        types, default = [arrow_type(key)], ["key"]
    if names is None:
        names = default
    if len(names) != len(types):
        raise ValueError(f"keyColumns names {len(names)} columns ({list(names)}), but the state's keys have "
                         f"{len(types)} part(s) ({key.describe()}): give {len(types)} names")
    return [pa.field(n, t) for n, t in zip(names, types)]


def _key_column_names(metadata: CheckpointMetadata, key_columns: Sequence[str] | None) -> Sequence[str] | None:
    """``key_columns``, else those a savepoint writer recorded in ``metadata``, else None (the default names)."""
    if key_columns is not None:
        return key_columns
    recorded = metadata.properties.get(KEY_COLUMNS_PROPERTY)
    return recorded if isinstance(recorded, list) and all(isinstance(c, str) for c in recorded) else None


def _split_key(key: SerializerSnapshot) -> bool:
    return key.identifier == "tuple" and is_typed(key)


# ---- applying a key group's chain ----------------------------------------------------------------------------------


@dataclass
class LiveEntries:
    """One state's live entries in one key group, as stored: keys (serialized with the job's key serializer) back
    to back in ``keys`` at ``key_offsets`` (n + 1 int64 positions), values (the state's framing, see
    :func:`value_framing`) likewise in ``values`` at ``value_offsets``; sorted by key bytes. ``keys`` and ``values``
    may be views of the bytes read."""

    keys: Any
    key_offsets: np.ndarray
    values: Any
    value_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.key_offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.key_offsets[-1] - self.key_offsets[0] + self.value_offsets[-1] - self.value_offsets[0])


def _packed(items: list[bytes]) -> tuple[bytes, np.ndarray]:
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    if items:
        np.cumsum([len(b) for b in items], out=offsets[1:])
    return b"".join(items), offsets


def _merge(layers: list[tuple[Any, Any, Any, Any]]) -> LiveEntries | None:
    """Apply one state's layers of one key group's chain, oldest first (block, key offsets or None, value offsets,
    delete offsets or None); None if no entry is left. A lone put layer is used in place."""
    if len(layers) == 1 and layers[0][3] is None and layers[0][1] is not None:
        block, ko, vo, _ = layers[0]
        return LiveEntries(block, ko, block, vo) if len(ko) > 1 else None
    entries: dict[bytes, Any] = {}
    for block, ko, vo, do in layers:
        if ko is not None:
            k, v = ko.tolist(), vo.tolist()
            for i in range(len(k) - 1):
                entries[bytes(block[k[i]:k[i + 1]])] = block[v[i]:v[i + 1]]
        if do is not None:
            d = do.tolist()
            for i in range(len(d) - 1):
                entries.pop(bytes(block[d[i]:d[i + 1]]), None)
    if not entries:
        return None
    keys = sorted(entries)
    key_data, key_offsets = _packed(keys)
    value_data, value_offsets = _packed([bytes(entries[k]) for k in keys])
    return LiveEntries(key_data, key_offsets, value_data, value_offsets)


def _chains(storage: CheckpointStorage, metadata: CheckpointMetadata, key_groups: KeyGroupRange
            ) -> Iterator[tuple[int, dict[str, tuple[dict[str, Any], LiveEntries]]]]:
    """Per key group of ``key_groups`` with state, ascending: state name -> (its meta, its live entries). Reads
    each file's part of the range at once (``plan_keyed_restore``: one ranged read per run of key groups per file),
    so the whole range is in memory; :func:`key_group_entries` holds one key group at a time."""
    return _applied(storage, plan_keyed_restore(metadata, key_groups))


def key_group_entries(storage: CheckpointStorage, metadata: CheckpointMetadata, key_groups: KeyGroupRange
                      ) -> Iterator[tuple[int, dict[str, tuple[dict[str, Any], LiveEntries]]]]:
    """Each key group of ``key_groups`` that holds state, ascending, as ``(key_group, {state name: (its meta, its
    live entries)})``: the key group's chain applied as a restore applies it (:class:`LiveEntries`), values still
    as stored (decode them with :func:`value_framing` of the meta, keys with the meta's ``key`` serializer).

    Streaming: the chains are planned once for the whole range (from the metadata), then one key group is read
    at a time, one ranged read of its bytes per file of its chain, so memory holds one key group's blocks and the
    bytes read are those of the range's chains, never a whole file per key group. CorruptSnapshotError names the
    file of a damaged block."""
    per_group: dict[int, list[KeyedStateHandle]] = {}
    for handle, run in plan_keyed_restore(metadata, key_groups):    # chain order: oldest checkpoint first
        for kg in run:
            per_group.setdefault(kg, []).append(handle)
    for kg in sorted(per_group):
        one = KeyGroupRange(kg, kg)
        yield from _applied(storage, [(handle, one) for handle in per_group[kg]])


def _applied(storage: CheckpointStorage, plan: list[tuple[KeyedStateHandle, KeyGroupRange]]
             ) -> Iterator[tuple[int, dict[str, tuple[dict[str, Any], LiveEntries]]]]:
    """The live entries of a restore plan's key groups (``plan_keyed_restore``'s pairs, in chain order)."""
    # kg -> state name -> (meta, layers); a full block starts the key group anew, in every state
    groups: dict[int, dict[str, tuple[dict[str, Any], list[Any]]]] = {}
    for handle, part in plan:
        blocks, _ = read_key_group_offsets(storage, handle, part)
        for block in blocks:
            group = groups.setdefault(block.key_group, {})
            if block.full:
                group.clear()
            per_state: dict[int, list[Any]] = {}
            for state_index, ko, vo in block.puts:
                _state_meta(handle, block.key_group, state_index)
                if len(ko) != len(vo):
                    raise CorruptSnapshotError(f"{handle.file}: key group {block.key_group}, state index "
                                               f"{state_index}: {len(ko) - 1} keys but {len(vo) - 1} values")
                per_state.setdefault(state_index, [block.block, None, None, None])[1:3] = ko, vo
            for state_index, do in block.deletes:
                _state_meta(handle, block.key_group, state_index)
                per_state.setdefault(state_index, [block.block, None, None, None])[3] = do
            for state_index, layer in per_state.items():
                meta = handle.states[state_index]
                entry = group.setdefault(meta["name"], (meta, []))
                group[meta["name"]] = (meta, entry[1])   # the newest file's meta (one per chain: checked by the plan)
                entry[1].append(tuple(layer))
    for kg in sorted(groups):
        live = {}
        for name, (meta, layers) in groups[kg].items():
            merged = _merge(layers)
            if merged is not None:
                live[name] = (meta, merged)
        if live:
            yield kg, live


def _state_meta(handle: KeyedStateHandle, kg: int, state_index: int) -> None:
    if not 0 <= state_index < len(handle.states):
        raise CorruptSnapshotError(f"{handle.file}: key group {kg} has a section for state index {state_index}, but "
                                   f"the file has {len(handle.states)} states")


#: Stored bytes (every block of the key groups' chains) a partition reads by default.
DEFAULT_PARTITION_BYTES = 64 << 20


def key_group_partitions(metadata: CheckpointMetadata, *, target_bytes: int = DEFAULT_PARTITION_BYTES,
                         count: int | None = None) -> list[KeyGroupRange]:
    """The key groups that hold state, cut into contiguous ranges of about ``target_bytes`` stored bytes each (every
    block of their chains, all states; from the metadata alone), or into about ``count`` ranges of equal bytes. A
    range never splits a key group. At least one range (empty when there is no keyed state) is returned."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"count must be an int >= 1 (how many partitions), got {count!r}")
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 1:
        raise ValueError(f"target_bytes must be an int >= 1, got {target_bytes!r}")
    stats = chain_stats(metadata, KeyGroupRange(0, metadata.max_parallelism - 1))
    sizes = [(kg, s.full_bytes + s.delta_bytes) for kg, s in sorted(stats.items())
             if s.delta_bytes or s.full_bytes > EMPTY_BLOCK_SIZE]   # an empty full block holds nothing to read
    if not sizes:
        return [KeyGroupRange.empty()]
    if count is not None:
        target_bytes = max(1, -(-sum(b for _, b in sizes) // count))
    ranges: list[KeyGroupRange] = []
    start, acc = sizes[0][0], 0
    for i, (kg, b) in enumerate(sizes):
        acc += b
        if i + 1 == len(sizes):
            ranges.append(KeyGroupRange(start, kg))
        elif acc >= target_bytes:
            ranges.append(KeyGroupRange(start, kg))
            start, acc = sizes[i + 1][0], 0
    return ranges


# ---- keyed state as rows -------------------------------------------------------------------------------------------


class KeyedStateReader:
    """Reads keyed state ``state`` of a restore point as Arrow record batches (see the module docs for the rows).

    ``flatten``: one row per list element / map entry instead of one per key (Spark's ``flattenCollectionTypes``);
    for value, reducing and aggregating states it changes nothing. ``key_columns`` names the key column(s) (by
    default those a savepoint writer recorded, else ``key`` or ``key_1``, ``key_2``, ... for a tuple key).

    The object is small and picklable (storage and metadata, no buffers): build it once, ship it to the tasks that
    each :meth:`read` one part of :meth:`partitions`."""

    def __init__(self, storage: CheckpointStorage, metadata: CheckpointMetadata, state: str, *,
                 flatten: bool = False, key_columns: Sequence[str] | None = None,
                 batch_rows: int = DEFAULT_BATCH_ROWS) -> None:
        metas = keyed_state_metas(metadata)
        if state not in metas:
            raise _not_found(metadata, state, "keyed")
        self.storage = storage
        self.metadata = metadata
        self.state = state
        self.meta = metas[state]
        self.kind: str = self.meta["kind"]
        self.ttl = self.meta.get("ttl") is not None
        self.flatten = bool(flatten) and self.kind in ("list", "map")
        self.batch_rows = batch_rows
        self._key_snapshot = _snapshot(self.meta, "key")
        key_fields = _key_fields(self._key_snapshot, _key_column_names(metadata, key_columns))
        self._key_parts = len(key_fields) if _split_key(self._key_snapshot) else 0   # 0: one key column
        self.schema = self._schema(key_fields)

    def _schema(self, key_fields: list[pa.Field]) -> pa.Schema:
        types = {role: arrow_type(_snapshot(self.meta, role)) for role in _roles(self.kind)}
        fields = [*key_fields, pa.field("key_group", pa.int32(), nullable=False)]
        if self.kind == "list":
            element = types["element"]
            if self.flatten:
                fields += [pa.field("index", pa.int32(), nullable=False), pa.field("value", element)]
                fields += [pa.field("ttl_timestamp", TTL_TYPE)] if self.ttl else []
            else:
                fields += [pa.field("value", pa.list_(element))]
                fields += [pa.field("ttl_timestamps", pa.list_(TTL_TYPE))] if self.ttl else []
        elif self.kind == "map":
            k, v = types["map key"], types["map value"]
            if self.flatten:
                fields += [pa.field("map_key", k), pa.field("value", v)]
                fields += [pa.field("ttl_timestamp", TTL_TYPE)] if self.ttl else []
            else:
                fields += [pa.field("value", pa.map_(k, v))]
                fields += [pa.field("ttl_timestamps", pa.map_(k, TTL_TYPE))] if self.ttl else []
        else:
            fields += [pa.field("value", types["value"])]
            fields += [pa.field("ttl_timestamp", TTL_TYPE)] if self.ttl else []
        names = [f.name for f in fields]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"columns {dup} appear twice in {names}: name the key columns otherwise (keyColumns)")
        return pa.schema(fields)

    def partitions(self, *, target_bytes: int = DEFAULT_PARTITION_BYTES, count: int | None = None
                   ) -> list[KeyGroupRange]:
        """:func:`key_group_partitions` of this reader's restore point."""
        return key_group_partitions(self.metadata, target_bytes=target_bytes, count=count)

    def read(self, key_groups: KeyGroupRange) -> Iterator[pa.RecordBatch]:
        """The rows of ``key_groups`` (ascending key group, then key bytes), as record batches of :attr:`schema`."""
        if not key_groups:
            return
        key_ser = reading_serializer(self._key_snapshot)
        framings: dict[str, ValueFraming] = {}
        pending: list[pa.RecordBatch] = []
        rows = 0
        for kg, states in _chains(self.storage, self.metadata, key_groups):
            found = states.get(self.state)
            if found is None:
                continue
            meta, live = found
            canonical = json.dumps(meta, sort_keys=True)
            framing = framings.get(canonical)
            if framing is None:
                framing = framings[canonical] = value_framing(meta)
            try:
                batch = self._rows(kg, live, key_ser, framing)
            except CorruptSnapshotError as e:
                # bytes its meta cannot decode (a crafted or damaged meta: a TTL the values were written without, a
                # serializer of another type): name the state, as the backends' restore does
                raise CorruptSnapshotError(f"state {self.state!r}, key group {kg}: its stored values do not decode "
                                           f"with the serializers and TTL its meta names: {e}") from e
            pending.append(batch)
            rows += batch.num_rows
            if rows >= self.batch_rows:
                yield _combined(pending, self.schema)
                pending, rows = [], 0
        if pending:
            yield _combined(pending, self.schema)

    def _rows(self, kg: int, live: LiveEntries, key_ser: TypeSerializer, framing: ValueFraming) -> pa.RecordBatch:
        keys = key_ser.deserialize_many(live.keys, live.key_offsets)
        if self.kind in SINGLE_VALUE_KINDS:
            values = framing.decode_many(live.values, live.value_offsets)
        else:
            o = live.value_offsets.tolist()
            mv = memoryview(live.values)
            values = [framing.decode(mv[o[i]:o[i + 1]]) for i in range(len(o) - 1)]
        columns: list[Any]
        if not self.flatten:
            columns = [values]
            if self.ttl:
                if self.kind in SINGLE_VALUE_KINDS:
                    columns = [[v for v, _ in values], [_ttl_stamp(t) for _, t in values]]
                elif self.kind == "list":
                    columns = [[[e for e, _ in v] for v in values], [[_ttl_stamp(t) for _, t in v] for v in values]]
                else:
                    columns = [[{k: x for k, (x, _) in v.items()} for v in values],
                               [[(k, _ttl_stamp(t)) for k, (_, t) in v.items()] for v in values]]
        else:
            repeat: list[int] = []
            if self.kind == "list":
                index: list[int] = []
                elements: list[Any] = []
                stamps: list[int | None] = []
                for i, v in enumerate(values):
                    repeat.extend([i] * len(v))
                    index.extend(range(len(v)))
                    if self.ttl:
                        elements.extend(e for e, _ in v)
                        stamps.extend(_ttl_stamp(t) for _, t in v)
                    else:
                        elements.extend(v)
                columns = [index, elements] + ([stamps] if self.ttl else [])
            else:
                map_keys: list[Any] = []
                items: list[Any] = []
                stamps = []
                for i, v in enumerate(values):
                    repeat.extend([i] * len(v))
                    map_keys.extend(v.keys())
                    if self.ttl:
                        items.extend(x for x, _ in v.values())
                        stamps.extend(_ttl_stamp(t) for _, t in v.values())
                    else:
                        items.extend(v.values())
                columns = [map_keys, items] + ([stamps] if self.ttl else [])
            keys = [keys[i] for i in repeat]
        n_key = max(1, self._key_parts)
        if not self._key_parts:
            key_columns = [keys]
        else:
            key_columns = [list(c) for c in zip(*keys)] if keys else [[] for _ in range(n_key)]
        arrays = [pa.array(c, type=f.type) for c, f in zip(key_columns, self.schema)]
        arrays.append(pa.array(np.full(len(keys), kg, dtype=np.int32)))
        arrays += [pa.array(c, type=f.type) for c, f in zip(columns, list(self.schema)[n_key + 1:])]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def _combined(batches: list[pa.RecordBatch], schema: pa.Schema) -> pa.RecordBatch:
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches, schema=schema).combine_chunks().to_batches()[0]


# ---- the metadata view ---------------------------------------------------------------------------------------------

METADATA_SCHEMA = pa.schema([
    pa.field("key_group", pa.int32(), nullable=False),
    pa.field("subtask", pa.int32(), nullable=False),
    pa.field("state", pa.string(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("serializers", pa.map_(pa.string(), pa.string())),
    pa.field("ttl_ms", pa.int64()),
    pa.field("keys", pa.int64(), nullable=False),
    pa.field("entries", pa.int64(), nullable=False),
    pa.field("state_bytes", pa.int64(), nullable=False),
    pa.field("chain_blocks", pa.int32(), nullable=False),
    pa.field("chain_bytes", pa.int64(), nullable=False),
])


def metadata_table(storage: CheckpointStorage, metadata: CheckpointMetadata, key_groups: KeyGroupRange | None = None
                   ) -> pa.Table:
    """One row per key group of ``key_groups`` (all by default) and keyed state stored in it: the subtask that owns
    the key group at the restore point (by its key-group ranges: Flink's, or balanced ones), the state's kind, serializers (by role, described), TTL,
    ``keys``, ``entries`` (list elements or map entries; = keys for the other kinds), ``state_bytes`` (its live
    keys and values as stored), and the key group's chain: ``chain_blocks`` and ``chain_bytes`` (all states)."""
    mp = metadata.max_parallelism
    wanted = KeyGroupRange(0, mp - 1) if key_groups is None else key_groups
    if not wanted:
        return METADATA_SCHEMA.empty_table()
    stats = chain_stats(metadata, wanted)
    owners = operator_indexes_for_boundaries(checkpoint_boundaries(metadata), np.arange(mp)).tolist()
    rows: list[dict[str, Any]] = []
    framings: dict[str, ValueFraming] = {}
    for kg, states in _chains(storage, metadata, wanted):
        chain = stats[kg]
        for name in sorted(states):
            meta, live = states[name]
            kind = meta["kind"]
            entries = len(live)
            if kind in ("list", "map"):
                canonical = json.dumps(meta, sort_keys=True)
                framing = framings.get(canonical)
                if framing is None:
                    framing = framings[canonical] = value_framing(meta)
                o = live.value_offsets.tolist()
                mv = memoryview(live.values)
                entries = sum(framing.element_count(mv[o[i]:o[i + 1]]) for i in range(len(o) - 1))
            ttl = meta.get("ttl")
            rows.append({
                "key_group": kg, "subtask": owners[kg], "state": name, "kind": kind,
                "serializers": [(role, SerializerSnapshot.from_json(s).describe())
                                for role, s in sorted(meta.get("serializers", {}).items())],
                "ttl_ms": ttl.get("ttl_ms") if isinstance(ttl, dict) else None,
                "keys": len(live), "entries": entries, "state_bytes": live.nbytes,
                "chain_blocks": chain.length, "chain_bytes": chain.full_bytes + chain.delta_bytes})
    return pa.Table.from_pylist(rows, schema=METADATA_SCHEMA)


# ---- timers ----------------------------------------------------------------------------------------------------------


def _timer_states(metadata: CheckpointMetadata) -> dict[TimeDomain, str]:
    """The time domains whose hidden timer state the restore point holds -> that state's name."""
    metas = keyed_state_metas(metadata)
    return {d: TIMER_STATE_NAMES[d] for d in TimeDomain if TIMER_STATE_NAMES[d] in metas}


def timer_schema(metadata: CheckpointMetadata, *, key_columns: Sequence[str] | None = None) -> pa.Schema:
    """The rows of :func:`read_timers`: the key column(s) (named as :class:`KeyedStateReader` names them), ``key_group``,
    ``domain`` (``"event-time"`` or ``"processing-time"``) and ``timestamp`` (epoch ms, as registered)."""
    metas = keyed_state_metas(metadata)
    names = _timer_states(metadata)
    meta = metas[next(iter(names.values()))] if names else next(iter(metas.values()), None)
    if meta is not None:   # every keyed state of a job stores its keys with the job's key serializer
        key_fields = _key_fields(_snapshot(meta, "key"), _key_column_names(metadata, key_columns))
    else:   # no keyed state at all: the key's type is unknown
        key_fields = [pa.field(key_columns[0] if key_columns else "key", pa.binary())]
    return pa.schema([*key_fields, pa.field("key_group", pa.int32(), nullable=False),
                      pa.field("domain", pa.string(), nullable=False),
                      pa.field("timestamp", pa.int64(), nullable=False)])


def read_timers(storage: CheckpointStorage, metadata: CheckpointMetadata, key_groups: KeyGroupRange | None = None,
                *, key_columns: Sequence[str] | None = None) -> pa.Table:
    """Every timer registered at the restore point (Spark's ``readRegisteredTimers``), of the key groups
    ``key_groups`` (all by default): one row per (key, time domain, timestamp), ordered by domain, timestamp, key
    group. Timers are the job's hidden map states ``_timers/event-time`` and ``_timers/processing-time`` (timestamp
    -> True per key), so this reads them as it reads any keyed state, in one pass over the key groups' chains: a
    deleted or fired timer is gone from the state and is not listed. The schema is :func:`timer_schema`; with no
    timer state at all, the table is empty."""
    schema = timer_schema(metadata, key_columns=key_columns)
    names = _timer_states(metadata)
    wanted = KeyGroupRange(0, metadata.max_parallelism - 1) if key_groups is None else key_groups
    if not names or not wanted:
        return schema.empty_table()
    readers = {domain: KeyedStateReader(storage, metadata, name, flatten=True, key_columns=key_columns)
               for domain, name in names.items()}
    key_ser = reading_serializer(next(iter(readers.values()))._key_snapshot)
    parts: list[pa.Table] = []
    for kg, states in _chains(storage, metadata, wanted):
        for domain, reader in readers.items():
            found = states.get(reader.state)
            if found is None:
                continue
            meta, live = found
            batch = reader._rows(kg, live, key_ser, value_framing(meta))   # key..., key_group, map_key, value
            columns = [*batch.columns[:-2], pa.array([domain.value] * batch.num_rows, pa.string()),
                       batch.column("map_key")]
            parts.append(pa.Table.from_arrays(columns, schema=schema))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts).sort_by([("domain", "ascending"), ("timestamp", "ascending"),
                                            ("key_group", "ascending")])


#: The rows of :func:`timer_counts`.
TIMER_COUNTS_SCHEMA = pa.schema([
    pa.field("key_group", pa.int32(), nullable=False),
    pa.field("domain", pa.string(), nullable=False),
    pa.field("timers", pa.int64(), nullable=False),
    pa.field("earliest", pa.int64(), nullable=False),
])


def timer_counts(storage: CheckpointStorage, metadata: CheckpointMetadata) -> pa.Table:
    """Per key group and time domain that holds timers at the restore point: how many (``timers``) and the earliest
    timestamp (``earliest``, epoch ms). One pass over every key group's chain (what a restore of everything reads);
    only the timer states' values are decoded, never a key, so a job's opaque keys do not matter. Empty without
    timers (and then nothing is read)."""
    names = _timer_states(metadata)
    if not names:
        return TIMER_COUNTS_SCHEMA.empty_table()
    rows: list[dict[str, Any]] = []
    for kg, states in _chains(storage, metadata, KeyGroupRange(0, metadata.max_parallelism - 1)):
        for domain, name in names.items():
            found = states.get(name)
            if found is None:
                continue
            meta, live = found
            framing = value_framing(meta)
            o = live.value_offsets.tolist()
            mv = memoryview(live.values)
            stamps = [ts for i in range(len(o) - 1) for ts in framing.decode(mv[o[i]:o[i + 1]])]
            if stamps:
                rows.append({"key_group": kg, "domain": domain.value, "timers": len(stamps),
                             "earliest": min(stamps)})
    return pa.Table.from_pylist(rows, schema=TIMER_COUNTS_SCHEMA)


# ---- operator state ------------------------------------------------------------------------------------------------


def operator_state_schema(metadata: CheckpointMetadata, state: str) -> pa.Schema:
    """The rows of :func:`operator_state_table`: ``operator_id``, ``subtask``, ``mode``, ``index`` (the element's
    position in its subtask's list), then ``value`` (list modes) or ``key`` and ``value`` (broadcast)."""
    meta = _operator_meta(metadata, state)
    head = [pa.field("operator_id", pa.string(), nullable=False), pa.field("subtask", pa.int32(), nullable=False),
            pa.field("mode", pa.string(), nullable=False), pa.field("index", pa.int32(), nullable=False)]
    if meta.mode is DistributionMode.BROADCAST:
        return pa.schema(head + [
            pa.field("key", arrow_type(SerializerSnapshot.from_json(meta.serializers["key_serializer"]))),
            pa.field("value", arrow_type(SerializerSnapshot.from_json(meta.serializers["value_serializer"])))])
    element = arrow_type(SerializerSnapshot.from_json(meta.serializers["serializer"]))
    return pa.schema(head + [pa.field("value", element)])


def _operator_meta(metadata: CheckpointMetadata, state: str) -> Any:
    for h in sorted(metadata.operator_handles, key=lambda h: (h.operator_id, h.subtask)):
        if state in h.states:
            return h.states[state]
    raise _not_found(metadata, state, "operator")


def operator_state_table(storage: CheckpointStorage, metadata: CheckpointMetadata, state: str) -> pa.Table:
    """Operator state ``state`` as stored: each subtask's elements in order (a broadcast state's map entries), every
    checksum block verified, decoded with the stored serializers (opaque ones as bytes)."""
    schema = operator_state_schema(metadata, state)
    broadcast = "key" in schema.names
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for h in sorted(metadata.operator_handles, key=lambda h: (h.operator_id, h.subtask)):
        meta = h.states.get(state)
        if meta is None:
            continue
        n = len(meta)
        run = ElementRun(h.file, h.subtask, state, meta.mode, 0, n, (meta.bound(0), meta.end),
                         (meta.bound(0), meta.end))
        restored, _ = read_operator_runs(storage, [h], [run])
        values: list[Any] = []
        keys: list[Any] = []
        for buffer, offsets in restored[state].relative():
            if broadcast:
                key_data, key_offsets, value_data, value_offsets = splitter.decode_entries(buffer, offsets)
                keys += reading_serializer(SerializerSnapshot.from_json(meta.serializers["key_serializer"])
                                           ).deserialize_many(key_data, key_offsets)
                values += reading_serializer(SerializerSnapshot.from_json(meta.serializers["value_serializer"])
                                             ).deserialize_many(value_data, value_offsets)
            else:
                values += reading_serializer(SerializerSnapshot.from_json(meta.serializers["serializer"])
                                             ).deserialize_many(buffer, offsets)
        columns["operator_id"] += [h.operator_id] * len(values)
        columns["subtask"] += [h.subtask] * len(values)
        columns["mode"] += [meta.mode.value] * len(values)
        columns["index"] += list(range(len(values)))
        columns["value"] += values
        if broadcast:
            columns["key"] += keys
    return pa.Table.from_pydict(columns, schema=schema)


def with_window_columns(rows: pa.Table | pa.RecordBatch) -> pa.Table:
    """Window start and end columns for rows of a namespaced state whose namespaces are windows (the contents of
    ``keygroups.windows``, state ``"window-contents"``, or any state got with ``namespace_serializer=
    TimeWindow.serializer()``), read with ``flatten=True``.

    A namespaced state is stored as a map state: its ``map_key`` is the namespace, a struct ``{_1: start, _2: end}``
    of epoch ms (for a namespaced map state ``{_1: {_1: start, _2: end}, _2: user key}``). This replaces it by
    ``window_start`` and ``window_end`` (UTC timestamps, ms) after the key columns, and keeps a namespaced map
    state's user key as ``map_key``. ValueError for rows without such a ``map_key``."""
    table = pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
    if "map_key" not in table.column_names or not pa.types.is_struct(table.schema.field("map_key").type):
        raise ValueError(f"with_window_columns needs a namespaced state read with flatten=True (a struct map_key "
                         f"column); the rows have columns {table.column_names}")
    key = table.column("map_key").combine_chunks()
    user_key = None
    if pa.types.is_struct(key.type.field(0).type):   # a namespaced map state: (window, user key)
        key, user_key = key.field(0), key.field(1)
    window_type = [key.type.field(i).type for i in range(key.type.num_fields)]
    if len(window_type) != 2 or not all(pa.types.is_integer(t) for t in window_type):
        raise ValueError(f"map_key {table.schema.field('map_key').type} is not a (start, end) window of epoch ms")
    at = table.column_names.index("map_key")
    table = table.remove_column(at)
    if user_key is not None:
        table = table.add_column(at, "map_key", user_key)
    for name, i in (("window_end", 1), ("window_start", 0)):
        table = table.add_column(at, name, key.field(i).cast(pa.int64()).cast(TTL_TYPE))
    return table


__all__ = ["KeyedStateReader", "key_group_entries", "LiveEntries", "value_framing", "with_window_columns",
           "load_restore_point", "key_group_partitions", "DEFAULT_PARTITION_BYTES",
           "keyed_state_metas", "operator_state_names", "metadata_table", "operator_state_schema",
           "operator_state_table", "StateNotFoundError", "METADATA_SCHEMA", "KEY_COLUMNS_PROPERTY", "TTL_TYPE",
           "SINGLE_VALUE_KINDS", "read_timers", "timer_schema", "timer_counts", "TIMER_COUNTS_SCHEMA"]
