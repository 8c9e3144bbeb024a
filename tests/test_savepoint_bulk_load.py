"""Bulk loading: a savepoint written from Arrow rows (``write_savepoint_subtask``, in bulk: keys and plain values
serialized column-wise) restores into either backend, at another parallelism, with every key's values; duplicates
are refused whatever the key type."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime.state_writer import (
    DuplicateKeyError,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor

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
