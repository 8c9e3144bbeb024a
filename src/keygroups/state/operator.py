"""Operator state (FLIP-8): non-keyed, per-subtask state that survives a change of parallelism.

A subtask keeps its operator state as *lists of elements*; the lists are the unit of redistribution. Three
:class:`~keygroups.checkpoint.DistributionMode` values, as in Flink's ``OperatorStateHandle.Mode``:

* ``SPLIT_DISTRIBUTE`` (:meth:`OperatorStateStore.get_list_state`): on restore the concatenation of all old
  subtasks' lists is split evenly over the new subtasks (sizes differ by at most one; which subtasks get the extra
  element rotates from one state to the next, as Flink's ``RoundRobinOperatorStateRepartitioner`` does).
* ``UNION`` (:meth:`OperatorStateStore.get_union_list_state`): every new subtask gets every element.
* ``BROADCAST`` (:meth:`OperatorStateStore.get_broadcast_state`): a map that is the same on every subtask; each new
  subtask restores one full copy.

This module holds what a function sees: the store and the two state classes. The rest lives beside the keyed
state's equivalents in ``keygroups.checkpoint``: the handle (``metadata.OperatorStateHandle``), restore planning
(``planning.plan_operator_restore``) and the file reader and writer (``operator_format``). A restored share stays
serialized until its state is registered; it is then deserialized with the serializer that compatibility
resolution picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keygroups._native import splitter
from keygroups._native.statecore import java_key, java_keys, java_map
from keygroups.checkpoint.metadata import (
    DEFAULT_OPERATOR_ID,
    CheckpointMetadata,
    DistributionMode,
    OperatorStateHandle,
    OperatorStateMeta,
)
from keygroups.checkpoint.operator_format import (
    OperatorRestoreStats,
    RestoredList,
    SerializedState,
    read_operator_runs,
    write_operator_snapshot,
)
from keygroups.checkpoint.planning import plan_operator_restore
from keygroups.checkpoint.storage import CheckpointStorage
from keygroups.errors import StateMigrationError, StateSerializationError
from keygroups.serializers import SerializerSnapshot, TypeSerializer, resolve_compatibility
from keygroups.state._base import SnapshotFuture
from keygroups.state._codec import UNWRITABLE

__all__ = [
    "OperatorStateStore",
    "OperatorListState",
    "BroadcastState",
]


class OperatorListState:
    """A list of elements kept per subtask (split-distribute or union, by how it was registered).

    Same methods as Flink's ``ListState``: :meth:`get`, :meth:`add`, :meth:`add_all`, :meth:`update`,
    :meth:`clear`. Elements are Python objects between checkpoints; a snapshot serializes them.
    """

    def __init__(self, name: str, mode: DistributionMode, serializer: TypeSerializer,
                 elements: list | None = None) -> None:
        self.name = name
        self.mode = mode
        self.serializer = serializer
        self._elements: list = elements if elements is not None else []

    def get(self) -> list:
        """The elements, in order (a new list: changing it does not change the state)."""
        return list(self._elements)

    def add(self, value: Any) -> None:
        self._elements.append(value)

    def add_all(self, values: Iterable[Any]) -> None:
        self._elements.extend(values)

    def update(self, values: Iterable[Any]) -> None:
        """Replace all elements."""
        self._elements = list(values)

    def clear(self) -> None:
        self._elements = []

    def __len__(self) -> int:
        return len(self._elements)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._elements))

    def __repr__(self) -> str:
        return f"OperatorListState({self.name!r}, {self.mode}, {len(self._elements)} elements)"


class BroadcastState:
    """A map that is the same on every subtask (Flink's ``BroadcastState``); each restored subtask gets a copy."""

    mode = DistributionMode.BROADCAST

    def __init__(self, name: str, key_serializer: TypeSerializer, value_serializer: TypeSerializer,
                 entries: dict | None = None) -> None:
        self.name = name
        self.key_serializer = key_serializer
        self.value_serializer = value_serializer
        # keys compare as Java's equals (one NaN entry, 0.0 and -0.0 apart), as in keyed MapState
        self._map: dict = java_map(entries) if entries is not None else {}

    def get(self, key: Any, default: Any = None) -> Any:
        return self._map.get(java_key(key), default)

    def put(self, key: Any, value: Any) -> None:
        self._map[java_key(key)] = value

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        self._map.update(java_map(entries))

    def remove(self, key: Any) -> None:
        self._map.pop(java_key(key), None)

    def contains(self, key: Any) -> bool:
        return java_key(key) in self._map

    def keys(self) -> list:
        return list(self._map.keys())

    def values(self) -> list:
        return list(self._map.values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._map.items())

    def is_empty(self) -> bool:
        return not self._map

    def clear(self) -> None:
        self._map = {}

    def __contains__(self, key: Any) -> bool:
        return java_key(key) in self._map

    def __len__(self) -> int:
        return len(self._map)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._map))

    def __repr__(self) -> str:
        return f"BroadcastState({self.name!r}, {len(self._map)} entries)"


