"""Flink's binary formats as keygroups.flink writes and reads them: every mapped type round trips exactly
(hypothesis), snapshots written are read back as the same types, and a keygroups savepoint of random rows exported
to the Flink format reads back equal (with keygroups' own reader of Flink savepoints; Flink itself restores such
exports in test_flink_roundtrip)."""

from __future__ import annotations

import math
import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.errors import CorruptSnapshotError
from keygroups.flink import export_savepoint, read_savepoint
from keygroups.flink._cursor import Cursor, decode_modified_utf8, encode_modified_utf8
from keygroups.flink.types import (
    BooleanType,
    ByteType,
    BytesType,
    CharType,
    DoubleType,
    FloatType,
    IntType,
    ListType,
    LongType,
    MapType,
    NullableType,
    RowType,
    ShortType,
    StringType,
    TimerType,
    TtlType,
    TtlValue,
    TupleType,
    VoidNamespaceType,
    read_nested_snapshot,
)

INT = {LongType: 64, IntType: 32, ShortType: 16, ByteType: 8}


def values_of(t):
    if type(t) in INT:
        bits = INT[type(t)]
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    if isinstance(t, DoubleType):
        return st.floats(allow_nan=False)
    if isinstance(t, FloatType):
        return st.floats(width=32, allow_nan=False)
    if isinstance(t, BooleanType):
        return st.booleans()
    if isinstance(t, CharType):
        return st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",))
    if isinstance(t, StringType):
        return st.text()
    if isinstance(t, BytesType):
        return st.binary()
    if isinstance(t, TupleType):   # Flink's TupleSerializer refuses null fields (getFieldNotNull)
        return st.tuples(*(values_of(f) for f in t.fields)).filter(lambda v: None not in v)
    if isinstance(t, RowType):
        return st.tuples(*(st.none() | values_of(f) for f in t.fields))
    if isinstance(t, ListType):
        return st.lists(values_of(t.element), max_size=5)
    if isinstance(t, MapType):
        return st.dictionaries(values_of(t.key), st.none() | values_of(t.value), max_size=5)
    if isinstance(t, NullableType):
        return st.none() | values_of(t.inner)
    if isinstance(t, TtlType):
        return st.builds(TtlValue, values_of(t.value), st.integers(0, 1 << 62))
    raise AssertionError(t)


SIMPLE = [LongType(), IntType(), ShortType(), ByteType(), DoubleType(), FloatType(), BooleanType(), CharType(),
          StringType(), BytesType()]
simple_types = st.sampled_from(SIMPLE)
flink_types = st.recursive(
    simple_types,
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(lambda fs: TupleType(tuple(fs))),
        st.lists(inner, min_size=1, max_size=9).map(lambda fs: RowType(tuple(fs))),
        inner.map(ListType), st.tuples(simple_types, inner).map(lambda kv: MapType(*kv)),
        simple_types.map(lambda t: NullableType(t, t.length if t.length > 0 else 0)), inner.map(TtlType)),
    max_leaves=6)


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack(">d", a) == struct.pack(">d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


@settings(max_examples=300)
@given(data=st.data(), t=flink_types)
def test_every_type_round_trips_its_values_and_its_snapshot(data, t):
    value = data.draw(values_of(t))
    out = bytearray()
    t.write(out, value)
    c = Cursor(bytes(out), "value")
    assert same(t.read(c), value) and c.remaining == 0
    snap = bytearray()
    t.write_snapshot(snap)
    c = Cursor(bytes(snap), "snapshot")
    assert read_nested_snapshot(c) == t and c.remaining == 0
    if len(out) > 0:
        with pytest.raises(CorruptSnapshotError):
            short = Cursor(bytes(out[:-1]), "value")
            t.read(short)
            if short.remaining == 0:      # a shorter value can still be a whole one (a list of fewer elements)
                raise CorruptSnapshotError("whole")


@given(st.text())
def test_java_modified_utf8_round_trips(text):
    encoded = encode_modified_utf8(text) if len(text.encode("utf-16-be", "surrogatepass")) < 20000 else None
    if encoded is not None:
        assert b"\x00" not in encoded[2:]
        assert decode_modified_utf8(encoded[2:]) == text


def test_string_value_matches_flinks_encoding():
    out = bytearray()
    StringType().write(out, "a\u00e9\U0001F600")
    # varint(len + 1 = 5) 'a' e9 01 then the two surrogates as varints
    assert bytes(out) == bytes([5, 0x61, 0xE9, 0x01, 0xBD, 0xB0, 0x03, 0x80, 0xBC, 0x03])
    out = bytearray()
    StringType().write(out, None)
    assert bytes(out) == b"\x00"


def test_timer_timestamps_sort_as_bytes():
    t = TimerType(LongType(), VoidNamespaceType())
    encoded = []
    for ts in (-5, -1, 0, 1, 1 << 40):
        out = bytearray()
        t.write(out, (ts, 7, None))
        encoded.append(bytes(out))
        assert t.read(Cursor(bytes(out), "timer")) == (ts, 7, None)
    assert encoded == sorted(encoded)


def test_out_of_range_values_are_refused_with_the_range():
    with pytest.raises(ValueError, match=r"outside Flink Short's range \[-32768, 32767\]"):
        ShortType().write(bytearray(), 40000)
    with pytest.raises(ValueError, match="not exactly a Java float"):
        FloatType().write(bytearray(), 0.1)
    with pytest.raises(ValueError, match="one UTF-16 code unit"):
        CharType().write(bytearray(), "\U0001F600")


ROWS = st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.text(), st.floats(allow_nan=False),
                          st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4),
                          st.dictionaries(st.text(max_size=5), st.integers(-(1 << 63), (1 << 63) - 1), max_size=3),
                          st.binary(max_size=8), st.booleans()),
                unique_by=lambda r: r[0], min_size=1, max_size=40)


