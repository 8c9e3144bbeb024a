"""Arrow types of stored state, from its serializer snapshots alone, and back: what the state reader and the savepoint
writer agree on.

A *typed* serializer (the built-in ``int64``, ``int32``, ``float64``, ``bool``, ``str``, ``bytes`` and ``nullable``,
``tuple``, ``list``, ``map`` built from them) maps to an Arrow type: ints, doubles, booleans, strings, binaries,
a nullable value to its inner type, a tuple to a struct with fields ``_1``, ``_2``, ... (as Spark names a Python
tuple's fields), a list to a list, a map to a map. A ``record`` (``RecordSerializer``) maps to a struct of its
named fields, nested, with their types and nullability (``keygroups.serializers.schema_formats.to_arrow``). Every
other serializer is *opaque*: ``PickleSerializer`` (never unpickled: that would run code from the checkpoint),
``ValueSerializer`` (self-describing, no one type) and custom ones, alone or nested anywhere. An opaque value is its
serialized bytes, a binary column, read and written as is.

Values cross as Python objects: the typed serializers decode to ints, floats, bools, str, bytes, tuples, lists and
dicts, which ``pyarrow.array`` takes for the mapped type as they are; the way back (:func:`python_values`) builds
tuples from structs and dicts from maps, a column at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from keygroups._native.statecore import java_keys
from keygroups.errors import KeyGroupsError
from keygroups.serializers import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    RecordSerializer,
    SerializerSnapshot,
    StrSerializer,
    TupleSerializer,
    TypeSerializer,
)
from keygroups.serializers.schema import DataType, ListType, MapType, RecordType
from keygroups.serializers.schema_formats import to_arrow

_SCALARS: dict[str, pa.DataType] = {
    "int64": pa.int64(), "int32": pa.int32(), "float64": pa.float64(), "bool": pa.bool_(), "str": pa.string(),
    "bytes": pa.binary(),
}
_COMPOSITES = frozenset({"nullable", "tuple", "list", "map"})
_RECORD = RecordSerializer.identifier

#: Serializer snapshots are untrusted JSON; a typed tree deeper than this is treated as opaque.
_MAX_DEPTH = 32


def is_typed(snapshot: SerializerSnapshot) -> bool:
    """Whether values of ``snapshot``'s serializer map to one Arrow type (see the module docs): a built-in typed
    serializer of its current format version, with typed serializers nested in it."""
    return _typed(snapshot, 0)


def _typed(s: SerializerSnapshot, depth: int) -> bool:
    if depth > _MAX_DEPTH or s.uses_pickle:
        return False
    if s.identifier == _RECORD:
        return _record_schema(s) is not None
    if s.identifier in _SCALARS:
        arity_ok = not s.nested
    elif s.identifier in _COMPOSITES:
        wanted = {"nullable": 1, "list": 1, "map": 2}.get(s.identifier)
        arity_ok = len(s.nested) == wanted if wanted is not None else len(s.nested) >= 1
    else:
        return False
    if not arity_ok or s.config:
        return False
    try:
        s.restore_serializer()   # a format version this code reads
    except KeyGroupsError:
        return False
    return all(_typed(n, depth + 1) for n in s.nested)


def _record_schema(s: SerializerSnapshot) -> RecordType | None:
    """The schema a record snapshot stores, or None when this code cannot read it (then the state is opaque)."""
    if s.nested or s.version != RecordSerializer.version:
        return None
    try:
        return RecordType.from_json(s.config.get("schema"))
    except KeyGroupsError:
        return None


def arrow_type(snapshot: SerializerSnapshot) -> pa.DataType:
    """The Arrow type of the values ``snapshot``'s serializer stores: mapped if typed, binary if opaque."""
    return _arrow(snapshot) if is_typed(snapshot) else pa.binary()


def _arrow(s: SerializerSnapshot) -> pa.DataType:
    if s.identifier == _RECORD:
        schema = _record_schema(s)
        assert schema is not None   # typed: checked by the caller
        return to_arrow(schema)
    if s.identifier in _SCALARS:
        return _SCALARS[s.identifier]
    if s.identifier == "nullable":
        return _arrow(s.nested[0])
    if s.identifier == "tuple":
        return pa.struct([pa.field(f"_{i + 1}", _arrow(n)) for i, n in enumerate(s.nested)])
    if s.identifier == "list":
        return pa.list_(_arrow(s.nested[0]))
    return pa.map_(_arrow(s.nested[0]), _arrow(s.nested[1]))


def reading_serializer(snapshot: SerializerSnapshot) -> TypeSerializer:
    """The serializer that decodes stored values for their Arrow column: the stored one if typed; for an opaque
    one ``BytesSerializer``, which hands a value's bytes over as they are (a lone bytes value is stored raw)."""
    return snapshot.restore_serializer() if is_typed(snapshot) else BytesSerializer()


# ---- the way back: Arrow values -> serializers and the Python objects they take ------------------------------------


