"""Checkpoint storage: the commit protocol, atomicity, retention, savepoints, local paths and fsspec memory://."""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import pickle
import shutil
import struct
import tempfile
import uuid

import fsspec
import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, key_group_range
from keygroups._local_dirs import SECRET_NAME, seal
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    KeyedStateHandle,
    OperatorStateHandle,
    carry_forward,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import METADATA_MAGIC, decode_metadata, encode_metadata
from keygroups.checkpoint.storage import _ReadCache
from keygroups.errors import CheckpointNotFoundError, ConcurrentCommitError, CorruptSnapshotError

MAXP = 16
# A meta as a backend writes it (keygroups.state._base.state_meta): the key's serializer too, so that a backend's
# restore (which checks every meta first, keygroups.checkpoint.state_meta) reads these checkpoints.
STATES = [{"name": "count", "kind": "value", "serializers": {"key": {"identifier": "str", "version": 1},
                                                            "value": {"identifier": "int64", "version": 1}}}]


@pytest.fixture(params=["local", "memory"])
def storage_factory(request, tmp_path):
    """Builds CheckpointStorage objects over a fresh local directory or a fresh memory:// root (same location for
    every call, so a test can open the same storage twice)."""
    if request.param == "local":
        location = str(tmp_path / "checkpoints")
        yield lambda **kw: CheckpointStorage(location, **kw)
    else:
        location = f"memory://kg-test-{uuid.uuid4().hex}"
        yield lambda **kw: CheckpointStorage(location, **kw)
        fs, root = fsspec.core.url_to_fs(location)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _entries(kg: int, cid: int) -> list:
    return [(0, [f"key-{kg}".encode()], [struct.pack("<qq", kg, cid)])]


def write_checkpoint(storage: CheckpointStorage, cid: int, parallelism: int = 2, *, commit: bool = True,
                     operator: bool = True) -> CheckpointMetadata:
    """A real checkpoint: one keyed file per subtask (one entry per key group) plus one operator file."""
    handles = []
    for i in range(parallelism):
        r = key_group_range(MAXP, parallelism, i)
        handles.append(write_keyed_snapshot(storage, cid, i, r, STATES, ((kg, _entries(kg, cid)) for kg in r)))
    op_handles = []
    if operator:
        rel = storage.new_file(cid, "operator-0")
        with storage.open_write(rel) as f:
            f.write(b"operator state bytes")
        op_handles.append(OperatorStateHandle(file=rel, subtask=0, size=20, operator_id="operator", states={}))
    md = CheckpointMetadata(checkpoint_id=cid, job_id="job-1", timestamp_ms=1_700_000_000_000 + cid,
                            max_parallelism=MAXP, parallelism=parallelism, keyed_handles=handles,
                            operator_handles=op_handles, properties={"source": {"0": cid}})
    if commit:
        storage.commit(md)
    return md


def read_all(storage: CheckpointStorage, md: CheckpointMetadata) -> dict[int, tuple]:
    out = {}
    for h in md.keyed_handles:
        blocks, _ = read_key_groups(storage, h, KeyGroupRange(0, MAXP - 1))
        for block in blocks:
            kg, sections = block.key_group, block.puts
            out[kg] = tuple((i, tuple(map(bytes, ks)), tuple(map(bytes, vs))) for i, ks, vs in sections)
    return out


def expected_state(cid: int) -> dict[int, tuple]:
    return {kg: ((0, (f"key-{kg}".encode(),), (struct.pack("<qq", kg, cid),)),) for kg in range(MAXP)}


# -- commit, load, latest ------------------------------------------------------------------------------------------

def test_commit_load_round_trip(storage_factory):
    storage = storage_factory()
    assert storage.latest() is None and storage.checkpoint_ids() == []
    md = write_checkpoint(storage, 1)
    assert md.base == "chk-1"
    loaded = storage.load(1)
    assert loaded == md
    assert loaded.base == "chk-1"
    assert all(h.file.startswith("shared/keyed-") for h in loaded.keyed_handles)   # keyed files outlive chk-<id>
    assert loaded.operator_handles[0].file.startswith("chk-1/operator-0-")
    assert storage.read_bytes(loaded.operator_handles[0].file) == b"operator state bytes"
    assert storage.latest() == md
    assert read_all(storage, loaded) == expected_state(1)


def test_metadata_stores_paths_relative_to_its_directory(storage_factory):
    storage = storage_factory()
    md = write_checkpoint(storage, 3)
    raw = storage.read_bytes("chk-3/_metadata")
    assert raw.startswith(METADATA_MAGIC)
    assert b"chk-3" not in raw   # relative to the checkpoint directory, so the directory can move
    moved = decode_metadata(raw, "elsewhere", "test")
    assert moved.operator_handles[0].file.startswith("elsewhere/operator-0-")
    assert md.operator_handles[0].file.startswith("chk-3/")
    # keyed files live in shared/ (later checkpoints reference them too) and are stored as shared/<name>
    assert moved.keyed_handles[0].file.startswith("shared/keyed-0-3-") and md.keyed_handles[0].file.startswith(
        "shared/keyed-0-3-")


def test_new_file_names_are_relative_and_unique(storage_factory):
    storage = storage_factory()
    a, b = storage.new_file(7, "keyed-3"), storage.new_file(7, "keyed-3")
    assert a != b and a.startswith("chk-7/keyed-3-") and not os.path.isabs(a)
    for bad in ["", "a/b", "../x", ".hidden", "x y"]:
        with pytest.raises(ValueError, match="prefix"):
            storage.new_file(7, bad)
    with pytest.raises(ValueError, match="checkpoint_id"):
        storage.new_file(-1, "keyed")
    for bad in ["/etc/passwd", "../outside", "chk-1/../../x", "", "a//b"]:
        with pytest.raises(ValueError, match="relative path"):
            storage.read_bytes(bad)


def test_ranged_read_bytes(storage_factory):
    storage = storage_factory()
    with storage.open_write("chk-1/blob") as f:
        f.write(bytes(range(100)))
    assert storage.read_bytes("chk-1/blob", 10, 20) == bytes(range(10, 20))
    assert storage.read_bytes("chk-1/blob", 90) == bytes(range(90, 100))
    assert storage.read_bytes("chk-1/blob") == bytes(range(100))
    assert storage.file_size("chk-1/blob") == 100
    assert bytes(memoryview(storage.open_buffer("chk-1/blob"))[5:8]) == bytes([5, 6, 7])
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("chk-1/nope")


