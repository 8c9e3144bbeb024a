"""Record schemas from and to the formats users have them in: a Spark DDL string (parsed with ``sqlglot``: no JVM,
no pyspark), a Spark ``StructType`` or its JSON (duck-typed through ``jsonValue()``), a ``pyarrow`` schema, a
dataclass (fields and annotations), or a list of ``(name, type, nullable)`` fields; :func:`record_type` picks by
argument. The types themselves live in :mod:`keygroups.serializers.schema`.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from keygroups.serializers.schema import (
    BINARY,
    BOOL,
    DATE,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    MAX_TYPE_DEPTH,
    NO_DEFAULT,
    STRING,
    DataType,
    DecimalType,
    Factory,
    Field,
    ListType,
    MapType,
    PrimitiveType,
    RecordType,
    TimestampType,
)


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


_ALLOWED_TYPES = ("tinyint, smallint, int, bigint, float, double, boolean, string, binary, date, timestamp, "
                  "timestamp_ntz, decimal(p,s), array<>, map<>, struct<>")


def parse_ddl(ddl: str) -> RecordType:
    """Spark DDL → record: ``"id bigint not null, tags array<string>, at timestamp"`` or ``"struct<...>"``.

    Types as Spark names them (tinyint, smallint, int/integer, bigint/long, float/real, double, boolean, string/
    varchar/char, binary, date, timestamp (UTC instants), timestamp_ntz (naive), decimal(p, s), array<>, map<>,
    struct<>); after a field's type ``not null``, ``comment '...'`` and ``default <literal>`` (as Spark 4 writes a
    column's default: the value a record stored before the field existed reads for it; see :func:`sql_default` for
    the literals)."""
    if not isinstance(ddl, str) or not ddl.strip():
        raise ValueError(f"a DDL schema must be a non-empty string such as 'id bigint, name string', got {ddl!r}")
    import sqlglot
    from sqlglot import exp

    text = ddl.strip()
    _check_no_empty_field(text, ddl)
    if text.lower().startswith("struct<") or text.lower().startswith("struct <"):
        t = parse_type(text)
        assert isinstance(t, RecordType)
        return t
    try:
        tree = sqlglot.parse_one(f"CREATE TABLE t ({text})", read="spark")
    except sqlglot.errors.TokenError as e:   # an unterminated quote or comment
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: {_first_line(e)} (a quote left open?)") from None
    except sqlglot.errors.ParseError as e:
        where = (e.errors or [{}])[0].get("highlight")
        near = f" at {where!r} (an unknown type, or a typo?)" if where else ""
        raise ValueError(f"cannot parse the DDL schema {ddl!r}{near}: {_first_line(e)}; a schema is 'name type, "
                         f"...' with types {_ALLOWED_TYPES}") from None
    except RecursionError:
        raise _too_deep(ddl) from None
    schema = tree.this
    if not isinstance(schema, exp.Schema):
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: expected 'name type, ...'")
    return RecordType(tuple(_column(c, ddl, 1) for c in schema.expressions))


def parse_type(ddl: str) -> DataType:
    """One Spark DDL type (``"array<map<string, bigint>>"``) → its DataType."""
    import sqlglot
    from sqlglot import exp

    _check_no_empty_field(ddl, ddl)
    try:
        node = exp.DataType.build(ddl, dialect="spark")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError, ValueError) as e:
        raise ValueError(f"cannot parse the DDL type {ddl!r}: {_first_line(e)}") from None
    except RecursionError:
        raise _too_deep(ddl) from None
    return _sqlglot_type(node, ddl, 0)


def _too_deep(ddl: str) -> ValueError:
    return ValueError(f"the DDL schema {ddl[:80]!r}{'...' if len(ddl) > 80 else ''} nests too deeply to parse; a record "
                      f"schema nests at most {MAX_TYPE_DEPTH} levels (records, lists and maps inside one another)")


def _check_no_empty_field(text: str, ddl: str) -> None:
    """ValueError for an empty field: two commas in a row, or a comma first or last in a field list (sqlglot skips
    them, so ``"a int,, ,"`` would read as ``"a int"``)."""
    import sqlglot

    try:
        tokens = sqlglot.Dialect.get_or_raise("spark").tokenize(text)
    except sqlglot.errors.TokenError:
        return   # the parser names what is wrong
    T = sqlglot.tokens.TokenType
    opening = (T.L_PAREN, T.LT)
    closing = (T.R_PAREN, T.GT)
    previous = None
    for tok in [*tokens, None]:
        kind = None if tok is None else tok.token_type
        after_comma = previous is not None and previous.token_type == T.COMMA
        if (kind == T.COMMA and (previous is None or previous.token_type in (T.COMMA, *opening))) or (
                after_comma and (kind is None or kind in closing)):
            raise ValueError(f"the DDL schema {ddl!r} has an empty field (two commas in a row, or a comma at the "
                             "start or end of a field list); a schema is 'name type, ...', e.g. 'id bigint, name "
                             "string'")
        previous = tok


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _column(c: Any, ddl: str, depth: int) -> Field:
    from sqlglot import exp

    if not isinstance(c, exp.ColumnDef) or c.args.get("kind") is None:
        raise ValueError(f"cannot parse the DDL schema {ddl!r}: {c.sql(dialect='spark')!r} is not 'name type'")
    constraints = [k.args.get("kind") for k in c.args.get("constraints") or []]
    nullable = True
    default_expression = None
    for k in constraints:
        if isinstance(k, exp.NotNullColumnConstraint):
            nullable = bool(k.args.get("allow_null"))
        elif isinstance(k, exp.DefaultColumnConstraint):
            default_expression = k.this
        elif not isinstance(k, exp.CommentColumnConstraint):
            raise ValueError(f"in the DDL schema {ddl!r}, field {c.name!r}: only NOT NULL, DEFAULT and COMMENT may "
                             f"follow a type, got {k.sql(dialect='spark')!r}")
    t = _sqlglot_type(c.args["kind"], ddl, depth)
    default = NO_DEFAULT
    if default_expression is not None:
        default = _literal(default_expression, t, f"in the DDL schema {ddl!r}, the DEFAULT of field {c.name!r}")
    return Field(c.name, t, nullable, default)


def sql_default(text: str, t: DataType, what: str = "a default") -> Any:
    """The Python value of a Spark SQL default ``text`` (``"'x'"``, ``"-5"``, ``"DATE'2024-01-01'"``) for a field of
    type ``t``: literals only (NULL, true/false, numbers, strings, X'hex' for binary, DATE'...' and TIMESTAMP'...'
    (or a string) for dates and timestamps, ``CAST(<literal> AS <type>)`` as Spark writes a column's default,
    ``array(...)`` and ``map(k, v, ...)`` of literals); ValueError for anything else (an expression such as
    ``current_date()`` has no fixed value)."""
    import sqlglot

    try:
        node = sqlglot.parse_one(text, read="spark")
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError) as e:
        raise ValueError(f"{what}: cannot parse {text!r} ({_first_line(e)})") from None
    return _literal(node, t, what)


def _literal(node: Any, t: DataType, what: str) -> Any:
    from sqlglot import exp

    sql = node.sql(dialect="spark")
    refuse = ValueError(f"{what}: {sql} is not a literal of type {t.ddl()}; a default is a literal (NULL, true, 42, "
                        "1.5, 'text', X'0A', DATE'2024-01-01', TIMESTAMP'2024-01-01 00:00:00', array(...), "
                        "map(...))")
    if isinstance(node, exp.Paren):
        return _literal(node.this, t, what)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Neg):
        value = _literal(node.this, t, what)
        if isinstance(value, bool) or not isinstance(value, (int, float, decimal.Decimal)):
            raise refuse
        return -value
    if isinstance(node, exp.HexString):
        return bytes.fromhex(node.this)
    if isinstance(node, exp.Cast):   # DATE'...', CAST(5 AS BIGINT) (Spark's EXISTS_DEFAULT): the field's type decides
        return _literal(node.this, t, what)
    if isinstance(node, exp.Literal):
        if node.is_string:
            return _from_text(node.this, t, refuse)
        return _number(node.this, t, refuse)
    if isinstance(node, exp.Array) and isinstance(t, ListType):
        return [_literal(e, t.element, what) for e in node.expressions]
    if isinstance(node, exp.VarMap) and isinstance(t, MapType):
        keys, values = node.args["keys"].expressions, node.args["values"].expressions
        return {_literal(k, t.key, what): _literal(v, t.value, what) for k, v in zip(keys, values)}
    raise refuse


def _from_text(text: str, t: DataType, refuse: ValueError) -> Any:
    """A string literal as a value of ``t``: the text itself, its UTF-8 bytes, or a date or timestamp it spells."""
    try:
        if t == DATE:
            return datetime.date.fromisoformat(text.strip())
        if isinstance(t, TimestampType):
            value = datetime.datetime.fromisoformat(text.strip())
            if t.tz is not None and value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)   # Spark's session zone in keygroups: UTC
            return value
    except ValueError:
        raise refuse from None
    if t == BINARY:
        return text.encode("utf-8")
    if t == STRING:
        return text
    raise refuse


def _number(text: str, t: DataType, refuse: ValueError) -> Any:
    if isinstance(t, DecimalType):
        return decimal.Decimal(text)
    if isinstance(t, PrimitiveType) and t.name in ("float32", "float64"):
        return float(text)
    if isinstance(t, PrimitiveType) and t.name in ("int8", "int16", "int32", "int64"):
        try:
            return int(text)
        except ValueError:
            raise refuse from None
    raise refuse


def _sqlglot_type(node: Any, ddl: str, depth: int) -> DataType:
    from sqlglot import exp

    if depth > MAX_TYPE_DEPTH:
        raise _too_deep(ddl)
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
        return ListType(_sqlglot_type(node.expressions[0], ddl, depth + 1))
    if t == T.MAP:
        return MapType(_sqlglot_type(node.expressions[0], ddl, depth + 1),
                       _sqlglot_type(node.expressions[1], ddl, depth + 1))
    if t == T.STRUCT:
        return RecordType(tuple(_column(c, ddl, depth + 1) for c in node.expressions))
    raise ValueError(f"in the DDL {ddl!r}: type {node.sql(dialect='spark')!r} is not supported; allowed: "
                     f"{_ALLOWED_TYPES}")


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
        return RecordType(tuple(_spark_field(f, depth) for f in d["fields"]))
    if kind == "array":
        return ListType(_spark_type(d["elementType"], depth + 1), bool(d.get("containsNull", True)))
    if kind == "map":
        return MapType(_spark_type(d["keyType"], depth + 1), _spark_type(d["valueType"], depth + 1),
                       bool(d.get("valueContainsNull", True)))
    raise ValueError(f"Spark type {d!r:.100} is not supported in a record")


#: Where Spark 4 keeps a column's default in a StructField's metadata: the value rows written before the column existed
#: read (what a record field's default is), and the one new rows get.
SPARK_DEFAULT_KEYS = ("EXISTS_DEFAULT", "CURRENT_DEFAULT")


def _spark_field(f: Mapping[str, Any], depth: int) -> Field:
    t = _spark_type(f["type"], depth + 1)
    metadata = f.get("metadata") or {}
    default = NO_DEFAULT
    for key in SPARK_DEFAULT_KEYS:
        if isinstance(metadata.get(key), str):
            default = sql_default(metadata[key], t, f"the {key} of Spark field {f['name']!r}")
            break
    return Field(f["name"], t, bool(f.get("nullable", True)), default)


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


def from_arrow(schema: Any, _depth: int = 0) -> RecordType:
    """A ``pyarrow.Schema`` (or struct type) → record; Arrow's nullability, units and zones are kept."""
    import pyarrow as pa

    fields = list(schema) if isinstance(schema, pa.Schema) else [schema.field(i) for i in range(schema.num_fields)]
    return RecordType(tuple(Field(f.name, _from_arrow_type(f.type, f.name, _depth + 1), f.nullable) for f in fields))


