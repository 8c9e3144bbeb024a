"""The RocksDB backend across batches: the per-batch cache (bounded, flushed, prefetched) and the warm database kept
on local disk, reused only at the exact checkpoint and snapshot file its marker names (real files, real RocksDB)."""

from __future__ import annotations

import io
import json
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keygroups import KeyGroupRange, assign_operators, assign_to_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.driver import begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)


def make(warm_dir=None, kgr=FULL, **kw):
    return RocksDBKeyedStateBackend(kgr, MAXP, Int64Serializer(), warm_dir=warm_dir, **kw)


def commit(storage, handles, checkpoint_id):
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="test", timestamp_ms=0,
                                      max_parallelism=MAXP, parallelism=1, keyed_handles=handles,
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def states(b):
    return (b.get_state(ValueStateDescriptor("v", Int64Serializer())),
            b.get_state(ListStateDescriptor("l", ValueSerializer())),
            b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer())))


def write(b, keys, delta):
    v, lst, m = states(b)
    for k in keys:
        b.set_current_key(k)
        v.update((v.value() or 0) + delta)
        lst.add(delta)
        m.put(str(delta), k)


def read(b, keys):
    v, lst, m = states(b)
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = (v.value(), lst.get(), sorted(m.items()))
    return out


KEYS = range(200)


def first_checkpoint(tmp_path, warm):
    """Checkpoint 1 written by a backend kept warm in ``warm``; (storage, metadata, expected state)."""
    storage = CheckpointStorage(tmp_path / "chk")
    b = make(warm)
    write(b, KEYS, 1)
    md = commit(storage, [b.snapshot(1, storage).result(30)], 1)
    expected = read(b, KEYS)
    b.dispose()
    return storage, md, expected


def test_the_batch_after_a_committed_one_reuses_the_database_and_reads_nothing(tmp_path):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    b = make(warm)
    stats = b.restore(storage, md)
    assert b.warm and stats.bytes_read == 0
    assert read(b, KEYS) == expected
    write(b, KEYS, 2)  # and it goes on: checkpoint 2 from the warm database, then warm again
    after = read(b, KEYS)
    md2 = commit(storage, [b.snapshot(2, storage).result(30)], 2)
    b.dispose()
    b = make(warm)
    assert b.restore(storage, md2).bytes_read == 0 and b.warm
    assert read(b, KEYS) == after
    b.dispose()
    cold = make()
    assert cold.restore(storage, md2).bytes_read > 0 and not cold.warm
    assert read(cold, KEYS) == after
    cold.dispose()


@pytest.mark.parametrize("how", ["uncommitted", "failed", "failed after an early flush"])
def test_a_database_past_the_restore_point_is_not_reused(tmp_path, how):
    """A batch that snapshotted but was never committed, or failed (with or without writing to the database):
    the retry restores checkpoint 1 from its files and sees exactly checkpoint 1."""
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    b = make(warm, cache_limit=10 if how == "failed after an early flush" else 1 << 20)
    b.restore(storage, md)
    write(b, KEYS, 5)
    if how == "uncommitted":
        b.snapshot(2, storage).result(30)  # the driver never commits checkpoint 2
    b.dispose()
    retry = make(warm)
    stats = retry.restore(storage, md)
    if how == "failed":  # nothing reached the database: it still is checkpoint 1, and may be reused
        assert retry.warm and stats.bytes_read == 0
    else:
        assert not retry.warm and stats.bytes_read > 0
    assert read(retry, KEYS) == expected
    retry.dispose()


def test_a_retried_attempts_database_is_not_reused(tmp_path):
    """Two attempts of one subtask wrote checkpoint 2; the driver committed the other attempt's file."""
    warm = tmp_path / "warm"
    storage, md, _ = first_checkpoint(tmp_path, warm)
    here = make(warm)
    here.restore(storage, md)
    write(here, KEYS, 7)
    here.snapshot(2, storage).result(30)
    here.dispose()
    elsewhere = make()
    elsewhere.restore(storage, md)
    write(elsewhere, KEYS, 9)
    expected = read(elsewhere, KEYS)
    md2 = commit(storage, [elsewhere.snapshot(2, storage).result(30)], 2)
    elsewhere.dispose()
    b = make(warm)
    assert b.restore(storage, md2).bytes_read > 0 and not b.warm
    assert read(b, KEYS) == expected
    b.dispose()