def test_commit_refuses_incomplete_or_inconsistent_checkpoints(storage_factory):
    storage = storage_factory()
    md = write_checkpoint(storage, 2, commit=False)
    missing = CheckpointMetadata(**{**md.__dict__, "keyed_handles": md.keyed_handles + [
        KeyedStateHandle("chk-2/keyed-1-gone", 1, KeyGroupRange.empty(), [0], 0, STATES, checkpoint_id=2,
                         file_id="0" * 32, checksums=[])]})
    with pytest.raises(ValueError, match="does not exist"):
        storage.commit(missing)
    h = md.keyed_handles[0]
    wrong_size = CheckpointMetadata(**{**md.__dict__, "keyed_handles": [dataclasses.replace(h, size=h.size + 1)]})
    with pytest.raises(ValueError, match="bytes but its handle says"):
        storage.commit(wrong_size)
    other_dir = CheckpointMetadata(**{**md.__dict__, "checkpoint_id": 5})
    with pytest.raises(ValueError, match="not inside 'chk-5'/"):
        storage.commit(other_dir)
    assert storage.checkpoint_ids() == []   # nothing of the refused commits became visible
    storage.commit(md)
    with pytest.raises(ValueError, match="ids must increase"):
        storage.commit(md)
    with pytest.raises(ValueError, match="max_parallelism"):
        CheckpointMetadata(9, "j", 0, 0, 1).validate()
    with pytest.raises(ValueError, match="parallelism must be"):
        CheckpointMetadata(9, "j", 0, 8, 9).validate()
    h0, h1 = md.keyed_handles
    with pytest.raises(ValueError, match="keyed handles overlap: subtask 0"):
        CheckpointMetadata(2, "j", 0, MAXP, 2, [h0, KeyedStateHandle(h1.file, 1, KeyGroupRange(0, 3), [0] * 5, 9,
                                                                    STATES, checkpoint_id=2, file_id="0" * 32,
                                                                    checksums=[0] * 4)]).validate()
    with pytest.raises(ValueError, match="subtask 1 in a checkpoint of parallelism 1"):
        CheckpointMetadata(2, "j", 0, MAXP, 1, [h1]).validate()
    with pytest.raises(ValueError, match="past max_parallelism=8"):
        CheckpointMetadata(2, "j", 0, 8, 2, [h1]).validate()


# -- atomicity -----------------------------------------------------------------------------------------------------

def test_checkpoint_without_metadata_does_not_exist(storage_factory):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2, commit=False)   # a crash before the driver wrote _metadata
    assert storage.checkpoint_ids() == [1]
    assert storage.latest().checkpoint_id == 1
    with pytest.raises(CheckpointNotFoundError) as e:
        storage.load(2)
    msg = str(e.value)
    assert "checkpoint 2 does not exist" in msg and "complete checkpoints: [1]" in msg and "incomplete" in msg
    assert "[2]" in msg


def test_leftover_temp_metadata_is_invisible(storage_factory):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    md2 = write_checkpoint(storage, 2, commit=False)
    # A crash between writing the temporary _metadata and the rename: a complete, valid file under the temp name.
    with storage.open_write(f"chk-2/_metadata.inprogress-{uuid.uuid4().hex}") as f:
        f.write(encode_metadata(md2, "chk-2"))
    # ... and a half-written one of a third checkpoint.
    md3 = write_checkpoint(storage, 3, commit=False)
    with storage.open_write(f"chk-3/_metadata.inprogress-{uuid.uuid4().hex}") as f:
        f.write(encode_metadata(md3, "chk-3")[:20])
    assert storage.checkpoint_ids() == [1]
    assert storage.latest().checkpoint_id == 1
    # The next successful commit cleans the older leftovers but not newer, possibly in-progress, checkpoints.
    storage.commit(md3)
    assert storage.checkpoint_ids() == [1, 3]
    assert not any(n.startswith("chk-2") for n in _ls(storage, ""))
    assert sum(".inprogress-" in n for n in _ls(storage, "chk-3")) == 1   # the latest one's leftovers stay ...
    write_checkpoint(storage, 4)
    assert not any(".inprogress-" in n for n in _ls(storage, "chk-3"))   # ... until a newer one completes
    assert read_all(storage, storage.load(3)) == expected_state(3)


