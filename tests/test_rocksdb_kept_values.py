"""The RocksDB backend's compiled batch paths: decoded values kept beside a warm database for the next backend of this
process that resumes exactly that database (and never otherwise), the flush's database keys and values built in C,
and the bulk reads and writes (``get_values``/``put_values``) the declarative aggregates use: the same state as the
per-key paths and a plain dict (real RocksDB, real files)."""

from __future__ import annotations

import struct

import rocksdict

from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group
from keygroups._native import rocksstate
from keygroups._native.framing import Encoder
from keygroups._native.statecore import MISSING
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
import keygroups.state.rocksdb as rocksdb
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.state._codec import ValueFraming

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)
COUNT = ValueStateDescriptor("count", Int64Serializer())
NAMES = ListStateDescriptor("names", StrSerializer())


def commit(storage, handle, checkpoint_id):
    handles = [handle]
    previous = storage.latest()
    if previous is not None:
        handles = carry_forward(previous, handles)
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="kept", timestamp_ms=0,
                                      max_parallelism=MAXP, parallelism=1, keyed_handles=handles,
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def batch(b, keys, delta):
    count, names = b.get_state(COUNT), b.get_state(NAMES)
    for k in keys:
        b.set_current_key(k)
        count.update((count.value() or 0) + delta)
        names.add(f"n{delta}")


def read(b, keys):
    count, names = b.get_state(COUNT), b.get_state(NAMES)
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = (count.value(), names.get())
    return out


def test_the_next_backend_resumes_the_kept_values_and_the_state_is_exact(tmp_path):
    storage, warm = CheckpointStorage(str(tmp_path / "ck")), str(tmp_path / "warm")
    rocksdb._KEPT_CACHES.clear()
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    batch(b, range(50), 1)
    metadata = commit(storage, b.snapshot(1, storage).result(60), 1)
    b.dispose()
    for checkpoint_id in (2, 3):
        b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
        assert b.restore(storage, metadata).bytes_read == 0 and b.warm
        b.get_state(COUNT)
        # the values decoded (or written) by the backend before: no database read for them
        cache = b._tables["count"].cache
        assert rocksdb._COMPLETE in cache   # it held every value of the state when parked: it still does
        assert len(cache.keys() - {rocksdb._COMPLETE}) == (50 if checkpoint_id == 2 else 60)   # (60: 10 known absent)
        b.prefetch(list(range(60)))
        batch(b, range(0, 60, 2), checkpoint_id)
        metadata = commit(storage, b.snapshot(checkpoint_id, storage).result(60), checkpoint_id)
        b.dispose()
    expected = {k: (1 + (k % 2 == 0) * 5 if k < 50 else 5 if k % 2 == 0 else None,
                    ["n1"] * (k < 50) + ["n2", "n3"] * (k % 2 == 0) or []) for k in range(60)}
    for cold in (False, True):
        if cold:
            rocksdb._KEPT_CACHES.clear()   # another process: the database read, and the checkpoint restored
        b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=None if cold else warm)
        b.restore(storage, metadata)
        assert read(b, range(60)) == expected
        b.dispose()
    h = HeapKeyedStateBackend(FULL, MAXP, Int64Serializer())
    h.restore(storage, metadata)
    assert read(h, range(60)) == expected


