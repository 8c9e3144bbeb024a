"""Restore planning: which old keyed handles, and which of their key groups, a new subtask reads.

Key groups are the unit of redistribution (Flink's ``StateAssignmentOperation``): a subtask of any new parallelism
owns a contiguous ``KeyGroupRange`` and reads, from each old subtask's file whose range intersects it, exactly the
intersection. The number of key groups (max parallelism) is fixed for the life of the state: a key's key group is
``murmur(hash) % max_parallelism``, so another max parallelism would put every key in another group.
"""

from __future__ import annotations

from keygroups._ranges import KeyGroupRange, check_max_parallelism
from keygroups.checkpoint.metadata import CheckpointMetadata, KeyedStateHandle
from keygroups.errors import CorruptSnapshotError, StateMigrationError


def check_restore_max_parallelism(metadata: CheckpointMetadata, max_parallelism: int) -> None:
    """StateMigrationError unless the job's ``max_parallelism`` equals the checkpoint's, as Flink refuses it."""
    mp = check_max_parallelism(max_parallelism)
    if mp != metadata.max_parallelism:
        raise StateMigrationError(
            f"cannot restore checkpoint {metadata.checkpoint_id} (job {metadata.job_id!r}), written with "
            f"max_parallelism={metadata.max_parallelism}, into a job with max_parallelism={mp}: the max parallelism "
            f"cannot change across a restore, because it fixes the key groups every key is assigned to. Restore "
            f"with max_parallelism={metadata.max_parallelism} (any parallelism from 1 to "
            f"{metadata.max_parallelism} works), or start without this state.")


def plan_keyed_restore(metadata: CheckpointMetadata, new_range: KeyGroupRange, *,
                       max_parallelism: int | None = None) -> list[tuple[KeyedStateHandle, KeyGroupRange]]:
    """The ``(old handle, key groups to read from it)`` pairs for a subtask that now owns ``new_range``, in
    key-group order; only handles whose range intersects ``new_range`` appear. Key groups no handle covers had no
    state. With ``max_parallelism`` given, a changed max parallelism raises StateMigrationError first; a
    ``new_range`` past the checkpoint's key groups does too (it can only come from another max parallelism)."""
    if max_parallelism is not None:
        check_restore_max_parallelism(metadata, max_parallelism)
    if not isinstance(new_range, KeyGroupRange):
        raise TypeError(f"new_range must be a KeyGroupRange, got {type(new_range).__name__}")
    if new_range and new_range.end >= metadata.max_parallelism:
        raise StateMigrationError(
            f"key groups {new_range} do not exist in checkpoint {metadata.checkpoint_id}, written with "
            f"max_parallelism={metadata.max_parallelism} (key groups 0..{metadata.max_parallelism - 1}): the max "
            f"parallelism cannot change across a restore")
    handles = sorted((h for h in metadata.keyed_handles if h.key_group_range),
                     key=lambda h: h.key_group_range.start)
    for prev, cur in zip(handles, handles[1:]):
        if prev.key_group_range.end >= cur.key_group_range.start:
            raise CorruptSnapshotError(
                f"checkpoint {metadata.checkpoint_id} has overlapping keyed handles: subtask {prev.subtask} "
                f"{prev.key_group_range} and subtask {cur.subtask} {cur.key_group_range}")
    plan = []
    for h in handles:
        part = h.key_group_range.intersection(new_range)
        if part:
            plan.append((h, part))
    return plan
