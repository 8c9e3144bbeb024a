"""Record schemas: named, typed fields, each nullable or not, for ``RecordSerializer``.

A schema is a :class:`RecordType`: a tuple of :class:`Field` (name, type, nullable, default, aliases). Types are the
ones Spark and Arrow users know, named as Spark's DDL names them in messages:

=====================  ==========================  =================================================
type                   Python value                stored as
=====================  ==========================  =================================================
``INT8`` … ``INT64``   int (range-checked)         1, 2, 4, 8 bytes
``FLOAT32/FLOAT64``    float (ints accepted)       4, 8 bytes (one canonical NaN)
``BOOL``               bool                        1 byte
``STRING``/``BINARY``  str / bytes                 u32 length + bytes
``DATE``               datetime.date               i32 days since 1970-01-01
``TimestampType``      datetime.datetime           i64 in the type's unit (s, ms, us, ns) since the epoch
``DecimalType``        decimal.Decimal             the unscaled int: i64 (precision <= 18) or i128
``ListType``           list (tuples accepted)      u32 count + elements
``MapType``            dict                        u32 count + (key, value) pairs in the dict's order
``RecordType``         dict, tuple or dataclass    its fields in order
=====================  ==========================  =================================================

A nullable position carries one flag byte (0: null, 1: a value follows). A timestamp with a zone (``tz="UTC"``,
``"Europe/Berlin"``) is an instant: it takes timezone-aware datetimes and returns them in that zone; one without a
zone (``tz=None``, Spark's ``TIMESTAMP_NTZ``) is a wall-clock time and takes and returns naive datetimes.

Schemas come from a Spark DDL string (:func:`parse_ddl`, parsed with ``sqlglot``, no Spark needed), a Spark
``StructType`` or its JSON (:func:`from_spark_json`, duck-typed through ``jsonValue()``), a ``pyarrow`` schema
(:func:`from_arrow`) or a dataclass (:func:`from_dataclass`); :func:`record_type` picks by argument. A schema is
stored in the serializer snapshot as JSON (:meth:`RecordType.to_json`); defaults and aliases are not stored: they
belong to the schema a restore registers (the reader's schema, as in Avro).

Schema evolution (:func:`resolve`) follows Avro's resolution rules, matching fields by name (or by one of the new
field's ``aliases``): fields may be added (with a default; a nullable field defaults to null), dropped, reordered,
widened (int8 → int16 → int32 → int64, float32 → float64, any int → float32/float64, a non-null field → nullable)
and renamed through an alias; nested records, list elements and map values evolve by the same rules. Anything else is
refused with a message that names the field, its old and new types and what is allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from keygroups.errors import CorruptSnapshotError


class _NoDefault:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_DEFAULT"


#: A field without a default: adding it to a stored record is refused unless it is nullable.
NO_DEFAULT: Any = _NoDefault()

#: Deeper type nesting is refused (snapshots are untrusted JSON; recursion must stay bounded).
MAX_TYPE_DEPTH = 32


class DataType:
    """A field type. Immutable and hashable; ``str()`` gives its Spark DDL name."""

    __slots__ = ()

    def ddl(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.ddl()


@dataclasses.dataclass(frozen=True, repr=False)
class PrimitiveType(DataType):
    """int8, int16, int32, int64, float32, float64, bool, string, binary or date."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in _PRIMITIVE_DDL:
            raise ValueError(f"unknown primitive type {self.name!r}; allowed: {', '.join(_PRIMITIVE_DDL)}")

    def ddl(self) -> str:
        return _PRIMITIVE_DDL[self.name]

    def __repr__(self) -> str:
        return self.name.upper()


_PRIMITIVE_DDL = {"int8": "tinyint", "int16": "smallint", "int32": "int", "int64": "bigint", "float32": "float",
                  "float64": "double", "bool": "boolean", "string": "string", "binary": "binary", "date": "date"}

INT8 = PrimitiveType("int8")
INT16 = PrimitiveType("int16")
INT32 = PrimitiveType("int32")
INT64 = PrimitiveType("int64")
FLOAT32 = PrimitiveType("float32")
FLOAT64 = PrimitiveType("float64")
BOOL = PrimitiveType("bool")
STRING = PrimitiveType("string")
BINARY = PrimitiveType("binary")
DATE = PrimitiveType("date")

#: Integer types by width, narrowest first (the order of widening).
INTEGERS = ("int8", "int16", "int32", "int64")
TIMESTAMP_UNITS = ("s", "ms", "us", "ns")


