"""The compiled Flink export (``_native/flinkout.pyx``) against the Python one (``exporter._entries`` and
``FlinkType.write``): byte-identical savepoint files, value by value equal bytes and refusals, and corrupt
keygroups bytes that raise CorruptSnapshotError instead of crashing."""

from __future__ import annotations

import math
import pathlib
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import keygroups.flink.exporter as exporter
from keygroups._ranges import key_group_range
from flink_harness import FIXTURE_SET, FIXTURES
from keygroups._native import flinkout
from keygroups.errors import CorruptSnapshotError
from keygroups.flink import UnsupportedFlinkTypeError, read_savepoint
from keygroups.flink.exporter import export_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.flink.types import (
    BooleanType,
    ByteType,
    BytesType,
    CharType,
    DoubleType,
    FlinkType,
    FloatType,
    IntType,
    ListType,
    LongType,
    MapType,
    NullableType,
    ShortType,
    StringType,
    TupleType,
    flink_row_for,
    flink_value,
)
from keygroups.runtime.state_types import arrow_type
from keygroups.runtime.state_writer import (
    StateColumn,
    _key_groups,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
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
)
from keygroups.serializers import schema as rs
from keygroups.state import StateTtlConfig
from record_strategies import _records, values_of

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]   # SavepointJob's: every state maps (unsupported-types holds POJOs)


def _data_files(directory: pathlib.Path) -> list[bytes]:
    """The savepoint's data files (``_metadata`` names them by random names, so it differs between exports)."""
    return sorted(p.read_bytes() for p in directory.iterdir() if p.name != "_metadata")


def _both_paths(monkeypatch, location: str, dest: pathlib.Path, **kwargs) -> tuple[exporter.ExportReport, ...]:
    """Export with the compiled path (and no state falling back to Python), then with the Python path alone."""
    def no_python(*args, **kw):
        raise AssertionError("a state took the Python path")

    with monkeypatch.context() as m:
        m.setattr(exporter, "_python_pairs", no_python)
        fast = export_savepoint(location, dest / "compiled", **kwargs)
    with monkeypatch.context() as m:
        m.setattr(exporter, "_COMPILED", False)
        slow = export_savepoint(location, dest / "python", **kwargs)
    return fast, slow


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("compression", [False, True])
def test_compiled_export_of_flink_fixtures_is_byte_identical(tmp_path, monkeypatch, name, compression):
    """Savepoints a real Flink 2.3 job wrote (every type, TTL, list, map, Row, timers; 1- and 2-byte prefixes),
    imported, exported through the compiled path and the Python path: the same bytes, file for file."""
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "sp", uid="keyed")
    fast, slow = _both_paths(monkeypatch, str(tmp_path / "loc"), tmp_path, uid="keyed", savepoint="sp", like=src,
                             compression=compression)
    assert (fast.entries, fast.timers, fast.key_groups) == (slow.entries, slow.timers, slow.key_groups)
    assert fast.entries > 0 and fast.timers > 0
    assert _data_files(tmp_path / "compiled") == _data_files(tmp_path / "python")
    # without like=: the types keygroups' serializers map to (Int32 for Short and Byte, Str for Character)
    fast, _ = _both_paths(monkeypatch, str(tmp_path / "loc"), tmp_path / "plain", uid="keyed", savepoint="sp")
    assert _data_files(tmp_path / "plain" / "compiled") == _data_files(tmp_path / "plain" / "python")


def _keygroups_savepoint(location: str, key: pa.Array | dict[str, pa.Array], columns: dict[str, pa.Array],
                         states: dict, max_parallelism: int, parallelism: int) -> None:
    keys = key if isinstance(key, dict) else {"k": key}
    batch = pa.record_batch({**keys, **columns})
    plan = plan_savepoint(batch.schema, location, "sp", key_columns=list(keys), states=states,
                          max_parallelism=max_parallelism, parallelism=parallelism)
    kgs = _key_groups(pa.Table.from_batches([batch]), plan)
    handles = []
    for i in range(parallelism):
        mine = key_group_range(max_parallelism, parallelism, i)
        handles.append(write_savepoint_subtask(plan, i, [batch.filter(pa.array((kgs >= mine.start) &
                                                                               (kgs <= mine.end)))]))
    commit_savepoint(plan, handles)


