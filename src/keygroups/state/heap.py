"""The heap keyed state backend: Python objects in one dict per (state, key group), with copy-on-write snapshots
and lazy restore.

Copy-on-write, at key-group granularity (Flink's ``CopyOnWriteStateMap`` keeps versions per entry; a dict per key
group gives the same guarantee with C-speed shallow copies): a snapshot's synchronous part only captures the list of
per-key-group dicts and marks them shared. The first write to a shared key group replaces its dict by a shallow copy;
mutable values (lists, maps, mutable accumulators) are then copied per entry when first read or written, so nothing
the background writer holds is ever mutated. Once no snapshot is running, every access takes the fast path again.

Lazy restore: a restored key group keeps the snapshot's raw byte sections until the first access to that key group
(then only its keys are decoded), and every value stays bytes until its key is first read; a snapshot taken before
that writes the original bytes back untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from keygroups.state._base import KeyedStateBackendBase, SnapshotFuture
from keygroups.state._codec import Codec
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.states import MISSING

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointStorage


class _NoKey(dict):  # type: ignore[type-arg]
    """Sits in the slot of key-group index -1 so that state access before ``set_current_key`` fails clearly at no
    cost to the normal path."""

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no current key: call set_current_key(key) on the backend before using keyed state")

    get = __getitem__ = __setitem__ = __delitem__ = pop = setdefault = __contains__ = _fail  # type: ignore


_NO_KEY = _NoKey()


class _HeapTable:
    """All entries of one state: ``maps[i]`` holds decoded values of key group ``start + i``; ``raw[i]`` restored
    entries still as bytes (key -> (key bytes, value bytes)); ``pending[i]`` restored sections whose keys are not even
    decoded yet. A key is in at most one of them."""

    __slots__ = ("b", "name", "meta", "descriptor", "read", "write", "migrate", "maps", "raw", "pending", "shared",
                 "private", "slow", "cow", "lazy_groups", "copy", "n")

    def __init__(self, backend: HeapKeyedStateBackend, name: str, meta: dict[str, Any], read: Codec,
                 write: Codec, descriptor: StateDescriptor | None) -> None:
        n = backend._n
        self.b = backend
        self.name = name
        self.n = n
        self.maps: list[dict[Any, Any]] = [{} for _ in range(n)]
        self.maps.append(_NO_KEY)
        self.raw: list[dict[Any, Any] | None] = [None] * (n + 1)
        self.pending: list[list[Any] | None] = [None] * (n + 1)
        self.shared = [False] * (n + 1)
        self.private: list[set[Any] | None] = [None] * (n + 1)
        self.cow = backend._running_snapshots > 0  # registered while a snapshot runs: nothing of ours is captured
        self.lazy_groups = 0
        self.slow = self.cow
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: Codec, write: Codec, descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read = read
        self.write = write
        self.descriptor = descriptor
        self.copy = write.copy
        self.migrate = not (read.ser.snapshot() == write.ser.snapshot() and
                            (read.key_ser is None or read.key_ser.snapshot() == write.key_ser.snapshot()))

    def _update_slow(self) -> None:
        self.slow = self.cow or self.lazy_groups > 0

    def _ttl_deadline(self) -> int | None:
        d = self.descriptor
        if d is None or d.ttl_config is None or not d.ttl_config.cleanup_full_snapshot:
            return None
        return self.b._now_ms() - d.ttl_config.ttl_ms

    # ---- store interface used by the state types (current key of the backend) -------------------------------------
    def get(self) -> Any:
        b = self.b
        if self.slow:
            return self._get_slow(b._kgi, b._key)
        return self.maps[b._kgi].get(b._key, MISSING)

    def put(self, value: Any) -> None:
        b = self.b
        if self.slow:
            self._prepare_write(b._kgi, b._key)
        self.maps[b._kgi][b._key] = value

    def delete(self) -> None:
        b = self.b
        if self.slow:
            self._prepare_write(b._kgi, b._key)
        self.maps[b._kgi].pop(b._key, None)

    def append(self, items: list[Any]) -> None:
        b = self.b
        kgi, key = b._kgi, b._key
        if self.slow:
            cur = self._get_slow(kgi, key)
            if cur is MISSING:
                self._prepare_write(kgi, key)
                self.maps[kgi][key] = items
            else:
                cur.extend(items)
            return
        m = self.maps[kgi]
        cur = m.get(key)
        if cur is None:
            m[key] = items
        else:
            cur.extend(items)

    # ---- slow path: lazy restore and copy-on-write -----------------------------------------------------------------
    def _materialize(self, kgi: int) -> None:
        sections = self.pending[kgi]
        self.pending[kgi] = None
        kd = self.b.key_serializer.deserialize
        deadline = self._ttl_deadline()
        drop = self.read.drop_expired_bytes
        raw = dict(self.raw[kgi] or {})
        for keys, values in sections or ():
            for kb, vb in zip(keys, values):
                if deadline is not None:
                    vb = drop(vb, deadline)
                    if vb is None:
                        continue
                raw[kd(kb)] = (kb, vb)
        self.raw[kgi] = raw or None
        if not raw:
            self.lazy_groups -= 1
            self._update_slow()

    def _unshare(self, kgi: int) -> None:
        self.maps[kgi] = dict(self.maps[kgi])
        r = self.raw[kgi]
        if r:
            self.raw[kgi] = dict(r)
        self.private[kgi] = set() if self.copy is not None else None
        self.shared[kgi] = False

    def _prepare_write(self, kgi: int, key: Any) -> None:
        if self.pending[kgi] is not None:
            self._materialize(kgi)
        if self.shared[kgi]:
            self._unshare(kgi)
        r = self.raw[kgi]
        if r and key in r:
            del r[key]
            if not r:
                self.raw[kgi] = None
                self.lazy_groups -= 1
                self._update_slow()
        p = self.private[kgi]
        if p is not None:
            p.add(key)

    def _get_slow(self, kgi: int, key: Any) -> Any:
        if self.pending[kgi] is not None:
            self._materialize(kgi)
        v = self.maps[kgi].get(key, MISSING)
        if v is MISSING:
            r = self.raw[kgi]
            if not r:
                return MISSING
            entry = r.get(key)
            if entry is None:
                return MISSING
            v = self.read.decode(entry[1])
            self._prepare_write(kgi, key)
            self.maps[kgi][key] = v
            return v
        if self.copy is not None and self.cow:
            if self.shared[kgi]:
                self._unshare(kgi)
            p = self.private[kgi]
            if p is not None and key not in p:
                v = self.copy(v)
                self.maps[kgi][key] = v
                p.add(key)
        return v

    # ---- whole-table operations ------------------------------------------------------------------------------------
    def has_data(self) -> bool:
        return self.lazy_groups > 0 or any(self.maps[i] for i in range(self.n))

    def add_section(self, kgi: int, keys: list[Any], values: list[Any]) -> None:
        if self.pending[kgi] is None:
            if not self.raw[kgi]:
                self.lazy_groups += 1
            self.pending[kgi] = []
        self.pending[kgi].append((keys, values))  # type: ignore[union-attr]
        self._update_slow()

    def decode_all(self) -> None:
        """Eager restore: decode every restored entry now."""
        dec = self.read.decode
        for i in range(self.n):
            if self.pending[i] is not None:
                self._materialize(i)
            r = self.raw[i]
            if r:
                m = self.maps[i]
                for k, (_, vb) in r.items():
                    m[k] = dec(vb)
                self.raw[i] = None
                self.lazy_groups -= 1
        self._update_slow()

    def keys_of_group(self, i: int) -> list[Any]:
        if self.pending[i] is not None:
            self._materialize(i)
        m = self.maps[i]
        r = self.raw[i]
        return list(m) + list(r) if r else list(m)


class HeapKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range, held as Python objects.

    ``key_serializer`` serializes keys in snapshots (it must be deterministic); ``key_type`` is the Java type keys
    hash as (see ``keygroups.assign_to_key_group``); ``clock`` (seconds, like ``time.time``) drives TTL;
    ``allow_pickle`` lets restore read pickled serializer data; ``subtask_index`` is recorded in snapshot handles.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tables: dict[str, _HeapTable] = {}
        self._running_snapshots = 0
        self._snap_lock = threading.Lock()

    # ---- hooks of the base ----------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        return any(t.has_data() for t in self._tables.values())

    def _restored_meta(self, name: str) -> dict[str, Any] | None:
        t = self._tables.get(name)
        return t.meta if t is not None and t.descriptor is None else None

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: Codec, write: Codec) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._tables[d.name] = _HeapTable(self, d.name, meta, read, write, d)
        else:
            t.configure(meta, read, write, d)

    def _store(self, name: str) -> _HeapTable:
        return self._tables[name]

    def _adopt_restored(self, name: str, meta: dict[str, Any], read: Codec | None) -> _HeapTable:
        t = self._tables.get(name)
        if t is not None and t.descriptor is not None:
            assert read is not None
            t.configure(t.meta, read, t.write, t.descriptor)
            return t
        if t is None:
            codec = self._restored_codec(meta)
            t = _HeapTable(self, name, meta, codec, codec, None)
            self._tables[name] = t
        elif t.meta["kind"] != meta["kind"]:
            from keygroups.errors import CorruptSnapshotError

            raise CorruptSnapshotError(f"state {name!r} is a {t.meta['kind']} state in one restored file and a "
                                       f"{meta['kind']} state in another")
        return t

    def _restore_section(self, target: _HeapTable, kgi: int, keys: list[Any], values: list[Any]) -> None:
        if len(keys) != len(values):
            from keygroups.errors import CorruptSnapshotError

            raise CorruptSnapshotError(f"state {target.name!r}: a section has {len(keys)} keys and {len(values)} "
                                       "values")
        target.add_section(kgi, keys, values)

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
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture:
        """Capture a consistent view now (cheap: per key group, a reference; see the module docs) and write it to
        ``storage`` in a background thread. Later writes to this backend never reach the snapshot."""
        n = self._n
        metas = []
        captured = []
        for t in self._tables.values():
            metas.append(t.meta)
            deadline = t._ttl_deadline()
            captured.append((t.maps[:n], t.raw[:n], t.pending[:n], t.read, t.write, t.migrate, deadline))
        with self._snap_lock:
            self._running_snapshots += 1
            for t in self._tables.values():
                t.shared = [True] * n + [False]
                t.private = [None] * (n + 1)
                t.cow = True
                t._update_slow()
        future = SnapshotFuture()

        def work(fut: SnapshotFuture) -> Any:
            try:
                return self._write_snapshot(checkpoint_id, storage, (metas, self._groups(captured)), fut)
            finally:
                self._release_snapshot()

        future._run(work, f"keygroups-snapshot-{checkpoint_id}")
        return future

    def _release_snapshot(self) -> None:
        with self._snap_lock:
            self._running_snapshots -= 1
            if self._running_snapshots:
                return
            n = self._n
            for t in list(self._tables.values()):
                t.cow = False
                t.shared = [False] * (n + 1)
                t.private = [None] * (n + 1)
                t._update_slow()

    def _groups(self, captured: list[Any]) -> Iterator[tuple[int, list[Any]]]:
        ks = self.key_serializer.serialize
        start = self._start
        for i in range(self._n):
            sections = []
            for si, (maps, raws, pends, read, write, migrate, deadline) in enumerate(captured):
                keys: list[Any] = []
                vals: list[Any] = []
                m = maps[i]
                if m:
                    enc = write.encode
                    if deadline is None:
                        for k, v in m.items():
                            keys.append(ks(k))
                            vals.append(enc(v))
                    else:
                        for k, v in m.items():
                            v = write.drop_expired(v, deadline)
                            if v is not None:
                                keys.append(ks(k))
                                vals.append(enc(v))
                r = raws[i]
                if r:
                    self._pass_through(((kb, vb) for kb, vb in r.values()), keys, vals, read, write, migrate,
                                       deadline)
                p = pends[i]
                if p:
                    for pk, pv in p:
                        self._pass_through(zip(pk, pv), keys, vals, read, write, migrate, deadline)
                if keys:
                    sections.append((si, keys, vals))
            yield start + i, sections

    @staticmethod
    def _pass_through(entries: Any, keys: list[Any], vals: list[Any], read: Codec, write: Codec, migrate: bool,
                      deadline: int | None) -> None:
        """Restored entries that were never decoded go back out as the same bytes (re-encoded only to migrate)."""
        if not migrate and deadline is None:
            for kb, vb in entries:
                keys.append(kb)
                vals.append(vb)
            return
        for kb, vb in entries:
            if migrate:
                vb = write.encode(read.decode(vb))
            if deadline is not None:
                vb = write.drop_expired_bytes(vb, deadline)
                if vb is None:
                    continue
            keys.append(kb)
            vals.append(vb)


__all__ = ["HeapKeyedStateBackend"]
