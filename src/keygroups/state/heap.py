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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from keygroups._native.statecore import HeapListCore, HeapMapCore, HeapValueCore, TableCore
from keygroups.state._base import KeyedStateBackendBase, SnapshotFuture
from keygroups.state._codec import Codec
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.states import MISSING, ListState, MapState, ValueState

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointStorage


class _NoKey(dict):  # type: ignore[type-arg]
    """Sits in the extra last slot (key-group index ``n``, where the key context points before any
    ``set_current_key``) so that state access without a key fails clearly at no cost to the normal path."""

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no current key: call set_current_key(key) on the backend before using keyed state")

    get = __getitem__ = __setitem__ = __delitem__ = pop = setdefault = __contains__ = _fail  # type: ignore


_NO_KEY = _NoKey()


class _HeapTable(TableCore):
    """All entries of one state: ``maps[i]`` holds decoded values of key group ``start + i``; ``raw[i]`` restored
    entries whose value is still bytes (key -> entry index in ``rawsecs[i]``, the key group's restored sections);
    ``pending[i]`` restored sections ``(block, key offsets, value offsets)`` whose keys are not even decoded yet. A
    key is in at most one of them."""

    __slots__ = ("b", "name", "meta", "descriptor", "read", "write", "migrate", "raw", "rawsecs", "pending",
                 "shared", "private", "lazy_groups", "copy", "n")

    def __init__(self, backend: HeapKeyedStateBackend, name: str, meta: dict[str, Any], read: Codec,
                 write: Codec, descriptor: StateDescriptor | None) -> None:
        n = backend._n
        self.b = backend
        self.ctx = backend._ctx
        self.name = name
        self.n = n
        self.maps: list[dict[Any, Any]] = [{} for _ in range(n)]
        self.maps.append(_NO_KEY)
        self.raw: list[dict[Any, int] | None] = [None] * (n + 1)
        self.rawsecs: list[list[Any] | None] = [None] * (n + 1)
        self.pending: list[list[Any] | None] = [None] * (n + 1)
        self.shared = [False] * (n + 1)
        self.private: list[set[Any] | None] = [None] * (n + 1)
        self.cow = backend._running_snapshots > 0  # registered while a snapshot runs: nothing of ours is captured
        self.lazy_groups = 0
        self.lazy = [False] * (n + 1)  # per key group: restored entries not decoded yet (pending or raw)
        self.slow = self.cow
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: Codec, write: Codec, descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read = read
        self.write = write
        self.descriptor = descriptor
        self.copy = write.copy
        self.migrate = read.needs_migration_to(write)

    def _update_slow(self) -> None:
        self.slow = self.cow or self.lazy_groups > 0

    def _ttl_deadline(self) -> int | None:
        d = self.descriptor
        if d is None or d.ttl_config is None or not d.ttl_config.cleanup_full_snapshot:
            return None
        return self.b._now_ms() - d.ttl_config.ttl_ms

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
        kgi, key = c.kgi, c.key
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
        """Decode a restored key group's keys; values stay bytes (``raw``)."""
        sections = self.pending[kgi] or []
        self.pending[kgi] = None
        kd_many = self.b.key_serializer.deserialize_many
        deadline = self._ttl_deadline()
        nsec = len(sections)
        raw: dict[Any, int] = {}
        decoded: dict[Any, Any] = {}
        secs = []
        for s_i, (block, ko, vo) in enumerate(sections):
            keys = kd_many(block, ko)
            vo_l = vo.tolist()
            secs.append((block, ko.tolist(), vo_l))
            if deadline is None:
                if nsec == 1:
                    raw.update(zip(keys, range(len(keys))))
                else:
                    raw.update((k, i * nsec + s_i) for i, k in enumerate(keys))
                continue
            drop = self.read.drop_expired_bytes
            for i, k in enumerate(keys):
                vb = block[vo_l[i]:vo_l[i + 1]]
                kept = drop(vb, deadline)
                if kept is None:
                    continue
                if kept is vb:
                    raw[k] = i * nsec + s_i
                else:  # partly expired list or map: keep what is left, decoded
                    decoded[k] = self.read.decode(kept)
        if decoded:
            if self.shared[kgi]:  # never write into a dict a running snapshot holds
                self._unshare(kgi)
            self.maps[kgi].update(decoded)
            p = self.private[kgi]
            if p is not None:
                p.update(decoded)
        self.rawsecs[kgi] = secs
        self.raw[kgi] = raw or None
        if not raw:
            self._group_decoded(kgi)

    def _group_decoded(self, kgi: int) -> None:
        self.lazy[kgi] = False
        self.lazy_groups -= 1
        self._update_slow()

    def _raw_value(self, kgi: int, idx: int) -> Any:
        secs = self.rawsecs[kgi]
        n = len(secs)  # type: ignore[arg-type]
        block, _, vo = secs[idx % n]  # type: ignore[index]
        i = idx // n
        return block[vo[i]:vo[i + 1]]

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
                self._group_decoded(kgi)
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
            idx = r.get(key)
            if idx is None:
                return MISSING
            v = self.read.decode(self._raw_value(kgi, idx))
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

    def add_section(self, kgi: int, block: Any, key_offsets: Any, value_offsets: Any) -> None:
        if self.pending[kgi] is None:
            if not self.raw[kgi]:
                self.lazy_groups += 1
            self.pending[kgi] = []
            self.lazy[kgi] = True
        self.pending[kgi].append((block, key_offsets, value_offsets))  # type: ignore[union-attr]
        self._update_slow()

    def decode_all(self) -> None:
        """Eager restore: decode every restored entry now."""
        dec = self.read.decode
        kd_many = self.b.key_serializer.deserialize_many
        fast = self._ttl_deadline() is None
        for i in range(self.n):
            p = self.pending[i]
            if p is not None and fast and not self.raw[i]:
                m = self.maps[i]
                for block, ko, vo in p:
                    m.update(zip(kd_many(block, ko), self.read.decode_many(block, vo)))
                self.pending[i] = None
                self._group_decoded(i)
                continue
            if p is not None:
                self._materialize(i)
            r = self.raw[i]
            if r:
                m = self.maps[i]
                secs: Any = self.rawsecs[i]
                if len(secs) == 1 and len(r) == len(secs[0][1]) - 1:
                    block, _, vo = secs[0]
                    vals = self.read.decode_many(block, vo)
                    m.update(zip(r, vals))  # raw's keys are in entry order
                else:
                    for k, idx in r.items():
                        m[k] = dec(self._raw_value(i, idx))
                self.raw[i] = None
                self.rawsecs[i] = None
                self._group_decoded(i)
        self._update_slow()

    def keys_of_group(self, i: int) -> list[Any]:
        if self.pending[i] is not None:
            self._materialize(i)
        m = self.maps[i]
        r = self.raw[i]
        return list(m) + list(r) if r else list(m)


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
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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

    def _new_table(self, name: str, meta: dict[str, Any], read: Codec, write: Codec,
                   d: StateDescriptor | None) -> _HeapTable:
        t = self._tables[name] = _HeapTable(self, name, meta, read, write, d)
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: Codec, write: Codec) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
        else:
            t.configure(meta, read, write, d)

    def _store(self, name: str) -> _HeapTable:
        return self._tables[name]

    def _restore_handle(self, storage: Any, handle: Any, kgr: Any, targets: list[Any]) -> tuple[int, int]:
        from keygroups.checkpoint.format import read_key_group_offsets

        it, nbytes = read_key_group_offsets(storage, handle, kgr)
        groups = 0
        for kg, block, sections in it:
            if kg not in self.key_group_range:
                continue
            groups += 1
            kgi = kg - self._start
            for state_index, ko, vo in sections:
                self._check_state_index(handle, kg, state_index, targets)
                if len(ko) != len(vo):
                    from keygroups.errors import CorruptSnapshotError

                    raise CorruptSnapshotError(f"{handle.file}: key group {kg}, state {state_index}: "
                                               f"{len(ko) - 1} keys but {len(vo) - 1} values")
                if len(ko) > 1:
                    targets[state_index].add_section(kgi, block, ko, vo)
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
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture:
        """Capture a consistent view now (cheap: per key group, a reference; see the module docs) and write it to
        ``storage`` in a background thread. Later writes to this backend never reach the snapshot."""
        n = self._n
        metas = []
        captured = []
        for t in self._tables.values():
            metas.append(t.meta)
            deadline = t._ttl_deadline()
            captured.append((t.maps[:n], t.raw[:n], t.rawsecs[:n], t.pending[:n], t.read, t.write, t.migrate,
                             deadline))
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
        from keygroups.checkpoint.format import Packed

        key_ser = self.key_serializer
        ks = key_ser.serialize
        start = self._start
        for i in range(self._n):
            sections: list[Any] = []
            for si, (maps, raws, rawsecs, pends, read, write, migrate, deadline) in enumerate(captured):
                m, r, p = maps[i], raws[i], pends[i]
                if not (m or r or p):
                    continue
                if p and not m and not r and len(p) == 1 and not migrate and deadline is None:
                    block, ko, vo = p[0]  # an untouched restored key group: its bytes as they are
                    sections.append((si, Packed(block, ko), Packed(block, vo)))
                    continue
                if m and not r and not p and deadline is None and write.kind in ("value", "reducing",
                                                                                  "aggregating") and not write.ttl:
                    kd, ko = key_ser.serialize_many(list(m))
                    vd, vo = write.ser.serialize_many(list(m.values()))
                    sections.append((si, Packed(kd, ko), Packed(vd, vo)))
                    continue
                keys: list[Any] = []
                vals: list[Any] = []
                if m:
                    enc = write.encode
                    for k, v in m.items():
                        if deadline is not None:
                            v = write.drop_expired(v, deadline)
                            if v is None:
                                continue
                        keys.append(ks(k))
                        vals.append(enc(v))
                if r:
                    secs = rawsecs[i]
                    nsec = len(secs)
                    entries = []
                    for idx in r.values():
                        block, ko, vo = secs[idx % nsec]
                        j = idx // nsec
                        entries.append((block[ko[j]:ko[j + 1]], block[vo[j]:vo[j + 1]]))
                    self._pass_through(entries, keys, vals, read, write, migrate, deadline)
                if p:
                    for block, ko, vo in p:
                        kl, vl = ko.tolist(), vo.tolist()
                        entries = [(block[kl[j]:kl[j + 1]], block[vl[j]:vl[j + 1]]) for j in range(len(kl) - 1)]
                        self._pass_through(entries, keys, vals, read, write, migrate, deadline)
                if keys:
                    sections.append((si, keys, vals))
            yield start + i, sections

    @staticmethod
    def _pass_through(entries: Any, keys: list[Any], vals: list[Any], read: Codec, write: Codec, migrate: bool,
                      deadline: int | None) -> None:
        """Restored entries that were never decoded go back out as the same bytes (re-encoded only to migrate)."""
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
