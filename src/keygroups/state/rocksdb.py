"""The RocksDB keyed state backend (on ``rocksdict``): state lives serialized in a local RocksDB per backend, with a
per-batch cache of decoded values in front of it.

Database keys are ``key group (u16 BE) | state id (u16 BE) | u32 BE key length | key bytes``: big-endian because
RocksDB orders keys bytewise, so one key group is one contiguous key range and a key group's rows are one ordered
scan. Map states, as in Flink, keep one database entry per map entry: the key above followed by the serialized user
key (the length prefix keeps keys prefix-free), the value being ``[i64 timestamp |] user value bytes``. Other states
keep one database value per key, the per-key value encoding of the snapshot format (``keygroups.state._codec``).

The cache (Spark's RocksDB state store buffers a batch the same way): ``prefetch(keys)`` loads a batch's keys with
one ``multi_get`` per state; reads and writes then hit decoded Python objects; the keys written since the last flush
are written to the database when a snapshot is taken, or earlier once a state caches more than ``cache_limit``
entries (the cache is then emptied; the set of keys changed since the last snapshot is kept): a flush of many value
state rows as one SST file RocksDB ingests (no memtable, none of its flushes to disk), a small one and maps' rows in
one ``WriteBatch``. A map key's cache entry holds either its whole map or an overlay of the entries touched (missing
entries are read row by row), so a batch touching one entry of a large map reads one row. Values read from the cache
are live objects, as on the heap backend: a mutable value read is written back at the next flush, so changing it in
place sticks. The value state's reads and writes and the flush of value, list, reducing and aggregating states
(database keys built and sorted, values encoded, the file's rows merged in key order) are compiled
(``_native/rocksstate.pyx``).

Kept values: when a warm database is closed exactly at its last snapshot (nothing written or pending since), its
states' caches stay in this process beside it (``_KeptCaches``, at most ``KEPT_CACHE_ENTRIES`` entries in all); the
next backend that resumes that very database (the same seal: no file of it changed) and registers each state with
the same meta takes them, so a warm batch reads from RocksDB only the keys earlier batches never touched, as a warm
heap backend does. A damaged file of the kept database is then found when it is first read, which may be at the
snapshot; the batch then fails with RocksDB's error and its retry restores cold (nothing is kept after a write).

Write-back: a kept database of value, list, reducing and aggregating states (no map state: its cache holds
overlays) is written at most every ``write_back_batches`` snapshots (``DEFAULT_WRITE_BACK_BATCHES``). A snapshot in
between writes nothing: its delta is encoded from the cache (``rocksstate.delta_values``), it writes no full key
group (the next written snapshot makes up the chain compactions skipped: from the caches when they hold every state
whole, with one pass over each cache for all of them, else scanned from the database), and its keys stay in the
cache as
*unwritten*, which no eviction drops (any flush writes them first). The database's marker keeps naming the
checkpoint its files hold; the caches park with the unwritten keys and the snapshot they are the state of, and the
next backend adopts them only when it restores exactly that snapshot. Otherwise (another process, a failed attempt,
an older checkpoint, the kept values dropped for room) the database is what its marker says and catches up from
there as any database left behind does (``_catch_up``: value-like states' deltas in one compiled file of puts and
tombstones); a rescale that takes a lagging database over completes it from this process's kept values when they
are here, else catches up the key groups it keeps the same way (``_resume_moved``). Between write-backs RocksDB sees
no write, so no SST file, no compaction.

Restore: the blocks a restore reads become one SST file, written in compiled code and ingested whole
(``rocksdb_ingest``); what leaves the range at a rescale is dropped with a ranged delete per run of key groups.

Warm database (``warm_dir``): the database stays on local disk after ``dispose()``, and the next backend of the same
range (or of an overlapping one, after boundaries moved or a rescale) that restores from exactly the checkpoint it
reflects opens it instead of restoring; one that restores from a later checkpoint of the same lineage (the batches
between ran elsewhere) catches up, applying only the blocks committed since (``_catch_up``); the directory's lock,
marker, seal, take-over and clean-up are ``rocksdb_warm``'s. A kept database found damaged when first read (RocksDB's "Corruption", say a bit-rotted file)
is replaced in the same batch by a cold restore of the same checkpoint, with a warning.

Lazy open: a kept database is opened on its first use, not when its backend is made (its lock is taken, and its
seal and files checked, then all the same: file stats, before anything of it is read). A warm batch whose reads
the kept values serve and whose snapshot defers its writes never opens it, nor closes or seals it again (it is
exactly as sealed). One that RocksDB cannot open once a restore resumed it (nothing was written to it) is replaced
by a cold restore of the resumed checkpoint, as a damaged read's is: that checkpoint holds whatever the kept values
held beyond the database's files, and the cache keeps the batch's changes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import logging
import os
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
from keygroups._local_dirs import UnsafeDirectoryError
from keygroups._native.statecore import java_key, java_keys, java_map
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import KeyedStateHandle, KeyGroupBlock, chain_stats, plan_keyed_restore, write_keyed_snapshot
from keygroups.checkpoint.metadata import is_shared_path, key_group_runs
from keygroups.checkpoint.planning import choose_full_key_groups
from keygroups.checkpoint.state_meta import check_state_metas
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError, no_current_key_error
from keygroups.serializers import TypeSerializer
from keygroups.state._base import (
    DEFAULT_DELTA_FRACTION,
    DEFAULT_MAX_CHAIN,
    KeyedStateBackendBase,
    RestoreStats,
    SnapshotFuture,
    _canonical,
    _committed_chains,
    _extend_chain_files,
    _files_of_chains,
    check_cancel,
)
from keygroups.state._checks import check_stored, checked_state_class, stored_value_check
from keygroups.state._codec import UNWRITABLE, ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.warm import WarmRegistry, WarmResume
from keygroups.state.rocksdb_ingest import STORED_KINDS, SstRestore, table_options
from keygroups._native import sstload
from keygroups._native import rocksstate
from keygroups._native.framing import Encoder
from keygroups._native.rocksstate import RocksValueCore
from keygroups.checkpoint.format import Packed
from keygroups.state.rocksdb_warm import Takeover, WarmDirectory, marker_seal, seal_kept
from keygroups.state.states import MISSING, MapState, ValueState

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage

# Big-endian: the database keys these build sort bytewise in RocksDB, key group first (see above).
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_pack_u32 = _U32.pack

#: Cached entries per state before the cache is flushed to the database and emptied.
DEFAULT_CACHE_LIMIT = 1 << 20

#: A kept database is written at most every this many snapshots (write-back; see the module docs).
DEFAULT_WRITE_BACK_BATCHES = 4

log = logging.getLogger(__name__)


_Caches = dict[str, tuple[Any, dict[Any, Any]]]

#: What parked caches hold beyond the database (write-back): per state name its unwritten keys (key -> key-group
#: index; their values are in the cache), and the snapshot the caches are the state of: (checkpoint id, the
#: snapshot file of the range), how many snapshots in a row were taken without writing the database, and how many of
#: them wrote no chain compaction (``RocksDBKeyedStateBackend._skipped_compactions``).
_Lag = tuple[dict[str, dict[Any, int]], int, str, int, int]

#: A catch-up's reads (``_catch_up_plan``): per checkpoint file (by ``id`` of its handle), the handle and its key
#: groups to read.
_Blocks = dict[int, tuple[KeyedStateHandle, list[int]]]


class _KeptCaches:
    """The decoded values of kept (warm) databases that backends of this process closed, by warm directory: each
    with the seal of the database as closed (``rocksdb_warm.seal_kept``) and, per state, its stored meta and its
    cache (every entry equal to what the database holds: parked only when nothing was written since the marker).
    The next backend of the range that resumes exactly that database (the same seal: not a file of it changed
    since) takes them, so a warm batch reads from RocksDB only the keys the earlier batches never touched, as a
    warm heap backend would. Bounded: at most ``limit`` entries in all, the least recently parked dropped first (a
    :class:`~keygroups.state.warm.WarmRegistry` weighed by entries)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # plain dicts of decoded values, freed by their reference counts once dropped: nothing to watch
        self._kept: WarmRegistry[tuple[str, _Caches, _Lag | None]] = WarmRegistry(watch=lambda kept: ())

    @staticmethod
    def _size(kept: tuple[str, _Caches, _Lag | None]) -> int:
        return sum(len(cache) for _, cache in kept[1].values())

    def park(self, path: str, seal: str, caches: _Caches, lag: _Lag | None = None) -> None:
        if not caches:
            self._kept.take(path)
            return
        self._kept.keep(path, (seal, caches, lag), self.limit, weight=self._size)

    def take(self, path: str, seal: str | None) -> tuple[_Caches, _Lag | None] | None:
        """The caches parked for ``path`` if they were parked for the database sealed ``seal``, with what they hold
        beyond it (None: nothing); either way none stay parked for ``path``. Dropped caches lose nothing: the
        database's marker names the checkpoint its files hold, and a restore catches up from there."""
        kept = self._kept.take(path)
        return (kept[1], kept[2]) if kept is not None and seal is not None and kept[0] == seal else None

    def lag_as_of(self, path: str) -> int | None:
        """The checkpoint the caches parked for ``path`` are the state of, when they hold more than its database
        (write-back); else None."""
        kept = self._kept.peek(path)
        return None if kept is None or kept[2] is None else kept[2][1]

    def clear(self) -> None:
        self._kept.clear()


#: Entries (decoded values) kept in all between batches by this process's RocksDB backends (see _KeptCaches).
KEPT_CACHE_ENTRIES = 1 << 21
_KEPT_CACHES = _KeptCaches(KEPT_CACHE_ENTRIES)
#: Beside the parked caches: RocksDB's estimate of its keys when the database was closed, by warm directory, with
#: the seal it was closed under (what ``estimated_entries`` answers for a database resumed and not opened).
_KEPT_ESTIMATES: dict[str, tuple[str, int]] = {}


class _Absent:
    """Not in the cache (unlike MISSING: known to have no value)."""

    __slots__ = ()


_ABSENT = _Absent()


class _CompleteMark:
    """The cache key of a state's cache that holds every value of the state (``_cache_complete``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<cache complete>"


#: In a state's cache, under this key: (the backend's epoch, its write count, whether it had restored) when the
#: cache was known to hold every value of the state in the backend's key groups (see ``_cache_complete``). A key no
#: user key equals (compared by identity); emptying the cache drops it, and the cache carries it when parked.
_COMPLETE = _CompleteMark()


class _Written:
    """What a flush wrote of one value state, for the snapshot's delta (``_capture_deltas``): the flush's keys, the
    positions among them of those put (with their encodings, in the same order) and of those deleted; how many, and
    (only when asked: the delta is mostly cut from the flush's rows) a key's encoding, None for a delete."""

    __slots__ = ("keys", "put_at", "encodings", "gone_at", "_by_key")

    def __init__(self, keys: list[Any], put_at: np.ndarray, encodings: list[bytes], gone_at: np.ndarray) -> None:
        self.keys, self.put_at, self.encodings, self.gone_at = keys, put_at, encodings, gone_at
        self._by_key: dict[Any, bytes | None] | None = None

    def __len__(self) -> int:
        return len(self.keys)   # the flush's keys are distinct (a pending dict's)

    def as_dict(self) -> dict[Any, bytes | None]:
        if self._by_key is None:
            keys = self.keys
            by_key: dict[Any, bytes | None] = dict(zip(map(keys.__getitem__, self.put_at.tolist()), self.encodings))
            by_key.update(dict.fromkeys(map(keys.__getitem__, self.gone_at.tolist())))
            self._by_key = by_key
        return self._by_key

    def get(self, key: Any, default: Any = None) -> Any:
        return self.as_dict().get(key, default)


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


def _scan(db: rocksdict.Rdict, prefix: bytes | None = None) -> Iterator[tuple[Any, Any]]:
    """The rows of ``db`` whose key starts with ``prefix`` (all of them: None), in key order. The iterator is bounded
    above, so it stops at the prefix's end by itself: unbounded, every seek first walked over the deleted rows
    (tombstones) past the prefix, which made a scan per key after mass deletes (timers fired, maps emptied)
    quadratic.

    RocksDB's iterator stops at a damaged block as if the rows had ended and says so only in its status, which
    rocksdict's ``items()`` never asks: a scan through it would silently lose the rest of the rows (and a snapshot
    would write them lost). This one asks at the end and raises RocksDB's error ("Corruption: ...")."""
    options = rocksdict.ReadOptions()
    if prefix is not None:
        options.set_iterate_upper_bound(_next_prefix(prefix))
    # A generator, so that ``options`` lives as long as the iterator that points into it.
    it = db.iter(options)
    if prefix is None:
        it.seek_to_first()
    else:
        it.seek(prefix)
    rows = _iterated(it)
    del it   # held by ``rows`` alone: an error's traceback through this frame keeps no iterator (_iterated)
    yield from rows