# --------------------------------------------------------------------------------------------------------------
# The store.


def _descriptor(descriptor: Any, kind: str, method: str, roles: tuple[str, ...]) -> tuple[str, list]:
    """The name and the serializers (by role) of a ``keygroups.state`` descriptor of the given kind."""
    name = getattr(descriptor, "name", None)
    serializers = getattr(descriptor, "serializers", None)
    if getattr(descriptor, "kind", None) != kind or not isinstance(name, str) or not isinstance(serializers, dict):
        wanted = "ListStateDescriptor" if kind == "list" else "MapStateDescriptor"
        raise TypeError(f"{method} takes a keygroups.state.{wanted}, got {descriptor!r}")
    if getattr(descriptor, "ttl_config", None) is not None:
        raise ValueError(f"operator state {name!r}: time-to-live applies to keyed state only (as in Flink); "
                         "register the descriptor without enable_time_to_live")
    return name, [serializers[role] for role in roles]


def _snapshot_json(serializer: TypeSerializer) -> dict:
    return serializer.snapshot().to_json()


@dataclass
class _Registration:
    mode: DistributionMode
    serializers: dict[str, dict]          # role -> serializer snapshot JSON
    state: OperatorListState | BroadcastState = field(repr=False)


class OperatorStateStore:
    """The operator state of one subtask: named list, union list and broadcast states, snapshot and restore.

    Restore first (:meth:`restore`, when resuming), then register states (``get_*``): a registered state that was
    restored starts with this subtask's share of the old elements, deserialized with the serializer that
    compatibility resolution picks for the registered one. :meth:`snapshot` captures every registered state
    synchronously and writes the file in the background.
    """

    def __init__(self, subtask_index: int, parallelism: int, *, allow_pickle: bool = False,
                 operator_id: str = DEFAULT_OPERATOR_ID) -> None:
        if not isinstance(parallelism, int) or parallelism < 1:
            raise ValueError(f"parallelism must be an int >= 1, got {parallelism!r}")
        if not isinstance(subtask_index, int) or not 0 <= subtask_index < parallelism:
            raise ValueError(f"subtask_index must be an int in [0, {parallelism - 1}], got {subtask_index!r}")
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.allow_pickle = allow_pickle
        self.operator_id = operator_id
        self._registered: dict[str, _Registration] = {}
        self._restored: dict[str, RestoredList] = {}
        self.restored_checkpoint_id: int | None = None

    # -- restore -----------------------------------------------------------------------------------------------

    @property
    def is_restored(self) -> bool:
        return self.restored_checkpoint_id is not None

    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata) -> OperatorRestoreStats:
        """Take this subtask's share of the operator state in ``metadata`` (any old parallelism).

        Reads only the checksum blocks that hold this subtask's elements; raises CorruptSnapshotError when a file
        is truncated, fails a checksum or disagrees with its handle.
        """
        if self._registered or self.is_restored:
            raise ValueError("restore() must come first, once, before any state is registered")
        handles = metadata.operator_handles
        plan = plan_operator_restore(handles, self.parallelism, operator_id=self.operator_id)
        self._restored, stats = read_operator_runs(storage, handles, plan[self.subtask_index])
        self.restored_checkpoint_id = int(metadata.checkpoint_id)
        return stats

    def _take_restored(self, name: str, mode: DistributionMode) -> RestoredList | None:
        restored = self._restored.pop(name, None)
        if restored is not None and restored.mode != mode:
            self._restored[name] = restored
            raise StateMigrationError(f"operator state {name!r} was checkpointed as {restored.mode} and is now "
                                      f"registered as {mode}; register it with the same kind of state")
        return restored

    def _read_serializer(self, name: str, meta: OperatorStateMeta, role_key: str, new: TypeSerializer,
                         role: str) -> TypeSerializer:
        old = SerializerSnapshot.from_json(meta.serializers[role_key])
        _, read_with = resolve_compatibility(name, old, new, allow_pickle=self.allow_pickle, role=role)
        return read_with

    # -- registration ------------------------------------------------------------------------------------------

    def _existing(self, name: str, mode: DistributionMode, serializers: dict[str, dict]) -> Any:
        reg = self._registered.get(name)
        if reg is None:
            return None
        if reg.mode != mode or reg.serializers != serializers:
            raise StateMigrationError(
                f"operator state {name!r} is already registered as {reg.mode} with serializers {reg.serializers}; "
                f"it cannot be registered again as {mode} with {serializers}")
        return reg.state

    def _get_list(self, descriptor: Any, mode: DistributionMode) -> OperatorListState:
        method = "get_list_state" if mode is DistributionMode.SPLIT_DISTRIBUTE else "get_union_list_state"
        name, (serializer,) = _descriptor(descriptor, "list", method, ("element",))
        snapshots = {"serializer": _snapshot_json(serializer)}
        existing = self._existing(name, mode, snapshots)
        if existing is not None:
            return existing
        elements: list = []
        restored = self._take_restored(name, mode)
        if restored is not None:
            read_with = self._read_serializer(name, restored.meta, "serializer", serializer, "list element")
            for buf, offsets in restored.relative():
                elements.extend(read_with.deserialize_many(buf, offsets))
        state = OperatorListState(name, mode, serializer, elements)
        self._registered[name] = _Registration(mode, snapshots, state)
        return state

    def get_list_state(self, descriptor: Any) -> OperatorListState:
        """A split-distribute list state: on restore, this subtask gets an even share of all old elements."""
        return self._get_list(descriptor, DistributionMode.SPLIT_DISTRIBUTE)

    def get_union_list_state(self, descriptor: Any) -> OperatorListState:
        """A union list state: on restore, every subtask gets all old subtasks' elements."""
        return self._get_list(descriptor, DistributionMode.UNION)

    def get_broadcast_state(self, descriptor: Any) -> BroadcastState:
        """A broadcast map state: the same map on every subtask; on restore each subtask gets a full copy."""
        name, (key_ser, value_ser) = _descriptor(descriptor, "map", "get_broadcast_state", ("map key", "map value"))
        snapshots = {"key_serializer": _snapshot_json(key_ser), "value_serializer": _snapshot_json(value_ser)}
        existing = self._existing(name, DistributionMode.BROADCAST, snapshots)
        if existing is not None:
            return existing
        entries: dict = {}
        restored = self._take_restored(name, DistributionMode.BROADCAST)
        if restored is not None:
            k_read = self._read_serializer(name, restored.meta, "key_serializer", key_ser, "map key")
            v_read = self._read_serializer(name, restored.meta, "value_serializer", value_ser, "map value")
            for buf, offsets in restored.relative():
                kd, ko, vd, vo = splitter.decode_entries(buf, offsets)
                entries.update(zip(java_keys(k_read.deserialize_many(kd, ko)), v_read.deserialize_many(vd, vo)))
        state = BroadcastState(name, key_ser, value_ser, entries)
        self._registered[name] = _Registration(DistributionMode.BROADCAST, snapshots, state)
        return state

    @property
    def registered_state_names(self) -> list[str]:
        return sorted(self._registered)

    def restored_share(self, name: str) -> RestoredList | None:
        """The still-serialized share of a restored state that is not registered yet (None otherwise): for tools
        that move state without decoding it."""
        return self._restored.get(name)

    @property
    def restored_state_names(self) -> list[str]:
        """States restored but not registered (yet): they are dropped by the next snapshot, as in Flink."""
        return sorted(self._restored)

    # -- snapshot ----------------------------------------------------------------------------------------------

    def _capture(self) -> list[SerializedState]:
        captured = []
        for name in sorted(self._registered):
            reg = self._registered[name]
            st = reg.state
            try:
                if isinstance(st, BroadcastState):
                    keys, values = list(st._map.keys()), list(st._map.values())
                    kd, ko = st.key_serializer.serialize_many(keys)
                    vd, vo = st.value_serializer.serialize_many(values)
                    data, offsets = splitter.encode_entries(kd, np.ascontiguousarray(ko, dtype=np.int64),
                                                            vd, np.ascontiguousarray(vo, dtype=np.int64))
                else:
                    data, offsets = st.serializer.serialize_many(st._elements)
                    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
            except UNWRITABLE as e:
                kind = {DistributionMode.SPLIT_DISTRIBUTE: "list", DistributionMode.UNION: "union list"}.get(
                    reg.mode, "broadcast")
                sers = (f"{st.key_serializer!r} -> {st.value_serializer!r}" if isinstance(st, BroadcastState)
                        else repr(st.serializer))
                raise StateSerializationError(
                    f"operator state {name!r} ({kind} state, serializer {sers}) cannot be written: {e}. The "
                    "snapshot fails and nothing is committed; store values the serializer accepts, or register the "
                    "state with one that fits them") from e
            captured.append(SerializedState(name, reg.mode, reg.serializers, data, offsets))
        return captured

    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> SnapshotFuture:
        """Capture all registered states now (serialized: later changes do not leak in); write the file in the
        background. The future's result is this subtask's :class:`~keygroups.checkpoint.OperatorStateHandle`."""
        captured = self._capture()
        relpath = storage.new_file(checkpoint_id, f"operator-{self.subtask_index}")

        def work(fut: SnapshotFuture) -> OperatorStateHandle:
            return write_operator_snapshot(storage, relpath, captured, subtask=self.subtask_index,
                                           operator_id=self.operator_id)

        return SnapshotFuture.start(work, name=f"operator-{self.subtask_index} chk-{checkpoint_id}")
