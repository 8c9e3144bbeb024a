"""Chain integrity (issue 31): each delta block names the block it applies on, and each block's checksum covers the id
of its file, so a chain that lacks a middle delta, holds deltas swapped, or holds a twin run's delta of the same
layout is refused -- by a restore (heap and RocksDB), by the commit and by ``keygroups verify`` -- naming the key
group, the checkpoint, the file and what was expected. The read cache of a remote location is checked against the
checksums ``_metadata`` names. Random damage to a chain's files and metadata is always refused or harmless, and a
checkpoint written before (keyed format 3, tests/data/keyed-checkpoint-v3) still restores."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import struct
import uuid

import fsspec
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups._local_dirs import SECRET_NAME, seal
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    KeyedStateHandle,
    carry_forward,
    chain_tips,
    open_snapshot,
    plan_keyed_restore,
    read_key_groups,
)
from keygroups.checkpoint.metadata import METADATA_MAGIC, METADATA_VERSION, encode_metadata
from keygroups.checkpoint.storage import _ReadCache
from keygroups.cli import main
from keygroups.errors import CorruptDataError, CorruptSnapshotError
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

MAXP = 16
P = 2
KEYS = range(48)
COUNT = ValueStateDescriptor("count", Int64Serializer())
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
#: The keys each checkpoint updates: checkpoint 1 writes every key group full, the others deltas.
UPDATES = {1: list(KEYS), 2: [k for k in KEYS if k % 3 == 0], 3: [k for k in KEYS if k % 3 == 1],
           4: [k for k in KEYS if k % 4 == 0]}
V3 = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v3"


def _owner(k: int) -> int:
    return 0 if assign_to_key_group(k, MAXP) in key_group_range(MAXP, P, 0) else 1


def _backends(backend: str, parallelism: int = P) -> list:
    # no key group is written full again within these few checkpoints: every chain is a full block and deltas
    return [BACKENDS[backend](key_group_range(MAXP, parallelism, i), MAXP, Int64Serializer(), subtask_index=i,
                              max_chain=20, delta_fraction=1000.0) for i in range(parallelism)]


def run_job(storage: CheckpointStorage, backend: str, factor: int = 1
            ) -> tuple[list[CheckpointMetadata], dict[int, int]]:
    """Checkpoints 1 to 4 of a job at parallelism 2 (``UPDATES``); key k holds ``factor * (1000 * c + k)`` of the
    last checkpoint c that updated it, an int64, so a twin run (another ``factor``) writes files of the very same
    layout. Returns each checkpoint's metadata and the state of the last one."""
    backends = _backends(backend)
    states = [b.get_state(COUNT) for b in backends]
    expected: dict[int, int] = {}
    last = None
    mds = []
    for cid, keys in UPDATES.items():
        for k in keys:
            i = _owner(k)
            backends[i].set_current_key(k)
            states[i].update(factor * (1000 * cid + k))
            expected[k] = factor * (1000 * cid + k)
        handles = [b.snapshot(cid, storage).result(30) for b in backends]
        storage.commit(CheckpointMetadata(cid, "twin", 0, MAXP, P, carry_forward(last, handles)))
        last = storage.load(cid)
        mds.append(last)
    for b in backends:
        b.dispose()
    return mds, expected


def restored(storage: CheckpointStorage, md: CheckpointMetadata, backend: str, parallelism: int = 1) -> dict:
    got = {}
    for b in _backends(backend, parallelism):
        try:
            b.restore(storage, md)
            state = b.get_state(COUNT)
            for k in KEYS:
                if assign_to_key_group(k, MAXP) in b.key_group_range:
                    b.set_current_key(k)
                    if state.value() is not None:
                        got[k] = state.value()
        finally:
            b.dispose()
    return got


def publish(storage: CheckpointStorage, md: CheckpointMetadata) -> None:
    """Overwrite ``chk-<id>/_metadata`` with ``md`` as a tool of its own would, without the commit's checks."""
    path = os.path.join(storage.location, f"chk-{md.checkpoint_id}", "_metadata")
    with open(path, "wb") as f:
        f.write(encode_metadata(md, f"chk-{md.checkpoint_id}"))


def verify(storage: CheckpointStorage, capsys, checkpoint: int = 4) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", storage.location, "--checkpoint", str(checkpoint)])
    return code, capsys.readouterr().err


