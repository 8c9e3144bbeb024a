"""Bulk loading: a savepoint written from Arrow rows (``write_savepoint_subtask``, in bulk: keys and plain values
serialized column-wise) restores into either backend, at another parallelism, with every key's values; duplicates
are refused whatever the key type."""

from __future__ import annotations

import dataclasses
import datetime

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import state_writer
from keygroups.runtime.state_writer import (
    DuplicateKeyError,
    StateColumn,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, StateTtlConfig, ValueStateDescriptor

MAXP = 128


def write(tmp_path, table, parallelism, key_column="k"):
    plan = plan_savepoint(table.schema, str(tmp_path), "bulk", key_columns=key_column,
                          states={"count": "count", "sum": "sum"}, max_parallelism=MAXP, parallelism=parallelism)
    groups = np.asarray(assign_key_groups(table.column(key_column), MAXP))
    handles = []
    for subtask in range(parallelism):
        r = key_group_range(MAXP, parallelism, subtask)
        mine = np.flatnonzero((groups >= r.start) & (groups <= r.end))
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine)).to_batches()))
    commit_savepoint(plan, handles)
    storage = CheckpointStorage(str(tmp_path))
    return storage, storage.load_savepoint("bulk")


@pytest.mark.parametrize("backend", [HeapKeyedStateBackend, RocksDBKeyedStateBackend])
def test_a_bulk_written_savepoint_restores_into_either_backend(tmp_path, backend):
    n = 50_000
    keys = np.arange(n, dtype=np.int64) * 7919 - 123_456
    table = pa.table({"k": keys, "count": keys % 1000, "sum": pa.array(np.where(keys % 7 == 0, None, keys * 3),
                                                                          pa.int64())})
    storage, metadata = write(tmp_path, table, parallelism=2)
    owners = np.asarray(assign_key_groups(keys, MAXP))
    for subtask in range(3):
        r = key_group_range(MAXP, 3, subtask)
        b = backend(r, MAXP, Int64Serializer(), subtask_index=subtask)
        try:
            b.restore(storage, metadata)
            count = b.get_state(ValueStateDescriptor("count", Int64Serializer()))
            total = b.get_state(ValueStateDescriptor("sum", Int64Serializer()))
            mine = keys[(owners >= r.start) & (owners <= r.end)].tolist()
            for k in mine:
                b.set_current_key(k)
                assert count.value() == k % 1000
                assert total.value() == (None if k % 7 == 0 else k * 3)
            assert sorted(b.keys("count")) == sorted(mine)
        finally:
            b.dispose()


def test_string_keys_load_and_duplicates_are_refused(tmp_path):
    keys = [f"user-{i}" * (1 + i % 3) for i in range(3000)]
    table = pa.table({"k": keys, "count": np.arange(3000, dtype=np.int64), "sum": np.ones(3000, dtype=np.int64)})
    storage, metadata = write(tmp_path / "ok", table, parallelism=1)
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, StrSerializer())
    try:
        b.restore(storage, metadata)
        count = b.get_state(ValueStateDescriptor("count", Int64Serializer()))
        for i in (0, 1, 2, 2999):
            b.set_current_key(keys[i])
            assert count.value() == i
    finally:
        b.dispose()
    twice = pa.concat_tables([table, table.slice(2500, 1)])
    with pytest.raises(DuplicateKeyError, match="user-2500"):
        write(tmp_path / "dup", twice, parallelism=1)
    ints = pa.table({"k": np.array([5, 9, 5], dtype=np.int64), "count": np.zeros(3, dtype=np.int64),
                     "sum": np.zeros(3, dtype=np.int64)})
    with pytest.raises(DuplicateKeyError, match="key 5 comes"):
        write(tmp_path / "dupint", ints, parallelism=1)


# ---- list, map, TTL and partly null states: framed in bulk, the bytes the value-by-value path writes -----------------

def entries_of(storage, metadata):
    """(key group, state name, key bytes) -> value bytes of every keyed file of a savepoint."""
    from keygroups.checkpoint import read_key_groups
    out = {}
    for handle in metadata.keyed_handles:
        blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
        for block in blocks:
            for index, keys, values in block.puts:
                for k, v in zip(keys, values):
                    out[(block.key_group, handle.states[index]["name"], k)] = v
    return out


def write_states(location, table, states, parallelism=2):
    plan = plan_savepoint(table.schema, location, "s", key_columns="k", states=states, max_parallelism=MAXP,
                          parallelism=parallelism)
    plan = dataclasses.replace(plan, written_ms=1_700_000_000_123)
    groups = np.asarray(assign_key_groups(table.column("k"), MAXP))
    handles = []
    for subtask in range(parallelism):
        r = key_group_range(MAXP, parallelism, subtask)
        mine = np.flatnonzero((groups >= r.start) & (groups <= r.end))
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine)).to_batches(max_chunksize=7)))
    metadata = commit_savepoint(plan, handles)
    return CheckpointStorage(location), metadata


