"""Typed serializers, their versioned snapshots and compatibility resolution.

Every state is written with a ``TypeSerializer``; its ``SerializerSnapshot`` (identifier, version, config, nested
snapshots; plain JSON) is stored beside the state, and on restore ``resolve_compatibility`` decides whether the
serializer registered now reads the old bytes as is, after migration (read with the old, write with the new) or
not at all (``StateMigrationError``). The built-in serializers are compiled (``keygroups._native.codec``; records: ``keygroups._native.records``).
``RecordSerializer`` stores records of named, typed fields (from a Spark DDL string, a StructType, a pyarrow schema
or a dataclass) and evolves them by Avro's rules; ``keygroups.serializers.schema`` holds its types.
"""

from keygroups.serializers.base import CodecSerializer, TypeSerializer
from keygroups.serializers.compatibility import Compatibility, resolve_compatibility
from keygroups.serializers.composite import ListSerializer, MapSerializer, NullableSerializer, TupleSerializer
from keygroups.serializers.factory import serializer_for
from keygroups.serializers.pickled import PickleSerializer
from keygroups.serializers.primitive import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    StrSerializer,
)
from keygroups.serializers.record import RecordMigrationReader, RecordSerializer
from keygroups.serializers.schema import Field, RecordType
from keygroups.serializers.snapshot import SerializerSnapshot
from keygroups.serializers.value import ValueSerializer

__all__ = [
    "TypeSerializer",
    "CodecSerializer",
    "SerializerSnapshot",
    "Compatibility",
    "resolve_compatibility",
    "Int64Serializer",
    "Int32Serializer",
    "Float64Serializer",
    "BoolSerializer",
    "StrSerializer",
    "BytesSerializer",
    "NullableSerializer",
    "TupleSerializer",
    "ListSerializer",
    "MapSerializer",
    "ValueSerializer",
    "PickleSerializer",
    "serializer_for",
    "RecordSerializer",
    "RecordMigrationReader",
    "RecordType",
    "Field",
]
