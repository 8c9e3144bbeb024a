"""The RocksDB keyed state backend (on ``rocksdict``): state lives serialized in a local RocksDB per backend, with a
per-batch cache of decoded values in front of it.

Database keys are ``key group (u16 BE) | state id (u16 BE) | u32 BE key length | key bytes``: big-endian because
RocksDB orders keys bytewise, so one key group is one contiguous key range and a key group's rows are one ordered
scan. Map states, as in Flink, keep one database entry per map entry: the key above followed by the serialized user
key (the length prefix keeps keys prefix-free), the value being ``[i64 timestamp |] user value bytes``. Other states
keep one database value per key, the per-key value encoding of the snapshot format (``keygroups.state._codec``).

The cache (Spark's RocksDB state store buffers a batch the same way): ``prefetch(keys)`` loads a batch's keys with
one ``multi_get`` per state; reads and writes then hit decoded Python objects; the keys written since the last flush
are written to the database in one ``WriteBatch`` when a snapshot is taken, or earlier once a state caches more than
``cache_limit`` entries (the cache is then emptied; the set of keys changed since the last snapshot is kept). A map
key's cache entry holds either its whole map or an overlay of the entries touched (missing entries are read row by
row), so a batch touching one entry of a large map reads one row. Values read from the cache are live objects, as on
the heap backend: a mutable value read is written back at the next flush, so changing it in place sticks.

Warm database (``warm_dir``): the database stays on local disk after ``dispose()`` with a marker naming the
checkpoint and the snapshot file it reflects; the next backend for the same key-group range that restores from that
very checkpoint, whose metadata names that very file for this range, opens it as it is instead of restoring. A backend
of another range (boundaries moved, or a rescale) with none of its own takes over the kept database of the range that
overlaps it most, at that same checkpoint only: the key groups that left are deleted (a ranged delete per run), only
the chains of those that arrived are read. Anything else (another checkpoint, a retried or failed attempt, a damaged
marker) deletes it and restores. The
warm directory must be private to this user (``keygroups._local_dirs``); when the database is closed its marker is
sealed with the list of its files (size, modification time, inode) and an HMAC under the directory's secret, and a
kept database is opened only after the seal and the files are checked: one changed behind the job's back is deleted
and restored, never read.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import gc
import itertools
import json
import logging
import operator
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import rocksdict

from keygroups._hashing import KeyType, assign_to_key_group
from keygroups._local_dirs import (
    UnsafeDirectoryError,
    check_private,
    directory_secret,
    make_private,
    private_directory,
    seal,
    sealed,
)
from keygroups._native.statecore import java_key, java_keys, java_map
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import KeyedStateHandle, KeyGroupBlock, chain_stats, plan_keyed_restore, write_keyed_snapshot
from keygroups.checkpoint.metadata import is_shared_path, key_group_runs
from keygroups.checkpoint.state_meta import check_state_metas
from keygroups.errors import CorruptSnapshotError, no_current_key_error
from keygroups.serializers import TypeSerializer
from keygroups.state._base import (
    DEFAULT_DELTA_FRACTION,
    DEFAULT_MAX_CHAIN,
    KeyedStateBackendBase,
    RestoreStats,
    SnapshotFuture,
    _canonical,
    check_cancel,
)
from keygroups.state._codec import UNWRITABLE, ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.warm import WarmResume
from keygroups.state.states import MISSING, MapState, ValueState

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage

# Big-endian: the database keys these build sort bytewise in RocksDB, key group first (see above).
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_pack_u32 = _U32.pack

#: Cached entries per state before the cache is flushed to the database and emptied.
DEFAULT_CACHE_LIMIT = 1 << 20

#: Version of the warm database's marker (and of the database layout it vouches for).
WARM_MARKER_VERSION = 3
_MARKER = "marker.json"

log = logging.getLogger(__name__)


class _Absent:
    """Not in the cache (unlike MISSING: known to have no value)."""

    __slots__ = ()


_ABSENT = _Absent()


class _Overlay(dict):  # type: ignore[type-arg]
    """A map key's cache entry that holds only the entries touched so far (user key -> value, MISSING: removed);
    the others are still in the database. A plain dict in the cache is the whole map."""

    __slots__ = ()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Keep Python's cyclic collector out of a loop that makes an object per entry: at a million cached entries
    its full collections cost more than the loop."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Range:
    """A range delete in a flush: from the operation's key up to ``end`` (exclusive)."""

    __slots__ = ("end",)

    def __init__(self, end: bytes) -> None:
        self.end = end


def _first(op: tuple[bytes, Any]) -> bytes:
    return op[0]


