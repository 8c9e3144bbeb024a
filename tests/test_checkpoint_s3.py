"""Checkpoints on a real S3-compatible object store: SeaweedFS on 127.0.0.1 (tests/s3_server.py), through s3fs.

The storage tests of test_checkpoint_storage.py run here unchanged, and keyed state (heap and RocksDB), operator
state and the partitioned-log source's offsets are snapshotted at one parallelism and restored at others, reading
only their share by ranged GETs. What SeaweedFS does differently from AWS S3 is named where a test depends on it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator

import pytest

import test_checkpoint_storage as storage_tests
from keygroups import assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointStorage, plan_keyed_restore
from keygroups.checkpoint.metadata import encode_metadata
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer
from keygroups.sources import write_partitioned_log
from keygroups.state import HeapKeyedStateBackend
from keygroups.state.operator import OperatorStateStore
from test_checkpoint_storage import expected_state, read_all, write_checkpoint
from test_operator_state import CONFIG, PAIRS, UNION, _old_job, restored
from test_sources import Job as SourceJob
from test_sources import _all, records
from test_state_rescale import Job as KeyedJob
from test_state_rescale import descriptors, expected, fill

# This one makes an empty directory to fail a move onto it; an object store has no empty directories (the move is
# made to fail otherwise in test_a_failed_atomic_write_leaves_no_temporary_object).
_NEEDS_EMPTY_DIRECTORIES = {"test_a_failed_atomic_write_removes_its_temporary_file"}

@pytest.fixture
def storage_factory(s3_server):
    """As test_checkpoint_storage's fixture of that name, over a fresh s3:// prefix of the session's server."""
    location = s3_server.url()
    yield lambda **kw: CheckpointStorage(location, storage_options=s3_server.storage_options, **kw)
    fs, root = s3_server.filesystem(), location.removeprefix("s3://")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# Every storage test written against storage_factory (local paths, memory://) runs on S3 too, unchanged.
globals().update({name: test for name, test in vars(storage_tests).items()
                  if name.startswith("test_") and name not in _NEEDS_EMPTY_DIRECTORIES
                  and "storage_factory" in inspect.signature(test).parameters})


def _objects(storage: CheckpointStorage, rel: str) -> list[str]:
    """The objects under ``rel`` (a prefix), by a fresh listing: what the store holds, not its directory view."""
    fs = storage._fs.fs
    fs.invalidate_cache()
    return sorted(p for p, info in fs.find(storage._fs.path(rel), detail=True).items() if info["type"] == "file")


def _flip_byte(s3_server, storage: CheckpointStorage, rel: str, at: int) -> None:
    fs = s3_server.filesystem()
    path = storage._fs.path(rel)
    data = bytearray(fs.cat_file(path))
    data[at] ^= 0x01
    fs.pipe_file(path, bytes(data))


@contextlib.contextmanager
def recorded_gets(storage: CheckpointStorage) -> Iterator[list[tuple[str, str | None]]]:
    """``(bucket/key, Range header)`` of every GetObject the storage's s3fs client sends meanwhile (path-style
    URLs: ``http://host:port/bucket/key``)."""
    fs = storage._fs.fs
    fs.connect()
    seen: list[tuple[str, str | None]] = []

    def record(request, **_):
        rng = request.headers.get("Range")
        seen.append((request.url.split("?")[0].split("/", 3)[3], rng.decode() if isinstance(rng, bytes) else rng))

    events = fs.s3.meta.events
    events.register("before-send.s3.GetObject", record)
    try:
        yield seen
    finally:
        events.unregister("before-send.s3.GetObject", record)


# -- storage: what the listing-based tests check, by objects -------------------------------------------------------

def test_a_failed_atomic_write_leaves_no_temporary_object(storage_factory, monkeypatch):
    storage = storage_factory()

    def refuse(*args, **kwargs):
        raise OSError("injected: the move failed")

    monkeypatch.setattr(storage._fs.fs, "mv", refuse)
    with pytest.raises(OSError, match="injected"):
        storage._fs.write_atomic("chk-1/target", b"new bytes")
    assert _objects(storage, "chk-1") == []
    monkeypatch.undo()
    storage._fs.write_atomic("chk-1/other", b"new bytes")
    assert [p.rsplit("/", 1)[1] for p in _objects(storage, "chk-1")] == ["other"]
    assert storage.read_bytes("chk-1/other") == b"new bytes"