@dataclasses.dataclass(frozen=True)
class TimestampType(DataType):
    """A point in time, stored as an i64 count of ``unit`` since the epoch. With ``tz`` (an IANA name, default UTC)
    values are timezone-aware datetimes (returned in ``tz``); with ``tz=None`` naive wall-clock datetimes."""

    unit: str = "us"
    tz: str | None = "UTC"

    def __post_init__(self) -> None:
        if self.unit not in TIMESTAMP_UNITS:
            raise ValueError(f"timestamp unit {self.unit!r} is not one of {', '.join(TIMESTAMP_UNITS)}")
        if self.tz is not None:
            if not isinstance(self.tz, str) or not self.tz:
                raise ValueError(f"timestamp zone must be an IANA zone name (e.g. 'UTC') or None, got {self.tz!r}")
            zone_info(self.tz)   # raises for an unknown zone

    def ddl(self) -> str:
        base = "timestamp" if self.tz is not None else "timestamp_ntz"
        extra = [] if self.unit == "us" else [self.unit]
        extra += [] if self.tz in (None, "UTC") else [self.tz]
        return base + (f"({', '.join(extra)})" if extra else "")


def zone_info(name: str) -> datetime.tzinfo:
    """The tzinfo of zone ``name`` (``datetime.timezone.utc`` for UTC); ValueError for an unknown zone."""
    if name in ("UTC", "Etc/UTC", "+00:00", "Z"):
        return datetime.timezone.utc
    import zoneinfo

    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}: give an IANA name such as 'UTC' or 'Europe/Berlin'") from None


@dataclasses.dataclass(frozen=True)
class DecimalType(DataType):
    """Exact decimals of at most ``precision`` digits, ``scale`` of them after the point (Spark's DecimalType)."""

    precision: int = 10
    scale: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.precision, int) and 1 <= self.precision <= 38):
            raise ValueError(f"decimal precision must be an int in [1, 38], got {self.precision!r}")
        if not (isinstance(self.scale, int) and 0 <= self.scale <= self.precision):
            raise ValueError(f"decimal scale must be an int in [0, precision={self.precision}], got {self.scale!r}")

    def ddl(self) -> str:
        return f"decimal({self.precision},{self.scale})"


@dataclasses.dataclass(frozen=True)
class ListType(DataType):
    """A list of ``element`` values (null elements only if ``element_nullable``)."""

    element: DataType
    element_nullable: bool = True

    def ddl(self) -> str:
        return f"array<{self.element.ddl()}{'' if self.element_nullable else ' not null'}>"


@dataclasses.dataclass(frozen=True)
class MapType(DataType):
    """A dict from ``key`` (never null) to ``value`` (null only if ``value_nullable``)."""

    key: DataType
    value: DataType
    value_nullable: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.key, (ListType, MapType, RecordType)):
            raise ValueError(f"map keys must be of a scalar type, got {self.key.ddl()}")

    def ddl(self) -> str:
        return f"map<{self.key.ddl()}, {self.value.ddl()}{'' if self.value_nullable else ' not null'}>"


@dataclasses.dataclass(frozen=True)
class Field:
    """One named field of a record. ``default`` fills it when a restore reads state written before the field
    existed (a nullable field defaults to null); ``aliases`` are names it had before (a rename)."""

    name: str
    type: DataType
    nullable: bool = True
    default: Any = dataclasses.field(default=NO_DEFAULT, compare=False)
    aliases: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a field name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.type, DataType):
            raise TypeError(f"field {self.name!r}: the type must be a keygroups.serializers.schema DataType, got "
                            f"{self.type!r}")
        object.__setattr__(self, "aliases", tuple(self.aliases))

    def ddl(self) -> str:
        return f"{_quote(self.name)} {self.type.ddl()}{'' if self.nullable else ' not null'}"


def _quote(name: str) -> str:
    return name if name.isidentifier() else "`" + name.replace("`", "``") + "`"