RECORD = RecordSerializer("id bigint not null, name string, small smallint, tiny tinyint, ratio float, "
                          "score double, ok boolean, raw binary, tags array<string>, counts map<string, int>, "
                          "inner struct<a: int, b: string>")


def _record(i: int) -> dict:
    return {"id": i, "name": None if i % 3 == 0 else f"n{i}\u00e9\U0001f600", "small": -i, "tiny": i % 100,
            "ratio": 0.5 * i, "score": i / 7, "ok": i % 2 == 0, "raw": bytes([i % 256]) * (i % 4),
            "tags": [f"t{j}" for j in range(i % 3)] + ([None] if i % 5 == 0 else []),
            "counts": {f"c{j}": (None if j == 1 else j) for j in range(i % 3)},
            "inner": None if i % 4 == 0 else {"a": i, "b": None if i % 2 else "x"}}


@pytest.mark.parametrize("key_kind", ["long", "string", "tuple"])
def test_compiled_export_of_every_keygroups_state_kind_is_byte_identical(tmp_path, monkeypatch, key_kind):
    """A keygroups savepoint (not from Flink) with every state kind, TTL on value/list/map, records, tuples,
    nullable values, 2-byte key-group prefixes: the compiled files equal the Python path's."""
    n = 300
    keys = {"long": pa.array(range(n), pa.int64()),
            "string": pa.array([f"key-{i}-\u00fc" for i in range(n)]),
            "tuple": {"ka": pa.array(range(n), pa.int32()), "kb": pa.array([f"s{i}" for i in range(n)])}}[key_kind]
    ttl = StateTtlConfig(ttl_ms=60_000)
    columns = {
        "v": pa.array([i * 1_000_003 for i in range(n)], pa.int64()),
        "s": pa.array([f"\u4e2d{i}\U00010348" if i % 7 else "" for i in range(n)]),
        "d": pa.array([float(i) / 3 if i % 11 else math.nan for i in range(n)]),
        "b": pa.array([i % 2 == 0 for i in range(n)]),
        "by": pa.array([bytes(range(i % 9)) for i in range(n)], pa.binary()),
        "nul": pa.array([None if i % 4 == 0 else i for i in range(n)], pa.int64()),
        "tup": pa.array([{"x": i, "y": -float(i)} for i in range(n)],
                        pa.struct([("x", pa.int32()), ("y", pa.float64())])),
        "lst": pa.array([[j for j in range(i % 5)] for i in range(n)], pa.list_(pa.int64())),
        "lst_s": pa.array([[f"e{j}" for j in range(i % 4)] for i in range(n)], pa.list_(pa.string())),
        "mp": pa.array([[(f"m{j}", j * i) for j in range(i % 4)] for i in range(n)],
                       pa.map_(pa.string(), pa.int64())),
        "rec": pa.array([_record(i) for i in range(n)], arrow_type(RECORD.snapshot())),
    }
    states = {
        "value": "v", "str": "s", "double": "d", "bool": "b", "bytes": "by",
        "nullable": StateColumn("nul", serializer=NullableSerializer(Int64Serializer())),
        "tuple": StateColumn("tup", serializer=TupleSerializer(Int32Serializer(), Float64Serializer())),
        "list": "lst", "list_str": "lst_s", "map": "mp",
        "reducing": StateColumn("v", kind="reducing"),
        "aggregating": StateColumn("s", kind="aggregating", serializer=StrSerializer()),
        "ttl_value": StateColumn("v", ttl=ttl), "ttl_list": StateColumn("lst_s", ttl=ttl),
        "ttl_map": StateColumn("mp", ttl=ttl),
        "record": StateColumn("rec", serializer=RECORD),
        "record_list": StateColumn("rec", kind="value", serializer=NullableSerializer(RECORD)),
    }
    location = str(tmp_path / "loc")
    _keygroups_savepoint(location, keys, columns, states, max_parallelism=1024, parallelism=3)
    fast, slow = _both_paths(monkeypatch, location, tmp_path, uid="op", savepoint="sp")
    assert fast.entries == slow.entries > 0 and fast.key_groups == slow.key_groups
    assert _data_files(tmp_path / "compiled") == _data_files(tmp_path / "python")
    sp = read_savepoint(tmp_path / "compiled")
    assert {s.name for s in sp.states("op")} >= set(states)