def handle(md: CheckpointMetadata, checkpoint: int, subtask: int) -> KeyedStateHandle:
    return next(h for h in md.keyed_handles if h.checkpoint_id == checkpoint and h.subtask == subtask)


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return request.param


@pytest.fixture
def job(tmp_path, backend):
    storage = CheckpointStorage(str(tmp_path / "chk"), retain=10)
    mds, expected = run_job(storage, backend)
    return storage, mds, expected


@pytest.fixture
def twin(tmp_path, backend):
    """A twin run of the job (same name, same keys, other values) in another location: its files have the layout
    of the job's, byte offsets and sizes alike."""
    storage = CheckpointStorage(str(tmp_path / "twin"), retain=10)
    mds, expected = run_job(storage, backend, factor=7)
    return storage, mds, expected


# ---- what is written -------------------------------------------------------------------------------------------------

def test_a_whole_chain_names_its_predecessors_restores_and_verifies(job, backend, capsys):
    storage, mds, expected = job
    md = mds[-1]
    assert open(os.path.join(storage.location, "chk-4", "_metadata"), "rb").read(8)[4:] == \
        struct.pack("<I", METADATA_VERSION) == struct.pack("<I", 7)
    assert sorted(h.checkpoint_id for h in md.keyed_handles) == [1, 1, 2, 2, 3, 3, 4, 4]
    for h in md.keyed_handles:
        file = open_snapshot(storage.read_bytes(h.file))
        quiet = [kg for kg in h.key_group_range if not h.changes(kg)]
        assert file.version == 4 and file.file_id == h.file_id
        if h.checkpoint_id == 1:
            assert file.checksums() == h.checksums and h.is_all_full and not h.predecessors
            continue
        # in the file, every delta, the empty ones too, names the newest block of its key group before it
        assert not h.full_key_groups
        tips = chain_tips(mds[h.checkpoint_id - 2], h.key_group_range)
        named = {b.key_group: b.predecessor for b in file.key_groups() if b.predecessor is not None}
        assert named == tips   # both backends name each delta's predecessor in the file
        if h.checkpoint_id == md.checkpoint_id:   # a checkpoint's own handles record every block's link
            assert file.checksums() == h.checksums and h.predecessors == tips
            continue
        # a carried handle (metadata version 7) records the links of the blocks that are not quiet only
        assert quiet and all(h.checksum(kg) is None and h.predecessor(kg) is None for kg in quiet)
        assert all(h.checksum(kg) == c for kg, c in zip(h.key_group_range, file.checksums()) if kg not in quiet)
        assert dict(h.predecessors) == {kg: link for kg, link in tips.items() if kg not in quiet}
    for p in (1, 3):
        assert restored(storage, md, backend, p) == expected
    assert verify(storage, capsys) == (0, "")


# ---- a middle delta lost ---------------------------------------------------------------------------------------------

LOST = (r"holds a broken chain: the (empty )?delta block of key group (\d+) in 'shared/keyed-0-[34]-[0-9a-f]+' "
        r"\(subtask 0, written by checkpoint [34]\) (applies on|continues) the block of checkpoint 2 with checksum "
        r"0x[0-9a-f]{8}, but the newest block before it in the chain is the block of checkpoint 1 in "
        r"'shared/keyed-0-1-[0-9a-f]+' \(subtask 0, checksum 0x[0-9a-f]{8}\): the chain lacks a delta \(the file of "
        r"checkpoint 2 that holds that block is not listed\) \(KEY_GROUPS\)")


