"""Warm RocksDB directories left by another parallelism are deleted by the first backend of an overlapping range at
the new one, and those of a job no backend claimed for two days by the next warm backend of the host, never while a
running backend holds them (real directories, real locks, real RocksDB)."""

from __future__ import annotations

import os
import time

import pyarrow as pa

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.serializers import Int64Serializer
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.subtask_state import warm_directory, warm_root
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state import rocksdb_warm
from keygroups.testing import KeyedFunctionHarness

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


# ------------------------------------------------------------------------------------- jobs that ended on this host

RETENTION = rocksdb_warm.WARM_RETENTION_SECONDS


def age(path, seconds):
    """Make ``path`` and everything in it look last used ``seconds`` ago."""
    then = time.time() - seconds
    for parent, dirs, files in os.walk(path):
        for entry in dirs + files:
            os.utime(os.path.join(parent, entry), (then, then))
    os.utime(path, (then, then))


def a_job(root, location, job, ranges_=(KeyGroupRange(0, 63), KeyGroupRange(64, 127))):
    path = os.path.join(root, location, job)
    for r in ranges_:
        open_and_dispose(path, r)
    return path


def test_job_directories_unclaimed_for_the_retention_go_and_held_recent_or_own_ones_stay(tmp_path):
    root = str(tmp_path / "keygroups-warm")
    ended = a_job(root, "loc1", "ended")
    alone = a_job(root, "loc2", "alone")       # the only job of its location: the location goes with it
    recent = a_job(root, "loc1", "recent")
    own = a_job(root, "loc3", "own")
    held = a_job(root, "loc3", "held")
    for path in (ended, alone, own, held):
        age(path, RETENTION + 60)
    age(recent, RETENTION - 600)
    holder = RocksDBKeyedStateBackend(KeyGroupRange(0, 63), MAXP, Int64Serializer(), warm_dir=held)
    try:
        age(held, RETENTION + 60)   # a backend running for that long still holds its range
        deleted = rocksdb_warm.sweep_unused_jobs(root, keep=own)
    finally:
        holder.dispose()
    assert sorted(deleted) == sorted([ended, alone])
    assert not os.path.exists(ended) and not os.path.exists(os.path.dirname(alone))
    for path in (recent, own, held):
        assert kept(path) == ({"0-63", "64-127"}, {"0-63", "64-127"}), path
    # a claim marks its job as used: the same job at its old ranges resumes its kept database
    open_and_dispose(recent, KeyGroupRange(0, 63))
    assert os.stat(os.path.join(recent, "0-63.lock")).st_mtime > time.time() - 60


def test_a_process_sweeps_a_root_at_most_once_an_interval(tmp_path, monkeypatch):
    root = str(tmp_path / "keygroups-warm")
    first = a_job(root, "loc", "first")
    age(first, 2 * RETENTION)
    assert rocksdb_warm.sweep_unused_jobs(root, keep="") == [first]
    second = a_job(root, "loc", "second")
    age(second, 2 * RETENTION)
    assert rocksdb_warm.sweep_unused_jobs(root, keep="") == []   # swept moments ago
    assert os.path.isdir(second)
    monkeypatch.setattr(rocksdb_warm, "SWEEP_INTERVAL_SECONDS", 0.0)
    assert rocksdb_warm.sweep_unused_jobs(root, keep="") == [second]


def test_what_is_not_a_private_job_directory_is_left_alone(tmp_path):
    root = tmp_path / "keygroups-warm"
    job = root / "loc" / "shared"
    job.mkdir(parents=True)
    (job / "0-63.lock").write_text("")
    job.chmod(0o777)   # writable by others: not one this user's backends made
    age(str(root), 2 * RETENTION)
    assert rocksdb_warm.sweep_unused_jobs(str(root), keep="") == []
    assert job.is_dir()


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.get_state(ValueStateDescriptor("n", Int64Serializer()))

    def process_element(self, row, ctx):
        self.n.update((self.n.value() or 0) + 1)
        yield {"k": row["k"], "n": self.n.value()}


def test_a_batch_on_rocksdb_sweeps_the_hosts_ended_jobs_and_keeps_its_own(tmp_path):
    harness = KeyedFunctionHarness(Count(), "k", output_schema="k long, n long", backend="rocksdb",
                                   directory=tmp_path)
    try:
        own = warm_directory(harness._local_dir, harness.storage.location, harness.name)
        ended = a_job(warm_root(harness._local_dir), "elsewhere", "ended")
        age(ended, 2 * RETENTION)
        harness.process(pa.table({"k": [1, 2, 3]}))
        assert not os.path.exists(ended)
        assert kept(own)[0]   # the batch's own database, kept for the next
        harness.output()
        harness.process(pa.table({"k": [1]}))
        assert harness.output() == [{"k": 1, "n": 2}]
    finally:
        harness.close()