def test_a_value_flink_cannot_hold_is_refused_by_name_on_the_compiled_path(tmp_path):
    """A null list element in a record (Flink's List<String> writes it, List<Long> cannot) and an int that does not
    fit the original savepoint's Short are refused naming the state and the key, as the Python path names them."""
    ser = RecordSerializer("id bigint, tags array<bigint>")
    location = str(tmp_path / "loc")
    _keygroups_savepoint(location, pa.array([1, 2], pa.int64()),
                         {"r": pa.array([{"id": 1, "tags": [1]}, {"id": 2, "tags": [3, None]}],
                                        pa.struct([("id", pa.int64()), ("tags", pa.list_(pa.int64()))]))},
                         {"r": StateColumn("r", serializer=ser)}, 128, 1)
    with pytest.raises(UnsupportedFlinkTypeError, match="state 'r', key 2: Flink's Row.*cannot hold the value"):
        export_savepoint(location, tmp_path / "out", uid="op", savepoint="sp")
    assert not (tmp_path / "out" / "_metadata").exists()


# ---- value by value: compiled transcoding == FlinkType.write of the decoded value -----------------------------------

def _expected(t: FlinkType, ser, data: bytes) -> bytes | None:
    """What the Python path writes for the keygroups bytes ``data`` (None: it refuses the value)."""
    value = ser.deserialize(data)
    out = bytearray()
    try:
        t.write(out, flink_value(t, value))
    except (TypeError, ValueError, OverflowError, struct.error):
        return None
    return bytes(out)


def _compiled(ser, t: FlinkType) -> flinkout.Op:
    return exporter._compile(exporter._top_source(ser.snapshot()), t, whole=True)


def _transcoded(op: flinkout.Op, data: bytes) -> bytes | None:
    try:
        return op.transcode(data)
    except flinkout.UnrepresentableValue:
        return None


texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
floats = st.one_of(st.floats(), st.floats(width=32), st.sampled_from([math.nan, -0.0, math.inf, 3.5e38, 1e-46]))


@st.composite
def typed(draw, depth: int = 0):
    """(keygroups serializer, Flink type, values strategy) of one position."""
    scalars = [
        (Int64Serializer(), LongType(), st.integers(-2 ** 63, 2 ** 63 - 1)),
        (Int32Serializer(), IntType(), st.integers(-2 ** 31, 2 ** 31 - 1)),
        (Int32Serializer(), ShortType(), st.integers(-2 ** 31, 2 ** 31 - 1) | st.integers(-40000, 40000)),
        (Int32Serializer(), ByteType(), st.integers(-300, 300)),
        (Float64Serializer(), DoubleType(), floats),
        (Float64Serializer(), FloatType(), floats),
        (BoolSerializer(), BooleanType(), st.booleans()),
        (StrSerializer(), StringType(), texts),
        (StrSerializer(), CharType(), st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=2)),
        (BytesSerializer(), BytesType(), st.binary(max_size=10)),
    ]
    if depth >= 2:
        return draw(st.sampled_from(scalars))
    kind = draw(st.sampled_from(["scalar", "scalar", "nullable", "tuple", "list", "map"]))
    if kind == "scalar":
        return draw(st.sampled_from(scalars))
    if kind == "nullable":   # (a Nullable of a Nullable takes the Python path)
        ser, t, values = draw(typed(depth + 1).filter(lambda p: not isinstance(p[0], NullableSerializer)))
        return NullableSerializer(ser), NullableType(t, draw(st.sampled_from([0, t.length if t.length > 0 else 0]))), \
            st.none() | values
    if kind == "tuple":
        parts = draw(st.lists(typed(depth + 1), min_size=1, max_size=3))
        return TupleSerializer(*(p[0] for p in parts)), TupleType(tuple(p[1] for p in parts)), \
            st.tuples(*(p[2] for p in parts))
    if kind == "list":
        ser, t, values = draw(typed(depth + 1))
        return ListSerializer(ser), ListType(t), st.lists(values, max_size=4)
    key_ser, key_t, key_values = draw(st.sampled_from([scalars[0], scalars[7], scalars[9]]))
    ser, t, values = draw(typed(depth + 1))
    return MapSerializer(key_ser, ser), MapType(key_t, t), st.dictionaries(key_values, values, max_size=3)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_transcoded_values_equal_flinks_serializer(data):
    ser, t, values = data.draw(typed())
    raw = ser.serialize(data.draw(values))
    assert _transcoded(_compiled(ser, t), raw) == _expected(t, ser, raw)


