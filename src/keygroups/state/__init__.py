"""Keyed state: descriptors, the five state types, TTL, and the heap and RocksDB keyed state backends; operator
state: the store, its list and broadcast states, and checkpointed functions (FLIP-8).

Names follow Flink's in Python casing (``ValueStateDescriptor``, ``get_state``, ``StateTtlConfig``), so that a Flink
user finds them. Backends snapshot into ``keygroups.checkpoint``'s keyed file format and restore from it at any
parallelism.
"""

from keygroups.checkpoint import DistributionMode
from keygroups.state._base import VOID_NAMESPACE, RestoreStats, SnapshotFuture, state_meta
from keygroups.state.checkpointed import (
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
    ListCheckpointed,
    checkpoint_function,
    initialize_function,
    snapshot_function,
)
from keygroups.state.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReduceFunction,
    ReducingStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from keygroups.state.heap import HeapKeyedStateBackend
from keygroups.state.operator import BroadcastState, OperatorListState, OperatorStateStore
from keygroups.state.states import AggregatingState, ListState, MapState, ReducingState, State, ValueState
from keygroups.state.ttl import (
    StateTtlConfig,
    StateTtlConfigBuilder,
    StateVisibility,
    TtlTimeCharacteristic,
    UpdateType,
)


def __getattr__(name: str):  # RocksDB is optional: import rocksdict only when asked for
    if name == "RocksDBKeyedStateBackend":
        from keygroups.state.rocksdb import RocksDBKeyedStateBackend

        return RocksDBKeyedStateBackend
    raise AttributeError(f"module 'keygroups.state' has no attribute {name!r}")


__all__ = [
    "StateDescriptor",
    "ValueStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "AggregatingStateDescriptor",
    "ReduceFunction",
    "AggregateFunction",
    "State",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
    "AggregatingState",
    "StateTtlConfig",
    "StateTtlConfigBuilder",
    "UpdateType",
    "StateVisibility",
    "TtlTimeCharacteristic",
    "HeapKeyedStateBackend",
    "RocksDBKeyedStateBackend",
    "RestoreStats",
    "SnapshotFuture",
    "VOID_NAMESPACE",
    "state_meta",
    "OperatorStateStore",
    "OperatorListState",
    "BroadcastState",
    "DistributionMode",
    "CheckpointedFunction",
    "ListCheckpointed",
    "FunctionInitializationContext",
    "FunctionSnapshotContext",
    "initialize_function",
    "snapshot_function",
    "checkpoint_function",
]
