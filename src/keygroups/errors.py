"""The exceptions keygroups raises, one small hierarchy.

Bad arguments raise the built-in ``ValueError`` / ``TypeError`` (their messages name the value and what is allowed);
everything about state, snapshots, checkpoints and stored inputs raises a ``KeyGroupsError`` subclass, so a caller
can tell "my input was wrong" from "the stored data cannot be used"::

    KeyGroupsError
    ├── StateMigrationError          a state cannot be read with what is registered now
    ├── CorruptDataError             stored bytes are not what keygroups wrote (catch this for "any corruption")
    │   └── CorruptSnapshotError     a snapshot file, a ``_metadata`` file or a state handle
    │       └── CorruptLogError      a partition log of ``keygroups.sources``
    ├── CheckpointNotFoundError      no such (complete) checkpoint or savepoint
    ├── ConcurrentCommitError        another writer committed first (this id, or after the planned-from one)
    ├── KeyGroupOutOfRangeError      a key given to a backend that does not own its key group
    └── UnsafeDeserializationError   pickled data without the caller's opt-in

``CorruptLogError`` sits under ``CorruptSnapshotError`` rather than beside it because the compiled frame scanner it
shares with the snapshot readers raises ``CorruptSnapshotError``, and callers written before ``CorruptDataError``
existed catch log corruption that way.
"""

from __future__ import annotations


class KeyGroupsError(Exception):
    """Base class of every keygroups-specific error."""


class StateMigrationError(KeyGroupsError):
    """A state cannot be restored with the serializer or settings registered now (incompatible serializer, a changed
    max parallelism, a state registered again as another kind)."""


class CorruptDataError(KeyGroupsError):
    """Stored bytes (a snapshot, its metadata, a log) are truncated, fail a checksum or are otherwise not what
    keygroups wrote."""


class CorruptSnapshotError(CorruptDataError):
    """A snapshot or metadata file, or a state handle, is truncated, fails its checksum or is otherwise not what
    keygroups wrote."""


class CorruptLogError(CorruptSnapshotError):
    """A partition file is not a keygroups log, or a complete record fails its checksum."""


class ConcurrentCommitError(KeyGroupsError, ValueError):
    """Another writer (a second driver on the same checkpoint location) committed first: this checkpoint id, or a
    checkpoint after the one this commit was planned from (compare-and-swap: a commit built on a stale restore point
    would lose that writer's updates). This commit published nothing, and the files its own batch wrote were
    removed. Also a ``ValueError``: the commit of an id that is already complete is refused, as any id that does not
    increase is.

    ``planned_from`` is the checkpoint the refused commit was planned from (None: none, the job's first) and
    ``newest`` the newest complete one found instead, when the refusal is of that kind (else both None)."""

    def __init__(self, message: str, *, planned_from: int | None = None, newest: int | None = None) -> None:
        super().__init__(message)
        self.planned_from = planned_from
        self.newest = newest


class StateSerializationError(KeyGroupsError, ValueError):
    """A state's serializer cannot write one of its values (an int beyond int64, a str with a lone surrogate, a value
    of another type): the error names the state, its serializer and the key, and the snapshot writes nothing."""


class DriverFencedError(ConcurrentCommitError):
    """A newer driver claimed this job's checkpoint location (its fencing token is higher): this driver may no longer
    commit. Nothing of the refused batch was published; start one driver per job and location, and let a restarted
    driver take over (it fences the old one)."""


class ReplayMismatchError(KeyGroupsError, ValueError):
    """A batch with an explicit checkpoint id that is already complete carries other records than the batch that
    completed it: answering with that checkpoint's output would silently drop this input, so it is refused."""


class CheckpointNotFoundError(KeyGroupsError):
    """The requested checkpoint or savepoint does not exist (or is incomplete: it has no ``_metadata``)."""


class KeyGroupOutOfRangeError(KeyGroupsError):
    """A key was given to a backend that does not own its key group: usually the sign of a key whose hash is not
    deterministic, or of records that were not partitioned by key group."""


class UnsafeDeserializationError(KeyGroupsError):
    """A snapshot holds pickled data and the caller did not opt in to unpickling it."""


class SinkCommitError(KeyGroupsError):
    """The checkpoint committed, but its sink's commit failed: its output is staged, not visible yet. The commit is
    retried before the driver's next batch and by a driver that restarts; do not run the batch's input again (its
    state changes are committed). ``checkpoint_id`` names the checkpoint."""

    def __init__(self, message: str, checkpoint_id: int) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id


# Messages raised from more than one module (Python and compiled), written once here.
def no_current_key_error() -> RuntimeError:
    """Keyed state was used before the backend had a current key."""
    return RuntimeError("no current key: call set_current_key(key) on the backend before using keyed state")


def none_added_error(state: str, kind: str) -> ValueError:
    """``None`` was added to a list or reducing state ``state`` (``kind`` names it, e.g. "ListState")."""
    return ValueError(f"state {state!r}: cannot add None to a {kind} (None means 'no value'); wrap the serializer "
                      "in a NullableSerializer and use a sentinel if you need to store nulls")


__all__ = [
    "KeyGroupsError",
    "StateMigrationError",
    "CorruptDataError",
    "CorruptSnapshotError",
    "CorruptLogError",
    "ConcurrentCommitError",
    "DriverFencedError",
    "ReplayMismatchError",
    "StateSerializationError",
    "CheckpointNotFoundError",
    "KeyGroupOutOfRangeError",
    "UnsafeDeserializationError",
    "SinkCommitError",
]