EXPORTED_SCALARS = [rs.INT8, rs.INT16, rs.INT32, rs.INT64, rs.FLOAT32, rs.FLOAT64, rs.BOOL, rs.STRING, rs.BINARY]


def exported_record_types() -> st.SearchStrategy[rs.RecordType]:
    keys = st.sampled_from([rs.INT32, rs.INT64, rs.STRING, rs.BINARY, rs.BOOL])

    def extend(children):
        return st.one_of(st.builds(rs.ListType, children, st.booleans()),
                         st.builds(rs.MapType, keys, children, st.booleans()), _records(children, 4))

    return _records(st.recursive(st.sampled_from(EXPORTED_SCALARS), extend, max_leaves=6), 5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_transcoded_records_equal_flinks_row_serializer(data):
    """Records (nullable fields, nested records, arrays and maps of them) as Flink's Row with RowKind; also nested
    in a List (a record inside a codec composite carries its length)."""
    schema = data.draw(exported_record_types())
    ser = RecordSerializer(schema)
    row = flink_row_for(schema, "state")
    value = data.draw(values_of(schema))
    raw = ser.serialize(value)
    assert _transcoded(_compiled(ser, row), raw) == _expected(row, ser, raw)
    outer = ListSerializer(NullableSerializer(ser))
    listed = outer.serialize([value, None])
    assert _transcoded(_compiled(outer, ListType(NullableType(row))), listed) == \
        _expected(ListType(NullableType(row)), outer, listed)


def test_strings_become_flinks_string_value_supplementary_characters_included():
    op = _compiled(StrSerializer(), StringType())
    for s in ["", "abc", "\u00e9", "\u4e2d\u6587", "\U0001f600x", "a" * 200, "\uffff\U0010ffff"]:
        out = bytearray()
        StringType().write(out, s)
        assert op.transcode(s.encode("utf-8")) == bytes(out)
    with pytest.raises(CorruptSnapshotError, match="not valid UTF-8"):
        op.transcode(b"\xed\xa0\x80")      # a surrogate in UTF-8
    with pytest.raises(CorruptSnapshotError, match="not valid UTF-8"):
        op.transcode(b"\xc0\x80")          # overlong
    with pytest.raises(flinkout.UnrepresentableValue, match="Character"):
        _compiled(StrSerializer(), CharType()).transcode("\U0001f600".encode())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupt_keygroups_bytes_raise_and_never_crash(data):
    """Truncated, extended or flipped keygroups bytes: the transcoder raises CorruptSnapshotError (or refuses the
    value), never reads past its buffer; what it accepts, Python's decoder accepts and writes the same."""
    if data.draw(st.booleans()):
        ser, t, values = data.draw(typed())
        raw = ser.serialize(data.draw(values))
    else:
        schema = data.draw(exported_record_types())
        ser, t = RecordSerializer(schema), flink_row_for(schema, "state")
        raw = ser.serialize(data.draw(values_of(schema)))
    damaged = bytearray(raw)
    how = data.draw(st.sampled_from(["cut", "extend", "flip"]))
    if how == "cut":
        assume(damaged)
        del damaged[data.draw(st.integers(0, len(damaged) - 1)):]
    elif how == "extend":
        damaged += data.draw(st.binary(min_size=1, max_size=6))
    else:
        assume(damaged)
        i = data.draw(st.integers(0, len(damaged) - 1))
        damaged[i] ^= data.draw(st.integers(1, 255))
    op = _compiled(ser, t)
    try:
        got = op.transcode(bytes(damaged))
    except (CorruptSnapshotError, flinkout.UnrepresentableValue):
        return
    try:
        expected = _expected(t, ser, bytes(damaged))
    except CorruptSnapshotError as e:   # Python's decoder also refuses a map with a repeated key
        assert "duplicate keys" in str(e)
        return
    assert got == expected


# ---- key-group blocks and states ----------------------------------------------------------------------------------

pairs_strategy = st.lists(st.tuples(st.binary(min_size=1, max_size=6), st.binary(max_size=6)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), pairs_strategy), max_size=5, unique_by=lambda s: s[0]))
def test_block_writer_writes_the_python_block(sections):
    sections = sorted(sections)
    writer = flinkout.BlockWriter(1)
    writer.start(7)
    for state_id, pairs in sections:
        writer.add_pairs(state_id, pairs)
    kept = [s for s in sections if s[1]]
    assert writer.finish() == (exporter._block(kept) if kept else None)


