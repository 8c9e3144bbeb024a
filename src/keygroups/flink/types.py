"""Flink's type serializers: their snapshots (read from and written to Flink's state meta info) and their binary
formats, each mapped to an Arrow type and to a keygroups serializer.

One class per Flink serializer, named after it; ``SNAPSHOT_READERS`` is the one table from a snapshot class name to
the reader of its payload. Flink's own serializers that keygroups does not map (Kryo, POJO, Avro, Value types,
BigInteger, java.time, ...) are read to the end of their snapshot and become an ``UnsupportedType``: the header reads
on, their states list, and using one refuses by name (``UnsupportedFlinkTypeError``), so ``skip_states`` can leave
it out. A snapshot class not in the table (a user's own serializer) raises ``UnknownSerializerSnapshotError``: its
payload has no length prefix, so nothing after it can be read either. Nothing is ever unpickled (a Kryo snapshot's
Java-serialized parts are skipped by their frame lengths, never read).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import pyarrow as pa

from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.flink._cursor import Cursor, encode_modified_utf8, plain, shown
from keygroups.serializers import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    NullableSerializer,
    RecordSerializer,
    StrSerializer,
    TupleSerializer,
    SerializerSnapshot,
    TypeSerializer,
)
from keygroups.serializers import schema as rs

COMPOSITE_MAGIC = 911108               # CompositeTypeSerializerSnapshot.MAGIC_NUMBER
NESTED_MAGIC = 1333245                 # NestedSerializersSnapshotDelegate.MAGIC_NUMBER
NESTED_VERSION = 1
SNAPSHOT_PROXY_VERSION = 2             # TypeSerializerSnapshotSerializationUtil's format version

_I16, _I32, _I64 = struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_F32, _F64 = struct.Struct(">f"), struct.Struct(">d")
_H = struct.Struct(">H")
_JAVA_NAN_64 = bytes.fromhex("7ff8000000000000")   # Double.doubleToLongBits(NaN)
_JAVA_NAN_32 = bytes.fromhex("7fc00000")           # Float.floatToIntBits(NaN)
_NATIVE_UTF16 = "utf-16-le" if sys.byteorder == "little" else "utf-16-be"


class UnsupportedFlinkTypeError(KeyGroupsError, ValueError):
    """A Flink state uses a serializer keygroups cannot read or write (Kryo, POJO, Avro, a user serializer), or a
    value keygroups cannot express in Flink. The message names the state, the serializer and what to do."""


class TtlValue(NamedTuple):
    """A TTL-wrapped value as Flink stores it (``TtlValue``): the value and its last-access timestamp (ms)."""

    value: Any
    timestamp: int


class FlinkType:
    """One Flink ``TypeSerializer``: its binary format, its snapshot, its Arrow type and its keygroups serializer."""

    snapshot_class: ClassVar[str]
    snapshot_version: ClassVar[int] = 3
    #: Bytes per value when fixed (Flink's ``getLength()``), else -1.
    length: ClassVar[int] = -1
    #: Flink's short name for messages.
    name: ClassVar[str]
    #: For fixed-size primitives: the struct that unpacks one value (a fast path for whole values).
    fixed_struct: ClassVar[struct.Struct | None] = None

    def from_fixed(self, raw: Any) -> Any:
        """The value of what ``fixed_struct`` unpacked."""
        return raw

    def read(self, c: Cursor) -> Any:
        raise NotImplementedError

    def write(self, out: bytearray, value: Any) -> None:
        raise NotImplementedError

    def arrow_type(self) -> pa.DataType:
        raise NotImplementedError

    def keygroups_serializer(self) -> TypeSerializer:
        raise UnsupportedFlinkTypeError(f"Flink's {self.name} has no keygroups serializer yet")

    def nested(self) -> tuple[FlinkType, ...]:
        return ()

    def write_outer(self, out: bytearray) -> None:
        """The payload of a simple snapshot, or the outer snapshot of a composite one."""

    def write_snapshot(self, out: bytearray) -> None:
        """``TypeSerializerSnapshot.writeVersionedSnapshot``: class, version, payload."""
        out += encode_modified_utf8(self.snapshot_class)
        out += _I32.pack(self.snapshot_version)
        self.write_outer(out)

    def to_python(self, value: Any) -> Any:
        """The value as keygroups' serializer holds it (identity unless a subclass narrows or widens)."""
        return value

    def from_python(self, value: Any) -> Any:
        return value

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        inner = ", ".join(repr(n) for n in self.nested())
        return f"{self.name}({inner})" if inner else self.name