@settings(max_examples=25)
@given(rows=ROWS, parallelism=st.integers(1, 4), max_parallelism=st.sampled_from([4, 128, 300]),
       compression=st.booleans())
def test_random_keygroups_state_exports_and_reads_back_equal(tmp_path_factory, rows, parallelism, max_parallelism,
                                                             compression):
    from keygroups import assign_key_groups
    from keygroups._ranges import key_group_range
    from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask

    tmp = tmp_path_factory.mktemp("export")
    table = pa.table({"k": pa.array([r[0] for r in rows], pa.int64()), "s": [r[1] for r in rows],
                      "d": [r[2] for r in rows], "l": pa.array([r[3] for r in rows], pa.list_(pa.int64())),
                      "m": pa.array([list(r[4].items()) for r in rows], pa.map_(pa.string(), pa.int64())),
                      "b": [r[5] for r in rows], "f": [r[6] for r in rows]})
    plan = plan_savepoint(table.schema, str(tmp / "loc"), "sp", key_columns="k",
                          states={n: n for n in "sdlmbf"}, max_parallelism=max_parallelism,
                          parallelism=parallelism)
    kgs = assign_key_groups(table.column("k"), max_parallelism)
    handles = []
    for i in range(parallelism):
        r = key_group_range(max_parallelism, parallelism, i)
        mine = table.filter(pa.array((kgs >= r.start) & (kgs <= r.end)))
        handles.append(write_savepoint_subtask(plan, i, mine.to_batches()))
    commit_savepoint(plan, handles)
    export_savepoint(str(tmp / "loc"), tmp / "flink", uid="op", savepoint="sp", compression=compression)
    sp = read_savepoint(tmp / "flink")
    assert sp.operator("op").max_parallelism == max_parallelism
    got: dict = {}
    for kg in sp.key_groups("op"):
        for name, entries in kg.entries.items():
            for e in entries:
                if name == "m":
                    got.setdefault((name, e[0]), {})[e[2]] = e[3]
                else:
                    got[(name, e[0])] = e[2]
    want = {}
    for k, s, d, lst, m, b, f in rows:
        want.update({("s", k): s, ("d", k): d, ("b", k): b, ("f", k): f})
        if lst:
            want[("l", k)] = lst
        if m:
            want[("m", k)] = m
    assert got.keys() == want.keys()
    assert all(same(got[k], want[k]) for k in want)


def _row_field_types():
    """Flink types a Row field can have that keygroups' records hold and export back as the same values (no TTL;
    no Nullable, whose nulls a Row's null mask carries anyway)."""
    return st.recursive(
        simple_types,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3).map(lambda fs: TupleType(tuple(fs))),
            st.lists(inner, min_size=1, max_size=4).map(lambda fs: RowType(tuple(fs))),
            inner.map(ListType), st.tuples(simple_types, inner).map(lambda kv: MapType(*kv))),
        max_leaves=6)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), fields=st.lists(_row_field_types(), min_size=1, max_size=5),
       max_parallelism=st.sampled_from([4, 128]), parallelism=st.integers(1, 3))
