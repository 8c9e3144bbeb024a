"""What both keyed state backends share: the current key, state registration and its checks against restored
state, restore planning, the backend's lifecycle (``dispose``, ``with``), and the snapshot runner.

A backend subclass provides the table hooks below (``_new_table``, ``_register``, ``_store``, ...; see
``HeapKeyedStateBackend`` and ``RocksDBKeyedStateBackend``); this module never touches the stored data itself.

Snapshots of every backend (and of the operator state store) run their asynchronous part on ONE worker thread
(``SnapshotFuture``), one after another, as Flink's ``SnapshotStrategyRunner`` does per backend. A snapshot's work
must therefore never wait for another snapshot: it would wait forever behind itself (``result()`` refuses).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import numpy as np

from keygroups._hashing import KeyType, assign_key_groups, key_type_code
from keygroups._native.statecore import KeyContext
from keygroups._ranges import KeyGroupRange, check_max_parallelism
from keygroups.checkpoint import (
    BlockLink,
    ChainStats,
    KeyedStateHandle,
    KeyGroupBlock,
    chain_stats,
    choose_full_key_groups,
    plan_keyed_restore,
    read_key_group_offsets,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import BlockLinks, is_shared_path, keyed_handles_by_range
from keygroups.checkpoint.planning import MAX_MATERIALIZED_SHARE, NO_CHAIN, key_group_chains
from keygroups.checkpoint.state_meta import check_state_metas
from keygroups.errors import CorruptSnapshotError, StateMigrationError, UnsafeDeserializationError
from keygroups.serializers import SerializerSnapshot, TypeSerializer, resolve_compatibility
from keygroups.state._checks import checked_state_class
from keygroups.state._codec import ValueFraming
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.external import (
    ExternalCapture,
    ExternalStates,
    check_target_meta,
    external_block,
    items,
    route_block,
)
from keygroups.state.namespaced import namespaced_state
from keygroups.state.states import STATE_CLASSES, State
from keygroups.state.timers import NO_WATERMARK
from keygroups.state.ttl import EVENT_TIME_NOT_STARTED, StateTtlConfig, stored_time_characteristic

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage


class _VoidNamespace:
    """The namespace of state that is not scoped to a window (Flink's ``VoidNamespace``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "VOID_NAMESPACE"

    def __reduce__(self) -> str:
        return "VOID_NAMESPACE"


VOID_NAMESPACE = _VoidNamespace()

#: Version of the per-state meta this module writes (the value framing of ``_codec`` is the keyed file format's).
STATE_META_VERSION = 1

#: A key group's chain of blocks is written full again past this many blocks (bounds the files a restore opens)...
DEFAULT_MAX_CHAIN = 32
#: ... or once its deltas exceed this fraction of its full block (bounds what a restore reads: at most 1.3x the
#: live state, and a batch that changes 1% of the keys writes about 1% + 1% / 0.3 = 4.3% of the state's bytes).
DEFAULT_DELTA_FRACTION = 0.3


def state_meta(descriptor: StateDescriptor, key_serializer: TypeSerializer) -> dict[str, Any]:
    """The per-state meta a keyed snapshot stores for ``descriptor``'s state with keys of ``key_serializer``: name,
    kind, serializer snapshots by role (``"key"`` too), TTL. What a backend writes, and what a savepoint written
    without a backend (``keygroups.runtime.state_writer``) must write so that a backend restores it."""
    sers = {"key": key_serializer.snapshot().to_json()}
    for role, ser in descriptor.serializers.items():
        sers[role] = ser.snapshot().to_json()
    return {
        "name": descriptor.name,
        "kind": descriptor.kind,
        "serializers": sers,
        "ttl": descriptor.ttl_config.to_json() if descriptor.ttl_config is not None else None,
        "namespace_serializer": None,
        "format": STATE_META_VERSION,
    }


@dataclass(frozen=True)
class RestoreStats:
    """What a restore read: bytes fetched from storage and the number of key groups restored."""

    bytes_read: int
    key_groups: int


# ---- the snapshot runner ---------------------------------------------------------------------------------------
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_on_worker = threading.local()  # ``.active`` is True on the worker thread while a snapshot's work runs


def _snapshot_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one worker thread every snapshot's asynchronous part runs on, created on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="keygroups-snapshot")
        return _executor


def _forget_executor_after_fork() -> None:
    # A forked child (Spark's Python daemon forks its workers) inherits the executor but not its thread: the
    # executor would count a worker that does not exist and never run the child's snapshots. Start afresh.
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_executor_after_fork)

T = TypeVar("T")


class _Cancelled(Exception):
    """Raised inside a snapshot's work (by ``check_cancel``) to stop it once ``cancel()`` was asked."""


class SnapshotFuture(Generic[T]):
    """The asynchronous part of a snapshot, running on the snapshot worker thread. ``result()`` gives what the work
    returned (a ``KeyedStateHandle`` for keyed state) once the file is written; ``cancel()`` stops the write at its
    next check (between key groups; ``result()`` then raises ``concurrent.futures.CancelledError``).

    Start one with :meth:`start`. The work always runs, even when cancelled before it began, so that it can release
    what the synchronous part captured (it ends at its first ``check_cancel``)."""

    def __init__(self) -> None:
        self.name = ""
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._cancel = threading.Event()

    @classmethod
    def start(cls, work: Callable[[SnapshotFuture[T]], T], *, name: str) -> SnapshotFuture[T]:
        """Run ``work(future)`` on the snapshot worker and return its future; ``name`` labels it (e.g.
        ``"keyed-3 chk-17"``). ``work`` calls :func:`check_cancel` where stopping is safe."""
        future: SnapshotFuture[T] = cls()
        future.name = name
        _snapshot_executor().submit(future._work, work)
        return future

    def result(self, timeout: float | None = None) -> T:
        """What the work returned; raises what it raised, or ``CancelledError``. Called from a snapshot's own work
        on an unfinished future, raises ``RuntimeError`` instead of waiting forever on the single worker."""
        if not self._future.done() and getattr(_on_worker, "active", False):
            raise RuntimeError(
                f"snapshot {self.name!r} has not finished and result() was called from another snapshot's work: "
                "snapshots run one at a time on one worker thread, so this would wait forever; wait for it from "
                "the thread that started the snapshots instead")
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """Ask the write to stop at its next check; True unless it had already finished. Does not wait:
        ``result()`` raises ``CancelledError`` once the work has stopped."""
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
        """Whether ``cancel()`` was called (the work may still be running until its next check)."""
        return self._cancel.is_set()

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self.done() else (
            "cancelling" if self.cancel_requested else "running")
        return f"SnapshotFuture({self.name!r}, {state})"

    def _work(self, work: Callable[[SnapshotFuture[T]], T]) -> None:
        # Never cancel the executor's own future: the work must run to release what the snapshot captured.
        time.sleep(0)  # hand the GIL back first: snapshot() returns to processing without waiting a switch interval
        _on_worker.active = True
        try:
            value = work(self)
        except _Cancelled:
            self._future.cancel()
            self._future.set_running_or_notify_cancel()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through result()
            self._future.set_exception(exc)
        else:
            self._future.set_result(value)
        finally:
            _on_worker.active = False