def _value_transcoder(ttl: bool = False) -> flinkout.StateTranscoder:
    key = _compiled(Int64Serializer(), LongType())
    return flinkout.StateTranscoder(flinkout.LIST_STATE, key, _compiled(StrSerializer(), StringType()), ttl=ttl)


@pytest.mark.parametrize("damage", ["frame past the end", "short key", "offsets", "bad utf8"])
def test_corrupt_entries_raise_corrupt_snapshot_error(damage):
    writer = flinkout.BlockWriter(2)
    writer.start(300)
    keys = struct.pack("<q", 5)
    value = struct.pack("<I", 3) + b"abc"
    ko, vo = np.array([0, 8], np.int64), np.array([0, len(value)], np.int64)
    if damage == "frame past the end":
        value = struct.pack("<I", 30) + b"abc"
        vo = np.array([0, len(value)], np.int64)
    elif damage == "short key":
        keys = keys[:5]
        ko = np.array([0, 5], np.int64)
    elif damage == "offsets":
        vo = np.array([0, 99], np.int64)
    else:
        value = struct.pack("<I", 2) + b"\xff\xfe"
        vo = np.array([0, len(value)], np.int64)
    with pytest.raises(CorruptSnapshotError):
        writer.add_state(1, _value_transcoder(), keys, ko, value, vo)


def test_timers_are_sorted_by_time_with_the_sign_bit_flipped():
    timers = flinkout.StateTranscoder(flinkout.TIMER_STATE, _compiled(Int64Serializer(), LongType()))
    entry = [struct.pack("<IIq?", 13, 8, ts, True) for ts in (50, -3, 7)]
    value = b"".join(entry)
    writer = flinkout.BlockWriter(1)
    writer.start(2)
    assert writer.add_state(0, timers, struct.pack("<q", 9), np.array([0, 8], np.int64), value,
                            np.array([0, len(value)], np.int64)) == (0, 3)
    keys = [bytes([2]) + struct.pack(">Q", (ts & (2 ** 64 - 1)) ^ (1 << 63)) + struct.pack(">q", 9) + b"\x00"
            for ts in (-3, 7, 50)]
    assert writer.finish() == exporter._block([(0, [(k, b"") for k in keys])])


def test_key_group_entries_reads_each_key_group_once_and_equals_the_whole_range(tmp_path, monkeypatch):
    """``state_reader.key_group_entries`` (what the export streams through): one ranged read per key group and file
    of its chain, never more than one key group's block at once, every byte of the files' blocks read once, and the
    same live entries as reading the whole range at once."""
    from keygroups.checkpoint import CheckpointStorage
    from keygroups.runtime import state_reader
    from keygroups.runtime.state_reader import key_group_entries, load_restore_point

    n = 500
    location = str(tmp_path / "loc")
    _keygroups_savepoint(location, pa.array(range(n), pa.int64()),
                         {"v": pa.array([f"value {i}" * (i % 5) for i in range(n)])}, {"s": "v"}, 256, 2)
    storage = CheckpointStorage(location)
    md = load_restore_point(storage, savepoint="sp")
    reads: list[int] = []
    read_bytes = CheckpointStorage.read_bytes

    def counting(self, rel, start=None, end=None, **kwargs):
        data = read_bytes(self, rel, start, end, **kwargs)
        reads.append(len(data))
        return data

    monkeypatch.setattr(CheckpointStorage, "read_bytes", counting)
    everything = state_reader.KeyGroupRange(0, 255)
    def pairs(e):
        ko, vo = e.key_offsets.tolist(), e.value_offsets.tolist()
        return [(bytes(e.keys[ko[i]:ko[i + 1]]), bytes(e.values[vo[i]:vo[i + 1]])) for i in range(len(e))]

    streamed = [(kg, {s: pairs(e) for s, (_, e) in live.items()})
                for kg, live in key_group_entries(storage, md, everything)]
    blocks = [h.byte_range(state_reader.KeyGroupRange(kg, kg)) for h in md.keyed_handles for kg in h.key_group_range]
    assert len(reads) == len(blocks) and sum(reads) == sum(end - start for start, end in blocks)
    assert max(reads) == max(end - start for start, end in blocks)
    whole = [(kg, {s: pairs(e) for s, (_, e) in live.items()})
             for kg, live in state_reader._chains(storage, md, everything)]
    assert streamed == whole and sum(len(live["s"]) for _, live in streamed) == n