def test_random_rows_become_records_and_export_back_as_equal_rows(tmp_path_factory, data, fields, max_parallelism,
                                                                  parallelism):
    """Flink Row values as keygroups records (the importer's RecordSerializer), written to a keygroups savepoint as
    struct columns, exported to a Flink savepoint and read back with Flink's Row format: the same values, nulls
    and narrow types (Short, Byte, Float) included."""
    from keygroups import assign_key_groups
    from keygroups._ranges import key_group_range
    from keygroups.flink.savepoint import to_arrow_value
    from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask

    row = RowType(tuple(fields))
    serializer = row.keygroups_serializer()
    keys = data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=12, unique=True))
    values = [data.draw(values_of(row)) for _ in keys]
    assert all(list(serializer.deserialize(serializer.serialize(v))) == [f"f{i}" for i in range(len(fields))]
               for v in values)
    tmp = tmp_path_factory.mktemp("rows")
    table = pa.table({"k": pa.array(keys, pa.int64()),
                      "v": pa.array([to_arrow_value(row, v) for v in values], row.arrow_type())})
    plan = plan_savepoint(table.schema, str(tmp / "loc"), "sp", key_columns="k",
                          states={"row": StateColumn("v", serializer=serializer)}, max_parallelism=max_parallelism,
                          parallelism=parallelism)
    kgs = assign_key_groups(table.column("k"), max_parallelism)
    handles = []
    for i in range(parallelism):
        r = key_group_range(max_parallelism, parallelism, i)
        handles.append(write_savepoint_subtask(plan, i, table.filter(pa.array((kgs >= r.start) & (kgs <= r.end)))
                                               .to_batches()))
    commit_savepoint(plan, handles)
    export_savepoint(str(tmp / "loc"), tmp / "flink", uid="op", savepoint="sp")
    sp = read_savepoint(tmp / "flink")
    (info,) = [s for s in sp.states("op") if s.name == "row"]
    assert isinstance(info.value_type, RowType) and info.value_type.supports_row_kind
    got = {e[0]: e[2] for kg in sp.key_groups("op") for e in kg.entries["row"]}
    assert got.keys() == set(keys)
    assert all(same(got[k], v) for k, v in zip(keys, values))


def _row_snapshot(outer_version: int, flag: bytes) -> bytes:
    out = bytearray(encode_modified_utf8(RowType.snapshot_class))
    out += struct.pack(">iii", 3, 911108, outer_version) + flag
    out += struct.pack(">iii", 1333245, 1, 2)
    LongType().write_snapshot(out)
    StringType().write_snapshot(out)
    return bytes(out)


@pytest.mark.parametrize("outer_version,flag,row_kind", [(3, b"", True), (4, b"\x01", True), (4, b"\x00", False)])
def test_row_snapshots_say_whether_rows_carry_a_row_kind(outer_version, flag, row_kind):
    """RowSerializerSnapshot: version 3 always wrote the 2 RowKind bits; version 4 stores supportsRowKind."""
    t = read_nested_snapshot(Cursor(memoryview(_row_snapshot(outer_version, flag)), "test"))
    assert isinstance(t, RowType) and t.supports_row_kind is row_kind
    out = bytearray()
    t.write(out, (7, None))
    # the mask: [kind bit 0, kind bit 1,] f0 null?, f1 null?, most significant bit first
    assert out[0] == (0b0001_0000 if row_kind else 0b0100_0000)
    assert t.read(Cursor(memoryview(bytes(out)), "test")) == (7, None)


def test_a_row_that_is_not_an_insert_is_refused_by_name():
    t = RowType((LongType(),))
    data = bytes([0b0100_0000]) + struct.pack(">q", 1)      # RowKind UPDATE_BEFORE
    with pytest.raises(CorruptSnapshotError, match="RowKind is not INSERT"):
        t.read(Cursor(memoryview(data), "test"))


def test_records_export_as_rows_and_refuse_fields_flink_cannot_hold():
    from keygroups.flink.types import UnsupportedFlinkTypeError, flink_type_for
    from keygroups.serializers import RecordSerializer

    row = flink_type_for(RecordSerializer("id bigint not null, tags array<string>, sub struct<a: smallint, b: float>")
                         .snapshot(), "state 'r'")
    assert row == RowType((LongType(), ListType(StringType()), RowType((ShortType(), FloatType()))))
    assert row.names == ("id", "tags", "sub") and row.fields[2].names == ("a", "b")
    out = bytearray()
    row.write(out, {"id": 1, "tags": None, "sub": {"a": 2, "b": 0.5}})
    assert row.read(Cursor(memoryview(bytes(out)), "test")) == (1, None, (2, 0.5))
    with pytest.raises(UnsupportedFlinkTypeError, match="state 'r'.*field 'sub.day' is date"):
        flink_type_for(RecordSerializer("id bigint, sub struct<day: date>").snapshot(), "state 'r'")


def test_row_fields_a_record_cannot_hold_are_refused_by_name():
    from keygroups.flink.types import UnsupportedFlinkTypeError

    with pytest.raises(UnsupportedFlinkTypeError, match="Row field 'f1' is a Map keyed by Tuple2"):
        RowType((LongType(), MapType(TupleType((LongType(), StringType())), LongType()))).keygroups_serializer()
    with pytest.raises(UnsupportedFlinkTypeError, match="Row field 'f0' is a TimeWindow"):
        from keygroups.flink.types import TimeWindowType
        RowType((TimeWindowType(),)).keygroups_serializer()