@dataclasses.dataclass(frozen=True)
class RecordType(DataType):
    """Named fields in order. ``python_class`` (not part of the type: never stored, never compared) is the class
    values of this record are built as when read (a dataclass), or None for the serializer's chosen form."""

    fields: tuple[Field, ...]
    python_class: type | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        object.__setattr__(self, "fields", fields)
        if not fields:
            raise ValueError("a record needs at least one field")
        names = [f.name for f in fields]
        for f in fields:
            if not isinstance(f, Field):
                raise TypeError(f"record fields must be Field objects, got {f!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"field name(s) {dup} appear more than once in the record")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r}; fields: {list(self.names)}")

    def ddl(self) -> str:
        return "struct<" + ", ".join(f.ddl() for f in self.fields) + ">"

    def fields_ddl(self) -> str:
        """The fields as a DDL list (``a bigint not null, b string``): the form ``parse_ddl`` reads back."""
        return ", ".join(f.ddl() for f in self.fields)

    def to_json(self) -> dict[str, Any]:
        """The stored form (no defaults, aliases or classes)."""
        return _type_json(self)

    @staticmethod
    def from_json(d: Any) -> RecordType:
        """The inverse of ``to_json``; anything malformed raises ``CorruptSnapshotError``."""
        t = _type_from_json(d, 0)
        if not isinstance(t, RecordType):
            raise CorruptSnapshotError(f"a stored record schema is not a record: {d!r:.200}")
        return t


def _type_json(t: DataType) -> Any:
    if isinstance(t, PrimitiveType):
        return t.name
    if isinstance(t, TimestampType):
        return {"type": "timestamp", "unit": t.unit, "tz": t.tz}
    if isinstance(t, DecimalType):
        return {"type": "decimal", "precision": t.precision, "scale": t.scale}
    if isinstance(t, ListType):
        return {"type": "list", "element": _type_json(t.element), "element_nullable": t.element_nullable}
    if isinstance(t, MapType):
        return {"type": "map", "key": _type_json(t.key), "value": _type_json(t.value),
                "value_nullable": t.value_nullable}
    assert isinstance(t, RecordType)
    return {"type": "record", "fields": [{"name": f.name, "type": _type_json(f.type), "nullable": f.nullable}
                                         for f in t.fields]}


def _type_from_json(d: Any, depth: int) -> DataType:
    if depth > MAX_TYPE_DEPTH:
        raise CorruptSnapshotError(f"a stored record schema nests deeper than {MAX_TYPE_DEPTH} levels")
    try:
        if isinstance(d, str):
            return PrimitiveType(d)
        if not isinstance(d, dict):
            raise ValueError(f"expected a type name or object, got {type(d).__name__}")
        kind = d.get("type")
        if kind == "timestamp":
            return TimestampType(d["unit"], d["tz"])
        if kind == "decimal":
            return DecimalType(d["precision"], d["scale"])
        if kind == "list":
            return ListType(_type_from_json(d["element"], depth + 1), _flag(d["element_nullable"]))
        if kind == "map":
            return MapType(_type_from_json(d["key"], depth + 1), _type_from_json(d["value"], depth + 1),
                           _flag(d["value_nullable"]))
        if kind == "record":
            fields = d["fields"]
            if not isinstance(fields, list):
                raise ValueError("fields must be a list")
            return RecordType(tuple(Field(f["name"], _type_from_json(f["type"], depth + 1), _flag(f["nullable"]))
                                    for f in fields))
        raise ValueError(f"unknown type {kind!r}")
    except CorruptSnapshotError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptSnapshotError(f"a stored record schema is malformed ({type(e).__name__}: {e}): {d!r:.200}") \
            from None


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"a nullable flag must be true or false, got {v!r}")
    return v


# ---- building schemas ----------------------------------------------------------------------------------------------


def record_type(schema: Any) -> RecordType:
    """A :class:`RecordType` from any of: a RecordType, a Spark DDL string, a Spark ``StructType`` (anything with
    ``jsonValue()``) or its JSON dict, a ``pyarrow.Schema`` or struct type, a dataclass (class), or a sequence of
    ``Field``s or ``(name, type, nullable)`` tuples (types as DataType objects or DDL strings)."""
    if isinstance(schema, RecordType):
        return schema
    if isinstance(schema, str):
        return parse_ddl(schema)
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return from_dataclass(schema)
    if hasattr(schema, "jsonValue"):
        return from_spark_json(schema.jsonValue())
    if isinstance(schema, Mapping) and schema.get("type") == "struct":
        return from_spark_json(schema)
    try:
        import pyarrow as pa
    except ImportError:   # pragma: no cover - pyarrow is a dependency
        pa = None
    if pa is not None and isinstance(schema, (pa.Schema, pa.StructType)):
        return from_arrow(schema)
    if isinstance(schema, Sequence) and not isinstance(schema, (bytes, bytearray)):
        return from_fields(schema)
    raise TypeError(f"cannot build a record schema from {schema!r} of type {type(schema).__name__}: give a Spark "
                    "DDL string, a StructType, a pyarrow schema, a dataclass, or a list of (name, type, nullable)")