def test_a_chain_without_a_middle_delta_is_refused_by_commit_restore_and_verify(job, backend, capsys):
    storage, mds, _ = job
    md = mds[-1]
    lost = handle(md, 2, 0)
    without = dataclasses.replace(md, keyed_handles=[h for h in md.keyed_handles if h is not lost])
    changed = [kg for kg in lost.key_group_range if lost.changes(kg)]   # where the lost file held changes
    assert changed
    lost_re = LOST.replace("KEY_GROUPS", f"{len(changed)} key groups: {', '.join(map(str, changed))}")
    # the commit: a driver that lost the file while carrying the chain forward
    with pytest.raises(CorruptSnapshotError, match=f"checkpoint 5 {lost_re}.*nothing was committed"):
        storage.commit(CheckpointMetadata(5, "twin", 0, MAXP, P, carry_forward(without, [])), planned_from=4)
    assert storage.checkpoint_ids() == [1, 2, 3, 4]
    # a _metadata that lost it: restore (any parallelism) and verify
    publish(storage, without)
    for p in (1, 2):
        with pytest.raises(CorruptSnapshotError, match=f"checkpoint 4 {lost_re}"):
            restored(storage, storage.load(4), backend, p)
    code, err = verify(storage, capsys)
    assert code == 1 and re.search(f"CORRUPT keyed state chains: checkpoint 4 {lost_re}", err)
    # only the key groups whose chain lost it: those of subtask 1 restore as they were
    assert plan_keyed_restore(storage.load(4), key_group_range(MAXP, P, 1))


def test_a_lost_file_that_ends_a_chain_is_refused_too(job, backend):
    """A key group whose last change was in the lost file: the later files' empty deltas name that block."""
    storage, mds, _ = job
    md = mds[-1]
    lost = handle(md, 3, 0)
    ends = [kg for kg in lost.key_group_range if lost.changes(kg) and not handle(md, 4, 0).changes(kg)]
    assert ends   # key groups whose chain ends with the lost file's block
    publish(storage, dataclasses.replace(md, keyed_handles=[h for h in md.keyed_handles if h is not lost]))
    for kg in ends:
        with pytest.raises(CorruptSnapshotError, match=rf"checkpoint 4 holds a broken chain: the empty delta block "
                                                       rf"of key group {kg} .*written by checkpoint 4\) continues "
                                                       rf"the block of checkpoint 3 with checksum"):
            plan_keyed_restore(storage.load(4), KeyGroupRange(kg, kg))


# ---- deltas swapped --------------------------------------------------------------------------------------------------

def test_swapped_delta_files_are_refused_by_restore_and_verify(job, backend, capsys):
    """The bytes of two middle deltas swapped under their names: each handle's checksums (and file id) refuse the
    other's bytes when they are read."""
    storage, mds, _ = job
    md = mds[-1]
    two, three = handle(md, 2, 1), handle(md, 3, 1)
    a, b = (os.path.join(storage.location, h.file) for h in (two, three))
    data_a, data_b = open(a, "rb").read(), open(b, "rb").read()
    open(a, "wb").write(data_b)
    open(b, "wb").write(data_a)
    with pytest.raises(CorruptSnapshotError, match=rf"keyed state file '{two.file}' \(subtask 1, written by "
                                                   rf"checkpoint 2\)"):
        restored(storage, md, backend)
    code, err = verify(storage, capsys)
    assert code == 1
    for h in (two, three):
        assert (f"CORRUPT keyed state file {h.file} (handle of subtask 1, written by checkpoint "
                f"{h.checkpoint_id})") in err


def test_deltas_listed_out_of_order_are_refused(job, backend, capsys):
    """A _metadata whose handles of checkpoints 2 and 3 trade their checkpoint ids (CRC and all recomputed): each
    delta then names another block than the one before it."""
    storage, mds, _ = job
    path = os.path.join(storage.location, "chk-4", "_metadata")
    raw = open(path, "rb").read()
    body = json.loads(raw[12:-4])
    for h in body["keyed_handles"]:
        h["checkpoint_id"] = {2: 3, 3: 2}.get(h["checkpoint_id"], h["checkpoint_id"])
    text = json.dumps(body).encode()
    head = struct.pack("<4sII", METADATA_MAGIC, METADATA_VERSION, len(text)) + text
    open(path, "wb").write(head + struct.pack("<I", crc32c(head)))
    reordered = storage.load(4)
    broken = (r"checkpoint 4 holds a broken chain: the (empty )?delta block of key group \d+ in .* \(subtask \d, "
              r"written by")
    with pytest.raises(CorruptSnapshotError, match=broken):
        restored(storage, reordered, backend)
    with pytest.raises(CorruptSnapshotError, match=broken.replace("checkpoint 4", "checkpoint 5")):
        storage.commit(CheckpointMetadata(5, "twin", 0, MAXP, P, carry_forward(reordered, [])), planned_from=4)
    code, err = verify(storage, capsys)
    assert code == 1 and re.search(f"CORRUPT keyed state chains: {broken}", err)