def _iterated(it: Any) -> Iterator[tuple[bytes, bytes]]:
    """The rows of a positioned, bounded rocksdict iterator, to its end; RocksDB's error if it stopped at a damaged
    block, raised anew without the iterator in its traceback (a live iterator keeps the database open: see
    ``_fall_back_cold``)."""
    valid, key, value, advance = it.valid, it.key, it.value, it.next
    while valid():
        yield key(), value()
        advance()
    try:
        it.status()
        return
    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
        message = str(e)
    del it, valid, key, value, advance
    raise Exception(message)


def _open(path: str, *, read_only: bool = False) -> rocksdict.Rdict:
    """Open the database at ``path`` (created if missing), or, ``read_only``, a snapshot's copy of it to scan (no
    files written: a third of the CPU of an open to write)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_block_based_table_factory(table_options())
    # RocksDB's own info log: a kept database is opened every batch, and each open would keep the last log beside
    # it (up to 1000), which every seal then lists
    opts.set_keep_log_file_num(1)
    # RocksDB opens the database's files on up to 16 threads by default, started at each open: a kept database,
    # opened every batch, has few files, and starting the threads cost more CPU than opening them (~0.5 ms a batch)
    opts.set_max_file_opening_threads(2)
    if read_only:
        return rocksdict.Rdict(path, opts, access_type=rocksdict.AccessType.read_only())
    db = rocksdict.Rdict(path, opts)
    # No write-ahead log: the checkpoint is the durable copy; a warm database is flushed before its marker is written.
    write = rocksdict.WriteOptions()
    write.disable_wal = True
    db.set_write_options(write)
    return db


#: Level-0 files at which a kept database is compacted before it is closed (``_settle_level0``): RocksDB starts
#: compacting at 4 and slows writes at 20. A compaction here rewrites the whole database (each flush's file spans all
#: its keys): 14 CPU-s for the 5M keys of a subtask at 10M keys, so it is left to RocksDB's background as long as
#: level 0 stays well below the slowdown.
_LEVEL0_SETTLE_FILES = 12


def _settle_level0(db: rocksdict.Rdict) -> None:
    """Compact a kept database whose level 0 reached ``_LEVEL0_SETTLE_FILES``, before it is closed. A kept
    database is opened and closed every batch, and closing aborts the compaction RocksDB started in the background:
    when it cannot finish within a batch, level 0 only grows (every ingested flush adds a file spanning all keys)
    and every read, and every snapshot's scan, merges all of them: a warm batch's CPU then grew by about 20 ms per
    batch (the peer job, 50k keys, a flush every batch), and past 20 files RocksDB slows the writes. Compacted here
    past ``_LEVEL0_SETTLE_FILES``, the work is the one RocksDB would have done, once per that many flushes."""
    try:
        files = db.property_int_value("rocksdb.num-files-at-level0") or 0
    except Exception:  # noqa: BLE001 - rocksdict raises plain Exception; a property is never worth failing a close
        return
    if files >= _LEVEL0_SETTLE_FILES:
        db.compact_range(None, None)


#: A snapshot with at most this many full key groups reads them through iterators made at its capture, not from a
#: RocksDB checkpoint (see ``RocksDBKeyedStateBackend.snapshot``).
_PINNED_GROUPS = 64

#: Keys of a batch sampled by ``prefetch`` to tell whether a state's cache holds nearly all of them: with at most one
#: in 64 of the sample missing, the state's missing keys are read on first use, not looked for among all the keys
#: (a dict lookup per key, 70 ns at a batch's size, against a point read of about 1.5 us per missing key).
_PREFETCH_SAMPLE = 256

#: A catch-up applies the delta blocks committed since the kept database's checkpoint: those of value, list,
#: reducing and aggregating states as one SST file of puts and tombstones, written in compiled code (the rate of a
#: cold restore per row, for only the rows that changed); those with a map state's entries (a put replaces a key's
#: rows) or a migrated state's row by row in Python (about 1 us of CPU per row against 0.28 us for a compiled cold
#: restore, at 400k keys): when a map state is restored, past this fraction of the bytes of the range's chains,
#: restoring cold is cheaper, and is done instead.
CATCH_UP_DELTA_FRACTION = 0.25

#: A flush of at least this many value-state rows writes them into an SST file that RocksDB ingests
#: (``RocksDBKeyedStateBackend._ingest_rows``); a smaller one goes through a WriteBatch and the memtable (a file per
#: small flush would leave RocksDB many small files to compact).
_INGEST_ROWS = 4096


def _flush_writer_options() -> rocksdict.Options:
    """Options of a flush's SST file: the database's table options (bloom filter included: the next batch's
    prefetch asks it for keys it does not hold), uncompressed, as a memtable flush is cheap to write (compactions
    compress what they rewrite)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.set_block_based_table_factory(table_options())
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    return opts


def _frame_key(key_bytes: bytes) -> bytes:
    return _pack_u32(len(key_bytes)) + key_bytes


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
    if fixed and 8 + width == row:   # every row is exactly a key: numpy makes the bytes objects
        return m.view(f"V{row}").ravel().tolist(), order
    buf = m.tobytes()
    if fixed:
        size = 8 + width
        return [buf[i:i + size] for i in range(0, n * row, row)], order
    ends = (np.arange(n) * row + 8 + lengths[order]).tolist()
    return [buf[i * row:e] for i, e in enumerate(ends)], order


class _RocksTable:
    """One state's view of the backend: its state id, framings, cache and the keys written since the last flush
    (``pending``: key -> key-group index) and since the last snapshot (``changed``)."""

    __slots__ = ("backend", "ctx", "name", "state_id", "state_id_bytes", "meta", "descriptor", "read_framing",
                 "write_framing", "needs_migration", "is_map", "mutable", "check_put", "cache", "pending", "changed",
                 "flushed_rows", "parked", "unwritten")

    def __init__(self, backend: RocksDBKeyedStateBackend, name: str, state_id: int, meta: dict[str, Any],
                 read: ValueFraming, write: ValueFraming, descriptor: StateDescriptor | None) -> None:
        self.backend = backend
        self.ctx = backend._ctx
        self.name = name
        self.state_id = state_id
        self.state_id_bytes = _U16.pack(state_id)
        self.cache: dict[Any, Any] = {}
        self.pending: dict[Any, int] = {}
        self.changed: dict[Any, int] = {}
        # Keys snapshotted but not written to the database (write-back: their values are in the cache, which never
        # drops them unwritten), key -> key-group index.
        self.unwritten: dict[Any, int] = {}
        # The rows of the flush a snapshot just made (database keys and values written, ascending; database keys
        # deleted): its delta is cut from them in compiled code (see _capture_deltas). None after any other flush.
        self.flushed_rows: tuple[list[bytes], list[bytes], list[bytes]] | None = None
        # Decoded values a backend of this process kept for this state of the database resumed (_KeptCaches): the
        # stored meta they were decoded with and the cache; taken into ``cache`` when the state is registered with
        # that same meta, dropped otherwise.
        self.parked: tuple[Any, dict[Any, Any]] | None = None
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
        # what reducing and aggregating states store is checked here, at the write (see state._checks)
        self.check_put = stored_value_check(write)

    # ---- database keys -------------------------------------------------------------------------------------------
    @property
    def db(self) -> rocksdict.Rdict:
        """The backend's database (opened on first use: ``RocksDBKeyedStateBackend._db``)."""
        return self.backend._db

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
        key, group_index = self.current()
        self.backend._check_warm()
        if len(self.cache) >= self.backend.cache_limit:
            self.backend._flush(evict=True)
        prefix = self.db_key(group_index, key)
        framing = self.read_framing
        if self.backend._cache_complete(self):   # the database has no other value of this state: nothing to read
            v = MISSING
        elif self.is_map:
            rows = self.backend._read(lambda: self.rows(prefix))
            v = framing.decode(framing.map_from_rows(rows)) if rows else MISSING
        else:
            raw = self.backend._read(lambda: self.db.get(prefix))
            v = MISSING if raw is None else framing.decode(raw)
        self.cache[key] = v
        if self.mutable and v is not MISSING:
            self.pending[key] = group_index
        return v

    def whole(self, key: Any, group_index: int, overlay: _Overlay) -> Any:
        """A map key's overlay completed with its other rows from the database: the whole map (or MISSING)."""
        framing = self.read_framing
        self.backend._check_warm()
        m = {}
        prefix = self.db_key(group_index, key)
        for ukb, stored in self.backend._read(lambda: self.rows(prefix)):
            m.update(framing.decode(framing.map_from_rows([(ukb, stored)])))
        for uk, v in overlay.items():
            if v is MISSING:
                m.pop(uk, None)
            else:
                m[uk] = v
        v = m if m else MISSING
        self.cache[key] = v
        self.pending[key] = group_index  # the overlay may hold unflushed changes
        return v

    # ---- store interface of the generic states (maps: the whole map of the current key) ---------------------------
    def get(self) -> Any:
        c = self.ctx
        v = self.cache.get(c.key, _ABSENT)
        if v is _ABSENT:
            return self.load()
        if type(v) is _Overlay:
            key, group_index = self.current()
            return self.whole(key, group_index, v)
        if self.mutable and v is not MISSING:
            self.pending[c.key] = c.kgi
        return v

    def put(self, value: Any) -> None:
        key, group_index = self.current()
        if self.check_put is not None:
            check_stored(self.check_put, value, self)
        self.cache[key] = value
        self.pending[key] = group_index

    def delete(self) -> None:
        key, group_index = self.current()
        self.cache[key] = MISSING
        self.pending[key] = group_index

    def append(self, items: list[Any]) -> None:
        key, group_index = self.current()
        cur = self.cache.get(key, _ABSENT)
        if cur is _ABSENT:
            cur = self.load()
        if cur is MISSING:
            self.cache[key] = items  # a fresh list built by the state
        else:
            cur.extend(items)
        self.pending[key] = group_index

    def ttl_deadline(self) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptor)

    def fill(self, keys: list[Any], group_indexes: np.ndarray, order: np.ndarray, db_keys: list[bytes],
             raw: list[bytes | None]) -> None:
        """Cache a prefetched batch: ``raw[i]`` is the stored value (None: not stored) of ``db_keys[i]``, the
        database key of ``keys[order[i]]``; decoded together, cached in that order, in one compiled pass
        (``rocksstate.fill_cache``)."""
        rocksstate.fill_cache(self.cache, self.pending, keys, order.tolist(), raw, self.read_framing.decode_many,
                              self.mutable, group_indexes.tolist())

    # ---- flushing -------------------------------------------------------------------------------------------------
    def value_rows(self, encoded: dict[str, Any] | None) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """The database writes of the pending keys' values (not of a map state): (database keys put, their values,
        database keys deleted), each ascending; ``encoded`` (state name -> what was written) receives them, for a
        delta (``_Written``). The database keys are built, sorted and the values encoded in one compiled pass
        (``rocksstate``). The keys stay pending until the caller has written the rows."""
        db_keys, encodings, gone_db_keys, keys, put_at, gone_at = self.encoded(rocksstate.flush_values, self.pending)
        self.flushed_rows = None
        if encoded is not None:
            written: Any = _Written(keys, put_at, encodings, gone_at)
            earlier = encoded.get(self.name)
            if earlier:   # a second flush into one capture: merged, the later writes winning
                written = {**(earlier.as_dict() if isinstance(earlier, _Written) else earlier), **written.as_dict()}
            encoded[self.name] = written
            self.flushed_rows = (db_keys, encodings, gone_db_keys)
        return db_keys, encodings, gone_db_keys

    def encoded(self, encode: Callable[..., Any], keys: dict[Any, int], *args: Any,
                what: str = "write to the database") -> Any:
        """``encode(keys, cache, ...)`` (``rocksstate.flush_values`` or ``delta_values``: ``keys`` maps a cached key
        to its key-group index) with the table's encoders, key-group prefixes and state id, then ``args``. A value
        the serializer cannot write raises the framing's error naming the first such key in database-key order
        (``what``: what failed)."""
        b = self.backend
        write = self.write_framing
        try:
            return encode(keys, self.cache, b._key_encoder, write.writer, b._group_prefix, self.state_id_bytes, *args)
        except UNWRITABLE as e:
            key = write.first_unwritable(self._in_key_order(keys), b.key_serializer.serialize, MISSING)
            raise write.unwritable(key, e, what=what) from e

    def _in_key_order(self, keys: dict[Any, int]) -> list[tuple[Any, Any]]:
        """The (key, cached value) pairs of ``keys`` in database-key order (as the flush writes them), for the
        search of an unwritable one; in the dict's order when a key cannot be serialized."""
        cache = self.cache
        entries = [(k, cache[k]) for k in keys]
        try:
            db_keys = [self.db_key(gi, k) for k, gi in keys.items()]
        except UNWRITABLE:
            return entries
        return [entries[i] for i in sorted(range(len(entries)), key=db_keys.__getitem__)]

    def write_pending(self, ops: list[tuple[bytes, Any]], encoded: dict[Any, bytes | None] | None) -> None:
        """Add a map state's pending keys' writes to ``ops`` ((database key, value bytes; None: delete; a
        ``_Range``: delete the range from the key); when ``encoded`` is given, their value encodings too, for a
        delta: maps written as overlays are left out, their whole value is read back after the write)."""
        gp, sid, ser = self.backend._group_prefix, self.state_id_bytes, self.backend._serialize_key
        cache, write = self.cache, self.write_framing
        add = ops.append
        for key, group_index in self.pending.items():
            v = cache[key]
            try:
                k = gp[group_index] + sid + _frame_key(ser(key))
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


