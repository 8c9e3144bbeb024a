"""A job's keys and its keyed state backends, as the driver and the tasks both see them: the key type of the input's
key columns, the serializer state stores the keys with, and the backend a subtask's state lives in."""

from __future__ import annotations

from typing import Any, Literal

import pyarrow as pa

from keygroups._hashing import KeyType, key_type_for_arrow

#: The keyed state backends a job can run on: ``"heap"`` (Python objects in the worker's memory, copy-on-write
#: snapshots) or ``"rocksdb"`` (a local RocksDB database per subtask, through rocksdict: state larger than memory).
StateBackendName = Literal["heap", "rocksdb"]
BACKENDS: tuple[StateBackendName, ...] = ("heap", "rocksdb")


def key_type_for_schema(schema: pa.Schema, key_columns: tuple[str, ...]) -> KeyType:
    """The key type (a name, or a tuple of names for several key columns) of the given Arrow columns: the names
    :func:`keygroups._hashing.key_type_for_arrow` gives, so a job hashes a column as ``assign_key_groups`` does."""
    names = []
    for column in key_columns:
        if column not in schema.names:
            raise ValueError(f"key column {column!r} is not in the input; its columns are {schema.names}")
        try:
            names.append(key_type_for_arrow(schema.field(column).type))
        except TypeError as e:
            raise TypeError(f"key column {column!r}: {e}") from None
    return names[0] if len(names) == 1 else tuple(names)


def key_serializer_for(key_type: KeyType) -> Any:
    """The serializer keyed state stores this job's keys with (deterministic bytes, compatible across runs)."""
    from keygroups import serializers as s

    if isinstance(key_type, tuple):
        return s.TupleSerializer(*(key_serializer_for(k) for k in key_type))
    return {
        "long": s.Int64Serializer,
        "int": s.Int32Serializer,
        "short": s.Int32Serializer,
        "byte": s.Int32Serializer,
        "boolean": s.BoolSerializer,
        "double": s.Float64Serializer,
        "float": s.Float64Serializer,
        "string": s.StrSerializer,
        "bytes": s.BytesSerializer,
    }[key_type]()


def create_backend(kind: StateBackendName, key_group_range: Any, max_parallelism: int, key_type: KeyType, *,
                   subtask_index: int = 0, allow_pickle: bool = False, local_dir: str | None = None,
                   warm_dir: str | None = None, compact_full_groups: bool = False,
                   warm_takeover: Any = (None, frozenset()), write_back_batches: int | None = None) -> Any:
    """A keyed state backend for one subtask's key groups: ``"heap"`` or ``"rocksdb"`` (a local database under
    ``local_dir``, a temporary directory by default, or kept warm under ``warm_dir``; call ``dispose()`` when
    done). ``compact_full_groups``: a heap backend drops the restored layers of a key group once it writes it
    full (for a backend kept warm across batches, which must not grow without bound). ``warm_takeover``: a
    RocksDB backend's part of the batch's warm takeover (``KeyedTaskSpec.warm_claims``). ``write_back_batches``: a
    RocksDB backend's write-back interval (None: its default; the heap has none)."""
    from keygroups import state

    key_serializer = key_serializer_for(key_type)
    common = {"key_type": key_type, "allow_pickle": allow_pickle, "subtask_index": subtask_index}
    if kind == "heap":
        return state.HeapKeyedStateBackend(key_group_range, max_parallelism, key_serializer,
                                           compact_full_groups=compact_full_groups, **common)
    if kind == "rocksdb":
        return state.RocksDBKeyedStateBackend(key_group_range, max_parallelism, key_serializer, db_dir=local_dir,
                                              warm_dir=warm_dir, warm_takeover=warm_takeover,
                                              write_back_batches=write_back_batches, **common)
    raise ValueError(f"unknown state backend {kind!r}; allowed: 'heap', 'rocksdb'")


__all__ = ["StateBackendName", "BACKENDS", "key_type_for_schema", "key_serializer_for", "create_backend"]