def test_retention_and_leftovers_on_s3(storage_factory):
    storage = storage_factory(retain=2)
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    write_checkpoint(storage, 3, commit=False)              # in progress, then abandoned
    with storage.open_write("chk-3/_metadata.inprogress-0123") as f:
        f.write(b"a crash between writing the temporary _metadata and the rename")
    storage.commit(write_checkpoint(storage, 4, commit=False))
    assert storage.checkpoint_ids() == [2, 4]
    assert _objects(storage, "chk-1") == [] and _objects(storage, "chk-3") == []   # pruned, abandoned: deleted
    assert len(_objects(storage, "chk-2")) == 1 + 1 and len(_objects(storage, "chk-4")) == 1 + 1
    # keyed files live in shared/: the two of each retained checkpoint stay, those of 1 and 3 are deleted
    assert sorted(int(f.split("-")[2]) for f in storage.shared_files()) == [2, 2, 4, 4]
    for cid in range(5, 9):
        write_checkpoint(storage, cid)
    assert storage.checkpoint_ids() == [7, 8]
    assert all(_objects(storage, f"chk-{cid}") == [] for cid in range(1, 7))
    assert sorted(int(f.split("-")[2]) for f in storage.shared_files()) == [7, 7, 8, 8]
    assert read_all(storage, storage.load(7)) == expected_state(7)
    assert read_all(storage, storage.latest()) == expected_state(8)


def test_pruned_checkpoint_leaves_no_directory_entry(storage_factory):
    """SeaweedFS keeps listing an emptied "directory" as a common prefix for minutes (until its empty-folder
    cleaner runs) unless the directory's own key is deleted; AWS S3 has no empty prefixes, GCS/ADLS with
    hierarchical namespaces behave as SeaweedFS. Retention deletes that key too, and a prefix emptied otherwise (a
    lost commit's files, a hand-deleted checkpoint) is not a checkpoint, complete or incomplete."""
    storage = storage_factory(retain=1)
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    assert storage.checkpoint_ids() == [2]
    assert [n for n in storage._fs.listdir("") if n.startswith("chk-")] == ["chk-2"]
    md3 = write_checkpoint(storage, 3, commit=False)
    for f in md3.files():                          # abandoned, then its objects deleted one by one
        storage._fs.remove(f)
    assert "chk-3" in storage._fs.listdir("")      # the server still lists the emptied prefix ...
    assert storage._chk_dirs() == {2: "chk-2"}     # ... which is no checkpoint
    assert "incomplete (no _metadata, ignored): none" in storage._inventory()
    write_checkpoint(storage, 4)
    assert storage.checkpoint_ids() == [4]


def test_latest_sees_a_checkpoint_committed_by_another_process(s3_server):
    """s3fs caches listings per filesystem instance with no expiry, and answers info() of a file missing from a
    cached listing with a zero-size directory; CheckpointStorage turns that cache off, so a process that listed the
    location before another wrote sees the new checkpoint, and the new files with their sizes, at its next call."""
    url = s3_server.url()
    driver = CheckpointStorage(url, storage_options=s3_server.storage_options)
    # another process has its own s3fs instance: skip_instance_cache gives this one a separate one, as there
    other = CheckpointStorage(url, storage_options={**s3_server.storage_options, "skip_instance_cache": True})
    write_checkpoint(other, 1)
    assert driver.latest().checkpoint_id == 1
    write_checkpoint(other, 2)
    assert driver.checkpoint_ids() == [1, 2]
    driver.commit(write_checkpoint(driver, 3, commit=False))   # lists chk-*/ and shared/ while retaining
    assert other.latest().checkpoint_id == 3
    md4 = write_checkpoint(other, 4, commit=False)             # written by "executors" into listed prefixes,
    driver.commit(md4)                                         # committed by the driver: sizes checked afresh
    assert other.checkpoint_ids() == [2, 3, 4]
    assert read_all(other, other.latest()) == expected_state(4)


