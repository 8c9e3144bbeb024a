"""RecordSerializer: schemas from DDL, Spark JSON, Arrow and dataclasses; exact round trips of random schemas and
values; refusals that name the field; corrupt bytes; and schema evolution by Avro's rules."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import pickle
from typing import Annotated, Optional

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups.errors import CorruptSnapshotError, StateMigrationError
from keygroups.serializers import (
    Compatibility,
    Int64Serializer,
    RecordSerializer,
    SerializerSnapshot,
    ValueSerializer,
    resolve_compatibility,
)
from keygroups.serializers.schema import (
    INT16,
    INT32,
    INT64,
    STRING,
    DecimalType,
    Field,
    ListType,
    MapType,
    RecordType,
    TimestampType,
)
from keygroups.serializers.schema_formats import from_arrow, from_spark_json, parse_ddl, to_arrow, to_spark_json
from record_strategies import evolution_steps, record_types, values_of

UTC = dt.timezone.utc


def stored(snapshot: SerializerSnapshot) -> SerializerSnapshot:
    return SerializerSnapshot.from_json(json.loads(json.dumps(snapshot.to_json())))


# ---- schemas ---------------------------------------------------------------------------------------------------


def test_ddl_covers_spark_types_and_nullability():
    t = parse_ddl("id bigint not null, b tinyint, s smallint, i int, f float, d double, ok boolean, name string, "
                  "raw binary, day date, at timestamp, wall timestamp_ntz, price decimal(10,2), tags array<string>, "
                  "counts map<string, int>, inner struct<x: int not null, y: string> comment 'nested'")
    assert [f.name for f in t.fields][:3] == ["id", "b", "s"]
    assert t.field("id").nullable is False and t.field("b").nullable is True
    assert t.field("at").type == TimestampType("us", "UTC") and t.field("wall").type == TimestampType("us", None)
    assert t.field("price").type == DecimalType(10, 2)
    assert t.field("counts").type == MapType(STRING, INT32)
    inner = t.field("inner").type
    assert isinstance(inner, RecordType) and inner.field("x").nullable is False
    assert parse_ddl(t.fields_ddl()) == t                       # DDL out and back in
    assert parse_ddl("struct<a: bigint, b: array<int>>") == RecordType((Field("a", INT64), Field("b", ListType(INT32))))


@pytest.mark.parametrize("bad, words", [
    ("id bigint, name", "cannot parse"), ("id interval", "not supported"), ("", "non-empty"),
    ("a int, a int", "more than once"),
])
def test_bad_ddl_is_refused_clearly(bad, words):
    with pytest.raises(ValueError, match=words):
        RecordSerializer(bad)


def test_spark_json_and_arrow_round_trip_the_schema():
    t = parse_ddl("a tinyint not null, b array<bigint>, c map<string, double>, d struct<x: date>, e timestamp, "
                  "f decimal(20,3)")
    assert from_spark_json(to_spark_json(t)) == t

    class Duck:   # a StructType is accepted through jsonValue(), no pyspark import below keygroups.spark
        def jsonValue(self):
            return to_spark_json(t)

    assert RecordSerializer(Duck()).schema == t
    arrow = to_arrow(t)
    assert from_arrow(arrow) == t
    assert RecordSerializer(pa.schema(list(arrow))).schema == t


def test_fields_constructor_is_public_for_other_formats():
    ser = RecordSerializer.from_fields([("f0", "bigint", False), ("f1", STRING), ("f2", ListType(INT16), True)],
                                       form="tuple")
    assert ser.schema.field("f0").nullable is False and ser.schema.field("f1").nullable is True
    assert ser.deserialize(ser.serialize((1, "x", [2]))) == (1, "x", [2])


@dataclasses.dataclass
class Line:
    sku: str
    quantity: Annotated[int, INT32]
    price: Annotated[decimal.Decimal, DecimalType(10, 2)]


@dataclasses.dataclass(frozen=True)
class Cart:
    user: str
    lines: list[Line]
    opened: dt.datetime
    closed: Optional[dt.date] = None
    notes: dict[str, int] = dataclasses.field(default_factory=dict)


def test_dataclass_schema_and_instances_both_ways():
    ser = RecordSerializer(Cart)
    t = ser.schema
    assert t.field("user").nullable is False and t.field("closed").nullable is True
    assert t.field("lines").type == ListType(RecordType((Field("sku", STRING, False), Field("quantity", INT32, False),
                                                         Field("price", DecimalType(10, 2), False))), False)
    cart = Cart("ann", [Line("a", 2, decimal.Decimal("1.50"))], dt.datetime(2024, 5, 1, tzinfo=UTC),
                notes={"gift": 1})
    back = ser.deserialize(ser.serialize(cart))
    assert back == cart and type(back) is Cart and type(back.lines[0]) is Line
    # dicts and tuples go in too; the chosen form comes out
    as_dict = RecordSerializer(Cart, form="dict")
    assert as_dict.deserialize(ser.serialize(dataclasses.asdict(cart)))["lines"] == [
        {"sku": "a", "quantity": 2, "price": decimal.Decimal("1.50")}]
    assert pickle.loads(pickle.dumps(ser)).deserialize(ser.serialize(cart)) == cart


def test_zones_units_and_naive_timestamps():
    berlin = RecordSerializer.from_fields([("t", TimestampType("ms", "Europe/Berlin"))])
    at = dt.datetime(2024, 7, 1, 12, 0, 0, 123000, tzinfo=UTC)
    back = berlin.deserialize(berlin.serialize({"t": at}))["t"]
    assert back == at and back.utcoffset() == dt.timedelta(hours=2)
    with pytest.raises(ValueError, match="below the type's unit"):
        berlin.serialize({"t": at.replace(microsecond=1)})
    naive = RecordSerializer("t timestamp_ntz")
    assert naive.deserialize(naive.serialize({"t": dt.datetime(1, 1, 1)}))["t"] == dt.datetime(1, 1, 1)
    with pytest.raises(TypeError, match="naive datetimes"):
        naive.serialize({"t": at})
    with pytest.raises(TypeError, match="timezone-aware"):
        RecordSerializer("t timestamp").serialize({"t": dt.datetime(2024, 1, 1)})


# ---- round trips ------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_schemas_and_values_round_trip_exactly(data):
    schema = data.draw(record_types())
    ser = RecordSerializer(schema)
    values = data.draw(st.lists(values_of(schema), min_size=1, max_size=5))
    for v in values:
        assert ser.deserialize(ser.serialize(v)) == v
    buf, offsets = ser.serialize_many(values)
    assert ser.deserialize_many(buf, offsets) == values
    assert ser.deserialize_many(memoryview(buf), offsets) == values    # read-only buffers are fine
    again = stored(ser.snapshot()).restore_serializer()                   # the stored schema reads the bytes
    assert again.deserialize_many(buf, offsets) == values
    as_tuples = RecordSerializer(schema, form="tuple")
    flat = as_tuples.deserialize(buf[offsets[0]:offsets[1]])
    assert as_tuples.deserialize(as_tuples.serialize(flat)) == flat


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrupt_bytes_raise_corrupt_snapshot_error(data):
    schema = data.draw(record_types())
    ser = RecordSerializer(schema)
    good = ser.serialize(data.draw(values_of(schema)))
    cut = data.draw(st.integers(0, max(0, len(good) - 1)))
    mutations = [good[:cut], good + b"\x00", data.draw(st.binary(max_size=40))]
    if good:
        i = data.draw(st.integers(0, len(good) - 1))
        mutations.append(good[:i] + bytes([data.draw(st.integers(0, 255))]) + good[i + 1:])
    for bad in mutations:
        try:
            ser.deserialize(bad)
        except CorruptSnapshotError:
            pass   # anything else (another exception, a crash) fails the test


def test_huge_counts_are_refused_before_allocating():
    ser = RecordSerializer("xs array<bigint> not null")
    with pytest.raises(CorruptSnapshotError, match="count"):
        ser.deserialize(b"\xff\xff\xff\x7f" + b"\x00" * 16)


# ---- refusals on write -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, words", [
    ({"id": "7"}, TypeError, "field 'id' (bigint not null) expects an int, got '7'"),
    ({"id": None}, TypeError, "field 'id' (bigint not null) is not nullable"),
    ({}, TypeError, "field 'id' (bigint not null) is not nullable"),
    ({"id": 2**63}, ValueError, "out of range"),
    ({"id": 1, "tags": ["a", 3]}, TypeError, "field 'tags[]' (string) expects a str"),
    ({"id": 1, "inner": {"n": 300}}, ValueError, "field 'inner.n' (tinyint)"),
    ({"id": 1, "price": decimal.Decimal("1.234")}, ValueError, "more than 2 digits after the point"),
    ({"id": 1, "price": decimal.Decimal("123456789")}, ValueError, "more than 5 digits"),
    ({"id": 1, "extra": 1}, ValueError, "has no field(s) ['extra']"),
    ((1, 2), ValueError, "has 4 fields"),
    ("nope", TypeError, "expects a dict, a tuple or an object"),
    ({"id": True}, TypeError, "expects an int"),
])
def test_wrong_values_are_refused_naming_the_field(value, error, words):
    ser = RecordSerializer("id bigint not null, tags array<string>, inner struct<n: tinyint>, price decimal(5,2)")
    with pytest.raises(error) as info:
        ser.serialize(value)
    assert words in str(info.value)


def test_records_are_smaller_than_value_serializer():
    ser = RecordSerializer("id bigint, score double, name string, ok boolean, at bigint, history array<bigint>")
    v = {"id": 1, "score": 0.5, "name": "user-1", "ok": True, "at": 1_700_000_000_000_000, "history": [1, 2, 3]}
    assert len(ser.serialize(v)) < len(ValueSerializer().serialize(v)) / 1.5


# ---- evolution -------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_evolution_steps_read_old_bytes_in_the_new_shape(data):
    schema = data.draw(record_types())
    old = RecordSerializer(schema)
    values = data.draw(st.lists(values_of(schema), min_size=1, max_size=4))
    step = data.draw(evolution_steps(schema))
    new = RecordSerializer(step.schema)
    outcome, reader = resolve_compatibility("s", stored(old.snapshot()), new)
    if step.schema == schema:   # a reorder that kept the order, nullable on a nullable field
        assert outcome is Compatibility.COMPATIBLE_AS_IS
        return
    assert outcome is Compatibility.COMPATIBLE_AFTER_MIGRATION
    assert reader.snapshot() == old.snapshot()     # backends see that the state must be rewritten
    buf, offsets = old.serialize_many(values)
    read = reader.deserialize_many(buf, offsets)
    assert read == [step.apply(v) for v in values]
    assert [reader.deserialize(old.serialize(v)) for v in values] == read
    assert new.deserialize_many(*new.serialize_many(read)) == read


@pytest.mark.parametrize("old, new, words", [
    ("a bigint", "a int", "field 'a' changed from bigint to int: this change of type is not a widening"),
    ("a double", "a bigint", "from double to bigint"),
    ("a string", "a bigint", "from string to bigint"),
    ("a binary", "a date", "from binary to date"),
    ("a bigint", "a bigint not null", "a nullable field cannot become not null"),
    ("a bigint", "a bigint, b int not null", "field 'b' changed from absent to int not null: a field added to stored "
                                             "state needs a default, or must be nullable"),
    ("s struct<x: int>", "s struct<x: string>", "field 's.x' changed from int to string"),
    ("m map<string, int>", "m map<int, int>", "map keys cannot change type"),
    ("l array<int>", "l array<string>", "field 'l[]' changed from int to string"),
])
def test_refused_changes_name_state_field_types_and_what_is_allowed(old, new, words):
    with pytest.raises(StateMigrationError) as info:
        resolve_compatibility("carts", stored(RecordSerializer(old).snapshot()), RecordSerializer(new))
    msg = str(info.value)
    assert "State 'carts' cannot be restored with the new value schema" in msg
    assert words in msg
    assert "Allowed changes: add a field" in msg and "not be incompatible" not in msg


def test_rename_needs_an_alias():
    old = RecordSerializer("qty int not null")
    renamed = RecordType((Field("quantity", INT32, False, aliases=("qty",)),))
    _, reader = resolve_compatibility("s", old.snapshot(), RecordSerializer(renamed))
    assert reader.deserialize(old.serialize({"qty": 4})) == {"quantity": 4}
    with pytest.raises(StateMigrationError, match="field 'quantity' changed from absent"):
        resolve_compatibility("s", old.snapshot(), RecordSerializer("quantity int not null"))


def test_dataclass_defaults_fill_added_fields():
    @dataclasses.dataclass
    class V1:
        user: str

    @dataclasses.dataclass
    class V2:
        user: str
        visits: int = 1
        tags: list[str] = dataclasses.field(default_factory=list)

    _, reader = resolve_compatibility("s", RecordSerializer(V1).snapshot(), RecordSerializer(V2))
    a, b = reader.deserialize_many(*RecordSerializer(V1).serialize_many([V1("x"), V1("y")]))
    assert a == V2("x", 1, []) and b == V2("y") and a.tags is not b.tags


def test_other_serializers_are_not_records():
    with pytest.raises(StateMigrationError, match="RecordSerializer cannot read data written by Int64Serializer"):
        resolve_compatibility("s", Int64Serializer().snapshot(), RecordSerializer("a bigint"))
    with pytest.raises(StateMigrationError, match="must be compatible as is"):   # keys never migrate
        resolve_compatibility("s", RecordSerializer("a int").snapshot(), RecordSerializer("a bigint"), role="key")


def test_a_malformed_stored_schema_is_corrupt():
    bad = SerializerSnapshot("record", 1, {"schema": {"type": "record", "fields": [{"name": "a", "type": "int128",
                                                                                       "nullable": True}]}})
    with pytest.raises(CorruptSnapshotError, match="malformed"):
        bad.restore_serializer()


def test_tuple_state_becomes_record_state_field_by_field():
    from keygroups.cli import shop
    from keygroups.serializers import StrSerializer, TupleSerializer

    old = shop.PAIR   # the demo's cart lines before they were records
    outcome, reader = resolve_compatibility("cart", stored(old.snapshot()), shop.CART.serializers["map value"])
    assert outcome is Compatibility.COMPATIBLE_AFTER_MIGRATION
    assert reader.deserialize(old.serialize((3, 250))) == shop.CartLine(3, 250)
    assert reader.snapshot() == old.snapshot()
    with pytest.raises(StateMigrationError, match="one field per tuple element"):
        resolve_compatibility("cart", old.snapshot(), RecordSerializer("quantity bigint"))
    with pytest.raises(StateMigrationError, match="fields in order, and field 'a' changed from string to bigint"):
        resolve_compatibility("cart", TupleSerializer(StrSerializer(), Int64Serializer()).snapshot(),
                              RecordSerializer("a bigint, b bigint"))
    with pytest.raises(StateMigrationError, match="one field per tuple element"):   # an opaque element
        resolve_compatibility("cart", TupleSerializer(ValueSerializer(), Int64Serializer()).snapshot(),
                              RecordSerializer("a bigint, b bigint"))


def test_records_nested_in_composites_migrate_into_the_new_shape():
    from keygroups.serializers import ListSerializer, MapSerializer, NullableSerializer, StrSerializer

    v1, v2 = RecordSerializer("a int not null"), RecordSerializer("a bigint not null, b string")
    for old, new, value, expected in [
        (ListSerializer(v1), ListSerializer(v2), [{"a": 1}], [{"a": 1, "b": None}]),
        (MapSerializer(StrSerializer(), v1), MapSerializer(StrSerializer(), v2), {"k": {"a": 2}},
         {"k": {"a": 2, "b": None}}),
        (v1, NullableSerializer(v2), {"a": 3}, {"a": 3, "b": None}),
        (NullableSerializer(v1), NullableSerializer(v2), None, None),
    ]:
        outcome, reader = resolve_compatibility("s", stored(old.snapshot()), new)
        assert outcome is Compatibility.COMPATIBLE_AFTER_MIGRATION
        assert reader.snapshot() == old.snapshot()
        assert reader.deserialize(old.serialize(value)) == expected


def test_serializer_for_a_dataclass_is_a_record_serializer():
    from keygroups.serializers import serializer_for

    ser = serializer_for(Line)
    assert isinstance(ser, RecordSerializer) and ser.form is Line
    assert serializer_for(Line("a", 1, decimal.Decimal(1))).schema == ser.schema


def test_dataclass_fields_are_renamed_through_metadata_aliases():
    @dataclasses.dataclass
    class Old:
        qty: int

    @dataclasses.dataclass
    class New:
        quantity: int = dataclasses.field(metadata={"aliases": ("qty",)})

    _, reader = resolve_compatibility("s", RecordSerializer(Old).snapshot(), RecordSerializer(New))
    assert reader.deserialize(RecordSerializer(Old).serialize(Old(5))) == New(5)


@dataclasses.dataclass(slots=True)
class Point:
    x: int
    y: Optional[float] = None


def test_slots_dataclasses_namedtuples_and_objects_with_attributes():
    import collections

    ser = RecordSerializer(Point)
    back = ser.deserialize(ser.serialize(Point(1, 2.5)))
    assert back == Point(1, 2.5) and type(back) is Point
    Pair = collections.namedtuple("Pair", ["y", "x"])   # by name, not by position
    assert ser.deserialize(ser.serialize(Pair(y=None, x=3))) == Point(3)
    with pytest.raises(TypeError, match="has no attribute 'x'"):
        ser.serialize(object())