def from_fields(fields: Sequence[Any]) -> RecordType:
    """A record from ``Field`` objects or ``(name, type)`` / ``(name, type, nullable)`` tuples, a type being a
    DataType or a DDL type string (``"bigint"``, ``"array<string>"``). Fields are nullable unless told otherwise.
    This is the constructor other formats (Flink's TupleN and Row serializers) map their fields onto."""
    out = []
    for i, f in enumerate(fields):
        if isinstance(f, Field):
            out.append(f)
            continue
        if not isinstance(f, (tuple, list)) or len(f) not in (2, 3):
            raise TypeError(f"field {i}: give a Field or a (name, type[, nullable]) tuple, got {f!r}")
        name, t = f[0], f[1]
        nullable = f[2] if len(f) == 3 else True
        if isinstance(t, str):
            t = parse_type(t)
        if not isinstance(nullable, bool):
            raise TypeError(f"field {name!r}: nullable must be a bool, got {nullable!r}")
        out.append(Field(name, t, nullable))
    return RecordType(tuple(out))


# -- Spark DDL (parsed by sqlglot: no JVM, no pyspark) --


def parse_ddl(ddl: str) -> RecordType:
    """Spark DDL → record: ``"id bigint not null, tags array<string>, at timestamp"`` or ``"struct<...>"``.

    Types as Spark names them (tinyint, smallint, int/integer, bigint/long, float/real, double, boolean, string/
    varchar/char, binary, date, timestamp (UTC instants), timestamp_ntz (naive), decimal(p, s), array<>, map<>,
    struct<>); ``not null`` and ``comment '...'`` after a field's type."""
    if not isinstance(ddl, str) or not ddl.strip():
        raise ValueError(f"a DDL schema must be a non-empty string such as 'id bigint, name string', got {ddl!r}")
    import sqlglot
    from sqlglot import exp

    text = ddl.strip()
    if text.lower().startswith("struct<") or text.lower().startswith("struct <"):
        t = parse_type(text)
        assert isinstance(t, RecordType)
        return t
    try:
        tree = sqlglot.parse_one(f"CREATE TABLE t ({text})", read="spark")
    except sqlglot.errors.ParseError as e:
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: {_first_line(e)}") from None
    schema = tree.this
    if not isinstance(schema, exp.Schema):
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: expected 'name type, ...'")
    return RecordType(tuple(_column(c, ddl) for c in schema.expressions))


def parse_type(ddl: str) -> DataType:
    """One Spark DDL type (``"array<map<string, bigint>>"``) → its DataType."""
    import sqlglot
    from sqlglot import exp

    try:
        node = exp.DataType.build(ddl, dialect="spark")
    except (sqlglot.errors.ParseError, ValueError) as e:
        raise ValueError(f"cannot parse the DDL type {ddl!r}: {_first_line(e)}") from None
    return _sqlglot_type(node, ddl)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _column(c: Any, ddl: str) -> Field:
    from sqlglot import exp

    if not isinstance(c, exp.ColumnDef) or c.args.get("kind") is None:
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: {c.sql(dialect='spark')!r} is not 'name type'")
    constraints = [k.args.get("kind") for k in c.args.get("constraints") or []]
    nullable = True
    for k in constraints:
        if isinstance(k, exp.NotNullColumnConstraint):
            nullable = bool(k.args.get("allow_null"))
        elif not isinstance(k, exp.CommentColumnConstraint):
            raise ValueError(f"in the DDL schema {ddl!r}, field {c.name!r}: only NOT NULL and COMMENT may follow "
                             f"a type, got {k.sql(dialect='spark')!r}")
    return Field(c.name, _sqlglot_type(c.args["kind"], ddl), nullable)


