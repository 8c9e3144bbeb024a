"""A kept (warm) RocksDB database whose file rotted on disk between batches (its seal intact: same size, inode and
modification time) is found damaged at its first read, and replaced in the same batch by a cold restore of the
checkpoint it was resumed at, with a warning: the batch sees exactly the checkpoint's state (real RocksDB, real
files, a real flipped byte)."""

from __future__ import annotations

import glob
import logging
import os

import pytest

from keygroups import KeyGroupRange, assign_to_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.serializers import Int64Serializer, StrSerializer
import keygroups.state.rocksdb as rocksdb
from keygroups.state import MapStateDescriptor, RocksDBKeyedStateBackend, ValueStateDescriptor

MAXP = 128
RANGE = KeyGroupRange(0, MAXP - 1)
KEYS = range(3000)
#: A key of the first key group: its rows are in the first data blocks, which rot() damages.
FIRST = min(KEYS, key=lambda k: assign_to_key_group(k, MAXP))


def descriptors():
    return (ValueStateDescriptor("count", Int64Serializer()),
            MapStateDescriptor("seen", StrSerializer(), Int64Serializer()))


def checkpoint_one(storage, warm):
    """Checkpoint 1 of one subtask holding every key, its database kept in ``warm``."""
    b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm)
    count, seen = (b.get_state(d) for d in descriptors())
    for k in KEYS:
        b.set_current_key(k)
        count.update(k * 10)
        seen.put(str(k), k)
    handle = b.snapshot(1, storage).result(60)
    metadata = CheckpointMetadata(checkpoint_id=1, job_id="warm-rot", timestamp_ms=0, max_parallelism=MAXP,
                                  parallelism=1, keyed_handles=[handle], operator_handles=[], properties={})
    storage.commit(metadata)
    b.dispose()
    # The next batch runs in another worker process: none of this one's decoded values kept beside the database
    # (they would serve the reads below without touching the rotted files; see test_rocksdb_kept_values.py).
    rocksdb._KEPT_CACHES.clear()
    return storage.load(1)


def rot(warm, min_size=0):
    """Flip a byte every 512 in the first half of every data file of the kept databases in ``warm`` of at least
    ``min_size`` bytes (its data blocks; the index and footer at its end stay intact), keeping each file's size, inode
    and times (as bit rot does): the seal still holds."""
    files = [p for p in glob.glob(os.path.join(warm, "*", "db", "*.sst")) if os.path.getsize(p) >= min_size]
    assert files
    for path in files:
        st = os.stat(path)
        with open(path, "r+b") as f:
            for offset in range(64, st.st_size // 2, 512):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("first_read", ["prefetch", "value", "map entry"])
def test_a_rotted_kept_database_is_restored_cold_in_the_same_batch(tmp_path, caplog, first_read):
    storage = CheckpointStorage(str(tmp_path / "ck"))
    warm = str(tmp_path / "warm")
    metadata = checkpoint_one(storage, warm)
    rot(warm)
    b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm)
    try:
        stats = b.restore(storage, metadata)
        assert b.warm and stats.bytes_read == 0   # the seal held: the kept database is resumed
        count, seen = (b.get_state(d) for d in descriptors())
        with caplog.at_level(logging.WARNING, logger="keygroups.state.rocksdb"):
            if first_read == "prefetch":
                b.prefetch(list(KEYS))
            b.set_current_key(FIRST)
            if first_read == "map entry":
                assert seen.get(str(FIRST)) == FIRST
            else:
                assert count.value() == FIRST * 10
        assert "damaged" in caplog.text and "restored cold from checkpoint 1" in caplog.text
        assert not b.warm
        for k in KEYS:
            b.set_current_key(k)
            assert count.value() == k * 10
            assert seen.get(str(k)) == k
            assert dict(seen.items()) == {str(k): k}
        # the batch goes on: its writes and the next checkpoint are exact
        b.set_current_key(7)
        count.update(-1)
        b.snapshot(2, storage).result(60)
    finally:
        b.dispose()


def test_a_rotted_database_after_the_batch_wrote_to_it_fails_with_rocksdb_s_error(tmp_path):
    """Once the batch wrote to the database, a cold restore would lose those writes: the error stands (the retry of
    the batch restores cold, as before)."""
    storage = CheckpointStorage(str(tmp_path / "ck"))
    warm = str(tmp_path / "warm")
    metadata = checkpoint_one(storage, warm)
    rot(warm)
    b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm)
    try:
        b.restore(storage, metadata)
        count, _ = (b.get_state(d) for d in descriptors())
        b.set_current_key(99_999)
        count.update(1)
        b._flush()
        with pytest.raises(Exception, match="Corruption"):
            b.prefetch(list(KEYS))
    finally:
        b.dispose()


def test_a_kept_database_rocksdb_cannot_open_is_restored(tmp_path, caplog):
    """A kept database whose footer rotted (RocksDB reads it when opening) is deleted and restored cold: the restore
    resumes it without opening it (its seal holds), and its first use finds that it cannot be opened."""
    storage = CheckpointStorage(str(tmp_path / "ck"))
    warm = str(tmp_path / "warm")
    metadata = checkpoint_one(storage, warm)
    for path in glob.glob(os.path.join(warm, "0-127", "db", "*.sst")):
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(st.st_size - 8)   # the table's magic number
            f.write(b"\x00" * 8)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    b = RocksDBKeyedStateBackend(RANGE, MAXP, Int64Serializer(), warm_dir=warm)
    try:
        with caplog.at_level(logging.WARNING, logger="keygroups.state.rocksdb"):
            stats = b.restore(storage, metadata)
            assert b.warm and stats.bytes_read == 0 and b._db_opens == 0   # not opened yet
            count, seen = (b.get_state(d) for d in descriptors())
            for k in KEYS:
                b.set_current_key(k)
                assert count.value() == k * 10 and seen.get(str(k)) == k
        assert not b.warm and b._db_opens == 1   # the fresh database the cold restore filled
        assert "cannot be opened" in caplog.text and "restored cold from checkpoint 1" in caplog.text
    finally:
        b.dispose()