def _from_arrow_type(t: Any, what: str, depth: int) -> DataType:
    import pyarrow as pa

    if depth > MAX_TYPE_DEPTH:
        raise ValueError(f"field {what!r}: the Arrow schema nests deeper than {MAX_TYPE_DEPTH} levels (records, lists "
                         "and maps inside one another), the most a record schema may")
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
        return ListType(_from_arrow_type(t.value_type, what, depth + 1), t.value_field.nullable)
    if pt.is_map(t):
        return MapType(_from_arrow_type(t.key_type, what, depth + 1), _from_arrow_type(t.item_type, what, depth + 1),
                       t.item_field.nullable)
    if pt.is_struct(t):
        return from_arrow(t, depth)
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
        if not _missing(f.default):
            default = f.default
        elif not _missing(f.default_factory):
            default = Factory(f.default_factory)  # type: ignore[arg-type]  # not MISSING: a factory
        aliases = f.metadata.get("aliases", ())
        if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
            raise TypeError(f"{cls.__qualname__}.{f.name}: metadata 'aliases' must be a tuple of old field names, "
                            f"got {aliases!r}")
        fields.append(Field(f.name, t, nullable, default, tuple(aliases)))
    return RecordType(tuple(fields), python_class=cls)


def _missing(value: Any) -> bool:
    """Whether a dataclass field's default (or factory) is ``dataclasses.MISSING``: by type too, because a dataclass
    that cloudpickle ships by value (one of a script's ``__main__``) comes back with a copy of MISSING."""
    return value is dataclasses.MISSING or type(value) is type(dataclasses.MISSING)


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


__all__ = ["record_type", "from_fields", "parse_ddl", "parse_type", "sql_default", "from_spark_json", "to_spark_json",
           "from_arrow", "to_arrow", "from_dataclass", "SPARK_DEFAULT_KEYS"]