def _next_prefix(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix`` (prefixes here start with a key group < 2^15,
    so the first byte is never 0xFF and a carry always stops)."""
    b = bytearray(prefix)
    while b[-1] == 0xFF:
        b.pop()
    b[-1] += 1
    return bytes(b)


def _scan(db: rocksdict.Rdict, prefix: bytes) -> Iterator[tuple[Any, Any]]:
    """The rows of ``db`` whose key starts with ``prefix``, in key order. The iterator is bounded above, so it stops
    at the prefix's end by itself: unbounded, every seek first walked over the deleted rows (tombstones) past the
    prefix, which made a scan per key after mass deletes (timers fired, maps emptied) quadratic."""
    bound = rocksdict.ReadOptions()
    bound.set_iterate_upper_bound(_next_prefix(prefix))
    # A generator, so that ``bound`` lives as long as the iterator that points into it.
    yield from db.items(from_key=prefix, read_opt=bound)


def _open(path: str) -> rocksdict.Rdict:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)  # a batch's prefetch asks for many keys that are not there yet
    opts.set_block_based_table_factory(table)
    db = rocksdict.Rdict(path, opts)
    # No write-ahead log: the checkpoint is the durable copy; a warm database is flushed before its marker is written.
    write = rocksdict.WriteOptions()
    write.disable_wal = True
    db.set_write_options(write)
    return db


def _frame_key(key_bytes: bytes) -> bytes:
    return _pack_u32(len(key_bytes)) + key_bytes


#: A warm directory of a key-group range, or its lock file: ``<first>-<last>[.lock]``.
_RANGE_NAME = re.compile(r"(\d+)-(\d+)(?:\.lock)?")


def _lock_range(parent: str, name: str) -> Any:
    """The lock file of warm directory ``name`` under ``parent``, opened and locked exclusively; None when another
    backend holds it. A lock file deleted (by a cleanup that held it) between opening and locking locks nothing:
    then the one now at the path is tried."""
    path = os.path.join(parent, name + ".lock")
    while True:
        lock_file = open(path, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            return None
        held = os.fstat(lock_file.fileno())
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return lock_file
        lock_file.close()


def _db_files(db_dir: str) -> dict[str, list[int]]:
    """What a closed database directory holds: file name -> [size, mtime (ns), inode]; UnsafeDirectoryError if
    anything in it is not a regular file of this user that only this user may write."""
    files = {}
    with os.scandir(db_dir) as it:
        for e in it:
            st = check_private(e.path, directory=False)
            files[e.name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return files


def _marker_body(marker: dict[str, Any]) -> bytes:
    """What a marker's HMAC covers: everything in it but the HMAC, as canonical JSON."""
    return json.dumps({k: v for k, v in marker.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def _seal_kept(path: str, secret: bytes) -> None:
    """Once the kept database is closed: add to its marker (if it still has one) the list of the database's files
    and an HMAC of the whole under the warm directory's secret. A marker not sealed so (its process died first) is
    never believed, nor one whose database files changed since."""
    marker_path = os.path.join(path, _MARKER)
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
        if not isinstance(marker, dict):
            raise ValueError("the marker is not a JSON object")
        marker["files"] = _db_files(os.path.join(path, "db"))
        marker["mac"] = seal(secret, _marker_body(marker))
        with open(marker_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_path + ".tmp", marker_path)
    except FileNotFoundError:
        return  # written to since its last snapshot: nothing to vouch for
    except (OSError, ValueError) as e:
        log.warning("warm state: could not seal %s (%s); it will be restored, not reused", path, e)
        with contextlib.suppress(OSError):
            os.remove(marker_path)


def _open_kept(path: str, secret: bytes) -> dict[str, Any] | None:
    """The sealed marker of the database kept in ``path`` when the seal holds and the database's files are exactly
    those it lists (checked before the database is opened, so nothing RocksDB reads has changed); otherwise the
    database and its marker are deleted (a warning if they were tampered with) and None is returned. An unsealed
    or missing marker only means there is nothing to reuse."""
    marker_path = os.path.join(path, _MARKER)
    db_dir = os.path.join(path, "db")
    marker = None
    problem = None
    try:
        check_private(marker_path, directory=False)
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
        if not isinstance(marker, dict) or "mac" not in marker:
            marker = None   # written by a backend that did not close: never vouched for
        elif not sealed(secret, marker["mac"], _marker_body(marker)):
            problem, marker = "its marker's seal does not match", None
        else:
            check_private(db_dir)
            if _db_files(db_dir) != marker.get("files"):
                problem, marker = "its database files changed since it was sealed", None
    except FileNotFoundError:
        marker = None
    except (OSError, ValueError) as e:
        problem, marker = str(e), None
    if marker is None:
        if problem is not None:
            log.warning("warm state: not reusing %s: %s; its database is deleted and restored", path, problem)
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker_path)
        shutil.rmtree(db_dir, ignore_errors=True)
        if os.path.lexists(db_dir):
            raise UnsafeDirectoryError(f"{db_dir} cannot be deleted")
    return marker


def _marker_checkpoint(path: str) -> int | None:
    """The checkpoint id the sealed marker in ``path`` names (unverified: only to decide whether the directory may
    still be taken over), None without one."""
    try:
        with open(os.path.join(path, _MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(marker, dict) and "mac" in marker and isinstance(marker.get("checkpoint_id"), int):
        return int(marker["checkpoint_id"])
    return None


def _split(blob: bytes, offsets: np.ndarray) -> list[bytes]:
    """``blob`` cut at ``offsets`` (n + 1 positions) into n bytes objects."""
    n = len(offsets) - 1
    if n <= 0:
        return []
    width = int(offsets[1] - offsets[0])
    if int(offsets[0]) == 0 and int(offsets[-1]) == n * width:
        if width == 0:
            return [b""] * n
        if bool((np.diff(offsets) == width).all()):  # fixed width: no offsets to walk
            return [blob[i:i + width] for i in range(0, n * width, width)]
    o = offsets.tolist()
    return [blob[a:b] for a, b in zip(o, o[1:])]


#: A batch's keys padded to more bytes per key than this (and more than 4x their size) are sorted in Python.
_MAX_PADDED_WIDTH = 256


def _sorted_db_keys(serialize_many: Callable[[Sequence[Any]], tuple[bytes, np.ndarray]], keys: Sequence[Any],
                    groups: np.ndarray, state_id: int, *, unique: bool) -> tuple[list[bytes], np.ndarray]:
    """The database keys of ``keys`` (absolute key groups ``groups``) in one state, sorted, with ``order``: the
    i-th database key is that of ``keys[order[i]]``; ``unique`` leaves out repeats of a key. Built in one pass over
    a byte matrix (a key per row, zero-padded to a multiple of 8 bytes: the length field precedes the key bytes,
    so padding never changes the order), sorted as big-endian 64-bit columns."""
    blob, offsets = serialize_many(keys)
    n = len(keys)
    lengths = np.diff(offsets)
    width = int(lengths.max()) if n else 0
    row = -(-(8 + width) // 8) * 8
    if n == 0 or (row > _MAX_PADDED_WIDTH and n * row > 4 * (len(blob) + 8 * n)):
        o = offsets.tolist()
        prefix = [_U16.pack(int(g)) + _U16.pack(state_id) for g in groups.tolist()]
        db_keys = [p + _pack_u32(b - a) + blob[a:b] for p, a, b in zip(prefix, o, o[1:])]
        order_list = sorted(range(n), key=db_keys.__getitem__)
        if unique:
            order_list = [i for j, i in enumerate(order_list) if j == 0 or db_keys[i] != db_keys[order_list[j - 1]]]
        return [db_keys[i] for i in order_list], np.array(order_list, dtype=np.int64)
    m = np.zeros((n, row), dtype=np.uint8)
    m[:, 0] = groups >> 8
    m[:, 1] = groups & 0xFF
    m[:, 2] = state_id >> 8
    m[:, 3] = state_id & 0xFF
    m[:, 4:8] = lengths.astype(">u4").view(np.uint8).reshape(n, 4)
    data = np.frombuffer(blob, dtype=np.uint8)
    fixed = int(lengths.min()) == width
    if fixed:
        m[:, 8:8 + width] = data.reshape(n, width)
    elif len(data):
        rows = np.repeat(np.arange(n), lengths)
        m[rows, np.arange(len(data)) - np.repeat(offsets[:-1], lengths) + 8] = data
    order = np.lexsort(m.view(">u8").T[::-1])
    m = m[order]
    if unique and n > 1:
        columns = m.view(">u8")
        first = np.ones(n, dtype=bool)
        first[1:] = (columns[1:] != columns[:-1]).any(axis=1)
        if not first.all():
            order, m = order[first], m[first]
            n = len(order)
    buf = m.tobytes()
    if fixed:
        size = 8 + width
        return [buf[i:i + size] for i in range(0, n * row, row)], order
    ends = (np.arange(n) * row + 8 + lengths[order]).tolist()
    return [buf[i * row:e] for i, e in enumerate(ends)], order


class _RocksTable:
    """One state's view of the backend: its state id, framings, cache and the keys written since the last flush
    (``pending``: key -> key-group index) and since the last snapshot (``changed``)."""

    __slots__ = ("backend", "db", "ctx", "name", "state_id", "state_id_bytes", "meta", "descriptor", "read_framing",
                 "write_framing", "needs_migration", "is_map", "mutable", "cache", "pending", "changed",
                 "prefetched", "restored_unregistered")

    def __init__(self, backend: RocksDBKeyedStateBackend, name: str, state_id: int, meta: dict[str, Any],
                 read: ValueFraming, write: ValueFraming, descriptor: StateDescriptor | None) -> None:
        self.backend = backend
        self.db = backend._db
        self.ctx = backend._ctx
        self.name = name
        self.state_id = state_id
        self.state_id_bytes = _U16.pack(state_id)
        self.cache: dict[Any, Any] = {}
        self.pending: dict[Any, int] = {}
        self.changed: dict[Any, int] = {}
        # The batches prefetched since the last flush: (keys, their database keys), both in database-key order.
        self.prefetched: list[tuple[list[Any], list[bytes]]] = []
        self.restored_unregistered = False
        self.configure(meta, read, write, descriptor)

    def configure(self, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                  descriptor: StateDescriptor | None) -> None:
        self.meta = meta
        self.read_framing = read
        self.write_framing = write
        self.descriptor = descriptor
        self.is_map = meta["kind"] == "map"
        self.needs_migration = read.needs_migration_to(write)
        # Values the user may change in place: a read of one counts as a write (the cache holds live objects).
        self.mutable = write.copy is not None

    # ---- database keys -------------------------------------------------------------------------------------------
    def db_key(self, group_index: int, key: Any) -> bytes:
        b = self.backend
        return b._group_prefix[group_index] + self.state_id_bytes + _frame_key(b._serialize_key(key))

    def current(self) -> tuple[Any, int]:
        c = self.ctx
        if c.kgi >= c.n:
            raise no_current_key_error()
        return c.key, c.kgi

    def rows(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The map entries of one key in the database: (user key bytes, stored value)."""
        out = []
        n = len(prefix)
        for k, v in _scan(self.db, prefix):
            out.append((cast(bytes, k)[n:], cast(bytes, v)))
        return out

    # ---- the cache ------------------------------------------------------------------------------------------------
    def load(self) -> Any:
        """The current key's value from the database (MISSING if none), now cached."""
        key, kgi = self.current()
        self.backend._check_warm()
        if len(self.cache) >= self.backend.cache_limit:
            self.backend._flush(evict=True)
        prefix = self.db_key(kgi, key)
        framing = self.read_framing
        if self.is_map:
            rows = self.rows(prefix)
            v = framing.decode(framing.map_from_rows(rows)) if rows else MISSING
        else:
            raw = self.db.get(prefix)
            v = MISSING if raw is None else framing.decode(raw)
        self.cache[key] = v
        if self.mutable and v is not MISSING:
            self.pending[key] = kgi
        return v

    def whole(self, key: Any, kgi: int, overlay: _Overlay) -> Any:
        """A map key's overlay completed with its other rows from the database: the whole map (or MISSING)."""
        framing = self.read_framing
        self.backend._check_warm()
        m = {}
        for ukb, stored in self.rows(self.db_key(kgi, key)):
            m.update(framing.decode(framing.map_from_rows([(ukb, stored)])))
        for uk, v in overlay.items():
            if v is MISSING:
                m.pop(uk, None)
            else:
                m[uk] = v
        v = m if m else MISSING
        self.cache[key] = v
        self.pending[key] = kgi  # the overlay may hold unflushed changes
        return v

    # ---- store interface of the generic states (maps: the whole map of the current key) ---------------------------
    def get(self) -> Any:
        c = self.ctx
        v = self.cache.get(c.key, _ABSENT)
        if v is _ABSENT:
            return self.load()
        if type(v) is _Overlay:
            key, kgi = self.current()
            return self.whole(key, kgi, v)
        if self.mutable and v is not MISSING:
            self.pending[c.key] = c.kgi
        return v

    def put(self, value: Any) -> None:
        key, kgi = self.current()
        self.cache[key] = value
        self.pending[key] = kgi

    def delete(self) -> None:
        key, kgi = self.current()
        self.cache[key] = MISSING
        self.pending[key] = kgi

    def append(self, items: list[Any]) -> None:
        key, kgi = self.current()
        cur = self.cache.get(key, _ABSENT)
        if cur is _ABSENT:
            cur = self.load()
        if cur is MISSING:
            self.cache[key] = items  # a fresh list built by the state
        else:
            cur.extend(items)
        self.pending[key] = kgi

    def ttl_deadline(self) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptor)

    def fill(self, keys: list[Any], group_indexes: np.ndarray, order: np.ndarray, db_keys: list[bytes],
             raw: list[bytes | None]) -> None:
        """Cache a prefetched batch: ``raw[i]`` is the stored value (None: not stored) of ``db_keys[i]``, the
        database key of ``keys[order[i]]``; decoded together, cached in the order of ``keys`` (the order the batch
        then reads them in, so the cache is walked front to back)."""
        stored = cast(list[bytes], raw)
        found: list[bool] | None = None  # None: every key has a stored value
        if raw.count(None):
            found = [r is not None for r in raw]
            stored = list(itertools.compress(stored, found))
        values: list[Any] = []
        if stored:
            offsets = np.zeros(len(stored) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in stored], out=offsets[1:])
            values = self.read_framing.decode_many(b"".join(stored), offsets)
        if found is not None:
            it = iter(values)
            values = [next(it) if f else MISSING for f in found]
        order_list = order.tolist()
        sorted_keys = [keys[i] for i in order_list]
        cached_keys = sorted_keys
        if len(order_list) == len(keys):  # no repeated keys: back to the batch's order
            inverse = np.empty(len(order_list), dtype=np.int64)
            inverse[order] = np.arange(len(order_list))
            inverse_list = inverse.tolist()
            values = [values[i] for i in inverse_list]
            if found is not None:
                found = [found[i] for i in inverse_list]
            cached_keys, order = keys, np.arange(len(keys))
        self.cache.update(zip(cached_keys, values))
        if self.mutable and stored:
            groups = group_indexes[order].tolist()
            if found is None:
                self.pending.update(zip(cached_keys, groups))
            else:
                self.pending.update(zip(itertools.compress(cached_keys, found), itertools.compress(groups, found)))
        self.prefetched.append((sorted_keys, db_keys))

    # ---- flushing -------------------------------------------------------------------------------------------------
    def sorted_pending(self) -> tuple[list[Any], list[bytes]]:
        """The pending keys and their database keys, in database-key order: picked out of the batch prefetched
        since the last flush when it holds them all (nothing to build or sort), else built and sorted."""
        pending = self.pending
        if len(self.prefetched) == 1:
            keys, db_keys = self.prefetched[0]
            mask = list(map(pending.__contains__, keys))
            picked = list(itertools.compress(keys, mask))
            if len(picked) == len(pending):
                return picked, list(itertools.compress(db_keys, mask))
        keys = list(pending)
        groups = np.fromiter(pending.values(), np.int64, len(keys)) + self.backend._start
        db_keys, order = _sorted_db_keys(self.backend.key_serializer.serialize_many, keys, groups, self.state_id,
                                         unique=False)
        return [keys[i] for i in order.tolist()], db_keys

    def encode_many(self, values: list[Any]) -> list[bytes]:
        """Encodings of ``values`` as stored, one vectorized call for plain value states."""
        write = self.write_framing
        if not write.ttl and write.kind in ("value", "reducing", "aggregating"):
            return _split(*write.ser.serialize_many(values))
        return list(map(write.encode, values))

    def write_values(self, batch: rocksdict.WriteBatch, encoded: dict[Any, bytes | None] | None) -> int:
        """Put the pending keys' values (not of a map state) into ``batch`` in key order, deletes for those
        without one; ``encoded`` receives the encodings (None: deleted), for a delta. Returns the rows written.
        The keys stay pending until the caller has written ``batch``."""
        keys, db_keys = self.sorted_pending()
        cache = self.cache
        values = list(map(cache.__getitem__, keys))
        live = [v is not MISSING for v in values]
        if not all(live):
            gone = list(itertools.compress(keys, map(operator.not_, live)))
            collections.deque(map(batch.delete, itertools.compress(db_keys, map(operator.not_, live))), maxlen=0)
            if encoded is not None:
                encoded.update(dict.fromkeys(gone, None))
            keys, db_keys = list(itertools.compress(keys, live)), list(itertools.compress(db_keys, live))
            values = list(itertools.compress(values, live))
        try:
            encodings = self.encode_many(values)
        except UNWRITABLE as e:
            write = self.write_framing
            key = write.first_unwritable(zip(keys, values), self.backend.key_serializer.serialize, MISSING)
            raise write.unwritable(key, e, what="write to the database") from e
        collections.deque(map(batch.put, db_keys, encodings), maxlen=0)
        if encoded is not None:
            encoded.update(zip(keys, encodings))
        return len(live)

    def write_pending(self, ops: list[tuple[bytes, Any]], encoded: dict[Any, bytes | None] | None) -> None:
        """Add a map state's pending keys' writes to ``ops`` ((database key, value bytes; None: delete; a
        ``_Range``: delete the range from the key); when ``encoded`` is given, their value encodings too, for a
        delta: maps written as overlays are left out, their whole value is read back after the write)."""
        gp, sid, ser = self.backend._group_prefix, self.state_id_bytes, self.backend._serialize_key
        cache, write = self.cache, self.write_framing
        add = ops.append
        for key, kgi in self.pending.items():
            v = cache[key]
            try:
                k = gp[kgi] + sid + _frame_key(ser(key))
                if type(v) is _Overlay:
                    uks, uvs = write.key_ser.serialize, write.ser.serialize
                    for uk, x in v.items():
                        add((k + uks(uk), None if x is MISSING else uvs(x)))
                    continue
                enc = None if v is MISSING else write.encode(v)
            except UNWRITABLE as e:
                raise write.unwritable(key, e, what="write to the database") from e
            # The whole map: its old rows go first (sorting keeps this range delete before the new rows).
            add((k, _Range(_next_prefix(k))))
            if enc is not None:
                for user_key_bytes, stored in write.map_rows(enc):
                    add((k + user_key_bytes, stored))
            if encoded is not None:
                encoded[key] = enc


class _RocksValue(ValueState):
    """ValueState without TTL, straight on the table's cache (the per-update path of the benchmark)."""

    __slots__ = ("_t", "_ctx", "_cache", "_pending", "_default", "_copy", "_mutable")

    def __init__(self, store: _RocksTable, descriptor: Any, backend: Any) -> None:
        self._t = store
        self._ctx = store.ctx
        self._cache = store.cache
        self._pending = store.pending
        self._default = descriptor.default
        ser = descriptor.serializers["value"]
        self._copy = None if ser.is_immutable else ser.copy
        self._mutable = store.mutable

    def value(self) -> Any:
        c = self._ctx
        v = self._cache.get(c.key, _ABSENT)
        if v is _ABSENT:
            v = self._t.load()
        elif self._mutable and v is not MISSING:
            self._pending[c.key] = c.kgi
        if v is MISSING:
            d = self._default
            return d if d is None or self._copy is None else self._copy(d)
        return v

    def update(self, value: Any) -> None:
        c = self._ctx
        if c.kgi >= c.n:
            raise no_current_key_error()
        self._cache[c.key] = MISSING if value is None else value
        self._pending[c.key] = c.kgi

    def clear(self) -> None:
        self._t.delete()


class _RocksMap(MapState):
    """MapState without TTL: a key's cache entry is an overlay of the entries touched (read row by row) until
    something needs the whole map."""

    __slots__ = ("_t", "_uks", "_uvd")

    def __init__(self, store: _RocksTable, descriptor: Any, backend: Any) -> None:
        self._t = store
        uk, uv = descriptor.serializers["map key"], descriptor.serializers["map value"]
        self._uks, self._uvd = uk.serialize, uv.deserialize

    def _entry(self) -> tuple[Any, Any, int]:
        """(the current key's cache entry: overlay, whole map or MISSING; the key; its key-group index)."""
        t = self._t
        key, kgi = t.current()
        m = t.cache.get(key, _ABSENT)
        if m is _ABSENT:
            t.backend._check_warm()
            if len(t.cache) >= t.backend.cache_limit:
                t.backend._flush(evict=True)
            m = t.cache[key] = _Overlay()
        return m, key, kgi

    def get(self, key: Any) -> Any:
        key = java_key(key)
        t = self._t
        m, k, kgi = self._entry()
        if m is MISSING:
            return None
        v = m.get(key, _ABSENT)
        if v is _ABSENT:
            if type(m) is not _Overlay:
                return None
            raw = t.db.get(t.db_key(kgi, k) + self._uks(key))
            v = m[key] = MISSING if raw is None else self._uvd(raw)
        if v is MISSING:
            return None
        if t.mutable:
            t.pending[k] = kgi
        return v

    def contains(self, key: Any) -> bool:
        key = java_key(key)
        t = self._t
        m, k, kgi = self._entry()
        if m is MISSING:
            return False
        v = m.get(key, _ABSENT)
        if v is _ABSENT and type(m) is _Overlay:
            return t.db.get(t.db_key(kgi, k) + self._uks(key)) is not None
        return v is not _ABSENT and v is not MISSING

    def put(self, key: Any, value: Any) -> None:
        key = java_key(key)
        t = self._t
        m, k, kgi = self._entry()
        if m is MISSING:
            m = t.cache[k] = {}
        m[key] = value
        t.pending[k] = kgi

    def put_all(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        mapping = java_map(mapping)
        t = self._t
        m, k, kgi = self._entry()
        if m is MISSING:
            m = t.cache[k] = {}
        m.update(mapping)
        t.pending[k] = kgi

    def remove(self, key: Any) -> None:
        key = java_key(key)
        t = self._t
        m, k, kgi = self._entry()
        if m is MISSING:
            return
        if type(m) is _Overlay:
            m[key] = MISSING
        elif m.pop(key, _ABSENT) is _ABSENT:
            return
        elif not m:
            t.cache[k] = MISSING
        t.pending[k] = kgi

    def _whole(self) -> Any:
        t = self._t
        m, k, kgi = self._entry()
        if type(m) is _Overlay:
            return t.whole(k, kgi, m)
        if t.mutable and m is not MISSING:
            t.pending[k] = kgi
        return m

    def items(self) -> list[tuple[Any, Any]]:
        m = self._whole()
        return [] if m is MISSING else list(m.items())

    def is_empty(self) -> bool:
        return self._whole() is MISSING

    def clear(self) -> None:
        self._t.delete()


class RocksDBKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range in a local RocksDB; same interface and snapshot format as
    ``HeapKeyedStateBackend``. ``db_dir``: parent directory of the database (a temporary directory by default);
    the database is deleted by ``dispose()`` (or on leaving a ``with`` block), at the latest when the backend is
    garbage-collected.

    ``cache_limit``: decoded entries each state caches before the cache is written to the database and emptied
    (bounds memory; see the module docs). ``warm_dir``: keep the database there across backends (one directory per
    key-group range under it) and reuse it when a restore finds it exactly at the checkpoint it restores (see the
    module docs); the caller keys ``warm_dir`` by checkpoint location and job (``runtime.subtask_state.warm_directory``).
    """

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0, incremental: bool = True, max_chain: int = DEFAULT_MAX_CHAIN,
                 delta_fraction: float = DEFAULT_DELTA_FRACTION, db_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int = DEFAULT_CACHE_LIMIT, warm_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer, key_type=key_type, clock=clock,
                         allow_pickle=allow_pickle, subtask_index=subtask_index, incremental=incremental,
                         max_chain=max_chain, delta_fraction=delta_fraction)
        if isinstance(cache_limit, bool) or not isinstance(cache_limit, int) or cache_limit < 1:
            raise ValueError(f"cache_limit must be an int >= 1 (entries per state), got {cache_limit!r}")
        self.cache_limit = cache_limit
        self.set_current_key = self._ctx.set_current_key  # type: ignore[method-assign]  # no Python-level hop
        self._serialize_key = self.key_serializer.serialize
        self._group_prefix = [_U16.pack(g) for g in range(self._start, self._start + self._n)]
        self._tables: dict[str, _RocksTable] = {}
        self._marker_lock = threading.Lock()
        self._writes = 0  # database writes so far: a marker vouches only for the write count it was captured at
        self._warm_path: str | None = None
        self._lock_file: Any = None
        self._secret: bytes | None = None  # of the warm directory: seals the marker (see _seal_kept)
        self._kept_marker: dict[str, Any] | None = None  # the sealed marker the kept database was checked against
        self._moved_from: KeyGroupRange | None = None  # the range of a kept database taken over (see _take_moved)
        self.warm = False  # True when restore() reused a warm database
        path = self._claim_warm(warm_dir) if warm_dir is not None else None
        if path is None:
            self._dir = tempfile.mkdtemp(prefix="keygroups-rocksdb-", dir=db_dir)
        else:
            self._dir = path
        self._db = _open(os.path.join(self._dir, "db"))
        # A kept database is used only once restore() has checked it against its checkpoint; anything that touches
        # the data first (a job that does not restore) empties it.
        self._unchecked = self._warm_path is not None
        keep = self._warm_path is not None
        self._finalizer = weakref.finalize(self, RocksDBKeyedStateBackend._cleanup, self._db, self._dir, keep,
                                           self._lock_file, self._secret)

    @staticmethod
    def _cleanup(db: rocksdict.Rdict, path: str, keep: bool, lock_file: Any, secret: bytes | None) -> None:
        try:
            db.close()
            if keep and secret is not None:
                _seal_kept(path, secret)
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
            if lock_file is not None:
                lock_file.close()  # releases the flock

    def _claim_warm(self, warm_dir: str | os.PathLike[str]) -> str | None:
        """This range's warm directory, locked for this backend; None when another backend holds it (a second
        attempt of the same task running beside the first): that one then works in a temporary directory. Once
        claimed, the job's warm directories of other ranges that overlap this one are deleted (see
        ``_remove_stale_warm``)."""
        r = self.key_group_range
        parent = private_directory(warm_dir, what="warm state")
        try:
            secret = directory_secret(parent)
        except OSError as e:
            log.warning("warm state: cannot use %s (%s); this backend's database is not kept", parent, e)
            return None
        name = f"{r.start}-{r.end}"
        try:
            lock_file = _lock_range(parent, name)
        except OSError as e:   # its lock file is a directory, say: work apart, never fail for it
            log.warning("warm state: cannot lock %s under %s (%s); this backend's database is not kept", name,
                        parent, e)
            return None
        if lock_file is None:
            return None
        path = os.path.join(parent, name)
        try:
            make_private(path)
            self._kept_marker = _open_kept(path, secret)
            if self._kept_marker is None:
                self._take_moved(parent, path, secret)
        except OSError as e:
            log.warning("warm state: %s cannot be kept (%s); its backend works in a temporary directory", path, e)
            lock_file.close()
            return None
        self._secret = secret
        self._lock_file = lock_file
        self._warm_path = path
        self._remove_stale_warm(parent)
        return path

    def _overlapping_warm(self, parent: str) -> dict[str, KeyGroupRange]:
        """The warm directories (and lock files) under ``parent`` of ranges that overlap this backend's but are not
        it, by name."""
        r = self.key_group_range
        out = {}
        for entry in os.listdir(parent):
            m = _RANGE_NAME.fullmatch(entry)
            if m is None:
                continue
            start, end = int(m[1]), int(m[2])
            if (start, end) != (r.start, r.end) and start <= r.end and end >= r.start and start <= end:
                out[m[0].removesuffix(".lock")] = KeyGroupRange(start, end)
        return out

    def _take_moved(self, parent: str, path: str, secret: bytes) -> None:
        """With no kept database of this very range: take over the one of the overlapping range that shares the
        most key groups with it (boundaries moved, or a rescale), if its sealed marker and files check out. Its
        directory becomes this range's (under both locks); its marker is removed at once (it vouches for the old
        range only) and kept in memory for ``restore``, which drops the key groups that left and restores those
        that arrived (see ``_resume_moved``)."""
        r = self.key_group_range
        candidates = sorted(self._overlapping_warm(parent).items(),
                            key=lambda nr: (-len(nr[1].intersection(r)), nr[1].start))
        for name, old in candidates:
            lock_file = _lock_range(parent, name)
            if lock_file is None:
                continue  # a running backend holds it
            try:
                old_path = os.path.join(parent, name)
                if not os.path.isdir(old_path):
                    continue
                marker = _open_kept(old_path, secret)
                if marker is None or marker.get("key_group_range") != [old.start, old.end]:
                    continue
                shutil.rmtree(path)
                os.rename(old_path, path)
                os.remove(os.path.join(path, _MARKER))
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(parent, name + ".lock"))
                self._kept_marker = marker
                self._moved_from = old
                return
            finally:
                lock_file.close()

    def _remove_stale_warm(self, parent: str, checkpoint_id: int | None = None) -> None:
        """Delete the warm directories under ``parent`` (one job's) of key-group ranges that overlap this backend's
        range but are not it: the ranges of one parallelism never overlap, so those are left from other ranges
        (before a rescale or a boundary move). One that also overlaps other ranges and holds a sealed marker may
        still be taken over by the backend of one of those (``_take_moved``): it stays until a restore from another
        checkpoint than its marker's (``checkpoint_id``) makes it useless. Every range of the current ranges
        overlaps some stale range it replaced, so the batches at the new ranges remove them all. A directory whose
        lock a running backend holds is left alone; the lock is deleted with its directory, while held
        (``_lock_range`` retries when it locked a file that was deleted meanwhile)."""
        r = self.key_group_range
        for name, old in sorted(self._overlapping_warm(parent).items()):
            lock_file = _lock_range(parent, name)
            if lock_file is None:
                continue  # a running backend holds it
            try:
                if not (old.start >= r.start and old.end <= r.end):
                    kept_at = _marker_checkpoint(os.path.join(parent, name))
                    if kept_at is not None and checkpoint_id in (None, kept_at):
                        continue  # a sibling range restoring from checkpoint ``kept_at`` may still take it over
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(parent, name + ".lock"))
            finally:
                lock_file.close()

    def dispose(self) -> None:
        """Close the local database and delete it, unless it is kept warm (once; later calls do nothing)."""
        self._finalizer()

    def estimated_entries(self) -> int:
        """RocksDB's own estimate of its keys (``rocksdb.estimate-num-keys``; writes still cached in Python are not
        in it until the next flush, which every snapshot does)."""
        return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)

    # ---- hooks ------------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        if any(t.pending for t in self._tables.values()):
            return True
        for _ in self._db.keys():
            return True
        return False

    def _new_table(self, name: str, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                   d: StateDescriptor | None) -> _RocksTable:
        state_id = len(self._tables)
        if state_id > 0xFFFF:
            raise ValueError(f"a RocksDB backend holds at most 65536 states; {name!r} would be one more")
        t = _RocksTable(self, name, state_id, meta, read, write, d)
        self._tables[name] = t
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: ValueFraming, write: ValueFraming) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
            return
        t.configure(meta, read, write, d)
        if t.needs_migration or (t.restored_unregistered and t.ttl_deadline() is not None):
            self._rewrite(t)  # restored bytes were ingested as written by the old serializers
        t.restored_unregistered = False

    def _rewrite(self, t: _RocksTable) -> None:
        """Re-encode (migrate) and TTL-clean every stored value of ``t`` in place."""
        self._flush(evict=True)
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
                for user_key_bytes, stored in write.map_rows(v):
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
                redo(group[0], read.map_from_rows(group[1]), group[2])
                group = None
            if group is None:
                group = (prefix, [], [])
            group[1].append((user_key_bytes, v))
            group[2].append(k)
        if group is not None:
            redo(group[0], read.map_from_rows(group[1]), group[2])
        self._write(batch)
        t.configure(t.meta, write, write, t.descriptor)

    def _store(self, name: str) -> _RocksTable:
        return self._tables[name]

    def _state_class(self, kind: str, ttl: bool) -> type:
        if not ttl and kind == "map":
            return _RocksMap
        if not ttl and kind == "value":
            return _RocksValue
        return super()._state_class(kind, ttl)

    def _adopt_restored(self, name: str, meta: dict[str, Any], read: ValueFraming | None) -> Any:
        t = super()._adopt_restored(name, meta, read)
        if t.descriptor is None:
            t.restored_unregistered = True
        return t

    def _restore_section(self, target: _RocksTable, group_index: int, keys: list[Any], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise CorruptSnapshotError(f"state {target.name!r}: a section has {len(keys)} keys and {len(values)} "
                                       "values")
        prefix = self._group_prefix[group_index] + target.state_id_bytes
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
            k = prefix + _frame_key(bytes(key_bytes))
            if target.is_map:
                for user_key_bytes, stored in (write if target.needs_migration else read).map_rows(value_bytes):
                    batch.put(k + user_key_bytes, stored)
            else:
                batch.put(k, bytes(value_bytes))
        self._write(batch)

    def _restore_block(self, handle: KeyedStateHandle, targets: list[Any], block: KeyGroupBlock) -> None:
        """Apply one block on top of the key group's earlier ones: a full block replaces every row of the key
        group; puts replace a key's value (a map's rows with the new ones), deletes remove the key."""
        group_index = block.key_group - self._start
        if block.full:
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.delete_range(self._group_prefix[group_index], _next_prefix(self._group_prefix[group_index]))
            self._write(batch)
        mv = block.block
        for state_index, key_offsets, value_offsets in block.puts:
            if len(key_offsets) != len(value_offsets):
                raise CorruptSnapshotError(f"{handle.file}: key group {block.key_group}, state {state_index}: "
                                           f"{len(key_offsets) - 1} keys but {len(value_offsets) - 1} values")
            if len(key_offsets) > 1:
                ko, vo = key_offsets.tolist(), value_offsets.tolist()
                target = targets[state_index]
                keys = [mv[a:b] for a, b in zip(ko, ko[1:])]
                if target.is_map and not block.full:  # the new map replaces the key's old rows
                    self._delete_keys(target, group_index, keys)
                self._restore_section(target, group_index, keys, [mv[a:b] for a, b in zip(vo, vo[1:])])
        for state_index, key_offsets in block.deletes:
            ko = key_offsets.tolist()
            self._delete_keys(targets[state_index], group_index, [mv[a:b] for a, b in zip(ko, ko[1:])])

    def _delete_keys(self, target: _RocksTable, group_index: int, keys: list[Any]) -> None:
        prefix = self._group_prefix[group_index] + target.state_id_bytes
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key_bytes in keys:
            k = prefix + _frame_key(bytes(key_bytes))
            if target.is_map:
                batch.delete_range(k, _next_prefix(k))
            else:
                batch.delete(k)
        self._write(batch)

    def _after_restore(self, lazy: bool) -> None:
        for t in self._tables.values():
            if t.descriptor is not None:
                t.configure(t.meta, t.write_framing, t.write_framing, t.descriptor)

    # ---- the cache --------------------------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[Any], key_groups: Sequence[int] | np.ndarray | None = None) -> None:
        """Load ``keys`` (a batch's distinct keys) into every state's cache, so the batch's reads hit decoded
        values. ``key_groups`` (the keys' key groups, absolute) saves hashing them again. The batch's database keys
        are built and sorted in one vectorized pass and read in key order (a state whose rows the batch mostly
        touches by one ordered scan of the touched key groups instead); the sorted keys are kept so that the flush
        writes the batch back in key order without building them again. Keys past the cache limit are left to load
        on first use; map states load theirs entry by entry."""
        keys = java_keys(list(keys)[:self.cache_limit])  # the cache is keyed as set_current_key keys it
        if key_groups is None:
            mp, kt = self.max_parallelism, self.key_type
            groups = np.fromiter((assign_to_key_group(k, mp, kt) for k in keys), np.int64, len(keys))
        else:
            groups = np.asarray(key_groups, dtype=np.int64)[:len(keys)]
            if len(groups) != len(keys):
                raise ValueError(f"prefetch: {len(keys)} keys but {len(groups)} key groups; pass one key group per "
                                 "key, or none")
        outside = (groups < self._start) | (groups >= self._start + self._n)
        if outside.any():
            k = keys[int(np.argmax(outside))]
            raise ValueError(f"prefetch: key {k!r} is not in this backend's key groups {self.key_group_range!r}")
        tables = [t for t in self._tables.values() if not t.is_map]
        if not keys or not tables:
            return
        self._check_warm()
        estimate = self._db.property_int_value("rocksdb.estimate-num-keys") or 0
        with _gc_paused():
            for t in tables:
                if len(t.cache) + len(keys) > self.cache_limit:
                    self._flush(evict=True)
                cache = t.cache
                if cache:
                    wanted = np.flatnonzero([k not in cache for k in keys])
                    want_keys, want_groups = [keys[i] for i in wanted.tolist()], groups[wanted]
                else:
                    want_keys, want_groups = keys, groups
                if not want_keys:
                    continue
                db_keys, order = _sorted_db_keys(self.key_serializer.serialize_many, want_keys, want_groups,
                                                 t.state_id, unique=True)
                if 4 * len(db_keys) * len(tables) >= estimate:
                    raw = self._scan(db_keys, np.unique(want_groups).tolist(), t.state_id_bytes)
                else:
                    raw = list(map(self._db.get, db_keys))
                t.fill(want_keys, want_groups - self._start, order, db_keys, raw)

    def _scan(self, db_keys: list[bytes], groups: list[int], state_id_bytes: bytes) -> list[bytes | None]:
        """The stored values of ``db_keys`` (None: not stored), read by one ordered scan of each key group's rows
        of one state: cheaper than a read per key when the keys are most of the rows."""
        where = dict(zip(db_keys, range(len(db_keys))))
        get = where.get
        out: list[bytes | None] = [None] * len(db_keys)
        for g in groups:
            prefix = _U16.pack(g) + state_id_bytes
            for k, v in _scan(self._db, prefix):
                i = get(cast(bytes, k))
                if i is not None:
                    out[i] = cast(bytes, v)
        return out

    def _write(self, batch: rocksdict.WriteBatch) -> None:
        """Write to the database; the first write after a snapshot removes the warm marker, which no longer holds."""
        with self._marker_lock:
            self._writes += 1
            if self._warm_path is not None:
                try:
                    os.remove(os.path.join(self._warm_path, _MARKER))
                except FileNotFoundError:
                    pass
        self._db.write(batch)

    def _flush(self, *, evict: bool = False, encoded: dict[str, dict[Any, bytes | None]] | None = None) -> None:
        """Write every state's pending keys in one WriteBatch; ``evict`` empties the caches afterwards.
        ``encoded`` (state name -> key -> value encoding or None) receives what was written, for a delta."""
        self._check_warm()
        with _gc_paused():
            batch = rocksdict.WriteBatch(raw_mode=True)
            writes = 0
            ops: list[tuple[bytes, Any]] = []
            flushed = [t for t in self._tables.values() if t.pending]
            for t in flushed:
                out = None if encoded is None else encoded.setdefault(t.name, {})
                if t.is_map:
                    t.write_pending(ops, out)
                else:
                    writes += t.write_values(batch, out)
            if ops:
                # In key order: RocksDB's memtable takes sorted inserts an order of magnitude faster.
                ops.sort(key=_first)
                put, delete, delete_range = batch.put, batch.delete, batch.delete_range
                for k, v in ops:
                    if v is None:
                        delete(k)
                    elif type(v) is _Range:
                        delete_range(k, v.end)
                    else:
                        put(k, v)
            if ops or writes:
                self._write(batch)
            # Only now: a value that cannot be written leaves every state's pending writes for the next flush.
            for t in flushed:
                t.changed.update(t.pending)
                t.pending.clear()
        for t in self._tables.values():
            t.prefetched.clear()
            if evict:
                t.cache.clear()

    # ---- iteration --------------------------------------------------------------------------------------------------
    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, in key-group order."""
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        self._flush()  # (checks a kept database first)
        deserialize = self.key_serializer.deserialize
        last = None
        for k in list(self._db.keys()):
            k = cast(bytes, k)
            if k[2:4] == t.state_id_bytes:
                key_bytes = _split_db_key(k)[2]
                if key_bytes != last:  # a map's entries of one key are adjacent
                    last = key_bytes
                    yield java_key(deserialize(key_bytes))

    def map_keys(self, state_name: str) -> Iterator[tuple[int, Any, list[Any]]]:
        """As the base class's, in one ordered scan of the state's rows per key group (not a read per key)."""
        t = self._tables.get(state_name)
        if t is None or t.descriptor is None or not t.is_map:
            raise KeyError(f"map state {state_name!r} is not registered; registered: "
                           f"{sorted(n for n, x in self._tables.items() if x.descriptor is not None)}")
        self._flush()  # (checks a kept database first)
        deserialize = self.key_serializer.deserialize

        def deserialize_key(key_bytes: Any) -> Any:
            return java_key(deserialize(key_bytes))

        framing = t.read_framing
        for kgi in range(self._n):
            prefix = self._group_prefix[kgi] + t.state_id_bytes
            key_bytes: bytes | None = None
            rows: list[tuple[bytes, bytes]] = []
            for k, v in _scan(self._db, prefix):
                _, _, kb, user_key = _split_db_key(cast(bytes, k))
                if kb != key_bytes:
                    if rows:
                        yield self._start + kgi, deserialize_key(key_bytes), list(
                            framing.decode(framing.map_from_rows(rows)))
                    key_bytes, rows = kb, []
                rows.append((user_key, cast(bytes, v)))
            if rows:
                yield self._start + kgi, deserialize_key(key_bytes), list(framing.decode(framing.map_from_rows(rows)))

    # ---- warm database ----------------------------------------------------------------------------------------------
    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, *, lazy: bool = True) -> RestoreStats:
        """Restore as every backend does (see ``KeyedStateBackendBase.restore``), or, with ``warm_dir``, reuse the
        database kept there when its marker shows it is exactly this checkpoint's state of this key-group range
        (then nothing is read: the stats say 0 bytes and ``self.warm`` is True), or the kept database of an
        overlapping range at this checkpoint (a :class:`~keygroups.state.warm.WarmResume`: the key groups that
        arrived are read, those that left deleted; see ``_resume_moved``)."""
        if self._warm_path is not None and not self._restored:
            self._remove_stale_warm(os.path.dirname(self._warm_path), metadata.checkpoint_id)
            if self._moved_from is not None:
                moved = self._resume_moved(storage, metadata, lazy)
                if moved is not None:
                    return moved
                self._reset_db()
                return super().restore(storage, metadata, lazy=lazy)
            states = self._warm_states(storage, metadata)
            if states is not None:
                self._unchecked = False
                self._restored = True
                self.warm = True
                for meta in states:
                    self._restore_target(meta)
                self._chains = chain_stats(metadata, self.key_group_range)
                self._chain_metas = {meta["name"]: _canonical(meta) for meta in states}
                self._after_restore(lazy)
                return RestoreStats(0, 0)
            self._reset_db()
        return super().restore(storage, metadata, lazy=lazy)

    def _resume_moved(self, storage: CheckpointStorage, metadata: CheckpointMetadata, lazy: bool
                      ) -> WarmResume | None:
        """Restore from the kept database of another, overlapping range (``_take_moved``) if its marker shows it is
        exactly this checkpoint's state of that range: the key groups that left are deleted (a ranged delete each
        run), those still owned stay as they are, and the chains of those that arrived are read (ranged reads, as a
        restore reads them). None when the marker does not match (nothing changed yet)."""
        old = self._moved_from
        assert old is not None
        states = self._warm_states(storage, metadata, old)
        if states is None:
            return None
        r = self.key_group_range
        check_state_metas(metadata)
        plan = plan_keyed_restore(metadata, r, max_parallelism=self.max_parallelism)
        arriving = [(h, run) for h, groups in plan for run in key_group_runs(kg for kg in groups if kg not in old)]
        known = {meta["name"]: _canonical(meta) for meta in states}
        for h, _ in arriving:
            for meta in h.states:
                if known.get(meta["name"], _canonical(meta)) != _canonical(meta):
                    return None   # another serializer or TTL there: restore it all, as a restore would migrate
        self._unchecked = False
        self._restored = True
        self.warm = True
        dropped = [kg for kg in old if kg not in r]
        with self._marker_lock:
            self._writes += 1
        for run in key_group_runs(dropped):   # key groups < 2**15: the one after a run still packs
            self._db.delete_range(_U16.pack(run.start), _U16.pack(run.end + 1))
        for meta in states:
            self._restore_target(meta)
        restored_bytes = 0
        arrived: set[int] = set()
        for handle, run in arriving:
            targets = [self._restore_target(meta) for meta in handle.states]
            restored_bytes += self._restore_handle(storage, handle, run, targets)[0]
            arrived.update(run)
        self._chains = chain_stats(metadata, r)
        self._chain_metas = dict(known)
        for handle, _ in plan:
            for meta in handle.states:
                self._chain_metas[meta["name"]] = _canonical(meta)
        self._needs_full = any(not is_shared_path(h.file) for h, _ in plan)
        self._after_restore(lazy)
        return WarmResume(restored_bytes, len(arrived), warm=tuple(kg for kg in r if kg in old),
                          restored=tuple(kg for kg in r if kg not in old), dropped=tuple(dropped),
                          bytes_restored=restored_bytes)

    def _warm_states(self, storage: CheckpointStorage, metadata: CheckpointMetadata,
                     kept_range: KeyGroupRange | None = None) -> list[dict[str, Any]] | None:
        """The states of the warm database if its marker matches this restore exactly (for ``kept_range``, this
        backend's range by default), else None."""
        assert self._warm_path is not None
        marker = self._kept_marker  # as sealed when its backend closed the database, checked before this one opened it
        self._kept_marker = None
        if marker is None:
            return None
        try:
            r = self.key_group_range if kept_range is None else kept_range
            if not (isinstance(marker, dict) and marker.get("version") == WARM_MARKER_VERSION
                    and marker.get("location") == storage.location
                    and marker.get("checkpoint_id") == metadata.checkpoint_id
                    and marker.get("max_parallelism") == self.max_parallelism == metadata.max_parallelism
                    and marker.get("key_group_range") == [r.start, r.end]):
                return None
            handle_file = marker.get("handle_file")
            if not any(h.file == handle_file and h.key_group_range == r for h in metadata.keyed_handles):
                return None
            states = marker.get("states")
            if not isinstance(states, list) or not all(isinstance(s, dict) and "name" in s for s in states):
                return None
            return states
        except (TypeError, ValueError):
            return None  # a marker of another shape: restore instead

    def _check_warm(self) -> None:
        """Empty a kept database that restore() has not vouched for, before its data is first used."""
        if self._unchecked:
            self._reset_db()

    def _reset_db(self) -> None:
        """Empty the database (a warm one that cannot be reused)."""
        assert self._warm_path is not None
        self._unchecked = False
        self._kept_marker = None
        try:
            os.remove(os.path.join(self._warm_path, _MARKER))
        except FileNotFoundError:
            pass
        self._db.delete_range(b"\x00", b"\xff")
        self._db.compact_range(None, None)

    def _write_marker(self, storage: CheckpointStorage, checkpoint_id: int, handle: KeyedStateHandle,
                      states: list[dict[str, Any]], writes: int) -> None:
        """Vouch for the database as the state ``handle`` holds, unless it was written to since the capture."""
        assert self._warm_path is not None
        r = self.key_group_range
        marker = {"version": WARM_MARKER_VERSION, "location": storage.location, "checkpoint_id": checkpoint_id,
                  "max_parallelism": self.max_parallelism, "key_group_range": [r.start, r.end],
                  "handle_file": handle.file, "states": states}
        self._db.flush()  # no write-ahead log: the marker must not outlive data in the memtable
        with self._marker_lock:
            if writes != self._writes:
                return
            path = os.path.join(self._warm_path, _MARKER)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)

    # ---- snapshots --------------------------------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture[KeyedStateHandle]:
        """Write the cache to the database and capture, now, the changes since the previous snapshot (encoded
        bytes of the keys written, tombstones for those deleted or expired); the snapshot worker writes them as
        delta blocks, and the key groups ``_full_key_groups_for_snapshot`` names as full blocks, scanned from a
        RocksDB checkpoint. A snapshot that writes no full block needs no checkpoint and scans nothing."""
        full = self._full_key_groups_for_snapshot()
        encoded: dict[str, dict[Any, bytes | None]] = {}
        self._flush(encoded=encoded)
        tables = list(self._tables.values())
        metas = [t.meta for t in tables]
        with _gc_paused():
            deltas = self._capture_deltas(tables, full, encoded)
        for t in tables:
            t.changed.clear()
        deadlines = {t.state_id: t.ttl_deadline() for t in tables}
        framings = {t.state_id: t.write_framing for t in tables}
        maps = {t.state_id: t.name for t in tables if t.is_map}
        writes = self._writes
        cp_dir: str | None = None
        if full:  # a consistent copy to scan: a RocksDB checkpoint (a flush and hard links; rocksdict's snapshot
            cp_dir = tempfile.mkdtemp(prefix="cp-", dir=self._dir)  # objects do not hold for iterators)
            os.rmdir(cp_dir)  # RocksDB creates it
            rocksdict.Checkpoint(self._db).create_checkpoint(cp_dir)
        view: rocksdict.Rdict | None = None

        def blocks() -> Iterator[tuple[int, list[Any], list[Any]]]:
            for g in self.key_group_range:
                if g in full:
                    assert view is not None
                    prefix = _U16.pack(g)
                    rows = _scan(view, prefix)
                    for _, sections in self._groups(rows, deadlines, framings, maps):
                        yield g, sections, []
                elif g in deltas:
                    puts, deletes = deltas[g]
                    yield g, [(s, ks, vs) for s, (ks, vs) in sorted(puts.items())], sorted(deletes.items())

        def work(future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
            nonlocal view
            try:
                if cp_dir is not None:
                    view = _open(cp_dir)
                check_cancel(future)
                handle = write_keyed_snapshot(storage, checkpoint_id, self.subtask_index, self.key_group_range,
                                              metas, blocks(), full_key_groups=full,
                                              on_key_group=functools.partial(check_cancel, future))
            finally:
                if view is not None:
                    view.close()
                if cp_dir is not None:
                    shutil.rmtree(cp_dir, ignore_errors=True)
            self._after_snapshot(handle)
            if self._warm_path is not None:
                self._write_marker(storage, checkpoint_id, handle, metas, writes)
            return handle

        return SnapshotFuture.start(work, name=f"keyed-{self.subtask_index} chk-{checkpoint_id} (rocksdb)")

    def _capture_deltas(self, tables: list[_RocksTable], full: set[int], encoded: dict[str, dict[Any, bytes | None]]
                        ) -> dict[int, tuple[dict[int, tuple[list[bytes], list[bytes]]], dict[int, list[bytes]]]]:
        """Per key group outside ``full``: (state index -> (keys, values) put, state index -> keys deleted), the
        values as the snapshot format encodes them. Keys flushed earlier (past the cache limit) and maps written
        entry by entry are read back from the database; TTL-expired values become deletes."""
        out: dict[int, tuple[dict[int, tuple[list[bytes], list[bytes]]], dict[int, list[bytes]]]] = {}
        ser = self._serialize_key
        start = self._start
        for index, t in enumerate(tables):
            if not t.changed:
                continue
            known = encoded.get(t.name, {})
            deadline = t.ttl_deadline()
            framing = t.write_framing
            for key, kgi in t.changed.items():
                g = start + kgi
                if g in full:
                    continue
                kb = ser(key)
                value = known.get(key, _ABSENT)
                if value is _ABSENT:
                    db_key = self._group_prefix[kgi] + t.state_id_bytes + _frame_key(kb)
                    if t.is_map:
                        rows = t.rows(db_key)
                        value = framing.map_from_rows(rows) if rows else None
                    else:
                        value = self._db.get(db_key)
                if value is not None and deadline is not None:
                    value = framing.drop_expired_bytes(value, deadline)
                puts, deletes = out.get(g) or out.setdefault(g, ({}, {}))
                if value is None:
                    deletes.setdefault(index, []).append(kb)
                else:
                    ks, vs = puts.get(index) or puts.setdefault(index, ([], []))
                    ks.append(kb)
                    vs.append(value)
        return out

    @staticmethod
    def _groups(rows: Iterable[tuple[Any, Any]], deadlines: dict[int, int | None], framings: dict[int, ValueFraming],
                maps: dict[int, str]) -> Iterator[tuple[int, list[Any]]]:
        """Database rows in key order, key group by key group, as snapshot sections (a map key's rows joined into
        the map's value encoding; TTL-expired values left out)."""
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
                add(state_id, key_bytes, framings[state_id].map_from_rows(rows))
                entry = None

        for k, v in rows:
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


def _split_db_key(k: bytes) -> tuple[int, int, bytes, bytes]:
    """(key group, state id, key bytes, the rest: a map entry's user key bytes, else empty)."""
    if len(k) < 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} is shorter than its 8-byte prefix")
    kg, state_id = k[0] << 8 | k[1], k[2] << 8 | k[3]
    (key_length,) = _U32.unpack_from(k, 4)
    if key_length > len(k) - 8:
        raise CorruptSnapshotError(f"RocksDB key {k!r} says {key_length} key bytes but has {len(k) - 8}")
    return kg, state_id, k[8:8 + key_length], k[8 + key_length:]


__all__ = ["RocksDBKeyedStateBackend"]
