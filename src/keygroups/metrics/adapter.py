"""The one place that reads a committed batch's reports for metrics: :func:`batch_metrics`.

Everything else in :mod:`keygroups.metrics` consumes :class:`~keygroups.metrics.BatchMetrics`; only this module
knows where each figure lives in what a batch commits: the checkpoint's ``properties`` (its subtask reports, timer
summary, watermarks, driver seconds, the assignment's decision, ranges and decayed load figures), its keyed handles
(state bytes per key group) and the reports the subtasks sent (their per-key-group counts, which the checkpoint
keeps only merged into decayed load figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, chain_stats
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
    CALLS_REPORT,
    DECISION_PROPERTY,
    RECORDS_REPORT,
    TIMERS_REPORT,
    checkpoint_boundaries,
    checkpoint_loads,
    decode_counts,
)
from keygroups.state.timers import NO_WATERMARK

#: The checkpoint property a streaming batch records its query and Spark batch id in, where the runner does.
STREAMING_PROPERTY = "streaming_batch"


def batch_metrics(metadata: CheckpointMetadata, reports: Sequence[Mapping[str, Any]],
                  previous: CheckpointMetadata | None, *, wall_seconds: float | None = None,
                  spark_seconds: float | None = None, commit_seconds: float | None = None,
                  task_seconds: Mapping[int, float] | None = None) -> BatchMetrics:
    """The :class:`~keygroups.metrics.BatchMetrics` of the batch that committed ``metadata``.

    ``reports`` are its keyed subtasks' reports as the driver got them (with their per-key-group counts: a report
    without them raises ValueError, as the checkpoint alone does not hold the batch's own counts); ``previous`` is
    the checkpoint or savepoint the batch restored (None: the job's first batch), for the rescale's figures.
    ``wall_seconds`` (the batch on the driver, from the call to the commit), ``spark_seconds`` (Spark's own time for
    its jobs), ``commit_seconds`` and ``task_seconds`` (subtask -> its Spark task's duration) are the caller's
    measurements (None: not measured).

    The cost grows with the key groups and the subtasks (a few numpy passes over ``max_parallelism`` figures, and
    the chains of the restore point's key groups when the ranges changed); no state file is read."""
    properties = metadata.properties
    mp, p = metadata.max_parallelism, metadata.parallelism
    boundaries = checkpoint_boundaries(metadata)
    loads = checkpoint_loads(metadata)
    records, calls, timers = (np.zeros(mp, dtype=np.int64) for _ in range(3))
    restore = np.full(mp, RESTORE_NONE, dtype=np.int8)
    by_subtask = {int(r["subtask"]): r for r in reports}
    if sorted(by_subtask) != list(range(p)):
        raise ValueError(f"checkpoint {metadata.checkpoint_id}: reports came from subtasks {sorted(by_subtask)}, "
                         f"expected one from each of 0..{p - 1}")
    subtasks = []
    for i in range(p):
        r = by_subtask[i]
        own = KeyGroupRange(boundaries[i], boundaries[i + 1] - 1)
        for key, target in ((RECORDS_REPORT, records), (CALLS_REPORT, calls), (TIMERS_REPORT, timers)):
            if r.get(key) is None:
                raise ValueError(f"checkpoint {metadata.checkpoint_id}: subtask {i}'s report has no {key!r}: pass "
                                 "the reports the subtasks sent (a checkpoint keeps only the decayed load figures)")
            target[own.start:own.end + 1] = np.rint(decode_counts(r[key], len(own), f"subtask {i}'s {key}"))
        restored = r.get("restored") or {}
        _restore_codes(restore, own, restored)
        seconds = r.get("seconds") or {}
        subtasks.append(SubtaskMetrics(
            subtask=i, first_key_group=own.start, last_key_group=own.end, records_in=int(r.get("records_in", 0)),
            records_late=int(r.get("records_late", 0)), records_out=int(r.get("records_out", 0)),
            restore_mode=str(restored.get("mode", "new")), bytes_restored=int(restored.get("bytes_read", 0)),
            bytes_written=int(r.get("snapshot_bytes", 0)) + int(r.get("raw_keyed_bytes", 0)),
            state_entries=None if r.get("state_entries") is None else int(r["state_entries"]),
            restore_seconds=float(seconds.get("restore", 0.0)), prepare_seconds=float(seconds.get("prepare", 0.0)),
            process_seconds=float(seconds.get("process", 0.0)), timers_seconds=float(seconds.get("timers", 0.0)),
            snapshot_seconds=float(seconds.get("snapshot", 0.0)),
            spark_task_seconds=None if task_seconds is None else task_seconds.get(i)))
    decision: Mapping[str, Any] | None = properties.get(DECISION_PROPERTY)
    moved = _moved_bytes(previous, boundaries, mp)
    timer_summary = properties.get("timers") or {}
    entries = [s.state_entries for s in subtasks]
    driver = properties.get("driver_seconds") or {}
    streaming = properties.get(STREAMING_PROPERTY) or {}
    return BatchMetrics(
        job=metadata.job_id, checkpoint_id=metadata.checkpoint_id, timestamp_ms=metadata.timestamp_ms,
        parallelism=p, max_parallelism=mp, boundaries=tuple(boundaries),
        previous_parallelism=None if previous is None else previous.parallelism,
        previous_max_parallelism=None if previous is None else previous.max_parallelism,
        records_in=sum(s.records_in for s in subtasks), records_late=int(properties.get("records_late", 0)),
        records_out=sum(s.records_out for s in subtasks),
        watermark_before=_watermark(properties.get("start_watermark")),
        watermark_after=_watermark(properties.get("watermark")),
        timers_registered=sum(int(t.get("registered", 0)) for t in timer_summary.values()),
        timers_fired=sum(int(t.get("fired", 0)) for t in timer_summary.values()),
        timers_pending=sum(int(t.get("queued", 0)) for t in timer_summary.values()),
        state_entries=sum(e for e in entries if e is not None) if None not in entries else None,
        state_bytes=int(loads.state_bytes.sum()),
        bytes_restored=sum(s.bytes_restored for s in subtasks), bytes_written=sum(s.bytes_written for s in subtasks),
        assignment=None if decision is None else decision.get("assignment"),
        ranges_moved=bool(decision.get("moved")) if decision is not None else False,
        moved_key_groups=int(decision.get("moved_key_groups", 0)) if decision is not None else 0,
        moved_bytes=int(decision.get("moved_bytes", 0)) if decision is not None else int(moved.sum()),
        max_over_mean=None if decision is None else decision.get("max_over_mean"),
        decision=decision,
        plan_seconds=float(driver.get("plan", 0.0)),
        commit_seconds=float(driver.get("commit", 0.0)) if commit_seconds is None else commit_seconds,
        wall_seconds=wall_seconds, spark_seconds=spark_seconds, subtasks=tuple(subtasks),
        key_groups=KeyGroupFigures(records=records, calls=calls, timers_fired=timers,
                                   state_bytes=loads.state_bytes.astype(np.int64), moved_bytes=moved,
                                   decayed_work=loads.calls + loads.timers, restore=restore),
        streaming_query_id=streaming.get("query"), streaming_batch_id=streaming.get("batch_id"),
        parallelism_reason=_reason(properties.get("parallelism_policy")),
    )


def _restore_codes(codes: npt.NDArray[np.int8], own: KeyGroupRange, restored: Mapping[str, Any]) -> None:
    """How each key group of ``own`` came, from a report's ``restored``: its runs of warm, caught-up and restored
    key groups where it has them, else its mode for the whole range."""
    if "warm_key_groups" in restored:
        for field, code in (("warm_key_groups", RESTORE_WARM), ("caught_up_key_groups", RESTORE_CAUGHT_UP),
                            ("restored_key_groups", RESTORE_COLD)):
            for start, end in restored.get(field) or ():
                codes[max(start, own.start):min(end, own.end) + 1] = code
        return
    code = {"warm": RESTORE_WARM, "caught-up": RESTORE_CAUGHT_UP, "cold": RESTORE_COLD,
            "moved": RESTORE_COLD}.get(restored.get("mode", "new"), RESTORE_NONE)
    codes[own.start:own.end + 1] = code


def _moved_bytes(previous: CheckpointMetadata | None, boundaries: Sequence[int], mp: int) -> npt.NDArray[np.int64]:
    """Per key group, its state in ``previous`` when its subtask changed from ``previous``'s ranges to
    ``boundaries`` (0 otherwise, and everywhere when the max parallelism changed: every key group is new then), as
    the assignment's decision counts its ``moved_bytes``."""
    moved = np.zeros(mp, dtype=np.int64)
    if previous is None or previous.max_parallelism != mp:
        return moved
    before = checkpoint_boundaries(previous)
    if tuple(before) == tuple(boundaries):
        return moved
    groups = np.arange(mp)
    owner_before = np.searchsorted(np.asarray(before[:-1]), groups, side="right") - 1
    owner_after = np.searchsorted(np.asarray(boundaries[:-1]), groups, side="right") - 1
    changed = np.flatnonzero(owner_before != owner_after)
    if not len(changed) or not previous.keyed_handles:
        return moved
    for kg, chain in chain_stats(previous, KeyGroupRange(0, mp - 1)).items():
        moved[kg] = chain.full_bytes + chain.delta_bytes
    keep = np.zeros(mp, dtype=bool)
    keep[changed] = True
    moved[~keep] = 0
    return moved


def _watermark(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value == NO_WATERMARK:
        return None
    return value


def _reason(decision: Any) -> str:
    if not isinstance(decision, dict):
        return "fixed"
    return f"{decision.get('policy')} chose {decision.get('chose')} for {decision.get('records')} records"


__all__ = ["batch_metrics", "STREAMING_PROPERTY"]
