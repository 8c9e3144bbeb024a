"""The RocksDB keyed state backend (on ``rocksdict``): state lives serialized in a local RocksDB per backend.

Database keys are ``key group (u16 BE) | state id (u16 BE) | u32 BE key length | key bytes``, so one key group is one
contiguous key range and a snapshot is one ordered scan. Map states, as in Flink, keep one database entry per map
entry: the key above followed by the serialized user key (the length prefix keeps keys prefix-free), the value being
``[i64 timestamp |] user value bytes``. Other states keep one database value per key, exactly the per-key value
encoding of the snapshot file format (``keygroups.state._codec``); a list append concatenates bytes without
decoding. A snapshot turns the entries back into that encoding; a restore splits it.

Snapshots: the synchronous part is a RocksDB checkpoint (a flush and hard links: a consistent, immutable copy); the
snapshot worker thread scans that copy into the snapshot file and deletes it.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import rocksdict

from keygroups._hashing import KeyType
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import KeyedStateHandle
from keygroups.errors import CorruptSnapshotError, no_current_key_error
from keygroups.serializers import TypeSerializer
from keygroups.state._base import KeyedStateBackendBase, SnapshotFuture
from keygroups.state._codec import ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.states import MISSING, MapState

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointStorage

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")


def _next_prefix(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix`` (prefixes here start with a key group < 2^15,
    so the first byte is never 0xFF and a carry always stops)."""
    b = bytearray(prefix)
    while b[-1] == 0xFF:
        b.pop()
    b[-1] += 1
    return bytes(b)


def _rows_to_value(state: str, rows: list[tuple[bytes, bytes]], ttl: bool) -> bytes:
    """Map entries stored as rows (user key bytes, [timestamp |] user value bytes) -> the map's value encoding."""
    parts: list[bytes] = []
    for ukb, stored in rows:
        n = len(stored) - 8 if ttl else len(stored)
        if n < 0:
            raise CorruptSnapshotError(f"state {state!r}: a TTL map entry of {len(stored)} bytes has no timestamp")
        parts += (_U32.pack(len(ukb)), ukb, _U32.pack(n), stored)
    return b"".join(parts)


def _value_to_rows(framing: ValueFraming, value: Any) -> list[tuple[bytes, bytes]]:
    """A map's value encoding -> rows (user key bytes, [timestamp |] user value bytes)."""
    if framing.ttl:
        return [(bytes(kb), _I64.pack(ts) + bytes(vb)) for kb, ts, vb in framing.entries(value)]
    return [(bytes(kb), bytes(vb)) for kb, _, vb in framing.entries(value)]


def _open(path: str) -> rocksdict.Rdict:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    return rocksdict.Rdict(path, opts)


