"""A large flush of the RocksDB backend writes its value states' rows into one SST file that RocksDB ingests
(``RocksDBKeyedStateBackend._ingest_rows``, merged in key order by ``rocksstate.write_sorted_rows``), a small one
goes through a WriteBatch: both leave the same database, byte for byte, and the same snapshot deltas, with deletes
(tombstones over older rows), lists, maps, TTL states, evictions past a tiny cache limit, snapshots, and a restore
of the result on the heap backend; and the RocksDB chain model (warm, cold and rescaled continuations) passes with
every flush ingested."""

from __future__ import annotations

import os

import pytest
import rocksdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from keygroups import key_group_range
from keygroups._native import rocksstate
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import StrSerializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state.rocksdb import _scan

from test_rocksdb_incremental import ChainModel
from test_rocksdb_sst_restore import LATER, OPS, Clock, apply, delta_entries, descriptors


def run(storage, ops_rounds, later, cache_limit, ingest_rows, job):
    """Each round's ops, then a snapshot (the first full, the others deltas); the database's rows after each
    snapshot and the snapshot files."""
    rocksdb_module._INGEST_ROWS = ingest_rows
    clock = Clock()
    b = RocksDBKeyedStateBackend(key_group_range(8, 1, 0), 8, StrSerializer(), clock=clock, max_chain=100,
                                 delta_fraction=100.0, cache_limit=cache_limit)
    rows, handles = [], []
    try:
        states = {d.name: b.get_state(d) for d in descriptors()}
        for checkpoint_id, ops in enumerate(ops_rounds, start=1):
            apply(b, states, clock, ops)
            clock.now += later
            handle = b.snapshot(checkpoint_id, storage).result(60)
            storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id=job, timestamp_ms=0,
                                              max_parallelism=8, parallelism=1,
                                              keyed_handles=carry_forward(storage.latest(), [handle]),
                                              operator_handles=[], properties={}))
            rows.append(list(_scan(b._db)))
            handles.append(handle)
    finally:
        b.dispose()
    return rows, handles, clock.now


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rounds=st.lists(OPS, min_size=1, max_size=3), later=LATER, cache_limit=st.sampled_from([1, 3, 1 << 20]))
def test_an_ingested_flush_leaves_the_database_and_deltas_a_write_batch_leaves(tmp_path_factory, monkeypatch,
                                                                                rounds, later, cache_limit):
    monkeypatch.setattr(rocksdb_module, "_INGEST_ROWS", rocksdb_module._INGEST_ROWS)   # restored afterwards
    results = []
    for ingest_rows in (1, 1 << 30):   # every flush through a file; none
        storage = CheckpointStorage(str(tmp_path_factory.mktemp("ck")))
        results.append((storage, *run(storage, rounds, later, cache_limit, ingest_rows, f"ingest-{ingest_rows}")))
    (s1, rows1, handles1, now), (s2, rows2, handles2, _) = results
    assert rows1 == rows2
    for h1, h2 in zip(handles1, handles2):
        assert delta_entries(s1, h1) == delta_entries(s2, h2)
    # what the ingesting backend checkpointed restores on the heap to what the other one checkpointed
    restored = []
    for storage in (s1, s2):
        heap = HeapKeyedStateBackend(key_group_range(8, 1, 0), 8, StrSerializer(), clock=lambda: now)
        heap.restore(storage, storage.latest())
        states = {d.name: heap.get_state(d) for d in descriptors()}
        seen = {}
        for name in states:
            for key in sorted(heap.keys(name)):
                heap.set_current_key(key)
                s = states[name]
                seen[name, key] = (sorted(s.items()) if hasattr(s, "items") else
                                   list(s.get() or []) if hasattr(s, "add") else s.value())
        restored.append(seen)
    assert restored[0] == restored[1]