def test_a_delta_written_on_an_older_checkpoint_is_refused_at_commit(job, backend):
    """A task attempt that restored checkpoint 3 (a zombie of an earlier batch) reports a delta for checkpoint 5: the
    blocks of checkpoint 4 come between the ones it names and it."""
    storage, mds, _ = job
    stale = _backends(backend)[0]
    stale.restore(storage, mds[2])
    stale.get_state(COUNT)
    h = stale.snapshot(5, storage).result(30)
    stale.dispose()
    assert h.predecessors == chain_tips(mds[2], h.key_group_range)
    with pytest.raises(CorruptSnapshotError, match=r"checkpoint 5 holds a broken chain: the empty delta block of key "
                                                   r"group \d+ .*written by checkpoint 5\) continues the block of "
                                                   r"checkpoint [123] .* but the block of checkpoint 4 .* comes "
                                                   r"between them: a delta that does not belong to this chain"):
        storage.commit(CheckpointMetadata(5, "twin", 0, MAXP, P, carry_forward(mds[-1], [h])), planned_from=4)
    assert storage.checkpoint_ids() == [1, 2, 3, 4]


# ---- a twin run's delta ----------------------------------------------------------------------------------------------

def test_a_twin_runs_delta_of_the_same_layout_is_refused_by_restore_and_verify(job, twin, backend, capsys):
    """The hostile probe of 2026-11-26: a delta file replaced by the twin run's file of the same checkpoint and
    subtask (same layout: every offset alike) restored the twin's values without a word, and verify passed."""
    storage, mds, expected = job
    twin_storage, twin_mds, _ = twin
    ours, theirs = handle(mds[-1], 3, 0), handle(twin_mds[-1], 3, 0)
    assert (ours.offsets, ours.size) == (theirs.offsets, theirs.size) and ours.checksums != theirs.checksums
    shutil.copyfile(os.path.join(twin_storage.location, theirs.file), os.path.join(storage.location, ours.file))
    with pytest.raises(CorruptSnapshotError, match=rf"keyed state file '{ours.file}' \(subtask 0, written by "
                                                   r"checkpoint 3\): the block of key group \d+ stores checksum "
                                                   r"0x[0-9a-f]{8}, the checkpoint's handle names 0x[0-9a-f]{8}: the "
                                                   r"file is not the one the checkpoint wrote \(replaced by another "
                                                   r"of the same layout"):
        restored(storage, mds[-1], backend)
    code, err = verify(storage, capsys)
    assert code == 1 and (f"CORRUPT keyed state file {ours.file} (handle of subtask 0, written by checkpoint 3): its "
                          f"header names file id {theirs.file_id}, its handle {ours.file_id}") in err
    # the commit after it reads no state file (its cost is the metadata's): the bytes are refused when read
    storage.commit(CheckpointMetadata(5, "twin", 0, MAXP, P, carry_forward(mds[-1], [])), planned_from=4)
    with pytest.raises(CorruptSnapshotError, match="not the one the checkpoint wrote"):
        restored(storage, storage.load(5), backend)


def test_a_twin_runs_delta_listed_in_the_chain_is_refused_by_commit_restore_and_verify(job, twin, backend, capsys):
    """The twin's handle itself spliced into the chain (its file copied beside ours): its blocks name the twin's
    predecessors, and the next delta names ours."""
    storage, mds, _ = job
    twin_storage, twin_mds, _ = twin
    ours, theirs = handle(mds[-1], 2, 0), handle(twin_mds[-1], 2, 0)
    shutil.copyfile(os.path.join(twin_storage.location, theirs.file), os.path.join(storage.location, theirs.file))
    spliced = dataclasses.replace(mds[-1], keyed_handles=[theirs if h is ours else h for h in mds[-1].keyed_handles])
    foreign = (r"the (empty )?delta block of key group \d+ in '.*' \(subtask 0, written by checkpoint 2\) "
               r"(applies on|continues) the block of checkpoint 1 with checksum 0x[0-9a-f]{8}, but the checkpoint "
               r"lists the block of checkpoint 1 in .* instead: one of the two files is of another run or attempt "
               r"of checkpoint 1 \(a foreign delta\)")
    with pytest.raises(CorruptSnapshotError, match=f"checkpoint 5 holds a broken chain: {foreign}"):
        storage.commit(CheckpointMetadata(5, "twin", 0, MAXP, P, carry_forward(spliced, [])), planned_from=4)
    publish(storage, spliced)
    with pytest.raises(CorruptSnapshotError, match=f"checkpoint 4 holds a broken chain: {foreign}"):
        restored(storage, storage.load(4), backend)
    code, err = verify(storage, capsys)
    assert code == 1 and "CORRUPT keyed state chains: checkpoint 4 holds a broken chain" in err