class _RocksValue(RocksValueCore, ValueState):
    """ValueState without TTL, straight on the table's cache: ``value``, ``update`` and ``clear`` in compiled code
    (``_native/rocksstate.pyx``), a key the cache does not hold loaded by the table."""

    __slots__ = ()


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
        key, group_index = t.current()
        m = t.cache.get(key, _ABSENT)
        if m is _ABSENT:
            t.backend._check_warm()
            if len(t.cache) >= t.backend.cache_limit:
                t.backend._flush(evict=True)
            m = t.cache[key] = _Overlay()
        return m, key, group_index

    def get(self, key: Any) -> Any:
        key = java_key(key)
        t = self._t
        m, k, group_index = self._entry()
        if m is MISSING:
            return None
        v = m.get(key, _ABSENT)
        if v is _ABSENT:
            if type(m) is not _Overlay:
                return None
            row = t.db_key(group_index, k) + self._uks(key)
            raw = t.backend._read(lambda: t.db.get(row))
            v = m[key] = MISSING if raw is None else self._uvd(raw)
        if v is MISSING:
            return None
        if t.mutable:
            t.pending[k] = group_index
        return v

    def contains(self, key: Any) -> bool:
        key = java_key(key)
        t = self._t
        m, k, group_index = self._entry()
        if m is MISSING:
            return False
        v = m.get(key, _ABSENT)
        if v is _ABSENT and type(m) is _Overlay:
            row = t.db_key(group_index, k) + self._uks(key)
            return t.backend._read(lambda: t.db.get(row)) is not None
        return v is not _ABSENT and v is not MISSING

    def put(self, key: Any, value: Any) -> None:
        key = java_key(key)
        t = self._t
        m, k, group_index = self._entry()
        if m is MISSING:
            m = t.cache[k] = {}
        m[key] = value
        t.pending[k] = group_index

    def put_all(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        mapping = java_map(mapping)
        t = self._t
        m, k, group_index = self._entry()
        if m is MISSING:
            m = t.cache[k] = {}
        m.update(mapping)
        t.pending[k] = group_index

    def remove(self, key: Any) -> None:
        key = java_key(key)
        t = self._t
        m, k, group_index = self._entry()
        if m is MISSING:
            return
        if type(m) is _Overlay:
            m[key] = MISSING
        elif m.pop(key, _ABSENT) is _ABSENT:
            return
        elif not m:
            t.cache[k] = MISSING
        t.pending[k] = group_index

    def _whole(self) -> Any:
        t = self._t
        m, k, group_index = self._entry()
        if type(m) is _Overlay:
            return t.whole(k, group_index, m)
        if t.mutable and m is not MISSING:
            t.pending[k] = group_index
        return m

    def items(self) -> list[tuple[Any, Any]]:
        m = self._whole()
        return [] if m is MISSING else list(m.items())

    def is_empty(self) -> bool:
        return self._whole() is MISSING

    def clear(self) -> None:
        self._t.delete()

_ROCKS_CLASSES = {"value": _RocksValue, "map": _RocksMap}


class RocksDBKeyedStateBackend(KeyedStateBackendBase):
    """Keyed state for one key-group range in a local RocksDB; same interface and snapshot format as
    ``HeapKeyedStateBackend``. ``db_dir``: parent directory of the database (a temporary directory by default);
    the database is deleted by ``dispose()`` (or on leaving a ``with`` block), at the latest when the backend is
    garbage-collected.

    ``cache_limit``: decoded entries each state caches before the cache is written to the database and emptied
    (bounds memory; see the module docs). ``warm_dir``: keep the database there across backends (one directory per
    key-group range under it) and reuse it when a restore finds it exactly at the checkpoint it restores (see the
    module docs); the caller keys ``warm_dir`` by checkpoint location and job (``runtime.subtask_state.warm_directory``).
    ``warm_takeover``: which other range's kept database to take over, and which to leave to other backends
    (``rocksdb_warm.WarmDirectory.claim``). ``write_back_batches``: a kept database of value, list, reducing and
    aggregating states is written at most every this many snapshots; the changes in between stay in the decoded
    values this process keeps (see the module docs); 1 writes it at every snapshot; None: ``DEFAULT_WRITE_BACK_BATCHES``.
    """

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0, incremental: bool = True, max_chain: int = DEFAULT_MAX_CHAIN,
                 delta_fraction: float = DEFAULT_DELTA_FRACTION, db_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int = DEFAULT_CACHE_LIMIT, warm_dir: str | os.PathLike[str] | None = None,
                 warm_takeover: Takeover = (None, frozenset()),
                 write_back_batches: int | None = None) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer, key_type=key_type, clock=clock,
                         allow_pickle=allow_pickle, subtask_index=subtask_index, incremental=incremental,
                         max_chain=max_chain, delta_fraction=delta_fraction)
        if isinstance(cache_limit, bool) or not isinstance(cache_limit, int) or cache_limit < 1:
            raise ValueError(f"cache_limit must be an int >= 1 (entries per state), got {cache_limit!r}")
        self.cache_limit = cache_limit
        if write_back_batches is None:
            write_back_batches = DEFAULT_WRITE_BACK_BATCHES
        if isinstance(write_back_batches, bool) or not isinstance(write_back_batches, int) or write_back_batches < 1:
            raise ValueError(f"write_back_batches must be an int >= 1 (snapshots per database write; 1: every "
                             f"snapshot writes it), got {write_back_batches!r}")
        self.write_back_batches = write_back_batches
        # Write-back: snapshots in a row taken without writing the database (whose marker stays at the one before),
        # the last one's (checkpoint id, snapshot file), and the states the database's marker vouches for.
        self._deferred = 0
        self._skipped = 0   # of those, the snapshots that left their chain compactions to the next written one
        self._lag_as_of: tuple[int, str] | None = None
        self._vouched_names: frozenset[str] | None = None
        self.set_current_key = self._ctx.set_current_key  # type: ignore[method-assign]  # no Python-level hop
        self._serialize_key = self.key_serializer.serialize
        self._key_encoder = Encoder(self.key_serializer)   # the same bytes as _serialize_key, in C
        self._group_prefix = [_U16.pack(g) for g in range(self._start, self._start + self._n)]
        self._tables: dict[str, _RocksTable] = {}
        self._gathered = SstRestore()   # a restore's blocks, until it ingests them as one file
        self._python_restored: set[int] = set()   # key groups a restore applied row by row (migrated states)
        self._writes = 0  # database writes so far: a marker vouches only for the write count it was captured at
        # Complete caches (_cache_complete): this backend's marks, and (write count, restored) of the last time the
        # database was looked at for any row, with the answer
        self._cache_epoch = object()
        self._probed: tuple[int, bool, bool] | None = None
        self._marker_writes = -1   # the write count the warm marker last written vouches for
        # A kept database's restore point and the write count when it was resumed: until the first write, a damaged
        # database can still be replaced by a cold restore of the same checkpoint (_fall_back_cold).
        self._resumed_from: tuple[CheckpointStorage, CheckpointMetadata] | None = None
        self._writes_at_resume = -1
        self._refilling = False
        self._catching_up = False   # applying a kept database's missing blocks on top of its rows (_catch_up)
        # Per key group, the files of the chain the database (with the pending writes) holds, and, per snapshot
        # file, that as of the snapshot: the warm marker names it, for a later catch-up (rocksdb_warm.behind).
        self._chain_files: dict[int, tuple[str, ...]] = {}
        self._snapshot_chains: dict[str, dict[int, tuple[str, ...]]] = {}
        self.warm = False  # True when restore() reused a warm database
        #: This range's claimed warm directory (``rocksdb_warm``); None: the database is not kept.
        self._warm = WarmDirectory.claim(warm_dir, key_group_range, warm_takeover) if warm_dir is not None else None
        self._given_to_others = frozenset(warm_takeover[1])   # kept ranges this batch's other backends take over
        self._marker_lock = self._warm.marker_lock if self._warm is not None else threading.Lock()
        if self._warm is None:
            self._dir = tempfile.mkdtemp(prefix="keygroups-rocksdb-", dir=db_dir)
        else:
            self._dir = self._warm.path
        # The database, once open (a one-element list the finalizer shares). A kept one is opened on first use, not
        # here: a warm batch served by the decoded values kept beside it (``_KeptCaches``) whose snapshot defers its
        # writes (write-back) never opens it (nor closes it). Its lock (``WarmDirectory.claim``) and the seal over its
        # files (``_open_kept``: file stats, before anything of it is read) are taken and checked here all the same.
        self._db_box: list[rocksdict.Rdict | None] = [None]
        self._db_opens = 0   # databases this backend opened (observed by tests)
        # RocksDB's estimate of its keys as of the last time this database was open in this process (_KEPT_ESTIMATES)
        self._kept_estimate: int | None = None
        self._kept_unopenable = False   # the kept database could not be opened: replaced by an empty one (_open_db)
        if self._warm is None:
            self._open_db(os.path.join(self._dir, "db"))
        # A kept database is used only once restore() has checked it against its checkpoint; anything that touches
        # the data first (a job that does not restore) empties it.
        self._unchecked = self._warm is not None
        self._finalizer = self._new_finalizer()

    @property
    def _db(self) -> rocksdict.Rdict:
        """The database, opened now if it is not yet (``_open_deferred``)."""
        db = self._db_box[0]
        return db if db is not None else self._open_deferred()

    def _ensure_open(self) -> None:
        """Open the database now if it is not yet (``_open_deferred``)."""
        if self._db_box[0] is None:
            self._open_deferred()

    def _open_deferred(self) -> rocksdict.Rdict:
        """Open the kept database on its first use. One that cannot be opened (a damaged file RocksDB reads on
        opening) is replaced: before a restore resumed it, by an empty one (``_open_db``); after (nothing was
        written to it: it was never open), by a cold restore of the checkpoint it was resumed at, the batch's
        cached changes kept (``_fall_back_cold``)."""
        db_dir = os.path.join(self._dir, "db")
        if self._resumed_from is None:
            return self._open_db(db_dir)
        try:
            return self._open_at(db_dir)
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
            error = f"cannot be opened: {e}"
        self._fall_back_cold(error)   # opens an empty database (_reset_db) and restores it
        db = self._db_box[0]
        assert db is not None
        return db

    def _open_at(self, db_dir: str) -> rocksdict.Rdict:
        """Open (or create) the database in ``db_dir`` as this backend's."""
        db = _open(db_dir)
        self._db_box[0] = db
        self._db_opens += 1
        return db

    def _open_db(self, db_dir: str) -> rocksdict.Rdict:
        """Open the database; a kept one that RocksDB cannot open (a damaged file it reads on opening) is deleted
        and created anew, with a warning: it is then restored, not reused."""
        try:
            return self._open_at(db_dir)
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
            if self._warm is None:
                raise
            log.warning("warm state: the kept RocksDB database in %s cannot be opened (%s); it is deleted and "
                        "restored", db_dir, str(e)[:200])
            self._warm.forget_kept()
            self._warm.remove_marker()
            self._kept_unopenable = True
        shutil.rmtree(db_dir, ignore_errors=True)
        return self._open_at(db_dir)

    def _new_finalizer(self) -> weakref.finalize:
        warm = self._warm
        return weakref.finalize(self, RocksDBKeyedStateBackend._cleanup, self._db_box, self._dir,
                                None if warm is None else warm.lock_file, None if warm is None else warm.secret,
                                None if warm is None else warm.kept_seal)

    @property
    def _warm_path(self) -> str | None:
        """The warm directory this backend's database is kept in; None: a temporary one."""
        return None if self._warm is None else self._warm.path

    @staticmethod
    def _cleanup(db_box: list[rocksdict.Rdict | None], path: str, lock_file: Any, secret: bytes | None,
                 found_seal: str | None) -> str | None:
        """Close the database; a kept one is sealed (its seal returned), any other deleted. A kept database never
        opened is as its seal found it (``found_seal``, if its marker still bears it): nothing to close or seal."""
        keep = lock_file is not None
        seal = None
        db, db_box[0] = db_box[0], None
        try:
            if db is not None:
                if keep:
                    _settle_level0(db)
                db.close()
                if keep and secret is not None:
                    seal = seal_kept(path, secret)
            elif keep and found_seal is not None:
                seal = found_seal if marker_seal(path) == found_seal else None
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
            if lock_file is not None:
                lock_file.close()  # releases the flock
        return seal

    def dispose(self) -> None:
        """Close the local database and delete it, unless it is kept warm (once; later calls do nothing). A kept
        database that is exactly its last snapshot's state leaves its states' decoded values to the next backend
        of this process that resumes it (``_KeptCaches``)."""
        caches, lag = self._parkable_caches()
        entries = self._kept_estimate
        if caches is not None and self._db_box[0] is not None and self._finalizer.alive:
            entries = self.estimated_entries()
        seal = self._finalizer()
        if caches is not None and self._warm is not None:
            if seal is not None:
                _KEPT_CACHES.park(self._warm.path, seal, caches, lag)
                if entries is not None:
                    _KEPT_ESTIMATES[self._warm.path] = (seal, entries)
            else:
                _KEPT_CACHES.take(self._warm.path, None)

    def _parkable_caches(self) -> tuple[_Caches | None, _Lag | None]:
        """Per state, (its stored meta, its cache) when the database is kept and holds exactly what the marker
        vouches for (nothing written, nothing pending since), with, after snapshots that did not write the database
        (write-back), the keys they left unwritten and the snapshot the caches are the state of; None otherwise."""
        if (self._warm is None or not self._finalizer.alive or self._unchecked or self._marker_writes != self._writes
                or any(t.pending for t in self._tables.values())):
            return None, None
        caches = {}
        for name, t in self._tables.items():
            if t.descriptor is not None or t.unwritten:
                if t.cache:
                    caches[name] = (_canonical(t.meta), t.cache)
            elif t.parked is not None:   # restored, not registered this batch: its kept values wait on
                caches[name] = t.parked
        unwritten = {name: t.unwritten for name, t in self._tables.items() if t.unwritten}
        if not unwritten:
            return caches, None
        if self._lag_as_of is None:
            return None, None
        return caches, (unwritten, *self._lag_as_of, self._deferred, self._skipped)

    def estimated_entries(self) -> int:
        """RocksDB's own estimate of its keys (``rocksdb.estimate-num-keys``; writes still cached in Python are not
        in it until the next flush, which every snapshot does). A kept database not opened (yet): its estimate when
        this process last closed it."""
        if self._db_box[0] is None and self._kept_estimate is not None:
            return self._kept_estimate
        return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)

    # ---- hooks ------------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        if self._refilling:
            return False   # a kept database replaced by a cold restore (_fall_back_cold): the cache stays
        if any(t.pending or t.unwritten for t in self._tables.values()):
            return True
        for _ in _scan(self._db):
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
        if t.unwritten and _canonical(meta) != _canonical(t.meta):
            # values kept unwritten (write-back), decoded with the old serializers: written with them, then dropped
            self._ensure_open()   # before the state changes (one found damaged is replaced first)
            self._flush()
            t.cache = {}
        t.configure(meta, read, write, d)
        parked, t.parked = t.parked, None
        if parked is not None and not t.needs_migration and parked[0] == _canonical(meta) and not t.cache:
            # the values a backend of this process decoded from (or wrote to) this very database, with this meta
            t.cache = parked[1]   # no state object holds the empty cache yet: they are made after this

    def _after_register(self, name: str) -> None:
        # Restored bytes were ingested as written by the old serializers: migrated now, all of them. Entries that
        # expired are not (the restore could not tell, the state being unregistered then): as on the heap, a read
        # finds them expired and the next full snapshot leaves them out, so registering costs nothing per row.
        # A kept database whose scan meets damage is restored cold instead (``_read``), which migrates as it
        # writes: nothing is left to rewrite then.
        t = self._tables[name]
        if t.needs_migration:
            self._ensure_open()   # first: one found damaged is restored cold, migrated as it is written
            self._read(lambda: self._rewrite(t) if t.needs_migration else None)

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
        for k, v in _scan(self._db):
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
        plain = _ROCKS_CLASSES[kind] if not ttl and kind in _ROCKS_CLASSES else super()._state_class(kind, ttl)
        return checked_state_class(kind, plain)

    def _restore_section(self, target: _RocksTable, group_index: int, keys: list[Any], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise CorruptSnapshotError(f"state {target.name!r}: a section has {len(keys)} keys and {len(values)} "
                                       "values")
        prefix = self._group_prefix[group_index] + target.state_id_bytes
        read, write = target.read_framing, target.write_framing
        batch = rocksdict.WriteBatch(raw_mode=True)
        # a catch-up writes TTL values as they are: one dropped here would leave the older row it replaces
        deadline = None if self._catching_up else target.ttl_deadline()
        for key_bytes, value_bytes in zip(keys, values):
            if target.needs_migration:
                value_bytes = write.encode(read.decode(value_bytes))
            k = prefix + _frame_key(bytes(key_bytes))
            if deadline is not None:
                value_bytes = write.drop_expired_bytes(value_bytes, deadline)
                if value_bytes is None:
                    # an expired put still replaces the key's older row, which may outlive it (TTL stamps need not
                    # grow along a chain: a clock stepped back, event time's not-started stamp); a map's rows are
                    # gone already (_apply_block)
                    if not target.is_map:
                        batch.delete(k)
                    continue
            if target.is_map:
                for user_key_bytes, stored in (write if target.needs_migration else read).map_rows(value_bytes):
                    batch.put(k + user_key_bytes, stored)
            else:
                batch.put(k, bytes(value_bytes))
        self._write(batch)

    def _restore_block(self, handle: KeyedStateHandle | None, targets: list[Any], block: KeyGroupBlock) -> None:
        """Take one block of a restore, after the key group's earlier ones: gathered for the SST file the restore
        ingests at its end (``rocksdb_ingest``), or, for a state whose stored bytes must be migrated to new
        serializers, applied at once, row by row (what was gathered is ingested first, so the order holds)."""
        if self._catching_up:   # onto the rows the kept database holds
            touched = ([targets[s] for s, keys, _ in block.puts if len(keys) > 1]
                       + [targets[s] for s, keys in block.deletes if len(keys) > 1])   # offsets: keys + 1
            if block.full or any(t.is_map or t.needs_migration for t in touched):
                # row by row (a map's put replaces rows, migrated bytes are re-encoded), after what was gathered
                self._ingest_gathered()
                self._apply_block(handle, targets, block)
            else:
                self._gathered.add(targets, block)   # puts and tombstones in one file (SstRestore's over_kept)
            return
        if any(t.needs_migration for t in targets):
            self._ingest_gathered()
            self._python_restored.add(block.key_group)
            self._apply_block(handle, targets, block)
            return
        if block.full and block.key_group in self._python_restored:
            # rows applied row by row before this full block: it replaces them, and the file ingested later is newer
            prefix = self._group_prefix[block.key_group - self._start]
            self._db.delete_range(prefix, _next_prefix(prefix))
            self._python_restored.discard(block.key_group)
        self._gathered.add(targets, block)

    def _ingest_gathered(self) -> None:
        """Write the blocks gathered so far into one SST file and ingest it (see ``rocksdb_ingest``)."""
        if self._gathered:
            gathered, self._gathered = self._gathered, SstRestore(over_kept=self._catching_up)
            gathered.ingest(self._db, self._dir, self._write_with)

    def _apply_block(self, handle: KeyedStateHandle | None, targets: list[Any], block: KeyGroupBlock) -> None:
        """Apply one block on top of the key group's earlier ones, row by row: a full block replaces every row of
        the key group; puts replace a key's value (a map's rows with the new ones), deletes remove the key."""
        group_index = block.key_group - self._start
        if block.full:
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.delete_range(self._group_prefix[group_index], _next_prefix(self._group_prefix[group_index]))
            self._write(batch)
        mv = block.block
        for state_index, key_offsets, value_offsets in block.puts:
            if len(key_offsets) != len(value_offsets):
                source = handle.file if handle is not None else "a re-keyed block"
                raise CorruptSnapshotError(f"{source}: key group {block.key_group}, state {state_index}: "
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
        self._ingest_gathered()
        self._python_restored.clear()
        for t in self._tables.values():
            if t.descriptor is not None:
                t.configure(t.meta, t.write_framing, t.write_framing, t.descriptor)

    # ---- the cache --------------------------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[Any], key_groups: Sequence[int] | np.ndarray | None = None) -> None:
        """Load ``keys`` (a batch's distinct keys) into every state's cache, so the batch's reads hit decoded
        values. ``key_groups`` (the keys' key groups, absolute) saves hashing them again. Keys the cache already
        holds (from earlier in the batch, or kept from the batch before: ``_KeptCaches``) are not read again; the
        others' database keys are built and sorted in one vectorized pass and read in key order with one multi-get
        per state (a state whose rows the batch mostly touches by one ordered scan of the touched key groups
        instead). A state whose cache holds nearly all of a large batch's keys (an even sample says so:
        ``_mostly_cached``) reads none here: its few others load on first use. Keys past the cache limit are left
        to load on first use; map states load theirs entry by entry."""
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
        with _gc_paused():
            for t in tables:
                if not self._mostly_cached(t.cache, keys):
                    self._load(t, keys, groups, len(tables))

    @staticmethod
    def _mostly_cached(cache: dict[Any, Any], keys: list[Any]) -> bool:
        """Whether an even sample of a large batch's keys says ``cache`` holds nearly all of them (as the values
        kept from the batches before do, once the keys recur): then looking every key up to find the few others
        costs more than reading those few one at a time on first use (``load``: a point read each)."""
        n = len(keys)
        if n < _PREFETCH_SAMPLE * 8 or len(cache) < n:
            return False
        sample = keys[::n // _PREFETCH_SAMPLE][:_PREFETCH_SAMPLE]
        return len(rocksstate.uncached(cache, sample)) * 64 <= len(sample)

    def _complete_mark(self) -> tuple[object, int, bool]:
        return (self._cache_epoch, self._writes, self._restored)

    def _cache_complete(self, t: _RocksTable) -> bool:
        """Whether table ``t``'s cache holds every value of its state in this backend's key groups (the database's
        rows, and those left unwritten: write-back), so that a key it lacks has no value and needs no read. Known
        from a mark in the cache (``_COMPLETE``), valid while nothing but a flush of the caches (``_flush``, which
        renews it) wrote the database and no restore happened since it was made: any other write (a restore, a
        catch-up, a ranged delete, a database replaced) counts in ``_writes`` and voids it, and emptying the cache
        drops it. Made when the database is found to hold no row at all (a backend that restored nothing: every
        value is in the caches); a cache parked by an earlier backend of this process (``_KeptCaches``, for this
        very database: its seal is checked when taken) keeps its mark, valid when parked (``snapshot`` drops one no
        longer valid, and parking needs nothing written since), as long as this backend resumed that database and
        wrote nothing. A stale mark is dropped here."""
        cache = t.cache
        mark = cache.get(_COMPLETE)
        if mark is None:
            if self._restored or self._unchecked or self._refilling or not self._database_empty():
                return False
            cache[_COMPLETE] = self._complete_mark()
            return True
        epoch, writes, restored = mark
        if epoch is self._cache_epoch:
            if writes == self._writes and restored == self._restored:
                return True
        elif self._resumed_from is not None and self._writes == 0 and self._restored:
            cache[_COMPLETE] = self._complete_mark()   # this backend's from now on
            return True
        del cache[_COMPLETE]
        return False

    def _database_empty(self) -> bool:
        """Whether the database holds no row at all (looked at once per write count)."""
        now = (self._writes, self._restored)
        if self._probed is None or self._probed[:2] != now:
            empty = True
            for _ in _scan(self._db):
                empty = False
                break
            self._probed = (*now, empty)
        return self._probed[2]

    def _load(self, t: _RocksTable, keys: list[Any], groups: np.ndarray, tables: int = 1) -> None:
        """Cache table ``t``'s values of ``keys`` (distinct, canonical; ``groups``: their absolute key groups) that
        its cache does not hold yet: one multi-get (or one ordered scan per key group when they are most of the
        rows of ``tables`` states). The cache is flushed and emptied first if they would not fit."""
        if len(t.cache) + len(keys) > self.cache_limit:
            self._flush(evict=True)
        cache = t.cache
        if cache:
            wanted = rocksstate.uncached(cache, keys)
            if not wanted:
                return
            want_keys, want_groups = list(map(keys.__getitem__, wanted)), groups[wanted]
        else:
            want_keys, want_groups = keys, groups
        if not want_keys:
            return
        if self._cache_complete(t):   # the database has no other value of this state: nothing to read
            t.cache.update(dict.fromkeys(want_keys, MISSING))
            return
        db_keys, order = _sorted_db_keys(self.key_serializer.serialize_many, want_keys, want_groups, t.state_id,
                                         unique=True)
        estimate = self._db.property_int_value("rocksdb.estimate-num-keys") or 0
        if 4 * len(db_keys) * tables >= estimate:
            groups_wanted = np.unique(want_groups).tolist()
            raw = self._read(lambda: self._scan(db_keys, groups_wanted, t.state_id_bytes))
        else:
            raw = self._read(lambda: self._db.get(cast(Any, db_keys)))   # one multi-get
        t.fill(want_keys, want_groups - self._start, order, db_keys, raw)

    def get_values(self, name: str, keys: Sequence[Any]) -> list[Any]:
        """The value of registered value state ``name`` for each of ``keys`` (None where it has none), as
        ``value()`` reads them one key at a time. For a value state without TTL: the keys the cache does not hold
        read with one multi-get, the values then taken from the cache in one compiled pass; other states (TTL)
        key by key. Leaves the last key current."""
        state = self._states[name]
        t = self._tables.get(name)
        if not isinstance(state, _RocksValue) or t is None or len(keys) > self.cache_limit:
            return super().get_values(name, keys)
        keys, indexes = rocksstate.current_keys(self._ctx, list(keys))
        if not keys:
            return []
        self._check_warm()
        with _gc_paused():
            distinct = list(dict.fromkeys(keys)) if len(set(keys)) != len(keys) else keys
            if distinct is keys:
                groups = np.asarray(indexes, dtype=np.int64) + self._start
            else:
                where = dict(zip(keys, indexes))
                groups = np.fromiter(map(where.__getitem__, distinct), np.int64, len(distinct)) + self._start
            self._load(t, distinct, groups)
            if len(t.cache) > self.cache_limit:   # (repeats only) past the limit: key by key, as value() loads
                return super().get_values(name, keys)
            d = t.descriptor
            assert d is not None
            ser = d.serializers["value"]
            return rocksstate.cached_values(t.cache, t.pending, keys, indexes, t.mutable, d.default,
                                            None if ser.is_immutable else ser.copy)

    def put_values(self, name: str, keys: Sequence[Any], values: Sequence[Any]) -> None:
        """Set registered value state ``name`` of each of ``keys`` to the matching value (None clears it), as
        ``update()`` does one key at a time: for a value state without TTL whose serializer checks nothing on
        write, into the cache in one compiled pass (the next flush writes them with one WriteBatch); other states
        key by key. Leaves the last key current."""
        if len(keys) != len(values):
            raise ValueError(f"put_values: {len(keys)} keys but {len(values)} values")
        state = self._states[name]
        t = self._tables.get(name)
        if type(state) is not _RocksValue or t is None:   # TTL, or checked on write: through the state
            super().put_values(name, keys, values)
            return
        keys, indexes = rocksstate.current_keys(self._ctx, list(keys))
        if not keys:
            return
        self._check_warm()
        if len(t.cache) + len(keys) > self.cache_limit:
            self._flush(evict=True)
        rocksstate.cache_writes(t.cache, t.pending, keys, indexes, list(values))

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
        """Write ``batch`` to the database (see ``_write_with``)."""
        self._write_with(functools.partial(self._db.write, batch))

    def _write_with(self, write: Callable[[], None]) -> None:
        """Run ``write`` (a write to the database); the first write after a snapshot removes the warm marker, which
        no longer holds."""
        with self._marker_lock:
            self._writes += 1
            if self._warm is not None:
                self._warm.remove_marker()
        write()

    def _ingest_rows(self, runs: list[tuple[list[bytes], list[bytes], list[bytes]]]) -> None:
        """Write value states' rows (per state: database keys put, their values, database keys deleted; each
        ascending) into one SST file, merged in key order in compiled code (``rocksstate.write_sorted_rows``;
        deletes become tombstones), and ingest it: a large flush's rows skip the memtable, and the flush of it to
        disk that every snapshot of a kept database forces (``_INGEST_ROWS``)."""
        fd, path = tempfile.mkstemp(prefix="flush-", suffix=".sst", dir=self._dir)
        os.close(fd)
        try:
            writer = rocksdict.SstFileWriter(_flush_writer_options())
            writer.open(path)
            rocksstate.write_sorted_rows(writer, [(put, values) for put, values, _ in runs]
                                         + [(gone, None) for _, _, gone in runs if gone])
            writer.finish()
            options = rocksdict.IngestExternalFileOptions()
            options.set_move_files(True)
            self._write_with(functools.partial(self._db.ingest_external_file, [path], options))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def _flush(self, *, evict: bool = False, encoded: dict[str, Any] | None = None,
               rows_out: dict[str, tuple[list[tuple[list[bytes], list[bytes]]], list[dict[Any, int]]]] | None = None
               ) -> None:
        """Write every state's pending keys in one WriteBatch; ``evict`` empties the caches afterwards.
        ``encoded`` (state name -> key -> value encoding or None; a value state's a ``_Written``) receives what was
        written, for a delta. Keys snapshotted without being written (write-back) are written first. ``rows_out``
        (value-like states only) receives per state name the rows put (runs of database keys and values, each
        ascending) and the keys written (dicts: key -> key-group index), for full blocks cut from them
        (``_full_from_caches``)."""
        self._check_warm()
        self._ensure_open()   # before anything is written (one found damaged is replaced first)
        # what the flush writes comes from the caches: one that held every value still does, after the writes
        complete = [t for t in self._tables.values() if self._cache_complete(t)]
        with _gc_paused():
            batch = rocksdict.WriteBatch(raw_mode=True)
            ops: list[tuple[bytes, Any]] = []
            # the keys snapshots left unwritten (write-back) that no pending write covers: in the same file or batch
            by_table = self._unwritten_runs()
            runs = [run for _, run in by_table]
            flushed = [t for t in self._tables.values() if t.pending]
            for t in flushed:
                if t.is_map:
                    t.write_pending(ops, None if encoded is None else encoded.setdefault(t.name, {}))
                else:
                    run = t.value_rows(encoded)
                    runs.append(run)
                    by_table.append((t, run))
            if rows_out is not None:   # before the pending and unwritten keys are let go of, below
                for t, (put, values, _) in by_table:
                    rows_out.setdefault(t.name, ([], []))[0].append((put, values))
                for t in self._tables.values():
                    if not t.is_map and (t.pending or t.unwritten):
                        rows_out.setdefault(t.name, ([], []))[1].extend(
                            d for d in (dict(t.pending), t.unwritten) if d)
            rows = sum(len(put) + len(gone) for put, _, gone in runs)
            if rows >= _INGEST_ROWS:
                # value and map states' keys never meet (the state id is in the key): the file and the batch apart
                self._ingest_rows(runs)
            else:
                for db_keys, encodings, gone_db_keys in runs:
                    collections.deque(map(batch.delete, gone_db_keys), maxlen=0)
                    collections.deque(map(batch.put, db_keys, encodings), maxlen=0)
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
            if ops or 0 < rows < _INGEST_ROWS:
                self._write(batch)
            # Only now: a value that cannot be written leaves every state's pending writes for the next flush.
            for t in self._tables.values():
                if t.unwritten:
                    t.unwritten = {}   # (a new dict: ``rows_out`` may hold the old one)
            for t in flushed:
                t.changed.update(t.pending)
                t.pending.clear()
            for t in complete:
                t.cache[_COMPLETE] = self._complete_mark()
        if evict:
            for t in self._tables.values():
                t.cache.clear()

    def _unwritten_runs(self) -> list[tuple[_RocksTable, tuple[list[bytes], list[bytes], list[bytes]]]]:
        """The rows of the keys snapshots left unwritten (write-back) that no pending write covers, per state (its
        table; database keys put, their values, database keys deleted; each ascending), for the flush to write with
        its own: the database then holds the state again, and its marker can vouch for it at the next snapshot."""
        runs = []
        for t in self._tables.values():
            if not t.unwritten:
                continue
            # the pending keys left out in the compiled pass (no set of the others made in Python)
            put, values, gone = t.encoded(rocksstate.flush_values, t.unwritten, t.pending)[:3]
            if put or gone:
                runs.append((t, (put, values, gone)))
        return runs

    def _write_rows(self, runs: list[tuple[list[bytes], list[bytes], list[bytes]]]) -> None:
        """Write value states' rows (per state: database keys put, their values, database keys deleted; each
        ascending): as one ingested SST file when many, else one WriteBatch."""
        if not runs:
            return
        if sum(len(put) + len(gone) for put, _, gone in runs) >= _INGEST_ROWS:
            self._ingest_rows(runs)
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        for db_keys, encodings, gone_db_keys in runs:
            collections.deque(map(batch.delete, gone_db_keys), maxlen=0)
            collections.deque(map(batch.put, db_keys, encodings), maxlen=0)
        self._write(batch)

    def _may_defer(self, required_full: set[int]) -> bool:
        """Whether this snapshot may leave the database unwritten (write-back): a kept database whose marker
        vouches for its files as they are (nothing written since), fewer than ``write_back_batches - 1`` snapshots
        in a row deferred, value-like states only (a map's cache holds overlays), each one the marker vouches for,
        and no key group that must be written full (``required_full``: the chain compactions aside, which the next
        written snapshot makes up for: see ``_skipped_compactions``)."""
        tables = self._tables.values()
        if (self._warm is None or self._deferred + 1 >= self.write_back_batches or self._unchecked
                or self._marker_writes != self._writes or self._vouched_names is None or self._chains is None
                or not any(t.pending or t.unwritten for t in tables)):
            return False
        if any(t.is_map or t.needs_migration or t.name not in self._vouched_names for t in tables):
            return False
        return not required_full

    def _skipped_compactions(self) -> set[int]:
        """After ``self._skipped`` deferred snapshots that left out chain compactions, the compactions they would have
        made: as many key groups as that many snapshots rewrite (the worst first), so that chains stay as long as
        without write-back."""
        if self._chains is None:
            return set()
        return choose_full_key_groups(self._chains, self._n * (self._skipped + 1), max_chain=self.max_chain,
                                      delta_fraction=self.delta_fraction)

    def _full_in_caches(self) -> bool:
        """Whether every state's cache holds its whole state (``_cache_complete``; marked already: nothing is read
        to find out) in a form a full block is encoded from as the flush encodes it: value, list (without a TTL
        cleanup at snapshots), reducing and aggregating states, none migrating."""
        tables = self._tables.values()
        return bool(tables) and all(
            not t.is_map and not t.needs_migration and t.cache.get(_COMPLETE) is not None
            and not (t.meta["kind"] == "list" and t.ttl_deadline() is not None) and self._cache_complete(t)
            for t in tables)

    def _full_from_caches(self, tables: list[_RocksTable], full: set[int], deadlines: dict[int, int | None],
                          flushed: dict[str, tuple[list[Any], list[dict[Any, int]]]] | None = None
                          ) -> dict[int, list[Any]] | None:
        """The full blocks' sections of key groups ``full`` (key group -> ``[(state index, keys, values), ...]``,
        as ``sstload.value_sections`` scans them from the database) encoded from the caches when they hold every
        state whole (``_full_in_caches``), else None (the database is scanned). The cached keys of those key groups
        are found in one compiled pass (``rocksstate.cached_in_groups``) and encoded in another
        (``rocksstate.delta_values``; a TTL-expired value left out): a full key group costs what the heap backend
        pays for it, not a database scan (a Python-level iterator step per row). The pass over each cache costs
        about as much as encoding an eighth of it: the snapshot that writes the database back makes the
        compactions of the deferred ones before it in one pass, rather than each deferred snapshot making its own
        (measured: ``benchmarks/bench_rocksdb_warm.py --phases``).

        ``flushed`` (``_flush``'s ``rows_out``: the snapshot's own flush, just made): a state's rows that flush put
        are cut into the full blocks as they are (``rocksstate.full_sections``), and only the cached keys of those
        key groups it did not write are encoded (at a write-back the flush wrote the changes of several batches:
        nearly every key), so the keys and values are not encoded a second time."""
        if not self._full_in_caches():
            return None
        out: dict[int, list[Any]] = {g: [] for g in full}
        for t in sorted(tables, key=lambda t: t.state_id):
            cache = t.cache
            deadline = deadlines[t.state_id]
            runs, written = flushed.get(t.name, ([], [])) if flushed is not None else ([], [])
            chosen = rocksstate.cached_in_groups(cache, self._ctx, _COMPLETE, full, tuple(written))
            if written:
                if chosen:   # cached, not written by the flush: encoded as it would write them
                    runs = [*runs, t.encoded(rocksstate.flush_values, chosen, what="write to a snapshot")[:2]]
                for g, puts in rocksstate.full_sections(runs, full, t.write_framing.ttl, deadline):
                    out[g].append((t.state_id, Packed(*puts[0]), Packed(*puts[1])))
                continue
            if not chosen:
                continue
            sections = t.encoded(rocksstate.delta_values, chosen, self._start, (), t.write_framing.ttl, deadline,
                                 what="write to a snapshot")
            for g, puts, _ in sections:   # a delete (no value, or expired) is no row of a full block
                if puts is not None:
                    out[g].append((t.state_id, Packed(*puts[0]), Packed(*puts[1])))
        return out

    def _encode_deferred(self, encoded: dict[str, Any]) -> dict[str, list[Any]]:
        """A deferred snapshot's part of a flush: every pending key's value encoded into its delta sections
        (``rocksstate.delta_values``; a list state with TTL: into ``encoded``, its delta made by ``_capture_deltas``),
        nothing written; the keys stay in the cache, unwritten. The sections by state name."""
        cut: dict[str, list[Any]] = {}
        with _gc_paused():
            for t in self._tables.values():
                if not t.pending:
                    continue
                deadline = t.ttl_deadline()
                if t.meta["kind"] == "list" and deadline is not None:
                    t.value_rows(encoded)
                    continue
                cut[t.name] = t.encoded(rocksstate.delta_values, t.pending, self._start, (), t.write_framing.ttl,
                                        deadline)
            for t in self._tables.values():
                t.changed.update(t.pending)
                t.unwritten.update(t.pending)
                t.pending.clear()
        return cut

    # ---- iteration --------------------------------------------------------------------------------------------------
    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, in key-group order."""
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        self._flush()  # (checks a kept database first)
        deserialize = self.key_serializer.deserialize
        last = None
        for k in self._read(lambda: [k for k, _ in _scan(self._db)]):
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
        for group_index in range(self._n):
            prefix = self._group_prefix[group_index] + t.state_id_bytes
            key_bytes: bytes | None = None
            rows: list[tuple[bytes, bytes]] = []
            for k, v in _scan(self._db, prefix):
                _, _, kb, user_key = _split_db_key(cast(bytes, k))
                if kb != key_bytes:
                    if rows:
                        yield self._start + group_index, deserialize_key(key_bytes), list(
                            framing.decode(framing.map_from_rows(rows)))
                    key_bytes, rows = kb, []
                rows.append((user_key, cast(bytes, v)))
            if rows:
                yield (self._start + group_index, deserialize_key(key_bytes),
                       list(framing.decode(framing.map_from_rows(rows))))

    # ---- warm database ----------------------------------------------------------------------------------------------
    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, *, lazy: bool = True) -> RestoreStats:
        """Restore as every backend does (see ``KeyedStateBackendBase.restore``), or, with ``warm_dir``, reuse the
        database kept there when its marker shows it is exactly this checkpoint's state of this key-group range
        (then nothing is read: the stats say 0 bytes and ``self.warm`` is True), or the kept database of an
        overlapping range at this checkpoint (a :class:`~keygroups.state.warm.WarmResume`: the key groups that
        arrived are read, those that left deleted; see ``_resume_moved``)."""
        # Python's cyclic collector stays out: a restore makes few objects and no cycles, but a full collection it
        # happened to trigger walked every object of the process (35 ms in one restore of 1.3M rows, a sixth of its CPU).
        with _gc_paused():
            stats = self._restore(storage, metadata, lazy)
        self._chain_files = _files_of_chains(_committed_chains(metadata, self.key_group_range))
        return stats

    def _restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, lazy: bool) -> RestoreStats:
        if self._warm is not None and not self._restored:
            taken = _KEPT_CACHES.take(self._warm.path, self._warm.kept_seal)
            kept, lag = taken if taken is not None else (None, None)
            estimate = _KEPT_ESTIMATES.pop(self._warm.path, None)
            if estimate is not None and estimate[0] == self._warm.kept_seal is not None:
                self._kept_estimate = estimate[1]
            if self._warm.moved_from is not None:
                self._ensure_open()   # before it is trusted (one that cannot be opened is forgotten)
            restoring = metadata.checkpoint_id
            self._warm.remove_stale(restoring, spare=self._may_be_taken_over(restoring))
            if self._warm.moved_from is not None:
                moved = self._resume_moved(storage, metadata, lazy)
                if moved is not None:
                    self._resumed(storage, metadata)
                    return moved
                self._reset_db()
                return super().restore(storage, metadata, lazy=lazy)
            behind = self._warm.behind(storage, metadata, self.max_parallelism)
            states = self._warm.states_at(storage, metadata, self.max_parallelism)
            if lag is not None:
                if states is None and behind is not None and kept is not None and self._adopt(
                        metadata, lazy, behind, kept, lag):
                    self._resumed(storage, metadata)
                    return RestoreStats(0, 0)
                kept = None   # the state of another snapshot than this restore's: the database catches up alone
            if states is None and behind is not None:
                self._ensure_open()   # before it is trusted (one that cannot be opened is forgotten)
                if self._kept_unopenable:
                    behind = None
            if states is None and behind is not None:
                caught = self._catch_up(storage, metadata, lazy, *behind)
                if caught is not None:
                    self._resumed(storage, metadata)
                    return caught
            if states is not None:
                self._unchecked = False
                self._restored = True
                self.warm = True
                for meta in states:
                    t = self._restore_target(meta)
                    if kept is not None and isinstance(t, _RocksTable) and meta["name"] in kept:
                        t.parked = kept[meta["name"]]
                self._chains = chain_stats(metadata, self.key_group_range)
                self._chain_metas = {meta["name"]: _canonical(meta) for meta in states}
                self._after_restore(lazy)
                self._resumed(storage, metadata)
                self._marker_writes = self._writes   # its marker vouches for the database as it is
                self._vouched_names = frozenset(self._chain_metas)
                return RestoreStats(0, 0)
            self._reset_db()
        return super().restore(storage, metadata, lazy=lazy)

    def _may_be_taken_over(self, restoring: int) -> Callable[[str, KeyGroupRange], bool]:
        """Whether a kept database of another range whose marker is older than checkpoint ``restoring`` may still
        be taken over by a sibling backend restoring it: this process keeps what it lacks (write-back), or the
        batch gives that range to another backend, which then catches its kept key groups up (``_resume_moved``)."""
        def spare(path: str, kept: KeyGroupRange) -> bool:
            return (_KEPT_CACHES.lag_as_of(path) == restoring
                    or (kept.start, kept.end) in self._given_to_others)
        return spare

    def _adopt(self, metadata: CheckpointMetadata, lazy: bool,
               behind: tuple[int, str, list[dict[str, Any]], dict[int, tuple[str, ...]]], kept: _Caches,
               lag: _Lag) -> bool:
        """Resume a kept database that snapshots of this process left behind (write-back) with the caches they
        parked: when ``metadata`` restores exactly the snapshot those caches are the state of (its checkpoint and
        this range's snapshot file), the database (at its marker's checkpoint, ``behind``) and the unwritten keys'
        cached values together are that state. False (nothing changed) otherwise: then it catches up."""
        unwritten, as_of, as_of_file, deferred, skipped = lag
        r = self.key_group_range
        handles = [h for h in metadata.keyed_handles if h.file == as_of_file and h.key_group_range == r]
        if metadata.checkpoint_id != as_of or not handles:
            return False
        _, _, states, _ = behind
        known = {meta["name"]: _canonical(meta) for meta in states}
        if (not unwritten.keys() <= kept.keys() or not kept.keys() <= known.keys()
                or any(kept[name][0] != known[name] for name in kept)
                or {meta["name"] for h in handles for meta in h.states} != known.keys()
                or not _same_metas(known, handles)):
            return False
        for name in kept:   # a state registered before the restore: its state objects hold its (empty) cache
            t = self._tables.get(name)
            if name in self._externals or (t is not None and t.descriptor is not None and (
                    _canonical(t.meta) != known[name] or t.cache or t.pending or t.unwritten)):
                return False
        self._unchecked = False
        self._restored = True
        self.warm = True
        for meta in states:
            t = self._restore_target(meta)
            name = meta["name"]
            if name in kept and isinstance(t, _RocksTable):
                if t.descriptor is not None:
                    t.cache.update(kept[name][1])
                else:
                    t.cache = kept[name][1]
                t.unwritten = unwritten.get(name, {})
        self._chains = chain_stats(metadata, r)
        self._chain_metas = dict(known)
        self._after_restore(lazy)
        self._deferred = deferred
        self._skipped = skipped
        self._lag_as_of = (as_of, as_of_file)
        self._marker_writes = self._writes
        self._vouched_names = frozenset(known)
        return True

    def _resume_moved(self, storage: CheckpointStorage, metadata: CheckpointMetadata, lazy: bool
                      ) -> WarmResume | None:
        """Restore from the kept database of another, overlapping range (``_take_moved``) if its marker shows it is
        exactly this checkpoint's state of that range: the key groups that left are deleted (a ranged delete each
        run), those still owned stay as they are, and the chains of those that arrived are read (ranged reads, as a
        restore reads them). A database behind this checkpoint (write-back, or batches run elsewhere) is first
        completed from the values its process parked, when that is this process (``_complete_moved``: nothing
        read), else the key groups it keeps catch up from the checkpoint chain, reading only the blocks newer than
        its marker (``_catch_up_plan``, as ``_catch_up`` does for a range's own database), whatever worker process
        Spark runs the subtask in. None when neither is exact (nothing changed yet): it is restored cold."""
        assert self._warm is not None
        old = self._warm.moved_from
        assert old is not None
        r = self.key_group_range
        behind = self._warm.behind(storage, metadata, self.max_parallelism, old)
        states = self._warm.states_at(storage, metadata, self.max_parallelism, old)
        catch_up: tuple[_Blocks, _Blocks, dict[str, str]] | None = None
        if states is None and behind is not None:
            states = self._complete_moved(metadata, old, behind)
            if states is None:
                # the caches that left it behind are not in this process: the key groups it keeps catch up from
                # the checkpoint chain instead (those leaving are dropped, so never read)
                kept_at, kept_file, states, held = behind
                catch_up = self._catch_up_plan(storage, metadata, kept_at, kept_file, states, held, old,
                                               [kg for kg in r if kg in old])
                if catch_up is None:
                    return None
        if states is None:
            return None
        check_state_metas(metadata)
        plan = plan_keyed_restore(metadata, r, max_parallelism=self.max_parallelism)
        arriving = [(h, run) for h, groups in plan for run in key_group_runs(kg for kg in groups if kg not in old)]
        known = {meta["name"]: _canonical(meta) for meta in states}
        if not _same_metas(known, [h for h, _ in arriving]):
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
        caught_up_bytes, caught_up = self._apply_catch_up(storage, *catch_up[:2]) if catch_up else (0, set())
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
        return WarmResume(restored_bytes + caught_up_bytes, len(arrived) + len(caught_up),
                          warm=tuple(kg for kg in r if kg in old and kg not in caught_up),
                          caught_up=tuple(sorted(caught_up)), restored=tuple(kg for kg in r if kg not in old),
                          dropped=tuple(dropped), bytes_caught_up=caught_up_bytes, bytes_restored=restored_bytes)

    def _complete_moved(self, metadata: CheckpointMetadata, old: KeyGroupRange,
                        behind: tuple[int, str, list[dict[str, Any]], dict[int, tuple[str, ...]]]
                        ) -> list[dict[str, Any]] | None:
        """A taken-over database that snapshots of this process left behind (write-back) at ``behind``'s checkpoint,
        whose caches, parked under the old range, are exactly this restore's state of it: the keys they left
        unwritten are written now, so that the database is that state and the move goes on as from a database at
        this checkpoint. Its states (the marker's), or None (nothing written)."""
        assert self._warm is not None
        if self._warm.moved_path is None:
            return None
        taken = _KEPT_CACHES.take(self._warm.moved_path, self._warm.moved_seal)
        if taken is None or taken[1] is None:
            return None
        kept, (unwritten, as_of, as_of_file, _, _) = taken
        handles = [h for h in metadata.keyed_handles if h.file == as_of_file and h.key_group_range == old]
        _, _, states, _ = behind
        known = {meta["name"]: _canonical(meta) for meta in states}
        if (metadata.checkpoint_id != as_of or not handles or not unwritten.keys() <= kept.keys()
                or not kept.keys() <= known.keys() or any(kept[name][0] != known[name] for name in kept)
                or {meta["name"] for h in handles for meta in h.states} != known.keys()
                or not _same_metas(known, handles) or any(name in self._tables for name in known)):
            return None
        prefixes = [_U16.pack(g) for g in old]   # the unwritten keys' key-group indexes are the old range's
        runs = []
        for meta in states:
            t = self._restore_target(meta)
            name = meta["name"]
            if name in unwritten:
                runs.append(rocksstate.flush_values(unwritten[name], kept[name][1], self._key_encoder,
                                                    t.write_framing.writer, prefixes, t.state_id_bytes)[:3])
        self._write_rows(runs)
        return states

    def _catch_up(self, storage: CheckpointStorage, metadata: CheckpointMetadata, lazy: bool, kept_at: int,
                  kept_file: str, states: list[dict[str, Any]], held: dict[int, tuple[str, ...]]
                  ) -> WarmResume | None:
        """Bring the kept database, sealed at the earlier checkpoint ``kept_at`` (snapshot file ``kept_file``;
        ``held``: per key group, the files of the chain it holds), to ``metadata``'s state by applying the blocks
        written since, as ``HeapKeyedStateBackend.resume`` does for a kept heap (``_catch_up_plan`` says when that
        is exact; None: refused, nothing was written). The delta blocks are applied in checkpoint order onto the
        kept rows, as one ingested file of puts and tombstones (``SstRestore``'s ``over_kept``), or row by row for a
        block with a map state's entries (TTL values kept as written: reads and full snapshots drop what expired, as
        in a kept database); a restarted key group is emptied and its chain restored as a cold restore does, into
        one ingested file."""
        r = self.key_group_range
        plan = self._catch_up_plan(storage, metadata, kept_at, kept_file, states, held, r, list(r))
        if plan is None:
            return None
        newer, restarts, known = plan
        self._unchecked = False
        self._restored = True
        self.warm = True
        for meta in states:
            self._restore_target(meta)
        caught_up_bytes, caught_up = self._apply_catch_up(storage, newer, restarts)
        self._chains = chain_stats(metadata, r)
        self._chain_metas = dict(known)
        restore_plan = plan_keyed_restore(metadata, r, max_parallelism=self.max_parallelism)
        for handle, _ in restore_plan:
            for meta in handle.states:
                self._chain_metas[meta["name"]] = _canonical(meta)
        self._needs_full = any(not is_shared_path(h.file) for h, _ in restore_plan)
        self._after_restore(lazy)
        return WarmResume(caught_up_bytes, len(caught_up), warm=tuple(kg for kg in r if kg not in caught_up),
                          caught_up=tuple(sorted(caught_up)), bytes_caught_up=caught_up_bytes)

    def _catch_up_plan(self, storage: CheckpointStorage, metadata: CheckpointMetadata, kept_at: int, kept_file: str,
                       states: list[dict[str, Any]], held: dict[int, tuple[str, ...]], kept_range: KeyGroupRange,
                       groups: Sequence[int]) -> tuple[_Blocks, _Blocks, dict[str, str]] | None:
        """What catching up ``groups`` of a kept database of ``kept_range`` (sealed at checkpoint ``kept_at``,
        snapshot file ``kept_file``, holding the chain files ``held`` per key group) to ``metadata`` reads: per
        handle, the key groups whose blocks newer than ``kept_at`` go onto the kept rows, and those whose chain
        restarted (a full block newer than ``kept_at``: emptied, then restored), with the states' canonical metas.
        None (refused) unless ``kept_file`` was committed for ``kept_range`` (``metadata`` or checkpoint ``kept_at``
        names it) and each key group's committed chain begins with exactly the files the database holds, or
        restarted: so a failed or uncommitted attempt, another lineage or another meta (serializers, TTL) is
        refused, and so are delta blocks past ``CATCH_UP_DELTA_FRACTION`` of the chains' bytes when a map state (or
        a migration) makes part of it row by row (a cold restore is cheaper then)."""
        if not any(h.file == kept_file and h.key_group_range == kept_range for h in metadata.keyed_handles):
            try:
                if not any(h.file == kept_file and h.key_group_range == kept_range
                           for h in storage.load(kept_at).keyed_handles):
                    return None
            except (CheckpointNotFoundError, CorruptSnapshotError):
                return None
        check_state_metas(metadata)
        chains = _committed_chains(metadata, self.key_group_range)
        newer: _Blocks = {}
        restarts: _Blocks = {}
        delta_bytes = chain_bytes = 0
        for kg in groups:
            chain = chains.get(kg, [])
            restarted = bool(chain) and chain[0].checkpoint_id > kept_at and chain[0].is_full(kg)
            if not restarted and tuple(h.file for h in chain if h.checkpoint_id <= kept_at) != held.get(kg, ()):
                return None
            for h in chain:
                size = h.block_size(kg)
                chain_bytes += size
                if h.checkpoint_id > kept_at:
                    (restarts if restarted else newer).setdefault(id(h), (h, []))[1].append(kg)
                    if not restarted:
                        delta_bytes += size
        row_by_row = any(meta["kind"] == "map" for meta in states) or any(
            t.needs_migration for t in self._tables.values())
        if row_by_row and delta_bytes > CATCH_UP_DELTA_FRACTION * chain_bytes:
            return None
        known = {meta["name"]: _canonical(meta) for meta in states}
        if not _same_metas(known, [h for h, _ in [*newer.values(), *restarts.values()]]):
            return None   # another serializer or TTL there: restore it all, as a restore would migrate
        return newer, restarts, known

    def _apply_catch_up(self, storage: CheckpointStorage, newer: _Blocks, restarts: _Blocks) -> tuple[int, set[int]]:
        """Apply a catch-up's blocks (``_catch_up_plan``): the newer deltas onto the kept rows, in checkpoint order,
        then the restarted key groups emptied and their chains restored; (bytes read, key groups caught up)."""
        def reads(blocks: _Blocks) -> list[tuple[KeyedStateHandle, Any]]:
            return sorted(((h, run) for h, kgs in blocks.values() for run in key_group_runs(kgs)),
                          key=lambda hr: (hr[0].checkpoint_id, hr[1].start))

        caught_up_bytes = 0
        caught_up: set[int] = set()
        self._ingest_gathered()   # what was gathered before goes first (over_kept changes how a file is written)
        self._catching_up = True
        self._gathered = SstRestore(over_kept=True)
        try:
            for handle, run in reads(newer):
                targets = [self._restore_target(meta) for meta in handle.states]
                caught_up_bytes += self._restore_handle(storage, handle, run, targets)[0]
                caught_up.update(run)
            self._ingest_gathered()
        finally:
            self._catching_up = False
            self._gathered = SstRestore()
        # restarted key groups: emptied, then their chains restored as a cold restore does (one ingested SST file)
        restarted_groups = sorted({kg for _, kgs in restarts.values() for kg in kgs})
        if restarted_groups:
            batch = rocksdict.WriteBatch(raw_mode=True)
            for run in key_group_runs(restarted_groups):   # key groups < 2**15: the one after a run still packs
                batch.delete_range(_U16.pack(run.start), _U16.pack(run.end + 1))
            self._write(batch)
        for handle, run in reads(restarts):
            targets = [self._restore_target(meta) for meta in handle.states]
            caught_up_bytes += self._restore_handle(storage, handle, run, targets)[0]
            caught_up.update(run)
        return caught_up_bytes, caught_up

    def _resumed(self, storage: CheckpointStorage, metadata: CheckpointMetadata) -> None:
        self._resumed_from = (storage, metadata)
        self._writes_at_resume = self._writes

    def _read(self, read: Callable[[], Any]) -> Any:
        """``read()`` (a read of the database); if it finds a kept database damaged (RocksDB's "Corruption": a file
        that rotted on disk behind an intact seal), the database is replaced by a cold restore of the checkpoint it
        was resumed at (``_fall_back_cold``) and ``read()`` runs again."""
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception; only a corrupt kept one is caught
            if not self._may_fall_back(e):
                raise
            error = str(e)
        # here, past the except block, nothing holds the failed read's frames (an iterator in them keeps the
        # database open)
        self._fall_back_cold(error)
        return read()

    def _may_replace_db(self) -> bool:
        """Whether a read that finds the database damaged would still replace it (``_fall_back_cold``): a kept
        database nothing was written to since it was resumed."""
        return self._resumed_from is not None and self._writes == self._writes_at_resume

    def _may_fall_back(self, error: Exception) -> bool:
        """Whether ``error`` is RocksDB's "Corruption" in a kept database that nothing was written to since it was
        resumed, which ``_fall_back_cold`` can replace."""
        return self._may_replace_db() and str(error).startswith("Corruption")

    def _fall_back_cold(self, error: str) -> None:
        """Replace a damaged kept database by a cold restore of the checkpoint it was resumed at (the cache, with
        this batch's changes, stays: every value in it was read intact or written by the batch)."""
        assert self._resumed_from is not None
        storage, metadata = self._resumed_from
        self._resumed_from = None
        log.warning("warm state: the kept RocksDB database of key groups %s is damaged (%s); it is deleted and "
                    "key groups restored cold from checkpoint %d", self.key_group_range, error[:200],
                    metadata.checkpoint_id)
        self._reset_db()
        self.warm = False
        self._restored = False
        self._refilling = True
        try:
            KeyedStateBackendBase.restore(self, storage, metadata)
        finally:
            self._refilling = False

    def _check_warm(self) -> None:
        """Empty a kept database that restore() has not vouched for, before its data is first used."""
        if self._unchecked:
            self._reset_db()

    def _reset_db(self) -> None:
        """Empty the database (a warm one that cannot be reused): closed, deleted and created anew, so that nothing
        of it is ever read again (a damaged file included; a ranged delete and a compaction would read it)."""
        self._unchecked = False
        with self._marker_lock:
            self._writes += 1
            if self._warm is not None:
                self._warm.forget_kept()
                self._warm.remove_marker()
        self._finalizer.detach()
        db, self._db_box[0] = self._db_box[0], None
        if db is not None:
            db.close()
        self._kept_estimate = None
        db_dir = os.path.join(self._dir, "db")
        shutil.rmtree(db_dir, ignore_errors=True)
        if os.path.lexists(db_dir):
            raise UnsafeDirectoryError(f"{db_dir} cannot be deleted")
        self._open_at(db_dir)
        self._finalizer = self._new_finalizer()

    # ---- snapshots --------------------------------------------------------------------------------------------------
    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture[KeyedStateHandle]:
        """Write the cache to the database and capture, now, the changes since the previous snapshot (encoded
        bytes of the keys written, tombstones for those deleted or expired); the snapshot worker writes them as
        delta blocks, and the key groups ``_full_key_groups_for_snapshot`` names as full blocks, encoded now from
        caches that hold every state whole (``_full_from_caches``), else scanned as the database is now (through
        iterators made now, or a RocksDB checkpoint: see below). A snapshot that writes no full block scans
        nothing."""
        required_full, compactions = self._full_key_groups_parts()
        full = required_full | compactions
        encoded: dict[str, Any] = {}
        self._check_warm()
        deferred = self._may_defer(required_full)
        # until this snapshot completes, the caches are the state of no snapshot: not parked with a lag
        self._lag_as_of = None
        cut: dict[str, list[Any]] = {}
        # the rows the snapshot's flush puts, for its full key groups (_full_from_caches)
        flushed: dict[str, tuple[list[Any], list[dict[Any, int]]]] = {}
        if deferred:
            self._deferred += 1
            cut = self._encode_deferred(encoded)
            # its chain compactions are left to the next snapshot that writes the database (_skipped_compactions),
            # which encodes them all from the caches when they hold the whole state (_full_from_caches): one pass
            # over each cache there, not one per deferred snapshot
            if compactions:
                self._skipped += 1
            full = set()
        else:
            if self._skipped:
                full |= self._skipped_compactions()
            self._deferred = self._skipped = 0
            self._flush(encoded=encoded, rows_out=flushed if full else None)
        tables = list(self._tables.values())
        for t in tables:   # a parked cache's mark must hold (_cache_complete): a stale one goes now
            if _COMPLETE in t.cache:
                self._cache_complete(t)
        metas = [t.meta for t in tables]
        with _gc_paused():
            deltas = self._capture_deltas(tables, full, encoded, cut)
        for t in tables:
            t.changed.clear()
        deadlines = {t.state_id: t.ttl_deadline() for t in tables}
        framings = {t.state_id: t.write_framing for t in tables}
        maps = {t.state_id: t.name for t in tables if t.is_map}
        # full key groups encoded from caches that hold every state whole, else scanned from the database
        from_caches = self._full_from_caches(tables, full, deadlines, flushed) if full else None
        writes = self._writes
        cp_dir: str | None = None
        # The full key groups' rows as they are now, whatever is written while the worker scans them: a RocksDB
        # iterator reads the database as it was when it was made, so a few key groups get one each, made here
        # (bounded to the key group's rows; dropped by the worker as soon as it has read them, and all of them
        # before the snapshot completes: a live iterator keeps the database from closing). Many key groups, or a
        # kept database that a damaged file may still make this backend replace (``_fall_back_cold``), get a
        # RocksDB checkpoint instead (a flush and hard links; rocksdict's snapshot objects do not hold for
        # iterators).
        pinned: dict[int, tuple[rocksdict.ReadOptions, Any]] = {}
        if from_caches is not None:
            pass
        elif full and len(full) <= _PINNED_GROUPS and not self._may_replace_db():
            for g in sorted(full):
                options = rocksdict.ReadOptions()
                options.set_iterate_upper_bound(_next_prefix(_U16.pack(g)))
                pinned[g] = (options, self._db.iter(options))
        elif full:
            cp_dir = tempfile.mkdtemp(prefix="cp-", dir=self._dir)
            os.rmdir(cp_dir)  # RocksDB creates it
            rocksdict.Checkpoint(self._db).create_checkpoint(cp_dir)
        view: rocksdict.Rdict | None = None

        # what the compiled scan needs of each state (a state's index in the snapshot is its state id)
        compiled = {t.state_id: (t.state_id, STORED_KINDS.get(t.meta["kind"], sstload.VALUE), t.write_framing.ttl,
                                 deadlines[t.state_id]) for t in tables}

        def full_sections(g: int) -> list[list[Any]]:
            """Key group ``g``'s full-block sections (one list, or a list per run of rows ``_groups`` makes), read
            from its pinned iterator (then dropped) or the checkpoint."""
            if from_caches is not None:
                return [from_caches[g]]
            prefix = _U16.pack(g)
            if g in pinned:
                options, it = pinned.pop(g)   # the options hold the iterator's bound: alive as long as it is
                try:
                    it.seek(prefix)
                    sections = sstload.value_sections(it, g, compiled)
                    if sections is None:   # a state the compiled scan does not know: the rows joined in Python
                        it.seek(prefix)
                        rows = list(_iterated(it))
                finally:
                    it = options = None   # read: dropped, even when an error's traceback keeps this frame
                if sections is not None:
                    return [[(s, Packed(*keys), Packed(*values)) for s, keys, values in sections]]
                return [found for _, found in self._groups(rows, deadlines, framings, maps)]
            assert view is not None
            compiled_found = self._compiled_sections(view, g, compiled)
            if compiled_found is not None:
                return [compiled_found]
            return [found for _, found in self._groups(_scan(view, prefix), deadlines, framings, maps)]

        def blocks() -> Iterator[tuple[int, list[Any], list[Any]]]:
            for g in self.key_group_range:
                if g in full:
                    for sections in full_sections(g):
                        yield g, sections, []
                elif g in deltas:
                    puts, deletes = deltas[g]
                    yield g, [(s, ks, vs) for s, (ks, vs) in sorted(puts.items())], sorted(deletes.items())

        def work(future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
            nonlocal view
            written = blocks()
            try:
                if cp_dir is not None:
                    view = _open(cp_dir, read_only=True)
                check_cancel(future)
                handle = write_keyed_snapshot(storage, checkpoint_id, self.subtask_index, self.key_group_range,
                                              metas, written, full_key_groups=full,
                                              on_key_group=functools.partial(check_cancel, future),
                                              predecessors=self._chain_tips())
            finally:
                written.close()
                pinned.clear()
                if view is not None:
                    view.close()
                if cp_dir is not None:
                    shutil.rmtree(cp_dir, ignore_errors=True)
            self._after_snapshot(handle)
            chains = self._snapshot_chains.pop(handle.file, None)
            if deferred:
                # the database and its marker stay at the last snapshot written; the caches are this one's state
                with self._marker_lock:
                    if writes == self._writes:
                        self._lag_as_of = (checkpoint_id, handle.file)
            elif self._warm is not None:
                self._db.flush()  # no write-ahead log: the marker must not outlive data in the memtable
                with self._marker_lock:
                    if writes == self._writes:   # nothing written since the capture
                        self._warm.write_marker(storage, checkpoint_id, handle, metas, self.max_parallelism,
                                                chains)
                        self._marker_writes = writes
                        self._vouched_names = frozenset(m["name"] for m in metas)
            return handle

        return SnapshotFuture.start(work, name=f"keyed-{self.subtask_index} chk-{checkpoint_id} (rocksdb)")

    def _after_snapshot(self, handle: KeyedStateHandle) -> None:
        super()._after_snapshot(handle)
        _extend_chain_files(self._chain_files, handle, self.key_group_range)
        self._snapshot_chains[handle.file] = dict(self._chain_files)

    @staticmethod
    def _compiled_sections(view: rocksdict.Rdict, key_group: int, states: dict[int, Any]) -> list[Any] | None:
        """Key group ``key_group``'s rows in ``view`` as full-block sections, scanned in compiled code
        (``sstload.value_sections``); None when a row is of a state not in ``states``."""
        prefix = _U16.pack(key_group)
        options = rocksdict.ReadOptions()
        options.set_iterate_upper_bound(_next_prefix(prefix))
        it = view.iter(options)
        it.seek(prefix)
        sections = sstload.value_sections(it, key_group, states)
        if sections is None:
            return None
        return [(s, Packed(*keys), Packed(*values)) for s, keys, values in sections]

    def _capture_deltas(self, tables: list[_RocksTable], full: set[int], encoded: dict[str, Any],
                        cut: dict[str, list[Any]] | None = None
                        ) -> dict[int, tuple[dict[int, tuple[Any, Any]], dict[int, Any]]]:
        """Per key group outside ``full``: (state index -> (keys, values) put, state index -> keys deleted), the
        values as the snapshot format encodes them. Keys flushed earlier (past the cache limit) and maps written
        entry by entry are read back from the database; TTL-expired values become deletes."""
        # keys and values: lists of bytes, or Packed when cut from a flush's rows
        out: dict[int, tuple[dict[int, tuple[Any, Any]], dict[int, Any]]] = {}
        ser = self._serialize_key
        start = self._start
        for index, t in enumerate(tables):
            if not t.changed:
                continue
            known = encoded.get(t.name, {})
            deadline = t.ttl_deadline()
            framing = t.write_framing
            flushed, t.flushed_rows = t.flushed_rows, None
            sections = None if cut is None else cut.get(t.name)
            if sections is None and (flushed is not None and len(known) == len(t.changed)
                                     and not (t.meta["kind"] == "list" and deadline is not None)):
                # every change is in the snapshot's own flush: cut from its rows, no key serialized again
                sections = sstload.delta_sections(*flushed, full, framing.ttl, deadline)
            if sections is not None:   # (a deferred snapshot's are encoded straight into sections)
                for g, puts, deletes in sections:
                    put_sections, delete_sections = out.get(g) or out.setdefault(g, ({}, {}))
                    if puts is not None:
                        put_sections[index] = (Packed(*puts[0]), Packed(*puts[1]))
                    if deletes is not None:
                        delete_sections[index] = Packed(*deletes)
                continue
            if t.is_map:
                self._capture_map_deltas(t, index, full, known, deadline, out)
                continue
            for key, group_index in t.changed.items():
                g = start + group_index
                if g in full:
                    continue
                kb = ser(key)
                value = known.get(key, _ABSENT)
                if value is _ABSENT:
                    db_key = self._group_prefix[group_index] + t.state_id_bytes + _frame_key(kb)
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

    def _capture_map_deltas(self, t: _RocksTable, index: int, full: set[int], known: dict[Any, bytes | None],
                            deadline: int | None,
                            out: dict[int, tuple[dict[int, tuple[Any, Any]], dict[int, Any]]]) -> None:
        """A map state's part of ``_capture_deltas``, in compiled code (``sstload.map_delta_sections``): the maps
        this flush wrote whole are taken from their encodings, the others (written entry by entry, or flushed
        earlier) joined from their rows in the database."""
        keys = list(t.changed)
        groups = np.fromiter(t.changed.values(), np.int64, len(keys)) + self._start
        db_keys, order = _sorted_db_keys(self.key_serializer.serialize_many, keys, groups, t.state_id, unique=False)
        values = list(map(known.get, map(keys.__getitem__, order.tolist()), itertools.repeat(_ABSENT)))
        db = self._db
        kept: list[Any] = [None]

        def read_rows(db_key: bytes) -> Any:
            options = rocksdict.ReadOptions()
            options.set_iterate_upper_bound(_next_prefix(db_key))
            it = db.iter(options)
            it.seek(db_key)
            kept[0] = options   # alive as long as the iterator that points into it
            return it

        sections = sstload.map_delta_sections(db_keys, values, read_rows, full, t.write_framing.ttl, deadline)
        kept[0] = None
        for g, puts, deletes in sections:
            put_sections, delete_sections = out.get(g) or out.setdefault(g, ({}, {}))
            if puts is not None:
                put_sections[index] = (Packed(*puts[0]), Packed(*puts[1]))
            if deletes is not None:
                delete_sections[index] = Packed(*deletes)

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


def _same_metas(known: dict[str, str], handles: Sequence[KeyedStateHandle]) -> bool:
    """Whether every state meta of ``handles`` equals the canonical meta of the same name in ``known`` (a state only
    one side names passes): a kept database resumes only onto blocks written with its serializers and TTL."""
    for h in handles:
        for meta in h.states:
            found = _canonical(meta)
            if known.get(meta["name"], found) != found:
                return False
    return True


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
