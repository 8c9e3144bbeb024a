"""The RocksDB keyed state backend (on ``rocksdict``): state lives serialized in a local RocksDB per backend.

Database keys are ``key group (u16 BE) | state id (u16 BE) | u32 BE key length | key bytes``, so one key group is one
contiguous key range and a snapshot is one ordered scan. Map states, as in Flink, keep one database entry per map
entry: the key above followed by the serialized user key (the length prefix keeps keys prefix-free), the value being
``[i64 timestamp |] user value bytes``. Other states keep one database value per key, exactly the per-key value
encoding of the snapshot file format (``keygroups.state._codec``); a list append concatenates bytes without
decoding. A snapshot turns the entries back into that encoding; a restore splits it.

Snapshots: the synchronous part is a RocksDB checkpoint (a flush and hard links: a consistent, immutable copy); the
background thread scans that copy into the snapshot file and deletes it.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import rocksdict

from keygroups.errors import CorruptSnapshotError
from keygroups.state._base import KeyedStateBackendBase, SnapshotFuture, check_cancel
from keygroups.state._codec import Codec
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


def _value_to_rows(codec: Codec, value: Any) -> list[tuple[bytes, bytes]]:
    """A map's value encoding -> rows (user key bytes, [timestamp |] user value bytes)."""
    if codec.ttl:
        return [(bytes(kb), _I64.pack(ts) + bytes(vb)) for kb, ts, vb in codec.entries(value)]
    return [(bytes(kb), bytes(vb)) for kb, _, vb in codec.entries(value)]


def _open(path: str) -> rocksdict.Rdict:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    return rocksdict.Rdict(path, opts)


class _RocksTable:
    __slots__ = ("b", "name", "sid", "sid_int", "meta", "descriptor", "read", "write", "migrate", "is_map")

    def __init__(self, backend: RocksDBKeyedStateBackend, name: str, sid: int, meta: dict[str, Any], read: Codec,
                 write: Codec, descriptor: StateDescriptor | None) -> None:
        self.b = backend
        self.name = name
        self.sid_int = sid
        self.sid = _U16.pack(sid)
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: Codec, write: Codec, descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read = read
        self.write = write
        self.descriptor = descriptor
        self.is_map = meta["kind"] == "map"
        self.migrate = read.needs_migration_to(write)

    def _key(self) -> bytes:
        b = self.b
        if b._kb is None or b._kgb is None:
            raise RuntimeError("no current key: call set_current_key(key) on the backend before using keyed state")
        return b._kgb + self.sid + b._kb

    def rows(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The map entries of one key: (user key bytes, stored value)."""
        out = []
        n = len(prefix)
        for k, v in self.b._db.items(from_key=prefix):
            k = cast(bytes, k)
            if not k.startswith(prefix):
                break
            out.append((k[n:], cast(bytes, v)))
        return out

    def delete_rows(self, prefix: bytes) -> None:
        self.b._db.delete_range(prefix, _next_prefix(prefix))

    # ---- store interface (maps: the whole map of the current key, for the generic TTL map state) -----------------
    def get(self) -> Any:
        if self.is_map:
            rows = self.rows(self._key())
            return self.write.decode(_rows_to_value(self.name, rows, self.write.ttl)) if rows else MISSING
        v = self.b._db.get(self._key())
        return MISSING if v is None else self.write.decode(v)

    def put(self, value: Any) -> None:
        k = self._key()
        if self.is_map:
            self.delete_rows(k)
            wb = rocksdict.WriteBatch(raw_mode=True)
            for ukb, stored in _value_to_rows(self.write, self.write.encode(value)):
                wb.put(k + ukb, stored)
            self.b._db.write(wb)
            return
        self.b._db.put(k, self.write.encode(value))

    def delete(self) -> None:
        if self.is_map:
            self.delete_rows(self._key())
        else:
            self.b._db.delete(self._key())

    def append(self, items: list[Any]) -> None:
        db = self.b._db
        k = self._key()
        cur = db.get(k)
        enc = self.write.encode(items)
        db.put(k, enc if cur is None else cur + enc)

    def ttl_deadline(self) -> int | None:
        d = self.descriptor
        if d is None or d.ttl_config is None or not d.ttl_config.cleanup_full_snapshot:
            return None
        return self.b._now_ms() - d.ttl_config.ttl_ms


def _split_db_key(k: bytes) -> tuple[int, int, bytes, bytes]:
    """(key group, state id, key bytes, the rest: a map entry's user key bytes, else empty)."""
    if len(k) < 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} is shorter than its 8-byte prefix")
    kg, sid = k[0] << 8 | k[1], k[2] << 8 | k[3]
    (ln,) = _U32.unpack_from(k, 4)
    if ln > len(k) - 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} says {ln} key bytes but has {len(k) - 8}")
    return kg, sid, k[8:8 + ln], k[8 + ln:]


