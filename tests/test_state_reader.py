"""The Spark-free state reader and savepoint writer (keygroups.runtime.state_reader / state_writer): rows equal what
a backend restored from the same checkpoint shows, for all five kinds, both backends, TTL on and off, over
incremental chains written at changing parallelisms; partitions; the metadata and operator views; savepoints
written from rows restore into a backend; damaged and foreign input fails clearly."""

from __future__ import annotations

import datetime
import json
import os

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from state_views import MAXP, STATES, T0, backend_view, build_chain, descriptors, expected_rows
from test_serializers_strategies import serializers_and_values
from timer_checkpoints import run_timer_job

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups._native import splitter
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, SerializedState, write_operator_snapshot
from keygroups.checkpoint.metadata import DistributionMode
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError
from keygroups.runtime.state_reader import (
    KeyedStateReader,
    StateNotFoundError,
    key_group_partitions,
    load_restore_point,
    metadata_table,
    operator_state_table,
    read_timers,
    timer_counts,
    timer_schema,
)
from keygroups.runtime.state_types import arrow_type, is_typed, python_values
from keygroups.runtime.state_writer import (
    DuplicateKeyError,
    StateColumn,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.serializers import (
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    NullableSerializer,
    PickleSerializer,
    StrSerializer,
    TupleSerializer,
    ValueSerializer,
)
from keygroups.state import HeapKeyedStateBackend, MapStateDescriptor, StateTtlConfig, ValueStateDescriptor

KEYS = list(range(60))


def plain(v):
    """A value as Arrow's to_pylist gives it, in the state API's form: structs as tuples, maps as dicts,
    timestamps as ms."""
    if isinstance(v, dict):
        return tuple(plain(x) for x in v.values())
    if isinstance(v, list) and v and all(isinstance(x, tuple) and len(x) == 2 for x in v):
        return {plain(k): plain(x) for k, x in v}
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, datetime.datetime):
        return round(v.timestamp() * 1000)
    return v


def read_all(reader: KeyedStateReader, ranges=None) -> list[tuple]:
    rows = []
    for r in ranges or reader.partitions(count=3):
        for batch in reader.read(r):
            assert batch.schema == reader.schema
            rows += [tuple(plain(x) for x in row.values()) for row in batch.to_pylist()]
    return sorted(rows, key=repr)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
@pytest.mark.parametrize("ttl", [False, True], ids=["no-ttl", "ttl"])
def test_rows_equal_the_backends_view_over_an_incremental_chain(backend, ttl, tmp_path):
    storage, md, model = build_chain(str(tmp_path), backend, ttl, [1, 3, 2, 4], KEYS)
    assert any(not h.is_all_full for h in md.keyed_handles)   # the last checkpoint is a chain of deltas
    view = backend_view(storage, md, backend, ttl)
    assert view == {s: {k: v for k, v in model.values[s].items()} for s in STATES}   # the reference itself
    for state in STATES:
        for flatten in (False, True):
            reader = KeyedStateReader(storage, md, state, flatten=flatten)
            assert read_all(reader) == expected_rows(view, model, state, ttl=ttl, flatten=flatten), (state, flatten)


def test_every_partitioning_reads_the_same_rows(tmp_path):
    storage, md, _ = build_chain(str(tmp_path), "heap", False, [2, 3], KEYS)
    reader = KeyedStateReader(storage, md, "l", flatten=True, batch_rows=7)
    whole = read_all(reader, [KeyGroupRange(0, MAXP - 1)])
    for count in (1, 2, 5, MAXP, 100):
        parts = key_group_partitions(md, count=count)
        assert len(parts) <= count and all(a.end < b.start for a, b in zip(parts, parts[1:]))
        assert read_all(reader, parts) == whole
    by_bytes = key_group_partitions(md, target_bytes=1)
    assert len(by_bytes) == len({assign_to_key_group(k, MAXP) for k in KEYS})   # one per key group with state
    assert read_all(reader, by_bytes) == whole
    assert key_group_partitions(md, target_bytes=1 << 30) == [KeyGroupRange(by_bytes[0].start, by_bytes[-1].end)]


