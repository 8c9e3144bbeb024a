"""A TTL state restored cold on RocksDB before it is registered (the order a job's ``open`` often takes): registering
it costs no pass over the restored rows (there was one, in Python, that rewrote every row: a cost that grew with the
total state), and nothing changes for the user: what expired reads as expired, and the next full snapshot leaves it
out, as the heap backend's does."""

from __future__ import annotations

import gc
import sys

import pytest

from keygroups import key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, read_key_groups
from keygroups.serializers import Int64Serializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

MAXP = 16
TTL = StateTtlConfig.new_builder(1).cleanup_full_snapshot().build()   # 1 s; a full snapshot drops what expired


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def descriptors():
    out = [ValueStateDescriptor("value", Int64Serializer()), ListStateDescriptor("list", Int64Serializer()),
           MapStateDescriptor("map", Int64Serializer(), Int64Serializer())]
    for d in out:
        d.enable_time_to_live(TTL)
    return out


def write_checkpoint(storage: CheckpointStorage, n_keys: int) -> CheckpointMetadata:
    """n_keys keys in three TTL states, written at t = 0 s; the odd keys written again at t = 0.8 s; checkpointed
    at t = 0.9 s, before anything expired."""
    clock = Clock()
    b = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), clock=clock)
    value, list_, map_ = (b.get_state(d) for d in descriptors())
    for now, keys in ((0.0, range(n_keys)), (0.8, range(1, n_keys, 2))):
        clock.now = now
        for k in keys:
            b.set_current_key(k)
            value.update(k)
            list_.add(k)
            map_.put(k, k + 1)
    clock.now = 0.9
    handle = b.snapshot(1, storage).result(60)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="ttl", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    return storage.load(1)


def calls_while(action) -> int:
    """Python and C function calls made while ``action()`` runs (a profile hook counts them). The cyclic collector
    is held off: a collection it happened to start would count the finalizers of whatever earlier tests left."""
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        action()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def restored_then_registered(storage, metadata, now: float):
    clock = Clock(now)
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), clock=clock,
                                 incremental=False)
    b.restore(storage, metadata)
    writes = b._writes
    calls = calls_while(lambda: [b.get_state(d) for d in descriptors()])
    assert b._writes == writes   # registering wrote nothing to the database
    return b, calls


def test_registering_a_restored_ttl_state_makes_no_pass_over_its_rows(tmp_path):
    calls = []
    for n_keys in (50, 1000):
        storage = CheckpointStorage(str(tmp_path / f"ck-{n_keys}"))
        b, c = restored_then_registered(storage, write_checkpoint(storage, n_keys), now=1.5)
        b.dispose()
        calls.append(c)
    assert calls[0] == calls[1], f"registration made {calls[0]} calls at 50 keys, {calls[1]} at 1000"


def entries(storage, handle):
    blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
    out = {}
    for block in blocks:
        assert block.full and not block.deletes
        for index, keys, values in block.puts:
            for k, v in zip(keys, values):
                out[(block.key_group, handle.states[index]["name"], k)] = v
    return out


@pytest.mark.parametrize("now", [0.5, 1.5, 2.0])
def test_expired_entries_read_as_expired_and_leave_the_next_full_snapshot(tmp_path, now):
    """At 0.5 s nothing expired, at 1.5 s the even keys did (written at 0 s only), at 2 s every key."""
    storage = CheckpointStorage(str(tmp_path / "ck"))
    metadata = write_checkpoint(storage, 40)
    rocks, _ = restored_then_registered(storage, metadata, now)
    heap = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), clock=Clock(now),
                                 incremental=False)
    heap.restore(storage, metadata)
    try:
        for b in (rocks, heap):
            value, list_, map_ = (b.get_state(d) for d in descriptors())
            for k in range(40):
                b.set_current_key(k)
                live = now < 1.0 or (now < 1.8 and k % 2 == 1)
                assert value.value() == (k if live else None)
                expected = [k, k] if k % 2 == 1 and now < 1.0 else [k] if live else []   # elements expire one by one
                assert list(list_.get() or []) == expected
                assert map_.get(k) == (k + 1 if live else None)
        handles = [b.snapshot(10 + i, storage).result(60) for i, b in enumerate((rocks, heap))]
        assert entries(storage, handles[0]) == entries(storage, handles[1])
    finally:
        rocks.dispose()
        heap.dispose()
