"""Checkpointed user functions (FLIP-8): ``CheckpointedFunction``, ``ListCheckpointed`` and the glue that drives
them against an :class:`~keygroups.state.operator.OperatorStateStore`.

A runner calls :func:`initialize_function` once when a subtask starts (after restoring the store, if resuming) and
:func:`snapshot_function` at every checkpoint, then takes the store's snapshot. A function implementing neither
interface is left alone.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from keygroups.checkpoint import CheckpointStorage
from keygroups.serializers import TypeSerializer, ValueSerializer
from keygroups.state._base import SnapshotFuture
from keygroups.state.descriptors import ListStateDescriptor
from keygroups.state.operator import OperatorStateStore

__all__ = [
    "FunctionSnapshotContext",
    "FunctionInitializationContext",
    "CheckpointedFunction",
    "ListCheckpointed",
    "LIST_CHECKPOINTED_STATE_NAME",
    "initialize_function",
    "snapshot_function",
    "checkpoint_function",
]

# Flink keeps ListCheckpointed state under DefaultOperatorStateBackend.DEFAULT_OPERATOR_STATE_NAME.
LIST_CHECKPOINTED_STATE_NAME = "_default_"


@dataclass(frozen=True)
class FunctionSnapshotContext:
    """What a function knows when asked for its state: the checkpoint's id and its timestamp in milliseconds since
    the epoch (the name ``CheckpointMetadata.timestamp_ms`` uses)."""

    checkpoint_id: int
    timestamp_ms: int


@dataclass(frozen=True)
class FunctionInitializationContext:
    """What a function gets when it starts: whether (and from which checkpoint) it resumes, and the stores to
    register its operator state and (on a keyed stream) keyed state in."""

    is_restored: bool
    restored_checkpoint_id: int | None
    operator_state_store: OperatorStateStore
    keyed_state_store: Any = None


class CheckpointedFunction(abc.ABC):
    """A function with operator (and possibly keyed) state, in full control of it (Flink's
    ``CheckpointedFunction``): it registers states in :meth:`initialize_state` and brings them up to date in
    :meth:`snapshot_state`, which runs just before the store is snapshotted."""

    @abc.abstractmethod
    def snapshot_state(self, context: FunctionSnapshotContext) -> None:
        """Write whatever the function holds outside its states into them."""

    @abc.abstractmethod
    def initialize_state(self, context: FunctionInitializationContext) -> None:
        """Register states; when ``context.is_restored``, read this subtask's share back."""


class ListCheckpointed(abc.ABC):
    """A function whose state is one list, redistributed split-wise on rescale (Flink's ``ListCheckpointed``).

    Elements are serialized with :meth:`state_serializer` (``ValueSerializer()`` by default: JSON-like values).
    """

    @abc.abstractmethod
    def snapshot_state(self, checkpoint_id: int, timestamp_ms: int) -> list:
        """The elements to checkpoint."""

    @abc.abstractmethod
    def restore_state(self, state: list) -> None:
        """Called on restore only, with this subtask's share of the elements (possibly empty)."""

    def state_serializer(self) -> TypeSerializer:
        return ValueSerializer()


def _kind(function: Any) -> str | None:
    checkpointed = isinstance(function, CheckpointedFunction)
    listed = isinstance(function, ListCheckpointed)
    if checkpointed and listed:
        raise TypeError(f"{type(function).__name__} implements both CheckpointedFunction and ListCheckpointed; "
                        "a function may implement only one of them")
    return "checkpointed" if checkpointed else "list" if listed else None


def _list_state(function: ListCheckpointed, store: OperatorStateStore) -> Any:
    return store.get_list_state(ListStateDescriptor(LIST_CHECKPOINTED_STATE_NAME, function.state_serializer()))


def initialize_function(function: Any, store: OperatorStateStore, *, keyed_state_store: Any = None) -> None:
    """Start ``function`` on a subtask: restore the store first (if resuming), then call this."""
    kind = _kind(function)
    if kind == "checkpointed":
        function.initialize_state(FunctionInitializationContext(
            store.is_restored, store.restored_checkpoint_id, store, keyed_state_store))
    elif kind == "list":
        state = _list_state(function, store)
        if store.is_restored:
            function.restore_state(state.get())


def snapshot_function(function: Any, store: OperatorStateStore, checkpoint_id: int, timestamp_ms: int) -> None:
    """Let ``function`` put its state into the store for checkpoint ``checkpoint_id``."""
    kind = _kind(function)
    if kind == "checkpointed":
        function.snapshot_state(FunctionSnapshotContext(int(checkpoint_id), int(timestamp_ms)))
    elif kind == "list":
        elements = function.snapshot_state(int(checkpoint_id), int(timestamp_ms))
        _list_state(function, store).update(elements if elements is not None else [])


def checkpoint_function(function: Any, store: OperatorStateStore, checkpoint_id: int, timestamp_ms: int,
                        storage: CheckpointStorage) -> SnapshotFuture:
    """:func:`snapshot_function`, then the store's snapshot: a future of the operator handle."""
    snapshot_function(function, store, checkpoint_id, timestamp_ms)
    return store.snapshot(checkpoint_id, storage)
