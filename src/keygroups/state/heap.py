"""The heap keyed state backend: Python objects in one dict per (state, key group), with copy-on-write snapshots,
incremental snapshots, and restored state that stays bytes until a key is read.

Copy-on-write, at key-group granularity (Flink's ``CopyOnWriteStateMap`` keeps versions per entry; a dict per key
group gives the same guarantee with C-speed shallow copies): a snapshot's synchronous part captures, for a key group
it writes full, the dict itself and marks it shared (the first write to it replaces it by a shallow copy), and for a
key group it writes as a delta, the values of its changed keys. Mutable values (lists, maps, mutable accumulators)
are then copied per entry when first read or written, so nothing the background writer holds is ever mutated. Once
no snapshot is running, every access takes the fast path again.

Restored state as layers: each block of a key group's chain (the newest full block, then its deltas) stays one
buffer and offset arrays per state (``statecore.Layer``), newest first. A key missing from the dict is serialized
and looked up in the layers by binary search over the raw key bytes (keyed format 2 sorts them); only its value is
decoded, so a batch touching 1% of the keys decodes about 1% of the state. Format 1 blocks are unsorted: their keys
are decoded on the key group's first lookup. A delete leaves ``MISSING`` in the dict, which shadows the layers.

Incremental snapshots: every write, delete, append, and every mutable value handed out adds the key to its key
group's dirty list (in the compiled fast paths). A snapshot writes, for the key groups the materialization policy
names (``_full_key_groups_for_snapshot``), a full block (the dict, then what the layers hold of the other keys, as
the same bytes); for the others a delta: the dirty keys' values, and deletes for those without one (cleared,
removed, or expired by TTL now, so that no older block brings them back). Writing creates bytes, not objects the
garbage collector tracks, so a collection during the snapshot has nothing of the state to scan.

Warm state (``resume``): the runtime keeps a heap backend in the worker process after its batch, and the next batch
of the same key-group range continues with it instead of restoring, when that gives exactly the state a restore
would. The backend remembers, per key group, the files of the chain its state reflects (from the restore, lengthened
by each snapshot) and the snapshot it wrote last. Checkpoint m resumes it if that snapshot's file is committed and
every key group's committed chain at m starts with exactly those files; the blocks after them (changes made
meanwhile by another worker process) are read and pushed as new top layers, and the decoded entries of the keys
they name are dropped. A key group whose chain restarted with a newer full block takes that chain instead. The
common case, checkpoint m being the backend's own last one for the same range, plans nothing: the chains, their stats
and the materialization policy's view of them are kept up to date from the backend's own snapshots (only the key
groups each changed), and the checkpoint's handles are checked to be the ones they were worked out from.

A kept backend must not grow without bound, nor keep Python objects for keys no batch touches: once a key group is
written full, its decoded entries and layers are replaced (``compact()``, once the snapshot finished, if nothing
touched the key group since its capture) by one layer of the bytes just written (``compact_full_groups``).

Hot paths: ``set_current_key`` and the value / list / map operations are compiled (``_native/statecore.pyx``); they
read the dicts directly, look a key missing from a layered key group's dict up in its sorted layers in C, and hand
over to the Python methods here only while a snapshot runs, for a format 1 (unsorted) layer, or for a TTL state. TTL
states and the rarer operations use the generic classes of ``states``.

Checks on write: a state whose serializer checks values (``TypeSerializer.check``; ``RecordSerializer`` does) refuses
a value it could not snapshot where it is written (``update``, ``add``, ``add_all``, ``put``, ``put_all``, and what a
reducing or aggregating state stores), with the ``StateSerializationError`` RocksDB raises when it writes one: the
state keeps what it had. The compiled value, list and map cores check themselves (``_HeapTable.value_check``: the
serializer's encoder into a scratch buffer, a record's in C); TTL states and reducing and aggregating tables check
through ``keygroups.state._checks``. States of other serializers check nothing.

A state registered again with another serializer (warm state resumed for a job whose schema changed, or restored
state decoded eagerly) has its decoded values rewritten into the new serializer's shape as it is registered (read
from their bytes with the reader a restore would use), as a restore would give them.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keygroups._hashing import KeyType
from keygroups._native import heapsnap
from keygroups._native.framing import Encoder
from keygroups._native.snapshot import encode_block, parse_block_offsets
from keygroups._native.statecore import (
    ABSENT,
    DELETED,
    HeapListCore,
    HeapMapCore,
    HeapValueCore,
    KeyContext,
    Layer,
    TableCore,
    java_keys,
)
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import (
    CheckpointMetadata,
    KeyedStateHandle,
    KeyGroupBlock,
    Packed,
    chain_stats,
    plan_keyed_restore,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import is_shared_path, key_group_runs, keyed_handles_by_range, same_handle
from keygroups.checkpoint.state_meta import check_state_metas
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError, StateSerializationError, no_current_key_error
from keygroups.serializers import TypeSerializer
from keygroups.serializers.base import checks_on_write
from keygroups.state._base import (
    DEFAULT_DELTA_FRACTION,
    DEFAULT_MAX_CHAIN,
    KeyedStateBackendBase,
    RestoreStats,
    SnapshotFuture,
    _canonical,
    _committed_chains,
    _canonical_states,
    _extend_chain_files,
    _file_uses,
    _files_of_chains,
    check_cancel,
)
from keygroups.state._checks import check_stored, checked_state_class, stored_value_check
from keygroups.state._codec import UNWRITABLE, ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.warm import WarmResume
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


def _find_unsorted(layer: Layer, key: Any, decode_keys: Callable[[Any, Any], list[Any]]) -> int:
    """:meth:`Layer.find` for an unsorted (format 1) layer, by decoded key: its keys are decoded on its first
    lookup (as the whole key group's were before format 2)."""
    if layer.index is None:
        keys = decode_keys(layer.block, layer.key_offsets) if layer.key_offsets is not None else []
        deletes = layer.delete_offsets
        layer.deleted = set(decode_keys(layer.block, deletes)) if deletes is not None else set()
        layer.index = dict(zip(keys, range(len(keys))))
    if key in layer.deleted:  # type: ignore[operator]
        return DELETED
    return layer.index.get(key, ABSENT)


def _write_checks(write: ValueFraming) -> tuple[Encoder | None, Encoder | None]:
    """The compiled checks on write of a value, list or map state's table (``TableCore.value_check`` and
    ``key_check``): the encoder of each serializer that checks on write (a record's node checks in C), else None."""
    if write.kind not in ("value", "list", "map"):
        return None, None
    value = checks_on_write(write.ser)
    key = checks_on_write(write.key_ser) if write.kind == "map" else None
    return (None if value is None else Encoder(write.ser, value),
            None if key is None else Encoder(write.key_ser, key))


#: A key group's dirty list is first de-duplicated when it reaches this many entries.
_DIRTY_LIMIT = 1 << 14


class _HeapTable(TableCore):
    """All entries of one state, per key group ``start + i`` (every per-group list has one extra last slot, index
    ``n``, for "no current key").

    Inherited from the compiled ``TableCore`` (read by the fast paths): ``maps[i]`` the decoded values (key ->
    value; ``MISSING`` marks a key deleted since the restore, which shadows the layers); ``ctx`` the backend's key
    context; ``cow`` whether a running snapshot may hold this table's dicts or values; ``lazy[i]`` whether key group
    ``i`` has restored layers (``layers[i]``); ``slow`` = ``cow`` or any ``lazy``: the fast paths hand over to the
    Python methods below; ``track`` and ``dirty[i]``: the keys changed since the last snapshot's capture.

    A key's value is ``maps[i][key]`` if the key is there, else the first of ``layers[i]`` (newest first) that puts
    or deletes it. Lookups in layers decode that one value and keep it in ``maps[i]``."""

    __slots__ = ("backend", "name", "meta", "descriptor", "read_framing", "write_framing", "needs_migration",
                 "copy_value", "reads_dirty", "group_count", "layers", "shared", "copied_keys", "lazy_group_count",
                 "check_put")

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
    #: A read through ``get`` hands out an object the caller may change in place: the key becomes dirty.
    reads_dirty: bool
    #: Key groups in the backend's range (``n``).
    group_count: int
    #: Per key group: the restored layers, newest first (None: none).
    layers: list[list[Layer] | None]
    #: Per key group: ``maps[i]`` is also held by a running snapshot; copy before writing.
    shared: list[bool]
    #: Per key group: keys whose value was already copied since the last snapshot (None: copy nothing, i.e. no
    #: running snapshot holds values of this group, or values are never mutated in place).
    copied_keys: list[set[Any] | None]
    #: Key groups with ``lazy[i]`` set.
    lazy_group_count: int
    #: What ``put`` checks a stored object with (a reducing or aggregating state's value, whose serializer checks on
    #: write: what ``reduce`` or ``add`` made), else None; value, list and map states check in their state classes.
    check_put: Callable[[Any], None] | None

    def __init__(self, backend: HeapKeyedStateBackend, name: str, meta: dict[str, Any], read: ValueFraming,
                 write: ValueFraming, descriptor: StateDescriptor | None) -> None:
        n = backend._n
        self.backend = backend
        self.ctx = backend._ctx
        self.name = name
        self.group_count = n
        self.maps: list[dict[Any, Any]] = [{} for _ in range(n)]
        self.maps.append(_NO_KEY)
        self.dirty = [[] for _ in range(n + 1)]
        self.dirty_limit = _DIRTY_LIMIT
        self.track = backend._tracking
        self.layers = [None] * (n + 1)
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
        # Lists are handed out as stored; maps only hand out their values; other values when mutable.
        self.reads_dirty = write.kind == "list" or (write.copy is not None and
                                                    (write.kind != "map" or not write.ser.is_immutable))
        self.needs_migration = read.needs_migration_to(write)
        self.check_put = stored_value_check(write)
        self.value_check, self.key_check = _write_checks(write)
        # a key read from the restored layers is looked up in C unless TTL needs the Python path's cleanup
        self.layer_keys = None if (read.ttl or write.ttl) else self.backend._key_encoder
        self.layer_decode = read.decode

    def _update_slow(self) -> None:
        self.slow = self.cow or self.lazy_group_count > 0

    def _ttl_deadline(self) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptor)

    # ---- store interface used by the state types (current key of the backend) -------------------------------------
    def get(self) -> Any:
        c = self.ctx
        group_index, key = c.kgi, c.key
        v = self._get_slow(group_index, key) if self.slow else self.maps[group_index].get(key, MISSING)
        if v is not MISSING and self.reads_dirty and self.track:
            self.dirty[group_index].append(key)
        return v

    def put(self, value: Any) -> None:
        c = self.ctx
        group_index, key = c.kgi, c.key
        if self.check_put is not None:
            check_stored(self.check_put, value, self)
        if self.cow:
            self._prepare_write(group_index, key)
        self.maps[group_index][key] = value
        if self.track:
            self.dirty[group_index].append(key)

    def delete(self) -> None:
        c = self.ctx
        group_index, key = c.kgi, c.key
        if self.cow:
            self._prepare_write(group_index, key)
        if self.lazy[group_index]:
            self.maps[group_index][key] = MISSING  # shadows the layers
        else:
            self.maps[group_index].pop(key, None)
        if self.track:
            self.dirty[group_index].append(key)

    def append(self, items: list[Any]) -> None:
        c = self.ctx
        group_index, key = c.kgi, c.key
        cur = self._get_slow(group_index, key) if self.slow else self.maps[group_index].get(key, MISSING)
        if cur is MISSING:
            if self.cow:
                self._prepare_write(group_index, key)
            self.maps[group_index][key] = items
        else:
            cur.extend(items)
        if self.track:
            self.dirty[group_index].append(key)

    def _compact_dirty(self, group_index: int) -> None:
        """Drop repeated keys from a dirty list that reached ``dirty_limit`` (the compiled paths call this); the
        limit doubles if the list stays long, so compaction costs O(1) per write on average."""
        keys = self.dirty[group_index] = list(dict.fromkeys(self.dirty[group_index]))
        self.dirty_limit = max(self.dirty_limit, 2 * len(keys))

    # ---- slow path: restored layers and copy-on-write ------------------------------------------------------------
    def _lookup(self, group_index: int, key: Any, layers: list[Layer]) -> Any:
        """``key``'s value from the layers (newest first), decoded, or MISSING; TTL cleanup as on restore."""
        key_bytes = None
        for layer in layers:
            if layer.sorted:
                if key_bytes is None:
                    key_bytes = self.backend.key_serializer.serialize(key)
                found = layer.find(key_bytes)
            else:
                found = _find_unsorted(layer, key, self.backend._decode_keys)
            if found == ABSENT:
                continue
            if found == DELETED:
                return MISSING
            value_bytes = layer.value(found)
            deadline = self._ttl_deadline()
            if deadline is not None:
                value_bytes = self.read_framing.drop_expired_bytes(value_bytes, deadline)
                if value_bytes is None:
                    return MISSING
            return self.read_framing.decode(value_bytes)
        return MISSING

    def _unshare(self, group_index: int) -> None:
        self.maps[group_index] = dict(self.maps[group_index])
        self.copied_keys[group_index] = set() if self.copy_value is not None else None
        self.shared[group_index] = False

    def _prepare_write(self, group_index: int, key: Any) -> None:
        """Before a write while a snapshot runs: never write into a dict it holds, nor copy the value later."""
        if self.shared[group_index]:
            self._unshare(group_index)
        copied = self.copied_keys[group_index]
        if copied is not None:
            copied.add(key)

    def _get_slow(self, group_index: int, key: Any) -> Any:
        m = self.maps[group_index]
        v = m.get(key, MISSING)
        if v is MISSING:
            layers = self.layers[group_index]
            if layers is None or key in m:  # no layers, or deleted since the restore
                return MISSING
            v = self._lookup(group_index, key, layers)
            if v is MISSING:
                return MISSING
            if self.shared[group_index]:
                self._unshare(group_index)
            self.maps[group_index][key] = v
            copied = self.copied_keys[group_index]
            if copied is not None:  # decoded just now: nothing else holds it
                copied.add(key)
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

    def add_layer(self, group_index: int, layer: Layer) -> None:
        """A restored block's entries, newer than every layer added before (restore applies chains in order)."""
        layers = self.layers[group_index]
        if layers is None:
            self.layers[group_index] = [layer]
            self.lazy[group_index] = True
            self.lazy_group_count += 1
            self._update_slow()
        else:  # a new list: a snapshot's capture or a pending compaction may hold the old one
            self.layers[group_index] = [layer, *layers]

    def replace_group(self, group_index: int, layer: Layer | None, keep: list[Any] | tuple[Any, ...] = ()) -> None:
        """Key group ``group_index`` becomes ``layer`` (None: empty): its older layers go, and its decoded entries
        but those of the keys in ``keep`` (the keys the last batch touched, whose values ``layer`` holds as they are:
        the next batch likely reads them again, and decoding them from the layer would cost more than keeping them)."""
        old = self.maps[group_index]
        kept: dict[Any, Any] = {}
        if layer is not None:
            for key in keep:
                v = old.get(key, MISSING)
                if v is not MISSING:
                    kept[key] = v
        self.maps[group_index] = kept
        self.drop_layers(group_index)
        if layer is not None:
            self.add_layer(group_index, layer)

    def rerange(self, old_start: int, new_start: int, n: int) -> None:
        """The backend's range moved (see ``HeapKeyedStateBackend.resume``): keep the per-group lists of the key
        groups still owned at their new index, start arrived ones empty, and forget those that left. Only called with
        nothing dirty and no snapshot running."""
        def moved(old: list[Any], fresh: Callable[[], Any]) -> list[Any]:
            out = []
            for i in range(n):
                j = new_start + i - old_start
                out.append(old[j] if 0 <= j < self.group_count else fresh())
            return out

        self.maps = moved(self.maps, dict)
        self.maps.append(_NO_KEY)
        self.dirty = [[] for _ in range(n + 1)]
        self.layers = moved(self.layers, lambda: None) + [None]
        self.shared = moved(self.shared, lambda: False) + [False]
        self.copied_keys = moved(self.copied_keys, lambda: None) + [None]
        self.lazy = moved(self.lazy, lambda: False) + [False]
        self.lazy_group_count = sum(self.lazy)
        self.group_count = n
        self._update_slow()

    def take_groups(self, source: _HeapTable, source_first: int, first: int, n: int) -> None:
        """Hold ``source``'s entries of its ``n`` key groups from index ``source_first`` at indexes ``first`` on, as
        they are (handed over, not copied: a kept backend split into pieces, or pieces assembled into one)."""
        for i in range(n):
            j = source_first + i
            self.maps[first + i] = source.maps[j]
            self.layers[first + i] = source.layers[j]
            self.lazy[first + i] = source.lazy[j]
            self.shared[first + i] = source.shared[j]
            self.copied_keys[first + i] = source.copied_keys[j]
        self.lazy_group_count = sum(self.lazy[:self.group_count])
        self._update_slow()

    def drop_layers(self, group_index: int) -> None:
        """Forget the layers of a key group (a full block replaces them)."""
        if self.layers[group_index] is not None:
            self.layers[group_index] = None
            self.lazy[group_index] = False
            self.lazy_group_count -= 1
            self._update_slow()

    def decode_all(self) -> None:
        """Eager restore: decode every restored entry now (the layers are dropped)."""
        read = self.read_framing
        decode_keys = self.backend._decode_keys
        deadline = self._ttl_deadline()
        for i in range(self.group_count):
            layers = self.layers[i]
            if layers is None:
                continue
            m = self.maps[i]
            only = layers[0]
            if len(layers) == 1 and not m and deadline is None and only.delete_offsets is None:
                if only.key_offsets is not None:  # one full block: decode it whole
                    m.update(zip(decode_keys(only.block, only.key_offsets),
                                 read.decode_many(only.block, only.value_offsets)))
                self.drop_layers(i)
                continue
            tombstones = [k for k, v in m.items() if v is MISSING]
            seen = set(m)
            for layer in layers:  # newest first: a key's newest entry wins
                block = layer.block
                if layer.key_offsets is not None:
                    keys = decode_keys(block, layer.key_offsets)
                    if deadline is None:
                        values = read.decode_many(block, layer.value_offsets)
                        m.update((k, v) for k, v in zip(keys, values) if k not in seen)
                    else:
                        for j, k in enumerate(keys):
                            if k in seen:
                                continue
                            kept = read.drop_expired_bytes(layer.value(j), deadline)
                            if kept is not None:
                                m[k] = read.decode(kept)
                    seen.update(keys)
                if layer.delete_offsets is not None:
                    seen.update(decode_keys(block, layer.delete_offsets))
            for k in tombstones:  # no layer left to shadow
                del m[k]
            self.drop_layers(i)

    def reshape_decoded(self, old: ValueFraming, read: ValueFraming) -> None:
        """The decoded values were made for the framing ``old`` (its serializers' shape: a previous registration's
        values, or values decoded with it); rewrite each as ``read`` reads ``old``'s bytes of it, the shape the
        serializer registered now gives. New dicts: a running snapshot may hold the old ones."""
        encode, decode = old.encode, read.decode
        for i in range(self.group_count):
            m = self.maps[i]
            if not m:
                continue
            try:
                self.maps[i] = {k: v if v is MISSING else decode(encode(v)) for k, v in m.items()}
            except UNWRITABLE as e:
                raise old.unwritable(old.first_unwritable(m.items(), self.backend.key_serializer.serialize, MISSING),
                                     e, what="migration to the serializer registered now") from e
            self.shared[i] = False
            self.copied_keys[i] = None   # every value is new: nothing a snapshot holds

    def keys_of_group(self, group_index: int) -> list[Any]:
        m = self.maps[group_index]
        out = [k for k, v in m.items() if v is not MISSING]
        layers = self.layers[group_index]
        if layers:
            decode_keys = self.backend._decode_keys
            seen = set(m)
            for layer in layers:
                if layer.key_offsets is not None:
                    for k in decode_keys(layer.block, layer.key_offsets):
                        if k not in seen:
                            seen.add(k)
                            out.append(k)
                if layer.delete_offsets is not None:
                    seen.update(decode_keys(layer.block, layer.delete_offsets))
        return out


