"""The warm directory of a RocksDB backend: where its database stays on local disk between batches, and every rule
about when a kept database may be used again (Flink keeps local recovery apart from its backends the same way:
``TaskLocalStateStoreImpl``).

Layout, under the job's warm directory (``runtime.subtask.warm_directory``, private to this user,
``keygroups._local_dirs``): one directory per key-group range, ``<first>-<last>/``, holding the database (``db/``)
and its marker (``marker.json``), and beside it the range's lock file ``<first>-<last>.lock``.

* **Lock.** A backend claims its range's directory with an exclusive ``flock`` on the lock file; a second attempt
  of the same task running beside the first finds it held and works in a temporary directory instead.
* **Marker.** After each snapshot the backend writes a marker naming the checkpoint location and id, the max
  parallelism, the key-group range, the snapshot file that holds exactly this database's state, and the states'
  metas; the first write after it removes it (``remove_marker``): it vouches only for the snapshot it was written
  at.
* **Seal.** When the database is closed, :func:`seal_kept` adds to the marker the list of the database's files
  (size, modification time, inode) and an HMAC of the whole under the directory's secret. A kept database is opened
  only after the seal and the files check out (:func:`_open_kept`); one changed behind the job's back is deleted
  and restored, never read.
* **Resume.** The next backend of the same range that restores from that very checkpoint, whose metadata names that
  very file for this range, opens the database as it is (:meth:`WarmDirectory.states_at`). One that restores from a
  later checkpoint of the same lineage (the batches between ran elsewhere: another host, a second attempt in a
  temporary directory) catches up: the marker names, per key group, the files of the chain the database holds
  (:meth:`WarmDirectory.behind`), and the backend applies only the blocks written after them. A backend of another
  range (boundaries moved, or a rescale) with none of its own takes over (moves) the kept database of the range
  that overlaps it most (:meth:`WarmDirectory.moved_from`): the backend then drops the key groups that left and
  restores those that arrived; one behind the checkpoint is first completed from the values its process kept, or
  caught up from the chain (``RocksDBKeyedStateBackend._resume_moved``).
* **Clean-up.** Directories of ranges that overlap the claimed one are left from other parallelisms: they are
  deleted once no sibling range can still take them over (:meth:`WarmDirectory.remove_stale`). A claim marks its
  range's lock file as used (its modification time); a whole job directory that no backend claimed for
  :data:`WARM_RETENTION_SECONDS` (a job that ended, or moved to other hosts) is deleted by the next warm backend of
  any job of that user on that host (:func:`sweep_unused_jobs`), as Flink drops a task's local state when the task
  ends: a kept database only ever saves a restore, so deleting one costs time, never state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from keygroups._local_dirs import (
    UnsafeDirectoryError,
    check_private,
    directory_secret,
    make_private,
    private_directory,
    seal,
    sealed,
)
from keygroups._ranges import KeyGroupRange

if TYPE_CHECKING:
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, KeyedStateHandle

#: Version of the warm database's marker (and of the database layout it vouches for).
WARM_MARKER_VERSION = 3
_MARKER = "marker.json"

log = logging.getLogger("keygroups.state.rocksdb")

#: A backend's part of a batch's warm takeover: the ``(first, last)`` key groups of the kept range it takes over (None:
#: the one that overlaps it most), and the ranges given to other backends.
Takeover = tuple[tuple[int, int] | None, frozenset[tuple[int, int]]]


#: How long a job's warm directory on a host may go unclaimed before :func:`sweep_unused_jobs` deletes it: two days,
#: so that a job that runs once a day, or restarts on the same hosts, still resumes its databases.
WARM_RETENTION_SECONDS = 2 * 24 * 3600

#: A warm directory of a key-group range, or its lock file: ``<first>-<last>[.lock]``.
_RANGE_NAME = re.compile(r"(\d+)-(\d+)(?:\.lock)?")


def _lock_range(parent: str, name: str) -> Any:
    """The lock file of warm directory ``name`` under ``parent``, opened and locked exclusively; None when another
    backend holds it. A lock file deleted (by a cleanup that held it) between opening and locking locks nothing:
    then the one now at the path is tried."""
    path = os.path.join(parent, name + ".lock")
    while True:
        lock_file = open(path, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            return None
        held = os.fstat(lock_file.fileno())
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return lock_file
        lock_file.close()


def _db_files(db_dir: str) -> dict[str, list[int]]:
    """What a closed database directory holds: file name -> [size, mtime (ns), inode]; UnsafeDirectoryError if
    anything in it is not a regular file of this user that only this user may write."""
    files = {}
    with os.scandir(db_dir) as it:
        for e in it:
            st = check_private(e.path, directory=False)
            files[e.name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return files


def _marker_body(marker: dict[str, Any]) -> bytes:
    """What a marker's HMAC covers: everything in it but the HMAC, as canonical JSON."""
    return json.dumps({k: v for k, v in marker.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def seal_kept(path: str, secret: bytes) -> str | None:
    """Once the kept database is closed: add to its marker (if it still has one) the list of the database's files
    and an HMAC of the whole under the warm directory's secret. A marker not sealed so (its process died first) is
    never believed, nor one whose database files changed since. Returns the seal (the HMAC: it names this database
    exactly as closed, files included), None when nothing was sealed."""
    marker_path = os.path.join(path, _MARKER)
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
        if not isinstance(marker, dict):
            raise ValueError("the marker is not a JSON object")
        marker["files"] = _db_files(os.path.join(path, "db"))
        marker["mac"] = seal(secret, _marker_body(marker))
        with open(marker_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_path + ".tmp", marker_path)
        return str(marker["mac"])
    except FileNotFoundError:
        return None  # written to since its last snapshot: nothing to vouch for
    except (OSError, ValueError) as e:
        log.warning("warm state: could not seal %s (%s); it will be restored, not reused", path, e)
        with contextlib.suppress(OSError):
            os.remove(marker_path)
        return None


def _open_kept(path: str, secret: bytes) -> dict[str, Any] | None:
    """The sealed marker of the database kept in ``path`` when the seal holds and the database's files are exactly
    those it lists (checked before the database is opened, so nothing RocksDB reads has changed); otherwise the
    database and its marker are deleted (a warning if they were tampered with) and None is returned. An unsealed
    or missing marker only means there is nothing to reuse."""
    marker_path = os.path.join(path, _MARKER)
    db_dir = os.path.join(path, "db")
    marker = None
    problem = None
    try:
        check_private(marker_path, directory=False)
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
        if not isinstance(marker, dict) or "mac" not in marker:
            marker = None   # written by a backend that did not close: never vouched for
        elif not sealed(secret, marker["mac"], _marker_body(marker)):
            problem, marker = "its marker's seal does not match", None
        else:
            check_private(db_dir)
            if _db_files(db_dir) != marker.get("files"):
                problem, marker = "its database files changed since it was sealed", None
    except FileNotFoundError:
        marker = None
    except (OSError, ValueError) as e:
        problem, marker = str(e), None
    if marker is None:
        if problem is not None:
            log.warning("warm state: not reusing %s: %s; its database is deleted and restored", path, problem)
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker_path)
        shutil.rmtree(db_dir, ignore_errors=True)
        if os.path.lexists(db_dir):
            raise UnsafeDirectoryError(f"{db_dir} cannot be deleted")
    return marker


def marker_seal(path: str) -> str | None:
    """The seal the marker in ``path`` bears (unverified: to tell whether a database never opened since its seal was
    checked is still under that seal), None without one."""
    try:
        with open(os.path.join(path, _MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker.get("mac") if isinstance(marker, dict) and isinstance(marker.get("mac"), str) else None


def _marker_checkpoint(path: str) -> int | None:
    """The checkpoint id the sealed marker in ``path`` names (unverified: only to decide whether the directory may
    still be taken over), None without one."""
    try:
        with open(os.path.join(path, _MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(marker, dict) and "mac" in marker and isinstance(marker.get("checkpoint_id"), int):
        return int(marker["checkpoint_id"])
    return None


class WarmDirectory:
    """One backend's claim on its key-group range's warm directory (see the module docs): the directory
    (``path``: the database lives in ``path/db``), its lock, the directory's secret, and the sealed marker of the
    database found kept there (or taken over from an overlapping range), until a restore checks it."""

    def __init__(self, path: str, key_group_range: KeyGroupRange, lock_file: Any, secret: bytes,
                 kept_marker: dict[str, Any] | None, moved_from: KeyGroupRange | None) -> None:
        self.path = path
        self.key_group_range = key_group_range
        self.lock_file = lock_file
        self.secret = secret
        self._kept_marker = kept_marker
        #: The range of a kept database taken over from an overlapping range (see ``_take_moved``); None if none.
        self.moved_from = moved_from
        #: The seal of this range's own kept database as found (``seal_kept``'s HMAC; None: none, or taken over):
        #: what names exactly the database a backend of this process closed, for its decoded values kept beside it.
        self.kept_seal: str | None = None
        if moved_from is None and isinstance(kept_marker, dict) and isinstance(kept_marker.get("mac"), str):
            self.kept_seal = kept_marker["mac"]
        #: The seal of the taken-over database as its backend closed it, and the directory it was kept in (its
        #: process's kept values of it are parked under that name: ``rocksdb._KeptCaches``).
        self.moved_seal: str | None = None
        self.moved_path: str | None = None
        if moved_from is not None and isinstance(kept_marker, dict) and isinstance(kept_marker.get("mac"), str):
            self.moved_seal = kept_marker["mac"]
            self.moved_path = os.path.join(os.path.dirname(path), f"{moved_from.start}-{moved_from.end}")
        #: Serializes marker writes with the backend's database writes (a marker vouches for one write count).
        self.marker_lock = threading.Lock()

    @property
    def parent(self) -> str:
        return os.path.dirname(self.path)

    @classmethod
    def claim(cls, warm_dir: str | os.PathLike[str], key_group_range: KeyGroupRange,
              takeover: Takeover = (None, frozenset())) -> WarmDirectory | None:
        """This range's warm directory, locked for the caller; None when another backend holds it (a second
        attempt of the same task running beside the first): that one then works in a temporary directory. Once
        claimed, the job's warm directories of other ranges that overlap this one are deleted (see
        :meth:`remove_stale`). ``takeover``: the ``(first, last)`` range whose kept database this one takes over
        when it has none of its own, and the ranges given to other backends, never taken (the batch's best
        matching, see ``KeyedTaskSpec.warm_claims``)."""
        r = key_group_range
        parent = private_directory(warm_dir, what="warm state")
        try:
            secret = directory_secret(parent)
        except OSError as e:
            log.warning("warm state: cannot use %s (%s); this backend's database is not kept", parent, e)
            return None
        name = f"{r.start}-{r.end}"
        try:
            lock_file = _lock_range(parent, name)
        except OSError as e:   # its lock file is a directory, say: work apart, never fail for it
            log.warning("warm state: cannot lock %s under %s (%s); this backend's database is not kept", name,
                        parent, e)
            return None
        if lock_file is None:
            return None
        with contextlib.suppress(OSError):
            os.utime(lock_file.fileno())   # the job's last use on this host, for sweep_unused_jobs
        path = os.path.join(parent, name)
        moved_from = None
        try:
            make_private(path)
            kept_marker = _open_kept(path, secret)
            if kept_marker is None:
                kept_marker, moved_from = _take_moved(parent, path, secret, r, takeover)
        except OSError as e:
            log.warning("warm state: %s cannot be kept (%s); its backend works in a temporary directory", path, e)
            lock_file.close()
            return None
        claimed = cls(path, r, lock_file, secret, kept_marker, moved_from)
        claimed.remove_stale()
        return claimed

    def remove_stale(self, checkpoint_id: int | None = None,
                     spare: Callable[[str, KeyGroupRange], bool] | None = None) -> None:
        """Delete the warm directories beside this one (one job's) of key-group ranges that overlap this range but
        are not it: the ranges of one parallelism never overlap, so those are left from other ranges (before a
        rescale or a boundary move). One that also overlaps other ranges and holds a sealed marker may still be
        taken over by the backend of one of those (``_take_moved``): it stays until a restore from another
        checkpoint than its marker's (``checkpoint_id``) makes it useless. Every range of the current ranges
        overlaps some stale range it replaced, so the batches at the new ranges remove them all. A directory whose
        lock a running backend holds is left alone; the lock is deleted with its directory, while held
        (``_lock_range`` retries when it locked a file that was deleted meanwhile). ``spare(path, range)``: one whose
        marker is older, but that may still be taken over (its process keeps what it lacks for ``checkpoint_id``, or
        the batch gives its range to another backend), stays too."""
        r = self.key_group_range
        parent = self.parent
        for name, old in sorted(_overlapping_warm(parent, r).items()):
            lock_file = _lock_range(parent, name)
            if lock_file is None:
                continue  # a running backend holds it
            try:
                if not (old.start >= r.start and old.end <= r.end):
                    kept_at = _marker_checkpoint(os.path.join(parent, name))
                    if kept_at is not None and (checkpoint_id in (None, kept_at) or (
                            spare is not None and spare(os.path.join(parent, name), old))):
                        continue  # a sibling range restoring from checkpoint ``kept_at`` may still take it over
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(parent, name + ".lock"))
            finally:
                lock_file.close()

    def forget_kept(self) -> None:
        """The kept database will not be used (it is being emptied)."""
        self._kept_marker = None
        self.moved_from = None
        self.kept_seal = None

    def states_at(self, storage: CheckpointStorage, metadata: CheckpointMetadata, max_parallelism: int,
                  kept_range: KeyGroupRange | None = None) -> list[dict[str, Any]] | None:
        """The states of the kept database if its marker matches this restore exactly (for ``kept_range``, this
        range by default), else None. Asked once: the marker is then forgotten."""
        marker = self._kept_marker  # as sealed when its backend closed the database, checked before this one opened it
        self._kept_marker = None
        if marker is None:
            return None
        try:
            r = self.key_group_range if kept_range is None else kept_range
            if not (isinstance(marker, dict) and marker.get("version") == WARM_MARKER_VERSION
                    and marker.get("location") == storage.location
                    and marker.get("checkpoint_id") == metadata.checkpoint_id
                    and marker.get("max_parallelism") == max_parallelism == metadata.max_parallelism
                    and marker.get("key_group_range") == [r.start, r.end]):
                return None
            handle_file = marker.get("handle_file")
            if not any(h.file == handle_file and h.key_group_range == r for h in metadata.keyed_handles):
                return None
            states = marker.get("states")
            if not isinstance(states, list) or not all(isinstance(s, dict) and "name" in s for s in states):
                return None
            return states
        except (TypeError, ValueError):
            return None  # a marker of another shape: restore instead

    def behind(self, storage: CheckpointStorage, metadata: CheckpointMetadata, max_parallelism: int,
               kept_range: KeyGroupRange | None = None
               ) -> tuple[int, str, list[dict[str, Any]], dict[int, tuple[str, ...]]] | None:
        """When the kept database is of this location, max parallelism and range at an earlier checkpoint than
        ``metadata``'s, and its marker names the chain files it holds: ``(its checkpoint id, its snapshot file, its
        states, key group -> the files of the chain it holds)``, for a catch-up (the caller checks that the file
        was committed and that each key group's committed chain begins with those files); else None. Does not
        forget the marker (``states_at`` does). ``kept_range``: the range the database was kept for (this one by
        default; a taken-over one's)."""
        marker = self._kept_marker
        try:
            r = self.key_group_range if kept_range is None else kept_range
            if not (isinstance(marker, dict) and marker.get("version") == WARM_MARKER_VERSION
                    and marker.get("location") == storage.location
                    and isinstance(marker.get("checkpoint_id"), int)
                    and marker["checkpoint_id"] < metadata.checkpoint_id
                    and marker.get("max_parallelism") == max_parallelism == metadata.max_parallelism
                    and marker.get("key_group_range") == [r.start, r.end]):
                return None
            chains, states, handle_file = marker.get("chains"), marker.get("states"), marker.get("handle_file")
            if not (isinstance(chains, dict) and isinstance(handle_file, str) and isinstance(states, list)
                    and all(isinstance(s, dict) and "name" in s for s in states)):
                return None
            files, distinct = chains["files"], chains["chains"]
            held: dict[int, tuple[str, ...]] = {}
            for first, last, at in chains["runs"]:
                if not (r.start <= first <= last <= r.end) or at < 0:
                    return None
                chain = tuple(str(files[i]) for i in distinct[at])
                held.update(dict.fromkeys(range(first, last + 1), chain))
            return int(marker["checkpoint_id"]), handle_file, states, held
        except (TypeError, ValueError, KeyError, IndexError):
            return None  # a marker of another shape: restore instead

    def remove_marker(self) -> None:
        """The database no longer is the state the marker vouches for (it is being written)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, _MARKER))

    def write_marker(self, storage: CheckpointStorage, checkpoint_id: int, handle: KeyedStateHandle,
                     states: list[dict[str, Any]], max_parallelism: int,
                     chains: dict[int, tuple[str, ...]] | None = None) -> None:
        """Vouch for the database (flushed, closed or not) as the state ``handle`` holds; the caller holds
        ``marker_lock`` and has checked that nothing was written since the snapshot's capture. ``chains``: per key
        group, the files of the chain the database holds (for a later catch-up: :meth:`behind`)."""
        r = self.key_group_range
        marker: dict[str, Any] = {
            "version": WARM_MARKER_VERSION, "location": storage.location, "checkpoint_id": checkpoint_id,
            "max_parallelism": max_parallelism, "key_group_range": [r.start, r.end], "handle_file": handle.file,
            "states": states}
        if chains is not None:
            marker["chains"] = _chains_json(chains)
        path = os.path.join(self.path, _MARKER)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


def _chains_json(chains: dict[int, tuple[str, ...]]) -> dict[str, Any]:
    """Per key group chain files as a marker holds them, growing with the distinct chains, not the key groups:
    the files, the distinct chains (lists of file indexes) and runs of key groups ``[first, last, chain index]``
    (key groups with no chain are left out)."""
    files = sorted({f for chain in chains.values() for f in chain})
    index = {f: i for i, f in enumerate(files)}
    distinct: dict[tuple[str, ...], int] = {}
    runs: list[list[int]] = []
    for kg in sorted(chains):
        at = distinct.setdefault(chains[kg], len(distinct))
        if runs and runs[-1][1] == kg - 1 and runs[-1][2] == at:
            runs[-1][1] = kg
        else:
            runs.append([kg, kg, at])
    return {"files": files, "chains": [[index[f] for f in chain] for chain in distinct], "runs": runs}


def _overlapping_warm(parent: str, r: KeyGroupRange) -> dict[str, KeyGroupRange]:
    """The warm directories (and lock files) under ``parent`` of ranges that overlap ``r`` but are not it, by
    name."""
    out = {}
    for entry in os.listdir(parent):
        m = _RANGE_NAME.fullmatch(entry)
        if m is None:
            continue
        start, end = int(m[1]), int(m[2])
        if (start, end) != (r.start, r.end) and start <= r.end and end >= r.start and start <= end:
            out[m[0].removesuffix(".lock")] = KeyGroupRange(start, end)
    return out


def _take_moved(parent: str, path: str, secret: bytes, r: KeyGroupRange, takeover: Takeover = (None, frozenset())
                ) -> tuple[dict[str, Any] | None, KeyGroupRange | None]:
    """With no kept database of range ``r`` itself: take over the one of the overlapping range that shares the most
    key groups with it (boundaries moved, or a rescale), if its sealed marker and files check out. Its directory
    becomes ``path`` (under both locks); its marker is removed at once (it vouches for the old range only) and
    returned with the old range, for the restore, which drops the key groups that left and restores those that
    arrived. (None, None) when there is none to take. ``takeover`` (the range given to this one, those given to
    others) puts the given range first and leaves the others' alone."""
    given, others = takeover
    candidates = sorted(((name, old) for name, old in _overlapping_warm(parent, r).items()
                         if (old.start, old.end) not in others),
                        key=lambda nr: ((nr[1].start, nr[1].end) != given, -len(nr[1].intersection(r)), nr[1].start))
    for name, old in candidates:
        lock_file = _lock_range(parent, name)
        if lock_file is None:
            continue  # a running backend holds it
        try:
            old_path = os.path.join(parent, name)
            if not os.path.isdir(old_path):
                continue
            marker = _open_kept(old_path, secret)
            if marker is None or marker.get("key_group_range") != [old.start, old.end]:
                continue
            shutil.rmtree(path)
            os.rename(old_path, path)
            os.remove(os.path.join(path, _MARKER))
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(parent, name + ".lock"))
            return marker, old
        finally:
            lock_file.close()
    return None, None


_swept: dict[str, float] = {}   # warm root -> when this process last swept it (time.monotonic)
_sweep_lock = threading.Lock()
#: A process sweeps a warm root at most this often (seconds): a sweep lists every job directory of the host.
SWEEP_INTERVAL_SECONDS = 3600.0


def sweep_unused_jobs(root: str, keep: str, retention: float = WARM_RETENTION_SECONDS) -> list[str]:
    """Delete the job directories under warm root ``root`` (``<root>/<location>/<job>``, see
    ``runtime.subtask_state.warm_directory``) that no backend claimed for ``retention`` seconds, except ``keep``
    (the caller's own), and each location directory left empty. A job directory of which a running backend holds
    any range's lock stays, however old. At most once per :data:`SWEEP_INTERVAL_SECONDS` per root and process;
    returns the job directories deleted. Never raises for what it finds: a directory it cannot read or delete is
    left for a later sweep."""
    now_mono = time.monotonic()
    with _sweep_lock:
        last = _swept.get(root)
        if last is not None and now_mono - last < SWEEP_INTERVAL_SECONDS:
            return []
        _swept[root] = now_mono
    deadline = time.time() - retention
    keep = os.path.normpath(keep)
    deleted: list[str] = []
    for location in _subdirectories(root):
        for job in _subdirectories(location):
            if os.path.normpath(job) != keep and _remove_if_unused(job, deadline):
                deleted.append(job)
        with contextlib.suppress(OSError):
            os.rmdir(location)   # only when empty
    if deleted:
        log.info("warm state: deleted %d job directories under %s unclaimed for %.0f s or more", len(deleted), root,
                 retention)
    return deleted


def _subdirectories(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _remove_if_unused(job: str, deadline: float) -> bool:
    """Delete job directory ``job`` if nothing in it was used after ``deadline`` (its own and its lock files'
    modification times) and no backend holds any of its ranges' locks; True if it was deleted."""
    try:
        check_private(job)
        with os.scandir(job) as it:
            entries = list(it)
        last_use = max([os.lstat(job).st_mtime] + [e.stat(follow_symlinks=False).st_mtime
                                                   for e in entries if e.name.endswith(".lock")])
    except OSError:
        return False
    if last_use > deadline:
        return False
    locks: list[Any] = []
    try:
        for e in entries:
            if e.name.endswith(".lock") and _RANGE_NAME.fullmatch(e.name):
                lock_file = _lock_range(job, e.name[:-len(".lock")])
                if lock_file is None:
                    return False   # a running backend holds this range
                locks.append(lock_file)
        shutil.rmtree(job, ignore_errors=True)   # the locks go with it, while held (see _lock_range)
        return not os.path.lexists(job)
    except OSError:
        return False
    finally:
        for lock_file in locks:
            lock_file.close()


__all__ = ["SWEEP_INTERVAL_SECONDS", "WARM_MARKER_VERSION", "WARM_RETENTION_SECONDS", "Takeover", "WarmDirectory",
           "marker_seal", "seal_kept", "sweep_unused_jobs"]