def test_schema_names_and_types(tmp_path):
    storage, md, _ = build_chain(str(tmp_path), "heap", True, [1], KEYS)
    v = KeyedStateReader(storage, md, "v").schema
    assert v.names == ["key", "key_group", "value", "ttl_timestamp"]
    assert v.field("value").type == pa.struct([("_1", pa.int64()), ("_2", pa.string())])
    m = KeyedStateReader(storage, md, "m", key_columns=["user"]).schema
    assert m.names == ["user", "key_group", "value", "ttl_timestamps"]
    assert m.field("value").type == pa.map_(pa.string(), pa.float64())
    assert KeyedStateReader(storage, md, "m", flatten=True).schema.names == [
        "key", "key_group", "map_key", "value", "ttl_timestamp"]
    assert KeyedStateReader(storage, md, "l", flatten=True).schema.names == [
        "key", "key_group", "index", "value", "ttl_timestamp"]
    assert KeyedStateReader(storage, md, "r", flatten=True).schema.names == ["key", "key_group", "value",
                                                                             "ttl_timestamp"]
    with pytest.raises(ValueError, match="keyColumns names 2 columns .* give 1 names"):
        KeyedStateReader(storage, md, "v", key_columns=["a", "b"])
    with pytest.raises(ValueError, match=r"columns \['value'\] appear twice"):
        KeyedStateReader(storage, md, "v", key_columns=["value"])


def test_serializers_map_to_arrow_types_and_opaque_ones_to_binary():
    t = TupleSerializer(Int32Serializer(), NullableSerializer(StrSerializer()),
                        ListSerializer(MapSerializer(StrSerializer(), Float64Serializer())))
    assert arrow_type(t.snapshot()) == pa.struct([("_1", pa.int32()), ("_2", pa.string()),
                                                  ("_3", pa.list_(pa.map_(pa.string(), pa.float64())))])
    for opaque in (PickleSerializer(), ValueSerializer(), TupleSerializer(Int64Serializer(), PickleSerializer()),
                   ListSerializer(ValueSerializer())):
        assert not is_typed(opaque.snapshot()) and arrow_type(opaque.snapshot()) == pa.binary()
    # values come back through Arrow in the form the serializer takes, sliced arrays too
    values = [(7, None, [{"a": 1.5}, {}]), None, (0, "x", [])]
    arr = pa.array(values, type=arrow_type(t.snapshot()))
    assert python_values(arr, t.snapshot()) == values
    assert python_values(pa.chunked_array([arr.slice(1), arr.slice(0, 1)]), t.snapshot()) == values[1:] + values[:1]


@settings(max_examples=150)
@given(st.data())
def test_typed_values_cross_arrow_unchanged(data):
    serializer, values_strategy = data.draw(serializers_and_values)
    snapshot = serializer.snapshot()
    values = data.draw(st.lists(values_strategy, max_size=6))
    if not is_typed(snapshot):
        assert arrow_type(snapshot) == pa.binary()
        return
    decoded = [serializer.deserialize(serializer.serialize(v)) for v in values]   # as the reader decodes them
    column = pa.array(decoded, type=arrow_type(snapshot))
    assert python_values(column, snapshot) == decoded                             # as the writer takes them
    assert [serializer.deserialize(serializer.serialize(v)) for v in python_values(column, snapshot)] == decoded