def test_an_ingested_flush_of_a_batch_is_read_back_and_its_deletes_shadow_older_rows(tmp_path, monkeypatch):
    """At the batch sizes that take the file path by default: values written, overwritten and deleted across
    flushes read back as a dict model says, from the cache and from the database after eviction."""
    from keygroups.serializers import Int64Serializer
    from keygroups.state import ValueStateDescriptor
    n = 3 * rocksdb_module._INGEST_ROWS
    b = RocksDBKeyedStateBackend(key_group_range(128, 1, 0), 128, Int64Serializer())
    model: dict[int, int] = {}
    try:
        s = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
        for round_ in range(3):
            for k in range(-n // 2, n // 2, 1 + round_):
                b.set_current_key(k)
                if (k + round_) % 5 == 0:
                    s.clear()
                    model.pop(k, None)
                else:
                    s.update(k * 7 + round_)
                    model[k] = k * 7 + round_
            written = b._writes
            b._flush(evict=True)
            assert b._writes == written + 1   # one write: the ingested file
        assert not any(name.endswith(".sst") for name in os.listdir(b._dir))   # the file was moved in
        for k in range(-n // 2, n // 2):
            b.set_current_key(k)
            assert s.value() == model.get(k)
        assert sorted(b.keys("v")) == sorted(model)
    finally:
        b.dispose()


def test_write_sorted_rows_merges_runs_and_refuses_what_is_not_strictly_ascending(tmp_path):
    def write(runs, name):
        opts = rocksdict.Options(raw_mode=True)
        writer = rocksdict.SstFileWriter(opts)
        path = str(tmp_path / name)
        writer.open(path)
        n = rocksstate.write_sorted_rows(writer, runs)
        writer.finish()
        return n, path

    n, path = write([([b"a", b"c", b"e"], [b"1", b"3", b"5"]), ([b"b", b"d"], None), ([b"", b"f\x00"], [b"0", b"6"])],
                    "ok.sst")
    assert n == 7
    db = rocksdict.Rdict(str(tmp_path / "db"), rocksdict.Options(raw_mode=True))
    try:
        db[b"b"] = b"old"
        db[b"d"] = b"old"
        db[b"e"] = b"old"
        options = rocksdict.IngestExternalFileOptions()
        db.ingest_external_file([path], options)
        assert list(_scan(db)) == [(b"", b"0"), (b"a", b"1"), (b"c", b"3"), (b"e", b"5"), (b"f\x00", b"6")]
    finally:
        db.close()
    with pytest.raises(ValueError, match="strictly ascending"):
        write([([b"b", b"a"], [b"1", b"2"])], "unsorted.sst")
    with pytest.raises(ValueError, match="strictly ascending"):
        write([([b"a"], [b"1"]), ([b"a"], None)], "repeated.sst")
    with pytest.raises(ValueError, match="2 values"):
        write([([b"a"], [b"1", b"2"])], "short.sst")
    with pytest.raises(TypeError, match="must be bytes"):
        write([([b"a", "b"], [b"1", b"2"])], "str.sst")
    with pytest.raises(TypeError):
        write([([b"a"],)], "shape.sst")


def test_a_database_opened_every_batch_keeps_one_info_log(tmp_path):
    """RocksDB keeps the info log of each earlier open beside the database (up to 1000 by default): a kept database,
    opened every batch, would grow by a file per batch, each listed and checked by every seal."""
    for i in range(5):
        db = rocksdb_module._open(str(tmp_path / "db"))
        db[b"k%d" % i] = b"v"
        db.close()
    logs = [name for name in os.listdir(tmp_path / "db") if name.startswith("LOG")]
    assert logs == ["LOG"]


@pytest.mark.parametrize("pinned_groups", [64, 0])   # iterators made at the capture; a RocksDB checkpoint
@pytest.mark.parametrize("ingest_rows", [1, 1 << 30])
def test_a_full_snapshot_holds_the_state_at_its_capture_whatever_is_written_while_it_is_written(
        tmp_path, monkeypatch, pinned_groups, ingest_rows):
    """Writes, deletes and an eviction's flush (into the database: ingested or batched) made after ``snapshot()``
    returns but before its worker reads the full key groups stay out of the snapshot; restored, it holds the values
    of the capture."""
    from keygroups.serializers import Int64Serializer
    from keygroups.state import ValueStateDescriptor
    monkeypatch.setattr(rocksdb_module, "_PINNED_GROUPS", pinned_groups)
    monkeypatch.setattr(rocksdb_module, "_INGEST_ROWS", ingest_rows)
    d = ValueStateDescriptor("v", Int64Serializer())
    b = RocksDBKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer())
    storage = CheckpointStorage(str(tmp_path / "ck"))
    real_write = rocksdb_module.write_keyed_snapshot

    def write_after_changes(*args, **kwargs):
        for k in range(300):   # in the worker, before it reads a row: as if the next batch ran meanwhile
            b.set_current_key(k)
            if k % 3 == 0:
                s.clear()
            else:
                s.update(-k)
        b._flush(evict=True)
        return real_write(*args, **kwargs)

    try:
        s = b.get_state(d)
        for k in range(300):
            b.set_current_key(k)
            s.update(k)
        monkeypatch.setattr(rocksdb_module, "write_keyed_snapshot", write_after_changes)
        handle = b.snapshot(1, storage).result(60)   # not restored: every key group full
        monkeypatch.setattr(rocksdb_module, "write_keyed_snapshot", real_write)
        for k in range(300):   # the backend itself holds the later values
            b.set_current_key(k)
            assert s.value() == (None if k % 3 == 0 else -k)
    finally:
        b.dispose()
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="capture", timestamp_ms=0, max_parallelism=16,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    heap = HeapKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer())
    heap.restore(storage, storage.latest())
    restored = heap.get_state(d)
    for k in range(300):
        heap.set_current_key(k)
        assert restored.value() == k


