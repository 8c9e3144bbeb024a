"""Restore planning from the metadata alone: what a subtask of a new parallelism reads of the old state files.

Keyed state (:func:`plan_keyed_restore`): key groups are the unit of redistribution (Flink's
``StateAssignmentOperation``). A subtask of any new parallelism owns a contiguous ``KeyGroupRange`` and reads, from
each old subtask's file whose range intersects it, exactly the intersection. The number of key groups (max
parallelism) is fixed for the life of the state: a key's key group is ``murmur(hash) % max_parallelism``, so another
max parallelism would put every key in another group.

Operator state (:func:`plan_operator_restore`, Flink's ``RoundRobinOperatorStateRepartitioner``): lists of elements
are the unit. Per state, by its :class:`~keygroups.checkpoint.metadata.DistributionMode`: SPLIT_DISTRIBUTE lists are
concatenated and cut evenly (:func:`split_sizes`), UNION lists go whole to every subtask, and each subtask reads one
old copy of a BROADCAST state. The plan is runs of elements with their byte ranges; ``operator_format`` reads them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from keygroups._ranges import KeyGroupRange, check_max_parallelism
from keygroups.checkpoint.metadata import (
    CheckpointMetadata,
    DistributionMode,
    KeyedStateHandle,
    OperatorStateHandle,
    OperatorStateMeta,
    keyed_handles_by_range,
)
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
    try:
        handles = keyed_handles_by_range(metadata.keyed_handles)
    except ValueError as e:
        raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id} is corrupt, overlapping: {e}") from None
    plan = []
    for h in handles:
        part = h.key_group_range.intersection(new_range)
        if part:
            plan.append((h, part))
    return plan


# ---- operator state -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementRun:
    """A contiguous run of one old subtask's elements of one state, to be read by one new subtask.

    ``first``/``stop``: element indices ``[first, stop)`` in the old subtask's list. ``byte_range``: the run's exact
    bytes in ``file``. ``read_range``: ``byte_range`` widened to whole checksum blocks (what is actually read).
    """

    file: str
    old_subtask: int
    state: str
    mode: DistributionMode
    first: int
    stop: int
    byte_range: tuple[int, int]
    read_range: tuple[int, int]

    def __len__(self) -> int:
        return self.stop - self.first


def split_sizes(total: int, parallelism: int, start: int = 0) -> tuple[list[tuple[int, int]], int]:
    """How Flink's round-robin repartitioner cuts ``total`` elements for ``parallelism`` subtasks.

    Returns ``([(subtask, count), ...] in the order the concatenated list is handed out, next start)``: subtasks
    are visited from ``start`` on, wrapping; the first ``total % parallelism`` of them get one element more, and
    the first one that gets no extra element is where the next state starts, so extras rotate across states.
    """
    if parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {parallelism}")
    base, remainder = divmod(total, parallelism)
    order: list[tuple[int, int]] = []
    next_start = start
    for i in range(parallelism):
        subtask = (i + start) % parallelism
        count = base
        if remainder > 0:
            count += 1
            remainder -= 1
        elif remainder == 0:
            next_start = subtask
            remainder -= 1
        order.append((subtask, count))
    return order, next_start


def _run(handle: OperatorStateHandle, name: str, meta: OperatorStateMeta, first: int, stop: int) -> ElementRun:
    """Elements ``[first, stop)`` of state ``name`` in ``handle``, with their bytes and checksum blocks."""
    if first >= stop:   # nothing to read, but the state (mode, serializers) is still restored
        at = meta.bound(first)
        return ElementRun(handle.file, handle.subtask, name, meta.mode, first, first, (at, at), (at, at))
    starts = meta.block_starts
    b_first = bisect.bisect_right(starts, first) - 1
    b_last = bisect.bisect_right(starts, stop - 1)   # block after the one holding stop-1
    read_lo = meta.bound(starts[b_first])
    read_hi = meta.bound(starts[b_last]) if b_last < len(starts) else meta.end
    return ElementRun(handle.file, handle.subtask, name, meta.mode, first, stop,
                      (meta.bound(first), meta.bound(stop)), (read_lo, read_hi))


def _states_of(handles: Sequence[OperatorStateHandle], operator_id: str | None
               ) -> dict[str, list[tuple[OperatorStateHandle, OperatorStateMeta]]]:
    """State name -> its per-old-subtask pieces, in old subtask order. Each handle is valid on its own (checked when
    built); here the handles must agree: one per subtask, and one mode and serializers per state."""
    for h in handles:
        if not isinstance(h, OperatorStateHandle):
            raise TypeError(f"handles must be OperatorStateHandle objects (OperatorStateHandle.from_json reads one "
                            f"from JSON), got {type(h).__name__}")
    chosen = sorted((h for h in handles if operator_id is None or h.operator_id == operator_id),
                    key=lambda h: h.subtask)
    subtasks = [h.subtask for h in chosen]
    if len(set(subtasks)) != len(subtasks):
        raise CorruptSnapshotError(f"operator {operator_id!r}: two handles for the same subtask ({subtasks})")
    by_name: dict[str, list[tuple[OperatorStateHandle, OperatorStateMeta]]] = {}
    for h in chosen:
        for name, meta in h.states.items():
            pieces = by_name.setdefault(name, [])
            if pieces and (pieces[0][1].mode, pieces[0][1].serializers) != (meta.mode, meta.serializers):
                raise CorruptSnapshotError(f"operator state {name!r}: subtasks {pieces[0][0].subtask} and "
                                           f"{h.subtask} disagree on its mode or serializers")
            pieces.append((h, meta))
    return by_name


def plan_operator_restore(handles: Sequence[OperatorStateHandle], new_parallelism: int, *,
                          operator_id: str | None = None) -> list[list[ElementRun]]:
    """Which element runs each of ``new_parallelism`` subtasks reads, from the old handles alone (no file I/O).

    SPLIT_DISTRIBUTE states (in name order) are cut as :func:`split_sizes` says over the old lists concatenated in
    old subtask order; UNION states go whole to everyone; new subtask ``i`` reads a BROADCAST state from the
    ``i % k``-th of the ``k`` old subtasks that hold it (each holds a full copy), as Flink does. Unlike Flink, an
    unchanged parallelism is rebalanced too (Flink hands the old lists back as they were), so lists are always
    balanced after a restore. ``operator_id`` picks one operator's handles when several share a checkpoint.
    """
    if not isinstance(new_parallelism, int) or new_parallelism < 1:
        raise ValueError(f"new_parallelism must be an int >= 1, got {new_parallelism!r}")
    plan: list[list[ElementRun]] = [[] for _ in range(new_parallelism)]
    start = 0
    for name, pieces in sorted(_states_of(handles, operator_id).items()):
        mode = pieces[0][1].mode
        if mode is DistributionMode.UNION:
            runs = [_run(h, name, meta, 0, len(meta)) for h, meta in pieces if len(meta)]
            for subtask_runs in plan:
                subtask_runs.extend(runs)
        elif mode is DistributionMode.BROADCAST:
            for i, subtask_runs in enumerate(plan):
                h, meta = pieces[i % len(pieces)]
                subtask_runs.append(_run(h, name, meta, 0, len(meta)))   # kept even when empty: the state exists
        else:
            order, start = split_sizes(sum(len(meta) for _, meta in pieces), new_parallelism, start)
            k, pos = 0, 0   # cursor into the concatenation: piece k, element pos
            for subtask, count in order:
                while count > 0:
                    while pos >= len(pieces[k][1]):
                        k, pos = k + 1, 0
                    h, meta = pieces[k]
                    take = min(count, len(meta) - pos)
                    plan[subtask].append(_run(h, name, meta, pos, pos + take))
                    pos += take
                    count -= take
        # a subtask that gets no elements must still know the state was restored, with its mode and serializers
        for subtask_runs in plan:
            if not subtask_runs or subtask_runs[-1].state != name:
                subtask_runs.append(_run(pieces[0][0], name, pieces[0][1], 0, 0))
    return plan