class _RocksMap(MapState):
    """MapState without TTL on per-entry rows: get/put/remove touch one database entry."""

    __slots__ = ("_t", "_uks", "_uvs", "_ukd", "_uvd")

    def __init__(self, store: _RocksTable, descriptor: Any, backend: Any) -> None:
        self._t = store
        uk, uv = descriptor.serializers["map key"], descriptor.serializers["map value"]
        self._uks, self._uvs, self._ukd, self._uvd = uk.serialize, uv.serialize, uk.deserialize, uv.deserialize

    def get(self, key: Any) -> Any:
        v = self._t.b._db.get(self._t._key() + self._uks(key))
        return None if v is None else self._uvd(v)

    def contains(self, key: Any) -> bool:
        return self._t.b._db.get(self._t._key() + self._uks(key)) is not None

    def put(self, key: Any, value: Any) -> None:
        self._t.b._db.put(self._t._key() + self._uks(key), self._uvs(value))

    def put_all(self, mapping: dict[Any, Any]) -> None:
        p = self._t._key()
        wb = rocksdict.WriteBatch(raw_mode=True)
        for k, v in mapping.items():
            wb.put(p + self._uks(k), self._uvs(v))
        self._t.b._db.write(wb)

    def remove(self, key: Any) -> None:
        self._t.b._db.delete(self._t._key() + self._uks(key))

    def items(self) -> list[tuple[Any, Any]]:
        return [(self._ukd(k), self._uvd(v)) for k, v in self._t.rows(self._t._key())]

    def is_empty(self) -> bool:
        p = self._t._key()
        for k in self._t.b._db.keys(from_key=p):
            return not cast(bytes, k).startswith(p)
        return True

    def clear(self) -> None:
        self._t.delete_rows(self._t._key())


class RocksDBKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range in a local RocksDB; same interface and snapshot format as
    ``HeapKeyedStateBackend``. ``db_dir``: parent directory of the database (a temporary directory by default);
    the database is deleted by ``dispose()`` or when the backend is garbage-collected."""

    def __init__(self, *args: Any, db_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dir = tempfile.mkdtemp(prefix="keygroups-rocksdb-", dir=db_dir)
        self._db = _open(os.path.join(self._dir, "db"))
        self._finalizer = weakref.finalize(self, RocksDBKeyedStateBackend._cleanup, self._db, self._dir)
        self._tables: dict[str, _RocksTable] = {}
        self._kgb: bytes | None = None
        self._kb: bytes | None = None
        self._ks = self.key_serializer.serialize

    @staticmethod
    def _cleanup(db: rocksdict.Rdict, path: str) -> None:
        try:
            db.close()
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def dispose(self) -> None:
        """Close and delete the local database."""
        self._finalizer()

    close = dispose

    def set_current_key(self, key: Any) -> None:
        super().set_current_key(key)
        kb = self._ks(key)
        self._kgb = _U16.pack(self._start + self._ctx.kgi)
        self._kb = _U32.pack(len(kb)) + kb

    # ---- hooks ------------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        for _ in self._db.keys():
            return True
        return False

    def _new_table(self, name: str, meta: dict[str, Any], read: Codec, write: Codec,
                   d: StateDescriptor | None) -> _RocksTable:
        sid = len(self._tables)
        if sid > 0xFFFF:
            raise ValueError(f"a RocksDB backend holds at most 65536 states; {name!r} would be one more")
        t = _RocksTable(self, name, sid, meta, read, write, d)
        self._tables[name] = t
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: Codec, write: Codec) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
            return
        t.configure(meta, read, write, d)
        if t.migrate or t.ttl_deadline() is not None:
            self._rewrite(t)  # restored bytes were ingested as written by the old serializers

    def _rewrite(self, t: _RocksTable) -> None:
        """Re-encode (migrate) and TTL-clean every stored value of ``t`` in place."""
        deadline = t.ttl_deadline()
        wb = rocksdict.WriteBatch(raw_mode=True)

        def redo(prefix: bytes, old: Any, old_keys: list[bytes]) -> None:
            v = t.write.encode(t.read.decode(old)) if t.migrate else old
            if deadline is not None:
                v = t.write.drop_expired_bytes(v, deadline)
            for k in old_keys:
                wb.delete(k)
            if v is None:
                return
            if t.is_map:
                for ukb, stored in _value_to_rows(t.write, v):
                    wb.put(prefix + ukb, stored)
            else:
                wb.put(prefix, v)

        group: tuple[bytes, list[tuple[bytes, bytes]], list[bytes]] | None = None
        for k, v in self._db.items():
            k, v = cast(bytes, k), cast(bytes, v)
            if k[2:4] != t.sid:
                continue
            if not t.is_map:
                redo(k, v, [k])
                continue
            _, _, kb, ukb = _split_db_key(k)
            prefix = k[:8 + len(kb)]
            if group is not None and group[0] != prefix:
                redo(group[0], _rows_to_value(t.name, group[1], t.read.ttl), group[2])
                group = None
            if group is None:
                group = (prefix, [], [])
            group[1].append((ukb, v))
            group[2].append(k)
        if group is not None:
            redo(group[0], _rows_to_value(t.name, group[1], t.read.ttl), group[2])
        self._db.write(wb)
        t.configure(t.meta, t.write, t.write, t.descriptor)

    def _store(self, name: str) -> _RocksTable:
        return self._tables[name]

    def _state_class(self, kind: str, ttl: bool) -> type:
        if kind == "map" and not ttl:
            return _RocksMap
        return super()._state_class(kind, ttl)

    def _restore_section(self, target: _RocksTable, kgi: int, keys: list[Any], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise CorruptSnapshotError(f"state {target.name!r}: a section has {len(keys)} keys and {len(values)} "
                                       "values")
        prefix = _U16.pack(self._start + kgi) + target.sid
        wb = rocksdict.WriteBatch(raw_mode=True)
        deadline = target.ttl_deadline()
        for kb, vb in zip(keys, values):
            if target.migrate:
                vb = target.write.encode(target.read.decode(vb))
            if deadline is not None:
                vb = target.write.drop_expired_bytes(vb, deadline)
                if vb is None:
                    continue
            k = prefix + _U32.pack(len(kb)) + bytes(kb)
            if target.is_map:
                for ukb, stored in _value_to_rows(target.write if target.migrate else target.read, vb):
                    wb.put(k + ukb, stored)
            else:
                wb.put(k, bytes(vb))
        self._db.write(wb)

    def _after_restore(self, lazy: bool) -> None:
        for t in self._tables.values():
            if t.descriptor is not None:
                t.configure(t.meta, t.write, t.write, t.descriptor)

    # ---- iteration --------------------------------------------------------------------------------------------------
    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, in key-group order."""
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        kd = self.key_serializer.deserialize
        last = None
        for k in list(self._db.keys()):
            k = cast(bytes, k)
            if k[2:4] == t.sid:
                kb = _split_db_key(k)[2]
                if kb != last:  # a map's entries of one key are adjacent
                    last = kb
                    yield kd(kb)

    # ---- snapshots --------------------------------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture:
        """Take a RocksDB checkpoint now (consistent and cheap: flush + hard links) and write it to ``storage`` in a
        background thread."""
        tables = list(self._tables.values())
        metas = [t.meta for t in tables]
        deadlines = {t.sid_int: t.ttl_deadline() for t in tables}
        codecs = {t.sid_int: t.write for t in tables}
        maps = {t.sid_int: t.name for t in tables if t.is_map}
        cp_dir = tempfile.mkdtemp(prefix="cp-", dir=self._dir)
        os.rmdir(cp_dir)  # RocksDB creates it
        rocksdict.Checkpoint(self._db).create_checkpoint(cp_dir)
        future = SnapshotFuture()

        def work(fut: SnapshotFuture) -> Any:
            cp = _open(cp_dir)
            try:
                return self._write_snapshot(checkpoint_id, storage,
                                            (metas, self._groups(cp, deadlines, codecs, maps, fut)), fut)
            finally:
                cp.close()
                shutil.rmtree(cp_dir, ignore_errors=True)

        future._run(work, f"keygroups-rocksdb-snapshot-{checkpoint_id}")
        return future

    def _groups(self, cp: rocksdict.Rdict, deadlines: dict[int, int | None], codecs: dict[int, Codec],
                maps: dict[int, str], fut: SnapshotFuture) -> Iterator[tuple[int, list[Any]]]:
        cur_kg = -1
        sections: dict[int, tuple[list[Any], list[Any]]] = {}
        entry: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None  # a map key's rows being gathered

        def add(sid: int, kb: bytes, v: Any) -> None:
            deadline = deadlines.get(sid)
            if deadline is not None:
                v = codecs[sid].drop_expired_bytes(v, deadline)
                if v is None:
                    return
            sec = sections.get(sid)
            if sec is None:
                sec = sections[sid] = ([], [])
            sec[0].append(kb)
            sec[1].append(v)

        def close_entry() -> None:
            nonlocal entry
            if entry is not None:
                sid, kb, rows = entry
                add(sid, kb, _rows_to_value(maps[sid], rows, codecs[sid].ttl))
                entry = None

        for k, v in cp.items():
            kg, sid, kb, ukb = _split_db_key(cast(bytes, k))
            if entry is not None and (kg != cur_kg or sid != entry[0] or kb != entry[1]):
                close_entry()
            if kg != cur_kg:
                if cur_kg >= 0:
                    yield cur_kg, [(s, ks, vs) for s, (ks, vs) in sorted(sections.items())]
                    check_cancel(fut)
                cur_kg = kg
                sections = {}
            if sid in maps:
                if entry is None:
                    entry = (sid, kb, [])
                entry[2].append((ukb, cast(bytes, v)))
            else:
                add(sid, kb, v)
        close_entry()
        if cur_kg >= 0:
            yield cur_kg, [(s, ks, vs) for s, (ks, vs) in sorted(sections.items())]


__all__ = ["RocksDBKeyedStateBackend"]