def test_server_refuses_a_second_create_if_absent_write(s3_server):
    """What issue 12's exclusive commit can build on: a conditional PUT (If-None-Match: *) fails on an existing
    object and leaves it as it was (s3fs reports HTTP 412 as OSError; the botocore code is PreconditionFailed)."""
    fs = s3_server.filesystem()
    path = s3_server.url().removeprefix("s3://") + "/chk-1/_metadata"
    fs.pipe_file(path, b"first driver", mode="create")
    with pytest.raises(OSError) as refused:
        fs.pipe_file(path, b"second driver", mode="create")
    assert refused.value.__cause__.response["Error"]["Code"] == "PreconditionFailed"
    assert refused.value.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert fs.cat_file(path) == b"first driver"
    fs.rm(path)


# -- keyed state: snapshot at 2, restore at 3 and at 1 -------------------------------------------------------------

MAXP = 128
KEYS = list(range(300))


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_keyed_state_rescales_through_s3_reading_only_its_key_groups(kind, s3_server):
    storage = CheckpointStorage(s3_server.url(), retain=1, storage_options=s3_server.storage_options)
    model = {}
    old = KeyedJob(kind, MAXP, 2)
    fill(old, KEYS)
    model.update((k, expected(k)) for k in KEYS)
    for k in KEYS[::3]:                                        # a second write to some keys
        old.at(k)["value"].update({"k": -k})
        model[k] = ({"k": -k},) + model[k][1:]
    md = old.checkpoint(storage, 1)
    old.dispose()
    storage.savepoint(md, "at-2")

    for parallelism, restore_from in [(3, md), (1, storage.load_savepoint("at-2"))]:
        with recorded_gets(storage) as gets:
            new = KeyedJob(kind, MAXP, parallelism, storage, restore_from)
        try:
            assert {k: new.read(k) for k in KEYS} == model
            planned = []
            for i, (backend, stats) in enumerate(zip(new.backends, new.stats)):
                mine = key_group_range(MAXP, parallelism, i)
                for name in descriptors():
                    assert all(assign_to_key_group(k, MAXP) in mine for k in backend.keys(name))
                spans = [(h.file, *h.byte_range(part)) for h, part in plan_keyed_restore(restore_from, mine)]
                assert stats.bytes_read == sum(end - start for _, start, end in spans)
                assert stats.key_groups == len(mine)
                planned += [(storage._fs.path(file), f"bytes={start}-{end - 1}") for file, start, end in spans]
            # on the wire: one ranged GET per (new subtask, old file it overlaps), of exactly the planned bytes
            assert sorted(gets) == sorted(planned)
            total = sum(h.size for h in restore_from.keyed_handles)
            assert sum(s.bytes_read for s in new.stats) < total   # blocks only: never the file headers
        finally:
            new.dispose()
    again = KeyedJob(kind, MAXP, 1, storage, md)               # checkpoint 2 prunes 1; the savepoint stays
    again.checkpoint(storage, 2)
    again.dispose()
    assert storage.checkpoint_ids() == [2] and storage.savepoint_names() == ["at-2"]
    assert _objects(storage, "chk-1") == []


def _planned_gets(storage: CheckpointStorage, md, maxp: int, parallelism: int) -> list[tuple[str, str]]:
    """The ranged GETs a cold restore at ``parallelism`` sends: one per (new subtask, old file it overlaps)."""
    out = []
    for i in range(parallelism):
        for h, part in plan_keyed_restore(md, key_group_range(maxp, parallelism, i)):
            start, end = h.byte_range(part)
            out.append((storage._fs.path(h.file), f"bytes={start}-{end - 1}"))
    return sorted(out)


