"""Warm state follows moved key-group ranges (issue 26), on both backends, with real files and real RocksDB: a backend
for a range that overlaps a kept one keeps the key groups still owned (nothing read for them), reads only the chains
of the key groups that arrived, drops those that left, and holds exactly the state a restore would; a kept RocksDB
database that overlaps several new ranges stays for them while it can still be used, and goes once it cannot."""

from __future__ import annotations

import os

from keygroups import KeyGroupRange, assign_to_key_group
from keygroups.checkpoint import CheckpointStorage, plan_keyed_restore
from keygroups.checkpoint.metadata import key_group_runs
from keygroups.serializers import Int64Serializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend
from keygroups.state.warm import WarmResume
from test_rocksdb_incremental import KEYS, MAXP, commit, read, write

OLD = [KeyGroupRange(0, 63), KeyGroupRange(64, 127)]
NEW = [KeyGroupRange(0, 37), KeyGroupRange(38, 100), KeyGroupRange(101, 127)]


def chain_bytes(metadata, key_groups):
    """Bytes of the chains of ``key_groups`` (an iterable of ints) in ``metadata``: what restoring them reads."""
    total = 0
    for run in key_group_runs(key_groups):
        for handle, part in plan_keyed_restore(metadata, run):
            start, end = handle.byte_range(part)
            total += end - start
    return total


def own(keys, r):
    return [k for k in keys if assign_to_key_group(k, MAXP) in r]


def heap(r):
    return HeapKeyedStateBackend(r, MAXP, Int64Serializer(), key_type="long", compact_full_groups=True)


def rocks(r, warm):
    return RocksDBKeyedStateBackend(r, MAXP, Int64Serializer(), warm_dir=warm)


def checkpoint_of_old_ranges(tmp_path, make):
    """Checkpoint 1 written by backends of ``OLD``: (storage, metadata, expected state, the backends)."""
    storage = CheckpointStorage(tmp_path / "chk")
    backends = [make(r) for r in OLD]
    expected = {}
    for b in backends:
        write(b, own(KEYS, b.key_group_range), 1)
        expected.update(read(b, own(KEYS, b.key_group_range)))
    md = commit(storage, [b.snapshot(1, storage).result(30) for b in backends], 1)
    return storage, md, expected, backends


def test_a_kept_heap_backend_resumes_for_an_overlapping_range(tmp_path):
    storage, md, expected, (first, second) = checkpoint_of_old_ranges(tmp_path, heap)
    stats = first.resume(storage, md, NEW[0])   # keeps 0-37, drops 38-63
    assert stats.bytes_read == 0 and stats.warm == tuple(NEW[0]) and stats.dropped == tuple(range(38, 64))
    assert first.key_group_range == NEW[0] and read(first, own(KEYS, NEW[0])) == {
        k: expected[k] for k in own(KEYS, NEW[0])}
    assert sorted(first.keys("v")) == sorted(own(KEYS, NEW[0]))    # the keys of the dropped key groups are gone
    stats = second.resume(storage, md, NEW[1])  # keeps 64-100, restores 38-63, drops 101-127
    assert stats.restored == tuple(range(38, 64)) and stats.warm == tuple(range(64, 101))
    assert stats.bytes_read == stats.bytes_restored == chain_bytes(md, range(38, 64))
    assert read(second, own(KEYS, NEW[1])) == {k: expected[k] for k in own(KEYS, NEW[1])}
    # and it goes on: the next snapshot is of the new range, and a restore of it gives the same state
    write(second, own(KEYS, NEW[1]), 5)
    after = read(second, own(KEYS, NEW[1]))
    handle = second.snapshot(2, storage).result(30)
    assert handle.key_group_range == NEW[1]
    md2 = commit(storage, [handle], 2)
    cold = heap(NEW[1])
    cold.restore(storage, md2)
    assert read(cold, own(KEYS, NEW[1])) == after


def test_a_heap_backend_with_unsnapshotted_writes_or_no_overlap_is_not_resumed(tmp_path):
    storage, md, _, (first, second) = checkpoint_of_old_ranges(tmp_path, heap)
    assert first.resume(storage, md, KeyGroupRange(64, 127)) is None     # no key group in common
    write(first, own(KEYS, OLD[0])[:1], 9)
    assert first.resume(storage, md, NEW[0]) is None                     # not the committed state any more
    assert first.key_group_range == OLD[0]                               # left as it was


def test_a_kept_rocksdb_database_is_taken_over_by_the_overlapping_range(tmp_path):
    warm = str(tmp_path / "warm")
    storage, md, expected, backends = checkpoint_of_old_ranges(tmp_path, lambda r: rocks(r, warm))
    for b in backends:
        b.dispose()
    got = {}
    reports = []
    for r in NEW:
        b = rocks(r, warm)
        reports.append(b.restore(storage, md))
        got.update(read(b, own(KEYS, r)))
        # the database holds no row of a key group it does not own (a ranged delete of those that left)
        assert all(int.from_bytes(k[:2], "big") in r for k in b._db.keys())
        b.dispose()
    assert got == expected
    first, second, third = reports
    assert first.bytes_read == 0 and first.dropped == tuple(range(38, 64))
    assert second.restored == tuple(range(38, 64)) and second.bytes_read == chain_bytes(md, range(38, 64))
    assert not hasattr(third, "restored") and third.bytes_read == chain_bytes(md, NEW[2])   # none left: restored
    assert {e for e in os.listdir(warm) if not e.startswith(".") and not e.endswith(".lock")} == {
        f"{r.start}-{r.end}" for r in NEW}


def test_a_partly_overlapping_rocksdb_database_waits_for_its_siblings_then_goes(tmp_path):
    warm = str(tmp_path / "warm")
    storage, md, _, backends = checkpoint_of_old_ranges(tmp_path, lambda r: rocks(r, warm))
    for b in backends:
        b.dispose()
    md2 = commit(storage, [], 2)    # a later checkpoint: the kept databases are of checkpoint 1
    b = rocks(KeyGroupRange(32, 95), warm)
    assert os.path.isdir(os.path.join(warm, "64-127"))    # at the claim it may still serve another range
    stats = b.restore(storage, md2)
    # checkpoint 2 changed nothing since 1: the database taken over (0-63) catches up (no block newer than its
    # marker) and the key groups that arrived are read
    assert b.warm and isinstance(stats, WarmResume) and stats.warm == tuple(range(32, 64)) and not stats.caught_up
    assert stats.bytes_read == chain_bytes(md2, range(64, 96))
    assert not os.path.exists(os.path.join(warm, "64-127"))   # and no other range of this batch is given it
    b.dispose()


def test_the_report_names_the_key_groups_of_each_kind_as_runs():
    from keygroups.runtime.report import RestoreInfo

    stats = WarmResume(10, 2, warm=(0, 1, 2), caught_up=(3,), restored=(4, 5), dropped=(6, 7),
                       bytes_caught_up=4, bytes_restored=6)
    info = RestoreInfo.resumed("moved", stats)
    assert info.to_json() == {"mode": "moved", "bytes_read": 10, "key_groups": 2, "warm": True,
                              "warm_key_groups": [[0, 2]], "caught_up_key_groups": [[3, 3]],
                              "restored_key_groups": [[4, 5]], "dropped_key_groups": [[6, 7]],
                              "bytes_caught_up": 4, "bytes_restored": 6}
    assert RestoreInfo.from_json(info.to_json()) == info