def test_prefetch_leaves_the_few_keys_a_nearly_full_cache_lacks_to_load_on_first_use(tmp_path):
    """A batch's keys that a state's cache mostly holds are not all looked up again: the few it lacks load on first
    use, with the values the database holds; a cache that lacks many of them is filled by the prefetch."""
    from keygroups.serializers import Int64Serializer
    from keygroups.state import ValueStateDescriptor
    n = 8 * rocksdb_module._PREFETCH_SAMPLE + 100
    b = RocksDBKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer())
    try:
        s = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
        for k in range(2 * n):
            b.set_current_key(k)
            s.update(3 * k)
        b._flush()
        t = b._tables["v"]
        lacking = {7, 1001, n - 1}   # dropped from the cache: only the database has them
        for k in lacking:
            del t.cache[k]
        t.cache.pop(rocksdb_module._COMPLETE)   # it no longer holds every value (_cache_complete)
        b.prefetch(list(range(n)))
        assert lacking.isdisjoint(t.cache)   # not looked for
        for k in range(n):
            b.set_current_key(k)
            assert s.value() == 3 * k
        t.cache.clear()
        t.cache.update((k, 3 * k) for k in range(n // 2, 2 * n))   # holds as many keys, but not the first half
        b.prefetch(list(range(n)))
        assert all(k in t.cache for k in range(n))
        for k in range(n):
            b.set_current_key(k)
            assert s.value() == 3 * k
    finally:
        b.dispose()


class IngestingChainModel(ChainModel):
    """The RocksDB chain model (random writes of the five state kinds against dicts, incremental checkpoints
    continued warm, cold or rescaled, evictions past a cache of 5) with every value-state flush written as an
    ingested file, and the snapshots' full key groups read through iterators made at the capture or from a RocksDB
    checkpoint, as drawn."""

    @initialize(pinned_groups=st.sampled_from([0, 64]))
    def paths(self, pinned_groups):
        rocksdb_module._PINNED_GROUPS = pinned_groups

    def __init__(self):
        self._saved = (rocksdb_module._INGEST_ROWS, rocksdb_module._PINNED_GROUPS)
        rocksdb_module._INGEST_ROWS = 1
        try:
            super().__init__()
        except BaseException:
            rocksdb_module._INGEST_ROWS, rocksdb_module._PINNED_GROUPS = self._saved
            raise

    def teardown(self):
        try:
            super().teardown()
        finally:
            rocksdb_module._INGEST_ROWS, rocksdb_module._PINNED_GROUPS = self._saved


IngestingChainModel.TestCase.settings = settings(max_examples=5, stateful_step_count=20, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_chains_model_with_ingested_flushes = IngestingChainModel.TestCase
