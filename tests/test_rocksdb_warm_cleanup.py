"""Warm RocksDB directories left by another parallelism are deleted by the first backend of an overlapping range at
the new one, never while a running backend holds them (real directories, real locks, real RocksDB)."""

from __future__ import annotations

import os

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.serializers import Int64Serializer
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor

MAXP = 128


def ranges(parallelism):
    return [key_group_range(MAXP, parallelism, i) for i in range(parallelism)]


def name(r):
    return f"{r.start}-{r.end}"


def kept(warm):
    """The range directories under ``warm`` and the lock files, by name (not the directory's secret)."""
    entries = [e for e in os.listdir(warm) if not e.startswith(".")]
    return ({e for e in entries if not e.endswith(".lock")}, {e[:-5] for e in entries if e.endswith(".lock")})


def a_key_of(r):
    return next(k for k in range(10_000) if assign_to_key_group(k, MAXP) in r)


def open_and_dispose(warm, r):
    b = RocksDBKeyedStateBackend(r, MAXP, Int64Serializer(), warm_dir=warm)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    b.set_current_key(a_key_of(r))
    v.update(1)
    b._flush()
    b.dispose()


def test_a_rescale_removes_the_old_ranges_directories_once_the_new_ones_are_claimed(tmp_path):
    warm = str(tmp_path / "warm")
    for r in ranges(2):
        open_and_dispose(warm, r)
    assert kept(warm) == ({"0-63", "64-127"}, {"0-63", "64-127"})
    new = ranges(3)  # 0-42, 43-85, 86-127
    open_and_dispose(warm, new[0])
    # 0-63 overlapped the new first range and is gone; 64-127 overlaps only later ones: still there.
    assert kept(warm) == ({"0-42", "64-127"}, {"0-42", "64-127"})
    for r in new[1:]:
        open_and_dispose(warm, r)
    assert kept(warm) == ({name(r) for r in new}, {name(r) for r in new})


def test_the_same_range_and_unrelated_entries_are_kept(tmp_path):
    warm = tmp_path / "warm"
    open_and_dispose(str(warm), KeyGroupRange(0, 63))
    (warm / "notes").mkdir()
    (warm / "12-x").mkdir()
    (warm / "README").write_text("not ours")
    open_and_dispose(str(warm), KeyGroupRange(0, 63))  # the same range again: its database stays for reuse
    assert sorted(os.listdir(warm)) == [".keygroups-secret", "0-63", "0-63.lock", "12-x", "README", "notes"]
    assert os.listdir(warm / "0-63")


def test_a_directory_a_running_backend_holds_is_never_removed(tmp_path):
    warm = str(tmp_path / "warm")
    old = RocksDBKeyedStateBackend(KeyGroupRange(0, 63), MAXP, Int64Serializer(), warm_dir=warm)
    try:
        open_and_dispose(warm, KeyGroupRange(0, 42))
        assert kept(warm) == ({"0-42", "0-63"}, {"0-42", "0-63"})
        # The holder keeps working on its database.
        v = old.get_state(ValueStateDescriptor("v", Int64Serializer()))
        old.set_current_key(a_key_of(old.key_group_range))
        v.update(7)
        old._flush()
        assert v.value() == 7
    finally:
        old.dispose()
    open_and_dispose(warm, KeyGroupRange(0, 42))  # released now: the next claim removes it
    assert kept(warm) == ({"0-42"}, {"0-42"})


def test_a_stale_lock_file_without_a_directory_is_removed_and_a_fresh_claim_still_locks(tmp_path):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "0-127.lock").write_text("")
    a = RocksDBKeyedStateBackend(KeyGroupRange(0, 63), MAXP, Int64Serializer(), warm_dir=str(warm))
    try:
        assert kept(str(warm)) == ({"0-63"}, {"0-63"})
        # The claim holds: a second backend of the same range works apart, in a temporary directory.
        b = RocksDBKeyedStateBackend(KeyGroupRange(0, 63), MAXP, Int64Serializer(), warm_dir=str(warm))
        assert b._warm_path is None
        b.dispose()
    finally:
        a.dispose()