def test_kept_values_are_never_taken_for_another_database_state_or_serializer(tmp_path):
    storage, warm = CheckpointStorage(str(tmp_path / "ck")), str(tmp_path / "warm")
    rocksdb._KEPT_CACHES.clear()
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    batch(b, range(20), 1)
    one = commit(storage, b.snapshot(1, storage).result(60), 1)
    b.dispose()
    # a backend resumes it, writes, snapshots checkpoint 2 (writing its database) but it is never committed: its
    # kept values are of a database that checkpoint 1 does not describe
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm, write_back_batches=1)
    b.restore(storage, one)
    batch(b, range(20), 100)
    b.snapshot(2, storage).result(60)
    b.dispose()
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    b.restore(storage, one)
    assert not b.warm   # the marker names checkpoint 2: restored cold, nothing kept taken
    assert read(b, range(20)) == {k: (1, ["n1"]) for k in range(20)}
    b.dispose()
    # written after its last snapshot: nothing is kept (the marker is gone), the next backend restores
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    b.restore(storage, one)
    batch(b, range(20), 7)
    b.snapshot(3, storage).result(60)
    batch(b, [0], 1000)
    b._flush()
    b.dispose()
    assert rocksdb._KEPT_CACHES.take(b._warm_path, "any") is None
    # registered with another serializer: the kept values (Python ints) are not taken, the stored bytes are read
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    batch(b, range(5), 2)
    five = commit(storage, b.snapshot(4, storage).result(60), 4)
    b.dispose()
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), warm_dir=warm)
    b.restore(storage, five)
    assert b.warm
    other = b.get_state(ValueStateDescriptor("count", ValueSerializer()))   # pickled ints: another meta
    assert not b._tables["count"].cache
    b.dispose()
    assert other is not None


def naive_db_key(ser, key, group, state_id):
    kb = ser.serialize(key)
    return struct.pack(">HHI", group, state_id, len(kb)) + kb


@settings(max_examples=80, deadline=None)
@given(keys=st.one_of(st.lists(st.integers(-2**63, 2**63 - 1), max_size=60, unique=True),
                      st.lists(st.text(max_size=30), max_size=60, unique=True),
                      # keys alike in their first 16 database-key bytes and more: the sort's heads tie
                      st.lists(st.text("a\x00b", max_size=12).map("0123456789abcdef".__add__), max_size=60,
                               unique=True)),
       deleted=st.lists(st.booleans(), max_size=60), state_id=st.sampled_from([0, 1, 258, 65535]),
       start=st.integers(0, 64), ttl=st.booleans())
def test_the_flush_builds_the_database_keys_and_values_the_per_key_code_does(keys, deleted, state_id, start, ttl):
    """``flush_values``: the pending keys' database keys, sorted bytewise, and their values as the framing encodes
    them one by one; the deleted ones apart, sorted the same way."""
    ser = StrSerializer() if keys and isinstance(keys[0], str) else Int64Serializer()
    n_groups = MAXP - start
    group_of = {k: (assign_to_key_group(k, MAXP) % n_groups) for k in keys}
    pending = {k: group_of[k] for k in keys}
    framing = ValueFraming("s", "value", Int64Serializer(), ttl=ttl)
    cache = {k: MISSING if i < len(deleted) and deleted[i] else ((i * 3, 1000 + i) if ttl else i * 3)
             for i, k in enumerate(keys)}
    prefixes = [struct.pack(">H", start + g) for g in range(n_groups)]
    put_db, put_values, gone_db, flushed, put_at, gone_at = rocksstate.flush_values(
        pending, cache, Encoder(ser), framing.writer, prefixes, struct.pack(">H", state_id))
    assert flushed == list(pending)
    put_keys, gone_keys = [flushed[i] for i in put_at], [flushed[i] for i in gone_at]
    naive = {k: naive_db_key(ser, k, start + group_of[k], state_id) for k in keys}
    live = [k for k in keys if cache[k] is not MISSING]
    assert put_db == sorted(naive[k] for k in live)
    assert [naive[k] for k in put_keys] == put_db
    assert put_values == [framing.reference_encode(cache[k]) for k in put_keys]
    assert gone_db == sorted(naive[k] for k in keys if cache[k] is MISSING)
    assert [naive[k] for k in gone_keys] == gone_db


ops = st.lists(st.tuples(st.sampled_from(["get", "put", "per key", "snapshot", "evict"]),
                         st.lists(st.integers(0, 30), max_size=25),
                         st.integers(-5, 5)), max_size=12)