def _sqlglot_type(node: Any, ddl: str) -> DataType:
    from sqlglot import exp

    T = exp.DataType.Type
    simple = {T.TINYINT: INT8, T.SMALLINT: INT16, T.INT: INT32, T.BIGINT: INT64, T.FLOAT: FLOAT32,
              T.DOUBLE: FLOAT64, T.BOOLEAN: BOOL, T.TEXT: STRING, T.VARCHAR: STRING, T.CHAR: STRING,
              T.NCHAR: STRING, T.NVARCHAR: STRING, T.BINARY: BINARY, T.VARBINARY: BINARY, T.DATE: DATE}
    t = node.this
    if t in simple:
        return simple[t]
    if t in (T.TIMESTAMP, T.TIMESTAMPTZ, T.TIMESTAMPLTZ):
        return TimestampType("us", "UTC")
    if t == T.TIMESTAMPNTZ:
        return TimestampType("us", None)
    if t == T.DECIMAL:
        params = [int(p.this.this) for p in node.expressions]
        return DecimalType(*params) if params else DecimalType(10, 0)
    if t == T.ARRAY:
        return ListType(_sqlglot_type(node.expressions[0], ddl))
    if t == T.MAP:
        return MapType(_sqlglot_type(node.expressions[0], ddl), _sqlglot_type(node.expressions[1], ddl))
    if t == T.STRUCT:
        return RecordType(tuple(_column(c, ddl) for c in node.expressions))
    raise ValueError(f"in the DDL {ddl!r}: type {node.sql(dialect='spark')!r} is not supported; allowed: tinyint, "
                     "smallint, int, bigint, float, double, boolean, string, binary, date, timestamp, timestamp_ntz, "
                     "decimal(p,s), array<>, map<>, struct<>")


# -- Spark JSON schema (StructType.jsonValue()) --


def from_spark_json(d: Mapping[str, Any]) -> RecordType:
    """A Spark ``StructType``'s JSON (``jsonValue()``) → record. Spark timestamps are UTC instants, timestamp_ntz
    naive; an array's ``containsNull`` and a map's ``valueContainsNull`` become the element/value nullability."""
    t = _spark_type(d, 0)
    if not isinstance(t, RecordType):
        raise ValueError(f"a record schema must be a Spark struct, got {d!r:.200}")
    return t


_SPARK_SIMPLE = {"byte": INT8, "short": INT16, "integer": INT32, "long": INT64, "float": FLOAT32, "double": FLOAT64,
                 "boolean": BOOL, "string": STRING, "binary": BINARY, "date": DATE,
                 "timestamp": TimestampType("us", "UTC"), "timestamp_ntz": TimestampType("us", None)}


def _spark_type(d: Any, depth: int) -> DataType:
    if depth > MAX_TYPE_DEPTH:
        raise ValueError(f"a Spark schema nests deeper than {MAX_TYPE_DEPTH} levels")
    if isinstance(d, str):
        if d in _SPARK_SIMPLE:
            return _SPARK_SIMPLE[d]
        if d.startswith("decimal(") and d.endswith(")"):
            p, s = d[len("decimal("):-1].split(",")
            return DecimalType(int(p), int(s))
        if d.startswith("varchar(") or d.startswith("char("):
            return STRING
        raise ValueError(f"Spark type {d!r} is not supported in a record")
    kind = d.get("type")
    if kind == "struct":
        return RecordType(tuple(Field(f["name"], _spark_type(f["type"], depth + 1), bool(f.get("nullable", True)))
                                for f in d["fields"]))
    if kind == "array":
        return ListType(_spark_type(d["elementType"], depth + 1), bool(d.get("containsNull", True)))
    if kind == "map":
        return MapType(_spark_type(d["keyType"], depth + 1), _spark_type(d["valueType"], depth + 1),
                       bool(d.get("valueContainsNull", True)))
    raise ValueError(f"Spark type {d!r:.100} is not supported in a record")


def to_spark_json(t: DataType, nullable: bool = True) -> Any:
    """The Spark JSON form of ``t`` (the inverse of ``from_spark_json``; ``StructType.fromJson`` reads it).
    Integer widths, float32 and timestamp zones map to Spark's types (a zoned timestamp → timestamp)."""
    if isinstance(t, PrimitiveType):
        return {"int8": "byte", "int16": "short", "int32": "integer", "int64": "long", "float32": "float",
                "float64": "double", "bool": "boolean"}.get(t.name, t.name)
    if isinstance(t, TimestampType):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    if isinstance(t, DecimalType):
        return f"decimal({t.precision},{t.scale})"
    if isinstance(t, ListType):
        return {"type": "array", "elementType": to_spark_json(t.element), "containsNull": t.element_nullable}
    if isinstance(t, MapType):
        return {"type": "map", "keyType": to_spark_json(t.key), "valueType": to_spark_json(t.value),
                "valueContainsNull": t.value_nullable}
    assert isinstance(t, RecordType)
    return {"type": "struct", "fields": [{"name": f.name, "type": to_spark_json(f.type), "nullable": f.nullable,
                                          "metadata": {}} for f in t.fields]}