def test_truncated_or_damaged_metadata_is_corrupt(storage_factory):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    raw = storage.read_bytes("chk-1/_metadata")
    for bad in [raw[: len(raw) // 2], raw[:-1], b"", raw[:5] + bytes([raw[5] ^ 1]) + raw[6:],
                raw[:-10] + bytes([raw[-10] ^ 0x20]) + raw[-9:]]:
        with storage.open_write("chk-1/_metadata") as f:
            f.write(bad)
        with pytest.raises(CorruptSnapshotError):
            storage.load(1)
    unknown = METADATA_MAGIC + struct.pack("<I", 99) + raw[8:]
    with storage.open_write("chk-1/_metadata") as f:
        f.write(unknown)
    with pytest.raises(CorruptSnapshotError, match="version 99"):
        storage.load(1)


def test_local_commit_leaves_no_temp_files(tmp_path):
    storage = CheckpointStorage(tmp_path)
    write_checkpoint(storage, 4)
    names = sorted(os.listdir(tmp_path / "chk-4"))
    assert "_metadata" in names and not any(".inprogress-" in n for n in names)
    assert len(names) == 1 + 1   # _metadata, one operator file
    shared = sorted(os.listdir(tmp_path / "shared"))   # the two keyed files: later checkpoints may reference them
    assert len(shared) == 2 and all(n.startswith(("keyed-0-4-", "keyed-1-4-")) for n in shared)


# -- retention -----------------------------------------------------------------------------------------------------

def _ls(storage: CheckpointStorage, rel: str) -> list[str]:
    return storage._fs.listdir(rel)


def test_a_failed_atomic_write_removes_its_temporary_file(storage_factory, monkeypatch):
    storage = storage_factory()
    storage._fs.makedirs("chk-1/target/inside")   # locally, moving a file onto a non-empty directory fails
    if "://" in storage.location:                  # memory:// moves onto anything: make its move fail instead

        def refuse(*args, **kwargs):
            raise OSError("injected: the move failed")

        monkeypatch.setattr(storage._fs.fs, "mv", refuse)
    with pytest.raises(OSError):
        storage._fs.write_atomic("chk-1/target", b"new bytes")
    assert _ls(storage, "chk-1") == ["target"]
    monkeypatch.undo()
    storage._fs.write_atomic("chk-1/other", b"new bytes")
    assert sorted(_ls(storage, "chk-1")) == ["other", "target"]
    assert storage.read_bytes("chk-1/other") == b"new bytes"


def test_retention_keeps_the_last_n_complete(storage_factory):
    storage = storage_factory(retain=2)
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    assert storage.checkpoint_ids() == [1, 2]
    write_checkpoint(storage, 3, commit=False)   # in progress: nothing may be pruned yet
    assert storage.checkpoint_ids() == [1, 2]
    assert "chk-1" in _ls(storage, "")
    storage.commit(storage_md := write_checkpoint(storage, 4, commit=False))
    assert storage.checkpoint_ids() == [2, 4]
    assert [n for n in _ls(storage, "") if n.startswith("chk-")] == ["chk-2", "chk-4"]   # 1 pruned, 3 abandoned
    for cid in range(5, 9):
        write_checkpoint(storage, cid)
    assert storage.checkpoint_ids() == [7, 8]
    assert read_all(storage, storage.load(7)) == expected_state(7)
    assert storage_md.checkpoint_id == 4


def test_retention_removes_orphans_of_older_checkpoints_only(storage_factory):
    storage = storage_factory(retain=3)
    write_checkpoint(storage, 1)
    with storage.open_write(storage.new_file(1, "keyed-0")) as f:   # a retried task attempt's unreported file
        f.write(b"orphan")
    write_checkpoint(storage, 2)
    with storage.open_write(storage.new_file(2, "keyed-1")) as f:
        f.write(b"orphan of the latest checkpoint: kept until a newer one completes")
    assert len(_ls(storage, "chk-1")) == 1 + 1
    assert len(_ls(storage, "chk-2")) == 1 + 1 + 1
    write_checkpoint(storage, 3)
    assert len(_ls(storage, "chk-1")) == 1 + 1 and len(_ls(storage, "chk-2")) == 1 + 1
    assert len(storage.shared_files()) == 3 * 2   # two keyed files per retained checkpoint
    assert storage.checkpoint_ids() == [1, 2, 3]
    assert read_all(storage, storage.load(2)) == expected_state(2)


def test_files_named_as_outputs_or_not_ours_are_never_orphans(storage_factory):
    storage = storage_factory(retain=3)
    md = write_checkpoint(storage, 1, commit=False)
    output = storage.new_file(1, "output-0") + ".parquet"
    stray = storage.new_file(1, "output-1") + ".parquet"
    for rel in (output, stray, "chk-1/README"):
        with storage.open_write(rel) as f:
            f.write(b"x")
    md.outputs = [output]
    md.properties = {"nested": {"deep": [{"other": "not a path"}]}}
    storage.commit(md)
    write_checkpoint(storage, 2)
    names = _ls(storage, "chk-1")
    assert output.split("/")[1] in names and "README" in names   # referenced as an output; not a new_file name
    assert stray.split("/")[1] not in names                       # an unreferenced new_file name: an orphan


def test_outputs_and_inputs_are_metadata_fields_and_properties_reference_no_file(storage_factory):
    storage = storage_factory(retain=3)
    md = write_checkpoint(storage, 1, commit=False)
    output, staged, named = (storage.new_file(1, p) + ".parquet" for p in ("output-0", "input-0", "output-9"))
    for rel in (output, staged, named):
        with storage.open_write(rel) as f:
            f.write(b"x")
    md.outputs, md.inputs = [output], [staged]
    md.properties = {"reports": [{"output_file": named}]}   # a string in properties keeps nothing alive
    storage.commit(md)
    loaded = storage.load(1)
    assert (loaded.outputs, loaded.inputs) == ([output], [staged])
    body = storage.read_bytes("chk-1/_metadata")[12:-4].decode()
    assert f'"outputs":["{output.split("/")[1]}"]' in body   # stored relative to the checkpoint's directory
    write_checkpoint(storage, 2)
    names = _ls(storage, "chk-1")
    assert output.split("/")[1] in names and staged.split("/")[1] in names and named.split("/")[1] not in names


def test_outputs_must_lie_in_the_checkpoints_own_directory_and_exist(storage_factory):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    md = write_checkpoint(storage, 2, commit=False)
    md.outputs = [storage.new_file(1, "output-0") + ".parquet"]
    with pytest.raises(ValueError, match=r"output file 'chk-1/output-0-.*' is not inside 'chk-2'/"):
        storage.commit(md)
    for bad in ["../chk-1/x", "/abs", "chk-2//x", 7]:
        md.outputs = [bad]
        with pytest.raises((ValueError, TypeError), match="an entry of outputs"):
            storage.commit(md)
    md.outputs, md.inputs = [], [storage.new_file(2, "input-0") + ".parquet"]
    with pytest.raises(ValueError, match="references input files .* which do not exist"):
        storage.commit(md)
    assert storage.checkpoint_ids() == [1]


def _version_1_metadata(md: CheckpointMetadata, base: str, properties: dict) -> bytes:
    """``_metadata`` as keygroups wrote it before the outputs field: version 1, the runner's files in properties."""
    body = {"checkpoint_id": md.checkpoint_id, "job_id": md.job_id, "timestamp_ms": md.timestamp_ms,
            "max_parallelism": md.max_parallelism, "parallelism": md.parallelism,
            "keyed_handles": [dict(h.to_json(), file=h.file[len(base) + 1:]) for h in md.keyed_handles],
            "operator_handles": [dict(h.to_json(), file=h.file[len(base) + 1:]) for h in md.operator_handles],
            "properties": properties}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    head = METADATA_MAGIC + struct.pack("<II", 1, len(raw)) + raw
    return head + struct.pack("<I", crc32c(head))


def test_version_1_checkpoints_with_outputs_in_properties_load_and_prune_correctly(storage_factory):
    storage = storage_factory(retain=2)
    md = write_checkpoint(storage, 1, commit=False)
    # a version 1 checkpoint kept its keyed files in its own directory
    for h in md.keyed_handles:
        storage._fs.copy(h.file, f"chk-1/{posixpath.basename(h.file)}")
        storage._fs.remove(h.file)
    md.keyed_handles = [dataclasses.replace(h, file=f"chk-1/{posixpath.basename(h.file)}") for h in md.keyed_handles]
    output, staged, stray = (storage.new_file(1, p) + ".parquet" for p in ("output-0", "input-0", "output-1"))
    for rel in (output, staged, stray):
        with storage.open_write(rel) as f:
            f.write(b"x")
    properties = {"outputs": [output], "inputs": [staged], "reports": [{"subtask": 0, "output_file": output}]}
    with storage.open_write("chk-1/_metadata") as f:
        f.write(_version_1_metadata(md, "chk-1", properties))
    loaded = storage.load(1)
    assert (loaded.outputs, loaded.inputs) == ([output], [staged])
    assert loaded.properties == {"reports": [{"subtask": 0, "output_file": output}]}
    assert loaded.keyed_handles == md.keyed_handles
    write_checkpoint(storage, 2)
    names = _ls(storage, "chk-1")
    assert output.split("/")[1] in names and staged.split("/")[1] in names and stray.split("/")[1] not in names
    where = storage.savepoint(1, "from-version-1")   # state only: the savepoint holds no outputs
    assert storage.load_savepoint("from-version-1").outputs == [] and where.endswith("savepoints/from-version-1")
    write_checkpoint(storage, 3)
    assert storage.checkpoint_ids() == [2, 3]


def test_retain_must_be_positive(tmp_path):
    for bad in [0, -1, True, 1.5]:
        with pytest.raises(ValueError, match="retain"):
            CheckpointStorage(tmp_path, retain=bad)


# -- savepoints ----------------------------------------------------------------------------------------------------

def test_savepoint_survives_retention_and_restores_from_its_own_dir(storage_factory):
    storage = storage_factory(retain=1)
    md = write_checkpoint(storage, 1)
    where = storage.savepoint(md, "before-upgrade")
    assert where.endswith("savepoints/before-upgrade")
    write_checkpoint(storage, 2)
    write_checkpoint(storage, 3)
    assert storage.checkpoint_ids() == [3]
    assert "chk-1" not in _ls(storage, "")
    sp = storage.load_savepoint("before-upgrade")
    assert sp.base == "savepoints/before-upgrade"
    assert all(h.file.startswith("savepoints/before-upgrade/") for h in sp.keyed_handles)
    assert sp.operator_handles[0].file.startswith("savepoints/before-upgrade/operator-0-")
    assert read_all(storage, sp) == expected_state(1)
    assert storage.read_bytes(sp.operator_handles[0].file) == b"operator state bytes"
    assert storage.savepoint_names() == ["before-upgrade"]
    # By id, too; a name is never reused.
    storage.savepoint(3, "three")
    assert read_all(storage, storage.load_savepoint("three")) == expected_state(3)
    with pytest.raises(ValueError, match="already exists"):
        storage.savepoint(3, "three")
    with pytest.raises(CheckpointNotFoundError, match=r"savepoint 'nope' does not exist.*'before-upgrade', 'three'"):
        storage.load_savepoint("nope")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 1 does not exist"):
        storage.savepoint(1, "too-late")


def test_savepoint_directory_is_self_contained(tmp_path):
    storage = CheckpointStorage(tmp_path / "a")
    write_checkpoint(storage, 5)
    storage.savepoint(5, "sp")
    shutil.copytree(tmp_path / "a" / "savepoints", tmp_path / "b" / "savepoints")
    shutil.rmtree(tmp_path / "a")
    moved = CheckpointStorage(tmp_path / "b")
    assert read_all(moved, moved.load_savepoint("sp")) == expected_state(5)


def test_interrupted_savepoint_does_not_exist_and_can_be_redone(storage_factory):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    with storage.open_write("savepoints/sp/keyed-0-partial") as f:
        f.write(b"half a copy")
    with pytest.raises(CheckpointNotFoundError):
        storage.load_savepoint("sp")
    assert storage.savepoint_names() == []
    storage.savepoint(1, "sp")
    assert read_all(storage, storage.load_savepoint("sp")) == expected_state(1)
    assert "keyed-0-partial" not in _ls(storage, "savepoints/sp")


# -- fsspec, pickling ----------------------------------------------------------------------------------------------

def test_memory_filesystem_round_trip_and_reopen():
    location = f"memory://kg-test-{uuid.uuid4().hex}/nested/dir"
    try:
        storage = CheckpointStorage(location)
        assert storage.location == location
        write_checkpoint(storage, 1)
        again = CheckpointStorage(location + "/")
        assert again.checkpoint_ids() == [1]
        assert read_all(again, again.latest()) == expected_state(1)
        fs, root = fsspec.core.url_to_fs(location)
        assert fs.exists(f"{root}/chk-1/_metadata")
        assert isinstance(again.open_buffer(again.latest().keyed_handles[0].file), bytes)
    finally:
        fs, root = fsspec.core.url_to_fs(location)
        fs.rm(root, recursive=True)


def test_storage_pickles_as_its_arguments(storage_factory):
    storage = storage_factory(retain=5)
    write_checkpoint(storage, 1)
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.location == storage.location and clone.retain == 5
    assert clone.load(1) == storage.load(1)


def test_file_url_and_relative_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = CheckpointStorage("ckpts")
    assert rel.location == str(tmp_path / "ckpts")
    write_checkpoint(rel, 1)
    via_url = CheckpointStorage(f"file://{tmp_path}/ckpts")
    assert via_url.checkpoint_ids() == [1]


def test_checkpoint_layer_imports_neither_state_nor_pyspark():
    import subprocess
    import sys

    code = ("import sys, keygroups.checkpoint; "
            "bad = [m for m in sys.modules if m.startswith(('pyspark', 'keygroups.state', 'keygroups.spark'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_two_drivers_committing_one_checkpoint_exactly_one_wins(storage_factory):
    """Two drivers on one location prepare checkpoint 2 and commit it at once: one commit publishes, the other is
    refused naming the winner, and the loser's own files are gone while everything the winner references stays."""
    import threading

    first = storage_factory()
    write_checkpoint(first, 1)
    drivers = [storage_factory(), storage_factory()]
    prepared = [write_checkpoint(s, 2, commit=False) for s in drivers]
    prepared[1].job_id = "job-2"
    start = threading.Barrier(2)
    outcomes: list = [None, None]

    def commit(i):
        start.wait()
        try:
            drivers[i].commit(prepared[i])
            outcomes[i] = "committed"
        except ConcurrentCommitError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=commit, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winner = outcomes.index("committed")
    loser = 1 - winner
    assert isinstance(outcomes[loser], ConcurrentCommitError)
    assert f"job {prepared[winner].job_id!r}" in str(outcomes[loser])
    assert f"(job {prepared[loser].job_id!r}) was published" in str(outcomes[loser])
    fresh = storage_factory()
    loaded = fresh.load(2)
    assert loaded.job_id == prepared[winner].job_id
    assert read_all(fresh, loaded) == read_all(fresh, prepared[winner])
    for f in prepared[winner].files():
        assert fresh.file_size(f) > 0
    for f in prepared[loser].files():
        with pytest.raises(FileNotFoundError):
            fresh.file_size(f)
    assert fresh.checkpoint_ids() == [1, 2]
    assert read_all(fresh, fresh.load(1)) == read_all(fresh, first.load(1))   # the previous checkpoint untouched


def test_a_commit_that_loses_keeps_files_of_earlier_checkpoints_it_carried(storage_factory):
    storage = storage_factory()
    one = write_checkpoint(storage, 1, operator=False)
    r = key_group_range(MAXP, 1, 0)
    delta = write_keyed_snapshot(storage, 2, 0, r, STATES, ((kg, _entries(kg, 2)) for kg in r), full_key_groups=set())
    late = CheckpointMetadata(checkpoint_id=2, job_id="late", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                              keyed_handles=carry_forward(one, [delta]), operator_handles=[], properties={})
    assert {h.file for h in one.keyed_handles} < {h.file for h in late.keyed_handles}   # its chains need them
    winner = write_checkpoint(storage_factory(), 2, operator=False)
    with pytest.raises(ConcurrentCommitError, match="committed by another writer .job 'job-1'"):
        storage.commit(late)
    for h in one.keyed_handles:   # checkpoint 1's files, which the lost commit carried: kept
        assert storage.file_size(h.file) == h.size
    with pytest.raises(FileNotFoundError):   # the lost batch's own file: removed
        storage.file_size(delta.file)
    assert storage.load(2).job_id == winner.job_id


def test_an_exclusive_write_never_replaces_what_is_there(storage_factory):
    storage = storage_factory()
    storage._fs.makedirs("chk-3")
    storage._fs.write_exclusive("chk-3/_metadata", b"first")
    with pytest.raises(FileExistsError):
        storage._fs.write_exclusive("chk-3/_metadata", b"second")
    assert storage.read_bytes("chk-3/_metadata") == b"first"
    assert storage._fs.listdir("chk-3") == ["_metadata"]   # no temporary left behind


def test_a_symlink_out_of_the_location_is_refused_for_reads_and_writes(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "_metadata").write_bytes(b"not ours")
    storage = CheckpointStorage(str(tmp_path / "checkpoints"))
    write_checkpoint(storage, 1)
    os.symlink(elsewhere, tmp_path / "checkpoints" / "chk-2")
    with pytest.raises(CorruptSnapshotError, match="outside the checkpoint location"):
        write_checkpoint(storage, 2)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["_metadata"]   # nothing written through the link
    with pytest.raises(CorruptSnapshotError, match="outside the checkpoint location"):
        storage.read_bytes("chk-2/_metadata")
    assert storage.load(1).checkpoint_id == 1   # the real checkpoints still load


# -- the local cache of remote keyed files -------------------------------------------------------------------------

def _cached(cache_dir) -> dict[str, bytes]:
    """The cache's entries (name -> content), temporary files and the directory's secret left out."""
    if not os.path.isdir(cache_dir):
        return {}
    return {n: (cache_dir / n).read_bytes() for n in sorted(os.listdir(cache_dir)) if not n.startswith(".")}


def _entry_is_sound(cache_dir: str, name: str, content: bytes) -> bool:
    """The entry's name has its range and the HMAC of key, range and content under the directory's secret."""
    key, start, end, mac = name.split("-")
    with open(os.path.join(cache_dir, SECRET_NAME), "rb") as f:
        secret = f.read()
    return (int(end) - int(start) == len(content)
            and seal(secret, key.encode(), f"{start}-{end}".encode(), content)[:32] == mac)


@pytest.fixture
def memory_location():
    location = f"memory://kg-test-{uuid.uuid4().hex}"
    yield location
    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _delete_remote(storage: CheckpointStorage, relpath: str) -> None:
    fs, path = fsspec.core.url_to_fs(storage.url(relpath))
    fs.rm_file(path)


def test_remote_keyed_ranges_are_read_once_then_served_from_the_cache(memory_location, tmp_path):
    cache = tmp_path / "cache"
    storage = CheckpointStorage(memory_location, cache_dir=cache)
    md = write_checkpoint(storage, 1)
    assert _cached(cache) == {}                                  # writing caches nothing
    assert read_all(storage, md) == expected_state(1)
    entries = _cached(cache)
    assert len(entries) == len(md.keyed_handles) == 2            # one ranged read per keyed file
    assert all(_entry_is_sound(str(cache), n, c) for n, c in entries.items())
    storage.load(1)
    storage.read_bytes(md.operator_handles[0].file)
    storage.read_bytes(md.keyed_handles[0].file)                 # the whole file: not a range of one
    assert _cached(cache) == entries                             # _metadata, operator and whole reads: not kept
    for h in md.keyed_handles:                                   # from now on only the cache has them
        _delete_remote(storage, h.file)
    again = CheckpointStorage(memory_location, cache_dir=cache)  # the next batch's storage on this host
    assert read_all(again, again.load(1)) == expected_state(1)
    h = md.keyed_handles[1]
    part = KeyGroupRange(h.key_group_range.start + 1, h.key_group_range.start + 3)
    assert [b.key_group for b in read_key_groups(again, h, part)[0]] == list(part)   # a part of a cached range
    assert _cached(cache) == entries
    with pytest.raises(FileNotFoundError):                       # a range never cached: the remote file is gone
        again.read_bytes(h.file, 0, 10)
    assert len(_cached(cache)) == 1                              # ... and its ranges are dropped with it


def test_a_damaged_cache_entry_is_dropped_and_read_again_from_the_remote_file(memory_location, tmp_path):
    cache = tmp_path / "cache"
    storage = CheckpointStorage(memory_location, cache_dir=cache)
    md = write_checkpoint(storage, 1)
    read_all(storage, md)
    entries = _cached(cache)
    damaged, truncated = sorted(entries)
    flipped = bytearray(entries[damaged])
    flipped[len(flipped) // 2] ^= 0x01
    (cache / damaged).write_bytes(bytes(flipped))
    (cache / truncated).write_bytes(entries[truncated][:-3])
    assert read_all(storage, md) == expected_state(1)
    assert _cached(cache) == entries                             # both replaced by what the remote file holds


def test_the_cache_keeps_at_most_its_limit_dropping_the_least_recently_used(memory_location, tmp_path):
    cache = tmp_path / "cache"
    storage = CheckpointStorage(memory_location, cache_dir=cache, cache_max_bytes=2500)
    files = []
    for name in "abcd":
        rel = storage.new_shared_file(1, f"keyed-{name}")
        with storage.open_write(rel) as f:
            f.write(name.encode() * (3000 if name == "d" else 1000))
        files.append(rel)
    a, b, c, d = files

    def entry(rel: str) -> str:
        (name,) = [n for n in _cached(cache) if n.startswith(_ReadCache.key(storage.url(rel)))]
        return name

    assert storage.read_bytes(a, 0, 1000) == b"a" * 1000
    assert storage.read_bytes(b, 0, 1000) == b"b" * 1000
    os.utime(cache / entry(a), (1, 1))                           # a read long ago, b a bit later
    os.utime(cache / entry(b), (2, 2))
    assert storage.read_bytes(a, 10, 20) == b"a" * 10            # a hit: a is recently used again
    assert storage.read_bytes(c, 0, 1000) == b"c" * 1000         # over the limit: b, least recently used, goes
    assert len(_cached(cache)) == 2 and entry(a) and entry(c)
    assert storage.read_bytes(d, 0, 3000) == b"d" * 3000         # larger than the whole cache: not kept
    assert sum(map(len, _cached(cache).values())) == 2000
    stale, fresh = cache / ".tmp-left-by-a-killed-writer", cache / ".tmp-being-written"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (1, 1))
    storage.read_bytes(b, 0, 1000)                               # a publish also removes stale temporary files
    assert not stale.exists() and fresh.exists()
    assert sum(map(len, _cached(cache).values())) <= 2500


def test_retention_drops_the_cached_ranges_of_the_files_it_deletes(memory_location, tmp_path):
    cache = tmp_path / "cache"
    storage = CheckpointStorage(memory_location, retain=1, cache_dir=cache)
    read_all(storage, write_checkpoint(storage, 1))
    assert len(_cached(cache)) == 2
    md2 = write_checkpoint(storage, 2)                           # deletes checkpoint 1's keyed files
    assert _cached(cache) == {}
    read_all(storage, md2)
    assert len(_cached(cache)) == 2


def test_local_locations_cache_nothing_and_the_cache_pickles(tmp_path, memory_location):
    local = CheckpointStorage(tmp_path / "checkpoints", cache_dir=tmp_path / "cache")
    read_all(local, write_checkpoint(local, 1))
    assert not (tmp_path / "cache").exists()
    remote = CheckpointStorage(memory_location, cache_dir=tmp_path / "cache", cache_max_bytes=12345)
    clone = pickle.loads(pickle.dumps(remote))
    assert (clone.cache_dir, clone.cache_max_bytes) == (str(tmp_path / "cache"), 12345)
    assert "cache_dir=" in repr(clone)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="cache_max_bytes must be an int >= 0"):
            CheckpointStorage(memory_location, cache_dir=tmp_path / "cache", cache_max_bytes=bad)


@settings(max_examples=40, deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 300)), max_size=30),
       limit=st.integers(0, 900))