STATE_TRANSCODERS = {
    "value ttl": lambda: flinkout.StateTranscoder(flinkout.VALUE_STATE, _compiled(StrSerializer(), StringType()),
                                                  _compiled(TupleSerializer(Int64Serializer(), StrSerializer()),
                                                            TupleType((LongType(), StringType()))), ttl=True),
    "list": lambda: _value_transcoder(),
    "list ttl": lambda: _value_transcoder(ttl=True),
    "map ttl": lambda: flinkout.StateTranscoder(flinkout.MAP_STATE, _compiled(Int64Serializer(), LongType()),
                                                _compiled(NullableSerializer(Int64Serializer()),
                                                          NullableType(LongType())),
                                                _compiled(StrSerializer(), StringType()), ttl=True),
    "timers": lambda: flinkout.StateTranscoder(flinkout.TIMER_STATE, _compiled(Int64Serializer(), LongType())),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(STATE_TRANSCODERS)), st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=40)),
                                                             max_size=4))
def test_random_entry_bytes_raise_corrupt_or_transcode_and_never_crash(kind, entries):
    """Whatever bytes a state's keys and values hold, add_state transcodes them or raises CorruptSnapshotError
    (UnrepresentableValue for a value Flink cannot hold); it never reads past the buffers."""
    keys = b"".join(k for k, _ in entries)
    values = b"".join(v for _, v in entries)
    ko = np.cumsum([0] + [len(k) for k, _ in entries]).astype(np.int64)
    vo = np.cumsum([0] + [len(v) for _, v in entries]).astype(np.int64)
    writer = flinkout.BlockWriter(2)
    writer.start(1000)
    try:
        writer.add_state(3, STATE_TRANSCODERS[kind](), keys, ko, values, vo)
    except (CorruptSnapshotError, flinkout.UnrepresentableValue):
        return
    block = writer.finish()
    assert block is None or block.endswith(b"\xff\xff")


def test_an_op_tree_cannot_be_made_cyclic():
    op = flinkout.Op(flinkout.LIST, flinkout.FLINK_LIST, (flinkout.Op(flinkout.I64, flinkout.LONG),))
    with pytest.raises(TypeError, match="twice"):
        op.__init__(flinkout.LIST, flinkout.FLINK_LIST, (op,))
    with pytest.raises(ValueError, match="cannot be written"):
        flinkout.Op(flinkout.STR, flinkout.LONG)


@pytest.mark.parametrize("bits", [0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001])
def test_every_nan_goes_to_flink_as_javas_one_nan(bits):
    """Java's writeDouble/writeFloat write doubleToLongBits/floatToIntBits: a NaN of any payload or sign is written
    as the canonical one, by the compiled path and the Python path alike."""
    stored = struct.pack("<Q", bits)   # keygroups' Float64 bytes of a NaN with this payload
    nan = struct.unpack("<d", stored)[0]
    for t, canonical in ((DoubleType(), "7ff8000000000000"), (FloatType(), "7fc00000")):
        written = bytearray()
        t.write(written, nan)
        assert written.hex() == canonical
        assert _compiled(Float64Serializer(), t).transcode(stored).hex() == canonical