def check_cancel(future: SnapshotFuture[Any]) -> None:
    """End a snapshot's work as cancelled if ``future.cancel()`` was asked (call it where stopping is safe)."""
    if future.cancel_requested:
        raise _Cancelled()


class KeyedStateBackendBase:
    """Shared logic of the keyed state backends (see ``HeapKeyedStateBackend`` for the public documentation).

    A backend is a context manager: ``with HeapKeyedStateBackend(...) as backend:`` disposes of it on exit."""

    _tables: dict[str, Any]  # state name -> the subclass's table

    def __init__(self, key_group_range: KeyGroupRange, max_parallelism: int, key_serializer: TypeSerializer, *,
                 key_type: KeyType = None, clock: Callable[[], float] = time.time, allow_pickle: bool = False,
                 subtask_index: int = 0, incremental: bool = True, max_chain: int = DEFAULT_MAX_CHAIN,
                 delta_fraction: float = DEFAULT_DELTA_FRACTION) -> None:
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
        if isinstance(max_chain, bool) or not isinstance(max_chain, int) or max_chain < 1:
            raise ValueError(f"max_chain must be an int >= 1 (the longest chain of blocks a key group keeps before "
                             f"it is written full again), got {max_chain!r}")
        if isinstance(delta_fraction, bool) or not isinstance(delta_fraction, (int, float)) or not (
                delta_fraction > 0):
            raise ValueError(f"delta_fraction must be a number > 0 (deltas past this fraction of a key group's full "
                             f"block make it written full again), got {delta_fraction!r}")
        self.incremental = bool(incremental)
        self.max_chain = max_chain
        self.delta_fraction = float(delta_fraction)
        #: Per key group of the range, the chain a restore of the latest snapshot (or of the restore point) reads;
        #: None until the backend is restored (its first snapshot is then written full).
        self._chains: dict[int, ChainStats] | None = None
        # What the materialization policy found of the chains, kept while only this backend's snapshots change
        # them (see _chains): the key groups that may be past their bounds (a superset) and those without a tip.
        self._may_be_overdue: set[int] | None = None
        self._without_tip: set[int] | None = None
        self._tips: dict[int, BlockLink] | None = None   # what _chain_tips gives, kept alike
        self._chain_metas: dict[str, str] = {}   # state name -> its meta (canonical JSON) along the chains
        self._needs_full = False                  # the next snapshot must be full (see _full_key_groups_for_snapshot)
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
        #: State name -> the external states it is bound to (``bind_external_states``).
        self._externals: dict[str, ExternalStates] = {}

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def dispose(self) -> None:
        """Release what the backend holds beyond Python objects (RocksDB: its local database). Calling it again
        does nothing; the heap backend holds nothing to release. Wait for running snapshots first."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.dispose()

    # ---- current key --------------------------------------------------------------------------------------------
    #: Whether restore() found this backend's state already on the host (a warm RocksDB database) and read nothing.
    warm: bool = False
    #: The job's current event-time watermark (epoch ms), set by the runtime as a batch proceeds: the clock of
    #: event-time TTL. ``NO_WATERMARK`` (Java's Long.MIN_VALUE) without event time: then no event-time TTL entry
    #: expires (see ``keygroups.state.ttl``).
    watermark: int = NO_WATERMARK

    def prefetch(self, keys: Sequence[Any], key_groups: Any = None) -> None:
        """A hint that a batch is about to use ``keys`` (its distinct keys; ``key_groups`` their absolute key groups,
        if known), so a backend whose reads are slow one by one can load them together. Nothing to do on the
        heap: its state is in memory."""

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

    #: The batch's processing time (epoch ms), set by the runtime before each batch: the clock of processing-time
    #: TTL, so that the batch reads and writes TTL at the same time its processing-time timers see (and a batch run
    #: again sees it again). None: ``clock``.
    processing_time: int | None = None

    def _now_ms(self) -> int:
        now = self.processing_time
        return int(self.clock() * 1000) if now is None else now

    def _watermark_ms(self) -> int:
        return self.watermark

    def _event_time_stamp_ms(self) -> int:
        w = self.watermark
        return EVENT_TIME_NOT_STARTED if w == NO_WATERMARK else w

    def _ttl_clocks(self, config: StateTtlConfig) -> tuple[Callable[[], int], Callable[[], int]]:
        """The clocks (ms) of a TTL state with ``config``: the one expiry is measured against, and the one a write
        stamps. Processing time: the backend's clock for both. Event time: the watermark (nothing expires while it
        is ``NO_WATERMARK``), and the watermark or, before the first one, ``EVENT_TIME_NOT_STARTED``."""
        if config.event_time:
            return self._watermark_ms, self._event_time_stamp_ms
        return self._now_ms, self._now_ms

    def _snapshot_ttl_deadline(self, descriptor: StateDescriptor | None) -> int | None:
        """Entries of ``descriptor``'s state last accessed at or before this time (ms, of the state's TTL clock)
        are expired and dropped when a snapshot is written or restored (``cleanup_full_snapshot``); None when that
        cleanup is off, or for event-time TTL while there is no watermark (nothing has expired)."""
        if descriptor is None or descriptor.ttl_config is None or not descriptor.ttl_config.cleanup_full_snapshot:
            return None
        config = descriptor.ttl_config
        if config.event_time:
            return None if self.watermark == NO_WATERMARK else self.watermark - config.ttl_ms
        return self._now_ms() - config.ttl_ms

    # ---- registration -------------------------------------------------------------------------------------------
    def get_state(self, descriptor: StateDescriptor, namespace: Any = VOID_NAMESPACE, *,
                  namespace_serializer: TypeSerializer | None = None) -> Any:
        """The state ``descriptor`` describes, created on first use (or matched to restored state: kind, TTL and
        serializer compatibility are checked, see ``keygroups.serializers.resolve_compatibility``).

        With a ``namespace`` (e.g. a window), the state is scoped to (key, namespace): a
        ``keygroups.state.namespaced.NamespacedState`` whose current namespace is ``namespace``, stored as a map
        state of the same name (namespace -> value, ``namespace_serializer`` writing the namespaces; needed on the
        first call)."""
        if namespace is not VOID_NAMESPACE:
            if not isinstance(descriptor, StateDescriptor) or not descriptor.kind:
                raise TypeError(f"get_state takes a state descriptor, got {descriptor!r}")
            return namespaced_state(self, descriptor, namespace, namespace_serializer)
        if not isinstance(descriptor, StateDescriptor) or not descriptor.kind:
            raise TypeError(f"get_state takes a ValueStateDescriptor, ListStateDescriptor, MapStateDescriptor, "
                            f"ReducingStateDescriptor or AggregatingStateDescriptor, got {descriptor!r}")
        name = descriptor.name
        known = self._descriptors.get(name)
        if known is not None:
            if known is not descriptor:
                self._check_same(known, descriptor)
            return self._states[name]
        if name in self._externals:   # kept by external states from an earlier batch: the backend keeps it again
            self._release_external(self._externals[name])
        meta = self._state_meta(descriptor)
        restored = self._restored_meta(name)
        write = self._framing(descriptor, descriptor.serializers)
        read = write if restored is None else self._framing(descriptor, self._resolve(descriptor, restored))
        self._register(descriptor, meta, read, write)
        state = self._state_class(descriptor.kind, descriptor.ttl_config is not None)(
            self._store(name), descriptor, self)
        self._descriptors[name] = descriptor
        self._states[name] = state
        self._after_register(name)
        return state

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
        return state_meta(d, self.key_serializer)

    @staticmethod
    def _framing(d: StateDescriptor, serializers: dict[str, TypeSerializer]) -> ValueFraming:
        return ValueFraming.for_state(d.name, d.kind, serializers, ttl=d.ttl_config is not None)

    def _resolve(self, d: StateDescriptor, meta: dict[str, Any]) -> dict[str, TypeSerializer]:
        """Serializers to read the restored bytes of ``d``'s state with; raises when they cannot be used."""
        name = d.name
        if meta["kind"] != d.kind:
            raise StateMigrationError(f"state {name!r} was snapshotted as a {meta['kind']} state and cannot be "
                                      f"restored as a {d.kind} state")
        if (meta.get("ttl") is None) != (d.ttl_config is None):
            had = "with" if meta.get("ttl") is not None else "without"
            raise StateMigrationError(
                f"state {name!r} was snapshotted {had} TTL; it must be registered {had} TTL to restore it "
                "(as in Flink, TTL cannot be switched on or off for existing state)")
        if d.ttl_config is not None:
            stored = stored_time_characteristic(meta["ttl"])
            if stored is not d.ttl_config.time_characteristic:
                raise StateMigrationError(
                    f"state {name!r} was snapshotted with {stored.value} TTL; it cannot be restored with "
                    f"{d.ttl_config.time_characteristic.value} TTL: its stored timestamps are of the other clock. "
                    f"Register it with set_ttl_time_characteristic(TtlTimeCharacteristic.{stored.value}) (the TTL "
                    "duration, update type and visibility may change), or keep the new clock under a new state name")
        read: dict[str, TypeSerializer] = {}
        for role, ser in d.serializers.items():
            stored = meta["serializers"].get(role)
            if stored is None:
                raise StateMigrationError(f"state {name!r}: the snapshot has no {role} serializer")
            _, read[role] = resolve_compatibility(name, stored, ser, allow_pickle=self.allow_pickle, role=role)
        return read

    def _check_key_serializer(self, meta: dict[str, Any]) -> None:
        """StateMigrationError unless this backend's key serializer reads the snapshot's keys as they are."""
        stored = meta["serializers"].get("key")
        if stored is None:
            raise StateMigrationError(f"state {meta['name']!r}: the snapshot has no key serializer")
        resolve_compatibility(meta["name"], stored, self.key_serializer, allow_pickle=self.allow_pickle, role="key")

    def _restored_framing(self, meta: dict[str, Any]) -> ValueFraming:
        """The framing of a restored state nobody registered yet: its own (old) serializers. A stored serializer that
        does not rebuild here (an identifier no module registered, a format this code does not read) is refused
        naming the state and the role, as ``resolve_compatibility`` does for a registered state."""
        sers: dict[str, TypeSerializer] = {}
        for role, s in meta["serializers"].items():
            if role == "key":
                continue
            try:
                sers[role] = SerializerSnapshot.from_json(s).restore_serializer(allow_pickle=self.allow_pickle)
            except (StateMigrationError, UnsafeDeserializationError) as e:
                raise type(e)(f"state {meta['name']!r}: its stored {role} serializer: {e}") from e
        return ValueFraming.for_state(meta["name"], meta["kind"], sers, ttl=meta.get("ttl") is not None)

    @property
    def _chains(self) -> dict[int, ChainStats] | None:
        """Per key group of the range, the chain a restore of the latest snapshot (or of the restore point) reads;
        None until the backend is restored (its first snapshot is then written full). Setting it (a restore, a resume
        that planned the chains) makes the materialization policy look at every chain again; :meth:`_after_snapshot`
        changes it in place and tells the policy which key groups changed."""
        return self._chain_stats

    @_chains.setter
    def _chains(self, chains: dict[int, ChainStats] | None) -> None:
        self._chain_stats = chains
        self._may_be_overdue = None
        self._without_tip = None
        self._tips = None

    # ---- restore ------------------------------------------------------------------------------------------------
    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata, *, lazy: bool = True) -> RestoreStats:
        """Restore this backend's key groups from a checkpoint written at any parallelism: for each key group its
        chain (the newest full block and the deltas after it), and nothing else, is read (one ranged read per run
        of key groups per file) and applied in checkpoint order. With ``lazy`` (the default, heap backend) values
        stay bytes until first accessed, and key groups are decoded when first touched.

        A checkpoint of another max parallelism restores when this backend's is a multiple or a divisor of it: the
        chains of the old key groups this backend's keys come from are read and re-keyed
        (:meth:`_restore_rekeyed`), and the next snapshot is written full. Any other change raises
        ``StateMigrationError`` naming the allowed values.

        Must be called once, before any state is written."""
        if self._restored:
            raise RuntimeError("restore() was already called on this backend; create a new backend to restore again")
        if self._has_data():
            raise RuntimeError("restore() must come before any state is written to the backend")
        check_state_metas(metadata)
        plan = plan_keyed_restore(metadata, self.key_group_range, max_parallelism=self.max_parallelism)
        self._restored = True
        if metadata.max_parallelism != self.max_parallelism:
            total, groups = self._restore_rekeyed(storage, plan)
            # chains and files of the old numbering mean nothing here: the first snapshot starts them anew
            self._chains = {}
            self._chain_metas = {}
            self._needs_full = True
            self._after_restore(lazy)
            return RestoreStats(total, groups)
        self._chains = chain_stats(metadata, self.key_group_range)
        self._chain_metas = {}
        total = 0
        restored: set[int] = set()
        for handle, key_groups in plan:  # key_groups: non-empty, inside this backend's range; chain order
            targets = [self._restore_target(meta) for meta in handle.states]
            nbytes, _ = self._restore_handle(storage, handle, key_groups, targets)
            total += nbytes
            restored.update(key_groups)
            for meta in handle.states:   # the newest meta of each state (the plan checked they agree per chain)
                self._chain_metas[meta["name"]] = _canonical(meta)
            # a file outside shared/ (keyed format 1, written before incremental checkpoints) must not be carried
            # into newer checkpoints: retention would delete it with its checkpoint's directory
            if not is_shared_path(handle.file):
                self._needs_full = True
        self._after_restore(lazy)
        return RestoreStats(total, len(restored))

    def _restore_rekeyed(self, storage: CheckpointStorage, plan: list[tuple[KeyedStateHandle, KeyGroupRange]]
                         ) -> tuple[int, int]:
        """Restore across a max-parallelism change; ``plan`` reads the chains of the old key groups this backend's
        keys come from (``plan_keyed_restore``). Each old key group's chain is merged into its entries (bytes: a
        full block starts it anew, a put replaces a key's value, a delete removes the key), each key is
        deserialized once to find its key group under this backend's max parallelism, the keys of other key groups
        are dropped, and each new key group gets one full block of its entries through :meth:`_restore_block`, as
        any restore feeds a backend. (bytes read, key groups restored).

        StateMigrationError if one state has different metas (serializers, TTL) in the chains of different old key
        groups: their bytes would land in one new key group."""
        metas: dict[str, dict[str, Any]] = {}
        parents: dict[int, dict[str, dict[bytes, bytes]]] = {}   # old key group -> state -> key bytes -> value bytes
        total = 0
        for handle, key_groups in plan:   # chain order
            for meta in handle.states:
                known = metas.setdefault(meta["name"], meta)
                if known is not meta and _canonical(known) != _canonical(meta):
                    raise StateMigrationError(
                        f"state {meta['name']!r} has one meta (serializers, TTL) in some old key groups and another "
                        f"in {handle.file!r}: their entries cannot be merged into the key groups of "
                        f"max_parallelism={self.max_parallelism}. Restore the checkpoint once with its own max "
                        "parallelism and checkpoint it (the snapshot after a migration is written full, with one "
                        "meta), then change the max parallelism")
            names = [meta["name"] for meta in handle.states]
            blocks, nbytes = read_key_group_offsets(storage, handle, key_groups)
            total += nbytes
            for block in blocks:
                entries = parents.setdefault(block.key_group, {})
                if block.full:
                    entries.clear()
                mv = block.block
                for state_index, key_offsets, value_offsets in block.puts:
                    self._check_state_index(handle, block.key_group, state_index, names)
                    if len(key_offsets) != len(value_offsets):
                        raise CorruptSnapshotError(f"{handle.file}: key group {block.key_group}, state {state_index}: "
                                                   f"{len(key_offsets) - 1} keys but {len(value_offsets) - 1} values")
                    ko, vo = key_offsets.tolist(), value_offsets.tolist()
                    state = entries.setdefault(names[state_index], {})
                    for i in range(len(ko) - 1):
                        state[bytes(mv[ko[i]:ko[i + 1]])] = bytes(mv[vo[i]:vo[i + 1]])
                for state_index, key_offsets in block.deletes:
                    self._check_state_index(handle, block.key_group, state_index, names)
                    ko = key_offsets.tolist()
                    state = entries.get(names[state_index], {})
                    for i in range(len(ko) - 1):
                        state.pop(bytes(mv[ko[i]:ko[i + 1]]), None)
        order = list(metas)
        index = {name: i for i, name in enumerate(order)}
        targets = [self._restore_target(metas[name]) for name in order]
        children: dict[int, list[dict[bytes, bytes]]] = {}   # new key group -> per state index, its entries
        for kg in sorted(parents):
            states = parents.pop(kg)
            new_groups = self._key_groups_of({k for state in states.values() for k in state})
            for name, state in states.items():
                i = index[name]
                for key_bytes, value_bytes in state.items():
                    g = new_groups[key_bytes]
                    if g in self.key_group_range:
                        children.setdefault(g, [{} for _ in order])[i][key_bytes] = value_bytes
        newest = plan[-1][0] if plan else None   # named by errors about a block (none expected: it is built here)
        restored = sorted(children)
        for g in restored:
            self._restore_block(newest, targets, _full_block(g, children.pop(g)))
        return total, len(restored)

    def _key_groups_of(self, keys: set[bytes]) -> dict[bytes, int]:
        """Serialized keys -> their key groups under this backend's max parallelism (each key deserialized once,
        hashed as ``set_current_key`` hashes it)."""
        ordered = list(keys)
        if not ordered:
            return {}
        offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in ordered], out=offsets[1:])
        decoded = self.key_serializer.deserialize_many(b"".join(ordered), offsets)
        groups = assign_key_groups(decoded, self.max_parallelism, self.key_type)
        return dict(zip(ordered, groups.tolist()))
    def _restore_handle(self, storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange,
                        targets: list[Any]) -> tuple[int, int]:
        """Read ``key_groups`` of one old file (one ranged read) and hand each block to :meth:`_restore_block`;
        (bytes read, blocks)."""
        blocks, nbytes = read_key_group_offsets(storage, handle, key_groups)
        n = 0
        for block in blocks:
            n += 1
            for state_index, *_ in block.puts:
                self._check_state_index(handle, block.key_group, state_index, targets)
            for state_index, _ in block.deletes:
                self._check_state_index(handle, block.key_group, state_index, targets)
            self._restore_block(handle, targets, route_block(block, targets) if self._externals else block)
        return nbytes, n

    def _restore_block(self, handle: KeyedStateHandle, targets: list[Any], block: KeyGroupBlock) -> None:
        """Apply one block of ``handle`` (sections as int64 offsets into ``block.block``; state indexes checked
        against ``targets``, one per state of the file) on top of what the key group's earlier blocks restored.

        This default feeds put sections to :meth:`_restore_section` as memoryview slices (a put replaces the
        key's value), which is all a full block holds; a backend that restores deletes overrides it."""
        if block.deletes:
            raise NotImplementedError(
                f"{type(self).__name__} cannot apply the deletes of {handle.file!r}'s delta block of key group "
                f"{block.key_group}: override _restore_block")
        mv = block.block
        group_index = block.key_group - self._start
        for state_index, key_offsets, value_offsets in block.puts:
            if len(key_offsets) != len(value_offsets):
                raise CorruptSnapshotError(f"{handle.file}: key group {block.key_group}, state {state_index}: "
                                           f"{len(key_offsets) - 1} keys but {len(value_offsets) - 1} values")
            if len(key_offsets) > 1:
                ko = key_offsets.tolist()
                vo = value_offsets.tolist()
                self._restore_section(targets[state_index], group_index,
                                      [mv[a:b] for a, b in zip(ko, ko[1:])], [mv[a:b] for a, b in zip(vo, vo[1:])])

    @staticmethod
    def _check_state_index(handle: KeyedStateHandle, kg: int, state_index: int, targets: list[Any]) -> None:
        if not 0 <= state_index < len(targets):
            raise CorruptSnapshotError(f"{handle.file}: key group {kg} has a section for state index {state_index}, "
                                       f"but the file has {len(targets)} states")

    def _restore_target(self, meta: dict[str, Any]) -> Any:
        """The table restored entries of ``meta``'s state go to (created for unregistered states)."""
        self._check_key_serializer(meta)
        name = meta["name"]
        bound = self._externals.get(name)
        if bound is not None:
            return check_target_meta(bound, bound.names.index(name), meta)
        d = self._descriptors.get(name)
        if d is not None:
            return self._adopt_restored(name, meta, self._framing(d, self._resolve(d, meta)))
        return self._adopt_restored(name, meta, None)

    # ---- hooks --------------------------------------------------------------------------------------------------
    def _has_data(self) -> bool:
        raise NotImplementedError

    def _after_register(self, name: str) -> None:
        """State ``name`` is registered (its descriptor known): work that may restore again goes here, not in
        ``_register``."""

    def estimated_entries(self) -> int | None:
        """About how many entries the backend's keyed state holds, found without reading them (None: this backend
        cannot tell cheaply)."""
        return None

    def has_state(self, name: str) -> bool:
        """Whether state ``name`` is registered or was restored (and not yet registered)."""
        return name in self._tables or name in self._externals

    def _restored_meta(self, name: str) -> dict[str, Any] | None:
        t = self._tables.get(name)
        return t.meta if t is not None and t.descriptor is None else None

    def _new_table(self, name: str, meta: dict[str, Any], read: ValueFraming, write: ValueFraming,
                   d: StateDescriptor | None) -> Any:
        """Create and register the backend's table for state ``name`` (``d`` is None for restored, unregistered
        state); stored bytes are decoded with ``read`` and written with ``write``."""
        raise NotImplementedError

    def _register(self, d: StateDescriptor, meta: dict[str, Any], read: ValueFraming, write: ValueFraming) -> None:
        raise NotImplementedError

    def _store(self, name: str) -> Any:
        raise NotImplementedError

    def _adopt_restored(self, name: str, meta: dict[str, Any], read: ValueFraming | None) -> Any:
        """The table restored entries of state ``name`` go into: the registered one (reading with ``read``), or a
        new table that keeps the stored meta until the state is registered."""
        t = self._tables.get(name)
        if t is not None and t.descriptor is not None:
            assert read is not None
            t.configure(t.meta, read, t.write_framing, t.descriptor)
            return t
        if t is None:
            framing = self._restored_framing(meta)
            return self._new_table(name, meta, framing, framing, None)
        if t.meta["kind"] != meta["kind"]:
            raise CorruptSnapshotError(f"state {name!r} is a {t.meta['kind']} state in one restored file and a "
                                       f"{meta['kind']} state in another")
        return t

    def _restore_section(self, target: Any, group_index: int, keys: list[Any], values: list[Any]) -> None:
        raise NotImplementedError

    def _after_restore(self, lazy: bool) -> None:
        pass

    def keys(self, state_name: str) -> Iterator[Any]:
        raise NotImplementedError

    def map_keys(self, state_name: str) -> Iterator[tuple[int, Any, list[Any]]]:
        """Every key of the registered map state ``state_name`` as (key group, key, its map's keys), key group by key
        group: one pass for what indexes a map state (the timer queues). Sets the current key as it goes."""
        state = self._states.get(state_name)
        if state is None:
            raise KeyError(f"map state {state_name!r} is not registered; registered: {sorted(self._states)}")
        for key in list(self.keys(state_name)):
            self.set_current_key(key)
            yield self.current_key_group, key, state.keys()

    def _write_snapshot(self, checkpoint_id: int, storage: CheckpointStorage, states: list[dict[str, Any]],
                        key_groups: Iterable[tuple[int, Iterable[tuple[int, Any, Any]]]],
                        future: SnapshotFuture[KeyedStateHandle]) -> KeyedStateHandle:
        """Write a captured view (``key_groups`` from the subclass, ascending) as this subtask's keyed snapshot
        file, stopping between key groups once ``future`` is cancelled (before the file is created if it already
        is)."""
        check_cancel(future)
        return write_keyed_snapshot(storage, checkpoint_id, self.subtask_index, self.key_group_range, states,
                                    key_groups, on_key_group=functools.partial(check_cancel, future),
                                    predecessors=self._chain_tips())

    # ---- external states (keygroups.state.external) ----------------------------------------------------------------
    #: Whether :meth:`bind_external_states` hands states to an external object: the backend then calls the hooks
    #: below where its snapshot, warm resume and table code meet them. The generic answer is no.
    _supports_external_states = False

    def bind_external_states(self, descriptors: Sequence[StateDescriptor],
                             make: Callable[[KeyedStateBackendBase], ExternalStates]) -> ExternalStates | None:
        """Keep the states of ``descriptors`` in the object ``make(self)`` builds (see
        :mod:`keygroups.state.external`), registered as :meth:`get_state` registers them (restored state is checked
        and migrated first, then handed over as bytes); ``get_state`` of them afterwards gives state objects on the
        external object's stores. A backend kept across batches keeps the binding: the next batch's call with
        descriptors of the same metas finds the same object (nothing is handed over again); other metas hand its
        entries back first.

        Returns None (the generic answer) when this backend keeps the states itself: register them with
        :meth:`get_state` and read and write them through the state objects (:meth:`get_values`,
        :meth:`put_values` do it for many keys)."""
        if not self._supports_external_states:
            return None
        names = tuple(d.name for d in descriptors)
        if len(set(names)) != len(names):
            raise ValueError(f"bind_external_states: state names repeat: {names}")
        bound = list({id(s): s for n in names if (s := self._externals.get(n)) is not None}.values())
        if (len(bound) == 1 and bound[0].names == names
                and [_canonical(m) for m in bound[0].metas()] == [_canonical(self._state_meta(d)) for d in descriptors]):
            self._register_external(bound[0], descriptors)
            return bound[0]
        for states in bound:
            self._release_external(states)
        for d in descriptors:
            self.get_state(d)   # checked against restored state, migrated, as any registration
        states = make(self)
        if tuple(states.names) != names:
            raise ValueError(f"bind_external_states: the external states hold {states.names}, not {names}")
        for position, d in enumerate(descriptors):
            for kg, keys, values in self._export_entries(d.name):
                states.load(kg, False, [(position, items(keys), items(values))], [])
        self._register_external(states, descriptors)
        return states

    def get_values(self, name: str, keys: Sequence[Any]) -> list[Any]:
        """The value of registered value state ``name`` for each of ``keys`` (None where it has none), read as
        ``value()`` reads it one key at a time: TTL is checked and refreshed the same way. Leaves the last key
        current. The generic form, for states a backend keeps itself."""
        state = self._states[name]
        set_key = self.set_current_key
        out = []
        for key in keys:
            set_key(key)
            out.append(state.value())   # type: ignore[attr-defined]
        return out

    def put_values(self, name: str, keys: Sequence[Any], values: Sequence[Any]) -> None:
        """Set registered value state ``name`` of each of ``keys`` to the matching value (None clears it), as
        ``update()`` does one key at a time. Leaves the last key current."""
        if len(keys) != len(values):
            raise ValueError(f"put_values: {len(keys)} keys but {len(values)} values")
        state = self._states[name]
        set_key = self.set_current_key
        for key, value in zip(keys, values):
            set_key(key)
            state.update(value)   # type: ignore[attr-defined]

    def _register_external(self, states: ExternalStates, descriptors: Sequence[StateDescriptor]) -> None:
        for d in descriptors:
            self._drop_table(d.name)
            self._externals[d.name] = states
            self._descriptors[d.name] = d
            self._states[d.name] = checked_state_class(d.kind, STATE_CLASSES[(d.kind, d.ttl_config is not None)])(
                states.store(d.name), d, self)

    def _release_external(self, states: ExternalStates) -> None:
        """Take ``states``' entries back into the backend, as restored state nobody registered yet."""
        for name in states.names:
            self._externals.pop(name, None)
            self._descriptors.pop(name, None)
            self._states.pop(name, None)
        if states.changed():
            self._needs_full = True   # changes no confirmed snapshot holds: the next snapshot writes them
        targets = [self._restore_target(meta) for meta in states.metas()]
        for kg, puts in states.release():
            self._restore_block(None, targets, external_block(kg, puts))   # type: ignore[arg-type]

    def _bound_externals(self) -> list[ExternalStates]:
        return list({id(s): s for s in self._externals.values()}.values())

    def _external_metas(self) -> list[tuple[str, dict[str, Any]]]:
        return [(m["name"], m) for s in self._bound_externals() for m in s.metas()]

    def _capture_externals(self, checkpoint_id: int, full_key_groups: Iterable[int], offset: int) -> ExternalCapture:
        """The external states' part of a snapshot (call in its synchronous part): their metas follow the
        backend's ``offset`` own, their sections merge into its key groups (``ExternalCapture.merge``)."""
        return ExternalCapture(self._bound_externals(), checkpoint_id, frozenset(full_key_groups), offset)

    def _externals_changed(self) -> bool:
        return any(s.changed() for s in self._bound_externals())

    def _external_meta_differs(self, meta: dict[str, Any]) -> bool:
        """Whether a block's ``meta`` is of a state bound to external states that hold it with another meta."""
        states = self._externals.get(meta["name"])
        return states is not None and _canonical(states.metas()[states.names.index(meta["name"])]) != _canonical(meta)

    def _clear_externals(self, key_groups: Iterable[int]) -> None:
        groups = list(key_groups)
        for states in self._bound_externals():
            states.clear(groups)

    def _move_externals(self) -> None:
        for states in self._bound_externals():
            states.move(self.key_group_range)

    def _external_entries(self) -> int:
        return sum(s.entries() for s in self._bound_externals())

    def _externals_have_data(self) -> bool:
        return any(s.has_data() for s in self._bound_externals())

    def _export_entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """State ``name``'s entries per key group (ascending) as ``(key group, keys, values)``, bytes in its write
        framing (lists of bytes or ``Packed``): what external states take over. Backends that support them."""
        raise NotImplementedError

    def _drop_table(self, name: str) -> None:
        """Forget the backend's own table of state ``name`` (external states hold it now)."""
        self._tables.pop(name, None)

    # ---- incremental snapshots: which key groups are written full -----------------------------------------------
    def _full_key_groups_for_snapshot(self) -> set[int]:
        """The key groups (absolute) the next snapshot writes full (:meth:`_full_key_groups_parts`, joined)."""
        required, compactions = self._full_key_groups_parts()
        return required | compactions

    def _full_key_groups_parts(self) -> tuple[set[int], set[int]]:
        """``(required, compactions)``: the key groups (absolute) the next snapshot must write full, and the chain
        compactions it writes full besides; the others are written as deltas (the entries written and deleted since
        the previous snapshot). Required: those without a chain (no block in the checkpoint restored, as after
        restoring a savepoint without their files), so every chain starts full, and those whose chain ends with a
        block of a keyed format before 4 (restored from a checkpoint of an earlier keygroups: a delta names the
        block it applies on by its checksum, which such a block does not carry); all of them when snapshots are not
        incremental, on a backend that was not restored, after a restore from files of before incremental
        checkpoints, or when a state's meta (serializers, TTL) differs from the one its chains were written with (a
        migrated serializer: the blocks of one chain are applied to one another as bytes). Compactions: the key
        groups whose chain is longer than ``max_chain`` or whose deltas exceed ``delta_fraction`` of their full
        block, the worst first, at most an eighth of them (``choose_full_key_groups``)."""
        r = self.key_group_range
        everything = set(range(r.start, r.end + 1))
        if not self.incremental or self._chains is None or self._needs_full:
            return everything, set()
        tables: dict[str, Any] = getattr(self, "_tables", {})
        for name, meta in [*((n, t.meta) for n, t in tables.items()), *self._external_metas()]:
            known = self._chain_metas.get(name)
            if known is not None and _canonical(meta) != known:
                return everything, set()
        # a key group without a chain (no block in the checkpoint restored) is written full: a delta needs a base,
        # and one it can name
        chains = self._chains
        if self._without_tip is None:
            self._without_tip = {kg for kg, c in chains.items() if c.tip is None}
        # the chains past their bounds: among all of them, or among those that were or changed since (a chain's
        # score depends on its stats alone)
        looked_at = chains if self._may_be_overdue is None else {
            kg: chains[kg] for kg in self._may_be_overdue if kg in chains}
        overdue = choose_full_key_groups(looked_at, math.ceil(len(looked_at) / MAX_MATERIALIZED_SHARE),
                                         max_chain=self.max_chain, delta_fraction=self.delta_fraction)
        self._may_be_overdue = overdue
        compactions = choose_full_key_groups({kg: chains[kg] for kg in overdue}, self._n, max_chain=self.max_chain,
                                             delta_fraction=self.delta_fraction)
        return (everything - chains.keys()) | self._without_tip, compactions

    def _chain_tips(self) -> dict[int, BlockLink]:
        """Each key group's newest block, as the next snapshot's delta of it names it (``write_keyed_snapshot``'s
        ``predecessors``). Snapshots run one at a time on the snapshot worker, each calling :meth:`_after_snapshot`
        before the next starts: called from a snapshot's work, this is the chain that snapshot continues."""
        if self._tips is None:
            self._tips = {kg: c.tip for kg, c in (self._chains or {}).items() if c.tip is not None}
        return dict(self._tips)

    def _after_snapshot(self, handle: KeyedStateHandle) -> None:
        """Record what a snapshot of this backend wrote (``handle``, once its file is complete), so the next one
        continues its chains: a full block starts a key group's chain anew, a non-empty delta lengthens it.

        A handle whose writer named no predecessors for its deltas (a backend that does not give
        ``write_keyed_snapshot`` its :meth:`_chain_tips`) gets them here, from this backend's chains, so that the
        checkpoint still checks its chains from the metadata (its blocks then name none themselves)."""
        self._name_predecessors(handle)
        if self._chains is None:
            self._chains = {}
        chains = self._chains   # changed in place: the policy is told what changed
        own = self.key_group_range
        # only the key groups whose block is full or a non-empty delta: a quiet block leaves its chain as it is
        full, deltas = _changed_in(handle, own)
        overdue, without_tip, tips = self._may_be_overdue, self._without_tip, self._tips
        for kg in (*full, *deltas):
            c = chains[kg] = chains.get(kg, NO_CHAIN).after(handle, kg)
            if overdue is not None:
                overdue.add(kg)
            if c.tip is None:
                if without_tip is not None:
                    without_tip.add(kg)
                if tips is not None:
                    tips.pop(kg, None)
            else:
                if without_tip is not None:
                    without_tip.discard(kg)
                if tips is not None:
                    tips[kg] = c.tip
        for states in self._bound_externals():
            states.confirm(handle.checkpoint_id)
        metas = dict(zip((meta["name"] for meta in handle.states), _canonical_states(handle)))
        if len(full) == len(own):   # every key group of the range written full
            self._chain_metas = metas
            self._needs_full = False
        else:
            self._chain_metas.update(metas)


    def _name_predecessors(self, handle: KeyedStateHandle) -> None:
        if handle.format_version < 4 or handle.checksums is None or not handle.key_group_range:
            return
        r = handle.key_group_range
        links = BlockLinks.of(handle.predecessors or {}, r)
        unnamed = links.checkpoints < 0
        for unlinked in list(handle.full_key_groups) + list(handle.fresh_key_groups or []):
            unnamed[unlinked.start - r.start:unlinked.end - r.start + 1] = False
        if not unnamed.any():
            return   # the writer named them all
        tips = self._chain_tips()
        checkpoints, checksums = links.checkpoints.copy(), links.checksums.copy()
        for i in np.flatnonzero(unnamed).tolist():
            tip = tips.get(r.start + i)
            if tip is not None:
                checkpoints[i], checksums[i] = tip
        handle.predecessors = BlockLinks(r.start, checkpoints, checksums)
        handle._check_chain_fields()