class _RocksTable:
    """One state's view of the backend's database: its state id, framings, and the current key's rows."""

    __slots__ = ("backend", "db", "name", "state_id", "state_id_bytes", "meta", "descriptor", "read_framing",
                 "write_framing", "needs_migration", "is_map")

    def __init__(self, backend: RocksDBKeyedStateBackend, db: rocksdict.Rdict, name: str, state_id: int,
                 meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                 descriptor: StateDescriptor | None) -> None:
        self.backend = backend
        self.db = db
        self.name = name
        self.state_id = state_id
        self.state_id_bytes = _U16.pack(state_id)
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                  descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read_framing = read
        self.write_framing = write
        self.descriptor = descriptor
        self.is_map = meta["kind"] == "map"
        self.needs_migration = read.needs_migration_to(write)

    def _key(self) -> bytes:
        """The current key's database key in this state (the common prefix of a map's rows)."""
        return self.backend._current_db_key(self.state_id_bytes)

    def rows(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The map entries of one key: (user key bytes, stored value)."""
        out = []
        n = len(prefix)
        for k, v in self.db.items(from_key=prefix):
            k = cast(bytes, k)
            if not k.startswith(prefix):
                break
            out.append((k[n:], cast(bytes, v)))
        return out

    def delete_rows(self, prefix: bytes) -> None:
        self.db.delete_range(prefix, _next_prefix(prefix))

    # ---- store interface (maps: the whole map of the current key, for the generic TTL map state) -----------------
    def get(self) -> Any:
        write = self.write_framing
        if self.is_map:
            rows = self.rows(self._key())
            return write.decode(_rows_to_value(self.name, rows, write.ttl)) if rows else MISSING
        v = self.db.get(self._key())
        return MISSING if v is None else write.decode(v)

    def put(self, value: Any) -> None:
        k = self._key()
        if self.is_map:
            self.delete_rows(k)
            batch = rocksdict.WriteBatch(raw_mode=True)
            for user_key_bytes, stored in _value_to_rows(self.write_framing, self.write_framing.encode(value)):
                batch.put(k + user_key_bytes, stored)
            self.db.write(batch)
            return
        self.db.put(k, self.write_framing.encode(value))

    def delete(self) -> None:
        if self.is_map:
            self.delete_rows(self._key())
        else:
            self.db.delete(self._key())

    def append(self, items: list[Any]) -> None:
        db = self.db
        k = self._key()
        cur = db.get(k)
        enc = self.write_framing.encode(items)
        db.put(k, enc if cur is None else cur + enc)

    def ttl_deadline(self) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptor)


def _split_db_key(k: bytes) -> tuple[int, int, bytes, bytes]:
    """(key group, state id, key bytes, the rest: a map entry's user key bytes, else empty)."""
    if len(k) < 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} is shorter than its 8-byte prefix")
    kg, state_id = k[0] << 8 | k[1], k[2] << 8 | k[3]
    (key_length,) = _U32.unpack_from(k, 4)
    if key_length > len(k) - 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} says {key_length} key bytes but has {len(k) - 8}")
    return kg, state_id, k[8:8 + key_length], k[8 + key_length:]


class _RocksMap(MapState):
    """MapState without TTL on per-entry rows: get/put/remove touch one database entry."""

    __slots__ = ("_t", "_uks", "_uvs", "_ukd", "_uvd")

    def __init__(self, store: _RocksTable, descriptor: Any, backend: Any) -> None:
        self._t = store
        uk, uv = descriptor.serializers["map key"], descriptor.serializers["map value"]
        self._uks, self._uvs, self._ukd, self._uvd = uk.serialize, uv.serialize, uk.deserialize, uv.deserialize

    def get(self, key: Any) -> Any:
        v = self._t.db.get(self._t._key() + self._uks(key))
        return None if v is None else self._uvd(v)

    def contains(self, key: Any) -> bool:
        return self._t.db.get(self._t._key() + self._uks(key)) is not None

    def put(self, key: Any, value: Any) -> None:
        self._t.db.put(self._t._key() + self._uks(key), self._uvs(value))

    def put_all(self, mapping: dict[Any, Any]) -> None:
        p = self._t._key()
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in mapping.items():
            batch.put(p + self._uks(k), self._uvs(v))
        self._t.db.write(batch)

    def remove(self, key: Any) -> None:
        self._t.db.delete(self._t._key() + self._uks(key))

    def items(self) -> list[tuple[Any, Any]]:
        return [(self._ukd(k), self._uvd(v)) for k, v in self._t.rows(self._t._key())]

    def is_empty(self) -> bool:
        p = self._t._key()
        for k in self._t.db.keys(from_key=p):
            return not cast(bytes, k).startswith(p)
        return True

    def clear(self) -> None:
        self._t.delete_rows(self._t._key())


class RocksDBKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range in a local RocksDB; same interface and snapshot format as
    ``HeapKeyedStateBackend``. ``db_dir``: parent directory of the database (a temporary directory by default);
    the database is deleted by ``dispose()`` (or on leaving a ``with`` block), at the latest when the backend is
    garbage-collected."""

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0, db_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer, key_type=key_type, clock=clock,
                         allow_pickle=allow_pickle, subtask_index=subtask_index)
        self._dir = tempfile.mkdtemp(prefix="keygroups-rocksdb-", dir=db_dir)
        self._db = _open(os.path.join(self._dir, "db"))
        self._finalizer = weakref.finalize(self, RocksDBKeyedStateBackend._cleanup, self._db, self._dir)
        self._tables: dict[str, _RocksTable] = {}
        self._current_group_bytes: bytes | None = None  # u16 BE key group of the current key
        self._current_key_bytes: bytes | None = None  # u32 BE length | serialized current key
        self._serialize_key = self.key_serializer.serialize

    @staticmethod
    def _cleanup(db: rocksdict.Rdict, path: str) -> None:
        try:
            db.close()
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def dispose(self) -> None:
        """Close and delete the local database (once; later calls do nothing)."""
        self._finalizer()

    def set_current_key(self, key: Any) -> None:
        super().set_current_key(key)
        key_bytes = self._serialize_key(key)
        self._current_group_bytes = _U16.pack(self._start + self._ctx.kgi)
        self._current_key_bytes = _U32.pack(len(key_bytes)) + key_bytes

    def _current_db_key(self, state_id_bytes: bytes) -> bytes:
        """The current key's database key in the state ``state_id_bytes``: key group | state id | key."""
        group, key = self._current_group_bytes, self._current_key_bytes
        if group is None or key is None:
            raise no_current_key_error()
        return group + state_id_bytes + key

    # ---- hooks ------------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        for _ in self._db.keys():
            return True
        return False

    def _new_table(self, name: str, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                   d: StateDescriptor | None) -> _RocksTable:
        state_id = len(self._tables)
        if state_id > 0xFFFF:
            raise ValueError(f"a RocksDB backend holds at most 65536 states; {name!r} would be one more")
        t = _RocksTable(self, self._db, name, state_id, meta, read, write, d)
        self._tables[name] = t
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: ValueFraming, write: ValueFraming) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
            return
        t.configure(meta, read, write, d)
        if t.needs_migration or t.ttl_deadline() is not None:
            self._rewrite(t)  # restored bytes were ingested as written by the old serializers

    def _rewrite(self, t: _RocksTable) -> None:
        """Re-encode (migrate) and TTL-clean every stored value of ``t`` in place."""
        deadline = t.ttl_deadline()
        read, write = t.read_framing, t.write_framing
        batch = rocksdict.WriteBatch(raw_mode=True)

        def redo(prefix: bytes, old: Any, old_keys: list[bytes]) -> None:
            v = write.encode(read.decode(old)) if t.needs_migration else old
            if deadline is not None:
                v = write.drop_expired_bytes(v, deadline)
            for k in old_keys:
                batch.delete(k)
            if v is None:
                return
            if t.is_map:
                for user_key_bytes, stored in _value_to_rows(write, v):
                    batch.put(prefix + user_key_bytes, stored)
            else:
                batch.put(prefix, v)

        group: tuple[bytes, list[tuple[bytes, bytes]], list[bytes]] | None = None  # one map key's rows
        for k, v in self._db.items():
            k, v = cast(bytes, k), cast(bytes, v)
            if k[2:4] != t.state_id_bytes:
                continue
            if not t.is_map:
                redo(k, v, [k])
                continue
            _, _, key_bytes, user_key_bytes = _split_db_key(k)
            prefix = k[:8 + len(key_bytes)]
            if group is not None and group[0] != prefix:
                redo(group[0], _rows_to_value(t.name, group[1], read.ttl), group[2])
                group = None
            if group is None:
                group = (prefix, [], [])
            group[1].append((user_key_bytes, v))
            group[2].append(k)
        if group is not None:
            redo(group[0], _rows_to_value(t.name, group[1], read.ttl), group[2])
        self._db.write(batch)
        t.configure(t.meta, write, write, t.descriptor)

    def _store(self, name: str) -> _RocksTable:
        return self._tables[name]

    def _state_class(self, kind: str, ttl: bool) -> type:
        if kind == "map" and not ttl:
            return _RocksMap
        return super()._state_class(kind, ttl)

    def _restore_section(self, target: _RocksTable, group_index: int, keys: list[Any], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise CorruptSnapshotError(f"state {target.name!r}: a section has {len(keys)} keys and {len(values)} "
                                       "values")
        prefix = _U16.pack(self._start + group_index) + target.state_id_bytes
        read, write = target.read_framing, target.write_framing
        batch = rocksdict.WriteBatch(raw_mode=True)
        deadline = target.ttl_deadline()
        for key_bytes, value_bytes in zip(keys, values):
            if target.needs_migration:
                value_bytes = write.encode(read.decode(value_bytes))
            if deadline is not None:
                value_bytes = write.drop_expired_bytes(value_bytes, deadline)
                if value_bytes is None:
                    continue
            k = prefix + _U32.pack(len(key_bytes)) + bytes(key_bytes)
            if target.is_map:
                for user_key_bytes, stored in _value_to_rows(write if target.needs_migration else read, value_bytes):
                    batch.put(k + user_key_bytes, stored)
            else:
                batch.put(k, bytes(value_bytes))
        self._db.write(batch)

    def _after_restore(self, lazy: bool) -> None:
        for t in self._tables.values():
            if t.descriptor is not None:
                t.configure(t.meta, t.write_framing, t.write_framing, t.descriptor)

    # ---- iteration --------------------------------------------------------------------------------------------------
    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, in key-group order."""
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        deserialize_key = self.key_serializer.deserialize
        last = None
        for k in list(self._db.keys()):
            k = cast(bytes, k)
            if k[2:4] == t.state_id_bytes:
                key_bytes = _split_db_key(k)[2]
                if key_bytes != last:  # a map's entries of one key are adjacent
                    last = key_bytes
                    yield deserialize_key(key_bytes)

    # ---- snapshots --------------------------------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture[KeyedStateHandle]:
        """Take a RocksDB checkpoint now (consistent and cheap: flush + hard links) and write it to ``storage`` on
        the snapshot worker thread."""
        tables = list(self._tables.values())
        metas = [t.meta for t in tables]
        deadlines = {t.state_id: t.ttl_deadline() for t in tables}
        framings = {t.state_id: t.write_framing for t in tables}
        maps = {t.state_id: t.name for t in tables if t.is_map}
        cp_dir = tempfile.mkdtemp(prefix="cp-", dir=self._dir)
        os.rmdir(cp_dir)  # RocksDB creates it
        rocksdict.Checkpoint(self._db).create_checkpoint(cp_dir)

        def work(future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
            cp = _open(cp_dir)
            try:
                return self._write_snapshot(checkpoint_id, storage, metas,
                                            self._groups(cp, deadlines, framings, maps), future)
            finally:
                cp.close()
                shutil.rmtree(cp_dir, ignore_errors=True)

        return SnapshotFuture.start(work, name=f"keyed-{self.subtask_index} chk-{checkpoint_id} (rocksdb)")

    @staticmethod
    def _groups(cp: rocksdict.Rdict, deadlines: dict[int, int | None], framings: dict[int, ValueFraming],
                maps: dict[int, str]) -> Iterator[tuple[int, list[Any]]]:
        """The checkpoint's rows, key group by key group, as snapshot sections (a map key's rows joined into the
        map's value encoding)."""
        cur_kg = -1
        sections: dict[int, tuple[list[Any], list[Any]]] = {}
        entry: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None  # a map key's rows being gathered

        def add(state_id: int, key_bytes: bytes, v: Any) -> None:
            deadline = deadlines.get(state_id)
            if deadline is not None:
                v = framings[state_id].drop_expired_bytes(v, deadline)
                if v is None:
                    return
            sec = sections.get(state_id)
            if sec is None:
                sec = sections[state_id] = ([], [])
            sec[0].append(key_bytes)
            sec[1].append(v)

        def close_entry() -> None:
            nonlocal entry
            if entry is not None:
                state_id, key_bytes, rows = entry
                add(state_id, key_bytes, _rows_to_value(maps[state_id], rows, framings[state_id].ttl))
                entry = None

        for k, v in cp.items():
            kg, state_id, key_bytes, user_key_bytes = _split_db_key(cast(bytes, k))
            if entry is not None and (kg != cur_kg or state_id != entry[0] or key_bytes != entry[1]):
                close_entry()
            if kg != cur_kg:
                if cur_kg >= 0:
                    yield cur_kg, [(s, ks, vs) for s, (ks, vs) in sorted(sections.items())]
                cur_kg = kg
                sections = {}
            if state_id in maps:
                if entry is None:
                    entry = (state_id, key_bytes, [])
                entry[2].append((user_key_bytes, cast(bytes, v)))
            else:
                add(state_id, key_bytes, v)
        close_entry()
        if cur_kg >= 0:
            yield cur_kg, [(s, ks, vs) for s, (ks, vs) in sorted(sections.items())]


__all__ = ["RocksDBKeyedStateBackend"]
