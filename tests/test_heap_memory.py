"""A kept heap backend holds what no batch touches as bytes: once a key group is written full, its decoded entries
are folded into one layer of the written bytes, but for the keys the last batch touched (read again soon); keys read
from the layer come back with their values (looked up in C), and what it holds is what a cold restore gives."""

from __future__ import annotations

import numpy as np

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, MapStateDescriptor, ValueStateDescriptor

MAXP = 8


def one_group_keys(n: int) -> list[int]:
    """``n`` int64 keys of key group 0 (of ``MAXP``)."""
    candidates = np.arange(20 * n * MAXP, dtype=np.int64)
    groups = np.asarray(assign_key_groups(candidates, MAXP))
    return candidates[groups == 0][:n].tolist()


def commit(storage, last, checkpoint_id, handle):
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="memory", timestamp_ms=0, max_parallelism=MAXP, parallelism=MAXP,
        keyed_handles=carry_forward(last, [handle]), operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def decoded(backend: HeapKeyedStateBackend, name: str) -> int:
    return len(backend._store(name).maps[0])


def test_a_kept_backend_folds_idle_keys_into_bytes_and_keeps_the_last_batch_decoded(tmp_path):
    keys = one_group_keys(400)
    hot = keys[:25]
    storage = CheckpointStorage(str(tmp_path / "c"))
    # one key group (p = max p): every snapshot after the first is full once the chain is longer than max_chain 1
    backend = HeapKeyedStateBackend(key_group_range(MAXP, MAXP, 0), MAXP, Int64Serializer(),
                                    compact_full_groups=True, max_chain=1)
    value = backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
    names = backend.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer()))
    for k in keys:
        backend.set_current_key(k)
        value.update(k * 3)
        names.put(str(k), k)
    handle1 = backend.snapshot(1, storage).result(60)
    backend.compact()
    assert decoded(backend, "v") == 0 and decoded(backend, "m") == 0   # all bytes now (nothing was tracked yet)
    expected = {}
    for n, k in enumerate(keys):
        backend.set_current_key(k)
        if k in hot:
            value.update(value.value() + 1)
        elif n % 7 == 0:
            value.clear()
        expected[k] = value.value()
        assert names.get(str(k)) == k
    last = commit(storage, None, 1, handle1)
    handle = backend.snapshot(2, storage).result(60)   # a delta: the chain is one block long
    backend.compact()
    last = commit(storage, last, 2, handle)
    assert handle.full_key_groups == []
    for k in hot:   # the next batch touches a few keys: the full snapshot after it keeps them decoded
        backend.set_current_key(k)
        value.update(value.value() + 1)
        expected[k] += 1
    handle = backend.snapshot(3, storage).result(60)
    backend.compact()
    last = commit(storage, last, 3, handle)
    assert [r.start for r in handle.full_key_groups] == [0]
    assert decoded(backend, "v") == len(hot) and decoded(backend, "m") == 0
    for k in keys:
        backend.set_current_key(k)
        assert value.value() == expected[k]
        assert names.get(str(k)) == k
    # a cold restore of the last checkpoint holds the same
    cold = HeapKeyedStateBackend(key_group_range(MAXP, MAXP, 0), MAXP, Int64Serializer())
    cold.restore(storage, last)
    cold_value = cold.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in keys:
        cold.set_current_key(k)
        assert cold_value.value() == expected[k]