def test_tuple_keys_and_opaque_values_are_columns_and_bytes(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    key_ser = TupleSerializer(StrSerializer(), Int64Serializer())
    be = HeapKeyedStateBackend(KeyGroupRange(0, 7), 8, key_ser, allow_pickle=True)
    pickled = be.get_state(ValueStateDescriptor("p", PickleSerializer()))
    json_like = be.get_state(MapStateDescriptor("j", Int64Serializer(), ValueSerializer()))
    for i in range(20):
        be.set_current_key((f"u{i}", i))
        pickled.update({"set": {i}})
        json_like.put(i, [i, "x"])
    storage.commit(CheckpointMetadata(1, "j", 0, 8, 1, [be.snapshot(1, storage).result()]))
    md = storage.load(1)
    p = KeyedStateReader(storage, md, "p", key_columns=["user", "n"])
    assert p.schema.names == ["user", "n", "key_group", "value"] and p.schema.field("value").type == pa.binary()
    rows = read_all(p)
    assert sorted((r[0], r[1]) for r in rows) == sorted((f"u{i}", i) for i in range(20))
    assert {r[3] for r in rows} == {PickleSerializer().serialize({"set": {i}}) for i in range(20)}   # not unpickled
    j = read_all(KeyedStateReader(storage, md, "j", flatten=True))
    assert sorted((r[0], r[1], r[3], ValueSerializer().deserialize(r[4])) for r in j) == sorted(
        (f"u{i}", i, i, [i, "x"]) for i in range(20))


def test_metadata_view_counts_keys_entries_and_bytes(tmp_path):
    storage, md, model = build_chain(str(tmp_path), "heap", True, [2, 3], KEYS)
    table = metadata_table(storage, md).to_pylist()
    assert {r["state"] for r in table} == set(STATES)
    for state in STATES:
        rows = [r for r in table if r["state"] == state]
        assert sum(r["keys"] for r in rows) == len(model.values[state])
        sizes = {"l": len, "m": len}.get(state, lambda v: 1)
        assert sum(r["entries"] for r in rows) == sum(sizes(v) for v in model.values[state].values())
        assert all(r["ttl_ms"] == 86_400_000 and r["subtask"] == r["key_group"] * 3 // MAXP for r in rows)
    r = next(r for r in table if r["state"] == "m")
    assert r["kind"] == "map" and dict(r["serializers"]) == {
        "key": "Int64Serializer()", "map key": "StrSerializer()", "map value": "Float64Serializer()"}
    assert all(0 < r["state_bytes"] <= r["chain_bytes"] and r["chain_blocks"] >= 1 for r in table)
    part = metadata_table(storage, md, KeyGroupRange(3, 5)).to_pylist()
    assert part == [r for r in table if 3 <= r["key_group"] <= 5]


def test_operator_state_per_subtask_and_mode(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    handles = []
    for subtask, (offsets_list, rules) in enumerate([([1, 2, 3], {"a": 1}), ([4], {"a": 1})]):
        data, offsets = Int64Serializer().serialize_many(offsets_list)
        kd, ko = StrSerializer().serialize_many(list(rules))
        vd, vo = Int64Serializer().serialize_many(list(rules.values()))
        bdata, boffsets = splitter.encode_entries(kd, ko, vd, vo)
        snap = {"serializer": Int64Serializer().snapshot().to_json()}
        handles.append(write_operator_snapshot(storage, storage.new_file(1, f"operator-{subtask}"), [
            SerializedState("offsets", DistributionMode.SPLIT_DISTRIBUTE, snap, data, offsets),
            SerializedState("rules", DistributionMode.BROADCAST,
                            {"key_serializer": StrSerializer().snapshot().to_json(),
                             "value_serializer": Int64Serializer().snapshot().to_json()}, bdata, boffsets)],
            subtask=subtask, operator_id="source"))
    storage.commit(CheckpointMetadata(1, "j", 0, 8, 2, [], handles))
    md = storage.load(1)
    assert operator_state_table(storage, md, "offsets").to_pylist() == [
        {"operator_id": "source", "subtask": 0, "mode": "SPLIT_DISTRIBUTE", "index": i, "value": v}
        for i, v in enumerate([1, 2, 3])] + [
        {"operator_id": "source", "subtask": 1, "mode": "SPLIT_DISTRIBUTE", "index": 0, "value": 4}]
    assert operator_state_table(storage, md, "rules").to_pylist() == [
        {"operator_id": "source", "subtask": s, "mode": "BROADCAST", "index": 0, "key": "a", "value": 1}
        for s in (0, 1)]
    with pytest.raises(StateNotFoundError, match=r"no operator state named 'nope'.*operator states: \['offsets', "
                                                 r"'rules'\]"):
        operator_state_table(storage, md, "nope")


# ---- restore points and damaged input ------------------------------------------------------------------------------


def test_restore_points_latest_by_id_and_savepoint(tmp_path):
    storage, md, _ = build_chain(str(tmp_path), "heap", False, [1, 2, 2], KEYS)
    assert load_restore_point(storage).checkpoint_id == 3
    first = load_restore_point(storage, checkpoint_id=1)
    assert first.checkpoint_id == 1
    storage.savepoint(md, "sp")
    sp = load_restore_point(storage, savepoint="sp")
    assert read_all(KeyedStateReader(storage, sp, "m")) == read_all(KeyedStateReader(storage, md, "m"))
    assert read_all(KeyedStateReader(storage, first, "m")) != read_all(KeyedStateReader(storage, md, "m"))
    with pytest.raises(ValueError, match="not both"):
        load_restore_point(storage, checkpoint_id=1, savepoint="sp")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 9 does not exist"):
        load_restore_point(storage, checkpoint_id=9)
    with pytest.raises(CheckpointNotFoundError, match="savepoint 'x' does not exist"):
        load_restore_point(storage, savepoint="x")
    with pytest.raises(CheckpointNotFoundError, match="holds no complete checkpoint"):
        load_restore_point(CheckpointStorage(str(tmp_path / "empty")))
    with pytest.raises(StateNotFoundError, match=r"holds no keyed state named 'nope'; its keyed states: "
                                                 r"\['a', 'l', 'm', 'r', 'v'\]"):
        KeyedStateReader(storage, md, "nope")


def test_damaged_files_raise_corrupt_snapshot_errors(tmp_path):
    storage, md, _ = build_chain(str(tmp_path), "heap", False, [1, 2], KEYS)
    reader = KeyedStateReader(storage, md, "v")
    newest = max(md.keyed_handles, key=lambda h: h.checkpoint_id)
    path = os.path.join(str(tmp_path), newest.file)
    data = bytearray(open(path, "rb").read())
    data[newest.offsets[1] + 20] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptSnapshotError, match=newest.file.split("/")[-1]):
        read_all(reader, [KeyGroupRange(0, MAXP - 1)])
    os.remove(path)
    with pytest.raises(CorruptSnapshotError, match="is missing"):
        read_all(reader, [KeyGroupRange(0, MAXP - 1)])
    meta = os.path.join(str(tmp_path), "chk-1", "_metadata")
    open(meta, "r+b").write(b"not a keygroups file")
    with pytest.raises(CorruptSnapshotError, match="_metadata"):
        load_restore_point(storage, checkpoint_id=1)


# ---- the savepoint writer without Spark ----------------------------------------------------------------------------


def write_rows(tmp_path, table: pa.Table, *, parallelism: int, **kwargs
               ) -> tuple[CheckpointStorage, CheckpointMetadata]:
    """As keygroups.spark.write_savepoint does, with the rows split over the subtasks in Python."""
    plan = plan_savepoint(table.schema, str(tmp_path), "boot", max_parallelism=MAXP, parallelism=parallelism,
                          **kwargs)
    keys = table.column(plan.key_columns[0]).to_pylist()
    handles = []
    for subtask in range(parallelism):
        groups = key_group_range(MAXP, parallelism, subtask)
        mine = [i for i, k in enumerate(keys) if assign_to_key_group(k, MAXP) in groups]
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine, pa.int64())).to_batches()))
    commit_savepoint(plan, handles)
    storage = CheckpointStorage(str(tmp_path))
    return storage, storage.load_savepoint("boot")