def serializer_for_arrow(arrow: pa.DataType, what: str) -> TypeSerializer:
    """The typed serializer a column of Arrow type ``arrow`` is written with when none is named (the inverse of
    :func:`arrow_type`; ints narrower than 64 bits as Int32, float32 as Float64, as a job stores such keys).
    ``what`` names the column in the TypeError for a type with no typed serializer."""
    t = pa.types
    if t.is_int64(arrow):
        return Int64Serializer()
    if t.is_int32(arrow) or t.is_int16(arrow) or t.is_int8(arrow):
        return Int32Serializer()
    if t.is_floating(arrow):
        return Float64Serializer()
    if t.is_boolean(arrow):
        return BoolSerializer()
    if t.is_string(arrow) or t.is_large_string(arrow):
        return StrSerializer()
    if t.is_binary(arrow) or t.is_large_binary(arrow):
        return BytesSerializer()
    if t.is_struct(arrow):   # a tuple, as before records existed; name a RecordSerializer for named fields
        if arrow.num_fields == 0:
            raise TypeError(f"{what}: an empty struct has no serializer")
        return TupleSerializer(*(serializer_for_arrow(arrow.field(i).type, f"{what}.{arrow.field(i).name}")
                                 for i in range(arrow.num_fields)))
    if t.is_list(arrow) or t.is_large_list(arrow):
        return ListSerializer(serializer_for_arrow(arrow.value_type, f"{what} element"))
    if t.is_map(arrow):
        return MapSerializer(serializer_for_arrow(arrow.key_type, f"{what} key"),
                             serializer_for_arrow(arrow.item_type, f"{what} value"))
    raise TypeError(f"{what} has type {arrow}, which no typed serializer stores (allowed: integers, floats, "
                    f"booleans, strings, binaries, and structs, arrays and maps of them); convert the column, or "
                    f"name a serializer and give its serialized bytes as a binary column")


def python_values(column: pa.Array | pa.ChunkedArray, snapshot: SerializerSnapshot) -> list[Any]:
    """The values of ``column`` (of ``arrow_type(snapshot)``, or of a type :func:`serializer_for_arrow` maps to
    ``snapshot``'s serializer) as that serializer takes them: a struct's values as tuples, a map's as dicts, any
    other as ``to_pylist`` gives it (opaque values: their bytes). Converted column by column, not row by row."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    # one array that starts at offset 0, so children and offsets line up without slicing arithmetic
    array = pa.concat_arrays(chunks) if chunks else pa.array([], type=column.type)
    return _python(array, snapshot) if is_typed(snapshot) else array.to_pylist()


def _needs_conversion(s: SerializerSnapshot) -> bool:
    return s.identifier in ("tuple", "map", _RECORD) or any(_needs_conversion(n) for n in s.nested)


def _with_dicts(value: Any, t: DataType) -> Any:
    """A record's ``to_pylist`` value with its maps as dicts (Arrow gives a map as a list of pairs)."""
    if value is None:
        return None
    if isinstance(t, RecordType):
        return {f.name: _with_dicts(value.get(f.name), f.type) for f in t.fields}
    if isinstance(t, ListType):
        return [_with_dicts(e, t.element) for e in value]
    if isinstance(t, MapType):
        return {k: _with_dicts(v, t.value) for k, v in (value.items() if isinstance(value, dict) else value)}
    return value


def _python(array: pa.Array, s: SerializerSnapshot) -> list[Any]:
    if s.identifier == _RECORD:
        schema = _record_schema(s)
        assert schema is not None   # typed: checked by the caller
        if not pa.types.is_struct(array.type):
            raise TypeError(f"a record {schema.ddl()} needs a struct column, got {array.type}")
        return [_with_dicts(v, schema) for v in array.to_pylist()]
    if s.identifier == "nullable":
        return _python(array, s.nested[0])
    if not _needs_conversion(s):
        return array.to_pylist()
    valid = None if array.null_count == 0 else array.is_valid().to_pylist()
    if s.identifier == "tuple":
        if not pa.types.is_struct(array.type) or array.type.num_fields != len(s.nested):
            raise TypeError(f"a {s.describe()} value needs a struct of {len(s.nested)} fields, got {array.type}")
        fields = [_python(array.field(i), n) for i, n in enumerate(s.nested)]
        rows: list[Any] = list(zip(*fields)) if fields else []
    else:
        if s.identifier == "list":
            parts = [_python(array.values, s.nested[0])]
        else:
            if not pa.types.is_map(array.type):
                raise TypeError(f"a {s.describe()} value needs a map, got {array.type}")
            parts = [_python(array.keys, s.nested[0]), _python(array.items, s.nested[1])]
        offsets = array.offsets.to_pylist()
        if s.identifier == "list":
            rows = [parts[0][a:b] for a, b in zip(offsets, offsets[1:])]
        else:
            keys = java_keys(parts[0])   # one NaN entry, 0.0 and -0.0 apart: the map state's own key equality
            rows = [dict(zip(keys[a:b], parts[1][a:b])) for a, b in zip(offsets, offsets[1:])]
    if valid is not None:
        rows = [r if ok else None for r, ok in zip(rows, valid)]
    return rows


__all__ = ["is_typed", "arrow_type", "reading_serializer", "serializer_for_arrow", "python_values"]
