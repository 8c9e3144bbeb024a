"""The heap keyed state backend: Python objects in one dict per (state, key group), with copy-on-write snapshots
and lazy restore.

Copy-on-write, at key-group granularity (Flink's ``CopyOnWriteStateMap`` keeps versions per entry; a dict per key
group gives the same guarantee with C-speed shallow copies): a snapshot's synchronous part only captures the list of
per-key-group dicts and marks them shared. The first write to a shared key group replaces its dict by a shallow copy;
mutable values (lists, maps, mutable accumulators) are then copied per entry when first read or written, so nothing
the background writer holds is ever mutated. Once no snapshot is running, every access takes the fast path again.

Lazy restore: a restored key group keeps the snapshot's block (one buffer and two offset arrays per state, not one
object per entry) until the first access to that key group; then only its keys are decoded (``deserialize_many``),
and every value stays bytes until its key is first read. A snapshot taken before that writes the original bytes back
untouched (an untouched key group is handed to the writer as one packed buffer).

Hot paths: ``set_current_key`` and the value / list / map operations are compiled (``_native/statecore.pyx``); they
read the dicts directly and hand over to the Python methods here only while a snapshot runs or for a key group that
still holds undecoded restored entries. TTL states and the rarer operations use the generic classes of ``states``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from keygroups._hashing import KeyType
from keygroups._native.statecore import HeapListCore, HeapMapCore, HeapValueCore, TableCore
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import KeyedStateHandle, Packed, read_key_group_offsets
from keygroups.errors import CorruptSnapshotError, no_current_key_error
from keygroups.serializers import TypeSerializer
from keygroups.state._base import KeyedStateBackendBase, SnapshotFuture
from keygroups.state._codec import ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.states import MISSING, ListState, MapState, ValueState

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointStorage


class _NoKey(dict):  # type: ignore[type-arg]
    """Sits in the extra last slot (key-group index ``n``, where the key context points before any
    ``set_current_key``) so that state access without a key fails clearly at no cost to the normal path."""

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise no_current_key_error()

    get = __getitem__ = __setitem__ = __delitem__ = pop = setdefault = __contains__ = _fail  # type: ignore


_NO_KEY = _NoKey()


class _Section(NamedTuple):
    """One state's restored entries of one key group, as the snapshot file holds them: entry ``i``'s key is
    ``block[key_offsets[i]:key_offsets[i + 1]]``, its value likewise with ``value_offsets`` (n + 1 offsets each;
    int64 arrays while pending, lists once the keys are decoded)."""

    block: Any
    key_offsets: Any
    value_offsets: Any


class _HeapTable(TableCore):
    """All entries of one state, per key group ``start + i`` (every per-group list has one extra last slot, index
    ``n``, for "no current key"). A key is in at most one of ``maps[i]``, ``raw_entries[i]`` and
    ``pending_sections[i]``.

    Inherited from the compiled ``TableCore`` (read by the fast paths): ``maps[i]`` the decoded values (key ->
    value); ``ctx`` the backend's key context; ``cow`` whether a running snapshot may hold this table's dicts;
    ``lazy[i]`` whether key group ``i`` still holds restored entries that are not decoded; ``slow`` = ``cow`` or
    any ``lazy``: the fast paths hand over to the Python methods below."""

    __slots__ = ("backend", "name", "meta", "descriptor", "read_framing", "write_framing", "needs_migration",
                 "copy_value", "group_count", "raw_entries", "raw_sections", "pending_sections", "shared",
                 "copied_keys", "lazy_group_count")

    #: The backend this table belongs to (its key serializer and clock).
    backend: HeapKeyedStateBackend
    #: The state's name and its meta as written to snapshots (name, kind, serializer snapshots, TTL).
    name: str
    meta: dict[str, Any]
    #: The registered descriptor; None for restored state nobody registered yet.
    descriptor: StateDescriptor | None
    #: Decodes stored bytes (the serializers the bytes were written with) / encodes values (the registered ones).
    read_framing: ValueFraming
    write_framing: ValueFraming
    #: Stored bytes must be re-encoded on their way out: read and write framings differ.
    needs_migration: bool
    #: A deep copy of one stored value, for copy-on-write; None when values are never mutated in place.
    copy_value: Callable[[Any], Any] | None
    #: Key groups in the backend's range (``n``).
    group_count: int
    #: Per key group: restored keys whose value is still bytes -> entry index in ``raw_sections[i]`` (entry
    #: ``idx`` is entry ``idx // len(sections)`` of section ``idx % len(sections)``); None when there are none.
    raw_entries: list[dict[Any, int] | None]
    #: Per key group: the restored sections ``raw_entries`` points into.
    raw_sections: list[list[_Section] | None]
    #: Per key group: restored sections whose keys are not decoded yet (decoded on the group's first access).
    pending_sections: list[list[_Section] | None]
    #: Per key group: ``maps[i]`` (and ``raw_entries[i]``) are also held by a running snapshot; copy before writing.
    shared: list[bool]
    #: Per key group: keys whose value was already copied since the last snapshot (None: copy nothing, i.e. the
    #: group is not shared with a snapshot, or values are never mutated in place).
    copied_keys: list[set[Any] | None]
    #: Key groups with ``lazy[i]`` set.
    lazy_group_count: int

    def __init__(self, backend: HeapKeyedStateBackend, name: str, meta: dict[str, Any], read: ValueFraming,
                 write: ValueFraming, descriptor: StateDescriptor | None) -> None:
        n = backend._n
        self.backend = backend
        self.ctx = backend._ctx
        self.name = name
        self.group_count = n
        self.maps: list[dict[Any, Any]] = [{} for _ in range(n)]
        self.maps.append(_NO_KEY)
        self.raw_entries = [None] * (n + 1)
        self.raw_sections = [None] * (n + 1)
        self.pending_sections = [None] * (n + 1)
        self.shared = [False] * (n + 1)
        self.copied_keys = [None] * (n + 1)
        self.cow = backend._running_snapshots > 0  # registered while a snapshot runs: nothing of ours is captured
        self.lazy_group_count = 0
        self.lazy = [False] * (n + 1)
        self.slow = self.cow
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                  descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read_framing = read
        self.write_framing = write
        self.descriptor = descriptor
        self.copy_value = write.copy
        self.needs_migration = read.needs_migration_to(write)

    def _update_slow(self) -> None:
        self.slow = self.cow or self.lazy_group_count > 0

    def _ttl_deadline(self) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptor)

    # ---- store interface used by the state types (current key of the backend) -------------------------------------
    def get(self) -> Any:
        c = self.ctx
        if self.slow:
            return self._get_slow(c.kgi, c.key)
        return self.maps[c.kgi].get(c.key, MISSING)

    def put(self, value: Any) -> None:
        c = self.ctx
        if self.slow:
            self._prepare_write(c.kgi, c.key)
        self.maps[c.kgi][c.key] = value

    def delete(self) -> None:
        c = self.ctx
        if self.slow:
            self._prepare_write(c.kgi, c.key)
        self.maps[c.kgi].pop(c.key, None)

    def append(self, items: list[Any]) -> None:
        c = self.ctx
        group_index, key = c.kgi, c.key
        if self.slow:
            cur = self._get_slow(group_index, key)
            if cur is MISSING:
                self._prepare_write(group_index, key)
                self.maps[group_index][key] = items
            else:
                cur.extend(items)
            return
        m = self.maps[group_index]
        cur = m.get(key)
        if cur is None:
            m[key] = items
        else:
            cur.extend(items)

    # ---- slow path: lazy restore and copy-on-write -----------------------------------------------------------------
    def _materialize(self, group_index: int) -> None:
        """Decode a restored key group's keys; values stay bytes (``raw_entries``)."""
        sections = self.pending_sections[group_index] or []
        self.pending_sections[group_index] = None
        decode_keys = self.backend.key_serializer.deserialize_many
        deadline = self._ttl_deadline()
        section_count = len(sections)
        raw: dict[Any, int] = {}
        decoded: dict[Any, Any] = {}
        kept_sections = []
        for section_index, (block, key_offsets, value_offsets) in enumerate(sections):
            keys = decode_keys(block, key_offsets)
            value_offsets = value_offsets.tolist()
            kept_sections.append(_Section(block, key_offsets.tolist(), value_offsets))
            if deadline is None:
                if section_count == 1:
                    raw.update(zip(keys, range(len(keys))))
                else:
                    raw.update((k, i * section_count + section_index) for i, k in enumerate(keys))
                continue
            drop = self.read_framing.drop_expired_bytes
            for i, k in enumerate(keys):
                value_bytes = block[value_offsets[i]:value_offsets[i + 1]]
                kept = drop(value_bytes, deadline)
                if kept is None:
                    continue
                if kept is value_bytes:
                    raw[k] = i * section_count + section_index
                else:  # partly expired list or map: keep what is left, decoded
                    decoded[k] = self.read_framing.decode(kept)
        if decoded:
            if self.shared[group_index]:  # never write into a dict a running snapshot holds
                self._unshare(group_index)
            self.maps[group_index].update(decoded)
            copied = self.copied_keys[group_index]
            if copied is not None:
                copied.update(decoded)
        self.raw_sections[group_index] = kept_sections
        self.raw_entries[group_index] = raw or None
        if not raw:
            self._group_decoded(group_index)

    def _group_decoded(self, group_index: int) -> None:
        self.lazy[group_index] = False
        self.lazy_group_count -= 1
        self._update_slow()

    def _raw_value(self, group_index: int, entry: int) -> Any:
        sections: Any = self.raw_sections[group_index]
        section_count = len(sections)
        block, _, value_offsets = sections[entry % section_count]
        i = entry // section_count
        return block[value_offsets[i]:value_offsets[i + 1]]

    def _unshare(self, group_index: int) -> None:
        self.maps[group_index] = dict(self.maps[group_index])
        raw = self.raw_entries[group_index]
        if raw:
            self.raw_entries[group_index] = dict(raw)
        self.copied_keys[group_index] = set() if self.copy_value is not None else None
        self.shared[group_index] = False

    def _prepare_write(self, group_index: int, key: Any) -> None:
        if self.pending_sections[group_index] is not None:
            self._materialize(group_index)
        if self.shared[group_index]:
            self._unshare(group_index)
        raw = self.raw_entries[group_index]
        if raw and key in raw:
            del raw[key]
            if not raw:
                self.raw_entries[group_index] = None
                self._group_decoded(group_index)
        copied = self.copied_keys[group_index]
        if copied is not None:
            copied.add(key)

    def _get_slow(self, group_index: int, key: Any) -> Any:
        if self.pending_sections[group_index] is not None:
            self._materialize(group_index)
        v = self.maps[group_index].get(key, MISSING)
        if v is MISSING:
            raw = self.raw_entries[group_index]
            if not raw:
                return MISSING
            entry = raw.get(key)
            if entry is None:
                return MISSING
            v = self.read_framing.decode(self._raw_value(group_index, entry))
            self._prepare_write(group_index, key)
            self.maps[group_index][key] = v
            return v
        if self.copy_value is not None and self.cow:
            if self.shared[group_index]:
                self._unshare(group_index)
            copied = self.copied_keys[group_index]
            if copied is not None and key not in copied:
                v = self.copy_value(v)
                self.maps[group_index][key] = v
                copied.add(key)
        return v

    # ---- whole-table operations ------------------------------------------------------------------------------------
    def has_data(self) -> bool:
        return self.lazy_group_count > 0 or any(self.maps[i] for i in range(self.group_count))

    def add_section(self, group_index: int, block: Any, key_offsets: Any, value_offsets: Any) -> None:
        pending = self.pending_sections[group_index]
        if pending is None:
            if not self.raw_entries[group_index]:
                self.lazy_group_count += 1
            pending = self.pending_sections[group_index] = []
            self.lazy[group_index] = True
        pending.append(_Section(block, key_offsets, value_offsets))
        self._update_slow()

    def decode_all(self) -> None:
        """Eager restore: decode every restored entry now."""
        read = self.read_framing
        decode_keys = self.backend.key_serializer.deserialize_many
        fast = self._ttl_deadline() is None
        for i in range(self.group_count):
            pending = self.pending_sections[i]
            if pending is not None and fast and not self.raw_entries[i]:
                m = self.maps[i]
                for block, key_offsets, value_offsets in pending:
                    m.update(zip(decode_keys(block, key_offsets), read.decode_many(block, value_offsets)))
                self.pending_sections[i] = None
                self._group_decoded(i)
                continue
            if pending is not None:
                self._materialize(i)
            raw = self.raw_entries[i]
            if raw:
                m = self.maps[i]
                sections: Any = self.raw_sections[i]
                if len(sections) == 1 and len(raw) == len(sections[0].key_offsets) - 1:
                    block, _, value_offsets = sections[0]
                    m.update(zip(raw, read.decode_many(block, value_offsets)))  # raw's keys are in entry order
                else:
                    for k, entry in raw.items():
                        m[k] = read.decode(self._raw_value(i, entry))
                self.raw_entries[i] = None
                self.raw_sections[i] = None
                self._group_decoded(i)
        self._update_slow()

    def keys_of_group(self, group_index: int) -> list[Any]:
        if self.pending_sections[group_index] is not None:
            self._materialize(group_index)
        m = self.maps[group_index]
        raw = self.raw_entries[group_index]
        return list(m) + list(raw) if raw else list(m)