TTL = StateTtlConfig.new_builder(60).build()
ROWS = st.lists(st.tuples(
    st.one_of(st.none(), st.lists(st.integers(-5, 5), max_size=4)),                       # a list
    st.one_of(st.none(), st.dictionaries(st.text("ab\u00e9", max_size=3), st.integers(-2**40, 2**40), max_size=4)),   # a map
    st.one_of(st.none(), st.text(max_size=5)),                                            # a value, with TTL
    st.one_of(st.none(), st.integers(-2**50, 2**50)),                                    # its ms stamp
    st.one_of(st.none(), st.datetimes(min_value=datetime.datetime(1960, 1, 1))),       # a timestamp stamp
    st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 2**45)), max_size=4)),   # per element
), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS, repeat_map_key=st.booleans())
def test_list_map_and_ttl_states_are_framed_in_bulk_as_value_by_value(tmp_path_factory, rows, repeat_map_key,
                                                                       monkeypatch):
    n = len(rows)
    lists, maps, texts, ms, stamps, element_stamps = (list(c) for c in zip(*rows)) if rows else ([],) * 6
    map_type = pa.map_(pa.string(), pa.int64())
    map_values = [None if m is None else list(m.items()) for m in maps]
    if repeat_map_key and any(map_values):
        i = next(i for i, m in enumerate(map_values) if m)
        map_values[i] = map_values[i] + [(map_values[i][0][0], 99)]   # the last entry of a key counts
    # per-element stamps only where their count fits the list (else the value-by-value path refuses the row)
    element_stamps = [s if s is None or (x is not None and len(s) == len(x)) else None
                      for s, x in zip(element_stamps, lists)]
    table = pa.table({
        "k": pa.array(np.arange(n, dtype=np.int64) * 31 + 7),
        "list": pa.array(lists, pa.list_(pa.int64())),
        "map": pa.array(map_values, map_type),
        "text": pa.array(texts, pa.string()),
        "ms": pa.array(ms, pa.int64()),
        "at": pa.array(stamps, pa.timestamp("us")),
        "per": pa.array(element_stamps, pa.list_(pa.int64())),
    })
    states = {
        "list": "list", "map": "map", "text": "text",
        "ttl list": StateColumn("list", ttl=TTL, ttl_column="per"),
        "ttl list at": StateColumn("list", ttl=TTL, ttl_column="at"),
        "ttl map": StateColumn("map", ttl=TTL, ttl_column="ms"),
        "ttl map now": StateColumn("map", ttl=TTL),
        "ttl text": StateColumn("text", ttl=TTL, ttl_column="at"),
        "ttl text ms": StateColumn("text", ttl=TTL, ttl_column="ms"),
    }
    storage, metadata = write_states(str(tmp_path_factory.mktemp("bulk")), table, states)
    framed = []
    monkeypatch.setattr(state_writer, "_framed", lambda *a: framed.append(a) or None)   # the value-by-value path
    reference = write_states(str(tmp_path_factory.mktemp("values")), table, states)
    monkeypatch.undo()
    assert entries_of(storage, metadata) == entries_of(*reference)


def test_bulk_framing_takes_list_map_and_ttl_columns_without_encoding_values_one_by_one(tmp_path, monkeypatch):
    n = 2000
    keys = np.arange(n, dtype=np.int64)
    table = pa.table({"k": keys, "list": pa.array([[int(k), -1] for k in keys], pa.list_(pa.int64())),
                      "map": pa.array([[("a", int(k))] for k in keys], pa.map_(pa.string(), pa.int64())),
                      "v": pa.array(np.where(keys % 3 == 0, None, keys), pa.int64()),
                      "at": pa.array(keys * 1000, pa.int64())})
    states = {"list": "list", "map": "map", "v": StateColumn("v", ttl=TTL, ttl_column="at")}

    def refuse(*args):
        raise AssertionError("a value encoded one by one")

    monkeypatch.setattr(state_writer._Encoder, "encode", refuse)
    storage, metadata = write_states(str(tmp_path), table, states)
    b = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
    b.restore(storage, metadata)
    from keygroups.state import ListStateDescriptor, MapStateDescriptor
    lst = b.get_state(ListStateDescriptor("list", Int64Serializer()))
    mp = b.get_state(MapStateDescriptor("map", StrSerializer(), Int64Serializer()))
    for k in (0, 1, 1999):
        b.set_current_key(k)
        assert list(lst.get()) == [k, -1]
        assert mp.get("a") == k