def test_written_savepoint_restores_into_a_backend_and_reads_back(tmp_path):
    n = 40
    table = pa.table({
        "k": pa.array(range(n), pa.int64()),
        "total": pa.array([i * 3 if i % 4 else None for i in range(n)], pa.int64()),
        "pair": pa.array([(i, f"s{i}") for i in range(n)], pa.struct([("a", pa.int64()), ("b", pa.string())])),
        "items": pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int64())),
        "prefs": pa.array([{"x": float(i)} for i in range(n)], pa.map_(pa.string(), pa.float64())),
        "seen": pa.array([datetime.datetime.fromtimestamp(T0 + i, datetime.timezone.utc) for i in range(n)],
                         pa.timestamp("us", tz="UTC")),
    })
    ttl = StateTtlConfig.new_builder(86400).build()
    storage, md = write_rows(tmp_path, table, parallelism=3, key_columns="k", states={
        "total": StateColumn("total", kind="reducing"), "pair": "pair", "items": "items",
        "prefs": StateColumn("prefs", ttl=ttl, ttl_column="seen")})
    assert md.parallelism == 3 and md.properties["key_columns"] == ["k"] and md.checkpoint_id == 0
    be = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), clock=lambda: T0 + 50)
    be.restore(storage, md)
    ds = descriptors(False)
    pair = be.get_state(ValueStateDescriptor("pair", TupleSerializer(Int64Serializer(), StrSerializer())))
    prefs_d = MapStateDescriptor("prefs", StrSerializer(), Float64Serializer())
    prefs_d.enable_time_to_live(ttl)
    prefs = be.get_state(prefs_d)
    items = be.get_state(type(ds["l"])("items", Int64Serializer()))
    total = be.get_state(type(ds["r"])("total", lambda a, b: a + b, Int64Serializer()))
    for i in range(n):
        be.set_current_key(i)
        assert pair.value() == (i, f"s{i}") and items.get() == [i, i + 1] and dict(prefs.items()) == {"x": float(i)}
        assert total.get() == (i * 3 if i % 4 else None)
    rows = read_all(KeyedStateReader(storage, md, "prefs", flatten=True))
    assert rows == sorted([(i, assign_to_key_group(i, MAXP), "x", float(i), int((T0 + i) * 1000)) for i in range(n)],
                          key=repr)