def _restored_state(kind: str, storage: CheckpointStorage, md, parallelism: int) -> dict:
    job = KeyedJob(kind, MAXP, parallelism, storage, md)
    try:
        return {k: job.read(k) for k in KEYS}
    finally:
        job.dispose()


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_restore_on_the_same_host_is_served_by_the_local_cache(kind, s3_server, tmp_path):
    """Issue 11, item 5: the keyed files of a remote location are read once per host. The next batch's storage
    (a new object, as every task builds one) restores the same key groups without a single GET; so does a rescale
    whose ranges lie inside cached ones, while ranges not cached are read as before, exactly as planned."""
    url, cache = s3_server.url(), tmp_path / "cache"

    def storage() -> CheckpointStorage:
        return CheckpointStorage(url, retain=1, storage_options=s3_server.storage_options, cache_dir=cache)

    old = KeyedJob(kind, MAXP, 2)
    fill(old, KEYS)
    md = old.checkpoint(storage(), 1)
    old.dispose()
    want = {k: expected(k) for k in KEYS}
    cold = storage()
    with recorded_gets(cold) as gets:
        assert _restored_state(kind, cold, md, 3) == want
    assert sorted(gets) == _planned_gets(cold, md, MAXP, 3)
    for parallelism in (3, 6):                            # 6's ranges of each old file lie inside 3's
        warm = storage()
        with recorded_gets(warm) as gets:
            assert _restored_state(kind, warm, md, parallelism) == want
        assert gets == []
    wider = storage()
    with recorded_gets(wider) as gets:                    # one subtask: ranges no entry holds
        assert _restored_state(kind, wider, md, 1) == want
    assert sorted(gets) == _planned_gets(wider, md, MAXP, 1)