@dataclass(frozen=True, slots=True)
class _Capture:
    """What a snapshot's synchronous part took of one table, per key group ``i``: for a key group written full,
    ``maps[i]`` and ``layers[i]`` as the table held them (the table copies a shared dict before changing it, and
    never changes a layer); for one written as a delta, ``deltas[i]``: its dirty keys -> their value or MISSING
    (deleted). ``dirty`` is the dirty lists taken (key-group index -> its list, for those with keys), given back if
    the snapshot fails."""

    maps: list[dict[Any, Any]]
    layers: list[list[Layer] | None]
    deltas: list[dict[Any, Any] | None]
    dirty: dict[int, list[Any]]
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

    ``compact_full_groups``: for a backend kept across batches (see :meth:`resume`), once a key group is written
    full, replace its decoded entries (and restored layers) by one layer of the written bytes, so the backend holds
    each key group's bytes once however many batches it lives, and holds the entries no batch touched since as
    bytes, not Python objects (an int64 key and value: 16 B instead of about 100 B; a key read again is decoded
    from its layer). Pointless for a backend used for one batch.
    """

    _supports_external_states = True   # keygroups.state.external: the hooks below marked "external states"

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0, incremental: bool = True, max_chain: int = DEFAULT_MAX_CHAIN,
                 delta_fraction: float = DEFAULT_DELTA_FRACTION, compact_full_groups: bool = False) -> None:
        super().__init__(key_group_range, max_parallelism, key_serializer, key_type=key_type, clock=clock,
                         allow_pickle=allow_pickle, subtask_index=subtask_index, incremental=incremental,
                         max_chain=max_chain, delta_fraction=delta_fraction)
        self.compact_full_groups = bool(compact_full_groups)
        # Per key group, the files of the chain the state reflects (absent: no chain), and the (checkpoint id, file)
        # of the last snapshot written: what resume() checks a restore point against.
        self._chain_files: dict[int, tuple[str, ...]] = {}
        self._warm_point: tuple[int, str] | None = None
        # The key-group range the handle of that snapshot covers: this backend's, or for a piece split off a kept
        # backend (split_off), the range of the backend it came from.
        self._snapshot_range: KeyGroupRange | None = None
        # For a resume from the backend's own last checkpoint without planning its chains again (_resume_own): how
        # many chains of _chain_files hold each file, and the handles whose part in those chains is accounted for
        # (by file: those of the checkpoint the chains were planned from that cover the range, in a chain or not,
        # and the snapshots written since).
        self._file_uses: dict[str, int] = {}
        self._known_handles: dict[str, KeyedStateHandle] = {}
        # Captures so far, and the compactions finished snapshots prepared: (capture number, table name, key-group
        # index, the dict and layers captured, the new layer or None, the keys the capture found dirty), applied by
        # the thread that owns the backend.
        self._captures = 0
        self._compactions: collections.deque[tuple[int, str, int, dict[Any, Any], list[Layer] | None,
                                                   Layer | None, list[Any]]] = collections.deque()
        self.set_current_key = self._ctx.set_current_key  # type: ignore[method-assign]  # no Python-level hop
        self._tables: dict[str, _HeapTable] = {}
        self._running_snapshots = 0
        self._snap_lock = threading.Lock()
        # Dirty tracking is on once a snapshot can be a delta: after a restore, or after the first snapshot's
        # capture (until then every key group is written full and tracking would only cost).
        self._tracking = False
        # What failed snapshots took (per table name its dirty lists, and the key groups it was to write full),
        # handed back to the next capture. A deque: the snapshot worker appends, the capture pops, no lock needed.
        self._failed: collections.deque[tuple[dict[str, dict[int, list[Any]]], set[int]]] = collections.deque()

    @functools.cached_property
    def _key_encoder(self) -> Encoder:
        """The key serializer's encoder, compiled (``_native/framing.pyx``): what snapshots serialize keys with."""
        return Encoder(self.key_serializer)

    def _decode_keys(self, block: Any, offsets: Any) -> list[Any]:
        """The keys serialized in ``block`` at ``offsets``, canonical (``java_keys``): a decoded key meets the dicts'
        keys as ``set_current_key`` made them, so a NaN or ``-0.0`` key is found, and listed, once."""
        return java_keys(self.key_serializer.deserialize_many(block, offsets))

    # ---- hooks of the base ----------------------------------------------------------------------------------------
    def _state_class(self, kind: str, ttl: bool) -> type:
        if not ttl and kind in _HEAP_CLASSES:
            return _HEAP_CLASSES[kind]   # their compiled cores check on write (``_HeapTable.value_check``)
        return checked_state_class(kind, super()._state_class(kind, ttl))

    def _has_data(self) -> bool:
        return any(t.has_data() for t in self._tables.values()) or self._externals_have_data()  # external states

    def _new_table(self, name: str, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                   d: StateDescriptor | None) -> _HeapTable:
        t = self._tables[name] = _HeapTable(self, name, meta, read, write, d)
        return t

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: ValueFraming, write: ValueFraming) -> None:
        t = self._tables.get(d.name)
        if t is None:
            self._new_table(d.name, meta, read, write, d)
            return
        if t.descriptor is None and not _same_values(t.write_framing, write):
            # Decoded values of restored or resumed state (a kept backend's last batch) are in the shape of the
            # serializer they were made with; the one registered now may read them otherwise (a record schema that
            # changed, another form): rewrite them as a restore would read them, before anything meets them.
            t.reshape_decoded(t.write_framing, read)
        t.configure(meta, read, write, d)

    def _store(self, name: str) -> _HeapTable:
        return self._tables[name]

    def _restore_block(self, handle: KeyedStateHandle, targets: list[Any], block: KeyGroupBlock) -> None:
        """One key group's block of one file of its chain (blocks come oldest first): kept as layers, nothing
        decoded. A full block replaces what older blocks said about the key group, in every state; a delta on top
        of decoded entries (a resumed backend catching up) drops those of the keys it names."""
        group_index = block.key_group - self._start
        if block.full:
            for t in self._tables.values():
                t.replace_group(group_index, None)
        per_state: dict[int, list[Any]] = {}
        for state_index, key_offsets, value_offsets in block.puts:
            if len(key_offsets) != len(value_offsets):
                raise CorruptSnapshotError(f"{handle.file}: key group {block.key_group}, state {state_index}: "
                                           f"{len(key_offsets) - 1} keys but {len(value_offsets) - 1} values")
            if len(key_offsets) > 1:
                self._section_slot(handle, block.key_group, per_state, state_index, 0)[:2] = key_offsets, value_offsets
        for state_index, key_offsets in block.deletes:
            if len(key_offsets) > 1:
                self._section_slot(handle, block.key_group, per_state, state_index, 2)[2] = key_offsets
        for state_index, (key_offsets, value_offsets, delete_offsets) in per_state.items():
            t = targets[state_index]
            decoded = t.maps[group_index]
            if decoded:
                for offsets in (key_offsets, delete_offsets):
                    if offsets is not None:
                        for key in self._decode_keys(block.block, offsets):
                            decoded.pop(key, None)
            t.add_layer(group_index, Layer(block.block, key_offsets, value_offsets, delete_offsets, block.sorted))

    @staticmethod
    def _section_slot(handle: KeyedStateHandle, kg: int, per_state: dict[int, list[Any]], state_index: int,
                      slot: int) -> list[Any]:
        entry = per_state.setdefault(state_index, [None, None, None])
        if entry[slot] is not None:
            raise CorruptSnapshotError(f"{handle.file}: key group {kg} has two {'delete' if slot else 'put'} "
                                       f"sections for state index {state_index}")
        return entry

    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, *, lazy: bool = True) -> RestoreStats:
        """Restore this backend's key groups from a checkpoint of any parallelism (see
        ``KeyedStateBackendBase.restore``), remembering each key group's chain for :meth:`resume`."""
        stats = super().restore(storage, metadata, lazy=lazy)
        self._set_chain_files(_committed_chains(metadata, self.key_group_range), metadata)
        return stats

    def _set_chain_files(self, chains: dict[int, list[KeyedStateHandle]], metadata: CheckpointMetadata) -> None:
        """The chains the state reflects now: ``chains`` (key group -> handles), planned from ``metadata``."""
        self._chain_files = _files_of_chains(chains)
        self._file_uses = _file_uses(self._chain_files)
        r = self.key_group_range
        self._known_handles = ({h.file: h for h in metadata.keyed_handles
                                if h.key_group_range.start <= r.end and r.start <= h.key_group_range.end}
                               if metadata.max_parallelism == self.max_parallelism else {})

    # ---- warm state -----------------------------------------------------------------------------------------------
    def resume(self, storage: CheckpointStorage, metadata: CheckpointMetadata,
               key_group_range: KeyGroupRange | None = None, *,
               pieces: Sequence[HeapKeyedStateBackend] = ()) -> WarmResume | None:
        """Continue, from checkpoint ``metadata``, with the state this backend holds since its last snapshot (the
        runtime keeps heap backends in the worker process between batches), for ``key_group_range`` (this backend's
        range by default; any range overlapping it), if that yields exactly the state :meth:`restore` would; None
        otherwise (then restore a new backend; this one is left as it was).

        The backend qualifies when its last snapshot (checkpoint n, file F) finished, none failed and nothing was
        written since. Checkpoint m >= n resumes it only if F is committed for the backend's range (m's metadata,
        or n's while retained, names it) and, per key group it keeps, the committed chain at m begins with exactly
        the files the state reflects; a key group whose chain restarted with a full block newer than n takes that
        chain. So a retried, failed or uncommitted attempt, another lineage, another max parallelism, or a state
        whose newer blocks carry another meta (serializers, TTL) is refused. Then only the blocks newer than n of
        the key groups kept are read (none when m == n), plus the whole chains of the key groups that arrived (a
        ranged read per run of them; values stay bytes until used, as after a restore); the entries of the key
        groups that left are dropped. The stats say which key groups were kept warm, caught up and restored.

        Registrations are forgotten, as after a restore: the job's function registers its states again (a changed
        serializer then migrates, as it would on restored state).

        From its own last checkpoint (m == n) for the same range, nothing is planned again (:meth:`_resume_own`):
        the cost grows with the checkpoint's handles, not with the key groups.

        ``pieces``: other kept backends of this process (pieces split off others, see :meth:`split_off`) inside
        ``key_group_range``, disjoint from this backend's range and from each other, whose key groups arrive here
        without being read: once this backend qualifies, each resumes for its own range with the same checks (a
        piece that does not qualify, or whose states' metas or value shapes differ from this backend's, is left
        out and its key groups read), and its key groups' entries move here. Pieces are spent either way, unless
        this backend does not qualify (None: they are left as they were)."""
        point = self._kept_point()
        old = self.key_group_range
        r = old if key_group_range is None else key_group_range
        kept = old.intersection(r)
        if (point is None or not kept or metadata.max_parallelism != self.max_parallelism
                or metadata.checkpoint_id < point[0] or r.end >= self.max_parallelism):
            return None
        n, kept_file = point
        written = self._snapshot_range or old
        if not _names(metadata, kept_file, written):
            if metadata.checkpoint_id == n:
                return None
            try:
                if not _names(storage.load(n), kept_file, written):
                    return None
            except (CheckpointNotFoundError, CorruptSnapshotError):
                return None
        check_state_metas(metadata)
        if metadata.checkpoint_id == n and r == old and not pieces:
            resumed = self._resume_own(metadata, kept_file)
            if resumed is not None:
                return resumed
        plan = plan_keyed_restore(metadata, r, max_parallelism=self.max_parallelism)
        chains = _committed_chains(metadata, r)
        restart: list[int] = []
        newer: dict[int, tuple[KeyedStateHandle, list[int]]] = {}
        for kg in kept:
            chain = chains.get(kg, [])
            if chain and chain[0].checkpoint_id > n and chain[0].is_full(kg):
                restart.append(kg)
            elif tuple(h.file for h in chain if h.checkpoint_id <= n) != self._chain_files.get(kg, ()):
                return None
            for h in chain:
                if h.checkpoint_id > n:
                    newer.setdefault(id(h), (h, []))[1].append(kg)
        # the key groups that arrive: their whole chains, in chain order (plan order)
        arriving: list[tuple[KeyedStateHandle, KeyGroupRange]] = []
        for h, groups in plan:
            arriving += [(h, run) for run in key_group_runs(kg for kg in groups if kg not in old)]
        for h in [h for h, _ in newer.values()] + [h for h, _ in arriving]:
            for meta in h.states:
                t = self._tables.get(meta["name"])
                if t is not None and _canonical(meta) != _canonical(t.meta):
                    return None
                if self._external_meta_differs(meta):   # external states
                    return None
        # The pieces that supply arriving key groups: each resumed for its own range (they change from here on).
        supplied, pieces_stats = self._resume_pieces(storage, metadata, r, old, pieces)
        if supplied:
            arriving = [(h, run) for h, part in arriving
                        for run in key_group_runs(kg for kg in part if kg not in supplied)]
        # From here on the backend changes: it becomes the state of checkpoint m for range r.
        self.compact()
        if r != old:
            self._move_to(r)
        for piece, _ in pieces_stats:
            self._take_groups(piece)
        self._forget_registrations()
        for kg in restart:
            for t in self._tables.values():
                t.replace_group(kg - self._start, None)
        self._clear_externals(restart)   # external states
        reads = sorted(((h, run) for h, kgs in newer.values() for run in key_group_runs(kgs)),
                       key=lambda hr: (hr[0].checkpoint_id, hr[1].start))
        caught_up_bytes = restored_bytes = 0
        caught_up: set[int] = set()
        for handle, run in reads:
            targets = [self._restore_target(meta) for meta in handle.states]
            caught_up_bytes += self._restore_handle(storage, handle, run, targets)[0]
            caught_up.update(run)
        arrived: set[int] = set()
        for handle, run in arriving:
            targets = [self._restore_target(meta) for meta in handle.states]
            restored_bytes += self._restore_handle(storage, handle, run, targets)[0]
            arrived.update(run)
        self._restored = True
        self.warm = True
        self._chains = chain_stats(metadata, r)
        self._chain_metas = {}
        for handle, _ in plan:
            for meta in handle.states:
                self._chain_metas[meta["name"]] = _canonical(meta)
        self._needs_full = any(not is_shared_path(h.file) for h, _ in plan)
        self._set_chain_files(chains, metadata)
        self._warm_point = None
        self._snapshot_range = None
        warm = {kg for kg in kept if kg not in caught_up}
        for _, piece_stats in pieces_stats:
            warm.update(piece_stats.warm)
            caught_up.update(piece_stats.caught_up)
            caught_up_bytes += piece_stats.bytes_read
        return WarmResume(caught_up_bytes + restored_bytes, len(caught_up | arrived),
                          warm=tuple(sorted(warm)), caught_up=tuple(sorted(caught_up)),
                          restored=tuple(kg for kg in r if kg not in old and kg not in supplied),
                          dropped=tuple(kg for kg in old if kg not in r),
                          bytes_caught_up=caught_up_bytes, bytes_restored=restored_bytes)

    def _resume_pieces(self, storage: CheckpointStorage, metadata: CheckpointMetadata, r: KeyGroupRange,
                       old: KeyGroupRange, pieces: Sequence[HeapKeyedStateBackend]
                       ) -> tuple[set[int], list[tuple[HeapKeyedStateBackend, WarmResume]]]:
        """The key groups ``pieces`` supply for :meth:`resume` to ``r`` (see there), and each usable piece resumed
        with its stats."""
        supplied: set[int] = set()
        used: list[tuple[HeapKeyedStateBackend, WarmResume]] = []
        if self._externals:
            return supplied, used
        for piece in pieces:
            pr = piece.key_group_range
            if (pr.start < r.start or pr.end > r.end or pr.intersection(old) or piece._externals
                    or any(kg in supplied for kg in pr) or piece.max_parallelism != self.max_parallelism):
                continue
            tables_fit = True
            for name, pt in piece._tables.items():
                t = self._tables.get(name)
                if t is not None and (_canonical(pt.meta) != _canonical(t.meta)
                                      or not _same_values(pt.write_framing, t.write_framing)):
                    tables_fit = False
            if not tables_fit:
                continue
            stats = piece.resume(storage, metadata, pr)
            if stats is None:
                continue
            supplied.update(pr)
            used.append((piece, stats))
        return supplied, used

    def _take_groups(self, piece: HeapKeyedStateBackend) -> None:
        """Move the entries of ``piece``'s key groups (inside this backend's range, empty here) into this backend;
        the piece is spent."""
        offset = piece._start - self._start
        for name, pt in piece._tables.items():
            t = self._tables.get(name)
            if t is None:
                t = self._new_table(name, pt.meta, pt.read_framing, pt.write_framing, None)
                t.track = self._tracking
            t.take_groups(pt, 0, offset, piece._n)
        piece._tables = {}

    def _resume_own(self, metadata: CheckpointMetadata, kept_file: str) -> WarmResume | None:
        """:meth:`resume` from the checkpoint of the backend's own last snapshot (file ``kept_file``), for the same
        range: nothing to read, and the chains, their stats and their files are those the backend keeps up to date
        from its own snapshots, so they are not planned again over every key group (at max parallelism 4096 that
        planning cost more than a small batch). That holds when the checkpoint's handles over the range are the
        backend's own view: each is one it accounted for (the same object: handles are decoded once per process),
        ``kept_file``'s as the backend wrote it, and every file of its chains is still listed; a handle it did not
        account for, or a chain file missing, leaves the answer to the full planning (None). The checks that
        planning makes of the chains (breaks, baseless deltas, one meta per state along a chain) were made when
        they were planned; of what came since, the snapshot's own metas are checked against the chains' other
        files here."""
        r = self.key_group_range
        try:
            ordered = keyed_handles_by_range(list(metadata.keyed_handles))
        except ValueError:
            return None   # overlapping handles: the planning raises a restore's error
        known = self._known_handles
        listed: dict[str, KeyedStateHandle] = {}
        for h in ordered:
            hr = h.key_group_range
            if hr.end < r.start or hr.start > r.end:
                continue
            mine = known.get(h.file)
            if h.file in listed or mine is None:
                return None
            if mine is not h:
                # the snapshot just written, read back: as it was written; a file carried since it was read back
                # last: alike as carried (the checkpoint leaves out what no chain uses)
                if not same_handle(mine, h, carried=h.file != kept_file):
                    return None
            listed[h.file] = h
        uses = self._file_uses
        if not all(f in listed for f in uses):
            return None
        chained = sorted((listed[f] for f in uses), key=lambda h: (h.checkpoint_id, h.key_group_range.start))
        written = listed.get(kept_file)
        if written is not None and kept_file in uses:
            metas = {meta["name"]: meta for meta in written.states}
            for h in chained:
                if h is not written and any(metas.get(meta["name"], meta) != meta for meta in h.states):
                    return None   # two metas of a state in the chains: the planning names the corruption
        # From here on the backend becomes the state of the checkpoint (nothing to read: it is what it wrote).
        self.compact()
        self._forget_registrations()
        self._known_handles = listed
        self._chain_metas = {}
        for h in chained:   # the newest meta of each state, as a restore takes them
            self._chain_metas.update(zip((meta["name"] for meta in h.states), _canonical_states(h)))
        self._needs_full = any(not is_shared_path(h.file) for h in chained)
        self._restored = True
        self.warm = True
        self._warm_point = None
        self._snapshot_range = None
        return WarmResume(0, 0, warm=tuple(range(r.start, r.end + 1)))

    @property
    def splittable(self) -> bool:
        """Whether :meth:`split_off` can part this backend: its state is exactly its last snapshot's (see
        :meth:`resume`) and no external states are bound (they keep their own per-range stores)."""
        return self._kept_point() is not None and not self._externals

    def split_off(self, key_group_range: KeyGroupRange) -> HeapKeyedStateBackend | None:
        """A new backend holding this kept backend's key groups of ``key_group_range`` (a part of its range) as they
        are, at the same restore point: what a subtask that resumes this backend for a range without those key
        groups leaves for another subtask of the same checkpoint, instead of dropping them (a rescale then reads only
        the key groups no kept piece in the process holds). The piece resumes as this backend would, with the same
        checks (:meth:`resume`: the snapshot committed for the range it was written for, each key group's chain
        beginning with the files its state reflects), and always plans its chains from the checkpoint.

        The entries are handed over, not copied: this backend must not use those key groups afterwards (its
        :meth:`resume` for a range without them drops them). None when it is not :attr:`splittable`, or the range is
        not a proper part of its own."""
        r = self.key_group_range
        part = key_group_range
        if (not part or part.start < r.start or part.end > r.end or part == r or not self.splittable
                or self._running_snapshots):
            return None
        self.compact()
        piece = HeapKeyedStateBackend(part, self.max_parallelism, self.key_serializer, key_type=self.key_type,
                                      clock=self.clock, allow_pickle=self.allow_pickle,
                                      subtask_index=self.subtask_index, incremental=self.incremental,
                                      max_chain=self.max_chain, delta_fraction=self.delta_fraction,
                                      compact_full_groups=self.compact_full_groups)
        piece._tracking = True
        piece._restored = self._restored
        piece.warm = self.warm
        piece._warm_point = self._warm_point
        piece._snapshot_range = self._snapshot_range or r
        piece._chain_files = {kg: f for kg, f in self._chain_files.items() if kg in part}
        piece._file_uses = _file_uses(piece._chain_files)
        piece._known_handles = {}   # never the own-checkpoint shortcut: the piece's chains are planned again
        piece._chains = None if self._chains is None else {kg: c for kg, c in self._chains.items() if kg in part}
        piece._chain_metas = dict(self._chain_metas)
        piece._needs_full = self._needs_full
        first = part.start - self._start
        for name, t in self._tables.items():
            p = piece._new_table(name, t.meta, t.read_framing, t.write_framing, t.descriptor)
            p.track = True
            p.take_groups(t, first, 0, len(part))
        return piece

    def _move_to(self, new_range: KeyGroupRange) -> None:
        """Own ``new_range`` from now on: the entries of the key groups that left are dropped, those that arrive
        start empty (``resume`` then restores them)."""
        old_start = self._start
        self.key_group_range = new_range
        self._start = new_range.start
        self._n = len(new_range)
        for t in self._tables.values():
            t.rerange(old_start, self._start, self._n)
        self._move_externals()   # external states
        self._chain_files = {kg: f for kg, f in self._chain_files.items() if kg in new_range}

    def _kept_point(self) -> tuple[int, str] | None:
        """(checkpoint id, file) of the last snapshot if the state is still exactly what it wrote: it finished, no
        snapshot runs or failed, and no key was written (or a mutable value read) since its capture. Not while a
        state migrates its serializer: its layers hold bytes of the old one, which the meta it wrote no longer
        names."""
        if (self._warm_point is None or self._running_snapshots or self._failed or not self._tracking
                or any(t.needs_migration or any(t.dirty) for t in self._tables.values())
                or self._externals_changed()):   # external states
            return None
        return self._warm_point

    def _forget_registrations(self) -> None:
        """Back to restored, unregistered states (as after a restore), with no current key."""
        self._descriptors.clear()
        self._states.clear()
        self._ctx = KeyContext(self.key_group_range, self.max_parallelism, self._key_type_code)
        self.set_current_key = self._ctx.set_current_key  # type: ignore[method-assign]
        for t in self._tables.values():
            t.descriptor = None
            t.ctx = self._ctx

    def compact(self) -> None:
        """Apply what the latest snapshot prepared (see ``compact_full_groups``) to the key groups untouched since
        its capture, and drop the rest: call it from the thread that uses the backend once the snapshot finished
        (the next ``snapshot`` or ``resume`` does it too). Does nothing while a snapshot runs."""
        if self._running_snapshots:
            return
        while self._compactions:
            capture, name, i, captured_map, captured_layers, layer, hot = self._compactions.popleft()
            t = self._tables.get(name)
            if (capture != self._captures or t is None or t.maps[i] is not captured_map
                    or t.layers[i] is not captured_layers or t.dirty[i]):
                continue
            t.replace_group(i, layer, hot)

    def _after_snapshot(self, handle: KeyedStateHandle) -> None:
        super()._after_snapshot(handle)
        _extend_chain_files(self._chain_files, handle, self.key_group_range, self._file_uses)
        # accounted for from now on; an earlier file of this range that no chain holds any more is forgotten (no
        # checkpoint carries it on), so a backend that snapshots without resuming keeps no growing list of them
        known, uses, r = self._known_handles, self._file_uses, self.key_group_range
        for f, h in list(known.items()):
            if f not in uses and r.start <= h.key_group_range.start and h.key_group_range.end <= r.end:
                del known[f]
        known[handle.file] = handle
        self._warm_point = (handle.checkpoint_id, handle.file)
        self._snapshot_range = None   # the handle covers this backend's own range

    def _after_restore(self, lazy: bool) -> None:
        if not lazy:
            for t in self._tables.values():
                t.decode_all()
        self._start_tracking()

    def _start_tracking(self) -> None:
        if not self.incremental:
            return
        self._tracking = True
        for t in self._tables.values():
            t.track = True

    # ---- iteration ------------------------------------------------------------------------------------------------
    def estimated_entries(self) -> int:
        """Entries per state and key group: those in memory, or, where restored layers are not merged yet, the most
        that one of them or memory holds (a key may be in several layers and memory at once; keys only a newer
        delta adds are missed). A sum over key groups, never over entries."""
        total = sum(heapsnap.estimated_entries(t.maps, t.layers, self._n) for t in self._tables.values())
        return total + self._external_entries()   # external states

    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has a value in ``state_name``, key group by key group (expired TTL entries that were
        not cleaned up yet included, as in Flink)."""
        if state_name in self._externals:   # external states
            yield from self._externals[state_name].keys(state_name)
            return
        t = self._tables.get(state_name)
        if t is None:
            raise KeyError(f"no state named {state_name!r}; known states: {sorted(self._tables)}")
        for i in range(self._n):
            yield from t.keys_of_group(i)

    def _export_entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """External states: state ``name``'s entries per key group, as a full snapshot would write them (decoded
        values encoded, restored bytes as they are, migrated to the registered serializers, expired TTL entries
        left out as a restore leaves them). Changes no snapshot holds yet (dirty keys, a failed snapshot's) make the
        next snapshot full, since the external states will not know them as changes."""
        t = self._tables[name]
        n = self._n
        if self._failed or any(t.dirty):
            self._needs_full = True
        capture = _Capture(t.maps[:n], t.layers[:n], [None] * n, {}, t.read_framing, t.write_framing,
                           t.needs_migration, t._ttl_deadline())
        for i in range(n):
            section = self._full_section(capture, i)
            if section is not None:
                yield self._start + i, section.keys, section.values

    # ---- snapshots ------------------------------------------------------------------------------------------------
    def _full_groups(self) -> set[int]:
        """Key-group indexes this snapshot writes full; the others get a delta of their dirty keys. The changes a
        failed snapshot took come back first: its deltas' keys are dirty again, its full key groups full again."""
        full: set[int] = set()
        while self._failed:
            dirty, failed_full = self._failed.popleft()
            full |= failed_full
            for name, lists in dirty.items():
                t = self._tables.get(name)
                if t is None:   # handed to external states since (which then made the next snapshot full)
                    continue
                for i, keys in lists.items():
                    t.dirty[i].extend(keys)
        if not self._tracking:  # nothing tracked yet: nothing to write a delta from
            return set(range(self._n))
        start = self._start
        return {kg - start for kg in self._full_key_groups_for_snapshot()} | full

    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture[KeyedStateHandle]:
        """Capture a consistent view now (cheap: per key group a reference, plus the values of the keys changed
        since the last snapshot; see the module docs) and write it to ``storage`` on the snapshot worker thread:
        full blocks for the key groups the materialization policy names, deltas (changed values and deletes) for
        the others. Later writes to this backend never reach the snapshot."""
        n, start = self._n, self._start
        self.compact()
        self._captures += 1
        capture = self._captures
        full = self._full_groups()
        metas = []
        captures = []
        names = list(self._tables)
        delta_groups: set[int] = set()   # key groups some state writes a delta of
        for t in self._tables.values():
            metas.append(t.meta)
            # the dirty lists move to the capture, each replaced by a new one in place: one object per key group
            # written since the last capture, none per untouched key group
            dirty = {i: keys for i, keys in enumerate(t.dirty) if keys}
            for i in dirty:
                t.dirty[i] = []
            t.dirty_limit = _DIRTY_LIMIT
            maps = t.maps
            deltas: list[dict[Any, Any] | None] = [None] * n
            for i, keys in dirty.items():
                if i not in full:
                    m = maps[i]
                    deltas[i] = {k: m.get(k, MISSING) for k in keys}
                    delta_groups.add(i)
            captures.append(_Capture(maps[:n], t.layers[:n], deltas, dirty, t.read_framing, t.write_framing,
                                     t.needs_migration, t._ttl_deadline()))
        with self._snap_lock:
            self._running_snapshots += 1
            for t in self._tables.values():
                # A full key group's dict is held as a whole (copied before the next write to it); a delta's values
                # are held one by one (a mutable one is copied before it is handed out again). A dict still held by
                # an earlier running snapshot stays shared.
                shared, copied = t.shared, t.copied_keys
                for i in full:
                    shared[i] = True
                    copied[i] = None
                if t.copy_value is not None:   # mutable values: those a delta holds are copied when next handed out
                    for i in delta_groups:
                        if not shared[i]:
                            copied[i] = set()
                t.cow = True
                t._update_slow()
        self._start_tracking()
        external = self._capture_externals(checkpoint_id, [start + i for i in full], len(metas))  # external states

        def work(future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
            compactions: list[tuple[int, int, Layer | None]] = []
            try:
                check_cancel(future)
                handle = write_keyed_snapshot(storage, checkpoint_id, self.subtask_index, self.key_group_range,
                                              metas + external.metas,
                                              external.merge(self._groups(captures, full, delta_groups, compactions)),
                                              full_key_groups={start + i for i in full},
                                              on_key_group=functools.partial(check_cancel, future),
                                              predecessors=self._chain_tips())
                for state_index, i, layer in compactions:
                    c = captures[state_index]
                    self._compactions.append((capture, names[state_index], i, c.maps[i], c.layers[i], layer,
                                              c.dirty.get(i, ())))
            except BaseException:
                self._failed.append(({name: {i: keys for i, keys in c.dirty.items() if i not in full}
                                      for name, c in zip(names, captures)}, full))
                raise
            finally:
                self._release_snapshot()
            self._after_snapshot(handle)
            return handle

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

    def _groups(self, captures: list[_Capture], full: set[int], delta_groups: set[int],
                compactions: list[tuple[int, int, Layer | None]]) -> Iterator[tuple[int, list[Any], list[Any]]]:
        """Per key group with something to write: ``(key_group, put sections, delete sections)``; the key groups
        in ``full`` (indexes) are written full, the others as deltas. With ``compact_full_groups``, a full key group
        with decoded entries or restored layers to fold adds ``(state index, key-group index, its written entries as one layer)`` to
        ``compactions``. Only the key groups in ``full`` or ``delta_groups`` (those a state has a delta of) are
        looked at: the writer gives every other one an empty block in one compiled call."""
        start = self._start
        for i in sorted(full | delta_groups):
            sections: list[Any] = []
            deletes: list[Any] = []
            if i in full:
                for state_index, c in enumerate(captures):
                    try:
                        section = self._full_section(c, i)
                    except UNWRITABLE as e:
                        raise self._unwritable(c, c.maps[i], e) from e
                    layers = c.layers[i]
                    if (self.compact_full_groups and not c.needs_migration
                            and (c.maps[i] or (layers is not None
                                               and (len(layers) > 1 or c.ttl_deadline is not None)))):
                        layer = None
                        if section is not None:
                            if section.merged is not None:   # the written bytes become the key group's layer
                                layer = Layer(*section.merged, None, True, copy=False)
                            else:
                                section, layer = _as_layer(start + i, section)
                        compactions.append((state_index, i, layer))
                    if section is not None:
                        sections.append((state_index, section.keys, section.values))
                yield start + i, sections, deletes
                continue
            for state_index, c in enumerate(captures):
                delta = c.deltas[i]
                if delta:
                    try:
                        keys, values, gone = heapsnap.delta_section(delta, self._key_encoder, c.write_framing.writer,
                                                                    MISSING, c.ttl_deadline)
                    except UNWRITABLE as e:
                        raise self._unwritable(c, delta, e) from e
                    if keys is not None:
                        sections.append((state_index, Packed(*keys), Packed(*values)))
                    if gone is not None:
                        deletes.append((state_index, Packed(*gone)))
            if sections or deletes:
                yield start + i, sections, deletes

    def _unwritable(self, c: _Capture, entries: dict[Any, Any], error: Exception) -> StateSerializationError:
        """The error for a value (or key) a serializer refused, naming the first key whose entry fails alone."""
        w = c.write_framing
        return w.unwritable(w.first_unwritable(entries.items(), self.key_serializer.serialize, MISSING), error)

    def _full_section(self, c: _Capture, i: int) -> _Section | None:
        """Every live entry of one state in one key group to write, or None if it has none: the decoded values,
        then what the layers hold of the other keys (bytes as they are, re-encoded only to migrate). Merged in C
        (``heapsnap.full_section``: no object per entry), except to migrate restored bytes, to drop what expired
        from a restored list or map, or with an unsorted (format 1) layer."""
        m, layers = c.maps[i], c.layers[i]
        if not (m or layers):
            return None
        write, deadline = c.write_framing, c.ttl_deadline
        if not m and layers is not None and len(layers) == 1 and not c.needs_migration and deadline is None:
            layer = layers[0]  # an untouched restored key group: its bytes as they are
            if not layer.n_puts:
                return None
            return _Section(Packed(layer.block, layer.key_offsets), Packed(layer.block, layer.value_offsets))
        if not layers or (not c.needs_migration and all(layer.sorted for layer in layers)
                          and (deadline is None or write.kind not in ("list", "map"))):
            merged = heapsnap.full_section(m, layers, self._key_encoder, write.writer, MISSING, deadline)
            if merged is None:
                return None
            data, key_offsets, value_offsets = merged
            return _Section(Packed(data, key_offsets), Packed(data, value_offsets), merged)
        return self._full_section_merged_in_python(c, m, layers)

    def _full_section_merged_in_python(self, c: _Capture, m: dict[Any, Any], layers: list[Layer]) -> _Section | None:
        """:meth:`_full_section` for what the compiled merge does not do: one bytes object per entry."""
        serialize_key = self.key_serializer.serialize
        write, deadline = c.write_framing, c.ttl_deadline
        encode = write.encode
        keys: list[bytes] = []
        values: list[bytes] = []
        shadow: set[bytes] = set()
        for k, v in m.items():
            key_bytes = serialize_key(k)
            shadow.add(key_bytes)
            if v is MISSING:
                continue
            if deadline is not None:
                v = write.drop_expired(v, deadline)
                if v is None:
                    continue
            keys.append(key_bytes)
            values.append(encode(v))
        for depth, layer in enumerate(layers):
            older = depth + 1 < len(layers)
            if older:
                layer.collect_deletes(shadow)
            first = len(keys)
            layer.collect_puts(shadow, keys, values, older)
            if c.needs_migration or deadline is not None:
                self._pass_through(keys, values, first, c)
        return _Section(keys, values) if keys else None

    @staticmethod
    def _pass_through(keys: list[bytes], values: list[bytes], first: int, capture: _Capture) -> None:
        """Restored entries ``keys[first:]`` go out as the same bytes, re-encoded only to migrate, without those
        TTL drops now."""
        read, write, deadline = capture.read_framing, capture.write_framing, capture.ttl_deadline
        kept_keys: list[bytes] = []
        kept_values: list[bytes] = []
        for key_bytes, value_bytes in zip(keys[first:], values[first:]):
            if capture.needs_migration:
                value_bytes = write.encode(read.decode(value_bytes))
            if deadline is not None:
                value_bytes = write.drop_expired_bytes(value_bytes, deadline)
                if value_bytes is None:
                    continue
            kept_keys.append(key_bytes)
            kept_values.append(value_bytes)
        keys[first:] = kept_keys
        values[first:] = kept_values


def _same_values(a: ValueFraming, b: ValueFraming) -> bool:
    """Whether values made for framing ``a`` are values of ``b`` as they are: the same serializers (snapshots) giving
    values in the same form (a record serializer's dicts, tuples or class)."""
    def same(x: Any, y: Any) -> bool:
        return x is y or (x is not None and y is not None and x.snapshot() == y.snapshot()
                          and getattr(x, "form", None) == getattr(y, "form", None))

    return a.kind == b.kind and a.ttl == b.ttl and same(a.ser, b.ser) and same(a.key_ser, b.key_ser)


def _names(metadata: CheckpointMetadata, file: str, key_group_range: KeyGroupRange) -> bool:
    """Whether ``metadata`` lists ``file`` as the keyed handle of exactly ``key_group_range``."""
    return any(h.file == file and h.key_group_range == key_group_range for h in metadata.keyed_handles)


@dataclass(frozen=True, slots=True)
class _Section:
    """One state's entries of one key group for a full block: keys and values (lists of bytes, or ``Packed``), and,
    when merged in C, ``merged``: ``(data, key_offsets, value_offsets)``, the same bytes as one buffer (sorted), which
    a kept backend keeps as the key group's layer as it is."""

    keys: Any
    values: Any
    merged: tuple[bytes, Any, Any] | None = None


def _as_layer(key_group: int, section: _Section) -> tuple[_Section, Layer]:
    """One state's full entries of a key group as one sorted layer, and the same bytes as the section to write
    (the writer then finds them sorted)."""
    block = encode_block(key_group, [(0, section.keys, section.values)], 1, full=True)
    _, puts, _ = parse_block_offsets(block, key_group, 1, verify_checksum=False)
    _, key_offsets, value_offsets = puts[0]
    layer = Layer(block, key_offsets, value_offsets, None, True)
    return _Section(Packed(layer.block, layer.key_offsets), Packed(layer.block, layer.value_offsets)), layer


__all__ = ["HeapKeyedStateBackend"]