def test_cached_reads_return_what_the_remote_file_holds_within_the_limit(reads, limit):
    location = f"memory://kg-test-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory() as cache:
        storage = CheckpointStorage(location, cache_dir=cache, cache_max_bytes=limit)
        contents = [bytes(range(i, 256)) + bytes(range(0, i)) for i in (0, 7, 99)]
        files = []
        for i, content in enumerate(contents):
            files.append(storage.new_shared_file(1, f"keyed-{i}"))
            with storage.open_write(files[-1]) as f:
                f.write(content)
        try:
            for i, a, b in reads:
                start, end = min(a, b), max(a, b)
                assert storage.read_bytes(files[i], start, end) == contents[i][start:end]
                entries = {n: open(os.path.join(cache, n), "rb").read() for n in os.listdir(cache)
                           if n != SECRET_NAME}
                assert sum(map(len, entries.values())) <= limit
                assert all(_entry_is_sound(cache, n, c) for n, c in entries.items())
        finally:
            fs, root = fsspec.core.url_to_fs(location)
            fs.rm(root, recursive=True)


# -- compare-and-swap commits (issue 22) ---------------------------------------------------------------------------

def test_a_commit_planned_from_a_checkpoint_that_is_no_longer_the_newest_is_refused(storage_factory):
    """Two drivers plan from checkpoint 1 with ids 2 and 3; 2 commits first. Before issue 22 checkpoint 3 committed
    too, built on checkpoint 1, and hid checkpoint 2's batch."""
    storage = storage_factory()
    write_checkpoint(storage, 1)
    two = write_checkpoint(storage_factory(), 2, commit=False)
    three = write_checkpoint(storage_factory(), 3, commit=False)
    three.job_id = "job-3"
    storage_factory().commit(two, planned_from=1)
    with pytest.raises(ConcurrentCommitError, match=r"checkpoint 3 cannot be committed: it was planned from "
                                                    r"checkpoint 1, but checkpoint 2, committed by another writer "
                                                    r"\(job 'job-1'.*is the newest complete one.*\(job 'job-3'\) was "
                                                    r"published and its 3 files were removed") as refused:
        storage.commit(three, planned_from=1)
    assert (refused.value.planned_from, refused.value.newest) == (1, 2)
    fresh = storage_factory()
    assert fresh.checkpoint_ids() == [1, 2]
    for f in three.files():
        with pytest.raises(FileNotFoundError):
            fresh.file_size(f)
    assert read_all(fresh, fresh.load(2)) == expected_state(2)
    fresh.commit(write_checkpoint(fresh, 3, commit=False), planned_from=2)   # planned again: committed
    assert fresh.checkpoint_ids() == [1, 2, 3]