def test_a_damaged_cache_entry_costs_one_remote_read_of_its_range(s3_server, tmp_path):
    cache = tmp_path / "cache"
    storage = CheckpointStorage(s3_server.url(), storage_options=s3_server.storage_options, cache_dir=cache)
    old = KeyedJob("heap", MAXP, 2)
    fill(old, KEYS)
    md = old.checkpoint(storage, 1)
    old.dispose()
    _restored_state("heap", storage, md, 2)
    entries = {p.name: p.read_bytes() for p in cache.iterdir() if not p.name.startswith(".")}   # not the secret
    damaged = sorted(entries)[0]
    data = bytearray(entries[damaged])
    data[len(data) // 3] ^= 0x10
    (cache / damaged).write_bytes(bytes(data))
    with recorded_gets(storage) as gets:
        assert _restored_state("heap", storage, md, 2) == {k: expected(k) for k in KEYS}
    _, start, end, _ = damaged.split("-")
    (got,) = gets
    assert got[1] == f"bytes={start}-{int(end) - 1}"
    assert {p.name: p.read_bytes() for p in cache.iterdir() if not p.name.startswith(".")} == entries   # whole again


def _restore_in_another_process(url: str, storage_options: dict, cache_dir: str, md_bytes: bytes,
                                parallelism: int) -> tuple[dict, int]:
    storage = CheckpointStorage(url, storage_options=storage_options, cache_dir=cache_dir)
    md = storage.load(1)
    assert encode_metadata(md, "chk-1") == md_bytes
    with recorded_gets(storage) as gets:
        state = _restored_state("heap", storage, md, parallelism)
    return state, len(gets)


def test_two_processes_share_one_cache_directory(s3_server, tmp_path):
    """Two workers of one host restore at once through one cache directory: each sees whole entries only (a
    publish is a rename), both restore the right state, and afterwards the cache serves a third restore alone."""
    url, cache = s3_server.url(), str(tmp_path / "cache")
    storage = CheckpointStorage(url, storage_options=s3_server.storage_options, cache_dir=cache)
    old = KeyedJob("heap", MAXP, 2)
    fill(old, KEYS)
    md = old.checkpoint(storage, 1)
    old.dispose()
    md_bytes = encode_metadata(md, "chk-1")
    want = {k: expected(k) for k in KEYS}
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = [pool.submit(_restore_in_another_process, url, s3_server.storage_options, cache, md_bytes, p)
                for p in (3, 3)]
        results = [r.result(120) for r in runs]
    assert all(state == want for state, _ in results)
    assert all(gets <= len(_planned_gets(storage, md, MAXP, 3)) for _, gets in results)
    names = sorted(n for n in os.listdir(cache) if not n.startswith(".keygroups"))   # not the directory secret
    assert not any(n.startswith(".tmp-") for n in names)
    assert len(names) == len(_planned_gets(storage, md, MAXP, 3))   # equal ranges published twice are one entry
    with recorded_gets(storage) as gets:
        assert _restored_state("heap", storage, md, 3) == want
    assert gets == []


def test_corrupt_keyed_object_raises_corrupt_snapshot(s3_server):
    storage = CheckpointStorage(s3_server.url(), storage_options=s3_server.storage_options)
    old = KeyedJob("heap", MAXP, 2)
    fill(old, KEYS)
    md = old.checkpoint(storage, 1)
    h = md.keyed_handles[1]
    start, end = h.byte_range(h.key_group_range)
    _flip_byte(s3_server, storage, h.file, (start + end) // 2)
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        KeyedJob("heap", MAXP, 1, storage, md)
    # a subtask whose key groups lie in the undamaged file restores: it never reads the damaged one
    first_half = key_group_range(MAXP, 2, 0)
    intact = HeapKeyedStateBackend(first_half, MAXP, Int64Serializer(), subtask_index=0)
    assert intact.restore(storage, md).key_groups == len(first_half)


def test_corrupt_metadata_object_raises_corrupt_snapshot(s3_server):
    storage = CheckpointStorage(s3_server.url(), storage_options=s3_server.storage_options)
    write_checkpoint(storage, 1)
    _flip_byte(s3_server, storage, "chk-1/_metadata", 40)
    with pytest.raises(CorruptSnapshotError):
        storage.load(1)


# -- operator state: list, union, broadcast; the source's offsets -------------------------------------------------

def test_operator_state_rescales_through_s3(s3_server):
    storage = CheckpointStorage(s3_server.url(), retain=10, storage_options=s3_server.storage_options)
    lists = [[(i, 10 * i) for i in range(0, 700)], [(i, 10 * i) for i in range(700, 1000)]]
    md = _old_job(storage, lists)
    for parallelism in (3, 1):
        stores = restored(storage, md, parallelism)
        got = [e for s in stores for e in s.get_list_state(PAIRS).get()]
        assert sorted(got) == sorted(lists[0] + lists[1])         # every element once, none lost
        for s in stores:
            assert sorted(s.get_union_list_state(UNION).get()) == ["subtask-0", "subtask-1"]
            assert dict(s.get_broadcast_state(CONFIG).items()) == {"rate": 0.5, "names": ["a", "b"], "owner": None}
    share = OperatorStateStore(2, 3)
    stats = share.restore(storage, md)
    assert 0 < stats.bytes_read < sum(h.size for h in md.operator_handles)   # its blocks, not whole files
    _flip_byte(s3_server, storage, md.operator_handles[0].file, md.operator_handles[0].size // 2)
    with pytest.raises(CorruptSnapshotError):
        OperatorStateStore(0, 1).restore(storage, md)            # reads every block of both files


@pytest.mark.parametrize("old,new", [(2, 1), (2, 4), (3, 2)])
def test_source_offsets_rescale_through_s3_nothing_lost(old, new, s3_server, tmp_path):
    source = write_partitioned_log(tmp_path / "log", {p: records(p, 10 + p) for p in range(5)})
    storage = CheckpointStorage(s3_server.url(), storage_options=s3_server.storage_options)
    job = SourceJob(source, storage, old)
    consumed = job.poll(3) + job.poll(4)
    md = job.checkpoint(1)
    job.poll(5)                                   # read after the checkpoint, then lost: replayed after the restore
    job = SourceJob(source, storage, new, md)
    assert sorted(p for r in job.readers for p in r.partitions) == list(range(5))
    consumed += job.poll(None)
    assert Counter(consumed) == _all(source)      # nothing skipped, nothing twice
    md = job.checkpoint(2)
    (last,) = SourceJob(source, storage, 1, md).readers
    assert last.positions == {p: source.end_offset(p) for p in range(5)}
