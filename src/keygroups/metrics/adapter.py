"""The one place that reads a committed batch for metrics: :func:`batch_metrics`.

Everything else in :mod:`keygroups.metrics` consumes :class:`~keygroups.metrics.BatchMetrics`; only this module
knows where each figure lives in what the batch's spine hands over once a batch has committed
(:class:`~keygroups.runtime.batch.CommittedBatch`): its :class:`~keygroups.runtime.report.BatchReport` (the batch's
figures, the assignment's decision, the driver's phases), its subtasks' typed reports (their per-key-group counts,
which the checkpoint keeps only merged into decayed load figures, and how each key group's state came), its plan
(the restore point, the ranges, the streaming batch) and its checkpoint (state bytes per key group, from the keyed
handles; the decayed load figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from keygroups._ranges import KeyGroupRange, flink_boundaries
from keygroups.checkpoint import CheckpointMetadata
from keygroups.metrics.model import (
    RESTORE_CAUGHT_UP,
    RESTORE_COLD,
    RESTORE_NONE,
    RESTORE_WARM,
    BatchMetrics,
    KeyGroupFigures,
    SubtaskMetrics,
)
from keygroups.runtime.assignment import (
    AssignmentDecision,
    checkpoint_boundaries,
    checkpoint_loads,
    decode_counts,
    key_group_state_bytes,
    warm_takeover,
)
from keygroups.runtime.batch import CommittedBatch
from keygroups.runtime.report import RestoreInfo, SubtaskReport

#: A subtask report's restore mode -> the code of every key group of its range, for reports without runs.
_MODE_CODES = {"warm": RESTORE_WARM, "caught-up": RESTORE_CAUGHT_UP, "cold": RESTORE_COLD, "moved": RESTORE_COLD,
               "new": RESTORE_NONE}


def batch_metrics(batch: CommittedBatch, *, spark_seconds: float | None = None,
                  task_seconds: Mapping[int, float] | None = None) -> BatchMetrics:
    """The :class:`~keygroups.metrics.BatchMetrics` of ``batch``, a batch the spine ran and committed (not a replay:
    its plan and its subtasks' own reports are needed, as the checkpoint alone does not hold the batch's own
    per-key-group counts; ValueError otherwise). ``spark_seconds`` (Spark's own time for the batch's jobs) and
    ``task_seconds`` (subtask -> its Spark task's duration) are the caller's (None: not known).

    The cost grows with the key groups and the subtasks (a few numpy passes over ``max_parallelism`` figures, and
    the chains of the restore point's key groups when the ranges changed); no state file is read."""
    plan, report, metadata = batch.plan, batch.report, batch.metadata
    if batch.replayed or plan is None:
        raise ValueError(f"checkpoint {metadata.checkpoint_id} was replayed: its metrics are those its first run "
                         "recorded")
    mp, p = plan.max_parallelism, plan.parallelism
    boundaries = tuple(plan.boundaries or flink_boundaries(mp, p))
    by_subtask = {r.subtask: r for r in batch.reports}
    if sorted(by_subtask) != list(range(p)):
        raise ValueError(f"checkpoint {metadata.checkpoint_id}: reports came from subtasks {sorted(by_subtask)}, "
                         f"expected one from each of 0..{p - 1}")
    records, calls, timers = (np.zeros(mp, dtype=np.int64) for _ in range(3))
    restore = np.full(mp, RESTORE_NONE, dtype=np.int8)
    subtasks = []
    for i in range(p):
        r = by_subtask[i]
        own = KeyGroupRange(boundaries[i], boundaries[i + 1] - 1)
        for counts, target, what in ((r.key_group_records, records, "key_group_records"),
                                     (r.key_group_calls, calls, "key_group_calls"),
                                     (r.key_group_timers, timers, "key_group_timers")):
            if counts is None:
                raise ValueError(f"checkpoint {metadata.checkpoint_id}: subtask {i}'s report has no {what}: the "
                                 "reports the subtasks sent are needed (a checkpoint keeps only decayed figures)")
            target[own.start:own.end + 1] = np.rint(decode_counts(counts, len(own), f"subtask {i}'s {what}"))
        _restore_codes(restore, own, r.restored)
        subtasks.append(_subtask(r, own, None if task_seconds is None else task_seconds.get(i)))
    previous = plan.previous
    decision = report.assignment
    changed, moved = _moved(previous, boundaries, mp, decision)
    loads = checkpoint_loads(metadata)
    state_bytes = key_group_state_bytes(metadata)
    streaming = plan.streaming
    return BatchMetrics(
        job=metadata.job_id, checkpoint_id=metadata.checkpoint_id, timestamp_ms=metadata.timestamp_ms,
        parallelism=p, max_parallelism=mp, boundaries=boundaries,
        previous_parallelism=None if previous is None else previous.parallelism,
        previous_max_parallelism=None if previous is None else previous.max_parallelism,
        records_in=report.records_in, records_late=report.records_late, records_out=report.records_out,
        watermark_before=report.watermark_before, watermark_after=report.watermark_after,
        timers_registered=report.timers_registered, timers_fired=report.timers_fired,
        timers_pending=report.timers_pending or 0, state_entries=report.state_entries,
        state_bytes=report.state_bytes, bytes_restored=report.bytes_restored, bytes_written=report.bytes_written,
        assignment=None if decision is None else decision.assignment,
        ranges_moved=False if decision is None else decision.moved,
        moved_key_groups=int(np.count_nonzero(changed)), moved_bytes=int(moved.sum()),
        max_over_mean=None if decision is None else decision.max_over_mean,
        decision=None if decision is None else decision.to_json(),
        plan_seconds=report.seconds.plan, commit_seconds=report.seconds.commit,
        wall_seconds=report.wall_seconds or None, spark_seconds=spark_seconds, subtasks=tuple(subtasks),
        key_groups=KeyGroupFigures(records=records, calls=calls, timers_fired=timers,
                                   state_bytes=state_bytes.astype(np.int64), moved_bytes=moved,
                                   decayed_work=loads.calls + loads.timers, restore=restore),
        streaming_query_id=None if streaming is None else streaming.query_id,
        streaming_batch_id=None if streaming is None else streaming.batch_id,
        parallelism_reason=report.parallelism_reason,
    )


def _subtask(r: SubtaskReport, own: KeyGroupRange, spark_task_seconds: float | None) -> SubtaskMetrics:
    s = r.seconds
    return SubtaskMetrics(
        subtask=r.subtask, first_key_group=own.start, last_key_group=own.end, records_in=r.records_in,
        records_late=r.records_late, records_out=r.records_out, restore_mode=r.restored.mode,
        bytes_restored=r.restored.bytes_read, bytes_written=r.snapshot_bytes + r.raw_keyed_bytes,
        state_entries=r.state_entries, restore_seconds=s.restore, prepare_seconds=s.prepare,
        process_seconds=s.process, timers_seconds=s.timers, snapshot_seconds=s.snapshot,
        spark_task_seconds=spark_task_seconds)


def _restore_codes(codes: npt.NDArray[np.int8], own: KeyGroupRange, restored: RestoreInfo) -> None:
    """How each key group of ``own`` came: the report's runs of warm, caught-up and restored key groups where it
    has them, else its mode for the whole range."""
    if restored.warm_key_groups is None or restored.mode == "new":
        codes[own.start:own.end + 1] = _MODE_CODES[restored.mode]
        return
    for runs, code in ((restored.warm_key_groups, RESTORE_WARM), (restored.caught_up_key_groups, RESTORE_CAUGHT_UP),
                       (restored.restored_key_groups, RESTORE_COLD)):
        for run in runs or ():
            codes[max(run.start, own.start):min(run.end, own.end) + 1] = code


def _moved(previous: CheckpointMetadata | None, boundaries: Sequence[int], mp: int,
           decision: AssignmentDecision | None) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Per key group, whether it changed holder from ``previous``'s ranges to ``boundaries`` and its moved bytes: its
    state in ``previous`` (its chain there) when it did, 0 otherwise (none changed holder when the max parallelism
    changed: every key group is new then, and none when the ranges are the same).

    Warm state belongs to a range, not to a subtask number: on new ranges each subtask takes over the warm state of
    at most one previous range (the decision's ``takeover``, which the spine ships to the subtasks), so a key group
    kept its holder when the subtask that owns it now took over the previous range that held it, whatever the two
    subtasks' numbers. The others changed holder: they are the key groups the subtasks read from the checkpoint for
    state they did not hold (their reports' ``restored_key_groups`` with warm state at hand, the previous holders'
    ``dropped_key_groups``), exactly the decision's ``moved_key_groups`` and ``moved_bytes``. Without a decision
    naming that takeover, it is the best one (:func:`~keygroups.runtime.assignment.warm_takeover`), as the driver
    ships it."""
    moved = np.zeros(mp, dtype=np.int64)
    if previous is None or previous.max_parallelism != mp:
        return np.zeros(mp, dtype=bool), moved
    before = tuple(int(b) for b in checkpoint_boundaries(previous))
    after = tuple(int(b) for b in boundaries)
    if before == after:
        return np.zeros(mp, dtype=bool), moved
    state = key_group_state_bytes(previous)
    takeover: tuple[int | None, ...] | None = None
    if (decision is not None and decision.previous is not None and tuple(decision.previous) == before
            and tuple(decision.boundaries) == after and len(decision.takeover) == len(after) - 1):
        takeover = tuple(decision.takeover)
    if takeover is None:
        takeover = warm_takeover(before, after, state)
    kept = np.zeros(mp, dtype=bool)
    for i, j in enumerate(takeover):
        if j is not None:   # subtask i holds the key groups it shares with the previous range j it took over
            kept[max(after[i], before[j]):min(after[i + 1], before[j + 1])] = True
    moved[~kept] = state[~kept].astype(np.int64)
    return ~kept, moved


__all__ = ["batch_metrics"]