@dataclass(frozen=True, slots=True)
class _Capture:
    """What a snapshot's synchronous part took of one table: per key group, the objects the table held then (the
    table copies a shared key group before changing it, so these never change), and how to write them."""

    maps: list[dict[Any, Any]]
    raw_entries: list[dict[Any, int] | None]
    raw_sections: list[list[_Section] | None]
    pending_sections: list[list[_Section] | None]
    read_framing: ValueFraming
    write_framing: ValueFraming
    needs_migration: bool
    ttl_deadline: int | None


# The non-TTL value, list and map states with their fast paths compiled (``_native/statecore.pyx``); same semantics
# as the generic classes in states.py.
class _HeapValue(HeapValueCore, ValueState):
    __slots__ = ()


class _HeapList(HeapListCore, ListState):
    __slots__ = ()


class _HeapMap(HeapMapCore, MapState):
    __slots__ = ()


_HEAP_CLASSES = {"value": _HeapValue, "list": _HeapList, "map": _HeapMap}


class HeapKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range, held as Python objects.

    ``key_serializer`` serializes keys in snapshots (it must be deterministic); ``key_type`` is the Java type keys
    hash as (see ``keygroups.assign_to_key_group``); ``clock`` (seconds, like ``time.time``) drives TTL;
    ``allow_pickle`` lets restore read pickled serializer data; ``subtask_index`` is recorded in snapshot handles.
    ``dispose()`` (or leaving a ``with`` block) does nothing here: the state is garbage-collected with the backend.
    """

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer, key_type=key_type, clock=clock,
                         allow_pickle=allow_pickle, subtask_index=subtask_index)
        self.set_current_key = self._ctx.set_current_key  # type: ignore[method-assign]  # no Python-level hop
        self._tables: dict[str, _HeapTable] = {}
        self._running_snapshots = 0
        self._snap_lock = threading.Lock()

    # ---- hooks of the base ----------------------------------------------------------------------------------------
    def _state_class(self, kind: str, ttl: bool) -> type:
        if not ttl and kind in _HEAP_CLASSES:
            return _HEAP_CLASSES[kind]
        return super()._state_class(kind, ttl)

    def _has_data(self) -> bool:
        return any(t.has_data() for t in self._tables.values())

    def _new_table(self, name: str, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                   d: StateDescriptor | None) -> _HeapTable:
        t = self._tables[name] = _HeapTable(self, name, meta, read, write, d)
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: ValueFraming, write: ValueFraming) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
        else:
            t.configure(meta, read, write, d)

    def _store(self, name: str) -> _HeapTable:
        return self._tables[name]

    def _restore_handle(self, storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange,
                        targets: list[Any]) -> tuple[int, int]:
        blocks, nbytes = read_key_group_offsets(storage, handle, key_groups)
        groups = 0
        for kg, block, sections in blocks:
            groups += 1
            group_index = kg - self._start
            for state_index, key_offsets, value_offsets in sections:
                self._check_state_index(handle, kg, state_index, targets)
                if len(key_offsets) != len(value_offsets):
                    raise CorruptSnapshotError(f"{handle.file}: key group {kg}, state {state_index}: "
                                               f"{len(key_offsets) - 1} keys but {len(value_offsets) - 1} values")
                if len(key_offsets) > 1:
                    targets[state_index].add_section(group_index, block, key_offsets, value_offsets)
        return nbytes, groups

    def _after_restore(self, lazy: bool) -> None:
        if not lazy:
            for t in self._tables.values():
                t.decode_all()

    # ---- iteration ------------------------------------------------------------------------------------------------
    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, key group by key group (expired TTL entries that were
        not cleaned up yet included, as in Flink)."""
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        for i in range(self._n):
            yield from t.keys_of_group(i)

    # ---- snapshots ------------------------------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture[KeyedStateHandle]:
        """Capture a consistent view now (cheap: per key group, a reference; see the module docs) and write it to
        ``storage`` on the snapshot worker thread. Later writes to this backend never reach the snapshot."""
        n = self._n
        metas = []
        captures = []
        for t in self._tables.values():
            metas.append(t.meta)
            captures.append(_Capture(t.maps[:n], t.raw_entries[:n], t.raw_sections[:n], t.pending_sections[:n],
                                     t.read_framing, t.write_framing, t.needs_migration, t._ttl_deadline()))
        with self._snap_lock:
            self._running_snapshots += 1
            for t in self._tables.values():
                t.shared = [True] * n + [False]
                t.copied_keys = [None] * (n + 1)
                t.cow = True
                t._update_slow()

        def work(future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
            try:
                return self._write_snapshot(checkpoint_id, storage, metas, self._groups(captures), future)
            finally:
                self._release_snapshot()

        return SnapshotFuture.start(work, name=f"keyed-{self.subtask_index} chk-{checkpoint_id}")

    def _release_snapshot(self) -> None:
        with self._snap_lock:
            self._running_snapshots -= 1
            if self._running_snapshots:
                return
            n = self._n
            for t in list(self._tables.values()):
                t.cow = False
                t.shared = [False] * (n + 1)
                t.copied_keys = [None] * (n + 1)
                t._update_slow()

    def _groups(self, captures: list[_Capture]) -> Iterator[tuple[int, list[Any]]]:
        key_ser = self.key_serializer
        serialize_key = key_ser.serialize
        start = self._start
        for i in range(self._n):
            sections: list[Any] = []
            for state_index, c in enumerate(captures):
                m, raw, pending = c.maps[i], c.raw_entries[i], c.pending_sections[i]
                if not (m or raw or pending):
                    continue
                write, deadline = c.write_framing, c.ttl_deadline
                if pending and not m and not raw and len(pending) == 1 and not c.needs_migration and deadline is None:
                    block, key_offsets, value_offsets = pending[0]  # an untouched restored key group: bytes as they are
                    sections.append((state_index, Packed(block, key_offsets), Packed(block, value_offsets)))
                    continue
                if (m and not raw and not pending and deadline is None and not write.ttl
                        and write.kind in ("value", "reducing", "aggregating")):
                    key_data, key_offsets = key_ser.serialize_many(list(m))
                    value_data, value_offsets = write.ser.serialize_many(list(m.values()))
                    sections.append((state_index, Packed(key_data, key_offsets), Packed(value_data, value_offsets)))
                    continue
                keys: list[Any] = []
                vals: list[Any] = []
                if m:
                    encode = write.encode
                    for k, v in m.items():
                        if deadline is not None:
                            v = write.drop_expired(v, deadline)
                            if v is None:
                                continue
                        keys.append(serialize_key(k))
                        vals.append(encode(v))
                if raw:
                    raw_sections: Any = c.raw_sections[i]
                    section_count = len(raw_sections)
                    entries = []
                    for entry in raw.values():
                        block, key_offsets, value_offsets = raw_sections[entry % section_count]
                        j = entry // section_count
                        entries.append((block[key_offsets[j]:key_offsets[j + 1]],
                                        block[value_offsets[j]:value_offsets[j + 1]]))
                    self._pass_through(entries, keys, vals, c)
                if pending:
                    for block, key_offsets, value_offsets in pending:
                        key_at, value_at = key_offsets.tolist(), value_offsets.tolist()
                        entries = [(block[key_at[j]:key_at[j + 1]], block[value_at[j]:value_at[j + 1]])
                                   for j in range(len(key_at) - 1)]
                        self._pass_through(entries, keys, vals, c)
                if keys:
                    sections.append((state_index, keys, vals))
            yield start + i, sections

    @staticmethod
    def _pass_through(entries: Any, keys: list[Any], vals: list[Any], capture: _Capture) -> None:
        """Restored entries that were never decoded go back out as the same bytes (re-encoded only to migrate)."""
        read, write, deadline = capture.read_framing, capture.write_framing, capture.ttl_deadline
        for key_bytes, value_bytes in entries:
            if capture.needs_migration:
                value_bytes = write.encode(read.decode(value_bytes))
            if deadline is not None:
                value_bytes = write.drop_expired_bytes(value_bytes, deadline)
                if value_bytes is None:
                    continue
            keys.append(key_bytes)
            vals.append(value_bytes)


__all__ = ["HeapKeyedStateBackend"]
