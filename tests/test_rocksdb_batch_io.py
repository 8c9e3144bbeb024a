"""The RocksDB backend's batch reads and writes (a batch's database keys built and sorted at once, read in key order,
written back in key order from the prefetched batch): same state as a plain dict under any mix of prefetches, reads,
writes, deletes, keys never prefetched, repeats, a tiny cache and snapshots (real RocksDB)."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state.rocksdb import _sorted_db_keys

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)


def naive_db_key(ser, key, state_id):
    kb = ser.serialize(key)
    return struct.pack(">HHI", assign_to_key_group(key, MAXP), state_id, len(kb)) + kb


str_keys = st.lists(st.one_of(st.text(max_size=12), st.text(min_size=200, max_size=400)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(keys=st.one_of(st.lists(st.integers(-2**63, 2**63 - 1), max_size=60), str_keys),
       state_id=st.sampled_from([0, 1, 258, 65535]), unique=st.booleans())
def test_database_keys_of_a_batch_are_the_sorted_keys_built_one_by_one(keys, state_id, unique):
    ser = StrSerializer() if keys and isinstance(keys[0], str) else Int64Serializer()
    groups = np.array([assign_to_key_group(k, MAXP) for k in keys], dtype=np.int64)
    db_keys, order = _sorted_db_keys(ser.serialize_many, keys, groups, state_id, unique=unique)
    expected = [naive_db_key(ser, k, state_id) for k in keys]
    if unique:
        assert db_keys == sorted(set(expected))
    else:
        assert db_keys == sorted(expected)
    assert [expected[i] for i in order.tolist()] == db_keys


ops = st.lists(st.tuples(st.sampled_from(["add", "set", "clear", "read", "mutate"]), st.integers(0, 40)),
               max_size=40)
batches = st.lists(st.tuples(
    st.one_of(st.lists(st.integers(0, 40), max_size=30, unique=True),
              st.lists(st.integers(0, 40), max_size=30)),  # keys prefetched, repeats allowed
    st.booleans(),                               # prefetch again (a second run before the flush)
    st.booleans(),                               # pass key groups
    ops,
    st.sampled_from(["flush", "evict", "evict", "snapshot", "none"])), max_size=6)


def key_of(i, text):
    return f"key-{i}" * (1 + i % 3) if text else i * 7919 - 100


@settings(max_examples=60, deadline=None)
@given(batches=batches, text=st.booleans(), cache_limit=st.sampled_from([3, 1 << 20]))
def test_batches_leave_the_state_a_dict_would_hold(tmp_path_factory, batches, text, cache_limit):
    tmp = tmp_path_factory.mktemp("batch")
    storage = CheckpointStorage(tmp)
    key_ser = StrSerializer() if text else Int64Serializer()
    b = RocksDBKeyedStateBackend(FULL, MAXP, key_ser, db_dir=tmp, cache_limit=cache_limit)
    counter = b.get_state(ValueStateDescriptor("n", Int64Serializer()))
    items = b.get_state(ValueStateDescriptor("items", ValueSerializer()))  # mutable values, changed in place
    model: dict = {}
    lists: dict = {}
    snapshots = 0
    try:
        for keys, again, with_groups, batch_ops, end in batches:
            ks = [key_of(i, text) for i in keys]
            groups = [assign_to_key_group(k, MAXP) for k in ks] if with_groups else None
            b.prefetch(ks, groups)
            if again:
                b.prefetch(ks[::-1])
            for op, i in batch_ops:
                k = key_of(i, text)
                b.set_current_key(k)
                if op == "add":
                    counter.update((counter.value() or 0) + 1)
                    model[k] = model.get(k, 0) + 1
                elif op == "set":  # a blind write: nothing read first
                    counter.update(i)
                    model[k] = i
                elif op == "clear":
                    counter.clear()
                    items.clear()
                    model.pop(k, None)
                    lists.pop(k, None)
                elif op == "read":
                    assert counter.value() == model.get(k)
                    assert items.value() == lists.get(k)
                else:
                    current = items.value()
                    if current is None:
                        items.update([i])
                    else:
                        current.append(i)  # in place: must stick
                    lists.setdefault(k, []).append(i)
            if end == "flush":
                b._flush()
            elif end == "evict":
                b._flush(evict=True)
            elif end == "snapshot":
                snapshots += 1
                commit(storage, b.snapshot(snapshots, storage).result(30), snapshots)
        for k in {key_of(i, text) for i in range(41)}:
            b.set_current_key(k)
            assert counter.value() == model.get(k)
            assert items.value() == lists.get(k)
        # What the batches left is what the database and the snapshots hold: restored by the heap backend from
        # the incremental chain it is the same, and the rows are those of a backend written key by key.
        snapshots += 1
        commit(storage, b.snapshot(snapshots, storage).result(30), snapshots)
        assert restored_on_heap(storage, key_ser) == (model, lists)
        fresh = RocksDBKeyedStateBackend(FULL, MAXP, key_ser, db_dir=tmp)
        fresh_counter = fresh.get_state(ValueStateDescriptor("n", Int64Serializer()))
        fresh_items = fresh.get_state(ValueStateDescriptor("items", ValueSerializer()))
        for k, v in model.items():
            fresh.set_current_key(k)
            fresh_counter.update(v)
        for k, v in lists.items():
            fresh.set_current_key(k)
            fresh_items.update(list(v))
        assert rows(b) == rows(fresh)
        fresh.dispose()
    finally:
        b.dispose()


def commit(storage, handle, checkpoint_id):
    previous = storage.latest()
    handles = [handle] if previous is None else carry_forward(previous, [handle])
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="t", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=1, keyed_handles=handles, operator_handles=[], properties={}))


def rows(b):
    b._flush()
    return [(bytes(k), bytes(v)) for k, v in b._db.items()]


def restored_on_heap(storage, key_ser):
    heap = HeapKeyedStateBackend(FULL, MAXP, key_ser)
    heap.restore(storage, storage.latest())
    counter = heap.get_state(ValueStateDescriptor("n", Int64Serializer()))
    items = heap.get_state(ValueStateDescriptor("items", ValueSerializer()))
    counters, lists = {}, {}
    for k in heap.keys("n"):
        heap.set_current_key(k)
        counters[k] = counter.value()
    for k in heap.keys("items"):
        heap.set_current_key(k)
        lists[k] = items.value()
    return counters, lists
