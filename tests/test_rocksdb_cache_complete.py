"""RocksDB: a state's cache that holds every value of the state (``_cache_complete``) answers a key it lacks
without reading the database: found so on a database with no row, kept with the cache for the next backend of this
process, renewed by a flush of the caches and voided by anything else that writes the database (a restore, a
catch-up, a row written behind the cache) or empties the cache. The hypothesis model of write-back
(tests/test_rocksdb_write_back.py) runs it with restores, rescales, TTL and new processes; these tests show each
way in and out."""

from __future__ import annotations

import rocksdict

from keygroups import key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state import rocksdb as rocksdb_module

MAXP = 128
COUNT = ValueStateDescriptor("n", Int64Serializer())


def _backend(warm=None, **options):
    return RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), warm_dir=warm, **options)


def _add(b, keys, plus):
    n = b.get_state(COUNT)
    for k in keys:
        b.set_current_key(k)
        n.update((n.value() or 0) + plus)


def _commit(storage, b, checkpoint_id, previous):
    handle = b.snapshot(checkpoint_id, storage).result(30)
    metadata = CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="complete", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
        keyed_handles=carry_forward(previous, [handle]) if previous is not None else [handle], operator_handles=[],
        properties={})
    storage.commit(metadata)
    return metadata


def _value(b, k):
    b.set_current_key(k)
    return b.get_state(COUNT).value()


def _write_behind(b, k, value):
    """Put ``k``'s value straight into the database, as a restore's row would, past the cache."""
    t = b._tables["n"]
    batch = rocksdict.WriteBatch(raw_mode=True)
    batch.put(t.db_key(_index(b, k), k), t.write_framing.encode(value))
    b._write(batch)


def _index(b, k):
    b.set_current_key(k)
    return b._ctx.kgi


def test_a_backend_on_an_empty_database_knows_a_never_seen_key_has_no_value():
    b = _backend()
    try:
        _add(b, range(100), 1)
        t = b._tables["n"]
        assert b._cache_complete(t)
        reads = []
        b._db_box[0] = _Counting(b._db_box[0], reads)
        b.prefetch(list(range(50, 300)))
        assert reads == []   # the 200 keys never written: answered by the cache
        assert [_value(b, k) for k in (0, 99, 100, 299)] == [1, 1, None, None]
        assert reads == []
    finally:
        b._db_box[0] = getattr(b._db_box[0], "db", b._db_box[0])
        b.dispose()


class _Counting:
    """A database whose reads are counted (everything else passed through)."""

    def __init__(self, db, reads):
        self.db, self.reads = db, reads

    def get(self, *args, **kwargs):
        self.reads.append(args[0])
        return self.db.get(*args, **kwargs)

    def iter(self, *args, **kwargs):
        self.reads.append(args)
        return self.db.iter(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_a_flush_keeps_the_cache_complete_and_any_other_write_voids_it():
    b = _backend()
    try:
        _add(b, range(10), 1)
        t = b._tables["n"]
        b._flush()   # the flush writes what the cache holds: still every value
        assert b._cache_complete(t)
        _write_behind(b, 500, 7)   # a row the cache does not hold (as a restore or a catch-up writes them)
        assert not b._cache_complete(t)
        assert rocksdb_module._COMPLETE not in t.cache   # dropped, not found again by the next look
        assert not b._cache_complete(t)
        assert _value(b, 500) == 7 and _value(b, 3) == 1
    finally:
        b.dispose()


def test_an_evicted_cache_is_no_longer_complete():
    b = _backend(cache_limit=20)
    try:
        _add(b, range(15), 1)
        assert b._cache_complete(b._tables["n"])
        _add(b, range(15, 40), 2)   # past the limit: flushed and emptied
        assert not b._cache_complete(b._tables["n"])
        assert [_value(b, k) for k in (0, 14, 15, 39, 40)] == [1, 1, 2, 2, None]
    finally:
        b.dispose()


def test_a_cold_restore_is_not_complete_and_reads_what_the_cache_lacks(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    b = _backend()
    _add(b, range(100), 3)
    metadata = _commit(storage, b, 1, None)
    b.dispose()
    b = _backend()
    try:
        b.restore(storage, metadata)
        b.get_state(COUNT)
        t = b._tables["n"]
        assert not b._cache_complete(t)
        _add(b, [500], 1)
        b._flush()   # writes what the cache holds, which is not every value: still not complete
        assert not b._cache_complete(t)
        assert _value(b, 7) == 3
        b.prefetch(list(range(200)))
        assert [_value(b, k) for k in (0, 99, 100, 199, 500)] == [3, 3, None, None, 1]
    finally:
        b.dispose()


def test_the_next_backend_resumes_the_complete_cache_without_opening_the_database(tmp_path):
    """Write-back: the warm batches in between never open the database, never-seen keys included; a restore of an
    older checkpoint, or a new process, does not take the cache (nor its mark) and reads."""
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(str(tmp_path / "chk")), str(tmp_path / "warm")
    b = _backend(warm, write_back_batches=4)
    _add(b, range(100), 1)
    history = [_commit(storage, b, 1, None)]
    b.dispose()
    for checkpoint_id, keys in ((2, range(50, 150)), (3, range(150, 250))):
        b = _backend(warm, write_back_batches=4)
        b.restore(storage, history[-1])
        b.get_state(COUNT)
        assert b._cache_complete(b._tables["n"])
        b.prefetch(list(keys))
        _add(b, keys, 10)
        history.append(_commit(storage, b, checkpoint_id, history[-1]))
        assert b._db_opens == 0   # deferred snapshot, every read answered by the kept cache
        b.dispose()
    expected = {k: (1 if k < 100 else 0) + (10 if 50 <= k < 250 else 0) or None for k in range(260)}
    b = _backend(warm, write_back_batches=4)
    try:
        b.restore(storage, history[-1])
        assert [_value(b, k) for k in range(260)] == [expected[k] for k in range(260)]
    finally:
        b.dispose()
    # an older checkpoint: the kept values are of another one; not taken, the database read
    b = _backend(warm, write_back_batches=4)
    try:
        b.restore(storage, history[1])
        b.get_state(COUNT)
        assert not b._cache_complete(b._tables["n"])
        assert [_value(b, k) for k in (0, 60, 149, 200)] == [1, 11, 10, None]
    finally:
        b.dispose()


def test_a_parked_complete_cache_is_not_trusted_once_the_next_backend_wrote(tmp_path):
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(str(tmp_path / "chk")), str(tmp_path / "warm")
    b = _backend(warm)
    _add(b, range(20), 1)
    metadata = _commit(storage, b, 1, None)
    b.dispose()
    b = _backend(warm)
    try:
        b.restore(storage, metadata)
        b.get_state(COUNT)
        t = b._tables["n"]
        assert rocksdb_module._COMPLETE in t.cache   # parked with its mark
        _write_behind(b, 700, 5)   # written before the cache was first used
        assert not b._cache_complete(t)
        assert _value(b, 700) == 5 and _value(b, 3) == 1
    finally:
        b.dispose()
