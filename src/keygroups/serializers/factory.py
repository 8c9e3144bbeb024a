"""``serializer_for``: a sensible default serializer for a Python type or a sample value."""

from __future__ import annotations

import dataclasses
from typing import Any

from keygroups.serializers.base import TypeSerializer
from keygroups.serializers.primitive import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    StrSerializer,
)
from keygroups.serializers.record import RecordSerializer
from keygroups.serializers.value import ValueSerializer

_BY_TYPE: dict[type, type[TypeSerializer[Any]]] = {
    bool: BoolSerializer,
    int: Int64Serializer,
    float: Float64Serializer,
    str: StrSerializer,
    bytes: BytesSerializer,
}


def serializer_for(type_or_value: Any) -> TypeSerializer[Any]:
    """The typed serializer for bool/int/float/str/bytes (a type or a value of it), a ``RecordSerializer`` for a
    dataclass (or an instance of one: values come back as that dataclass); ``ValueSerializer`` for anything else
    JSON-like. Never pickle: use ``PickleSerializer()`` explicitly for arbitrary objects.

    Note that int maps to Int64Serializer, which refuses ints outside the 64-bit range; pass ``object`` (or use
    ValueSerializer) for unbounded ints.
    """
    t = type_or_value if isinstance(type_or_value, type) else type(type_or_value)
    if dataclasses.is_dataclass(t):
        return RecordSerializer(t)
    cls = _BY_TYPE.get(t)
    return cls() if cls is not None else ValueSerializer()


__all__ = ["serializer_for"]