@settings(max_examples=40, deadline=None)
@given(ops=ops, cache_limit=st.sampled_from([4, 1 << 20]), default=st.sampled_from([None, 9]))
def test_bulk_reads_and_writes_are_per_key_reads_and_writes(tmp_path_factory, ops, cache_limit, default):
    """``get_values``/``put_values`` on RocksDB (a multi-get of the keys not cached, the cache read and written in
    C) against a plain dict, with repeats, deletes (None), the descriptor's default, a tiny cache and snapshots."""
    d = ValueStateDescriptor("acc", Int64Serializer(), default=default)
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("ck")))
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), cache_limit=cache_limit)
    model: dict[int, int] = {}
    checkpoint_id = 0
    try:
        state = b.get_state(d)
        for op, keys, x in ops:
            if op == "get":
                assert b.get_values("acc", keys) == [model.get(k, default) for k in keys]
            elif op == "put":
                values = [None if (k + x) % 4 == 0 else k * x for k in keys]
                b.put_values("acc", keys, values)
                for k, v in zip(keys, values):
                    if v is None:
                        model.pop(k, None)
                    else:
                        model[k] = v
            elif op == "per key":
                for k in keys:
                    b.set_current_key(k)
                    assert state.value() == model.get(k, default)
                    state.update(k + x)
                    model[k] = k + x
            elif op == "snapshot":
                checkpoint_id += 1
                metadata = commit(storage, b.snapshot(checkpoint_id, storage).result(60), checkpoint_id)
                b.dispose()
                b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), cache_limit=cache_limit)
                b.restore(storage, metadata)
                state = b.get_state(d)
            else:
                b._flush(evict=True)
        assert b.get_values("acc", list(range(31))) == [model.get(k, default) for k in range(31)]
    finally:
        b.dispose()


def test_bulk_reads_and_writes_of_a_ttl_state_go_through_its_state_objects(tmp_path):
    ttl = StateTtlConfig.new_builder(60).build()
    d = ValueStateDescriptor("acc", Int64Serializer())
    d.enable_time_to_live(ttl)
    now = [1000.0]
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer(), clock=lambda: now[0])
    try:
        b.get_state(d)
        b.put_values("acc", [1, 2, 3], [10, None, 30])
        assert b.get_values("acc", [3, 2, 1]) == [30, None, 10]
        now[0] += 61
        assert b.get_values("acc", [1, 3]) == [None, None]
    finally:
        b.dispose()


class _TupleDecodingInt64(Int64Serializer):
    """A user serializer whose ``deserialize_many`` returns a tuple, which its contract allows (any sequence)."""

    def deserialize_many(self, data, offsets):
        return tuple(super().deserialize_many(data, offsets))


def test_a_user_serializer_returning_any_sequence_fills_the_cache(tmp_path):
    """The compiled cache fill reads list items by pointer: a tuple from a user's ``deserialize_many`` must come back
    as values, never be read as a list (a crash before)."""
    d = ValueStateDescriptor("acc", _TupleDecodingInt64())
    b = RocksDBKeyedStateBackend(FULL, MAXP, Int64Serializer())
    try:
        b.get_state(d)
        b.put_values("acc", [1, 2, 3], [10, None, 30])
        b._flush(evict=True)
        assert b.get_values("acc", [3, 2, 1]) == [30, None, 10]
    finally:
        b.dispose()


def test_settling_compacts_level_0_only_past_the_trigger(tmp_path):
    """A kept database is opened and closed every batch; closing aborts the compaction RocksDB started in the
    background, so its level 0 could only grow (a warm batch cost about 20 ms more per batch in
    bench_rocksdb_warm). The close compacts it once it reaches ``_LEVEL0_SETTLE_FILES``, and not before."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_disable_auto_compactions(True)
    db = rocksdict.Rdict(str(tmp_path / "db"), opts)
    settle = rocksdb._LEVEL0_SETTLE_FILES
    for n in range(settle):
        db[b"k%d" % n] = b"v"
        db.flush()
        before = db.property_int_value("rocksdb.num-files-at-level0")
        rocksdb._settle_level0(db)
        after = db.property_int_value("rocksdb.num-files-at-level0")
        assert before == n + 1 and after == (0 if before == settle else before)
    assert [db[b"k%d" % n] for n in range(settle)] == [b"v"] * settle
    db.close()
