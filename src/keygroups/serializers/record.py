"""``RecordSerializer``: records of named, typed fields, with schema evolution on restore.

Build one from a Spark DDL string, a Spark ``StructType``, a ``pyarrow`` schema, a dataclass, or a list of
``(name, type, nullable)`` fields (:meth:`RecordSerializer.from_fields`; see :mod:`keygroups.serializers.schema` for
the types and their values)::

    RecordSerializer("item string not null, quantity int not null, price decimal(10,2), added timestamp")
    RecordSerializer(CartLine)                           # a dataclass: values come back as CartLine instances
    RecordSerializer(spark_df.schema, form="tuple")      # a StructType, values as tuples

Values go in as dicts (field name → value; a missing key is null), tuples or lists (fields in order), or any object
with the fields as attributes (dataclass instances, namedtuples, Spark ``Row``s); they come out in the chosen
``form``: ``"dict"`` (the default), ``"tuple"``, or the dataclass the schema was built from (nested dataclasses too).
A value that does not fit is refused on write with ``TypeError``/``ValueError`` naming the field and its type
(:meth:`RecordSerializer.check` checks one without making its bytes: the state backends call it on every write).

Bytes: the fields in order, each nullable one behind a flag byte, no names (format in ``_native/records.pyx``):
smaller than ``ValueSerializer``'s self-describing form, and compiled both ways. Equal records give equal bytes
(one NaN), except that a map field is written in its dict's order: do not use records that hold maps as keys.

Evolution: the snapshot stores the schema (with its aliases). On restore, a changed schema is resolved with Avro's
rules (see :func:`keygroups.serializers.schema.resolve`: the new schema's aliases rename the stored fields, then
fields match by name; add with a default, drop, reorder, widen, string ↔ binary): the state is then read with a
reader that decodes the old bytes into the new shape, and every backend rewrites it with the new schema in its next
snapshot (a full one for that state), so a checkpoint's chains never mix shapes. A change the rules do not allow
raises ``StateMigrationError`` naming the state, the field, both types and the changes that are allowed.

A serializer pickles (pickle, cloudpickle: Spark ships functions so) as its schema with defaults and aliases, and its
form; the copy equals it and behaves alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keygroups._native import records as _records
from keygroups.errors import KeyGroupsError
from keygroups.serializers.base import AFTER_MIGRATION, AS_IS, INCOMPATIBLE, TypeSerializer
from keygroups.serializers.compatibility import Compatibility
from keygroups.serializers.schema import (
    ALLOWED_CHANGES,
    BINARY,
    BOOL,
    FLOAT64,
    INT32,
    INT64,
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
    SchemaChangeRefused,
    TimestampType,
    ValueNotConvertible,
    check_depth,
    is_identity,
    project,
    resolve,
    zone_info,
)
from keygroups.serializers.schema_formats import from_fields, record_type
from keygroups.serializers.snapshot import SerializerSnapshot

FORMS = ("dict", "tuple")

_PRIMITIVE_KINDS = {"int8": _records.INT8, "int16": _records.INT16, "int32": _records.INT32, "int64": _records.INT64,
                    "float32": _records.FLOAT32, "float64": _records.FLOAT64, "bool": _records.BOOL,
                    "string": _records.STRING, "binary": _records.BINARY, "date": _records.DATE}
_UNITS = {"s": 0, "ms": 1, "us": 2, "ns": 3}


def _node(t: DataType, nullable: bool, path: str, form: str | type) -> Any:
    """The compiled node of one position: a field, a list element, a map key or value."""
    what = f"field {path!r} ({t.ddl()}{'' if nullable else ' not null'})" if path else "the record"
    if isinstance(t, PrimitiveType):
        return _records.Node(_PRIMITIVE_KINDS[t.name], nullable, what)
    if isinstance(t, TimestampType):
        return _records.Node(_records.TIMESTAMP, nullable, what, unit=_UNITS[t.unit],
                             tz=None if t.tz is None else zone_info(t.tz))
    if isinstance(t, DecimalType):
        return _records.Node(_records.DECIMAL, nullable, what, precision=t.precision, scale=t.scale)
    if isinstance(t, ListType):
        return _records.Node(_records.LIST, nullable, what, (_node(t.element, t.element_nullable, path + "[]", form),))
    if isinstance(t, MapType):
        return _records.Node(_records.MAP, nullable, what, (_node(t.key, False, path + " key", form),
                                                             _node(t.value, t.value_nullable, path + " value", form)))
    assert isinstance(t, RecordType)
    prefix = path + "." if path else ""
    children = tuple(_node(f.type, f.nullable, prefix + f.name, form) for f in t.fields)
    if callable(form) and not isinstance(form, (str, type)):   # a factory: every record level is built by it
        return _records.Node(_records.RECORD, nullable, what, children, t.names, _records.FACTORY_FORM, form)
    cls = t.python_class if form not in FORMS and t.python_class is not None else None
    if cls is not None:
        return _records.Node(_records.RECORD, nullable, what, children, t.names, _records.CLASS_FORM, cls)
    record_form = _records.TUPLE_FORM if form == "tuple" else _records.DICT_FORM
    return _records.Node(_records.RECORD, nullable, what, children, t.names, record_form)


def _form_of(schema: Any, form: Any, record: RecordType) -> Any:
    if callable(form) and not isinstance(form, type):
        return form   # a factory from a record's dict (keygroups.spark.row_records builds Spark Rows with one)
    if form is None:
        return record.python_class if record.python_class is not None else "dict"
    if isinstance(form, str):
        if form not in FORMS:
            raise ValueError(f"form must be 'dict', 'tuple' or a dataclass, got {form!r}")
        return form
    if isinstance(form, type) and dataclasses.is_dataclass(form):
        if record.python_class is not form:
            raise ValueError(f"form={form.__qualname__} needs the schema to come from that dataclass: pass "
                             f"RecordSerializer({form.__qualname__})")
        return form
    raise TypeError(f"form must be 'dict', 'tuple' or the schema's dataclass, got {form!r}")


def _check_defaults(t: DataType, node: Any, path: str) -> None:
    """ValueError when a field's default (anywhere in ``t``) is not a value of the field: found when the schema is
    declared, not when a restore first needs the default."""
    if isinstance(t, RecordType):
        prefix = path + "." if path else ""
        for f, child in zip(t.fields, node.children):
            if f.default is not NO_DEFAULT and not isinstance(f.default, Factory):
                try:
                    child.check(f.default)
                except (TypeError, ValueError, OverflowError) as e:
                    raise ValueError(f"the default of field {prefix + f.name!r} ({f.default!r}) is not a value of the "
                                     f"field: {e}") from None
            _check_defaults(f.type, child, prefix + f.name)
    elif isinstance(t, ListType):
        _check_defaults(t.element, node.children[0], path + "[]")
    elif isinstance(t, MapType):
        _check_defaults(t.value, node.children[1], path + " value")


def _without_classes(t: Any) -> Any:
    """``t`` with no ``python_class`` anywhere in it (defaults and aliases kept)."""
    if isinstance(t, RecordType):
        return RecordType(tuple(dataclasses.replace(f, type=_without_classes(f.type)) for f in t.fields))
    if isinstance(t, ListType):
        return dataclasses.replace(t, element=_without_classes(t.element))
    if isinstance(t, MapType):
        return dataclasses.replace(t, value=_without_classes(t.value))
    return t


class RecordSerializer(TypeSerializer):
    """Records of named, typed fields; see the module docs.

    ``schema``: a Spark DDL string, a ``StructType`` (or its JSON), a ``pyarrow.Schema``, a dataclass, a
    :class:`~keygroups.serializers.schema.RecordType`, or a list of fields. ``form``: how records are returned,
    ``"dict"``, ``"tuple"``, (the default for a dataclass schema) the dataclass, or a picklable function that
    builds each record (nested ones too) from its dict (``keygroups.spark.row_records`` returns Spark Rows so).
    """

    identifier = "record"
    version = 1
    is_immutable = False

    def __init__(self, schema: Any, *, form: Any = None) -> None:
        self.schema: RecordType = record_type(schema)
        check_depth(self.schema)
        self.form: Any = _form_of(schema, form, self.schema)
        if not isinstance(self.form, type):   # no classes: pickles (to Spark executors) without the user's modules
            self.schema = _without_classes(self.schema)
        node = _node(self.schema, False, "", self.form)
        _check_defaults(self.schema, node, "")
        self._node = node
        # the compiled methods shadow the Python ones on the instance: one call less per value
        self.__dict__.update(serialize=node.encode, deserialize=node.decode, serialize_many=node.encode_many,
                             deserialize_many=node.decode_many, check=node.check)

    @classmethod
    def from_fields(cls, fields: Sequence[Any], *, form: str | None = None) -> RecordSerializer:
        """A record of ``fields``: ``(name, type)`` or ``(name, type, nullable)`` tuples (a type is a DataType of
        :mod:`keygroups.serializers.schema` or a Spark DDL type string such as ``"bigint"`` or ``"array<string>"``)
        or ``Field`` objects. Fields are nullable unless told otherwise. Other formats (Flink's TupleN and Row
        serializers) map their fields onto this constructor."""
        return cls(from_fields(fields), form=form)

    def serialize(self, value: Any) -> bytes:
        return self._node.encode(value)

    def check(self, value: Any) -> None:
        """Raise the ``TypeError``/``ValueError`` (naming the field) that :meth:`serialize` would raise for ``value``,
        without making its bytes (compiled: the encoder writes into a scratch buffer). The state backends call it on
        every write of a record, so a value that does not fit is refused where it is written."""
        self._node.check(value)

    def deserialize(self, data: bytes | memoryview) -> Any:
        return self._node.decode(data)

    def serialize_many(self, values: Sequence[Any]) -> tuple[bytes, Any]:
        return self._node.encode_many(values)

    def deserialize_many(self, data: bytes | memoryview, offsets: Any) -> list[Any]:
        return self._node.decode_many(data, offsets)

    def copy(self, value: Any) -> Any:
        # a deep copy through the codec: faster than copy.deepcopy, and the copy has the record's exact form
        return self._node.decode(self._node.encode(value))

    # -- snapshot and evolution ------------------------------------------------------------------------------------

    def snapshot_config(self) -> dict[str, Any]:
        return {"schema": self.schema.to_json()}

    @classmethod
    def restore(cls, snapshot: SerializerSnapshot, nested: tuple[TypeSerializer, ...]) -> TypeSerializer:
        """The serializer that wrote ``snapshot``: its schema, values as dicts (the classes are not stored)."""
        from keygroups.errors import StateMigrationError

        if snapshot.version != cls.version:
            raise StateMigrationError(f"RecordSerializer format v{snapshot.version} is not known to this code "
                                      f"(it reads v{cls.version}); restore with the keygroups version that wrote it")
        return cls(RecordType.from_json(snapshot.config.get("schema")))

    def compatibility_with(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        """As is for the same schema; after migration when Avro's rules resolve the old schema to this one (the
        reason lists what changed), or when the old state is a ``TupleSerializer`` of as many fields that map onto
        this record's fields in order (tuple state becoming record state); incompatible otherwise, naming the field
        and the allowed changes."""
        if old.identifier == "tuple":
            as_record = tuple_as_record(old, self.schema)
            if as_record is None:
                return INCOMPATIBLE, (f"RecordSerializer cannot read data written by {old.describe()}: a tuple becomes "
                                      f"a record only with one field per tuple element ({len(self.schema.fields)} "
                                      f"here, {len(old.nested)} there) of built-in typed serializers")
            try:
                resolve(as_record, self.schema)
            except SchemaChangeRefused as e:
                return INCOMPATIBLE, f"the tuple's elements are this record's fields in order, and {e}"
            return AFTER_MIGRATION, f"{old.describe()} values become records {self.schema.ddl()}, field by field"
        if old.identifier != self.identifier:
            return INCOMPATIBLE, (f"RecordSerializer cannot read data written by {old.describe()}: record state "
                                  "starts with a record serializer or a tuple serializer (write the old state into a "
                                  "new state to convert it)")
        outcome, why = self.version_compatibility(old.version)
        if outcome is not AS_IS:
            return outcome, why
        stored = RecordType.from_json(old.config.get("schema"))
        if is_identity(stored, self.schema):
            return AS_IS, "same schema"
        try:
            resolve(stored, self.schema)
        except SchemaChangeRefused as e:
            return INCOMPATIBLE, str(e)
        return AFTER_MIGRATION, f"the stored schema {stored.ddl()} is read into {self.schema.ddl()}"

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer:
        """Reads bytes written with ``old`` (a record schema this one resolves, or a tuple) into this shape."""
        if old.identifier == "tuple":
            as_record = tuple_as_record(old, self.schema)
            assert as_record is not None   # checked by compatibility_with
            return RecordMigrationReader(as_record, self, old.restore_serializer(), old)
        return RecordMigrationReader(RecordType.from_json(old.config.get("schema")), self, old_snapshot=old)

    def refusal_message(self, state_name: str, role: str, old: SerializerSnapshot, why: str) -> str:
        stored = RecordType.from_json(old.config["schema"]).ddl() if old.identifier == self.identifier else (
            old.describe())
        return (f"State {state_name!r} cannot be restored with the new {role} schema {self.schema.ddl()}: {why}. "
                f"The stored {role} schema is {stored}. Allowed changes: {ALLOWED_CHANGES}. Register a schema that "
                "follows these rules, or keep the old one.")

    @classmethod
    def describe_stored(cls, snapshot: SerializerSnapshot) -> str:
        """``RecordSerializer('a bigint, b string')`` for a stored snapshot (the schema as DDL)."""
        try:
            return f"RecordSerializer({RecordType.from_json(snapshot.config.get('schema')).fields_ddl()!r})"
        except KeyGroupsError:
            return "RecordSerializer(<unreadable schema>)"

    def __reduce__(self) -> tuple:
        form = self.form
        return (_rebuild, (form if isinstance(form, type) else self.schema, form))

    def __repr__(self) -> str:
        return f"RecordSerializer({self.schema.fields_ddl()!r})"


class _TupleDecoder:
    """A record node read as tuples, with the serializer method names the migration reader calls."""

    def __init__(self, node: Any) -> None:
        self.deserialize = node.decode
        self.deserialize_many = node.decode_many


_TUPLE_SCALARS: dict[str, DataType] = {"int64": INT64, "int32": INT32, "float64": FLOAT64, "bool": BOOL,
                                       "str": STRING, "bytes": BINARY}


def tuple_as_record(old: SerializerSnapshot, new: RecordType) -> RecordType | None:
    """A stored ``TupleSerializer``'s elements as a record with ``new``'s field names in order (nested tuples as
    records named ``_1``, ``_2``, ...), or None when the arity differs or an element is not built-in and typed."""
    if len(old.nested) != len(new.fields):
        return None
    found = [_tuple_element(n, 0) for n in old.nested]
    types = [t for t in found if t is not None]
    if len(types) != len(found):
        return None
    # the new fields' aliases too: the elements are those fields by position, so no alias may rename them
    return RecordType(tuple(Field(f.name, t[0], t[1], aliases=f.aliases) for f, t in zip(new.fields, types)))


def _tuple_element(s: SerializerSnapshot, depth: int) -> tuple[DataType, bool] | None:
    if depth > 16 or s.config:
        return None
    if s.identifier in _TUPLE_SCALARS and not s.nested:
        return _TUPLE_SCALARS[s.identifier], False
    found = [_tuple_element(n, depth + 1) for n in s.nested]
    parts = [p for p in found if p is not None]
    if len(parts) != len(found):
        return None
    if s.identifier == "nullable" and len(parts) == 1:
        return parts[0][0], True
    if s.identifier == "list" and len(parts) == 1:
        return ListType(parts[0][0], parts[0][1]), False
    if s.identifier == "map" and len(parts) == 2 and not parts[0][1]:
        return MapType(parts[0][0], parts[1][0], parts[1][1]), False
    if s.identifier == "tuple" and parts:
        return RecordType(tuple(Field(f"_{i + 1}", t, nl) for i, (t, nl) in enumerate(parts))), False
    return None


def _rebuild(schema: Any, form: Any) -> RecordSerializer:
    return RecordSerializer(schema, form=form)


class RecordMigrationReader(TypeSerializer):
    """Reads state written with an older record schema into the shape of ``new`` (one value at a time: it runs once
    per value, while the state is rewritten with ``new``). Its snapshot is the OLD one, so the backends see that
    the state must be rewritten; it does not write."""

    is_immutable = False

    def __init__(self, old_schema: RecordType, new: RecordSerializer, old_serializer: TypeSerializer | None = None,
                 old_snapshot: SerializerSnapshot | None = None, state: str | None = None) -> None:
        self.old_schema = old_schema
        self.new = new
        #: The state this reader reads (named in errors); ``resolve_compatibility`` sets it.
        self.state = state
        self._old_serializer = old_serializer
        # the old bytes decode to tuples (nested records too): the old record's codec, or the old tuple serializer
        self._old = old_serializer if old_serializer is not None else _TupleDecoder(_node(old_schema, False, "",
                                                                                          "tuple"))
        self._old_snapshot = old_snapshot
        self._sources = resolve(old_schema, new.schema)

    def deserialize(self, data: bytes | memoryview) -> Any:
        old = self._old.deserialize(data)
        try:
            return self.new.deserialize(self.new.serialize(project(old, self._sources)))
        except ValueNotConvertible as e:
            raise self._not_convertible(e) from None

    def deserialize_many(self, data: bytes | memoryview, offsets: Any) -> list[Any]:
        old = self._old.deserialize_many(data, offsets)
        new = self.new
        try:
            return new.deserialize_many(*new.serialize_many([project(v, self._sources) for v in old]))
        except ValueNotConvertible as e:
            raise self._not_convertible(e) from None

    def _not_convertible(self, e: ValueNotConvertible) -> Exception:
        from keygroups.errors import StateMigrationError

        state = "a record state" if self.state is None else f"state {self.state!r}"
        return StateMigrationError(f"{state} cannot be read with the new schema {self.new.schema.ddl()}: {e}. The "
                                   f"stored schema is {self.old_schema.ddl()}")

    def serialize(self, value: Any) -> bytes:
        raise TypeError("a record migration reader only reads old state; values are written with the new "
                        f"serializer {self.new!r}")

    def copy(self, value: Any) -> Any:
        return self.new.copy(value)

    def snapshot(self) -> SerializerSnapshot:
        if self._old_snapshot is not None:
            return self._old_snapshot
        return SerializerSnapshot(RecordSerializer.identifier, RecordSerializer.version,
                                  {"schema": self.old_schema.to_json()})

    def __reduce__(self) -> tuple:
        # the compiled nodes are rebuilt from the schemas
        return (RecordMigrationReader, (self.old_schema, self.new, self._old_serializer, self._old_snapshot,
                                        self.state))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordMigrationReader) and (self.old_schema, self.new) == (other.old_schema,
                                                                                             other.new)

    def __hash__(self) -> int:
        return hash((self.old_schema, self.new))

    def __repr__(self) -> str:
        return f"RecordMigrationReader({self.old_schema.fields_ddl()!r} -> {self.new!r})"


__all__ = ["RecordSerializer", "RecordMigrationReader"]