# -- pyarrow --


def from_arrow(schema: Any) -> RecordType:
    """A ``pyarrow.Schema`` (or struct type) → record; Arrow's nullability, units and zones are kept."""
    import pyarrow as pa

    fields = list(schema) if isinstance(schema, pa.Schema) else [schema.field(i) for i in range(schema.num_fields)]
    return RecordType(tuple(Field(f.name, _from_arrow_type(f.type, f.name), f.nullable) for f in fields))


def _from_arrow_type(t: Any, what: str) -> DataType:
    import pyarrow as pa

    pt = pa.types
    for check, ours in ((pt.is_int8, INT8), (pt.is_int16, INT16), (pt.is_int32, INT32), (pt.is_int64, INT64),
                        (pt.is_float32, FLOAT32), (pt.is_float64, FLOAT64), (pt.is_boolean, BOOL),
                        (pt.is_string, STRING), (pt.is_large_string, STRING), (pt.is_binary, BINARY),
                        (pt.is_large_binary, BINARY), (pt.is_date32, DATE), (pt.is_date64, DATE)):
        if check(t):
            return ours
    if pt.is_timestamp(t):
        return TimestampType(t.unit, t.tz)
    if pt.is_decimal(t):
        return DecimalType(t.precision, t.scale)
    if pt.is_list(t) or pt.is_large_list(t):
        return ListType(_from_arrow_type(t.value_type, what), t.value_field.nullable)
    if pt.is_map(t):
        return MapType(_from_arrow_type(t.key_type, what), _from_arrow_type(t.item_type, what),
                       t.item_field.nullable)
    if pt.is_struct(t):
        return from_arrow(t)
    raise ValueError(f"field {what!r}: Arrow type {t} is not supported in a record (allowed: ints, floats, bool, "
                     "string, binary, date, timestamp, decimal, list, map, struct)")


def to_arrow(t: DataType) -> Any:
    """The Arrow type of ``t``'s values (a record: a struct with its fields' nullability)."""
    import pyarrow as pa

    if isinstance(t, PrimitiveType):
        return {"int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
                "float32": pa.float32(), "float64": pa.float64(), "bool": pa.bool_(), "string": pa.string(),
                "binary": pa.binary(), "date": pa.date32()}[t.name]
    if isinstance(t, TimestampType):
        return pa.timestamp(t.unit, tz=t.tz)
    if isinstance(t, DecimalType):
        return pa.decimal128(t.precision, t.scale)
    if isinstance(t, ListType):
        return pa.list_(pa.field("element", to_arrow(t.element), t.element_nullable))
    if isinstance(t, MapType):
        return pa.map_(pa.field("key", to_arrow(t.key), False), pa.field("value", to_arrow(t.value),
                                                                         t.value_nullable))
    assert isinstance(t, RecordType)
    return pa.struct([pa.field(f.name, to_arrow(f.type), f.nullable) for f in t.fields])


# -- dataclasses --

_PY_TYPES: dict[Any, DataType] = {int: INT64, float: FLOAT64, bool: BOOL, str: STRING, bytes: BINARY,
             datetime.date: DATE,
             datetime.datetime: TimestampType("us", "UTC"), decimal.Decimal: DecimalType(38, 18)}


def from_dataclass(cls: type) -> RecordType:
    """A dataclass → record: one field per dataclass field, typed by its annotation: int → bigint, float → double,
    bool, str, bytes, datetime.date, datetime.datetime → UTC timestamp (µs), Decimal → decimal(38, 18) (Spark's
    inference), ``list[X]``, ``dict[K, V]``, nested dataclasses; ``Optional[X]`` / ``X | None`` is nullable, every
    other field is not. ``typing.Annotated[X, t]`` with a DataType ``t`` chooses the type (``Annotated[int, INT32]``,
    ``Annotated[Decimal, DecimalType(10, 2)]``). A field's default becomes its default for schema evolution, and
    ``field(metadata={"aliases": ("old_name",)})`` renames a field; read values are instances of the class."""
    return _dataclass_type(cls, 0)


