"""A kept (warm) RocksDB database is opened on its first use, not when its backend is made: a warm batch whose reads
the decoded values kept beside the database serve (``_KeptCaches``) and whose snapshot defers its writes (write-back)
never opens it, nor closes it; its files stay exactly as sealed. A batch that needs it opens it; one that then finds
it damaged (RocksDB cannot open it, or a read finds a rotted block) restores the checkpoint it resumed cold, the
cached values newer than the database's files (unwritten keys, the batch's changes) kept: exact (real RocksDB, real
files)."""

from __future__ import annotations

import glob
import logging
import os

import pytest

from keygroups import KeyGroupRange, assign_to_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state import rocksdb as rocksdb_module
from test_rocksdb_warm_corruption import rot

MAXP = 128
RANGE = KeyGroupRange(0, MAXP - 1)
KEYS = range(3000)
TOUCHED = range(100)   # the keys batches 2 and 3 update (cached from batch 2 on)
#: A key outside TOUCHED of the first key group: its row is in the first data blocks, which rot() damages.
UNCACHED = min((k for k in KEYS if k not in TOUCHED), key=lambda k: assign_to_key_group(k, MAXP))


def count_state():
    return ValueStateDescriptor("count", Int64Serializer())


def backend(warm, **options):
    return RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm, write_back_batches=4, **options)


def commit(storage, b, checkpoint_id, restored):
    handle = b.snapshot(checkpoint_id, storage).result(60)
    previous = None if restored is None else storage.load(restored)
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="lazy-open", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
        keyed_handles=carry_forward(previous, [handle]) if previous else [handle], operator_handles=[],
        properties={}))


def db_files(warm):
    """Every file of the kept database with its size and modification time (an open writes new ones)."""
    return {p: (os.stat(p).st_size, os.stat(p).st_mtime_ns)
            for p in glob.glob(os.path.join(warm, "0-127", "db", "*"))}


def first_two_batches(storage, warm):
    """Checkpoint 1 (every key: k) written by another process (nothing kept), then batch 2 in this process: TOUCHED
    keys + 1 (read from the database), a snapshot that defers its writes; returns the model at checkpoint 2."""
    b = backend(warm)
    count = b.get_state(count_state())
    for k in KEYS:
        b.set_current_key(k)
        count.update(k)
    commit(storage, b, 1, None)
    b.dispose()
    rocksdb_module._KEPT_CACHES.clear()
    b = backend(warm)
    b.restore(storage, storage.load(1))
    count = b.get_state(count_state())
    for k in TOUCHED:
        b.set_current_key(k)
        count.update(count.value() + 1)
    commit(storage, b, 2, 1)
    assert b._deferred == 1 and b._db_opens == 1   # the reads opened it; the snapshot wrote nothing
    b.dispose()
    return {k: k + 1 if k in TOUCHED else k for k in KEYS}


def test_a_deferred_batch_served_by_kept_values_never_opens_the_database_and_the_next_that_needs_it_does(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ck"))
    warm = str(tmp_path / "warm")
    model = first_two_batches(storage, warm)
    sealed = db_files(warm)
    # batch 3: adopts the kept values (the database is at checkpoint 1, they at 2); reads and writes only them
    b = backend(warm)
    assert b.restore(storage, storage.load(2)).bytes_read == 0 and b.warm
    count = b.get_state(count_state())
    b.prefetch(list(TOUCHED))
    for k in TOUCHED:
        b.set_current_key(k)
        assert count.value() == model[k]
        count.update(model[k] + 1)
        model[k] += 1
    # the lock is held all the same: a second backend of the range works apart
    other = backend(warm)
    assert other._warm is None
    other.dispose()
    assert b.estimated_entries() > 0   # its estimate as last closed, without opening it
    commit(storage, b, 3, 2)
    assert b._deferred == 2 and b._db_opens == 0
    b.dispose()
    assert db_files(warm) == sealed   # never opened: not a file of it written
    # batch 4: adopts them again, then reads a key they do not hold: the database is opened
    b = backend(warm)
    b.restore(storage, storage.load(3))
    count = b.get_state(count_state())
    assert b._db_opens == 0
    b.set_current_key(UNCACHED)
    assert count.value() == model[UNCACHED]
    assert b._db_opens == 1
    for k in KEYS:
        b.set_current_key(k)
        assert count.value() == model[k]
    commit(storage, b, 4, 3)
    assert b._deferred == 3
    b.dispose()
    # batch 5: the fourth snapshot in a row writes the database back: opened (by the flush) to write it
    b = backend(warm)
    b.restore(storage, storage.load(4))
    count = b.get_state(count_state())
    for k in TOUCHED:
        b.set_current_key(k)
        count.update(count.value() + 1)
        model[k] += 1
    assert b._db_opens == 0
    commit(storage, b, 5, 4)
    assert b._deferred == 0 and b._db_opens == 1
    b.dispose()
    rocksdb_module._KEPT_CACHES.clear()
    b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer())
    b.restore(storage, storage.load(5))
    count = b.get_state(count_state())
    for k in KEYS:
        b.set_current_key(k)
        assert count.value() == model[k]
    b.dispose()


def break_footer(warm):
    """Zero every table file's magic number (RocksDB reads it when opening), keeping sizes and times: the seal holds."""
    for path in glob.glob(os.path.join(warm, "0-127", "db", "*.sst")):
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(st.st_size - 8)
            f.write(b"\x00" * 8)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", ["cannot be opened", "rotted block"])
def test_a_database_found_damaged_when_first_used_after_adopting_newer_kept_values_is_restored_exactly(
        tmp_path, caplog, damage):
    storage = CheckpointStorage(str(tmp_path / "ck"))
    warm = str(tmp_path / "warm")
    model = first_two_batches(storage, warm)   # the database holds checkpoint 1; the kept values hold 2's keys
    if damage == "cannot be opened":
        break_footer(warm)
    else:
        rot(warm)
    b = backend(warm)
    try:
        with caplog.at_level(logging.WARNING, logger="keygroups.state.rocksdb"):
            assert b.restore(storage, storage.load(2)).bytes_read == 0 and b.warm and b._db_opens == 0
            count = b.get_state(count_state())
            for k in TOUCHED[:50]:   # this batch's changes, in the cache only
                b.set_current_key(k)
                count.update(count.value() * 10)
                model[k] *= 10
            assert b._db_opens == 0
            b.set_current_key(UNCACHED)   # needs the database: found damaged, replaced by checkpoint 2, cold
            assert count.value() == model[UNCACHED]
        assert not b.warm and "restored cold from checkpoint 2" in caplog.text
        assert ("cannot be opened" in caplog.text) == (damage == "cannot be opened")
        for k in KEYS:
            b.set_current_key(k)
            assert count.value() == model[k]
        commit(storage, b, 3, 2)
    finally:
        b.dispose()
    rocksdb_module._KEPT_CACHES.clear()
    for warm_dir in (None, warm):   # checkpoint 3 and the database kept at it are exact
        b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm_dir)
        try:
            b.restore(storage, storage.load(3))
            assert b.warm == (warm_dir is not None)
            count = b.get_state(count_state())
            for k in KEYS:
                b.set_current_key(k)
                assert count.value() == model[k]
        finally:
            b.dispose()