def _full_block(key_group: int, states: list[dict[bytes, bytes]]) -> KeyGroupBlock:
    """A full block of ``key_group`` built from its entries (``states[i]``: state ``i``'s serialized keys -> values),
    as a restore reads blocks: keys back to back then values back to back per state, keys sorted by their bytes,
    sections as int64 offsets into one buffer. Values stay the opaque bytes they were."""
    parts: list[bytes] = []
    puts = []
    pos = 0
    for state_index, entries in enumerate(states):
        if not entries:
            continue
        keys = sorted(entries)
        values = [entries[k] for k in keys]
        sections = []
        for items in (keys, values):
            offsets = np.empty(len(items) + 1, dtype=np.int64)
            offsets[0] = pos
            np.cumsum([len(x) for x in items], out=offsets[1:])
            offsets[1:] += pos
            pos = int(offsets[-1])
            parts.extend(items)
            sections.append(offsets)
        puts.append((state_index, sections[0], sections[1]))
    return KeyGroupBlock(key_group, True, True, memoryview(b"".join(parts)), puts, [])


def _canonical(meta: dict[str, Any]) -> str:
    """A state meta as canonical JSON, so metas compare equal whether they come from a file or were just built."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def _canonical_states(handle: KeyedStateHandle) -> list[str]:
    """``handle.states`` as :func:`_canonical` gives them, worked out once per handle (a handle is never changed once
    written, and one object serves every checkpoint that lists it: a warm backend reads its chains' metas each
    batch)."""
    cached = handle.__dict__.get("_canonical_states")
    if cached is None:
        cached = handle.__dict__["_canonical_states"] = [_canonical(meta) for meta in handle.states]
    return cached


def _changed_in(handle: KeyedStateHandle, own: KeyGroupRange) -> tuple[list[int], list[int]]:
    """``(full, deltas)``: the key groups of ``own`` whose block in ``handle`` is full, and those whose block is a
    non-empty delta, each ascending (from the handle's :meth:`~KeyedStateHandle.changed_key_groups`, no loop over
    the range)."""
    part = handle.key_group_range.intersection(own)
    if not part:
        return [], []
    full, deltas = handle.changed_key_groups()
    return (full[bisect.bisect_left(full, part.start):bisect.bisect_right(full, part.end)],
            deltas[bisect.bisect_left(deltas, part.start):bisect.bisect_right(deltas, part.end)])


def _committed_chains(metadata: CheckpointMetadata, own: KeyGroupRange) -> dict[int, list[KeyedStateHandle]]:
    """Each key group of ``own`` that ``metadata`` holds -> the handles of its chain (its newest full block, then the
    non-empty deltas after it, oldest first)."""
    return key_group_chains(keyed_handles_by_range(list(metadata.keyed_handles)), own)


def _files_of_chains(chains: dict[int, list[KeyedStateHandle]]) -> dict[int, tuple[str, ...]]:
    """Key group -> the files of its chain, oldest first (what a backend's ``_chain_files`` holds)."""
    return {kg: tuple(h.file for h in chain) for kg, chain in chains.items()}


def _extend_chain_files(files: dict[int, tuple[str, ...]], handle: KeyedStateHandle,
                        own: KeyGroupRange, uses: dict[str, int] | None = None) -> None:
    """``files`` (key group -> the files of its chain, oldest first) after ``handle``, for the key groups of ``own``:
    a full block starts a chain anew, a delta that changes a key group lengthens it, a quiet one leaves it. With
    ``uses`` (file -> how many chains of ``files`` hold it, as :func:`_file_uses` counts them), kept counting; a
    file no chain holds any more leaves it."""
    full, deltas = _changed_in(handle, own)
    new = handle.file
    for kg in full:
        if uses is not None:
            for f in files.get(kg, ()):
                _count(uses, f, -1)
        files[kg] = (new,)
    for kg in deltas:
        files[kg] = files.get(kg, ()) + (new,)
    if uses is not None and (full or deltas):
        _count(uses, new, len(full) + len(deltas))


def _file_uses(files: dict[int, tuple[str, ...]]) -> dict[str, int]:
    """File -> how many chains of ``files`` (key group -> the files of its chain) hold it."""
    uses: dict[str, int] = {}
    for chain in files.values():
        for f in chain:
            uses[f] = uses.get(f, 0) + 1
    return uses


def _count(uses: dict[str, int], file: str, by: int) -> None:
    left = uses.get(file, 0) + by
    if left:
        uses[file] = left
    else:
        uses.pop(file, None)


__all__ = ["VOID_NAMESPACE", "RestoreStats", "SnapshotFuture", "KeyedStateBackendBase", "state_meta"]