def test_a_first_commit_is_refused_once_another_first_checkpoint_exists(storage_factory):
    storage = storage_factory()
    late = write_checkpoint(storage, 2, commit=False)
    write_checkpoint(storage_factory(), 1)
    with pytest.raises(ConcurrentCommitError, match="planned from no checkpoint .the job's first., but checkpoint 1"):
        storage.commit(late, planned_from=None)
    assert storage.checkpoint_ids() == [1]


def test_a_first_commit_whose_staged_claim_the_winner_pruned_is_refused_as_the_lost_race(tmp_path):
    """Two drivers commit a first checkpoint. The winner commits and prunes between the loser's staging of its claim
    and the claim's link: retention takes the loser's staged ``first`` claim for a dead writer's temporary. The
    loser is refused as the lost race it is, never with a FileNotFoundError of its own temporary file (a CI run's
    fault campaign saw that one)."""
    location = str(tmp_path / "chk")
    loser, winner = CheckpointStorage(location), CheckpointStorage(location)
    late = write_checkpoint(loser, 1, commit=False)
    early = write_checkpoint(winner, 1, commit=False)
    link = loser._fs.link_exclusive

    def winner_commits_first(staged, rel):
        if rel.startswith("_commits/"):
            winner.commit(early, planned_from=None)
            assert not loser._fs.exists(staged)   # pruned as a dead writer's temporary
        link(staged, rel)

    loser._fs.link_exclusive = winner_commits_first
    with pytest.raises(ConcurrentCommitError, match="checkpoint 1 is already complete .*committed by another writer"):
        loser.commit(late, planned_from=None)
    assert CheckpointStorage(location).checkpoint_ids() == [1]
    assert read_all(winner, CheckpointStorage(location).load(1)) == expected_state(1)
    assert not [n for n in os.listdir(os.path.join(location, "_commits")) if "inprogress" in n]


