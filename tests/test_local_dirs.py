"""Local directories that only their user may change (keygroups._local_dirs): the read cache and the warm RocksDB
databases are created private (mode 0700), refused with a warning when another user owns them or others may write
them, and what they hold is believed only under an HMAC of this user's secret. A tampered cache entry or kept
database never changes a restored value; a broken cache directory costs a remote read, never the restore.

"Another user" is simulated on the real filesystem: the tests run as root, so they chown directories and files to
another uid and make them group- or world-writable."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import uuid

import fsspec
import pytest
import rocksdict
from crc32c import crc32c

from keygroups import KeyGroupRange
from keygroups._local_dirs import SECRET_NAME, UnsafeDirectoryError, check_private, directory_secret, private_directory
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.subtask_state import read_cache_directory, warm_directory
from keygroups.serializers import Int64Serializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor

MAXP = 8
KEYS = range(40)
OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs chown (root)")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def warned(caplog, text: str) -> bool:
    return any(r.name.startswith("keygroups") and r.levelno == logging.WARNING and text in r.getMessage()
               for r in caplog.records)


# ---- private directories ------------------------------------------------------------------------------------------
def test_a_new_directory_is_created_private(tmp_path):
    path = tmp_path / "base" / "cache"
    assert private_directory(path, what="read cache") == str(path)
    assert mode(path) == 0o700 and os.stat(path).st_uid == os.geteuid()


def test_an_own_directory_readable_by_others_is_made_private(tmp_path):
    path = tmp_path / "mine"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    assert private_directory(path, what="read cache") == str(path)
    assert mode(path) == 0o700


@pytest.mark.parametrize("hostile", [
    pytest.param("other owner", marks=needs_root), "world-writable", "group-writable", "a file", "a symlink"])
def test_a_directory_someone_else_could_change_is_refused_for_a_private_one(tmp_path, caplog, hostile):
    path = tmp_path / f"shared-{hostile.replace(' ', '-')}"
    if hostile == "a file":
        path.write_bytes(b"not a directory")
    elif hostile == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
        os.chmod(path, {"other owner": 0o755, "world-writable": 0o777, "group-writable": 0o770}[hostile])
        if hostile == "other owner":
            os.chown(path, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        chosen = private_directory(path, what="read cache")
    assert chosen != str(path) and os.path.isdir(chosen)
    assert mode(chosen) == 0o700 and os.stat(chosen).st_uid == os.geteuid()
    assert warned(caplog, str(path))
    assert private_directory(path, what="read cache") == chosen   # one decision (and one warning) per process
    with pytest.raises(UnsafeDirectoryError):
        check_private(str(path))


@needs_root
def test_the_default_cache_and_warm_directories_are_per_user_and_refused_when_planted(tmp_path, caplog):
    base = tmp_path / "tmp"
    cache = read_cache_directory(str(base))
    assert cache == str(base / f"keygroups-cache-{os.geteuid()}") and mode(cache) == 0o700
    warm = warm_directory(str(base), "s3://bucket/chk", "job")
    assert warm.startswith(str(base / f"keygroups-warm-{os.geteuid()}") + os.sep)
    assert mode(base / f"keygroups-warm-{os.geteuid()}") == 0o700
    # another user got there first, under another local dir: created before us, world-writable
    planted = tmp_path / "planted"
    for name in (f"keygroups-cache-{os.geteuid()}", f"keygroups-warm-{os.geteuid()}"):
        (planted / name).mkdir(parents=True)
        os.chmod(planted / name, 0o777)
        os.chown(planted / name, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        cache = read_cache_directory(str(planted))
        warm = warm_directory(str(planted), "s3://bucket/chk", "job")
    assert not cache.startswith(str(planted)) and not warm.startswith(str(planted))
    assert warned(caplog, "read cache") and warned(caplog, "warm state")


def test_the_directory_secret_is_private_and_shared_by_its_users(tmp_path):
    d = private_directory(tmp_path / "d", what="read cache")
    secret = directory_secret(d)
    assert directory_secret(d) == secret and len(secret) == 32
    assert mode(os.path.join(d, SECRET_NAME)) == 0o600
    os.chmod(os.path.join(d, SECRET_NAME), 0o666)
    with pytest.raises(UnsafeDirectoryError, match="writable by group or others"):
        directory_secret(d)


# ---- the read cache -----------------------------------------------------------------------------------------------
def _write_state(storage: CheckpointStorage, value_of) -> CheckpointMetadata:
    backend = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    state = backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in KEYS:
        backend.set_current_key(k)
        state.update(value_of(k))
    handle = backend.snapshot(1, storage).result()
    backend.dispose()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[handle], operator_handles=[])
    storage.commit(md)
    return storage.load(1)


def _restored_values(storage: CheckpointStorage, md: CheckpointMetadata) -> dict[int, int]:
    backend = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    backend.restore(storage, md)
    state = backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
    out = {}
    for k in KEYS:
        backend.set_current_key(k)
        out[k] = state.value()
    backend.dispose()
    return out


def _entries(cache) -> list[str]:
    return sorted(n for n in os.listdir(cache) if not n.startswith("."))


@pytest.fixture(params=["memory", "s3"])
def remote(request):
    """Two fresh remote locations (the job's and an attacker's) and their storage options: memory:// or the real
    S3 server."""
    if request.param == "memory":
        locations = [f"memory://kg-dirs-{uuid.uuid4().hex}" for _ in range(2)]
        options: dict = {}
    else:
        server = request.getfixturevalue("s3_server")
        locations, options = [server.url(), server.url()], server.storage_options
    yield locations, options
    for location in locations:
        fs, root = fsspec.core.url_to_fs(location, **options)
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_a_rewritten_cache_entry_never_changes_a_restored_value(remote, tmp_path, caplog):
    """A local user rewrites every cache entry with bytes of a real keyed file (valid block checksums, every value
    999999), under the entry's own name and under names carrying the new content's CRC32C: the restore still
    returns what the remote checkpoint holds."""
    (location, attacker_location), options = remote
    cache = tmp_path / "cache"
    storage = CheckpointStorage(location, storage_options=options, cache_dir=cache)
    md = _write_state(storage, lambda k: k * 10)
    truth = {k: k * 10 for k in KEYS}
    assert _restored_values(storage, md) == truth
    names = _entries(cache)
    assert names   # the restore's ranged reads were kept
    forged = CheckpointStorage(attacker_location, storage_options=options)
    forged_md = _write_state(forged, lambda k: 999999)
    (victim,), (attacker,) = md.keyed_handles, forged_md.keyed_handles
    assert attacker.offsets == victim.offsets   # same layout: the forged bytes parse where the true ones did
    for name in names:
        key, lo, hi, _ = name.split("-")
        fake = forged.read_bytes(attacker.file, int(lo), int(hi))
        (cache / name).write_bytes(fake)
        (cache / f"{key}-{lo}-{hi}-{crc32c(fake):08x}").write_bytes(fake)
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        again = CheckpointStorage(location, storage_options=options, cache_dir=cache)
        assert _restored_values(again, md) == truth
    assert warned(caplog, "fails its check")
    # the damaged entries were replaced by what the remote file holds: the next restore is served from the cache
    assert _restored_values(CheckpointStorage(location, storage_options=options, cache_dir=cache), md) == truth


@needs_root
def test_a_cache_entry_of_another_user_is_not_read(tmp_path):
    location = f"memory://kg-dirs-{uuid.uuid4().hex}"
    cache = tmp_path / "cache"
    storage = CheckpointStorage(location, cache_dir=cache)
    md = _write_state(storage, lambda k: k + 1)
    assert _restored_values(storage, md) == {k: k + 1 for k in KEYS}
    for name in _entries(cache):
        os.chown(cache / name, OTHER_UID, OTHER_UID)
    fs, path = fsspec.core.url_to_fs(storage.url(md.keyed_handles[0].file))
    fs.rm_file(path)   # only the cache could serve it now: an entry that is not ours must not
    with pytest.raises(CorruptSnapshotError, match="missing"):
        _restored_values(CheckpointStorage(location, cache_dir=cache), md)


@pytest.mark.parametrize("broken", ["a file", "world-writable", pytest.param("other owner", marks=needs_root)])
def test_a_broken_cache_directory_costs_a_remote_read_never_the_restore(tmp_path, caplog, broken):
    location = f"memory://kg-dirs-{uuid.uuid4().hex}"
    cache = tmp_path / "cache"
    if broken == "a file":
        cache.write_bytes(b"in the way")
    else:
        cache.mkdir()
        os.chmod(cache, 0o777 if broken == "world-writable" else 0o700)
        if broken == "other owner":
            os.chown(cache, OTHER_UID, OTHER_UID)
    storage = CheckpointStorage(location, cache_dir=cache)
    md = _write_state(storage, lambda k: -k)
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        assert _restored_values(storage, md) == {k: -k for k in KEYS}
    assert warned(caplog, f"not using {cache}")
    if broken != "a file":
        assert _entries(cache) == []


# ---- warm RocksDB databases ---------------------------------------------------------------------------------------
def _rocks_run(storage, warm, md=None, value_of=None, checkpoint_id=1):
    """A RocksDB backend in ``warm``: restored from ``md`` if given, written with ``value_of`` if given and then
    snapshotted (and committed) as ``checkpoint_id``; returns (whether it reused the kept database, its values,
    the new metadata)."""
    backend = RocksDBKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), warm_dir=warm)
    if md is not None:
        backend.restore(storage, md)
    state = backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
    reused = backend.warm
    values = {}
    for k in KEYS:
        backend.set_current_key(k)
        values[k] = state.value()
        if value_of is not None:
            state.update(value_of(k))
    new_md = None
    if value_of is not None:
        handle = backend.snapshot(checkpoint_id, storage).result()
        # as the driver does: a backend restored from ``md`` snapshots deltas on top of ``md``'s blocks, so the
        # new checkpoint carries forward the files of their chains (commit refuses a delta without its base)
        handles = carry_forward(md, [handle]) if md is not None else [handle]
        new_md = CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="j", timestamp_ms=0, max_parallelism=MAXP,
                                    parallelism=1, keyed_handles=handles, operator_handles=[])
        storage.commit(new_md, planned_from=md.checkpoint_id if md is not None else None)
        new_md = storage.load(checkpoint_id)
    backend.dispose()
    return reused, values, new_md


def _kept_db(warm) -> str:
    return os.path.join(warm, f"0-{MAXP - 1}", "db")


def _rewrite_kept_values(warm, value: int) -> None:
    """What a local user with access would do: open the kept database and set every stored value."""
    opts = rocksdict.Options(raw_mode=True)
    db = rocksdict.Rdict(_kept_db(warm), opts)
    for k in list(db.keys()):
        db[k] = value.to_bytes(8, "little", signed=True)
    db.flush()
    db.close()


@pytest.fixture(params=["local", "s3"])
def checkpoints(request, tmp_path):
    """Checkpoint storage of a warm-database test: a local directory, or a fresh prefix on the real S3 server."""
    if request.param == "local":
        yield CheckpointStorage(str(tmp_path / "chk"))
        return
    server = request.getfixturevalue("s3_server")
    location = server.url()
    yield CheckpointStorage(location, storage_options=server.storage_options, cache_dir=tmp_path / "cache")
    fs, root = fsspec.core.url_to_fs(location, **server.storage_options)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_a_kept_database_is_reused_when_nothing_touched_it(checkpoints, tmp_path):
    storage, warm = checkpoints, str(tmp_path / "warm")
    _, _, md = _rocks_run(storage, warm, value_of=lambda k: k * 3)
    reused, values, _ = _rocks_run(storage, warm, md)
    assert reused and values == {k: k * 3 for k in KEYS}


@pytest.mark.parametrize("tamper", ["rewrite values", "marker's checkpoint", "marker's seal", "unsealed marker",
                                    "secret", pytest.param("a file of another user", marks=needs_root)])
def test_a_tampered_kept_database_is_restored_never_reused(checkpoints, tmp_path, caplog, tamper):
    storage, warm = checkpoints, str(tmp_path / "warm")
    _, _, md = _rocks_run(storage, warm, value_of=lambda k: k * 3)
    truth = {k: k * 3 for k in KEYS}
    marker_path = os.path.join(warm, f"0-{MAXP - 1}", "marker.json")
    with open(marker_path) as f:
        marker = json.load(f)
    assert "mac" in marker and marker["files"]   # sealed when the database closed
    if tamper == "rewrite values":
        _rewrite_kept_values(warm, 999999)
    elif tamper == "marker's checkpoint":   # an old database passed off as the current checkpoint's
        marker["handle_file"] = "shared/elsewhere"
    elif tamper == "marker's seal":
        _rewrite_kept_values(warm, 999999)
        marker["files"] = {n: [os.stat(os.path.join(_kept_db(warm), n)).st_size, 0, 0]
                           for n in os.listdir(_kept_db(warm))}
    elif tamper == "unsealed marker":   # as a backend that never closed its database leaves it
        _rewrite_kept_values(warm, 999999)
        del marker["mac"], marker["files"]
    elif tamper == "secret":
        _rewrite_kept_values(warm, 999999)
        with open(os.path.join(warm, SECRET_NAME), "wb") as f:
            f.write(os.urandom(32))
    else:
        some = sorted(os.listdir(_kept_db(warm)))[0]
        os.chown(os.path.join(_kept_db(warm), some), OTHER_UID, OTHER_UID)
    if tamper != "rewrite values" and tamper != "a file of another user":
        with open(marker_path, "w") as f:
            json.dump(marker, f)
    reused, values, md2 = _rocks_run(storage, warm, md, value_of=lambda k: k * 3, checkpoint_id=2)
    assert not reused and values == truth
    # restored, snapshotted, kept and sealed again: the next batch reuses it
    reused, values, _ = _rocks_run(storage, warm, md2)
    assert reused and values == truth


def test_a_world_writable_warm_directory_is_not_used(tmp_path, caplog):
    storage, warm = CheckpointStorage(str(tmp_path / "chk")), tmp_path / "warm"
    warm.mkdir()
    os.chmod(warm, 0o777)
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        _, _, md = _rocks_run(storage, str(warm), value_of=lambda k: k)
    assert warned(caplog, "warm state") and os.listdir(warm) == []
    reused, values, _ = _rocks_run(storage, str(warm), md)
    assert values == {k: k for k in KEYS}


@pytest.mark.parametrize("obstacle", ["range directory is a file", "lock file is a directory"])
def test_a_broken_warm_directory_costs_a_restore_never_the_batch(tmp_path, caplog, obstacle):
    storage, warm = CheckpointStorage(str(tmp_path / "chk")), tmp_path / "warm"
    _, _, md = _rocks_run(storage, str(warm), value_of=lambda k: k + 5)
    name = f"0-{MAXP - 1}"
    if obstacle == "range directory is a file":
        shutil.rmtree(warm / name)
        (warm / name).write_bytes(b"in the way")
    else:
        os.remove(warm / f"{name}.lock")
        (warm / f"{name}.lock").mkdir()
    with caplog.at_level(logging.WARNING, logger="keygroups"):
        reused, values, _ = _rocks_run(storage, str(warm), md)
    assert not reused and values == {k: k + 5 for k in KEYS}
    assert warned(caplog, "warm state")
