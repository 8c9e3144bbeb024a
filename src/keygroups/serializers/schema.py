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

Schemas come from a Spark DDL string, a Spark ``StructType`` or its JSON, a ``pyarrow`` schema or a dataclass: see
:mod:`keygroups.serializers.schema_formats` (``record_type`` picks by argument). A schema nests at most
:data:`MAX_TYPE_DEPTH` levels (deeper ones are refused when declared). It is stored in the serializer snapshot as JSON
(:meth:`RecordType.to_json`) with each field's aliases; defaults are not stored: they belong to the schema a restore
registers (the reader's schema, as in Avro).

Schema evolution (:func:`resolve`) follows Avro's resolution rules: the new (reader's) schema's aliases rewrite the
names of the stored (writer's) schema — a stored field named like an alias of a new field is that field — and then
fields match by name. So two fields can swap names (each listing the other's old name), and a field renamed away
frees its old name for a new field, which takes its default. An alias the stored schema already lists on that same
field is not applied again (the state was written after that rename), so restoring with the schema that wrote it
reads it as it is, however often. Fields may be added (with a default; a nullable field defaults to null), dropped,
reordered, widened (int8 → int16 → int32 → int64, float32 → float64, any int → float32/float64, a non-null field →
nullable), turned from string into binary (UTF-8) or from binary into string (the bytes must be UTF-8) and renamed
through an alias; nested records, list elements and map values evolve by the same rules. Anything else is refused
with a message that names the field, its old and new types and what is allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
from collections.abc import Callable
from typing import Any

from keygroups.errors import CorruptSnapshotError


class _NoDefault:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_DEFAULT"

    def __reduce__(self) -> str:
        # pickled by reference, so that it is still THE NO_DEFAULT after pickle or cloudpickle (Spark ships a
        # function's serializers with cloudpickle): ``default is NO_DEFAULT`` decides whether a field has a default
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
        if not isinstance(self.nullable, bool):
            raise TypeError(f"field {self.name!r}: nullable must be a bool, got {self.nullable!r}")
        aliases = self.aliases
        if isinstance(aliases, (str, bytes)) or not all(isinstance(a, str) and a for a in aliases):
            raise TypeError(f"field {self.name!r}: aliases must be a tuple of the field's old names (non-empty "
                            f"strs), got {aliases!r}")
        object.__setattr__(self, "aliases", tuple(dict.fromkeys(a for a in aliases if a != self.name)))

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
        claimed: dict[str, str] = {}
        for f in fields:
            for alias in f.aliases:
                other = claimed.setdefault(alias, f.name)
                if other != f.name:
                    raise ValueError(f"fields {other!r} and {f.name!r} both list the alias {alias!r}: a stored field "
                                     f"{alias!r} can become one of them only; keep the alias on one field")

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
        """The stored form: names, types, nullability and aliases (no defaults or classes). A field's ``aliases``
        key appears only when it has some, so a schema without aliases is stored as before aliases were stored."""
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
    fields = []
    for f in t.fields:
        d = {"name": f.name, "type": _type_json(f.type), "nullable": f.nullable}
        if f.aliases:
            d["aliases"] = list(f.aliases)
        fields.append(d)
    return {"type": "record", "fields": fields}


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
            return RecordType(tuple(Field(f["name"], _type_from_json(f["type"], depth + 1), _flag(f["nullable"]),
                                          aliases=_aliases(f.get("aliases", [])))
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


def _aliases(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise ValueError(f"aliases must be a list of names, got {v!r}")
    return tuple(v)


def type_depth(t: DataType) -> int:
    """How deep ``t`` nests: the most steps (into a field's type, a list's element, a map's key or value) from ``t``
    to a type inside it (0 for a scalar, 1 for a record of scalars), counted as :meth:`RecordType.from_json` counts.
    Iterative, so a schema built by hand however deep is measured without recursion."""
    deepest = 0
    stack: list[tuple[DataType, int]] = [(t, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, RecordType):
            stack.extend((f.type, depth + 1) for f in node.fields)
        elif isinstance(node, ListType):
            stack.append((node.element, depth + 1))
        elif isinstance(node, MapType):
            stack += [(node.key, depth + 1), (node.value, depth + 1)]
    return deepest


def check_depth(t: DataType, what: str = "a record schema") -> None:
    """ValueError when ``t`` nests deeper than :data:`MAX_TYPE_DEPTH` levels: a stored schema that deep would not
    restore (snapshots are untrusted, so their recursion is bounded), so it is refused when it is declared."""
    depth = type_depth(t)
    if depth > MAX_TYPE_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep (records, lists and maps inside one another); at most "
                         f"{MAX_TYPE_DEPTH} levels are allowed: flatten it, or keep the deep part as a binary field")


@dataclasses.dataclass(frozen=True)
class Factory:
    """A dataclass field's ``default_factory``: called for each value that needs the default."""

    make: Callable[[], Any]


def default_value(f: Field) -> Any:
    """The value a record read from state written before ``f`` existed gets for it."""
    if isinstance(f.default, Factory):
        return f.default.make()
    return None if f.default is NO_DEFAULT else f.default



# ---- schema evolution -------------------------------------------------------------------------------------------

#: What may change between the stored schema and the one registered now (named in every refusal).
ALLOWED_CHANGES = ("add a field (it needs a default unless it is nullable), drop a field, reorder fields, widen a "
                   "type (tinyint → smallint → int → bigint, float → double, any integer → float or double, not "
                   "null → nullable), string → binary and binary → string (UTF-8), rename a field by listing its "
                   "old name in the new field's aliases (Avro's rule: the aliases rename the stored fields, then "
                   "fields match by name)")


class SchemaChangeRefused(ValueError):
    """A change :func:`resolve` does not allow: ``field`` (a dotted path), old and new type, and why."""

    def __init__(self, field: str, old: str, new: str, why: str, *, message: str | None = None) -> None:
        self.field, self.old, self.new, self.why = field, old, new, why
        super().__init__(message if message is not None else f"field {field!r} changed from {old} to {new}: {why}")


class ValueNotConvertible(ValueError):
    """A stored value that a change :func:`resolve` allows cannot take the new type (binary that is not UTF-8 read
    as a string): ``field`` is its dotted path. The reader that met it names the state."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"field {field!r}: {message}")


@dataclasses.dataclass(frozen=True)
class FieldSource:
    """Where one field of the new record comes from: the old field at ``index`` (converted by ``convert``), or
    (``index`` -1) the new field's default."""

    index: int
    convert: Callable[[Any], Any] | None
    field: Field


def stored_names(old: RecordType, new: RecordType) -> list[str]:
    """The names ``old``'s fields are read under by ``new`` (Avro's alias rewrite of the writer's schema): a field
    named like an alias of a new field is that field, unless the stored schema already lists the alias on its own
    field of the new field's name (the state was written after that rename, so the name is a new field's)."""
    claims = {alias: nf.name for nf in new.fields for alias in nf.aliases}
    if not claims:
        return list(old.names)
    by_name = {of.name: of for of in old.fields}
    out = []
    for of in old.fields:
        target = claims.get(of.name)
        done = target is not None and target in by_name and of.name in by_name[target].aliases
        out.append(of.name if target is None or done else target)
    return out


def resolve(old: RecordType, new: RecordType, path: str = "") -> list[FieldSource]:
    """How to build a ``new`` record from an ``old`` one, by Avro's resolution: the new schema's aliases rename the
    old fields (:func:`stored_names`), then fields match by name (nested records alike). One :class:`FieldSource`
    per new field. Raises :class:`SchemaChangeRefused` for anything :data:`ALLOWED_CHANGES` does not list, and when
    the renaming leaves two old fields with one name (Avro refuses that too)."""
    names = stored_names(old, new)
    old_index: dict[str, int] = {}
    for i, name in enumerate(names):
        j = old_index.setdefault(name, i)
        if j != i:
            a, b = old.fields[j].name, old.fields[i].name
            renamed = [n for n in (a, b) if n != name]
            where = f"{path}{name}"
            raise SchemaChangeRefused(
                where, f"stored fields {a!r} and {b!r}", name, "ambiguous",
                message=f"field {where!r} would read two stored fields, {a!r} and {b!r}: the alias "
                        f"{renamed[0]!r} renames a stored field to {name!r}, which the stored record already has. "
                        f"Drop one of them in one step and rename in the next, or remove the alias")
    sources = []
    for nf in new.fields:
        where = f"{path}{nf.name}"
        found = old_index.get(nf.name)
        if found is None:
            if nf.default is NO_DEFAULT and not nf.nullable:
                raise SchemaChangeRefused(where, "absent", _with_null(nf.type, nf.nullable),
                                          "a field added to stored state needs a default, or must be nullable")
            sources.append(FieldSource(-1, None, nf))
            continue
        of = old.fields[found]
        if of.nullable and not nf.nullable:
            raise SchemaChangeRefused(where, _with_null(of.type, True), _with_null(nf.type, False),
                                      "a nullable field cannot become not null (stored nulls would have no value)")
        sources.append(FieldSource(found, _converter(of.type, nf.type, where), nf))
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
        if old.name == "int64" and new.name == "float32":
            return _int_to_float32
        if old.name in INTEGERS and new.name in ("float32", "float64"):
            return float   # exact for int32 and below (the float32 encoder rounds once); int64 → double rounds once
        if old.name == "float32" and new.name == "float64":
            return None
        if old.name == "string" and new.name == "binary":
            return _utf8_bytes
        if old.name == "binary" and new.name == "string":
            return functools.partial(_utf8_text, where)
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


def _int_to_float32(v: int) -> float:
    """The float32 nearest ``v`` (ties to even), as a double: what Java's ``(float) long`` gives. ``float(v)`` first
    would round twice (to a double, then to a float) and can land one float32 step off for |v| > 2**53."""
    if -(1 << 53) <= v <= 1 << 53:
        return float(v)   # exact as a double: the encoder's one rounding to float32 is the only one
    shift = abs(v).bit_length() - 24
    q, r = divmod(abs(v), 1 << shift)
    half = 1 << (shift - 1)
    if r > half or (r == half and q & 1):
        q += 1
    return math.copysign(float(q << shift), v)


def _utf8_bytes(v: str) -> bytes:
    return v.encode("utf-8")


def _utf8_text(where: str, v: bytes) -> str:
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueNotConvertible(where, f"the stored binary value {v[:32]!r}{'...' if len(v) > 32 else ''} is "
                                         f"not UTF-8 text ({e.reason} at byte {e.start}), so it cannot be read as "
                                         "a string; restore with the field still binary") from None


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
    """Whether ``new`` reads ``old``'s bytes as they are: the same fields, types and nullability in the same order,
    and no alias of ``new`` renames a field of ``old`` (nested records alike)."""
    if old != new:
        return False
    if stored_names(old, new) != list(old.names):
        return False
    return all(_same_names(of.type, nf.type) for of, nf in zip(old.fields, new.fields))


def _same_names(old: DataType, new: DataType) -> bool:
    if isinstance(old, RecordType) and isinstance(new, RecordType):
        return is_identity(old, new)
    if isinstance(old, ListType) and isinstance(new, ListType):
        return _same_names(old.element, new.element)
    if isinstance(old, MapType) and isinstance(new, MapType):
        return _same_names(old.value, new.value)
    return True


__all__ = ["DataType", "PrimitiveType", "TimestampType", "DecimalType", "ListType", "MapType", "RecordType", "Field",
           "INT8", "INT16", "INT32", "INT64", "FLOAT32", "FLOAT64", "BOOL", "STRING", "BINARY", "DATE",
           "NO_DEFAULT", "MAX_TYPE_DEPTH", "resolve", "stored_names", "project", "FieldSource", "SchemaChangeRefused",
           "ValueNotConvertible", "ALLOWED_CHANGES", "default_value", "zone_info", "Factory", "type_depth",
           "check_depth"]