def _claim_then_die(storage: CheckpointStorage, metadata: CheckpointMetadata, monkeypatch) -> None:
    """Commit ``metadata`` (planned from the checkpoint before it) as a driver killed right after its claim."""
    def dies(self, base, data, *staged, **options):
        raise KeyboardInterrupt("the driver was killed")

    monkeypatch.setattr(CheckpointStorage, "_publish", dies)
    with pytest.raises(KeyboardInterrupt):
        storage.commit(metadata, planned_from=metadata.checkpoint_id - 1)
    monkeypatch.undo()


def test_a_commit_whose_writer_stops_after_its_claim_is_completed_by_the_next(storage_factory, monkeypatch):
    """The claim holds the whole _metadata: a writer that dies between claiming and publishing leaves a checkpoint
    that the next driver publishes (begin_batch does) rather than one that blocks the location, and a commit
    planned from the checkpoint before it is refused naming it."""
    storage = storage_factory()
    write_checkpoint(storage, 1)
    two = write_checkpoint(storage, 2, commit=False)
    _claim_then_die(storage, two, monkeypatch)
    other = storage_factory()
    assert other.checkpoint_ids() == [1]   # not visible: claimed, never published
    late = write_checkpoint(other, 3, commit=False)
    with pytest.raises(ConcurrentCommitError, match="planned from checkpoint 1, but checkpoint 2") as refused:
        other.commit(late, planned_from=1)
    assert refused.value.newest == 2
    assert other.checkpoint_ids() == [1, 2]    # completed by the refused commit
    assert other.load(2) == two
    assert other.finish_interrupted_commit() is None