# ---- the read cache --------------------------------------------------------------------------------------------------

@pytest.fixture
def remote(tmp_path):
    """The job's chain copied to a remote (memory://) location, read through a cache directory; the twin's files
    of the same names beside it, for poisoning."""
    local = CheckpointStorage(str(tmp_path / "chk"), retain=10)
    mds, expected = run_job(local, "heap")
    twin = CheckpointStorage(str(tmp_path / "twin"), retain=10)
    twin_mds, _ = run_job(twin, "heap", factor=7)
    location = f"memory://kg-chain-{uuid.uuid4().hex}"
    storage = CheckpointStorage(location, retain=10, cache_dir=str(tmp_path / "cache"))
    for root, _, files in os.walk(local.location):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local.location).replace(os.sep, "/")
            with storage.open_write(rel) as f:
                f.write(open(os.path.join(root, name), "rb").read())
    yield storage, mds, expected, twin, twin_mds, tmp_path / "cache"
    fs, path = fsspec.core.url_to_fs(location)
    fs.rm(path, recursive=True)


def _poison(cache_dir: pathlib.Path, storage: CheckpointStorage, relpath: str, start: int, data: bytes) -> str:
    """A cache entry for bytes [start, start + len(data)) of ``relpath`` that passes its HMAC (as one written by this
    user's keygroups would, for another file of the same URL, say), holding ``data``."""
    secret = (cache_dir / SECRET_NAME).read_bytes()
    key = _ReadCache.key(storage.url(relpath))
    end = start + len(data)
    name = f"{key}-{start}-{end}-{seal(secret, key.encode(), f'{start}-{end}'.encode(), data)[:32]}"
    (cache_dir / name).write_bytes(data)
    os.chmod(cache_dir / name, 0o600)
    return name


def test_a_cached_range_that_fails_the_metadata_checksums_is_dropped_and_read_again(remote, caplog):
    storage, mds, expected, twin, twin_mds, cache = remote
    md = storage.load(4)
    assert restored(storage, md, "heap") == expected   # fills the cache
    entries = sorted(os.listdir(cache))
    h, theirs = handle(md, 3, 0), handle(twin_mds[-1], 3, 0)
    start, end = h.byte_range(h.key_group_range)
    for entry in [n for n in entries if n.startswith(_ReadCache.key(storage.url(h.file)))]:
        os.remove(cache / entry)   # the ranges read of the file: one entry holding all of them takes their place
    poisoned = _poison(cache, storage, h.file, start, twin.read_bytes(theirs.file, start, end))
    with caplog.at_level("WARNING", logger="keygroups.checkpoint.storage"):
        assert restored(storage, md, "heap") == expected
    assert f"{poisoned} passes its HMAC but not the checkpoint's checksums" in caplog.text
    assert not (cache / poisoned).exists() and sorted(os.listdir(cache)) == entries   # kept again: the true bytes


def test_a_range_wrong_in_the_cache_and_in_the_file_is_refused(remote):
    storage, mds, expected, twin, twin_mds, cache = remote
    md = storage.load(4)
    h, theirs = handle(md, 2, 1), handle(twin_mds[-1], 2, 1)
    start, end = h.byte_range(h.key_group_range)
    twin_bytes = twin.read_bytes(theirs.file)
    with storage.open_write(h.file) as f:   # the twin's file at the source
        f.write(twin_bytes)
    storage._cache._ready()
    _poison(cache, storage, h.file, start, twin_bytes[start:end])
    with pytest.raises(CorruptSnapshotError, match=rf"'{h.file}' \(subtask 1, written by checkpoint 2\): the block "
                                                   r"of key group \d+ stores checksum"):
        read_key_groups(storage, h, h.key_group_range)
    assert not [n for n in os.listdir(cache) if n.startswith(_ReadCache.key(storage.url(h.file)))]


