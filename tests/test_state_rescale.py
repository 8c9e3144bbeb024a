"""Restore at any parallelism, in the spirit of Flink's RescalingITCase / StateBackendTestBase: every key's state is
found in the subtask that owns its key group and nowhere else, on both backends."""

from __future__ import annotations

import pytest
from keygroups import assign_to_key_group, assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)

BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}


class SumCount(AggregateFunction):
    def create_accumulator(self):
        return [0, 0]

    def add(self, value, acc):
        acc[0] += value
        acc[1] += 1
        return acc

    def get_result(self, acc):
        return (acc[0], acc[1])

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]


def descriptors():
    return {
        "value": ValueStateDescriptor("value", ValueSerializer()),
        "list": ListStateDescriptor("list", Int64Serializer()),
        "map": MapStateDescriptor("map", StrSerializer(), ValueSerializer()),
        "reducing": ReducingStateDescriptor("reducing", lambda a, b: a + b, Int64Serializer()),
        "aggregating": AggregatingStateDescriptor("aggregating", SumCount(), ValueSerializer()),
    }


class Job:
    """p subtasks of one operator: a backend per subtask, each with the five states, records routed by key."""

    def __init__(self, kind: str, maxp: int, p: int, storage=None, metadata=None):
        self.kind, self.maxp, self.p = kind, maxp, p
        self.backends = [BACKENDS[kind](key_group_range(maxp, p, i), maxp, Int64Serializer(), subtask_index=i)
                         for i in range(p)]
        self.stats = []
        if metadata is not None:
            self.stats = [b.restore(storage, metadata) for b in self.backends]
        self.states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in self.backends]

    def at(self, key):
        i = assign_to_operator(key, self.maxp, self.p)
        self.backends[i].set_current_key(key)
        return self.states[i]

    def read(self, key):
        s = self.at(key)
        return (s["value"].value(), s["list"].get(), dict(s["map"].items()), s["reducing"].get(),
                s["aggregating"].get())

    def checkpoint(self, storage, checkpoint_id, during=None):
        futures = [b.snapshot(checkpoint_id, storage) for b in self.backends]
        if during is not None:
            during()
        handles = [f.result(60) for f in futures]
        # as the driver does: delta files need the earlier files of their chains
        storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="rescale", timestamp_ms=0,
                                          max_parallelism=self.maxp, parallelism=self.p,
                                          keyed_handles=carry_forward(storage.latest(), handles),
                                          operator_handles=[], properties={}))
        return storage.load(checkpoint_id)

    def dispose(self):
        for b in self.backends:
            b.dispose()


def fill(job, keys):
    for k in keys:
        s = job.at(k)
        s["value"].update({"k": k})
        s["list"].add_all([k, k + 1])
        s["map"].put(str(k), [k])
        s["reducing"].add(k)
        s["aggregating"].add(k)


def expected(k):
    return ({"k": k}, [k, k + 1], {str(k): [k]}, k, (k, 1))


#: (max parallelism, old parallelism, new parallelism, keys); the RocksDB runs are in test_state_rescale_rocksdb.py.
CASES = [
    (128, 2, 4, 300), (128, 4, 2, 300), (128, 3, 1, 300), (128, 1, 7, 300), (128, 15, 77, 400),
    (128, 77, 15, 400), (13, 3, 5, 42), (13, 13, 2, 42), (13, 1, 13, 42),
]


@pytest.mark.parametrize("maxp,p,p2,nkeys", CASES)
def test_rescale_heap(maxp, p, p2, nkeys, tmp_path):
    check_rescale("heap", maxp, p, p2, nkeys, tmp_path)


def check_rescale(kind, maxp, p, p2, nkeys, tmp_path):
    """Write nkeys keys' state at parallelism p, restore at p2: each key is in its owner subtask, nowhere else."""
    storage = CheckpointStorage(tmp_path)
    keys = list(range(nkeys))
    old = Job(kind, maxp, p)
    fill(old, keys)
    md = old.checkpoint(storage, 1)
    old.dispose()
    new = Job(kind, maxp, p2, storage, md)
    try:
        seen = {}
        for i, b in enumerate(new.backends):
            for name in descriptors():
                for k in b.keys(name):
                    # found only where its key group lives
                    assert assign_to_key_group(k, maxp) in b.key_group_range
                    seen.setdefault(name, []).append(k)
        for name in descriptors():
            assert sorted(seen[name]) == keys  # every key exactly once (nowhere else)
        for k in keys:
            assert new.read(k) == expected(k)
        # each subtask read only its share: the old files' bytes for its key groups
        total = sum(h.size for h in md.keyed_handles)
        assert sum(s.bytes_read for s in new.stats) <= total
        assert all(s.key_groups == len(b.key_group_range) for s, b in zip(new.stats, new.backends))
    finally:
        new.dispose()