class _PowerLossTrace:
    """What a power loss may keep of a local location, traced from the storage's own calls: a name in a directory
    (a file's, a directory's, a hard link's) survives only once that directory is fsync'd after the name was made,
    and a file's bytes only once the file is fsync'd (POSIX promises no more; ext4 often keeps more). Records every
    ``os.open(O_CREAT)``, ``open(..., "wb")``, ``os.mkdir``, ``os.link`` and ``os.fsync`` under ``root``, and at
    each ``os.link`` checks ``check(src, dst)``."""

    def __init__(self, root: str, monkeypatch, check) -> None:
        import keygroups.checkpoint.storage as storage_module

        self.root = os.path.realpath(root)
        self.clock = 0
        self.made: dict[str, int] = {}   # path -> when its name was made
        self.synced: dict[str, list[int]] = {}   # path -> when it was fsync'd
        real_open, real_mkdir, real_link, real_fsync = os.open, os.mkdir, os.link, os.fsync

        def made(path) -> None:
            self.clock += 1
            self.made[os.path.realpath(path)] = self.clock

        def traced_open(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and not os.path.exists(path):
                made(path)
            return real_open(path, flags, *args, **kwargs)

        def traced_builtin_open(path, mode="r", *args, **kwargs):
            if "w" in mode and not os.path.exists(path):
                made(path)
            return open(path, mode, *args, **kwargs)

        def traced_mkdir(path, *args, **kwargs):
            real_mkdir(path, *args, **kwargs)
            made(path)

        def traced_link(src, dst, *args, **kwargs):
            check(os.path.realpath(src), os.path.realpath(dst))
            real_link(src, dst, *args, **kwargs)
            made(dst)

        def traced_fsync(fd):
            real_fsync(fd)
            self.clock += 1
            self.synced.setdefault(os.readlink(f"/proc/self/fd/{fd}"), []).append(self.clock)

        monkeypatch.setattr(os, "open", traced_open)
        monkeypatch.setattr(os, "mkdir", traced_mkdir)
        monkeypatch.setattr(os, "link", traced_link)
        monkeypatch.setattr(os, "fsync", traced_fsync)
        monkeypatch.setattr(storage_module, "open", traced_builtin_open, raising=False)

    def _synced_after(self, path: str, since: int) -> bool:
        return any(t > since for t in self.synced.get(path, ()))

    def name_kept(self, path: str) -> bool:
        """Whether ``path`` and every directory above it, up to the root, survive a power loss now."""
        while path != self.root:
            made = self.made.get(path)
            if made is not None and not self._synced_after(os.path.dirname(path), made):
                return False
            path = os.path.dirname(path)
        return True

    def bytes_kept(self, path: str) -> bool:
        return self._synced_after(path, self.made.get(path, 0))


def test_a_local_commit_is_durable_in_the_order_a_power_loss_needs(tmp_path, monkeypatch):
    """The commit's fsyncs, checked against what a power loss may keep (:class:`_PowerLossTrace`): when a claim is
    linked (the commit's durable record), the claimed bytes, every file the checkpoint names (bytes and name) and the
    previous checkpoint's ``_metadata`` are durable; when ``_metadata`` is linked, its claim is. So whatever a crash
    keeps, a claim or ``_metadata`` never names a file it lost, a ``_metadata`` never survives its claim (the
    compare-and-swap's record), and only the newest ``_metadata`` can be lost, which its claim restores (next
    test). Fails if any of the fsyncs before the claim, or the claim's, is left out or comes after its link."""
    location = tmp_path / "checkpoints"
    storage = CheckpointStorage(str(location))
    committing: list[CheckpointMetadata] = []
    checked: list[str] = []

    def check(src: str, dst: str) -> None:
        md = committing[-1]
        rel = os.path.relpath(dst, loc)
        assert trace.bytes_kept(src), f"{rel} links bytes not yet durable"
        if rel.startswith("_commits/"):
            for f in md.files():
                full = os.path.join(loc, f)
                assert trace.bytes_kept(full) and trace.name_kept(full), f"claim {rel} names {f}, not yet durable"
            if md.checkpoint_id > 1:
                before = os.path.join(loc, f"chk-{md.checkpoint_id - 1}", "_metadata")
                assert trace.name_kept(before), f"claim {rel} made while the previous _metadata is not durable"
            checked.append("claim")
        elif rel == f"chk-{md.checkpoint_id}/_metadata":
            claim = "first" if md.checkpoint_id == 1 else f"after-{md.checkpoint_id - 1}"
            assert trace.name_kept(os.path.join(loc, "_commits", claim)), "_metadata linked before its durable claim"
            checked.append("metadata")

    location.mkdir()   # the user's: everything below it is the storage's to make durable
    loc = os.path.realpath(location)
    trace = _PowerLossTrace(loc, monkeypatch, check)
    for cid in (1, 2, 3):
        md = write_checkpoint(storage, cid, commit=False)
        committing.append(md)
        storage.commit(md, planned_from=cid - 1 if cid > 1 else None)
    assert checked == ["claim", "metadata"] * 3
    assert storage.checkpoint_ids() == [1, 2, 3]


def test_a_committed_checkpoint_whose_metadata_link_a_crash_lost_is_restored_from_its_claim(tmp_path):
    """The one link a commit leaves to the next commit's fsyncs is the newest ``_metadata``'s: a crash that loses it
    keeps its claim (durable before it), and the next driver publishes the checkpoint again, state and all."""
    location = str(tmp_path / "checkpoints")
    storage = CheckpointStorage(location)
    write_checkpoint(storage, 1)
    write_checkpoint(storage, 2)
    os.remove(os.path.join(location, "chk-2", "_metadata"))   # what the power loss took
    restarted = CheckpointStorage(location)
    assert restarted.checkpoint_ids() == [1]
    assert restarted.finish_interrupted_commit() == 2
    assert restarted.checkpoint_ids() == [1, 2] and read_all(restarted, restarted.load(2)) == expected_state(2)


def test_finish_interrupted_commit_publishes_a_claimed_checkpoint(storage_factory, monkeypatch):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    two = write_checkpoint(storage, 2, commit=False)
    _claim_then_die(storage, two, monkeypatch)
    fresh = storage_factory()
    assert fresh.checkpoint_ids() == [1]
    assert fresh.finish_interrupted_commit() == 2
    assert fresh.checkpoint_ids() == [1, 2] and read_all(fresh, fresh.load(2)) == expected_state(2)


def test_a_claim_whose_files_are_gone_is_named_with_the_way_out(storage_factory, monkeypatch):
    storage = storage_factory()
    write_checkpoint(storage, 1)
    two = write_checkpoint(storage, 2, commit=False)
    _claim_then_die(storage, two, monkeypatch)
    storage._fs.remove(two.keyed_handles[0].file)   # deleted by hand
    with pytest.raises(CorruptSnapshotError, match=r"checkpoint 2 was claimed as the successor of checkpoint 1 .* "
                                                   r"never published, and it cannot be any more.*Remove .*"
                                                   r"_commits/after-1 to let the job continue"):
        storage_factory().finish_interrupted_commit()
    storage._fs.remove("_commits/after-1")
    fresh = storage_factory()
    fresh.commit(write_checkpoint(fresh, 3, commit=False), planned_from=1)
    assert fresh.checkpoint_ids() == [1, 3]


def test_retrying_the_same_commit_after_its_claim_publishes_it(storage_factory, monkeypatch):
    """A commit whose publish failed (a network error after the claim) can be retried with the same metadata."""
    storage = storage_factory()
    write_checkpoint(storage, 1)
    two = write_checkpoint(storage, 2, commit=False)

    def fails(self, base, data, *staged, **options):
        raise OSError("connection reset")

    monkeypatch.setattr(CheckpointStorage, "_publish", fails)
    with pytest.raises(OSError, match="connection reset"):
        storage.commit(two, planned_from=1)
    monkeypatch.undo()
    storage.commit(two, planned_from=1)
    assert storage.checkpoint_ids() == [1, 2]


def test_claims_of_checkpoints_older_than_the_retained_ones_are_pruned(storage_factory):
    storage = storage_factory(retain=2)
    for cid in range(1, 6):
        write_checkpoint(storage, cid)
    assert storage.checkpoint_ids() == [4, 5]
    assert storage._fs.listdir("_commits") == ["after-4"]   # the claim of 5, the newest: none of 5 yet