def test_another_range_or_location_is_not_reused(tmp_path):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    half = KeyGroupRange(0, MAXP // 2 - 1)
    b = make(warm, kgr=half)  # a rescale: another range, another directory, restored from the files
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    mine = [k for k in KEYS if assign_to_key_group(k, MAXP) in half]
    assert read(b, mine) == {k: expected[k] for k in mine}
    b.dispose()
    other = CheckpointStorage(tmp_path / "elsewhere")  # the same files under another location
    md_other = commit(other, [], 1)
    b = make(warm)
    b.restore(other, md_other)
    assert not b.warm and read(b, [1]) == {1: (None, [], [])}
    b.dispose()


@pytest.mark.parametrize("damage", [b"{not json", b"[]", b'{"version": 1}', b""])
def test_a_damaged_marker_is_refused_cleanly(tmp_path, damage):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    marker = warm / f"0-{MAXP - 1}" / "marker.json"
    assert json.loads(marker.read_text())["checkpoint_id"] == 1
    marker.write_bytes(damage)
    b = make(warm)
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    assert read(b, KEYS) == expected
    b.dispose()


def test_a_job_that_does_not_restore_starts_empty_even_over_a_kept_database(tmp_path):
    warm = tmp_path / "warm"
    first_checkpoint(tmp_path, warm)
    b = make(warm)
    assert read(b, [1, 2]) == {1: (None, [], []), 2: (None, [], [])}
    b.dispose()


def test_a_second_backend_on_a_held_directory_works_apart(tmp_path):
    """A second attempt running beside the first on one host does not share its database."""
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    a, b = make(warm), make(warm)
    assert a.restore(storage, md).bytes_read == 0 and a.warm
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    write(a, KEYS, 3)
    assert read(b, KEYS) == expected
    a.dispose()
    b.dispose()
    assert sorted(os.listdir(warm)) == [f"0-{MAXP - 1}", f"0-{MAXP - 1}.lock"]


# ---- the cache ---------------------------------------------------------------------------------------------------
def test_prefetch_and_a_small_cache_limit_change_nothing_but_memory(tmp_path):
    storage = CheckpointStorage(tmp_path)
    big, small = make(), make(cache_limit=7)
    for b in (big, small):
        write(b, KEYS, 1)
    small.prefetch(list(KEYS))  # more keys than the limit: the rest load on first use
    big.prefetch(list(KEYS), [assign_to_key_group(k, MAXP) for k in KEYS])
    for b in (big, small):
        write(b, KEYS, 2)
        assert all(len(t.cache) <= (7 if b is small else 1 << 20) for t in b._tables.values())
    assert read(big, KEYS) == read(small, KEYS)
    mds = [commit(CheckpointStorage(tmp_path / str(i)), [b.snapshot(1, CheckpointStorage(tmp_path / str(i)))
                                                         .result(30)], 1) for i, b in enumerate((big, small))]
    restored = []
    for i, md in enumerate(mds):
        r = make()
        r.restore(CheckpointStorage(tmp_path / str(i)), md)
        restored.append(read(r, KEYS))
        r.dispose()
    assert restored[0] == restored[1] == read(big, KEYS)
    with pytest.raises(ValueError, match="cache_limit"):
        make(cache_limit=0)
    with pytest.raises(ValueError, match="not in this backend's key groups"):
        make(kgr=KeyGroupRange(0, 0)).prefetch([k for k in KEYS if assign_to_key_group(k, MAXP) != 0][:1])
    big.dispose()
    small.dispose()
    del storage


def test_a_mutable_value_changed_in_place_sticks_as_on_the_heap():
    b = make()
    v = b.get_state(ValueStateDescriptor("v", ValueSerializer()))
    b.set_current_key(1)
    v.update([1])
    b._flush(evict=True)
    v.value().append(2)  # loaded into the cache and changed in place
    b._flush(evict=True)
    assert v.value() == [1, 2]
    b.dispose()


# ---- the runner ------------------------------------------------------------------------------------------------
class Count(KeyedProcessFunction):
    """Counts records per key; emits (key, count) per record."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        return [(record["k"], n)]


def run_counting_batch(storage, local_dir, keys, parallelism=2):
    schema = pa.schema([("k", pa.int64())])
    plan = begin_batch(storage, job_name="count", max_parallelism=MAXP, parallelism=parallelism)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Count()), input_schema=schema,
                           output_schema=pa.schema([("k", pa.int64()), ("n", pa.int64())]), backend="rocksdb",
                           local_dir=str(local_dir))
    table = pa.table({"k": keys}, schema=schema)
    owners = assign_operators(table.column("k"), MAXP, parallelism)
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports)
    out = pa.concat_tables(pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in metadata.outputs)
    return reports, dict(zip(out.column("k").to_pylist(), out.column("n").to_pylist()))


def test_the_runner_keeps_rocksdb_warm_between_batches_and_restores_after_a_rescale(tmp_path):
    storage = CheckpointStorage(tmp_path / "chk")
    local = tmp_path / "local"
    keys = list(range(300))
    run_counting_batch(storage, local, keys)
    reports, counts = run_counting_batch(storage, local, keys)
    assert [r["restored"]["warm"] for r in reports] == [True, True]
    assert [r["restored"]["bytes_read"] for r in reports] == [0, 0]
    assert counts == {k: 2 for k in keys}
    reports, counts = run_counting_batch(storage, local, keys, parallelism=3)  # a rescale: restored from files
    assert not any(r["restored"]["warm"] for r in reports) and all(r["restored"]["bytes_read"] for r in reports)
    assert counts == {k: 3 for k in keys}
