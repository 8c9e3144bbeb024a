"""keygroups: Apache Flink's rescalable keyed and operator state for PySpark pipelines.

The top level is the key-group API, bit-exact with Flink's ``KeyGroupRangeAssignment``: every key hashes (Java
``hashCode()``, then Flink's murmur hash) into one of ``max_parallelism`` key groups, and each of ``parallelism``
subtasks owns a contiguous range of them.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keygroups._hashing import (
        assign_key_groups,
        assign_key_groups_for_tuples,
        assign_operators,
        assign_to_key_group,
        assign_to_operator,
        java_hash,
        java_hashes,
        murmur_hash,
        tuple_java_hashes,
    )
    from keygroups._ranges import (
        UPPER_BOUND_MAX_PARALLELISM,
        KeyGroupRange,
        default_max_parallelism,
        key_group_range,
        operator_index_for_key_group,
    )
from keygroups.errors import (
    CheckpointNotFoundError,
    ConcurrentCommitError,
    CorruptDataError,
    CorruptLogError,
    CorruptSnapshotError,
    DriverFencedError,
    KeyGroupOutOfRangeError,
    KeyGroupsError,
    ReplayMismatchError,
    StateMigrationError,
    StateSerializationError,
    UnsafeDeserializationError,
)

__version__ = "0.1.0"

# Loaded on first use: numpy and pyarrow take seconds to import, and pytest imports this package at its start
# for the harness fixture (keygroups.testing.pytest_plugin) in every suite of an environment that has keygroups.
_LAZY = {
    **dict.fromkeys(("assign_key_groups", "assign_key_groups_for_tuples", "assign_operators", "assign_to_key_group",
                     "assign_to_operator", "java_hash", "java_hashes", "murmur_hash", "tuple_java_hashes"),
                    "keygroups._hashing"),
    **dict.fromkeys(("UPPER_BOUND_MAX_PARALLELISM", "KeyGroupRange", "default_max_parallelism", "key_group_range",
                     "operator_index_for_key_group"), "keygroups._ranges"),
}

__all__ = [
    "java_hash",
    "java_hashes",
    "tuple_java_hashes",
    "murmur_hash",
    "assign_to_key_group",
    "assign_key_groups",
    "assign_key_groups_for_tuples",
    "assign_to_operator",
    "assign_operators",
    "KeyGroupRange",
    "key_group_range",
    "operator_index_for_key_group",
    "default_max_parallelism",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupsError",
    "StateMigrationError",
    "CorruptDataError",
    "CorruptSnapshotError",
    "CorruptLogError",
    "ConcurrentCommitError",
    "DriverFencedError",
    "ReplayMismatchError",
    "StateSerializationError",
    "CheckpointNotFoundError",
    "KeyGroupOutOfRangeError",
    "UnsafeDeserializationError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keygroups' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
