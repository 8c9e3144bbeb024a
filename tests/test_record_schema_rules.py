"""Record schemas as declared: Spark DDL ``DEFAULT`` (and Spark's default metadata), empty DDL fields, the nesting
bound (refused when declared, never a RecursionError, and a schema at the bound restores), alias declarations, the
evolution rules' edge cases (int64 -> float32 rounds once, binary -> string names the state), and a checkpoint written
by main's RecordSerializer before aliases were stored, which must keep restoring on both backends."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import pathlib

import numpy as np
import pyarrow as pa
import pytest

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import StateMigrationError
from keygroups.serializers import Compatibility, Int64Serializer, RecordSerializer, StrSerializer, resolve_compatibility
from keygroups.serializers.schema import (
    INT64,
    MAX_TYPE_DEPTH,
    NO_DEFAULT,
    STRING,
    Field,
    ListType,
    MapType,
    RecordType,
)
from keygroups.serializers.schema_formats import from_arrow, from_spark_json, parse_ddl
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

UTC = dt.timezone.utc
BACKENDS = [HeapKeyedStateBackend, RocksDBKeyedStateBackend]


# ---- DDL ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ddl, default", [
    ("b string default 'x'", "x"),
    ("b STRING NOT NULL DEFAULT 'it\\'s' COMMENT 'c'", "it's"),
    ("b bigint default -5", -5),
    ("b int default 0", 0),
    ("b double default 1.5e3", 1500.0),
    ("b float default -0.25", -0.25),
    ("b boolean default true", True),
    ("b decimal(10,2) default 12.34", decimal.Decimal("12.34")),
    ("b binary default X'0AFF'", b"\n\xff"),
    ("b date default DATE'2024-02-29'", dt.date(2024, 2, 29)),
    ("b date default '2024-02-29'", dt.date(2024, 2, 29)),
    ("b timestamp default TIMESTAMP'2024-01-02 03:04:05'", dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ("b timestamp_ntz default '2024-01-02 03:04:05'", dt.datetime(2024, 1, 2, 3, 4, 5)),
    ("b array<int> default array(1, 2)", [1, 2]),
    ("b map<string, bigint> default map('k', 1)", {"k": 1}),
    ("b string default null", None),
])
def test_ddl_default_gives_the_field_its_default(ddl, default):
    field = parse_ddl("a bigint not null, " + ddl).field("b")
    assert field.default == default and type(field.default) is type(default)
    # and a restore of state written before the field existed reads it
    old = RecordSerializer("a bigint not null")
    _, reader = resolve_compatibility("s", old.snapshot(), RecordSerializer("a bigint not null, " + ddl))
    assert reader.deserialize(old.serialize({"a": 1})) == {"a": 1, "b": default}


def test_ddl_without_default_has_none_and_nested_fields_take_defaults():
    t = parse_ddl("a bigint, s struct<x: int not null default 4, y: string>")
    assert t.field("a").default is NO_DEFAULT
    inner = t.field("s").type
    assert isinstance(inner, RecordType) and inner.field("x").default == 4
    old = RecordSerializer("a bigint, s struct<y: string>")
    _, reader = resolve_compatibility("s", old.snapshot(), RecordSerializer(t))
    assert reader.deserialize(old.serialize({"a": 1, "s": {"y": "q"}})) == {"a": 1, "s": {"x": 4, "y": "q"}}


@pytest.mark.parametrize("ddl, words", [
    ("b int default 'x'", "DEFAULT of field 'b': 'x' is not a literal of type int"),
    ("b int default 1.5", "1.5 is not a literal of type int"),
    ("b int default 1 + 2", "is not a literal"),
    ("b date default current_date()", "is not a literal"),
    ("b int not null default null", "the default of field 'b' (None) is not a value of the field"),
    ("b tinyint default 300", "300 is out of range"),
    ("b date default '2024-13-01'", "is not a literal of type date"),
])
def test_a_ddl_default_that_does_not_fit_is_refused_when_declared(ddl, words):
    with pytest.raises(ValueError) as info:
        RecordSerializer("a bigint, " + ddl)
    assert words in str(info.value)


def test_spark_default_metadata_gives_the_default():
    """Spark 4 keeps a column's default in its StructField's metadata: EXISTS_DEFAULT (what rows written before the
    column existed read) before CURRENT_DEFAULT."""
    struct = {"type": "struct", "fields": [
        {"name": "a", "type": "long", "nullable": False, "metadata": {}},
        {"name": "b", "type": "string", "nullable": True, "metadata": {"CURRENT_DEFAULT": "'x'"}},
        {"name": "c", "type": "integer", "nullable": False,
         "metadata": {"CURRENT_DEFAULT": "2", "EXISTS_DEFAULT": "1"}}]}
    t = from_spark_json(struct)
    assert (t.field("a").default, t.field("b").default, t.field("c").default) == (NO_DEFAULT, "x", 1)


@pytest.mark.parametrize("ddl", ["a int,, ,", "a int,", ",a int", "a int,,b int", "s struct<a: int,, b: int>",
                                 "a array<struct<x: int,>>", "struct<a: int,>"])
def test_empty_ddl_fields_are_refused(ddl):
    with pytest.raises(ValueError, match="has an empty field"):
        parse_ddl(ddl)


@pytest.mark.parametrize("ddl", ["a string default 'open", "a string comment 'x", 'a string default "x'])
def test_an_open_quote_is_a_clear_error(ddl):
    with pytest.raises(ValueError, match="cannot parse the DDL schema"):
        parse_ddl(ddl)


# ---- nesting ------------------------------------------------------------------------------------------------------

def nested(depth: int) -> RecordType:
    """A record whose deepest type is ``depth`` levels down (records and lists alternating)."""
    t: object = INT64
    level = depth
    while level > 1:
        t = ListType(t) if level % 2 else RecordType((Field("x", t),))
        level -= 1
    return RecordType((Field("x", t),))


def nested_value(t: object) -> object:
    if isinstance(t, RecordType):
        return {"x": nested_value(t.fields[0].type)}
    if isinstance(t, ListType):
        return [nested_value(t.element)]
    return 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_schema_at_the_nesting_bound_is_committed_and_restores(backend, tmp_path):
    t = nested(MAX_TYPE_DEPTH)
    ser = RecordSerializer(t)
    value = nested_value(t)
    storage = CheckpointStorage(tmp_path)
    with backend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        state = b.get_state(ValueStateDescriptor("deep", ser))
        b.set_current_key(1)
        state.update(value)
        handle = b.snapshot(1, storage).result(60)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=16,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    with backend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        b.restore(storage, storage.load(1))
        state = b.get_state(ValueStateDescriptor("deep", RecordSerializer(t)))
        b.set_current_key(1)
        assert state.value() == value


@pytest.mark.parametrize("depth", [MAX_TYPE_DEPTH + 1, 200, 5000])
def test_deeper_schemas_are_refused_when_declared_in_every_form(depth):
    with pytest.raises(ValueError, match=f"at most {MAX_TYPE_DEPTH} levels"):
        RecordSerializer(nested(depth))
    ddl = "a " + "struct<x: " * depth + "int" + ">" * depth
    with pytest.raises(ValueError, match=f"at most {MAX_TYPE_DEPTH} levels"):
        RecordSerializer(ddl)
    if depth < 500:   # pyarrow and json themselves recurse on what they are given
        spark: dict = {"type": "struct", "fields": [{"name": "x", "type": "long", "nullable": True}]}
        arrow = pa.int64()
        for _ in range(depth):
            spark = {"type": "struct", "fields": [{"name": "x", "type": spark, "nullable": True}]}
            arrow = pa.struct([pa.field("x", arrow)])
        with pytest.raises(ValueError, match=f"{MAX_TYPE_DEPTH} levels"):
            from_spark_json(spark)
        with pytest.raises(ValueError, match=f"{MAX_TYPE_DEPTH} levels"):
            from_arrow(pa.schema([pa.field("x", arrow)]))


# ---- aliases as declared -------------------------------------------------------------------------------------------

def test_an_alias_on_two_fields_is_refused():
    with pytest.raises(ValueError, match="fields 'a' and 'b' both list the alias 'old'"):
        RecordType((Field("a", INT64, aliases=("old",)), Field("b", INT64, aliases=("old",))))


def test_aliases_must_be_a_tuple_of_names():
    with pytest.raises(TypeError, match="aliases must be a tuple"):
        Field("a", INT64, aliases="old")   # type: ignore[arg-type]
    assert Field("a", INT64, aliases=("a", "b", "b")).aliases == ("b",)


def test_aliases_are_stored_only_when_a_field_has_some():
    plain = RecordSerializer("a bigint")
    assert plain.snapshot().config == {"schema": {"type": "record", "fields": [
        {"name": "a", "type": "int64", "nullable": True}]}}
    renamed = RecordSerializer(RecordType((Field("b", INT64, aliases=("a",)),)))
    assert renamed.snapshot().config["schema"]["fields"][0]["aliases"] == ["a"]
    assert RecordType.from_json(renamed.snapshot().config["schema"]).fields[0].aliases == ("a",)


def test_an_alias_already_applied_is_not_applied_again():
    v1 = RecordSerializer("a bigint not null")
    v2 = RecordSerializer(RecordType((Field("b", INT64, False, aliases=("a",)), Field("a", INT64, False, 7))))
    _, reader = resolve_compatibility("s", v1.snapshot(), v2)
    assert reader.deserialize(v1.serialize({"a": 1})) == {"b": 1, "a": 7}
    # state v2 wrote restores with v2 as it is: its 'a' is the new field, not the old one
    assert resolve_compatibility("s", v2.snapshot(), v2)[0] is Compatibility.COMPATIBLE_AS_IS


# ---- rules' edge cases ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [2**60 + 2**36 + 1, -(2**60 + 2**36 + 1), 2**53 + 1, 2**63 - 1, -(2**63),
                                   (2**24 + 1) * 2**38 + 1, 123456789])
def test_int64_to_float_rounds_once_as_java_does(value):
    old = RecordSerializer("a bigint not null")
    _, reader = resolve_compatibility("s", old.snapshot(), RecordSerializer("a float not null"))
    got = reader.deserialize(old.serialize({"a": value}))["a"]
    assert got == float(np.array([value], dtype=np.int64).astype(np.float32)[0])   # C's (float) long


def test_binary_that_is_not_utf8_names_the_state_and_the_field():
    old = RecordSerializer("a bigint, blob binary")
    _, reader = resolve_compatibility("carts", old.snapshot(), RecordSerializer("a bigint, blob string"))
    assert reader.deserialize(old.serialize({"a": 1, "blob": "é".encode()})) == {"a": 1, "blob": "é"}
    with pytest.raises(StateMigrationError) as info:
        reader.deserialize(old.serialize({"a": 1, "blob": b"\xff\xfe"}))
    assert "state 'carts'" in str(info.value) and "field 'blob'" in str(info.value) and "UTF-8" in str(info.value)
    _, back = resolve_compatibility("carts", RecordSerializer("blob string").snapshot(), RecordSerializer("blob binary"))
    assert back.deserialize(RecordSerializer("blob string").serialize({"blob": "é"})) == {"blob": "é".encode()}


# ---- a checkpoint of main's RecordSerializer (format 1, no aliases stored) -----------------------------------------

V1 = pathlib.Path(__file__).parent / "data" / "record-checkpoint-v1"
V1_SCHEMA = ("id bigint not null, name string, score double, small int not null, price decimal(10,2), day date, "
             "at timestamp, address struct<street: string, zip int not null>, tags array<string>, "
             "counts map<string, bigint>")


def v1_descriptors(ser: RecordSerializer) -> dict:
    out = {"profile": ValueStateDescriptor("profile", ser), "history": ListStateDescriptor("history", ser),
           "by_name": MapStateDescriptor("by_name", StrSerializer(), ser)}
    out["by_name"].enable_time_to_live(StateTtlConfig.new_builder(10**6).build())
    return out


def read_v1(backend: type, ser: RecordSerializer, p: int) -> dict[int, list]:
    storage = CheckpointStorage(V1 / "chk")
    got = {}
    for i in range(p):
        with backend(key_group_range(16, p, i), 16, Int64Serializer(), clock=lambda: 1_700_000_000.0) as b:
            b.restore(storage, storage.load(2))
            s = {n: b.get_state(d) for n, d in v1_descriptors(ser).items()}
            for k in range(40):
                if assign_to_operator(k, 16, p) == i:
                    b.set_current_key(k)
                    got[k] = [s["profile"].value(), s["history"].get(), sorted(s["by_name"].items())]
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_main_s_record_checkpoint_restores_as_it_was_written(backend):
    expected = json.loads((V1 / "expected.json").read_text())
    got = read_v1(backend, RecordSerializer(V1_SCHEMA), 3)
    assert {str(k): [repr(v[0]), repr(v[1]), repr(v[2])] for k, v in got.items()} == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_main_s_record_checkpoint_restores_into_an_evolved_schema(backend):
    evolved = RecordType((
        Field("id", INT64, False),
        Field("label", STRING, True, aliases=("name",)),                       # renamed
        Field("score", parse_ddl("x double").fields[0].type, True),
        Field("small", INT64, False),                                          # widened
        Field("address", parse_ddl("s struct<zip bigint not null, street binary>").fields[0].type, True),
        Field("counts", MapType(STRING, INT64), True),
        Field("name", STRING, False, default="?"),                             # the old name, reused
    ))
    before = read_v1(backend, RecordSerializer(V1_SCHEMA), 1)
    after = read_v1(backend, RecordSerializer(evolved), 2)

    def evolve(v: dict | None) -> dict | None:
        if v is None:
            return None
        address = v["address"] and {"zip": v["address"]["zip"], "street": v["address"]["street"]
                                    and v["address"]["street"].encode()}
        return {"id": v["id"], "label": v["name"], "score": v["score"], "small": v["small"], "address": address,
                "counts": v["counts"], "name": "?"}

    assert after == {k: [evolve(p), [evolve(h) for h in hist], [(n, evolve(x)) for n, x in by_name]]
                     for k, (p, hist, by_name) in before.items()}



def test_a_tuple_becomes_a_record_by_position_whatever_its_aliases():
    """Tuple state read as records: element i is field i; the new fields' aliases rename nothing."""
    from keygroups.serializers import TupleSerializer

    old = TupleSerializer(Int64Serializer(), StrSerializer())
    new = RecordSerializer(RecordType((Field("b", INT64, False, aliases=("a",)), Field("a", STRING, False))))
    _, reader = resolve_compatibility("s", old.snapshot(), new)
    assert reader.deserialize(old.serialize((1, "x"))) == {"b": 1, "a": "x"}
