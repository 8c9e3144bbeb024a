"""Checkpoint storage: ``chk-<id>/`` directories, ``shared/`` keyed files, the commit protocol, retention and
savepoints.

Layout under ``location`` (a local path or any fsspec URL)::

    chk-17/_metadata               written last, atomically: a checkpoint without it does not exist
    chk-17/operator-0-<uuid>       files of one checkpoint alone, named by storage.new_file(17, "operator-0")
    shared/keyed-0-17-<uuid>       keyed state files, named by storage.new_shared_file(17, "keyed-0"): an incremental
                                   checkpoint references the files of earlier ones for what it did not change
    savepoints/<name>/_metadata    a self-contained full snapshot of one checkpoint, never pruned
    savepoints/<name>/keyed-0-<uuid>

Commit protocol: subtasks write their state files (``open_write``, fsync'd on close for local paths), report
handles; the driver calls :meth:`CheckpointStorage.commit`, which writes ``_metadata`` last and atomically:

* local filesystem: the bytes are written once, to a temporary file; the claim (below) and then ``_metadata`` are
  hard links of it, each created or refused as one step. Before the claim, one round of fsyncs (the first commits
  the filesystem's journal, the rest find little left) makes durable the temporary file, the directories of the new
  state files, the location's root (which names ``chk-<id>/``) and the previous checkpoint's directory; then the
  claim's directory is fsync'd, and ``_metadata`` is linked. The claim is the commit's durable record:
  ``_metadata``'s own link is made durable by the next commit's round of fsyncs, and until then a crash that loses
  it leaves the claim, which the next driver publishes again (:meth:`CheckpointStorage.finish_interrupted_commit`).
  A crash leaves either no ``_metadata`` (the checkpoint does not exist) or a complete one.
* object stores (S3, GCS, ...): one create-if-absent put for the claim, one for ``_metadata``; an object appears only
  once fully written, so ``_metadata`` is never seen half written; the durability is the store's. There is no
  directory fsync there.

A commit checks the files its own batch wrote (they exist, keyed ones with their handle's size; one listing per
directory on object stores); files of earlier checkpoints it carries forward were checked when those committed, and
a restore point a driver did not commit itself is checked whole when it is loaded (:meth:`CheckpointStorage.
check_complete`). Its chains are checked as :func:`~keygroups.checkpoint.planning.carry_forward` extends the restore
point's, so a commit costs what its batch changed, not the checkpoint's history.

Compare-and-swap: a commit names the checkpoint it was planned from (``planned_from``) and succeeds only if that
one is still the newest complete checkpoint; it first claims the place after it, ``_commits/after-<id>``
(``_commits/first`` for a location's first checkpoint), create-if-absent (a hard link locally, ``If-None-Match: *``
on object stores), so of two commits planned from one checkpoint exactly one publishes and the other gets a
ConcurrentCommitError naming both checkpoints. The claim holds the new ``_metadata``'s bytes: a writer that dies
between its claim and its publish leaves a claim the next commit (or ``begin_batch``) completes. Driver fences
(``_drivers/epoch-<n>``, :class:`~keygroups.runtime.driver.DriverFence`) say which driver may go on; the
compare-and-swap makes sure that no commit, fenced or not, hides another's batch.

Only after that does retention run: it keeps the newest ``retain`` complete checkpoints, deletes older ones, and
removes leftovers older than the newest complete checkpoint: directories without ``_metadata``, temporary files, and
files named by ``new_file`` that a retained checkpoint does not reference (e.g. from a retried task attempt). A file
is referenced when a keyed, operator or raw keyed handle names it or when it is one of the checkpoint's ``outputs``,
``inputs`` or ``late_outputs``. Directories of checkpoints newer than the one just committed are left alone: they may still be in
progress. In ``shared/`` (Flink's shared state registry, done without a registry file), a file is deleted when no
retained checkpoint references it and the checkpoint id in its name is at most the one just committed: files of
newer checkpoints, still being written, are never touched, and a shared file is only ever referenced by the
checkpoint that wrote it and by later ones. If a retained ``_metadata`` cannot be read, nothing in ``shared/`` is
deleted. Retention costs what changed since the last: one storage object reads each retained ``_metadata`` at most
once (none that its driver committed or loaded), counts the references to ``shared/`` as checkpoints enter and leave
retention, and cleans a checkpoint directory of orphans once, at the first retention after a newer checkpoint (a
retried task attempt's file that comes later still goes with its directory); per prune, one listing of the
checkpoints, of ``shared/`` and of ``_commits/``.

Remote locations: every listing and existence check asks the store (fsspec's listing cache is off), so a process
sees checkpoints and files that others wrote at its next call. A ``chk-<id>`` is a checkpoint directory only while
it holds an object: some stores (SeaweedFS; those with a hierarchical namespace) keep listing an emptied prefix.
With a ``cache_dir``, ranged reads of ``shared/`` files, immutable under their unique names, are kept on local disk
(:class:`_ReadCache`: in a directory private to this user, bounded, least recently used dropped first, safe for
processes sharing it, every entry checked against an HMAC under the directory's secret before use, and a range a
keyed read serves checked against the checksums its handle in ``_metadata`` names), so restoring the same key
groups again on one host sends no request for them.
``_metadata`` and every other file are always read from the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import io
import json
import logging
import mmap
import os
import posixpath
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Literal

from keygroups import _local_dirs
from keygroups._ranges import key_group_range
from keygroups.checkpoint.format import merged_key_groups, write_full_snapshot
from keygroups.checkpoint.metadata import (
    SHARED_DIR,
    CheckpointMetadata,
    check_relpath,
    decode_metadata,
    encode_metadata,
    is_shared_path,
)
from keygroups.checkpoint.planning import check_chains, describe_baseless, describe_breaks, plan_keyed_restore
from keygroups.errors import CheckpointNotFoundError, ConcurrentCommitError, CorruptDataError, CorruptSnapshotError

log = logging.getLogger(__name__)

METADATA_NAME = "_metadata"
SAVEPOINTS_DIR = "savepoints"
_TMP_MARKER = ".inprogress-"
DEFAULT_CACHE_MAX_BYTES = 4 << 30   # of ranges of remote keyed files kept in CheckpointStorage's cache_dir
_CHK_RE = re.compile(r"^chk-(0|[1-9][0-9]*)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_STATE_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*-[0-9a-f]{32}(\.[A-Za-z0-9_.-]+)?$")   # new_file's names
DRIVERS_DIR = "_drivers"
COMMITS_DIR = "_commits"   # commit claims: _commits/after-<id>, _commits/first (see CheckpointStorage.commit)
_CLAIM_RE = re.compile(r"^(?:first|after-(0|[1-9][0-9]*))$")
_EPOCH_RE = re.compile(r"^epoch-([0-9]{12})$")
_SHARED_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*-(0|[1-9][0-9]*)-[0-9a-f]{32}$")   # new_shared_file's


def _is_shared_file(relpath: str) -> bool:
    """Whether ``relpath`` is a keyed state file in ``shared/`` (named by ``new_shared_file``): written once,
    never changed under its name, so its bytes may be cached."""
    parent, name = posixpath.split(relpath)
    return parent == SHARED_DIR and _SHARED_FILE_RE.match(name) is not None


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > 200:
        raise ValueError(f"{what} must be 1-200 characters of letters, digits, '_', '.', '-' (not starting with '.' "
                         f"or '-'), got {name!r}")
    return name


def _check_id(checkpoint_id: Any) -> int:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
        raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
    return checkpoint_id


@contextlib.contextmanager
def _tmp_name(fs: _LocalFS | _FsspecFS, rel: str) -> Iterator[str]:
    """A fresh temporary name beside ``rel`` (retention knows it by ``_TMP_MARKER``), removed again if the block
    fails: how both filesystems write a file atomically (write the temporary, then move it onto ``rel``)."""
    parent, name = posixpath.split(rel)
    tmp = posixpath.join(parent, f"{name}{_TMP_MARKER}{uuid.uuid4().hex}")
    try:
        yield tmp
    except BaseException:
        fs.remove(tmp)
        raise


class _SyncOnClose(io.BufferedWriter):
    """A local file whose close() also fsyncs it, so state files are durable before ``_metadata`` names them."""

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()
                os.fsync(self.fileno())
            finally:
                super().close()


class _LocalFS:
    """The local filesystem under ``root``, with real fsync/rename atomicity."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._real_root: str | None = None   # the root's real path, resolved once (see path)

    def path(self, rel: str) -> str:
        """The local path of ``rel``; CorruptSnapshotError if a symlink inside the location (a ``chk-<id>`` linked
        elsewhere, say) would take a read or a write out of it. Only ``rel``'s own components are looked at (one
        ``lstat`` each, up to the first that does not exist): the root's real path is resolved once, and a path
        through no symlink below it stays inside it (a commit asks for some twenty paths)."""
        if not rel:
            return self.root
        parts = rel.split("/")
        full = os.path.join(self.root, *parts)
        inside = self._real_root
        if inside is None:
            inside = self._real_root = os.path.realpath(self.root)
        if not ("" in parts or "." in parts or ".." in parts or self._through_link(inside, parts)):
            return full
        real = os.path.realpath(full)
        if real != inside and not real.startswith(inside.rstrip(os.sep) + os.sep):
            raise CorruptSnapshotError(f"{full} resolves to {real}, outside the checkpoint location {self.root}: a "
                                       "symlink that leads out of the location is refused")
        return full

    @staticmethod
    def _through_link(real_root: str, parts: list[str]) -> bool:
        """False when no component of ``parts`` below ``real_root`` is a symlink (those after the first that does
        not exist cannot be); True otherwise (or when one cannot be looked at), for the full check."""
        at = real_root
        for part in parts:
            at = os.path.join(at, part)
            try:
                if stat.S_ISLNK(os.lstat(at).st_mode):
                    return True
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError:
                return True
        return False

    def url(self, rel: str) -> str:
        return self.path(rel)

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def open_write(self, rel: str) -> BinaryIO:
        fd = os.open(self.path(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return _SyncOnClose(io.FileIO(fd, "wb"))

    def read_bytes(self, rel: str, start: int | None, end: int | None) -> bytes:
        with open(self.path(rel), "rb") as f:
            # never ask for more than the file holds: read(n) allocates n bytes first, and a damaged handle may say
            # 2**62; the caller sees a short read and names the file, as object stores answer past the end
            size = os.fstat(f.fileno()).st_size
            begin = min(start or 0, size)
            stop = size if end is None else min(end, size)
            f.seek(begin)
            return f.read(max(0, stop - begin))

    def open_buffer(self, rel: str) -> Any:
        with open(self.path(rel), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def size(self, rel: str) -> int:
        return os.stat(self.path(rel)).st_size

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def names_holding_files(self, rel: str, prefix: str) -> list[str]:
        """The entries of ``rel`` starting with ``prefix``: empty directories too, which exist on a local
        filesystem (retention removes them)."""
        return [n for n in self.listdir(rel) if n.startswith(prefix)]

    def names_and_marked(self, prefix: str, marker: str) -> tuple[list[str], set[str]]:
        """The top-level names starting with ``prefix`` (:meth:`names_holding_files`) and those of them holding a
        file ``marker``."""
        names = self.names_holding_files("", prefix)
        return names, {n for n in names if os.path.exists(os.path.join(self.root, n, marker))}

    def isdir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def rmtree(self, rel: str) -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path(rel))

    def sync_dir(self, rel: str) -> None:
        fd = os.open(self.path(rel), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, rel: str, data: bytes) -> None:
        with _tmp_name(self, rel) as tmp:
            with open(self.path(tmp), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self.path(tmp), self.path(rel))
        self.sync_dir(posixpath.dirname(rel))

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Write ``rel`` atomically, only if it does not exist: FileExistsError otherwise. A hard link of the
        complete temporary file is created or fails as one step, so of two writers exactly one succeeds."""
        with self.staged(rel, data) as staged:
            self.link_exclusive(staged, rel)

    @contextlib.contextmanager
    def staged(self, near: str, data: bytes, *, sync: bool = True) -> Iterator[Any]:
        """``data`` written once under a temporary name beside ``near``, for :meth:`link_exclusive` to publish under
        one or more names (hard links of one file: the bytes are written once); removed after. ``sync=False``
        leaves its fsync to the caller (:meth:`sync_all`, beside other fsyncs)."""
        with _tmp_name(self, near) as tmp:
            with open(self.path(tmp), "wb") as f:
                f.write(data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            try:
                yield tmp
            finally:
                # gone already when a writer that committed meanwhile pruned it as a dead writer's temporary
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path(tmp))

    def link_exclusive(self, staged: Any, rel: str, *, durable: bool = True) -> None:
        """Publish the staged file as ``rel`` if ``rel`` does not exist (FileExistsError otherwise), durably unless
        ``durable=False`` (the caller has another record that recovers it: see :meth:`CheckpointStorage.commit`)."""
        os.link(self.path(staged), self.path(rel))
        if durable:
            self.sync_dir(posixpath.dirname(rel))

    def sync_all(self, files: Sequence[str], dirs: Sequence[str], optional_dirs: Sequence[str] = ()) -> None:
        """fsync ``files``, then directories ``dirs`` and ``optional_dirs`` (those that still exist): returns once
        all are durable; FileNotFoundError for a file or one of ``dirs`` that is gone. One after another, in this
        thread: on a journaling filesystem the first commits every change pending (the rest find little left to
        write), and threads of their own measured no faster on a shared machine, where each waits to be scheduled."""
        wanted = [(f, False) for f in files] + [(d, False) for d in dirs] + [(d, True) for d in optional_dirs]
        for rel, optional in wanted:
            try:
                fd = os.open(self.path(rel), os.O_RDONLY)
            except FileNotFoundError:
                if optional:
                    continue
                raise
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size of each of ``rels`` that exists (one stat each)."""
        out = {}
        for rel in rels:
            with contextlib.suppress(FileNotFoundError):
                out[rel] = os.stat(self.path(rel)).st_size
        return out

    def copy(self, src: str, dst: str) -> None:
        with open(self.path(src), "rb") as fin, self.open_write(dst) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)

    def move(self, src: str, dst: str) -> None:
        """``src`` renamed to ``dst``, replacing it, atomically (:meth:`sync_dir` makes the rename durable)."""
        os.replace(self.path(src), self.path(dst))


class _FsspecFS:
    """Any fsspec filesystem under ``root``. ``_metadata`` is written to a temporary name and moved into place."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self._find_takes_prefix = "prefix" in inspect.signature(fs.find).parameters   # s3fs, gcsfs

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def url(self, rel: str) -> str:
        return str(self.fs.unstrip_protocol(self.path(rel)))

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def open_write(self, rel: str) -> BinaryIO:
        return self.fs.open(self.path(rel), "wb")  # type: ignore[no-any-return]

    def read_bytes(self, rel: str, start: int | None, end: int | None) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel), start=start, end=end))

    def open_buffer(self, rel: str) -> Any:
        return bytes(self.fs.cat_file(self.path(rel)))

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def listdir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries} - {""})

    def names_holding_files(self, rel: str, prefix: str) -> list[str]:
        """Names under ``rel`` starting with ``prefix`` that hold at least one file, from one listing of the
        objects below (the store is asked for ``prefix`` only where the filesystem can). Object stores have no
        directories, yet SeaweedFS (like stores with a hierarchical namespace) keeps listing an emptied prefix for
        minutes: a pruned ``chk-<id>`` is gone here once its objects are."""
        path = self.path(rel)
        try:
            found = self.fs.find(path, prefix=prefix) if self._find_takes_prefix else self.fs.find(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = path.rstrip("/") + "/"
        names = {str(p)[len(base):].split("/", 1)[0] for p in found if str(p).startswith(base)}
        return sorted(n for n in names if n and n.startswith(prefix))

    def names_and_marked(self, prefix: str, marker: str) -> tuple[list[str], set[str]]:
        """The top-level names starting with ``prefix`` that hold a file, and those of them holding a file
        ``marker``, from one listing of the objects below (not a request per name)."""
        path = self.root
        try:
            found = self.fs.find(path, prefix=prefix) if self._find_takes_prefix else self.fs.find(path)
        except (FileNotFoundError, NotADirectoryError):
            return [], set()
        base = path.rstrip("/") + "/"
        names: set[str] = set()
        marked: set[str] = set()
        for p in map(str, found):
            if not p.startswith(base):
                continue
            parts = p[len(base):].split("/")
            if parts[0] and parts[0].startswith(prefix):
                names.add(parts[0])
                if len(parts) == 2 and parts[1] == marker:
                    marked.add(parts[0])
        return sorted(names), marked

    def isdir(self, rel: str) -> bool:
        return bool(self.fs.isdir(self.path(rel)))

    def rmtree(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)
        # the "directory" itself: SeaweedFS keeps listing an emptied prefix for minutes unless its key (with the
        # trailing slash) is deleted; elsewhere that key does not exist and the request changes nothing
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel) + "/")

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def sync_dir(self, rel: str) -> None:
        pass  # nothing to sync: object stores and fsspec filesystems have no directory entries to make durable

    def write_atomic(self, rel: str, data: bytes) -> None:
        with _tmp_name(self, rel) as tmp:
            self.fs.pipe_file(self.path(tmp), data)
            self.fs.mv(self.path(tmp), self.path(rel))

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Write ``rel`` in one request, only if it does not exist: FileExistsError otherwise. On object stores a
        conditional put (``If-None-Match: *``), which the store itself decides; s3fs reports the refusal as an
        OSError whose cause carries the code ``PreconditionFailed``."""
        try:
            self.fs.pipe_file(self.path(rel), data, mode="create")
        except FileExistsError:
            raise
        except OSError as e:
            if "PreconditionFailed" in repr(e.__cause__) or "PreconditionFailed" in str(e):
                raise FileExistsError(f"{self.url(rel)} already exists") from e
            raise

    @contextlib.contextmanager
    def staged(self, near: str, data: bytes, *, sync: bool = True) -> Iterator[Any]:
        """Nothing to stage on object stores: each :meth:`link_exclusive` puts the bytes (one request)."""
        yield data

    def link_exclusive(self, staged: Any, rel: str, *, durable: bool = True) -> None:
        self.write_exclusive(rel, staged)

    def sync_all(self, files: Sequence[str], dirs: Sequence[str], optional_dirs: Sequence[str] = ()) -> None:
        pass  # an object appears complete and durable once its put returns

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """The size of each of ``rels`` that exists: one listing per directory holding several of them (a request
        per file is what makes a commit slow on an object store), a request per file for up to three."""
        by_dir: dict[str, list[str]] = {}
        for rel in rels:
            by_dir.setdefault(posixpath.dirname(rel), []).append(rel)
        out: dict[str, int] = {}
        for parent, wanted in by_dir.items():
            if len(wanted) <= 3:
                for rel in wanted:
                    with contextlib.suppress(FileNotFoundError):
                        out[rel] = int(self.fs.size(self.path(rel)))
                continue
            try:
                listed = self.fs.find(self.path(parent), detail=True, maxdepth=1)
            except (FileNotFoundError, NotADirectoryError):
                listed = {}
            base = self.path(parent).rstrip("/") + "/"
            found = {str(k)[len(base):]: info for k, info in listed.items() if str(k).startswith(base)}
            for rel in wanted:
                info = found.get(posixpath.basename(rel))
                if info is not None and info.get("type", "file") == "file":
                    out[rel] = int(info["size"])
        return out

    def copy(self, src: str, dst: str) -> None:
        self.fs.cp_file(self.path(src), self.path(dst))

    def move(self, src: str, dst: str) -> None:
        """``src`` to ``dst``, replacing it: on an object store a copy then a delete (the new object appears only
        once complete, so a reader sees the old one, the new one, or none)."""
        self.fs.mv(self.path(src), self.path(dst))


#: What :func:`location_filesystem` returns: the local filesystem or an fsspec one, with the same methods.
LocationFilesystem = _LocalFS | _FsspecFS


class _ReadCache:
    """Byte ranges of immutable remote files kept in a local directory, so a second read of the same bytes on this
    host is served from disk. A file may be cached only if its content never changes under its name.

    The directory must be private to this user (``keygroups._local_dirs``: created with mode 0700; an existing one
    owned by someone else, writable by group or others, or not a directory disables the cache, with a warning). One
    cache file per range read, named ``<key>-<start>-<end>-<mac>``: ``key`` a hash of the file's URL, ``mac`` an
    HMAC-SHA256 of the key, the range and the content under the directory's secret (a random key in a 0600 file of the
    directory), so an entry that this user's keygroups did not write, or whose bytes changed, is never used, however
    well its own checksums agree. A read is served by any entry of the file whose range holds it, after the whole
    entry's HMAC is checked, and then the range against the caller's ``check`` (a keyed read checks the blocks against
    the checksums ``_metadata`` names for them): an entry that fails either, or is not a private file, is deleted and
    the read goes to the remote file, whose bytes are kept only once they pass ``check`` too. Entries are published
    atomically (written under a temporary name, then renamed), so processes sharing the directory see complete entries
    only; two that miss at once both fetch and publish the same bytes. After each publish the least recently used
    entries (by modification time, which a hit renews) are deleted until the total is at most ``max_bytes``; temporary
    files older than :attr:`STALE_TMP_S` (of a writer that died) go too. Every cache failure (a full disk, a racing
    deletion, a directory that is a file or
    unreadable) falls back to the remote read: the cache can cost a read, never fail one."""

    STALE_TMP_S = 600.0
    _TMP = ".tmp-"

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._secret: bytes | None = None
        self._disabled = False

    @staticmethod
    def key(url: str) -> str:
        return hashlib.sha256(url.encode()).hexdigest()[:40]

    def _ready(self) -> bytes | None:
        """The directory's secret once the directory is checked (created private if missing); None, with one
        warning, when it cannot be used."""
        if self._secret is None and not self._disabled:
            try:
                _local_dirs.make_private(self.directory)
                self._secret = _local_dirs.directory_secret(self.directory)
            except OSError as e:
                self._disabled = True
                log.warning("checkpoint cache: not using %s (%s); reading remote files directly", self.directory, e)
        return self._secret

    def _mac(self, secret: bytes, key: str, start: int, end: int, data: bytes) -> str:
        return _local_dirs.seal(secret, key.encode(), f"{start}-{end}".encode(), data)[:32]

    def _entries(self, key: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self.directory) as it:
                return [e for e in it if e.name.startswith(key + "-")]
        except OSError:
            return []

    def get(self, key: str, start: int, end: int, check: Callable[[bytes], None] | None = None) -> bytes | None:
        """Bytes ``[start, end)`` of the file ``key`` from the smallest entry holding them that passes its HMAC and
        ``check`` (which raises CorruptDataError on bytes it refuses), or None."""
        secret = self._ready()
        if secret is None:
            return None
        holding = []
        for entry in self._entries(key):
            parts = entry.name.split("-")
            if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit():
                lo, hi = int(parts[1]), int(parts[2])
                if lo <= start and end <= hi:
                    holding.append((hi - lo, lo, hi, parts[3], entry.path))
        for _, lo, hi, mac, path in sorted(holding):
            try:
                data = self._read_private(path)
            except OSError:   # evicted meanwhile by another process, or not a file of ours
                continue
            if len(data) != hi - lo or not hmac.compare_digest(self._mac(secret, key, lo, hi, data), mac):
                log.warning("checkpoint cache: %s fails its check (not written here, or changed since); dropped, "
                            "reading the remote file", path)
                self._remove(path)
                continue
            got = data if (lo, len(data)) == (start, end - start) else data[start - lo:end - lo]
            if check is not None:
                try:
                    check(got)
                except CorruptDataError as e:
                    log.warning("checkpoint cache: %s passes its HMAC but not the checkpoint's checksums (%s); "
                                "dropped, reading the remote file", path, e)
                    self._remove(path)
                    continue
            with contextlib.suppress(OSError):
                os.utime(path)   # recently used: evicted last
            return got
        return None

    @staticmethod
    def _read_private(path: str) -> bytes:
        """The content of cache entry ``path``, opened without following a symlink; UnsafeDirectoryError (after
        deleting it) when it is not a regular file of this user that only this user may write."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                _ReadCache._remove(path)
                raise _local_dirs.UnsafeDirectoryError(f"{path} is not a private file")
            return f.read()

    def put(self, key: str, start: int, data: bytes) -> None:
        """Publish ``data`` as bytes ``[start, start + len(data))`` of file ``key``, then evict down to the limit."""
        if len(data) > self.max_bytes:
            return
        secret = self._ready()
        if secret is None:
            return
        try:
            end = start + len(data)
            tmp = os.path.join(self.directory, f"{self._TMP}{uuid.uuid4().hex}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.directory,
                                             f"{key}-{start}-{end}-{self._mac(secret, key, start, end, data)}"))
            except BaseException:
                self._remove(tmp)
                raise
            self._evict()
        except OSError as e:
            log.warning("checkpoint cache: could not keep a range in %s: %s", self.directory, e)

    def drop(self, key: str) -> None:
        """Delete every entry of file ``key`` (the file is gone from the remote store)."""
        for entry in self._entries(key):
            self._remove(entry.path)

    def _evict(self) -> None:
        now = time.time()
        sized = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name == _local_dirs.SECRET_NAME:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.startswith(self._TMP):
                    if now - st.st_mtime > self.STALE_TMP_S:
                        self._remove(e.path)
                else:
                    sized.append((st.st_mtime, e.path, st.st_size))
        total = sum(size for _, _, size in sized)
        for _, path, size in sorted(sized):
            if total <= self.max_bytes:
                break
            self._remove(path)
            total -= size

    @staticmethod
    def _remove(path: str) -> None:
        with contextlib.suppress(OSError):
            os.remove(path)


@dataclasses.dataclass(frozen=True)
class _References:
    """The files a complete checkpoint references: in ``shared/`` (``shared``) and in its own directory
    (``own``, storage-relative), which retention keeps."""

    shared: frozenset[str]
    own: frozenset[str]

    @classmethod
    def of(cls, metadata: CheckpointMetadata) -> _References:
        files = [*metadata.files(), *metadata.runner_files()]
        shared = frozenset(f for f in files if is_shared_path(f))
        return cls(shared, frozenset(files) - shared)


class _RetentionState:
    """What retention learnt of a location across prunes by one storage object, so that each prune costs what
    changed since the last (the checkpoints committed and dropped), not every retained checkpoint: the files each
    retained checkpoint references (its ``_metadata`` read at most once), how many counted checkpoints reference
    each shared file, and the directories already cleaned of orphans."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.references: dict[int, _References] = {}
        self.counted: set[int] = set()
        self.shared_uses: dict[str, int] = {}
        self.cleaned: set[int] = set()


def _is_local(location: str) -> bool:
    return "://" not in location or location.startswith("file://")


def location_filesystem(location: str, storage_options: Mapping[str, Any] | None = None) -> LocationFilesystem:
    """The filesystem under a local path (``file://`` or none: real fsyncs and atomic renames) or an fsspec URL
    (``storage_options`` go to fsspec), with paths relative to it. Shared by checkpoint storage and file sinks.
    Listings are never served from fsspec's listing cache: a listing cached by this process would hide files that
    others write, and s3fs answers ``info()`` of a file missing from a cached listing with a zero-size "directory"."""
    if _is_local(location):
        root = location[len("file://"):] if location.startswith("file://") else location
        return _LocalFS(os.path.abspath(os.path.expanduser(root)))
    import fsspec  # type: ignore[import-untyped]

    fs, root = fsspec.core.url_to_fs(location, **{**(storage_options or {}), "use_listings_cache": False})
    return _FsspecFS(fs, root)


class CheckpointStorage:
    """Checkpoints and savepoints under ``location``: a local path or any fsspec URL (``s3://...``,
    ``memory://...``, ...); ``storage_options`` go to fsspec. ``retain`` is how many complete checkpoints to keep.

    ``cache_dir``: a local directory where ranged reads of keyed state files in ``shared/`` of a remote location are
    kept (they never change under their name), so reading the same key groups again on this host costs no request;
    at most ``cache_max_bytes`` are kept, least recently used dropped first. Several processes may share one
    directory. Ignored for a local ``location``; None (the default) caches nothing.

    Listings and existence checks on remote locations are never answered from fsspec's listing cache: a checkpoint
    another process committed is seen at the next call.

    All paths handed in and out (``new_file``, handles' ``file``) are relative to ``location``. The object pickles
    as its arguments, so it can be shipped to Spark executors."""

    def __init__(self, location: str | os.PathLike[str], *, retain: int = 3,
                 storage_options: dict[str, Any] | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES) -> None:
        if isinstance(retain, bool) or not isinstance(retain, int) or retain < 1:
            raise ValueError(f"retain must be an int >= 1 (how many complete checkpoints to keep), got {retain!r}")
        if isinstance(cache_max_bytes, bool) or not isinstance(cache_max_bytes, int) or cache_max_bytes < 0:
            raise ValueError(f"cache_max_bytes must be an int >= 0 (the most bytes cache_dir keeps), got "
                             f"{cache_max_bytes!r}")
        loc = os.fspath(location)
        if not isinstance(loc, str) or not loc:
            raise ValueError(f"location must be a non-empty path or URL, got {location!r}")
        self.retain = retain
        self.storage_options = dict(storage_options or {})
        self.cache_dir = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self.cache_max_bytes = cache_max_bytes
        self._fs: _LocalFS | _FsspecFS
        self._cache: _ReadCache | None = None
        self._retention = _RetentionState()
        self._fs = location_filesystem(loc, self.storage_options)
        if isinstance(self._fs, _LocalFS):
            self.location = self._fs.root
        else:
            self.location = loc.rstrip("/")
            if self.cache_dir is not None:
                self._cache = _ReadCache(self.cache_dir, cache_max_bytes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_storage, (self.location, self.retain, self.storage_options, self.cache_dir,
                                   self.cache_max_bytes))

    def __repr__(self) -> str:
        cache = f", cache_dir={self.cache_dir!r}" if self._cache is not None else ""
        return f"CheckpointStorage({self.location!r}, retain={self.retain}{cache})"

    # -- state files -------------------------------------------------------------------------------------------
    def new_file(self, checkpoint_id: int, prefix: str) -> str:
        """A fresh, unique state file name ``"chk-<id>/<prefix>-<uuid>"`` (relative to ``location``)."""
        cid = _check_id(checkpoint_id)
        _check_name(prefix, "prefix")
        return f"chk-{cid}/{prefix}-{uuid.uuid4().hex}"

    def new_shared_file(self, checkpoint_id: int, prefix: str) -> str:
        """A fresh, unique keyed state file name ``"shared/<prefix>-<id>-<uuid>"`` (relative to ``location``): it
        may be referenced by later checkpoints too, and retention deletes it once no retained checkpoint does."""
        cid = _check_id(checkpoint_id)
        _check_name(prefix, "prefix")
        return f"{SHARED_DIR}/{prefix}-{cid}-{uuid.uuid4().hex}"

    def open_write(self, relpath: str) -> BinaryIO:
        """A binary file open for writing at ``relpath``, creating its directory. On the local filesystem closing
        it also fsyncs it, so it is durable before a ``_metadata`` names it."""
        check_relpath(relpath)
        parent = posixpath.dirname(relpath)
        if parent:
            self._fs.makedirs(parent)
        return self._fs.open_write(relpath)

    def read_bytes(self, relpath: str, start: int | None = None, end: int | None = None, *,
                   verify: Callable[[bytes], None] | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (one ranged read); the whole file by default. FileNotFoundError if it
        does not exist; fewer bytes than asked if the file is shorter. With a ``cache_dir``, a range of a ``shared/``
        file is served from the cache when an entry holds it, and kept there after a remote read.

        ``verify`` checks the bytes before they are returned (raising CorruptDataError on bytes it refuses; keyed
        reads check the blocks against their handle's checksums): a cached range it refuses is dropped and read
        again from the file, and the file's bytes are kept in the cache only once they pass; bytes of the file it
        refuses raise its error."""
        check_relpath(relpath)
        for name, v in (("start", start), ("end", end)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")
        if start is not None and end is not None and end < start:
            raise ValueError(f"end must be >= start, got start={start}, end={end}")
        if self._cache is None or start is None or end is None or not _is_shared_file(relpath):
            data = self._fs.read_bytes(relpath, start, end)
            if verify is not None:
                verify(data)
            return data
        key = _ReadCache.key(self._fs.url(relpath))
        cached = self._cache.get(key, start, end, verify)
        if cached is not None:
            return cached
        try:
            data = self._fs.read_bytes(relpath, start, end)
        except FileNotFoundError:
            self._cache.drop(key)   # deleted by retention: its ranges are of no use any more
            raise
        if verify is not None:
            verify(data)   # the file itself is wrong: refused, and nothing kept
        if 0 < len(data) == end - start:   # a short read is a damaged file's, reported by the caller: never kept
            self._cache.put(key, start, data)
        return data

    def open_buffer(self, relpath: str) -> Any:
        """The whole file as a read-only buffer: an ``mmap`` for local files (close it, or drop every view of it,
        when done), ``bytes`` otherwise. ``memoryview(buffer)`` works on both."""
        check_relpath(relpath)
        return self._fs.open_buffer(relpath)

    def file_size(self, relpath: str) -> int:
        """Size of a file in bytes (FileNotFoundError if absent)."""
        check_relpath(relpath)
        return self._fs.size(relpath)

    def url(self, relpath: str = "") -> str:
        """The full path or URL of ``relpath`` (of ``location`` itself by default), for messages and tools."""
        return self._fs.url(check_relpath(relpath) if relpath else "")

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _chk_dirs(self) -> dict[int, str]:
        return self._listing()[0]

    def _listing(self) -> tuple[dict[int, str], list[int]]:
        """The ``chk-<id>`` directories (id -> name) and the ids of the complete ones, ascending: one listing (and
        locally a stat per directory), not a request per checkpoint."""
        names, complete = self._fs.names_and_marked("chk-", METADATA_NAME)
        dirs = {}
        for name in names:
            m = _CHK_RE.match(name)
            if m:
                dirs[int(m.group(1))] = name
        return dirs, sorted(cid for cid, d in dirs.items() if d in complete)

    def checkpoint_ids(self) -> list[int]:
        """Ids of the complete checkpoints (those with a ``_metadata``), ascending."""
        return self._listing()[1]

    def savepoint_names(self) -> list[str]:
        """Names of the complete savepoints, sorted."""
        return [n for n in self._fs.listdir(SAVEPOINTS_DIR)
                if _NAME_RE.match(n) and self._fs.exists(f"{SAVEPOINTS_DIR}/{n}/{METADATA_NAME}")]

    def _inventory(self) -> str:
        complete = self.checkpoint_ids()
        incomplete = sorted(set(self._chk_dirs()) - set(complete))
        return (f"complete checkpoints: {complete or 'none'}; incomplete (no _metadata, ignored): "
                f"{incomplete or 'none'}; savepoints: {self.savepoint_names() or 'none'}")

    def _read_metadata(self, base: str) -> CheckpointMetadata:
        rel = f"{base}/{METADATA_NAME}"
        data = self._fs.read_bytes(rel, None, None)
        return decode_metadata(data, base, self._fs.url(rel))

    def load(self, checkpoint_id: int) -> CheckpointMetadata:
        """The metadata of complete checkpoint ``checkpoint_id``; CheckpointNotFoundError (listing what exists) if
        it is absent or incomplete, CorruptSnapshotError if its ``_metadata`` is damaged."""
        cid = _check_id(checkpoint_id)
        try:
            md = self._read_metadata(f"chk-{cid}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"checkpoint {cid} does not exist in {self.location} (a checkpoint exists only once its "
                f"_metadata is written); {self._inventory()}") from None
        if md.checkpoint_id != cid:
            raise CorruptSnapshotError(f"chk-{cid}/_metadata in {self.location} holds checkpoint {md.checkpoint_id}")
        # what retention needs of it, so that it is not read again for that (one dict operation: no lock needed
        # beside a retention thread)
        self._retention.references.setdefault(cid, _References.of(md))
        return md

    def check_complete(self, metadata: CheckpointMetadata) -> None:
        """CorruptSnapshotError naming the checkpoint (or savepoint) and its files unless every file its
        ``_metadata`` names exists, keyed and raw keyed state files with their handle's size: a restore point
        that lost a file is refused before any task runs, rather than restored without it (a warm restore reads no
        file) or carried into the next checkpoint. One stat per file locally, one listing per directory on object
        stores (a driver does this once per restore point it did not commit itself)."""
        files = [*metadata.files(), *metadata.runner_files()]
        sizes = self._fs.sizes(sorted(set(files)))
        what = (f"savepoint {metadata.base.split('/', 1)[1]!r}" if metadata.base.startswith(f"{SAVEPOINTS_DIR}/")
                else f"checkpoint {metadata.checkpoint_id}")
        missing = [f for f in files if f not in sizes]
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CorruptSnapshotError(
                f"{what} in {self.location} names {len(missing)} file(s) that do not exist: {shown}. Its _metadata "
                "is complete but the files it references were removed or lost, so it cannot be restored; restore an "
                "earlier checkpoint or a savepoint (keygroups verify lists every missing or damaged file)")
        sized: list[tuple[str, int, int]] = [(h.file, h.subtask, h.size) for h in metadata.keyed_handles]
        sized += [(h.file, h.subtask, h.size) for h in metadata.raw_keyed_handles]
        for file, subtask, size in sized:
            if sizes[file] != size:
                raise CorruptSnapshotError(
                    f"{what} in {self.location} names state file {file!r} (subtask {subtask}) of {size} "
                    f"bytes, but the file is {sizes[file]} bytes: it was damaged or replaced; restore an earlier "
                    "checkpoint or a savepoint")

    def load_restore_point(self, point: int | str) -> CheckpointMetadata:
        """The metadata a batch restores from: a checkpoint id (int) or a savepoint name (str)."""
        return self.load_savepoint(point) if isinstance(point, str) else self.load(point)

    def latest(self) -> CheckpointMetadata | None:
        """The latest complete checkpoint, or None if there is none."""
        ids = self.checkpoint_ids()
        return self.load(ids[-1]) if ids else None

    def commit(self, metadata: CheckpointMetadata, *,
               planned_from: int | None | Literal["latest"] = "latest", prune: bool = True,
               encoded: bytes | None = None) -> None:
        """Make checkpoint ``metadata.checkpoint_id`` complete: check that every referenced file exists (and keyed
        files have their handle's size), claim the place after the checkpoint it was planned from, write
        ``chk-<id>/_metadata`` atomically, then apply retention. Sets ``metadata.base``.

        Compare-and-swap: ``planned_from`` is the checkpoint the batch was planned from (its restore point, or the
        newest checkpoint when it restored a savepoint; None for a job's first checkpoint). The commit succeeds only
        if that checkpoint is still the newest complete one; otherwise ConcurrentCommitError naming both, and
        nothing of this commit becomes visible (its own files are removed). ``"latest"`` (the default, for
        writers that plan from nothing, e.g. tools) follows whichever checkpoint is newest now. The id must be newer
        than every complete checkpoint.

        How the check is atomic with the publish: the successor of checkpoint ``k`` is claimed by writing
        ``_commits/after-<k>`` (``_commits/first`` for the first checkpoint) create-if-absent -- a hard link on a
        local filesystem, a conditional PUT (``If-None-Match: *``) on object stores -- holding the new ``_metadata``'s
        bytes. Of two commits planned from one checkpoint exactly one creates the claim; the other is refused.
        ``_metadata`` is published only after the claim, so a writer that dies in between leaves a claim that the
        next commit or :meth:`finish_interrupted_commit` completes (its files were checked before the claim). A
        claim left from a checkpoint that retention has since removed (the claims of checkpoints older than the
        retained ones are deleted) is caught after the claim: the checkpoint planned from no longer exists, so the
        claim is withdrawn and the commit refused.

        Round trips: planned from a named checkpoint, the claim itself is the check (no listing before it), and one
        existence check of the planned-from ``_metadata`` follows it; only a commit planned from no checkpoint or
        from ``"latest"``, or one whose claim is taken, lists the checkpoints. Before the claim, the batch's own
        files are checked (a request each for up to three files of a directory, else one listing of it); files of
        earlier checkpoints carried forward are not checked again. On an object store a commit is therefore about
        six requests whatever the number of retained checkpoints or carried files; locally, one write of the bytes
        and two rounds of fsyncs: the staged file, the location's root, the directories of the new state files and of
        the previous checkpoint (whose ``_metadata`` link its own commit left to this one), then the claim's
        directory.

        ``prune=False`` leaves retention to a later :meth:`prune` (a driver runs it off its batch's critical path).
        ``encoded``: ``encode_metadata(metadata, "chk-<id>")`` when the caller has it already."""
        metadata.validate()
        cid = metadata.checkpoint_id
        base = f"chk-{cid}"
        named = planned_from != "latest" and planned_from is not None
        if named:
            previous = _check_id(planned_from)
            if cid <= previous:
                raise ValueError(f"checkpoint {cid} cannot be committed: checkpoint ids must increase and it was "
                                 f"planned from checkpoint {previous}")
        else:
            previous = self._checked_newest(metadata, planned_from)
        self._check_chains(metadata)
        data = encoded if encoded is not None else encode_metadata(metadata, base)   # files must lie in chk-<id>/
        try:
            self._check_files(metadata)
        except ValueError:
            # a file of this batch gone: removed by the retention of a writer that committed after the planned-from
            # checkpoint (a lost race, said as such), else missing indeed
            self._checked_newest(metadata, planned_from)
            raise
        self._fs.makedirs(base)
        claim = _claim_file(previous)
        self._fs.makedirs(COMMITS_DIR)
        # Locally the bytes are written once and published twice, as hard links: the claim, then _metadata. An
        # object store takes one create-if-absent put for each.
        with self._fs.staged(claim, data, sync=False) as staged:
            # Durable before the claim (the commit's record): the staged bytes, the directory entries of the state
            # files and of the directories holding them (chk-<id>/, shared/, _commits/ in the location's root), and
            # the previous checkpoint's _metadata, which its commit published without an fsync (its claim
            # recovered it until now): in one round of fsyncs.
            new_shared = any(h.checkpoint_id == cid and is_shared_path(h.file) for h in metadata.keyed_handles)
            try:
                self._fs.sync_all([staged], ["", base, *([SHARED_DIR] if new_shared else [])],
                                  [f"chk-{previous}"] if previous is not None else [])
            except FileNotFoundError:
                # chk-<id>/ removed meanwhile, as an unfinished directory older than another writer's newer
                # checkpoint: the lost race it is (else the directory is missing indeed)
                self._checked_newest(metadata, planned_from)
                raise
            try:
                self._fs.link_exclusive(staged, claim)
            except FileNotFoundError:
                # the staged claim pruned by a writer that committed after ``previous``: the lost race it is
                self._checked_newest(metadata, planned_from)
                raise
            except FileExistsError:
                if self._read_claim(claim) != data:   # ours already when a commit of this very metadata is retried
                    if named:   # say what the location holds, as a listing before the claim would have
                        self._checked_newest(metadata, planned_from)
                    raise self._claimed_by_another(metadata, previous, claim) from None
            if named:
                stale = not self._fs.exists(f"chk-{previous}/{METADATA_NAME}")
            else:
                ids = self.checkpoint_ids()
                stale = (ids[-1] if ids else None) not in (previous, cid)
            if stale:
                # the claim of a checkpoint that retention removed, taken again: the chain moved on long ago
                self._fs.remove(claim)
                ids = self.checkpoint_ids()
                raise self._stale_commit(metadata, previous, ids[-1] if ids else None)
            # not made durable here: until the next commit's fsyncs do, the claim (durable) recovers it
            self._publish(base, data, staged, durable=False)
        metadata.base = base
        if prune:
            self.prune(cid, known={cid: metadata})

    def _checked_newest(self, metadata: CheckpointMetadata, planned_from: int | None | Literal["latest"]
                        ) -> int | None:
        """The checkpoint a commit of ``metadata`` follows (``planned_from``, or the newest for ``"latest"``), after
        a listing: ValueError if its id is not above the newest, ConcurrentCommitError if it is already complete or
        ``planned_from`` is not the newest."""
        cid = metadata.checkpoint_id
        ids = self.checkpoint_ids()
        newest = ids[-1] if ids else None
        if newest is not None and cid < newest:
            raise ValueError(f"checkpoint {cid} cannot be committed: checkpoint ids must increase and checkpoint "
                             f"{newest} is already complete in {self.location}")
        if cid in ids:
            raise self._lost_commit(metadata, f"chk-{cid}")
        previous = newest if planned_from == "latest" else planned_from
        if previous != newest:
            raise self._stale_commit(metadata, previous, newest)
        return previous

    def prune(self, latest: int, *, known: Mapping[int, CheckpointMetadata] | None = None) -> None:
        """Retention after the commit of checkpoint ``latest`` (see the module docs): older checkpoints beyond
        ``retain``, unreferenced files, old claims. ``known``: metadata of checkpoints the caller holds already (a
        driver, those it committed), which retention then does not read again. A failure is logged; the next prune
        retries it."""
        known = known or {}
        try:
            with self._retention.lock:
                dirs, complete = self._listing()
                self._prune(latest, known, dirs, complete)
                self._prune_shared(latest, known, complete)
                self._prune_claims(complete[-self.retain:])
        except OSError as e:   # the checkpoint is complete; a failed cleanup is retried at the next commit
            log.warning("retention after checkpoint %d in %s failed: %s", latest, self.location, e)

    @staticmethod
    def _check_chains(metadata: CheckpointMetadata) -> None:
        """ValueError, committing nothing, if a key group's chain starts with a delta whose base the metadata does
        not list (a driver that forgot to carry older files forward: a restore would return the delta alone);
        CorruptSnapshotError, committing nothing, if a delta does not apply on the block before it in its chain (a
        lost middle delta, a delta of another run or attempt: ``planning.chain_breaks``). From the metadata alone."""
        found, breaks = check_chains(metadata)   # what carry_forward added only, when it built the handles
        if found:
            raise ValueError(f"{describe_baseless(metadata.checkpoint_id, found)}; nothing was committed")
        if breaks:
            raise CorruptSnapshotError(f"{describe_breaks(metadata.checkpoint_id, breaks)}; nothing was committed")

    def _publish(self, base: str, data: bytes, staged: Any = None, *, durable: bool = True) -> None:
        """Write ``base/_metadata`` create-if-absent (from ``staged``, ``data`` staged by the filesystem, when
        given); one with the same bytes there already (published from the claim by another process) is this very
        checkpoint. ``durable=False``: a link of ``staged`` is not fsync'd (its claim is)."""
        try:
            if staged is not None:
                try:
                    self._fs.link_exclusive(staged, f"{base}/{METADATA_NAME}", durable=durable)
                    return
                except FileNotFoundError:
                    # pruned by a process that published this claim and pruned after it: write the bytes again
                    pass
            self._fs.write_exclusive(f"{base}/{METADATA_NAME}", data)
        except FileExistsError:
            if self._fs.read_bytes(f"{base}/{METADATA_NAME}", None, None) != data:
                raise
            self._fs.sync_dir(base)

    def _read_claim(self, claim: str) -> bytes | None:
        try:
            return self._fs.read_bytes(claim, None, None)
        except FileNotFoundError:   # withdrawn meanwhile
            return None

    def _decode_claim(self, data: bytes, claim: str) -> CheckpointMetadata:
        """The checkpoint metadata a claim holds (the ``_metadata`` it publishes), its files in ``chk-<id>/``."""
        where = self._fs.url(claim)
        cid = decode_metadata(data, "chk-0", where).checkpoint_id   # paths relative to its directory: id first
        return decode_metadata(data, f"chk-{cid}", where)

    def _claimed_by_another(self, metadata: CheckpointMetadata, previous: int | None,
                            claim: str) -> ConcurrentCommitError:
        """Another writer claimed the place after ``previous`` first: complete its checkpoint if it is still
        unpublished, remove this commit's own files, and name both checkpoints."""
        data = self._read_claim(claim)
        try:
            if data is None:
                raise FileNotFoundError(f"{claim} was withdrawn meanwhile")
            winner = self._decode_claim(data, claim)
        except (CorruptSnapshotError, OSError) as e:   # unreadable: keep every file, the next retention decides
            return ConcurrentCommitError(
                f"checkpoint {metadata.checkpoint_id} (job {metadata.job_id!r}) cannot be committed: it was planned "
                f"from {_describe(previous)}, whose successor another writer claimed first in {self.location} "
                f"({self._fs.url(claim)}, unreadable: {e}); nothing of this commit was published",
                planned_from=previous)
        self._finish_claim(previous, claim, data, winner)
        return self._stale_commit(metadata, previous, winner.checkpoint_id, winner)

    def _stale_commit(self, metadata: CheckpointMetadata, previous: int | None, newest: int | None,
                      winner: CheckpointMetadata | None = None) -> ConcurrentCommitError:
        """The commit of ``metadata``, planned from ``previous``, is refused because ``newest`` (committed by
        another writer, ``winner`` if known) is the newest checkpoint now: remove its own files and say so."""
        if winner is None and newest is not None:
            with contextlib.suppress(CorruptSnapshotError, OSError):
                winner = self._read_metadata(f"chk-{newest}")
        keep: set[str] = set()
        who = ""
        if winner is not None:
            keep = set(winner.files()) | set(winner.runner_files())
            who = f" (job {winner.job_id!r}, committed at timestamp_ms={winner.timestamp_ms})"
        removed = self.discard(metadata, keep=keep)
        found = "no checkpoint is complete" if newest is None else (
            f"checkpoint {newest}, committed by another writer{who}, is the newest complete one")
        return ConcurrentCommitError(
            f"checkpoint {metadata.checkpoint_id} cannot be committed: it was planned from {_describe(previous)}, "
            f"but {found} in {self.location}; publishing it would lose that writer's updates. Nothing of this "
            f"commit (job {metadata.job_id!r}) was published and its {removed} files were removed. Plan the batch "
            "again from the latest checkpoint; two drivers must not run one job on one checkpoint location at once",
            planned_from=previous, newest=newest)

    def _finish_claim(self, previous: int | None, claim: str, data: bytes, claimed: CheckpointMetadata) -> None:
        """Publish the checkpoint a claim holds if it is still unpublished and ``previous`` still the newest (its
        writer died, or is slow, between claiming and publishing; publishing twice is harmless: same bytes)."""
        base = f"chk-{claimed.checkpoint_id}"
        if self._fs.exists(f"{base}/{METADATA_NAME}"):
            return
        ids = self.checkpoint_ids()
        if (ids[-1] if ids else None) != previous:
            return   # a stale claim, being withdrawn by its writer
        try:
            self._check_all_files(claimed)
        except (ValueError, CorruptSnapshotError) as e:
            raise CorruptSnapshotError(
                f"checkpoint {claimed.checkpoint_id} was claimed as the successor of {_describe(previous)} in "
                f"{self.location} ({self._fs.url(claim)}) but never published, and it cannot be any more: {e}. "
                f"Remove {self._fs.url(claim)} to let the job continue from {_describe(previous)}") from None
        log.warning("completing checkpoint %d in %s: its writer claimed it (%s) but has not published it (slow, "
                    "or stopped)", claimed.checkpoint_id, self.location, claim)
        self._fs.makedirs(base)
        self._publish(base, data)

    def finish_interrupted_commit(self) -> int | None:
        """Publish the checkpoint whose writer claimed it (see :meth:`commit`) but stopped before writing its
        ``_metadata``, so a new batch plans from it; its id, or None when there is none. A claimed checkpoint is as
        committed as a published one (its writer may yet report success): a restarted driver calls this before it
        looks at what is committed, and ``begin_batch`` calls it before planning; a commit planned from the
        checkpoint before it is refused either way."""
        ids = self.checkpoint_ids()
        previous = ids[-1] if ids else None
        claim = _claim_file(previous)
        data = self._read_claim(claim)
        if data is None:
            return None
        claimed = self._decode_claim(data, claim)
        if claimed.checkpoint_id in ids:
            return None
        self._finish_claim(previous, claim, data, claimed)
        return claimed.checkpoint_id if self._fs.exists(f"chk-{claimed.checkpoint_id}/{METADATA_NAME}") else None

    def _prune_claims(self, ids: list[int]) -> None:
        """Delete the claims of checkpoints older than the oldest retained one (``ids``: the retained, ascending):
        no commit can be planned from them any more (one that was is refused by the listing after its claim)."""
        if not ids:
            return
        for name in self._fs.listdir(COMMITS_DIR):
            m = _CLAIM_RE.match(name.split(_TMP_MARKER, 1)[0])   # and a dead writer's temporary of one
            if m is not None and (m.group(1) is None or int(m.group(1)) < ids[0]):
                self._fs.remove(f"{COMMITS_DIR}/{name}")

    @staticmethod
    def _written_for(relpath: str, checkpoint_id: int) -> bool:
        """Whether ``relpath`` was written for checkpoint ``checkpoint_id``: in its ``chk-<id>/``, or a shared file
        named with that id."""
        if relpath.startswith(f"chk-{checkpoint_id}/"):
            return True
        parent, name = posixpath.split(relpath)
        match = _SHARED_FILE_RE.match(name) if parent == SHARED_DIR else None
        return match is not None and int(match.group(1)) == checkpoint_id

    def _lost_commit(self, metadata: CheckpointMetadata, base: str) -> ConcurrentCommitError:
        """Another writer published ``base/_metadata`` first: remove the files only this commit referenced (its
        state, output and input files; never one the winner references) and name the winner."""
        try:
            winner = self._read_metadata(base)
            theirs = set(winner.files()) | set(winner.runner_files())
            who = f"job {winner.job_id!r}, committed at timestamp_ms={winner.timestamp_ms}"
        except (CorruptSnapshotError, OSError) as e:   # unreadable: keep every file, the next retention decides
            return ConcurrentCommitError(
                f"checkpoint {metadata.checkpoint_id} is already complete in {self.location}, committed by another "
                f"writer (its _metadata cannot be read: {e}): checkpoint ids must increase; nothing of this commit "
                "was published")
        removed = self.discard(metadata, keep=theirs)
        return ConcurrentCommitError(
            f"checkpoint {metadata.checkpoint_id} is already complete in {self.location}, committed by another "
            f"writer ({who}): checkpoint ids must increase; nothing of this commit (job {metadata.job_id!r}) was "
            f"published and its {removed} files were removed. Two drivers must not run one job on one checkpoint "
            "location at once")

    def discard(self, metadata: CheckpointMetadata, *, keep: frozenset[str] | set[str] = frozenset()) -> int:
        """Remove the files an unpublished checkpoint's own batch wrote (its state, output and input files in
        ``chk-<id>/`` and shared files named with its id), except those in ``keep``; files of earlier checkpoints it
        carried forward stay. Returns how many were removed; one that cannot be removed is left to retention."""
        ours = {f for f in set(metadata.files()) | set(metadata.runner_files())
                if self._written_for(f, metadata.checkpoint_id)}
        removed = 0
        for f in sorted(ours - set(keep)):
            try:
                self._fs.remove(f)
                removed += 1
            except OSError as e:
                log.warning("could not remove %s of an unpublished checkpoint: %s", f, e)
        return removed

    def _check_files(self, metadata: CheckpointMetadata) -> None:
        """What a commit checks before its claim: the files its own batch wrote (:meth:`_check_all_files`), not
        the keyed files of older checkpoints it carries forward (checked when those committed; retention keeps
        every file a retained checkpoint references): a commit costs what its batch wrote, not its history."""
        self._check_all_files(metadata, new_only=True)

    def _check_all_files(self, metadata: CheckpointMetadata, *, new_only: bool = False) -> None:
        """ValueError unless every file ``metadata`` references exists, state files with their handle's size
        (CorruptSnapshotError for a carried keyed file whose size changed); ``new_only``: keyed files of older
        checkpoints are not looked at. Sizes come from one listing per directory on object stores."""
        cid = metadata.checkpoint_id
        keyed = [h for h in metadata.keyed_handles if not new_only or h.checkpoint_id >= cid]
        sizes = self._fs.sizes(sorted({h.file for h in keyed} | {h.file for h in metadata.raw_keyed_handles}
                                      | {h.file for h in metadata.operator_handles}
                                      | set(metadata.runner_files())))

        def size_of(what: str, file: str, subtask: int) -> int:
            size = sizes.get(file)
            if size is None:
                raise ValueError(f"checkpoint {cid} references {what} file {file!r} (subtask {subtask}), which does "
                                 f"not exist in {self.location}")
            return size

        def unfinished(what: str, file: str, subtask: int, size: int, expected: int) -> ValueError:
            return ValueError(f"{what} file {file!r} (subtask {subtask}) is {size} bytes but its handle says "
                              f"{expected}: the file was not completely written (closed?)")

        for h in keyed:
            size = size_of("keyed state", h.file, h.subtask)
            if size != h.size and h.checkpoint_id < cid:
                raise CorruptSnapshotError(
                    f"keyed state file {h.file!r} of checkpoint {h.checkpoint_id}, carried into checkpoint "
                    f"{cid}, is {size} bytes but its handle says {h.size}: it was damaged after "
                    f"its checkpoint committed (in {self.location}); restore from a checkpoint or savepoint that "
                    "does not reference it")
            if size != h.size:
                raise unfinished("keyed state", h.file, h.subtask, size, h.size)
        for oh in metadata.operator_handles:
            if oh.file not in sizes:
                raise ValueError(f"checkpoint {cid} references operator state file "
                                 f"{oh.file!r}, which does not exist in {self.location}")
        for rh in metadata.raw_keyed_handles:
            size = size_of("raw keyed state", rh.file, rh.subtask)
            if size != rh.size:
                raise unfinished("raw keyed state", rh.file, rh.subtask, size, rh.size)
        for name, files in (("output", metadata.outputs), ("input", metadata.inputs),
                            ("late output", metadata.late_outputs)):
            missing = [f for f in files if f not in sizes]
            if missing:
                raise ValueError(f"checkpoint {metadata.checkpoint_id} references {name} files {missing}, which do "
                                 f"not exist in {self.location}")

    def _references(self, checkpoint_id: int, known: Mapping[int, CheckpointMetadata]) -> _References:
        """What retained checkpoint ``checkpoint_id`` references, from ``known`` or its ``_metadata``, each read at
        most once by this storage object (a complete checkpoint never changes)."""
        refs = self._retention.references.get(checkpoint_id)
        if refs is None:
            found = known.get(checkpoint_id)
            md = found if found is not None else self._read_metadata(f"chk-{checkpoint_id}")
            refs = self._retention.references[checkpoint_id] = _References.of(md)
        return refs

    def _prune(self, latest: int, known: Mapping[int, CheckpointMetadata], dirs: dict[int, str],
               complete: list[int]) -> None:
        """Remove the checkpoints older than the newest ``retain`` complete ones, then the orphans in each retained
        checkpoint's directory older than ``latest``, once per directory (a retried task attempt's file comes
        while its batch runs, before that batch's commit; one later still goes with its checkpoint)."""
        keep = set(complete[-self.retain:])
        cleaned = self._retention.cleaned
        for cid, d in sorted(dirs.items()):
            if cid > latest:
                continue   # a newer checkpoint may still be being written
            if cid not in keep:
                log.debug("retention: removing %s", d)
                self._fs.rmtree(d)
                cleaned.discard(cid)
            elif cid < latest and cid not in cleaned:
                if self._remove_orphans(d, cid, known):
                    cleaned.add(cid)
        cleaned.intersection_update(keep)

    def _prune_shared(self, latest: int, known: Mapping[int, CheckpointMetadata], complete: list[int]) -> None:
        """Delete the files of ``shared/`` that no retained checkpoint references, written by checkpoint ``latest``
        or older (newer ones may belong to a checkpoint still being written). The references are counted as
        checkpoints enter and leave retention: each retained ``_metadata`` is read at most once."""
        state = self._retention
        retained = set(complete[-self.retain:])
        for cid in sorted(state.counted - retained):
            state.counted.discard(cid)
            refs = state.references.pop(cid, None)
            for f in refs.shared if refs is not None else ():
                state.shared_uses[f] -= 1
                if not state.shared_uses[f]:
                    del state.shared_uses[f]
        for cid in sorted(retained - state.counted):
            try:
                refs = self._references(cid, known)
            except (CorruptSnapshotError, FileNotFoundError) as e:
                log.warning("retention: not cleaning %s/, the _metadata of checkpoint %d is unreadable: %s",
                            SHARED_DIR, cid, e)
                return
            state.counted.add(cid)
            for f in refs.shared:
                state.shared_uses[f] = state.shared_uses.get(f, 0) + 1
        for cid in set(state.references) - retained:
            del state.references[cid]
        for name in self._fs.listdir(SHARED_DIR):
            m = _SHARED_FILE_RE.match(name)
            if m is None or int(m.group(1)) > latest or f"{SHARED_DIR}/{name}" in state.shared_uses:
                continue
            log.debug("retention: removing unreferenced %s/%s", SHARED_DIR, name)
            self._fs.remove(f"{SHARED_DIR}/{name}")
            if self._cache is not None:
                self._cache.drop(_ReadCache.key(self._fs.url(f"{SHARED_DIR}/{name}")))

    def shared_files(self) -> list[str]:
        """The keyed state files in ``shared/`` (storage-relative), sorted: for tools and tests of retention."""
        return [f"{SHARED_DIR}/{n}" for n in self._fs.listdir(SHARED_DIR) if _SHARED_FILE_RE.match(n)]

    def _remove_orphans(self, base: str, checkpoint_id: int, known: Mapping[int, CheckpointMetadata]) -> bool:
        """Remove the files of ``base`` its checkpoint does not reference; False if its _metadata is unreadable."""
        try:
            refs = self._references(checkpoint_id, known)
        except (CorruptSnapshotError, FileNotFoundError) as e:
            log.warning("retention: not cleaning %s, its _metadata is unreadable: %s", base, e)
            return False
        referenced = {posixpath.relpath(f, base) for f in refs.own} | {METADATA_NAME}
        for name in self._fs.listdir(base):
            if name in referenced or not (_STATE_FILE_RE.match(name) or _TMP_MARKER in name):
                continue
            if not self._fs.isdir(f"{base}/{name}"):
                log.debug("retention: removing orphan %s/%s", base, name)
                self._fs.remove(f"{base}/{name}")
        return True

    # -- driver claims (fencing) -------------------------------------------------------------------------------
    def claim(self, owner: dict[str, Any]) -> int:
        """Claim the location for a new driver and return its fencing token: the epoch of a ``_drivers/epoch-<n>``
        file written create-if-absent, one above the newest claim (a racing claimant takes the next). ``owner``
        (JSON) says who holds it, for the error that fences an older driver."""
        existing = [int(m.group(1)) for m in map(_EPOCH_RE.match, self._fs.listdir(DRIVERS_DIR)) if m]
        epoch = max(existing, default=0) + 1
        self._fs.makedirs(DRIVERS_DIR)
        while True:
            try:
                self._fs.write_exclusive(_epoch_file(epoch), json.dumps({**owner, "epoch": epoch},
                                                                        sort_keys=True).encode())
                return epoch
            except FileExistsError:
                epoch += 1   # claims are contiguous: a claimant that loses a race takes the next number

    def newer_claim(self, epoch: int) -> dict[str, Any] | None:
        """Who claimed the location after the driver holding ``epoch`` (its owner record), None if nobody did: that
        driver is the current one. Claims are contiguous, so only the next epoch's file is looked at."""
        rel = _epoch_file(epoch + 1)
        try:
            data = self._fs.read_bytes(rel, None, None)
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(data)
        except ValueError:
            owner = None
        return owner if isinstance(owner, dict) else {"epoch": epoch + 1, "unreadable": self._fs.url(rel)}

    # -- savepoints --------------------------------------------------------------------------------------------
    def savepoint(self, metadata_or_id: CheckpointMetadata | int, name: str) -> str:
        """Write a checkpoint (given by metadata or id) as a self-contained full snapshot into
        ``savepoints/<name>/``, ``_metadata`` written last: per subtask of the checkpoint's parallelism, one keyed
        file whose blocks are each key group's chain merged into one full block (bytes in, bytes out), and a copy
        of each operator and raw keyed state file. Retention never touches it, and either backend restores it. Returns the
        savepoint directory's full path or URL."""
        md = metadata_or_id if isinstance(metadata_or_id, CheckpointMetadata) else self.load(metadata_or_id)
        md.validate()
        base = self.begin_savepoint(name)
        copied = {f: f"{base}/{posixpath.basename(f)}"
                  for f in [h.file for h in md.operator_handles] + [h.file for h in md.raw_keyed_handles]}
        if len(set(copied.values())) != len(copied):
            raise ValueError(f"two operator or raw keyed state files of checkpoint {md.checkpoint_id} share a file "
                             f"name; a savepoint (one flat directory) cannot hold both: {sorted(copied)}")
        for src, dst in copied.items():
            self._fs.copy(src, dst)
        keyed = []
        for subtask in range(md.parallelism):
            r = key_group_range(md.max_parallelism, md.parallelism, subtask)
            plan = plan_keyed_restore(md, r)
            if not plan:
                continue
            states, groups = merged_key_groups(self, plan, r)
            keyed.append(write_full_snapshot(self, f"{base}/keyed-{subtask}-{uuid.uuid4().hex}", md.checkpoint_id,
                                             subtask, r, states, groups))
        copy = CheckpointMetadata(
            checkpoint_id=md.checkpoint_id, job_id=md.job_id, timestamp_ms=md.timestamp_ms,
            max_parallelism=md.max_parallelism, parallelism=md.parallelism, keyed_handles=keyed,
            operator_handles=[dataclasses.replace(h, file=copied[h.file]) for h in md.operator_handles],
            raw_keyed_handles=[dataclasses.replace(h, file=copied[h.file]) for h in md.raw_keyed_handles],
            properties=dict(md.properties), base=base)
        return self.commit_savepoint(copy, name)

    def begin_savepoint(self, name: str) -> str:
        """Start writing savepoint ``name``: ValueError if it already exists; leftovers of an interrupted one of
        that name are removed. Returns its directory (storage-relative, ``savepoints/<name>``): write its state
        files there (e.g. ``keygroups.checkpoint.format.write_full_snapshot``), then :meth:`commit_savepoint`."""
        _check_name(name, "savepoint name")
        base = f"{SAVEPOINTS_DIR}/{name}"
        if self._fs.exists(f"{base}/{METADATA_NAME}"):
            raise ValueError(f"savepoint {name!r} already exists in {self.location}; choose another name "
                             f"(existing: {self.savepoint_names()})")
        self._fs.rmtree(base)   # leftovers of an interrupted savepoint of the same name
        self._fs.makedirs(base)
        return base

    def commit_savepoint(self, metadata: CheckpointMetadata, name: str) -> str:
        """Make savepoint ``name`` complete: every file ``metadata`` references lies in its directory and exists
        (keyed files with their handle's size), then its ``_metadata`` is written last, atomically. Sets
        ``metadata.base``; returns the savepoint directory's full path or URL."""
        _check_name(name, "savepoint name")
        base = f"{SAVEPOINTS_DIR}/{name}"
        self._check_chains(metadata)
        data = encode_metadata(metadata, base)   # also checks every file lies in the savepoint's directory
        self._check_all_files(metadata)
        self._fs.sync_dir(base)
        self._fs.write_atomic(f"{base}/{METADATA_NAME}", data)
        metadata.base = base
        return self._fs.url(base)

    def load_savepoint(self, name: str) -> CheckpointMetadata:
        """The metadata of savepoint ``name`` (its handles point into ``savepoints/<name>/``);
        CheckpointNotFoundError listing the savepoints that exist."""
        _check_name(name, "savepoint name")
        try:
            return self._read_metadata(f"{SAVEPOINTS_DIR}/{name}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"savepoint {name!r} does not exist in {self.location} (a savepoint exists only once its _metadata "
                f"is written); {self._inventory()}") from None


def _claim_file(previous: int | None) -> str:
    """The claim of the checkpoint that follows ``previous`` (None: the first checkpoint of a location)."""
    return f"{COMMITS_DIR}/first" if previous is None else f"{COMMITS_DIR}/after-{previous}"


def _describe(checkpoint_id: int | None) -> str:
    return "no checkpoint (the job's first)" if checkpoint_id is None else f"checkpoint {checkpoint_id}"


def _epoch_file(epoch: int) -> str:
    return f"{DRIVERS_DIR}/epoch-{epoch:012d}"


def _rebuild_storage(location: str, retain: int, storage_options: dict[str, Any], cache_dir: str | None = None,
                     cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES) -> CheckpointStorage:
    return CheckpointStorage(location, retain=retain, storage_options=storage_options, cache_dir=cache_dir,
                             cache_max_bytes=cache_max_bytes)