def _dataclass_type(cls: type, depth: int) -> RecordType:
    if depth > MAX_TYPE_DEPTH:
        raise ValueError(f"dataclass {cls.__qualname__} nests deeper than {MAX_TYPE_DEPTH} levels (or contains itself)")
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, AttributeError, TypeError) as e:
        raise TypeError(f"the annotations of dataclass {cls.__qualname__} cannot be resolved ({type(e).__name__}: "
                        f"{e}); define it in an importable module, with its types imported there") from None
    fields = []
    for f in dataclasses.fields(cls):
        t, nullable = _annotation(hints[f.name], f"{cls.__qualname__}.{f.name}", depth)
        default = NO_DEFAULT
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = _Factory(f.default_factory)
        aliases = f.metadata.get("aliases", ())
        if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
            raise TypeError(f"{cls.__qualname__}.{f.name}: metadata 'aliases' must be a tuple of old field names, "
                            f"got {aliases!r}")
        fields.append(Field(f.name, t, nullable, default, tuple(aliases)))
    return RecordType(tuple(fields), python_class=cls)


@dataclasses.dataclass(frozen=True)
class _Factory:
    """A dataclass field's ``default_factory``: called for each value that needs the default."""

    make: Callable[[], Any]


def default_value(f: Field) -> Any:
    """The value a record read from state written before ``f`` existed gets for it."""
    if isinstance(f.default, _Factory):
        return f.default.make()
    return None if f.default is NO_DEFAULT else f.default