def test_writer_refuses_bad_requests_before_writing(tmp_path):
    table = pa.table({"k": pa.array([1, 2, 1], pa.int64()), "v": pa.array([1, 2, 3], pa.int64()),
                      "t": pa.array([datetime.datetime(2024, 1, 1)] * 3, pa.timestamp("us")),
                      "b": pa.array([b"x"] * 3, pa.binary())})
    common = {"max_parallelism": MAXP, "parallelism": 2}
    with pytest.raises(ValueError, match=r"column 'nope' is not in the input; its columns: \['k', 'v', 't', 'b'\]"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k", states={"s": "nope"}, **common)
    with pytest.raises(TypeError, match="has type timestamp.*no typed serializer"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k", states={"s": "t"}, **common)
    with pytest.raises(TypeError, match="a list state takes an array column"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k", states={"s": StateColumn("v", "list")},
                       **common)
    with pytest.raises(TypeError, match="given as their serialized bytes, a binary column"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k",
                       states={"s": StateColumn("v", serializer=PickleSerializer())}, **common)
    with pytest.raises(ValueError, match="kind 'set' is not one of"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k", states={"s": StateColumn("v", "set")},
                       **common)
    with pytest.raises(ValueError, match="parallelism"):
        plan_savepoint(table.schema, str(tmp_path), "x", key_columns="k", states={"s": "v"}, max_parallelism=4,
                       parallelism=5)
    with pytest.raises(DuplicateKeyError, match="key 1 comes in more than one row"):
        write_rows(tmp_path, table, parallelism=1, key_columns="k", states={"s": "v"})
    assert not os.path.exists(tmp_path / "savepoints" / "boot" / "_metadata")
    ok = table.slice(1)
    write_rows(tmp_path, ok, parallelism=1, key_columns="k", states={"s": "v"})
    with pytest.raises(ValueError, match="savepoint 'boot' already exists"):
        write_rows(tmp_path, ok, parallelism=1, key_columns="k", states={"s": "v"})
    # an opaque serializer takes the bytes as given, byte for byte
    storage, md = write_rows(tmp_path / "o", ok, parallelism=1, key_columns="k",
                             states={"p": StateColumn("b", serializer=PickleSerializer())})
    assert json.loads(json.dumps(md.keyed_handles[0].states[0]["serializers"]["value"]))["identifier"] == "pickle"
    assert [r[2] for r in read_all(KeyedStateReader(storage, md, "p"))] == [b"x", b"x"]


# ---- timers offline ---------------------------------------------------------------------------------------------------


def test_timers_are_read_back_per_key_domain_and_timestamp(tmp_path):
    storage, live = run_timer_job(str(tmp_path))
    md = storage.latest()
    assert timer_schema(md).names == ["key", "key_group", "domain", "timestamp"]
    table = read_timers(storage, md)
    assert table.schema == timer_schema(md)
    rows = table.to_pylist()
    assert {(r["key"], r["domain"], r["timestamp"]) for r in rows} == live and len(rows) == len(live)
    assert all(r["key_group"] == assign_to_key_group(r["key"], md.max_parallelism) for r in rows)
    assert [(r["domain"], r["timestamp"]) for r in rows] == sorted((r["domain"], r["timestamp"]) for r in rows)
    # a range of key groups reads only its timers; key columns can be named
    part = read_timers(storage, md, KeyGroupRange(0, 5), key_columns=["user"]).to_pylist()
    assert part == [dict(user=r["key"], **{c: r[c] for c in ("key_group", "domain", "timestamp")})
                    for r in rows if r["key_group"] <= 5]
    # the hidden states read as the map states they are
    hidden = read_all(KeyedStateReader(storage, md, "_timers/event-time", flatten=True),
                      [KeyGroupRange(0, md.max_parallelism - 1)])
    assert {(k, ts) for k, _, ts, flag in hidden} == {(k, ts) for k, d, ts in live if d == "event-time"}
    assert all(flag is True for *_, flag in hidden)
    # counts per key group and domain, with the earliest
    counts = {(r["key_group"], r["domain"]): (r["timers"], r["earliest"]) for r in timer_counts(storage, md).to_pylist()}
    want: dict = {}
    for k, d, ts in live:
        n, first = want.get((assign_to_key_group(k, md.max_parallelism), d), (0, ts))
        want[(assign_to_key_group(k, md.max_parallelism), d)] = (n + 1, min(first, ts))
    assert counts == want


def test_a_restore_point_without_timers_reads_none(tmp_path):
    storage, md, _ = build_chain(str(tmp_path), "heap", False, [2, 3], KEYS)
    assert read_timers(storage, md).num_rows == 0
    assert timer_counts(storage, md).num_rows == 0


def test_event_time_ttl_values_without_a_watermark_read_with_a_null_timestamp(tmp_path):
    from keygroups.state import TtlTimeCharacteristic

    storage = CheckpointStorage(str(tmp_path))
    be = HeapKeyedStateBackend(KeyGroupRange(0, 7), 8, Int64Serializer())
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(StateTtlConfig.new_builder(datetime.timedelta(minutes=5))
                          .set_ttl_time_characteristic(TtlTimeCharacteristic.EventTime).build())
    state = be.get_state(d)
    for k in range(4):
        be.set_current_key(k)
        if k == 3:
            be.watermark = 1_000   # the job's first watermark: from here on writes are stamped with it
        state.update(k * 10)
    storage.commit(CheckpointMetadata(1, "j", 0, 8, 1, [be.snapshot(1, storage).result()]))
    rows = read_all(KeyedStateReader(storage, storage.load(1), "v"))
    stamps = {r[0]: r[3] for r in rows}
    assert [stamps[k] for k in range(3)] == [None, None, None]
    assert stamps[3] == 1_000   # (read_all gives plain epoch ms)
