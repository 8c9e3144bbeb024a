"""What both keyed state backends share: the current key, state registration and its checks against restored
state, restore planning, and the snapshot future.

A backend subclass provides ``_new_table(name, kind, meta, read_codec, write_codec, ...)`` style hooks (see
``HeapKeyedStateBackend`` and ``RocksDBKeyedStateBackend``); this module never touches the stored data itself.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keygroups._hashing import key_type_code
from keygroups._native.statecore import KeyContext
from keygroups._ranges import KeyGroupRange, check_max_parallelism
from keygroups.errors import StateMigrationError
from keygroups.state._codec import Codec
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.states import STATE_CLASSES, State

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, KeyedStateHandle
    from keygroups.serializers import TypeSerializer


class _VoidNamespace:
    """The namespace of state that is not scoped to a window (Flink's ``VoidNamespace``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "VOID_NAMESPACE"

    def __reduce__(self) -> str:
        return "VOID_NAMESPACE"


VOID_NAMESPACE = _VoidNamespace()

#: Version of the per-state meta this module writes (bumped when the value framing of ``_codec`` changes).
STATE_META_VERSION = 1


@dataclass(frozen=True)
class RestoreStats:
    """What a restore read: bytes fetched from storage and the number of key groups restored."""

    bytes_read: int
    key_groups: int


class SnapshotFuture:
    """The asynchronous part of a snapshot. ``result()`` gives the ``KeyedStateHandle`` once the file is written;
    ``cancel()`` stops the write between key groups (``result()`` then raises ``concurrent.futures.CancelledError``)."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def result(self, timeout: float | None = None) -> KeyedStateHandle:
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """Ask the write to stop at the next key group; True unless it had already finished. Does not wait:
        ``result()`` raises ``CancelledError`` once the writer has stopped."""
        if self._future.done():
            return self._future.cancelled()
        self._cancel.set()
        return True

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def done(self) -> bool:
        return self._future.done()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def _run(self, work: Callable[[SnapshotFuture], Any], name: str) -> None:
        def target() -> None:
            time.sleep(0)  # hand the GIL back first: snapshot() returns to processing without waiting a switch interval
            try:
                value = work(self)
            except _Cancelled:
                self._future.cancel()
                self._future.set_running_or_notify_cancel()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through result()
                self._future.set_exception(exc)
            else:
                self._future.set_result(value)

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()


class _Cancelled(Exception):
    pass


def check_cancel(future: SnapshotFuture) -> None:
    if future._cancel.is_set():
        raise _Cancelled()


def _snap_from_json(d: dict[str, Any]) -> Any:
    from keygroups.serializers import SerializerSnapshot

    return SerializerSnapshot.from_json(d)


class KeyedStateBackendBase:
    """Shared logic of the keyed state backends (see ``HeapKeyedStateBackend`` for the public documentation)."""

    _tables: dict[str, Any]  # state name -> the subclass's table

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: Any = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0) -> None:
        from keygroups.serializers import TypeSerializer

        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {key_group_range!r}")
        mp = check_max_parallelism(max_parallelism)
        if not key_group_range or key_group_range.end >= mp:
            raise ValueError(f"key_group_range must be a non-empty range inside [0, {mp - 1}] "
                             f"(max_parallelism={mp}), got {key_group_range!r}")
        if not isinstance(key_serializer, TypeSerializer):
            raise TypeError(f"key_serializer must be a keygroups.serializers.TypeSerializer, got {key_serializer!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds (like time.time), got {clock!r}")
        self.key_group_range = key_group_range
        self.max_parallelism = mp
        self.key_serializer = key_serializer
        self.key_type = key_type
        self._key_type_code = key_type_code(key_type)
        self.clock = clock
        self.allow_pickle = allow_pickle
        self.subtask_index = subtask_index
        self._start = key_group_range.start
        self._n = len(key_group_range)
        self._ctx = KeyContext(key_group_range, mp, self._key_type_code)
        self._states: dict[str, State] = {}
        self._descriptors: dict[str, StateDescriptor] = {}
        self._restored = False

    # ---- current key --------------------------------------------------------------------------------------------
    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key that every state of this backend reads and writes.

        Raises ``KeyGroupOutOfRangeError`` (naming the key, its key group and the range) if the key's group is not
        in this backend's range: the records were not partitioned by key group, or the key's hash is not
        deterministic."""
        self._ctx.set_current_key(key)

    @property
    def current_key(self) -> Any:
        return self._ctx.key

    @property
    def current_key_group(self) -> int:
        c = self._ctx
        return c.start + c.kgi if c.kgi < c.n else -1

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ---- registration -------------------------------------------------------------------------------------------
    def get_state(self, descriptor: StateDescriptor, namespace: Any = VOID_NAMESPACE) -> Any:
        """The state ``descriptor`` describes, created on first use (or matched to restored state: kind, TTL and
        serializer compatibility are checked, see ``keygroups.serializers.resolve_compatibility``).

        ``namespace`` is reserved for window state; only ``VOID_NAMESPACE`` is supported so far."""
        if namespace is not VOID_NAMESPACE:
            raise NotImplementedError(
                f"namespaced state (namespace={namespace!r}) is not supported yet; use the default VOID_NAMESPACE")
        if not isinstance(descriptor, StateDescriptor) or not descriptor.kind:
            raise TypeError(f"get_state takes a ValueStateDescriptor, ListStateDescriptor, MapStateDescriptor, "
                            f"ReducingStateDescriptor or AggregatingStateDescriptor, got {descriptor!r}")
        name = descriptor.name
        known = self._descriptors.get(name)
        if known is not None:
            if known is not descriptor:
                self._check_same(known, descriptor)
            return self._states[name]
        meta = self._state_meta(descriptor)
        restored = self._restored_meta(name)
        if restored is None:
            codec = self._codec(descriptor, descriptor.serializers)
            self._register(descriptor, meta, codec, codec)
        else:
            read_sers = self._resolve(descriptor, restored)
            self._register(descriptor, meta, self._codec(descriptor, read_sers),
                           self._codec(descriptor, descriptor.serializers))
        state = self._state_class(descriptor.kind, descriptor.ttl_config is not None)(
            self._store(name), descriptor, self)
        self._descriptors[name] = descriptor
        self._states[name] = state
        return state

    get_partitioned_state = get_state

    def _state_class(self, kind: str, ttl: bool) -> type:
        return STATE_CLASSES[(kind, ttl)]

    def _check_same(self, known: StateDescriptor, new: StateDescriptor) -> None:
        name = new.name
        if known.kind != new.kind:
            raise StateMigrationError(f"state {name!r} is registered as a {known.kind} state; it cannot be "
                                      f"registered again as a {new.kind} state")
        for role, ser in new.serializers.items():
            if known.serializers[role].snapshot() != ser.snapshot():
                raise StateMigrationError(
                    f"state {name!r} is registered with {role} serializer {known.serializers[role]!r}; it cannot be "
                    f"registered again with {ser!r}")
        if (known.ttl_config is None) != (new.ttl_config is None) or (
                known.ttl_config is not None and known.ttl_config != new.ttl_config):
            raise StateMigrationError(f"state {name!r} is registered with TTL {known.ttl_config}; it cannot be "
                                      f"registered again with TTL {new.ttl_config}")

    def _state_meta(self, d: StateDescriptor) -> dict[str, Any]:
        sers = {"key": self.key_serializer.snapshot().to_json()}
        for role, ser in d.serializers.items():
            sers[role] = ser.snapshot().to_json()
        return {
            "name": d.name,
            "kind": d.kind,
            "serializers": sers,
            "ttl": d.ttl_config.to_json() if d.ttl_config is not None else None,
            "namespace_serializer": None,
            "format": STATE_META_VERSION,
        }

    def _codec(self, d: StateDescriptor, sers: dict[str, Any]) -> Codec:
        ttl = d.ttl_config is not None
        if d.kind == "list":
            return Codec(d.name, "list", sers["element"], ttl=ttl)
        if d.kind == "map":
            return Codec(d.name, "map", sers["map value"], sers["map key"], ttl=ttl)
        return Codec(d.name, d.kind, sers["value"], ttl=ttl)

    @staticmethod
    def _codec_for_meta(meta: dict[str, Any], sers: dict[str, Any]) -> Codec:
        kind, ttl, name = meta["kind"], meta.get("ttl") is not None, meta["name"]
        if kind == "list":
            return Codec(name, "list", sers["element"], ttl=ttl)
        if kind == "map":
            return Codec(name, "map", sers["map value"], sers["map key"], ttl=ttl)
        return Codec(name, kind, sers["value"], ttl=ttl)

    def _resolve(self, d: StateDescriptor, meta: dict[str, Any]) -> dict[str, Any]:
        """Serializers to read the restored bytes of ``d``'s state with; raises when they cannot be used."""
        from keygroups.serializers import resolve_compatibility

        name = d.name
        if meta["kind"] != d.kind:
            raise StateMigrationError(f"state {name!r} was snapshotted as a {meta['kind']} state and cannot be "
                                      f"restored as a {d.kind} state")
        if (meta.get("ttl") is None) != (d.ttl_config is None):
            had = "with" if meta.get("ttl") is not None else "without"
            raise StateMigrationError(
                f"state {name!r} was snapshotted {had} TTL; it must be registered {had} TTL to restore it "
                "(as in Flink, TTL cannot be switched on or off for existing state)")
        read: dict[str, Any] = {}
        for role, ser in d.serializers.items():
            stored = meta["serializers"].get(role)
            if stored is None:
                raise StateMigrationError(f"state {name!r}: the snapshot has no {role} serializer")
            _, read[role] = resolve_compatibility(name, _snap_from_json(stored), ser,
                                                  allow_pickle=self.allow_pickle, role=role)
        return read

    def _check_key_serializer(self, meta: dict[str, Any]) -> None:
        from keygroups.serializers import Compatibility, resolve_compatibility

        stored = meta["serializers"].get("key")
        if stored is None:
            raise StateMigrationError(f"state {meta['name']!r}: the snapshot has no key serializer")
        outcome, _ = resolve_compatibility(meta["name"], _snap_from_json(stored), self.key_serializer,
                                           allow_pickle=self.allow_pickle, role="key")
        if outcome is not Compatibility.COMPATIBLE_AS_IS:
            raise StateMigrationError(
                f"state {meta['name']!r}: the key serializer {self.key_serializer!r} is not compatible as-is with "
                f"the snapshot's ({stored.get('identifier', stored)}); keys cannot be migrated because their bytes "
                "identify them")

    def _restored_codec(self, meta: dict[str, Any]) -> Codec:
        """The codec of a restored state nobody registered yet: its own (old) serializers."""
        sers = {role: _snap_from_json(s).restore_serializer(allow_pickle=self.allow_pickle)
                for role, s in meta["serializers"].items() if role != "key"}
        return self._codec_for_meta(meta, sers)

    # ---- restore ------------------------------------------------------------------------------------------------
    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, *, lazy: bool = True) -> RestoreStats:
        """Restore this backend's key groups from a checkpoint written at any parallelism: only the intersecting
        key groups of the intersecting old files are read (one ranged read per file). With ``lazy`` (the default,
        heap backend) values stay bytes until first accessed, and key groups are decoded when first touched.

        Must be called once, before any state is written. A changed max parallelism raises
        ``StateMigrationError``."""
        from keygroups.checkpoint import plan_keyed_restore

        if self._restored:
            raise RuntimeError("restore() was already called on this backend; create a new backend to restore again")
        if self._has_data():
            raise RuntimeError("restore() must come before any state is written to the backend")
        if metadata.max_parallelism != self.max_parallelism:
            raise StateMigrationError(
                f"checkpoint {metadata.checkpoint_id} was taken with max_parallelism={metadata.max_parallelism}, "
                f"this backend has max_parallelism={self.max_parallelism}: max parallelism cannot change across a "
                "restore (key groups would move); restore with the old max parallelism")
        self._restored = True
        total = 0
        groups = 0
        for handle, kgr in plan_keyed_restore(metadata, self.key_group_range):
            kgr = kgr.intersection(self.key_group_range)
            if not kgr:
                continue
            targets = [self._restore_target(meta) for meta in handle.states]
            nbytes, ngroups = self._restore_handle(storage, handle, kgr, targets)
            total += nbytes
            groups += ngroups
        self._after_restore(lazy)
        return RestoreStats(total, groups)

    def _restore_handle(self, storage: CheckpointStorage, handle: KeyedStateHandle, kgr: KeyGroupRange,
                        targets: list[Any]) -> tuple[int, int]:
        """Read ``kgr`` of one old file into ``targets`` (one per state of the file); (bytes read, key groups)."""
        from keygroups.checkpoint import read_key_groups

        it, nbytes = read_key_groups(storage, handle, kgr)
        groups = 0
        for kg, sections in it:
            if kg not in self.key_group_range:
                continue
            groups += 1
            kgi = kg - self._start
            for state_index, keys, values in sections:
                self._check_state_index(handle, kg, state_index, targets)
                if keys:
                    self._restore_section(targets[state_index], kgi, keys, values)
        return nbytes, groups

    @staticmethod
    def _check_state_index(handle: KeyedStateHandle, kg: int, state_index: int, targets: list[Any]) -> None:
        if not 0 <= state_index < len(targets):
            from keygroups.errors import CorruptSnapshotError

            raise CorruptSnapshotError(f"{handle.file}: key group {kg} has a section for state index {state_index}, "
                                       f"but the file has {len(targets)} states")

    def _restore_target(self, meta: dict[str, Any]) -> Any:
        """The table restored entries of ``meta``'s state go to (created for unregistered states)."""
        self._check_key_serializer(meta)
        name = meta["name"]
        d = self._descriptors.get(name)
        if d is not None:
            read = self._resolve(d, meta)
            return self._adopt_restored(name, meta, self._codec(d, read))
        return self._adopt_restored(name, meta, None)

    # ---- hooks --------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        raise NotImplementedError

    def _restored_meta(self, name: str) -> dict[str, Any] | None:
        t = self._tables.get(name)
        return t.meta if t is not None and t.descriptor is None else None

    def _new_table(self, name: str, meta: dict[str, Any], read: Codec, write: Codec,
                   d: StateDescriptor | None) -> Any:
        """Create and register the backend's table for state ``name`` (``d`` is None for restored, unregistered
        state)."""
        raise NotImplementedError

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: Codec, write: Codec) -> None:
        raise NotImplementedError

    def _store(self, name: str) -> Any:
        raise NotImplementedError

    def _adopt_restored(self, name: str, meta: dict[str, Any], read: Codec | None) -> Any:
        """The table restored entries of state ``name`` go into: the registered one (reading with ``read``), or a
        new table that keeps the stored meta until the state is registered."""
        t = self._tables.get(name)
        if t is not None and t.descriptor is not None:
            assert read is not None
            t.configure(t.meta, read, t.write, t.descriptor)
            return t
        if t is None:
            codec = self._restored_codec(meta)
            return self._new_table(name, meta, codec, codec, None)
        if t.meta["kind"] != meta["kind"]:
            from keygroups.errors import CorruptSnapshotError

            raise CorruptSnapshotError(f"state {name!r} is a {t.meta['kind']} state in one restored file and a "
                                       f"{meta['kind']} state in another")
        return t

    def _restore_section(self, target: Any, kgi: int, keys: list[Any], values: list[Any]) -> None:
        raise NotImplementedError

    def _after_restore(self, lazy: bool) -> None:
        pass

    def keys(self, state_name: str) -> Iterator[Any]:
        raise NotImplementedError

    def _write_snapshot(self, checkpoint_id: int, storage: CheckpointStorage, capture: Any,
                        future: SnapshotFuture) -> KeyedStateHandle:
        """Write a captured view (``capture`` from the subclass) as a keyed snapshot file."""
        from keygroups.checkpoint import KeyedSnapshotWriter, KeyedStateHandle

        metas, groups = capture
        rel = storage.new_file(checkpoint_id, f"keyed-{self.subtask_index}")
        with storage.open_write(rel) as stream:
            writer = KeyedSnapshotWriter(stream, self.key_group_range, metas)
            for kg, sections in groups:
                check_cancel(future)
                writer.write_key_group(kg, sections)
            check_cancel(future)
            offsets, size = writer.finish()
        return KeyedStateHandle(file=rel, subtask=self.subtask_index, key_group_range=self.key_group_range,
                                offsets=offsets, size=size, states=metas)


__all__ = ["VOID_NAMESPACE", "RestoreStats", "SnapshotFuture", "KeyedStateBackendBase"]