def _annotation(a: Any, what: str, depth: int) -> tuple[DataType, bool]:
    origin = typing.get_origin(a)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(a)
        chosen = [x for x in extra if isinstance(x, DataType)]
        _, nullable = _annotation(base, what, depth)
        if chosen:
            return chosen[0], nullable
        return _annotation(base, what, depth)
    if origin in (typing.Union, types.UnionType):
        args = [x for x in typing.get_args(a) if x is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{what}: a union {a} is not a record field type; only Optional[X] (X | None) is")
        t, _ = _annotation(args[0], what, depth)
        return t, True
    if origin in (list, Sequence, typing.List):   # noqa: UP006
        (element,) = tuple(typing.get_args(a)) or (None,)
        if element is None:
            raise TypeError(f"{what}: give the element type, e.g. list[int]")
        t, nullable = _annotation(element, what + "[]", depth + 1)
        return ListType(t, nullable), False
    if origin in (dict, Mapping, typing.Dict):   # noqa: UP006
        key_value = typing.get_args(a)
        if len(key_value) != 2:
            raise TypeError(f"{what}: give the key and value types, e.g. dict[str, int]")
        k, knull = _annotation(key_value[0], what + " key", depth + 1)
        if knull:
            raise TypeError(f"{what}: map keys cannot be None (Optional key type {key_value[0]})")
        v, vnull = _annotation(key_value[1], what + " value", depth + 1)
        return MapType(k, v, vnull), False
    if isinstance(a, type) and dataclasses.is_dataclass(a):
        return _dataclass_type(a, depth + 1), False
    if a in _PY_TYPES:
        return _PY_TYPES[a], False
    raise TypeError(f"{what}: annotation {a!r} has no record type; allowed: int, float, bool, str, bytes, "
                    "datetime.date, datetime.datetime, decimal.Decimal, list[X], dict[K, V], Optional[X], nested "
                    "dataclasses, and Annotated[X, <DataType>] to choose a width")


# ---- schema evolution -------------------------------------------------------------------------------------------

#: What may change between the stored schema and the one registered now (named in every refusal).
ALLOWED_CHANGES = ("add a field (it needs a default unless it is nullable), drop a field, reorder fields, widen a "
                   "type (tinyint → smallint → int → bigint, float → double, any integer → float or double, not "
                   "null → nullable), rename a field by listing its old name in the new field's aliases")


class SchemaChangeRefused(ValueError):
    """A change :func:`resolve` does not allow: ``field`` (a dotted path), old and new type, and why."""

    def __init__(self, field: str, old: str, new: str, why: str) -> None:
        self.field, self.old, self.new, self.why = field, old, new, why
        super().__init__(f"field {field!r} changed from {old} to {new}: {why}")


@dataclasses.dataclass(frozen=True)
class FieldSource:
    """Where one field of the new record comes from: the old field at ``index`` (converted by ``convert``), or
    (``index`` -1) the new field's default."""

    index: int
    convert: Callable[[Any], Any] | None
    field: Field


def resolve(old: RecordType, new: RecordType, path: str = "") -> list[FieldSource]:
    """How to build a ``new`` record from an ``old`` one (Avro's resolution, matching by name or alias): one
    :class:`FieldSource` per new field. Raises :class:`SchemaChangeRefused` for anything :data:`ALLOWED_CHANGES`
    does not list."""
    old_index = {f.name: i for i, f in enumerate(old.fields)}
    sources = []
    for nf in new.fields:
        where = f"{path}{nf.name}"
        matches = [old_index[n] for n in (nf.name, *nf.aliases) if n in old_index]
        if not matches:
            if nf.default is NO_DEFAULT and not nf.nullable:
                raise SchemaChangeRefused(where, "absent", _with_null(nf.type, nf.nullable),
                                          "a field added to stored state needs a default, or must be nullable")
            sources.append(FieldSource(-1, None, nf))
            continue
        of = old.fields[matches[0]]
        if of.nullable and not nf.nullable:
            raise SchemaChangeRefused(where, _with_null(of.type, True), _with_null(nf.type, False),
                                      "a nullable field cannot become not null (stored nulls would have no value)")
        sources.append(FieldSource(matches[0], _converter(of.type, nf.type, where), nf))
    return sources


def _with_null(t: DataType, nullable: bool) -> str:
    return t.ddl() + ("" if nullable else " not null")


def _converter(old: DataType, new: DataType, where: str) -> Callable[[Any], Any] | None:
    """None when values of ``old`` are values of ``new`` as they are; a function converting one otherwise."""
    if isinstance(old, PrimitiveType) and isinstance(new, PrimitiveType):
        if old == new:
            return None
        if old.name in INTEGERS and new.name in INTEGERS and INTEGERS.index(old.name) < INTEGERS.index(new.name):
            return None
        if old.name in INTEGERS and new.name in ("float32", "float64"):
            return float
        if old.name == "float32" and new.name == "float64":
            return None
    elif isinstance(old, RecordType) and isinstance(new, RecordType):
        sources = resolve(old, new, where + ".")
        if _identity(sources, len(old.fields)):
            return None
        return lambda v: project(v, sources)
    elif isinstance(old, ListType) and isinstance(new, ListType):
        if old.element_nullable and not new.element_nullable:
            raise SchemaChangeRefused(where, old.ddl(), new.ddl(), "nullable elements cannot become not null")
        element = _converter(old.element, new.element, where + "[]")
        if element is None:
            return None
        return lambda v: [None if e is None else element(e) for e in v]
    elif isinstance(old, MapType) and isinstance(new, MapType):
        if old.key != new.key:
            raise SchemaChangeRefused(where, old.ddl(), new.ddl(), "map keys cannot change type")
        if old.value_nullable and not new.value_nullable:
            raise SchemaChangeRefused(where, old.ddl(), new.ddl(), "nullable map values cannot become not null")
        conv = _converter(old.value, new.value, where + "{}")
        if conv is None:
            return None
        return lambda v: {k: None if x is None else conv(x) for k, x in v.items()}
    elif old == new:
        return None
    raise SchemaChangeRefused(where, old.ddl(), new.ddl(), "this change of type is not a widening")


def _identity(sources: list[FieldSource], old_count: int) -> bool:
    return len(sources) == old_count and all(s.index == i and s.convert is None for i, s in enumerate(sources))


def project(old_value: tuple[Any, ...], sources: list[FieldSource]) -> tuple[Any, ...]:
    """A record read with the old schema (as a tuple, nested records too) → the new record as a tuple."""
    out = []
    for s in sources:
        if s.index < 0:
            out.append(default_value(s.field))
        else:
            v = old_value[s.index]
            out.append(v if v is None or s.convert is None else s.convert(v))
    return tuple(out)


def is_identity(old: RecordType, new: RecordType) -> bool:
    """Whether ``new`` reads ``old``'s bytes as they are: the same fields, types and nullability in the same order."""
    return old == new


__all__ = ["DataType", "PrimitiveType", "TimestampType", "DecimalType", "ListType", "MapType", "RecordType", "Field",
           "INT8", "INT16", "INT32", "INT64", "FLOAT32", "FLOAT64", "BOOL", "STRING", "BINARY", "DATE",
           "NO_DEFAULT", "record_type", "from_fields", "parse_ddl", "parse_type", "from_spark_json", "to_spark_json",
           "from_arrow", "to_arrow", "from_dataclass", "resolve", "project", "FieldSource", "SchemaChangeRefused",
           "ALLOWED_CHANGES", "default_value", "zone_info"]