def _check_int(value: Any, bits: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Flink's {name} holds ints, got {shown(value)} of type {type(value).__name__}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not lo <= value <= hi:
        raise ValueError(f"{value} is outside Flink {name}'s range [{lo}, {hi}]")
    return value


class _Simple(FlinkType):
    """A serializer whose snapshot is a ``SimpleTypeSerializerSnapshot`` (version 3, no payload)."""


def _base(name: str) -> str:
    return f"org.apache.flink.api.common.typeutils.base.{name}Serializer${name}SerializerSnapshot"


class LongType(_Simple):
    """``LongSerializer``: 8 bytes big-endian."""

    snapshot_class, name, length = _base("Long"), "Long", 8
    fixed_struct = _I64

    def read(self, c: Cursor) -> int:
        return c.i64("a Long")

    def write(self, out: bytearray, value: Any) -> None:
        out += _I64.pack(_check_int(value, 64, "Long"))

    def arrow_type(self) -> pa.DataType:
        return pa.int64()

    def keygroups_serializer(self) -> TypeSerializer:
        return Int64Serializer()


class IntType(_Simple):
    """``IntSerializer``: 4 bytes big-endian."""

    snapshot_class, name, length = _base("Int"), "Integer", 4
    fixed_struct = _I32

    def read(self, c: Cursor) -> int:
        return c.i32("an Integer")

    def write(self, out: bytearray, value: Any) -> None:
        out += _I32.pack(_check_int(value, 32, "Integer"))

    def arrow_type(self) -> pa.DataType:
        return pa.int32()

    def keygroups_serializer(self) -> TypeSerializer:
        return Int32Serializer()


class ShortType(_Simple):
    """``ShortSerializer``: 2 bytes big-endian (kept in keygroups as Int32)."""

    snapshot_class, name, length = _base("Short"), "Short", 2
    fixed_struct = _I16

    def read(self, c: Cursor) -> int:
        return c.i16("a Short")

    def write(self, out: bytearray, value: Any) -> None:
        out += _I16.pack(_check_int(value, 16, "Short"))

    def arrow_type(self) -> pa.DataType:
        return pa.int16()

    def keygroups_serializer(self) -> TypeSerializer:
        return Int32Serializer()


class ByteType(_Simple):
    """``ByteSerializer``: 1 byte, signed (kept in keygroups as Int32)."""

    snapshot_class, name, length = _base("Byte"), "Byte", 1

    def read(self, c: Cursor) -> int:
        b = c.u8("a Byte")
        return b - 256 if b > 127 else b

    def write(self, out: bytearray, value: Any) -> None:
        out.append(_check_int(value, 8, "Byte") & 0xFF)

    def arrow_type(self) -> pa.DataType:
        return pa.int8()

    def keygroups_serializer(self) -> TypeSerializer:
        return Int32Serializer()


class DoubleType(_Simple):
    """``DoubleSerializer``: the IEEE bits as a long (``doubleToLongBits``: one NaN)."""

    snapshot_class, name, length = _base("Double"), "Double", 8
    fixed_struct = _F64

    def read(self, c: Cursor) -> float:
        return _F64.unpack(c.take(8, "a Double"))[0]

    def write(self, out: bytearray, value: Any) -> None:
        v = float(value)
        out += _F64.pack(v) if v == v else _JAVA_NAN_64   # writeDouble: doubleToLongBits, one NaN

    def arrow_type(self) -> pa.DataType:
        return pa.float64()

    def keygroups_serializer(self) -> TypeSerializer:
        return Float64Serializer()


class FloatType(_Simple):
    """``FloatSerializer``: the IEEE bits as an int (kept in keygroups as Float64, exactly)."""

    snapshot_class, name, length = _base("Float"), "Float", 4
    fixed_struct = _F32

    def read(self, c: Cursor) -> float:
        return _F32.unpack(c.take(4, "a Float"))[0]

    def write(self, out: bytearray, value: Any) -> None:
        v = float(value)
        packed = _F32.pack(v)
        if _F32.unpack(packed)[0] != v and v == v:
            raise ValueError(f"{shown(v)} is not exactly a Java float: Flink's Float state cannot hold it")
        out += packed if v == v else _JAVA_NAN_32          # writeFloat: floatToIntBits, one NaN

    def arrow_type(self) -> pa.DataType:
        return pa.float32()

    def keygroups_serializer(self) -> TypeSerializer:
        return Float64Serializer()


class BooleanType(_Simple):
    """``BooleanSerializer``: one byte, 0 or 1."""

    snapshot_class, name, length = _base("Boolean"), "Boolean", 1

    def read(self, c: Cursor) -> bool:
        return c.boolean("a Boolean")

    def write(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"Flink's Boolean holds bools, got {shown(value)}")
        out.append(1 if value else 0)

    def arrow_type(self) -> pa.DataType:
        return pa.bool_()

    def keygroups_serializer(self) -> TypeSerializer:
        return BoolSerializer()


class CharType(_Simple):
    """``CharSerializer``: one UTF-16 code unit, 2 bytes big-endian (kept in keygroups as a one-character str)."""

    snapshot_class, name, length = _base("Char"), "Character", 2

    def read(self, c: Cursor) -> str:
        return chr(c.u16("a Character"))

    def write(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, str) or len(value) != 1 or ord(value) > 0xFFFF:
            raise ValueError(f"Flink's Character holds one UTF-16 code unit, got {shown(value)}")
        out += _H.pack(ord(value))

    def arrow_type(self) -> pa.DataType:
        return pa.string()

    def keygroups_serializer(self) -> TypeSerializer:
        return StrSerializer()


def read_string_value(c: Cursor) -> str | None:
    """Flink's ``StringValue.readString``: varint (length + 1; 0 is null), then each UTF-16 unit as a varint."""
    n = _varint(c, "a String's length")
    if n == 0:
        return None
    n -= 1
    if n > c.remaining:
        raise c.fail(f"a String of {n} characters is longer than the {c.remaining} remaining bytes")
    data, start = c.data, c.pos
    end = start + n
    chunk = bytes(data[start:end])
    if chunk.isascii():           # the common case: one byte per character
        c.pos = end
        return chunk.decode("ascii")
    # each unit is 1 to 3 varint bytes: scan in place, every byte checked against the end first
    units = array("H")
    pos, stop = start, c.end
    for _ in range(n):
        if pos >= stop:
            c.pos = pos
            raise c.fail("a String's character needs a byte but none remains (truncated or corrupt)")
        b = data[pos]
        pos += 1
        if b < 0x80:
            units.append(b)
            continue
        value, shift = b & 0x7F, 7
        while True:
            if pos >= stop:
                c.pos = pos
                raise c.fail("a String's character needs a byte but none remains (truncated or corrupt)")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if value > 0xFFFF:
                c.pos = pos
                raise c.fail("a String's character exceeds 0xFFFF")
            if b < 0x80:
                break
            shift += 7
        units.append(value)
    c.pos = pos
    return units.tobytes().decode(_NATIVE_UTF16, "surrogatepass")


def _varint(c: Cursor, what: str, limit: int = 0x7FFFFFFF) -> int:
    value, shift = 0, 0
    while True:
        b = c.u8(what)
        value |= (b & 0x7F) << shift
        if value > limit:
            raise c.fail(f"{what} exceeds {limit}")
        if b < 0x80:
            return value
        shift += 7


def _write_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def write_string_value(out: bytearray, s: str | None) -> None:
    if s is None:
        out.append(0)
        return
    if s.isascii():
        _write_varint(out, len(s) + 1)
        out += s.encode("ascii")
        return
    units = s.encode("utf-16-be", "surrogatepass")
    _write_varint(out, len(units) // 2 + 1)
    for i in range(0, len(units), 2):
        _write_varint(out, (units[i] << 8) | units[i + 1])


class StringType(_Simple):
    """``StringSerializer`` (``StringValue`` encoding: varint lengths and characters, any UTF-16 string)."""

    snapshot_class, name = _base("String"), "String"

    def read(self, c: Cursor) -> str | None:
        return read_string_value(c)

    def write(self, out: bytearray, value: Any) -> None:
        if value is not None and not isinstance(value, str):
            raise TypeError(f"Flink's String holds str, got {shown(value)} of type {type(value).__name__}")
        write_string_value(out, value)

    def arrow_type(self) -> pa.DataType:
        return pa.string()

    def keygroups_serializer(self) -> TypeSerializer:
        return StrSerializer()


class BytesType(_Simple):
    """``BytePrimitiveArraySerializer`` (``byte[]``): int length, then the bytes."""

    snapshot_class = ("org.apache.flink.api.common.typeutils.base.array.BytePrimitiveArraySerializer"
                      "$BytePrimitiveArraySerializerSnapshot")
    name = "byte[]"

    def read(self, c: Cursor) -> bytes:
        n = c.i32("a byte[] length")
        return bytes(c.take(n, "a byte[]"))

    def write(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"Flink's byte[] holds bytes, got {shown(value)} of type {type(value).__name__}")
        b = bytes(value)
        out += _I32.pack(len(b))
        out += b

    def arrow_type(self) -> pa.DataType:
        return pa.binary()

    def keygroups_serializer(self) -> TypeSerializer:
        return BytesSerializer()


class VoidNamespaceType(_Simple):
    """``VoidNamespaceSerializer``: the one namespace of non-windowed state, one 0 byte."""

    snapshot_class = "org.apache.flink.runtime.state.VoidNamespaceSerializer$VoidNamespaceSerializerSnapshot"
    name, length = "VoidNamespace", 1

    def read(self, c: Cursor) -> None:
        c.u8("a VoidNamespace")
        return None

    def write(self, out: bytearray, value: Any) -> None:
        out.append(0)

    def arrow_type(self) -> pa.DataType:
        return pa.null()


class TimeWindowType(_Simple):
    """``TimeWindow.Serializer``: start and end (ms), two longs; as a (start, end) tuple."""

    snapshot_class = ("org.apache.flink.streaming.api.windowing.windows.TimeWindow$Serializer"
                      "$TimeWindowSerializerSnapshot")
    name, length = "TimeWindow", 16

    def read(self, c: Cursor) -> tuple[int, int]:
        return c.i64("a TimeWindow start"), c.i64("a TimeWindow end")

    def write(self, out: bytearray, value: Any) -> None:
        start, end = value
        out += _I64.pack(start) + _I64.pack(end)

    def arrow_type(self) -> pa.DataType:
        return pa.struct([("start", pa.int64()), ("end", pa.int64())])


class _Composite(FlinkType):
    """A ``CompositeTypeSerializerSnapshot``: outer snapshot, then the nested serializers' snapshots."""

    snapshot_version = 3
    outer_version: ClassVar[int] = 1

    def write_outer_payload(self, out: bytearray) -> None:
        """The outer snapshot's own fields (none by default)."""

    def write_outer(self, out: bytearray) -> None:
        out += _I32.pack(COMPOSITE_MAGIC) + _I32.pack(self.outer_version)
        self.write_outer_payload(out)
        nested = self.nested()
        out += _I32.pack(NESTED_MAGIC) + _I32.pack(NESTED_VERSION) + _I32.pack(len(nested))
        for n in nested:
            n.write_snapshot(out)


class TupleType(_Composite):
    """``TupleSerializer`` (Flink's Tuple1..Tuple25): the fields in order, none null; as a Python tuple.

    ``names`` (not part of the snapshot: Flink's Tuple classes name their fields f0, f1, ...) name the fields of the
    keygroups record the Tuple becomes (``state_serializer``), f0, f1, ... unless the import was given others."""

    snapshot_class = "org.apache.flink.api.java.typeutils.runtime.TupleSerializerSnapshot"
    name = "Tuple"
    outer_version = 2

    def __init__(self, fields: tuple[FlinkType, ...], tuple_class: str | None = None,
                 names: tuple[str, ...] | None = None) -> None:
        self.fields = fields
        self.tuple_class = tuple_class or f"org.apache.flink.api.java.tuple.Tuple{len(fields)}"
        self.names = tuple(names) if names is not None else tuple(f"f{i}" for i in range(len(fields)))
        if len(self.names) != len(fields) or len(set(self.names)) != len(fields) or \
                not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"a Tuple of {len(fields)} fields needs {len(fields)} distinct non-empty field names, "
                             f"got {list(self.names)!r}")

    def with_names(self, names: tuple[str, ...]) -> TupleType:
        """This Tuple with its fields named ``names`` (the names of the record it becomes in keygroups)."""
        return TupleType(self.fields, self.tuple_class, tuple(names))

    def nested(self) -> tuple[FlinkType, ...]:
        return self.fields

    def write_outer_payload(self, out: bytearray) -> None:
        out += encode_modified_utf8(self.tuple_class)

    def read(self, c: Cursor) -> tuple:
        return tuple(f.read(c) for f in self.fields)

    def write(self, out: bytearray, value: Any) -> None:
        if isinstance(value, dict):      # a keygroups record standing for a Tuple: fields f0, f1, ... or its names
            value = record_values(self.names, value, "a Tuple")
        if len(value) != len(self.fields):
            raise ValueError(f"a {plain(self.tuple_class.rpartition('.')[2])} needs {len(self.fields)} fields, got "
                             f"{len(value)}: {shown(value)}")
        for f, v in zip(self.fields, value):
            if v is None:
                raise ValueError(f"Flink's Tuple fields cannot be null: {shown(value)}")
            f.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.struct([(n, f.arrow_type()) for n, f in zip(self.names, self.fields)])

    def keygroups_serializer(self) -> TypeSerializer:
        return TupleSerializer(*(f.keygroups_serializer() for f in self.fields))

    def __eq__(self, other: object) -> bool:
        # names are not part of Flink's serializer (nor of its snapshot)
        return isinstance(other, TupleType) and (self.fields, self.tuple_class) == (other.fields, other.tuple_class)

    def __hash__(self) -> int:
        return hash((TupleType, len(self.fields)))

    def __repr__(self) -> str:
        return f"Tuple{len(self.fields)}({', '.join(map(repr, self.fields))})"


class RowType(_Composite):
    """``RowSerializer`` (position based): a bit mask (2 RowKind bits when supported, then one null bit per field,
    most significant bit first), then the non-null fields; as a Python tuple (RowKind must be INSERT).

    Flink's snapshot stores the field serializers and ``supportsRowKind``, never field names: ``names`` (not part of
    the snapshot, f0, f1, ... unless given) name the fields of the keygroups record the Row becomes."""

    snapshot_class = "org.apache.flink.api.java.typeutils.runtime.RowSerializer$RowSerializerSnapshot"
    name = "Row"
    outer_version = 4

    def __init__(self, fields: tuple[FlinkType, ...], supports_row_kind: bool = True,
                 names: tuple[str, ...] | None = None) -> None:
        self.fields = fields
        self.supports_row_kind = supports_row_kind
        self.names = tuple(names) if names is not None else tuple(f"f{i}" for i in range(len(fields)))
        if len(self.names) != len(fields) or len(set(self.names)) != len(fields) or \
                not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"a Row of {len(fields)} fields needs {len(fields)} distinct non-empty field names, "
                             f"got {list(self.names)!r}")

    def with_names(self, names: tuple[str, ...]) -> RowType:
        """This Row with its fields named ``names`` (the names of the record it becomes in keygroups)."""
        return RowType(self.fields, self.supports_row_kind, tuple(names))

    def nested(self) -> tuple[FlinkType, ...]:
        return self.fields

    def write_outer_payload(self, out: bytearray) -> None:
        out.append(1 if self.supports_row_kind else 0)

    def _mask_bits(self) -> int:
        return len(self.fields) + (2 if self.supports_row_kind else 0)

    def read(self, c: Cursor) -> tuple:
        nbits = self._mask_bits()
        mask = int.from_bytes(c.take((nbits + 7) // 8, "a Row's null mask"), "big")
        shift = ((nbits + 7) // 8) * 8
        offset = 2 if self.supports_row_kind else 0
        if offset and mask >> (shift - 2):
            raise c.fail("a Row whose RowKind is not INSERT (keygroups keeps only inserted rows)")
        out = []
        for i, f in enumerate(self.fields):
            is_null = (mask >> (shift - 1 - offset - i)) & 1
            out.append(None if is_null else f.read(c))
        return tuple(out)

    def write(self, out: bytearray, value: Any) -> None:
        if isinstance(value, dict):
            value = record_values(self.names, value, "a Row")
        if len(value) != len(self.fields):
            raise ValueError(f"a Row of {len(self.fields)} fields cannot hold {shown(value)}")
        nbits = self._mask_bits()
        nbytes = (nbits + 7) // 8
        offset = 2 if self.supports_row_kind else 0
        mask = 0
        for i, v in enumerate(value):
            if v is None:
                mask |= 1 << (nbytes * 8 - 1 - offset - i)
        out += mask.to_bytes(nbytes, "big")
        for f, v in zip(self.fields, value):
            if v is not None:
                f.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.struct([(n, f.arrow_type()) for n, f in zip(self.names, self.fields)])

    def record_type(self) -> rs.RecordType:
        """The keygroups record schema of this Row: its names, every field nullable (Flink's null mask)."""
        return rs.RecordType(tuple(rs.Field(n, record_field_type(f, n)[0], True)
                                   for n, f in zip(self.names, self.fields)))

    def keygroups_serializer(self) -> TypeSerializer:
        return RecordSerializer(self.record_type())

    def __eq__(self, other: object) -> bool:
        # names are not part of Flink's serializer (nor of its snapshot)
        return isinstance(other, RowType) and (self.fields, self.supports_row_kind) == (
            other.fields, other.supports_row_kind)

    def __hash__(self) -> int:
        return hash((RowType, len(self.fields)))

    def __repr__(self) -> str:
        return f"Row({', '.join(map(repr, self.fields))})"


def record_values(names: tuple[str, ...], value: dict, what: str) -> tuple:
    """A keygroups record (a dict) as a tuple of its fields in ``names``' order; other keys are refused."""
    extra = set(value) - set(names)
    if extra:
        raise ValueError(f"{what} with fields {list(names)} cannot hold the fields {shown(sorted(extra))} of "
                         f"{shown(value)}")
    return tuple(value.get(n) for n in names)


def record_field_type(t: FlinkType, path: str) -> tuple[rs.DataType, bool]:
    """The keygroups record type of a Flink serializer inside a Row: (type, nullable). Short, Byte and Float keep
    their width (int16, int8, float32); a Character is a one-character string; a nested Tuple or Row is a record
    with fields f0, f1, ... (a Tuple's never null, a Row's always nullable)."""
    scalars: dict[type[FlinkType], rs.DataType] = {
        LongType: rs.INT64, IntType: rs.INT32, ShortType: rs.INT16, ByteType: rs.INT8, DoubleType: rs.FLOAT64,
        FloatType: rs.FLOAT32, BooleanType: rs.BOOL, CharType: rs.STRING, StringType: rs.STRING,
        BytesType: rs.BINARY}
    if type(t) in scalars:
        return scalars[type(t)], False
    if isinstance(t, NullableType):
        return record_field_type(t.inner, path)[0], True
    if isinstance(t, EnumType):
        return rs.STRING, False
    if isinstance(t, _PrimitiveArray):
        return rs.ListType(record_field_type(t.element, path + "[]")[0], False), False
    if isinstance(t, (StringArrayType, GenericArrayType)):
        item = t.element if isinstance(t, GenericArrayType) else StringType()
        return rs.ListType(record_field_type(item, path + "[]")[0], True), False
    if isinstance(t, ListType):
        element, element_nullable = record_field_type(t.element, path + "[]")
        return rs.ListType(element, element_nullable), False
    if isinstance(t, MapType):
        key, _ = record_field_type(t.key, path + " key")
        if isinstance(key, (rs.ListType, rs.MapType, rs.RecordType)):
            raise UnsupportedFlinkTypeError(f"Row field {path!r} is a Map keyed by {t.key!r}: a keygroups record's "
                                            "map keys are scalars")
        value, _ = record_field_type(t.value, path + " value")
        return rs.MapType(key, value, True), False
    if isinstance(t, TupleType):
        return rs.RecordType(tuple(rs.Field(n, *record_field_type(f, f"{path}.{n}" if path else n))
                                   for n, f in zip(t.names, t.fields))), False
    if isinstance(t, RowType):
        return rs.RecordType(tuple(rs.Field(n, record_field_type(f, f"{path}.{n}")[0], True)
                                   for n, f in zip(t.names, t.fields))), False
    raise UnsupportedFlinkTypeError(f"Row field {path!r} is a {t!r}, which a keygroups record cannot hold")


def tuple_record_type(t: TupleType) -> rs.RecordType:
    """The keygroups record a Flink Tuple becomes: fields ``f0``, ``f1``, ... (the names Flink's Tuple classes give
    them; ``t.names`` when the import was given others), in order, none null unless Flink's field serializer is a
    Nullable one."""
    record, _ = record_field_type(t, "")
    assert isinstance(record, rs.RecordType)
    return record


def state_serializer(t: FlinkType) -> TypeSerializer:
    """The keygroups serializer of a whole state value of Flink type ``t`` (a value, a list element, a map value, an
    operator state element): ``t.keygroups_serializer()``, except that a Tuple becomes a record with Flink's field
    names, ``f0``, ``f1``, ... (``tuple_record_type``), wherever it is but in a map's key (keys stay tuples: a record
    is a dict, which cannot key a map). A state read back (the state reader, SQL) has ``value.f0``, as a Flink user
    writes ``value.f0``."""
    if isinstance(t, TupleType):
        return RecordSerializer(tuple_record_type(t))
    if isinstance(t, TtlType):
        return state_serializer(t.value)
    if isinstance(t, ListType):
        return ListSerializer(state_serializer(t.element))
    if isinstance(t, MapType):
        return MapSerializer(t.key.keygroups_serializer(), state_serializer(t.value))
    if isinstance(t, NullableType):
        return NullableSerializer(state_serializer(t.inner))
    if isinstance(t, GenericArrayType):
        return ListSerializer(NullableSerializer(state_serializer(t.element)))
    return t.keygroups_serializer()


def holds_tuple(t: FlinkType) -> bool:
    """Whether ``t`` holds a Tuple that ``state_serializer`` makes a record: anywhere but in a map's key or inside a
    Row (whose Tuples are records already)."""
    if isinstance(t, TupleType):
        return True
    if isinstance(t, RowType):
        return False
    if isinstance(t, MapType):
        return holds_tuple(t.value)
    return any(holds_tuple(n) for n in t.nested())


class ListType(_Composite):
    """``ListSerializer``: int count, then the elements (none null); as a Python list."""

    snapshot_class = "org.apache.flink.api.common.typeutils.base.ListSerializerSnapshot"
    name = "List"

    def __init__(self, element: FlinkType) -> None:
        self.element = element

    def nested(self) -> tuple[FlinkType, ...]:
        return (self.element,)

    def read(self, c: Cursor) -> list:
        n = c.count("a List's size", max(1, self.element.length))
        return [self.element.read(c) for _ in range(n)]

    def write(self, out: bytearray, value: Any) -> None:
        out += _I32.pack(len(value))
        for v in value:
            self.element.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.list_(self.element.arrow_type())

    def keygroups_serializer(self) -> TypeSerializer:
        return ListSerializer(self.element.keygroups_serializer())


class MapType(_Composite):
    """``MapSerializer``: int count, then (key, boolean isNull, value) per entry; as a Python dict."""

    snapshot_class = "org.apache.flink.api.common.typeutils.base.MapSerializerSnapshot"
    name = "Map"

    def __init__(self, key: FlinkType, value: FlinkType) -> None:
        self.key = key
        self.value = value

    def nested(self) -> tuple[FlinkType, ...]:
        return (self.key, self.value)

    def read(self, c: Cursor) -> dict:
        n = c.count("a Map's size", max(1, self.key.length) + 1)
        out = {}
        for _ in range(n):
            k = self.key.read(c)
            out[k] = None if c.boolean("a Map value's null flag") else self.value.read(c)
        return out

    def write(self, out: bytearray, value: Any) -> None:
        out += _I32.pack(len(value))
        for k, v in value.items():
            self.key.write(out, k)
            out.append(1 if v is None else 0)
            if v is not None:
                self.value.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.map_(self.key.arrow_type(), self.value.arrow_type())

    def keygroups_serializer(self) -> TypeSerializer:
        return MapSerializer(self.key.keygroups_serializer(), self.value.keygroups_serializer())


class NullableType(_Composite):
    """``NullableSerializer``: boolean isNull, then the value (or ``padding`` zero bytes for a null)."""

    snapshot_class = "org.apache.flink.api.java.typeutils.runtime.NullableSerializer$NullableSerializerSnapshot"
    name = "Nullable"
    outer_version = 2

    def __init__(self, inner: FlinkType, padding: int = 0) -> None:
        self.inner = inner
        self.padding = padding

    def nested(self) -> tuple[FlinkType, ...]:
        return (self.inner,)

    def write_outer_payload(self, out: bytearray) -> None:
        out += _I32.pack(self.padding)

    def read(self, c: Cursor) -> Any:
        if c.boolean("a Nullable's null flag"):
            c.take(self.padding, "a Nullable's padding")
            return None
        return self.inner.read(c)

    def write(self, out: bytearray, value: Any) -> None:
        if value is None:
            out.append(1)
            out += bytes(self.padding)
        else:
            out.append(0)
            self.inner.write(out, value)

    def arrow_type(self) -> pa.DataType:
        return self.inner.arrow_type()

    def keygroups_serializer(self) -> TypeSerializer:
        return NullableSerializer(self.inner.keygroups_serializer())


class TtlType(_Composite):
    """``TtlStateFactory.TtlSerializer``: the last-access timestamp (long), then the user value; as ``TtlValue``."""

    snapshot_class = "org.apache.flink.runtime.state.ttl.TtlStateFactory$TtlSerializerSnapshot"
    name = "Ttl"
    outer_version = 2

    def __init__(self, value: FlinkType) -> None:
        self.value = value

    def nested(self) -> tuple[FlinkType, ...]:
        return (LongType(), self.value)

    def read(self, c: Cursor) -> TtlValue:
        ts = c.i64("a TTL timestamp")
        return TtlValue(self.value.read(c), ts)

    def write(self, out: bytearray, value: Any) -> None:
        out += _I64.pack(value.timestamp)
        self.value.write(out, value.value)

    def arrow_type(self) -> pa.DataType:
        return self.value.arrow_type()

    def keygroups_serializer(self) -> TypeSerializer:
        return self.value.keygroups_serializer()


class TimerType(_Composite):
    """``TimerSerializer`` (a timer of the heap and RocksDB priority queues): timestamp with its sign bit flipped (so
    bytes sort as numbers), key, namespace."""

    snapshot_class = "org.apache.flink.streaming.api.operators.TimerSerializerSnapshot"
    name = "Timer"
    outer_version = 2

    def __init__(self, key: FlinkType, namespace: FlinkType) -> None:
        self.key = key
        self.namespace = namespace

    def nested(self) -> tuple[FlinkType, ...]:
        return (self.key, self.namespace)

    def read(self, c: Cursor) -> tuple[int, Any, Any]:
        ts = c.i64("a timer timestamp") ^ -(1 << 63)
        return ts, self.key.read(c), self.namespace.read(c)

    def write(self, out: bytearray, value: Any) -> None:
        ts, key, namespace = value
        out += _I64.pack(_check_int(ts, 64, "timer timestamp") ^ -(1 << 63))
        self.key.write(out, key)
        self.namespace.write(out, namespace)


# ---------------------------------------------------------------------------------------------- arrays and enums

class _PrimitiveArray(_Simple):
    """Flink's primitive-array serializers (``long[]``, ``int[]``, ...): int length, then the elements (the array is
    never null); as a Python list, kept in keygroups as a ``ListSerializer`` of the element's serializer."""

    element: ClassVar[FlinkType]

    def read(self, c: Cursor) -> list:
        e = self.element
        n = c.count(f"a {self.name} length", e.length)
        if e.fixed_struct is not None:
            raw = c.take(n * e.length, f"a {self.name}")
            return [e.from_fixed(x) for x in struct.unpack(f">{n}{e.fixed_struct.format[-1]}", raw)]
        return [e.read(c) for _ in range(n)]

    def write(self, out: bytearray, value: Any) -> None:
        if value is None or isinstance(value, (str, bytes, dict)):
            raise TypeError(f"Flink's {self.name} holds a list (never null), got {shown(value)}")
        values = list(value)
        out += _I32.pack(len(values))
        for v in values:
            if v is None:
                raise ValueError(f"Flink's {self.name} cannot hold null elements: {shown(value)}")
            self.element.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.list_(self.element.arrow_type())

    def keygroups_serializer(self) -> TypeSerializer:
        return ListSerializer(self.element.keygroups_serializer())


def _array_snapshot(java: str) -> str:
    return (f"org.apache.flink.api.common.typeutils.base.array.{java}PrimitiveArraySerializer"
            f"${java}PrimitiveArraySerializerSnapshot")


class LongArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Long"), "long[]", LongType()


class IntArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Int"), "int[]", IntType()


class ShortArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Short"), "short[]", ShortType()


class DoubleArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Double"), "double[]", DoubleType()


class FloatArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Float"), "float[]", FloatType()


class BooleanArrayType(_PrimitiveArray):
    snapshot_class, name, element = _array_snapshot("Boolean"), "boolean[]", BooleanType()


class StringArrayType(_Simple):
    """``StringArraySerializer`` (``String[]``): int length, then each element as a String (null allowed)."""

    snapshot_class = ("org.apache.flink.api.common.typeutils.base.array.StringArraySerializer"
                      "$StringArraySerializerSnapshot")
    name = "String[]"

    def read(self, c: Cursor) -> list:
        n = c.count("a String[] length", 1)
        return [read_string_value(c) for _ in range(n)]

    def write(self, out: bytearray, value: Any) -> None:
        if value is None or isinstance(value, (str, bytes)):
            raise TypeError(f"Flink's String[] holds a list of str (never null itself), got {shown(value)}")
        values = list(value)
        out += _I32.pack(len(values))
        for v in values:
            StringType().write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.list_(pa.string())

    def keygroups_serializer(self) -> TypeSerializer:
        return ListSerializer(NullableSerializer(StrSerializer()))


class GenericArrayType(_Composite):
    """``GenericArraySerializer`` (an array of objects, e.g. ``Long[]``): int length, then per element a boolean
    (false: null) and the element; as a Python list."""

    snapshot_class = "org.apache.flink.api.common.typeutils.base.GenericArraySerializerSnapshot"
    name = "Array"
    outer_version = 1

    def __init__(self, element: FlinkType, component_class: str) -> None:
        self.element = element
        self.component_class = component_class

    def nested(self) -> tuple[FlinkType, ...]:
        return (self.element,)

    def write_outer_payload(self, out: bytearray) -> None:
        out += encode_modified_utf8(self.component_class)

    def read(self, c: Cursor) -> list:
        n = c.count("an array's length", 1)
        return [self.element.read(c) if c.boolean("an array element's non-null flag") else None for _ in range(n)]

    def write(self, out: bytearray, value: Any) -> None:
        values = list(value)
        out += _I32.pack(len(values))
        for v in values:
            out.append(0 if v is None else 1)
            if v is not None:
                self.element.write(out, v)

    def arrow_type(self) -> pa.DataType:
        return pa.list_(self.element.arrow_type())

    def keygroups_serializer(self) -> TypeSerializer:
        return ListSerializer(NullableSerializer(self.element.keygroups_serializer()))

    def __repr__(self) -> str:
        return f"{self.element!r}[]"


class EnumType(FlinkType):
    """``EnumSerializer``: the value's position (int) in the enum's constants as the snapshot lists them (Flink keeps
    that order across restores); as the constant's name, a str."""

    snapshot_class = "org.apache.flink.api.common.typeutils.base.EnumSerializer$EnumSerializerSnapshot"
    name = "Enum"
    length = 4

    def __init__(self, enum_class: str, constants: tuple[str, ...]) -> None:
        self.enum_class = enum_class
        self.constants = tuple(constants)
        self._ordinals = {n: i for i, n in enumerate(self.constants)}

    def write_outer(self, out: bytearray) -> None:
        out += encode_modified_utf8(self.enum_class) + _I32.pack(len(self.constants))
        for n in self.constants:
            out += encode_modified_utf8(n)

    def read(self, c: Cursor) -> str:
        i = c.i32("an enum ordinal")
        if not 0 <= i < len(self.constants):
            raise c.fail(f"ordinal {i} of enum {plain(self.enum_class)}, which has {len(self.constants)} constants")
        return self.constants[i]

    def write(self, out: bytearray, value: Any) -> None:
        i = self._ordinals.get(value) if isinstance(value, str) else None
        if i is None:
            listed = ", ".join(plain(n) for n in self.constants[:20]) + (", ..." if len(self.constants) > 20 else "")
            raise ValueError(f"{shown(value)} is not a constant of enum {plain(self.enum_class)} ({listed})")
        out += _I32.pack(i)

    def arrow_type(self) -> pa.DataType:
        return pa.string()

    def keygroups_serializer(self) -> TypeSerializer:
        return StrSerializer()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnumType) and (self.enum_class, self.constants) == (other.enum_class, other.constants)

    def __hash__(self) -> int:
        return hash((EnumType, self.enum_class))

    def __repr__(self) -> str:
        return f"Enum({plain(self.enum_class.rpartition('.')[2])})"


# ---------------------------------------------------------------------------------------------- not mapped

class UnsupportedType(FlinkType):
    """A Flink serializer whose snapshot keygroups reads to its end (so the rest of the header reads on, and
    ``skip_states`` / ``--skip-state`` can leave its state out) but whose values it neither reads nor writes: Kryo,
    POJO, Avro, a Flink ``Value`` type, BigInteger, java.time types, ... Reading its values, its Arrow type, import
    and export each raise ``UnsupportedFlinkTypeError`` naming the state, the serializer, the user's class and what
    to do. Its snapshot is kept as Flink wrote it (written back byte for byte)."""

    name = "Unsupported"

    def __init__(self, snapshot_class: str, version: int, kind: str, user_class: str | None = None,
                 fields: tuple[tuple[str, FlinkType | None], ...] = ()) -> None:
        self.snapshot_class_name = snapshot_class
        self.version = version
        #: what the serializer is, for people: "Kryo", "POJO", "Avro", "a Flink Value type", ...
        self.kind = kind
        #: the user's class (a POJO's, Kryo's generic type, an Avro record's), when the snapshot names it
        self.user_class = user_class
        #: a POJO's fields: (name, type, None when keygroups does not know the field's serializer either)
        self.fields = fields
        #: the snapshot's payload as Flink wrote it
        self.payload = b""
        #: the state it belongs to (set once the state meta info is read)
        self.state: str | None = None
        #: the serializer of the job's keys (set by the keyed header): no state can be skipped around it
        self.is_key = False

    @property
    def serializer_class(self) -> str:
        """Flink's serializer class: the snapshot class's outer class, or its name without ``Snapshot``."""
        cls = self.snapshot_class_name
        if "$" in cls:
            return cls.rsplit("$", 1)[0]
        return cls[: -len("Snapshot")] if cls.endswith("Snapshot") else cls

    def refusal(self) -> UnsupportedFlinkTypeError:
        of = f" of {plain(self.user_class)}" if self.user_class else ""
        if self.is_key:
            return UnsupportedFlinkTypeError(
                f"the job is keyed by Flink's {plain(self.serializer_class)}{of} ({self.kind}), which keygroups can "
                "neither read nor hash as Flink does, so none of the operator's keyed state can be imported: key the "
                "job by a basic type, String, byte[] or a Tuple of them (convert the state in Flink first, with the "
                "State Processor API)")
        state = f"state {shown(self.state)}" if self.state else "this state"
        skip = (f"--skip-state {plain(self.state)} (Python: skip_states=[{shown(self.state)}])" if self.state
                else "--skip-state NAME (Python: skip_states=[NAME])")
        return UnsupportedFlinkTypeError(
            f"{state} uses Flink's {plain(self.serializer_class)}{of} ({self.kind}), which keygroups cannot read or "
            "write (it maps Flink's basic types, String, byte[], primitive arrays, enums, Tuple, Row, List, Map, "
            "Nullable and TTL). Convert the state in Flink first (the State Processor API: read it and write it back "
            f"as a Row, Tuple or basic type), or leave it out: {skip}")

    def read(self, c: Cursor) -> Any:
        raise self.refusal()

    def write(self, out: bytearray, value: Any) -> None:
        raise self.refusal()

    def arrow_type(self) -> pa.DataType:
        raise self.refusal()

    def keygroups_serializer(self) -> TypeSerializer:
        raise self.refusal()

    def write_snapshot(self, out: bytearray) -> None:
        out += encode_modified_utf8(self.snapshot_class_name)
        out += _I32.pack(self.version)
        out += self.payload

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnsupportedType) and (self.snapshot_class_name, self.version, self.payload) == (
            other.snapshot_class_name, other.version, other.payload)

    def __hash__(self) -> int:
        return hash((UnsupportedType, self.snapshot_class_name))

    def __repr__(self) -> str:
        short = self.serializer_class.rpartition(".")[2]
        return f"{plain(short)}({plain(self.user_class)})" if self.user_class else plain(short)


def unsupported_types(t: FlinkType) -> list[UnsupportedType]:
    """Every ``UnsupportedType`` in ``t``'s tree (``t`` itself, a List's element, a Map's value, ...)."""
    if isinstance(t, UnsupportedType):
        return [t]
    return [u for n in t.nested() for u in unsupported_types(n)]


# ---------------------------------------------------------------------------------------------- reading snapshots

def _read_composite(c: Cursor, cls_name: str, outer_versions: frozenset[int]) -> tuple[int, Cursor]:
    magic = c.i32("a composite serializer snapshot's magic number")
    if magic != COMPOSITE_MAGIC:
        raise c.fail(f"{cls_name}: magic number {magic}, expected {COMPOSITE_MAGIC} (a CompositeTypeSerializer"
                     "Snapshot); snapshots older than Flink 1.8's format are not supported")
    outer = c.i32("the outer snapshot version")
    if outer not in outer_versions:
        raise UnsupportedFlinkTypeError(f"{cls_name} outer snapshot version {outer} is not supported (known: "
                                        f"{sorted(outer_versions)})")
    return outer, c


def _read_nested_list(c: Cursor, cls_name: str, expected: int | None = None) -> list[FlinkType]:
    magic = c.i32("the nested serializers' magic number")
    if magic != NESTED_MAGIC:
        raise c.fail(f"{cls_name}: nested serializers magic number {magic}, expected {NESTED_MAGIC}")
    version = c.i32("the nested serializers' version")
    if version != NESTED_VERSION:
        raise c.fail(f"{cls_name}: nested serializers version {version}, expected {NESTED_VERSION}")
    n = c.count("the number of nested serializers", 6, limit=1024)
    if expected is not None and n != expected:
        raise c.fail(f"{cls_name} has {n} nested serializers, expected {expected}")
    return [read_nested_snapshot(c) for _ in range(n)]


def _read_simple_payload(c: Cursor, cls_name: str, version: int) -> None:
    """``SimpleTypeSerializerSnapshot.readSnapshot``: version 3 has no payload, version 2 the serializer's class."""
    if version == 2:
        c.utf(f"{cls_name}'s serializer class")
    elif version != 3:
        raise UnknownSerializerSnapshotError(cls_name, f"{cls_name} version {version} is not supported (2 or 3)")


def _simple(cls: type[FlinkType]) -> Callable[[Cursor, int], FlinkType]:
    def reader(c: Cursor, version: int) -> FlinkType:
        _read_simple_payload(c, cls.snapshot_class, version)
        return cls()
    return reader


def _tuple(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "TupleSerializerSnapshot", frozenset({2}))
    tuple_class = c.utf("the tuple class")
    return TupleType(tuple(_read_nested_list(c, "TupleSerializerSnapshot")), tuple_class)


def _row(c: Cursor, version: int) -> FlinkType:
    outer, _ = _read_composite(c, "RowSerializerSnapshot", frozenset({3, 4}))
    # RowSerializerSnapshot.readOuterSnapshot: version 3 always wrote RowKind bits; version 4 stores the flag
    supports_row_kind = c.boolean("RowSerializer's supportsRowKind") if outer >= 4 else True
    return RowType(tuple(_read_nested_list(c, "RowSerializerSnapshot")), supports_row_kind)


def _list(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "ListSerializerSnapshot", frozenset({1}))
    return ListType(*_read_nested_list(c, "ListSerializerSnapshot", 1))


def _map(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "MapSerializerSnapshot", frozenset({1}))
    return MapType(*_read_nested_list(c, "MapSerializerSnapshot", 2))


def _nullable(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "NullableSerializerSnapshot", frozenset({2}))
    padding = c.i32("a Nullable's padding length")
    if not 0 <= padding <= 1024:
        raise c.fail(f"a Nullable's padding length is {padding}")
    (inner,) = _read_nested_list(c, "NullableSerializerSnapshot", 1)
    if padding and padding != inner.length:
        raise c.fail(f"a Nullable's padding of {padding} bytes differs from its {inner!r}'s length {inner.length}")
    return NullableType(inner, padding)


def _ttl(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "TtlSerializerSnapshot", frozenset({2}))
    ts, value = _read_nested_list(c, "TtlSerializerSnapshot", 2)
    if not isinstance(ts, LongType):
        raise c.fail(f"a TtlSerializer's timestamp serializer is {ts!r}, not Long")
    return TtlType(value)


def _timer(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "TimerSerializerSnapshot", frozenset({2}))
    return TimerType(*_read_nested_list(c, "TimerSerializerSnapshot", 2))


_SIMPLE_TYPES: tuple[type[FlinkType], ...] = (
    LongType, IntType, ShortType, ByteType, DoubleType, FloatType, BooleanType, CharType, StringType, BytesType,
    VoidNamespaceType, TimeWindowType)

#: Every serializer snapshot class keygroups reads, to the reader of its payload (given the snapshot version).
SNAPSHOT_READERS: dict[str, Callable[[Cursor, int], FlinkType]] = {
    **{t.snapshot_class: _simple(t) for t in _SIMPLE_TYPES},
    TupleType.snapshot_class: _tuple,
    RowType.snapshot_class: _row,
    ListType.snapshot_class: _list,
    MapType.snapshot_class: _map,
    NullableType.snapshot_class: _nullable,
    TtlType.snapshot_class: _ttl,
    TimerType.snapshot_class: _timer,
}

class UnknownSerializerSnapshotError(UnsupportedFlinkTypeError):
    """A serializer snapshot keygroups cannot even skip (a user's serializer, an unknown version): its payload has
    no length prefix, so nothing after it in the same header can be read."""

    def __init__(self, snapshot_class: str, message: str) -> None:
        super().__init__(message)
        self.snapshot_class = snapshot_class


OPTIONAL_MAP_HEADER = 0x4F2C69A3D70   # LinkedOptionalMapSerializer.HEADER


def _optional_map(c: Cursor, what: str) -> list[tuple[str, memoryview | None, memoryview | None]]:
    """``LinkedOptionalMapSerializer.readOptionalMap``: long header, int size, then per entry the key's name and an
    optional length-prefixed frame for the key and one for the value (so each entry skips exactly)."""
    header = c.i64(f"{what}'s header")
    if header != OPTIONAL_MAP_HEADER:
        raise c.fail(f"{what}'s header is {header:#x}, expected {OPTIONAL_MAP_HEADER:#x}")
    out = []
    for _ in range(c.count(f"{what}'s size", 4, limit=1 << 16)):
        name = c.utf(f"a name in {what}")
        frames: list[memoryview | None] = []
        for part in ("key", "value"):
            if c.boolean(f"{what} {shown(name)}'s {part} presence flag"):
                n = c.i32(f"{what} {shown(name)}'s {part} frame length")
                frames.append(c.take(n, f"{what} {shown(name)}'s {part} frame"))
            else:
                frames.append(None)
        out.append((name, frames[0], frames[1]))
    return out


def _framed_snapshot(frame: memoryview | None, where: str) -> FlinkType | None:
    """A nested snapshot inside a frame of an optional map (a POJO field's serializer): None when keygroups does not
    know it. The frame's length bounds it, so an unknown one costs nothing after it."""
    if frame is None:
        return None
    c = Cursor(frame, where)
    try:
        t = read_nested_snapshot(c)
    except (UnsupportedFlinkTypeError, CorruptSnapshotError):
        return None
    return t if not c.remaining else None


def _kryo(c: Cursor, version: int) -> FlinkType:
    cls = "org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializerSnapshot"
    if version != 2:
        raise UnknownSerializerSnapshotError(cls, f"{cls} version {version} is not supported (only 2)")
    user_class = c.utf("Kryo's type class")
    for what in ("Kryo's registrations", "Kryo's default serializers", "Kryo's default serializer classes"):
        _optional_map(c, what)
    return UnsupportedType(cls, version, "Kryo: a generic type Flink could not analyse", user_class)


def _pojo(c: Cursor, version: int) -> FlinkType:
    cls = "org.apache.flink.api.java.typeutils.runtime.PojoSerializerSnapshot"
    if version != 2:
        raise UnknownSerializerSnapshotError(cls, f"{cls} version {version} is not supported (only 2, Flink 1.8+)")
    pojo_class = c.utf("the POJO class")
    fields = tuple((name, _framed_snapshot(value, c.where))
                   for name, _, value in _optional_map(c, f"POJO {plain(pojo_class)}'s fields"))
    _optional_map(c, f"POJO {plain(pojo_class)}'s registered subclasses")
    _optional_map(c, f"POJO {plain(pojo_class)}'s other subclasses")
    return UnsupportedType(cls, version, "a POJO", pojo_class, fields)


def _avro(c: Cursor, version: int) -> FlinkType:
    cls = "org.apache.flink.formats.avro.typeutils.AvroSerializerSnapshot"
    if version == 1:
        runtime_type = None
    elif version == 2:
        runtime_type = c.utf("the Avro runtime type")
    else:
        raise UnknownSerializerSnapshotError(cls, f"{cls} version {version} is not supported (1 or 2)")
    schema = c.utf("the Avro schema")
    return UnsupportedType(cls, version, f"Avro, schema {shown(schema)}", runtime_type)


def _generic_type(cls: str, kind: str) -> Callable[[Cursor, int], FlinkType]:
    """``GenericTypeSerializerSnapshot`` (ValueSerializer, CopyableValueSerializer): version 2, the type class."""
    def reader(c: Cursor, version: int) -> FlinkType:
        if version != 2:
            raise UnknownSerializerSnapshotError(cls, f"{cls} version {version} is not supported (only 2)")
        return UnsupportedType(cls, version, kind, c.utf("the type class"))
    return reader


def _simple_unsupported(cls: str, kind: str) -> Callable[[Cursor, int], FlinkType]:
    def reader(c: Cursor, version: int) -> FlinkType:
        _read_simple_payload(c, cls, version)
        return UnsupportedType(cls, version, kind)
    return reader


def _enum(c: Cursor, version: int) -> FlinkType:
    if version != 3:
        raise UnknownSerializerSnapshotError(EnumType.snapshot_class, f"{EnumType.snapshot_class} version {version} "
                                             "is not supported (only 3, Flink 1.11+)")
    enum_class = c.utf("the enum class")
    constants = tuple(c.utf("an enum constant") for _ in range(c.count("the enum's number of constants", 2)))
    if len(set(constants)) != len(constants):
        twice = sorted({n for n in constants if constants.count(n) > 1})
        raise c.fail(f"enum {plain(enum_class)} lists constant {plain(twice[0])} twice")
    return EnumType(enum_class, constants)


def _generic_array(c: Cursor, version: int) -> FlinkType:
    _read_composite(c, "GenericArraySerializerSnapshot", frozenset({1}))
    component = c.utf("the array's component class")
    (element,) = _read_nested_list(c, "GenericArraySerializerSnapshot", 1)
    return GenericArrayType(element, component)


def _base_unsupported(java: str, kind: str) -> tuple[str, Callable[[Cursor, int], FlinkType]]:
    cls = _base(java)
    return cls, _simple_unsupported(cls, kind)


#: Flink's serializers whose snapshot (a ``SimpleTypeSerializerSnapshot``) keygroups skips but whose values it does
#: not map: their states list, and refuse by name when used.
_UNSUPPORTED_SIMPLE = dict([
    _base_unsupported("BigInt", "java.math.BigInteger"),
    _base_unsupported("BigDec", "java.math.BigDecimal"),
    _base_unsupported("Date", "java.util.Date"),
    _base_unsupported("Instant", "java.time.Instant"),
    _base_unsupported("LocalDate", "java.time.LocalDate"),
    _base_unsupported("LocalDateTime", "java.time.LocalDateTime"),
    _base_unsupported("LocalTime", "java.time.LocalTime"),
    _base_unsupported("SqlDate", "java.sql.Date"),
    _base_unsupported("SqlTime", "java.sql.Time"),
    _base_unsupported("SqlTimestamp", "java.sql.Timestamp"),
    _base_unsupported("Void", "java.lang.Void"),
    _base_unsupported("Bitmap", "a Flink Bitmap"),
    _base_unsupported("Variant", "a Flink Variant"),
    *(_base_unsupported(f"{t}Value", f"Flink's {t}Value") for t in (
        "Boolean", "Byte", "Char", "Double", "Float", "Int", "Long", "Null", "Short", "String")),
    (_array_snapshot("Char"), _simple_unsupported(_array_snapshot("Char"), "char[]")),
    ("org.apache.flink.runtime.state.JavaSerializer$JavaSerializerSnapshot",
     _simple_unsupported("org.apache.flink.runtime.state.JavaSerializer$JavaSerializerSnapshot",
                         "Java serialization")),
    ("org.apache.flink.streaming.api.windowing.windows.GlobalWindow$Serializer$GlobalWindowSerializerSnapshot",
     _simple_unsupported("org.apache.flink.streaming.api.windowing.windows.GlobalWindow$Serializer"
                         "$GlobalWindowSerializerSnapshot", "a GlobalWindow namespace")),
])

SNAPSHOT_READERS.update({
    **{t.snapshot_class: _simple(t) for t in (LongArrayType, IntArrayType, ShortArrayType, DoubleArrayType,
                                                FloatArrayType, BooleanArrayType, StringArrayType)},
    EnumType.snapshot_class: _enum,
    GenericArrayType.snapshot_class: _generic_array,
    "org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializerSnapshot": _kryo,
    "org.apache.flink.api.java.typeutils.runtime.PojoSerializerSnapshot": _pojo,
    "org.apache.flink.formats.avro.typeutils.AvroSerializerSnapshot": _avro,
    "org.apache.flink.api.java.typeutils.runtime.ValueSerializer$ValueSerializerSnapshot": _generic_type(
        "org.apache.flink.api.java.typeutils.runtime.ValueSerializer$ValueSerializerSnapshot", "a Flink Value type"),
    "org.apache.flink.api.java.typeutils.runtime.CopyableValueSerializer$CopyableValueSerializerSnapshot":
        _generic_type("org.apache.flink.api.java.typeutils.runtime.CopyableValueSerializer"
                      "$CopyableValueSerializerSnapshot", "a Flink CopyableValue type"),
    **_UNSUPPORTED_SIMPLE,
})


def read_nested_snapshot(c: Cursor) -> FlinkType:
    """``TypeSerializerSnapshot.readVersionedSnapshot``: class name, version, payload. A serializer keygroups skips
    but does not map becomes an ``UnsupportedType`` holding its payload; one it cannot skip raises
    ``UnknownSerializerSnapshotError``."""
    cls_name = c.utf("a serializer snapshot class")
    version = c.i32(f"{plain(cls_name)}'s version")
    reader = SNAPSHOT_READERS.get(cls_name)
    if reader is None:
        raise UnknownSerializerSnapshotError(
            plain(cls_name), f"serializer snapshot {plain(cls_name)} is one keygroups does not know (a user's "
            "serializer?): its payload has no length prefix, so it cannot be skipped either")
    start = c.pos
    t = reader(c, version)
    if isinstance(t, UnsupportedType):
        t.payload = bytes(c.data[start:c.pos])
    return t


def read_serializer_snapshot(c: Cursor) -> FlinkType:
    """``TypeSerializerSnapshotSerializationUtil.readSerializerSnapshot``: format version 2, then the snapshot."""
    proxy = c.i32("the serializer snapshot format version")
    if proxy != SNAPSHOT_PROXY_VERSION:
        raise UnsupportedFlinkTypeError(f"serializer snapshot format version {proxy} (Flink before 1.8) is not "
                                        f"supported; only {SNAPSHOT_PROXY_VERSION}")
    return read_nested_snapshot(c)


def write_serializer_snapshot(out: bytearray, t: FlinkType) -> None:
    out += _I32.pack(SNAPSHOT_PROXY_VERSION)
    t.write_snapshot(out)


# ---------------------------------------------------------------------------------------------- keygroups → Flink

def flink_type_for(snapshot: SerializerSnapshot, what: str) -> FlinkType:
    """The Flink serializer that holds the values of keygroups' serializer ``snapshot`` exactly; refuses (by name)
    those Flink cannot hold."""
    ident = snapshot.identifier
    simple = {"int64": LongType, "int32": IntType, "float64": DoubleType, "bool": BooleanType, "str": StringType,
              "bytes": BytesType}
    if ident in simple:
        return simple[ident]()
    nested = snapshot.nested
    if ident == "tuple":
        return TupleType(tuple(flink_type_for(s, what) for s in nested))
    if ident == "list":
        return ListType(flink_type_for(nested[0], what))
    if ident == "map":
        return MapType(flink_type_for(nested[0], what), flink_type_for(nested[1], what))
    if ident == "nullable":
        return NullableType(flink_type_for(nested[0], what))
    if ident == RecordSerializer.identifier and snapshot.version == RecordSerializer.version:
        return flink_row_for(rs.RecordType.from_json(snapshot.config.get("schema")), what)
    raise UnsupportedFlinkTypeError(
        f"{what} uses {snapshot.describe()}, which Flink cannot hold: only Int64/Int32/Float64/Bool/Str/Bytes, "
        "records (as Row) and Tuple, List, Map and Nullable of them are exported (a ValueSerializer or pickled value "
        "has no Flink type; give the state a typed serializer, or leave it out with skip_states / --skip-state)")


_FLINK_SCALARS: dict[rs.DataType, type[FlinkType]] = {
    rs.INT64: LongType, rs.INT32: IntType, rs.INT16: ShortType, rs.INT8: ByteType, rs.FLOAT64: DoubleType,
    rs.FLOAT32: FloatType, rs.BOOL: BooleanType, rs.STRING: StringType, rs.BINARY: BytesType}


def is_tuple_shaped(record: rs.RecordType) -> bool:
    """Whether a record has a Flink Tuple's shape, as ``tuple_record_type`` makes one: 1 to 25 fields named ``f0``,
    ``f1``, ... in order, none nullable (a Row's fields always are)."""
    return 1 <= len(record.fields) <= 25 and all(f.name == f"f{i}" and not f.nullable
                                                 for i, f in enumerate(record.fields))


def flink_row_for(record: rs.RecordType, what: str) -> RowType | TupleType:
    """The Flink ``Row`` (with RowKind, as Flink 2's ``RowTypeInfo`` makes it) of a keygroups record schema: every
    field nullable in Flink, nested records as nested Rows; field names are kept on the RowType (Flink does not
    store them). A record of a Tuple's shape (``is_tuple_shaped``: how a Flink Tuple was imported) goes back as that
    Tuple, nested ones too. Date, timestamp and decimal fields have no Flink serializer keygroups writes: refused by
    name."""
    def field(t: rs.DataType, path: str) -> FlinkType:
        scalar = _FLINK_SCALARS.get(t)
        if scalar is not None:
            return scalar()
        if isinstance(t, rs.ListType):
            return ListType(field(t.element, path + "[]"))
        if isinstance(t, rs.MapType):
            return MapType(field(t.key, path + " key"), field(t.value, path + " value"))
        if isinstance(t, rs.RecordType):
            fields = tuple(field(f.type, f"{path}.{f.name}" if path else f.name) for f in t.fields)
            return TupleType(fields) if is_tuple_shaped(t) else RowType(fields, names=t.names)
        raise UnsupportedFlinkTypeError(
            f"{what}: record field {path!r} is {t.ddl()}, which keygroups does not export to Flink (records export "
            "as Row of bigint, int, smallint, tinyint, double, float, boolean, string, binary, arrays, maps and "
            "nested records); skip the state or store the field as one of those")
    row = field(record, "")
    assert isinstance(row, (RowType, TupleType))
    return row


def narrow_to(flink: FlinkType, wider: FlinkType) -> bool:
    """True when values of keygroups' serializer for ``wider`` can be written as ``flink`` (same shape, with Short/
    Byte/Float/Character narrowed from Int32/Float64/Str): used to export to the types of an original savepoint."""
    if type(flink) is type(wider):
        return all(narrow_to(a, b) for a, b in zip(flink.nested(), wider.nested())) \
            and len(flink.nested()) == len(wider.nested())
    if isinstance(flink, TupleType) and isinstance(wider, RowType):    # a Tuple as a record: by position
        return len(flink.fields) == len(wider.fields) and all(
            narrow_to(a, b) or a == b for a, b in zip(flink.fields, wider.fields))
    if isinstance(flink, NullableType) and not isinstance(wider, NullableType):   # a Row's field, nullable anyway
        return narrow_to(flink.inner, wider) or flink.inner == wider
    if isinstance(flink, _PrimitiveArray) and isinstance(wider, ListType):    # long[] imported as a List
        return narrow_to(flink.element, wider.element) or flink.element == wider.element
    if isinstance(flink, (StringArrayType, GenericArrayType)) and isinstance(wider, ListType):
        element = flink.element if isinstance(flink, GenericArrayType) else StringType()
        inner = wider.element.inner if isinstance(wider.element, NullableType) else wider.element
        return element == inner or narrow_to(element, inner)
    pairs = {(ShortType, IntType), (ByteType, IntType), (FloatType, DoubleType), (CharType, StringType),
             (EnumType, StringType)}     # an enum imported as its constants' names
    return (type(flink), type(wider)) in pairs


def with_record_names(template: FlinkType, derived: FlinkType) -> FlinkType:
    """``template`` (a type of the original Flink savepoint, which ``narrow_to`` accepted for ``derived``) with the
    field names of ``derived``'s Rows: Flink does not store names, keygroups' records have them."""
    if isinstance(template, RowType) and isinstance(derived, RowType):
        return RowType(tuple(map(with_record_names, template.fields, derived.fields)), template.supports_row_kind,
                       derived.names)
    if isinstance(template, TupleType) and isinstance(derived, (TupleType, RowType)):
        return TupleType(tuple(map(with_record_names, template.fields, derived.fields)), template.tuple_class,
                         derived.names)
    if isinstance(template, ListType) and isinstance(derived, ListType):
        return ListType(with_record_names(template.element, derived.element))
    if isinstance(template, MapType) and isinstance(derived, MapType):
        return MapType(with_record_names(template.key, derived.key), with_record_names(template.value, derived.value))
    if isinstance(template, NullableType):
        inner = derived.inner if isinstance(derived, NullableType) else derived
        return NullableType(with_record_names(template.inner, inner), template.padding)
    return template


def flink_value(t: FlinkType, v: Any) -> Any:
    """A keygroups value as the FlinkType ``t`` writes it: records (dicts) as tuples in the field order of a Row or
    Tuple, inside lists, maps and TTL values too (TTL as a (value, timestamp) pair)."""
    if v is None:
        return None
    if isinstance(t, TtlType):
        value, ts = v
        return TtlValue(flink_value(t.value, value), ts)
    if isinstance(t, (RowType, TupleType)):
        if isinstance(v, dict):
            v = record_values(t.names, v, f"a {t.name}")
        if len(v) != len(t.fields):
            raise ValueError(f"{t!r} needs {len(t.fields)} fields, got {shown(v)}")
        return tuple(flink_value(f, x) for f, x in zip(t.fields, v))
    if isinstance(t, ListType) and isinstance(t.element, _Composite):
        return [flink_value(t.element, x) for x in v]
    if isinstance(t, MapType) and isinstance(t.value, _Composite):
        return {k: flink_value(t.value, x) for k, x in v.items()}
    if isinstance(t, NullableType):
        return flink_value(t.inner, v)
    return v