# ---- random damage: always refused or harmless -----------------------------------------------------------------------

_BUILT: dict[str, tuple[str, str, dict]] = {}


def _built_chains(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict]:
    """The job's and the twin's locations (built once per test run, copied per example) and the job's state."""
    if "heap" not in _BUILT:
        root = str(tmp_path_factory.mktemp("chain-model"))
        ours = CheckpointStorage(os.path.join(root, "ours"), retain=10)
        _, expected = run_job(ours, "heap")
        twin = CheckpointStorage(os.path.join(root, "twin"), retain=10)
        run_job(twin, "heap", factor=7)
        _BUILT["heap"] = (ours.location, twin.location, expected)
    return _BUILT["heap"]


MUTATIONS = ["drop", "copy file", "swap files", "swap names", "flip", "truncate", "splice twin", "renumber"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_to_a_chain_is_refused_or_harmless(data, tmp_path_factory, capsys):
    """One to three random mutations of the chain's files and of the newest ``_metadata`` (a file lost, a file's
    bytes replaced by another's of ours or the twin's, two files swapped under their names or in the metadata, a
    flipped byte, a truncation, the twin's handle spliced in, a handle renumbered): a restore then raises
    CorruptDataError or returns exactly the state that was checkpointed, never another one, and whenever
    ``keygroups verify`` passes the restore is exact. (A file of the newest checkpoint dropped from its own
    _metadata is left out: no later file attests the chains it ends.)"""
    ours_src, twin_src, expected = _built_chains(tmp_path_factory)
    root = tmp_path_factory.mktemp("model")
    shutil.copytree(ours_src, root / "ours")
    twin = CheckpointStorage(twin_src, retain=10)
    storage = CheckpointStorage(str(root / "ours"), retain=10)
    md = storage.load(4)
    handles = list(md.keyed_handles)
    twin_handles = {(h.checkpoint_id, h.subtask): h for h in twin.load(4).keyed_handles}
    files = [h.file for h in handles]

    def path(rel: str) -> str:
        return os.path.join(storage.location, rel)

    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        what = data.draw(st.sampled_from(MUTATIONS), label="what")
        i = data.draw(st.integers(0, len(handles) - 1), label="i")
        j = data.draw(st.integers(0, len(handles) - 1), label="j")
        if what == "drop" and handles[i].checkpoint_id < 4:
            handles.pop(i)
        elif what == "copy file":
            from_twin = data.draw(st.booleans(), label="from twin")
            src = (os.path.join(twin.location, twin_handles[(handles[j].checkpoint_id, handles[j].subtask)].file)
                   if from_twin else path(files[j]))
            if src != path(files[i]):
                shutil.copyfile(src, path(files[i]))
        elif what == "swap files" and files[i] != files[j]:
            a, b = open(path(files[i]), "rb").read(), open(path(files[j]), "rb").read()
            open(path(files[i]), "wb").write(b)
            open(path(files[j]), "wb").write(a)
        elif what == "swap names":
            a, b = handles[i], handles[j]
            handles[i], handles[j] = dataclasses.replace(a, file=b.file), dataclasses.replace(b, file=a.file)
        elif what == "flip":
            raw = bytearray(open(path(files[i]), "rb").read())
            if raw:   # (an earlier truncation may have emptied it)
                raw[data.draw(st.integers(0, len(raw) - 1), label="at")] ^= data.draw(st.integers(1, 255), label="x")
                open(path(files[i]), "wb").write(bytes(raw))
        elif what == "truncate":
            raw = open(path(files[i]), "rb").read()
            if raw:
                open(path(files[i]), "wb").write(raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")])
        elif what == "splice twin":
            theirs = twin_handles[(handles[i].checkpoint_id, handles[i].subtask)]
            shutil.copyfile(os.path.join(twin.location, theirs.file), path(theirs.file))
            handles[i] = theirs
        elif what == "renumber":
            cid = data.draw(st.integers(1, 4), label="checkpoint")
            try:
                handles[i] = dataclasses.replace(handles[i], checkpoint_id=cid)
            except ValueError:   # a delta cannot name a block of its own or a newer checkpoint
                pass
    try:
        publish(storage, dataclasses.replace(md, keyed_handles=handles))
    except ValueError:
        return   # no _metadata can even be written with such handles (overlapping ones, say)
    try:
        loaded = storage.load(4)
        state = restored(storage, loaded, "heap", data.draw(st.sampled_from([1, 2]), label="parallelism"))
    except CorruptDataError:
        state = None
    assert state is None or state == expected, "a damaged chain restored another state without an error"
    code, _ = verify(storage, capsys)
    if code == 0:
        assert state == expected, "verify passed a chain that does not restore what was checkpointed"


# ---- checkpoints written before: keyed format 3, _metadata 3 ---------------------------------------------------------

def v3_descriptors() -> dict:
    ttl = StateTtlConfig.new_builder(3600).build()
    out = {"count": ValueStateDescriptor("count", Int64Serializer()),
           "events": ListStateDescriptor("events", StrSerializer()),
           "attrs": MapStateDescriptor("attrs", StrSerializer(), ValueSerializer()),
           "seen": ValueStateDescriptor("seen", Int64Serializer()),
           "log": ListStateDescriptor("log", StrSerializer()),
           "tags": MapStateDescriptor("tags", StrSerializer(), Int64Serializer())}
    for name in ("seen", "log", "tags"):
        out[name].enable_time_to_live(ttl)
    return out


V3_CLOCK_S = 1_700_000_000.0 + 300   # "live" in expected.json: nothing expired


def v3_state(storage: CheckpointStorage, md: CheckpointMetadata, backend: str, parallelism: int) -> dict:
    got = {}
    for i in range(parallelism):
        r = key_group_range(16, parallelism, i)
        with BACKENDS[backend](r, 16, Int64Serializer(), subtask_index=i, clock=lambda: V3_CLOCK_S) as b:
            b.restore(storage, md)
            s = {n: b.get_state(d) for n, d in v3_descriptors().items()}
            for k in range(60):
                if assign_to_key_group(k, 16) in r:
                    b.set_current_key(k)
                    got[str(k)] = [s["count"].value(), list(s["events"].get()), dict(s["attrs"].items()),
                                   s["seen"].value(), list(s["log"].get()), dict(s["tags"].items())]
    return got


@pytest.fixture
def v3_storage(tmp_path):
    shutil.copytree(V3 / "chk", tmp_path / "chk")
    return CheckpointStorage(str(tmp_path / "chk"), retain=100)


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_format_3_chain_still_restores_and_verifies(v3_storage, backend, parallelism, capsys):
    md = v3_storage.load(3)
    assert {h.format_version for h in md.keyed_handles} == {3} and any(not h.is_all_full for h in md.keyed_handles)
    expected = json.loads((V3 / "expected.json").read_text())["live"]
    assert v3_state(v3_storage, md, backend, parallelism) == expected
    assert verify(v3_storage, capsys, 3) == (0, "")


def test_the_first_snapshot_after_a_format_3_chain_is_full_then_chained(v3_storage, backend):
    """A delta names its predecessor by a checksum that format-3 blocks lack: the first snapshot on a format-3 chain
    writes every key group full (format 4), and the next ones are linked deltas on it."""
    last = v3_storage.load(3)
    expected = json.loads((V3 / "expected.json").read_text())["live"]
    for cid in (4, 5):
        handles = []
        for i in range(2):
            with BACKENDS[backend](key_group_range(16, 2, i), 16, Int64Serializer(), subtask_index=i,
                                   clock=lambda: V3_CLOCK_S) as b:
                b.restore(v3_storage, last)
                s = {n: b.get_state(d) for n, d in v3_descriptors().items()}
                for k in range(60):
                    if assign_to_key_group(k, 16) in b.key_group_range and k % 5 == cid % 5:
                        b.set_current_key(k)
                        s["count"].update(cid * 100 + k)
                        expected[str(k)][0] = cid * 100 + k
                handles.append(b.snapshot(cid, v3_storage).result(30))
        assert all(h.format_version == 4 for h in handles)
        assert all(h.is_all_full for h in handles) == (cid == 4)
        v3_storage.commit(CheckpointMetadata(cid, "format-3", 0, 16, 2, carry_forward(last, handles)))
        last = v3_storage.load(cid)
    assert {h.format_version for h in last.keyed_handles} == {4}
    assert all(h.predecessors for h in last.keyed_handles if h.checkpoint_id == 5)
    assert v3_state(v3_storage, last, backend, 1) == expected
