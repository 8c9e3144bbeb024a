"""keygroups: Apache Flink's rescalable keyed and operator state for PySpark pipelines.

The top level is the key-group API, bit-exact with Flink's ``KeyGroupRangeAssignment``: every key hashes (Java
``hashCode()``, then Flink's murmur hash) into one of ``max_parallelism`` key groups, and each of ``parallelism``
subtasks owns a contiguous range of them.
"""

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
