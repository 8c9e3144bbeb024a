"""What one micro-batch did, as a user reads it: :class:`BatchReport`, built on the driver from the committed
checkpoint's metadata (its properties hold every subtask's report) and the driver's own timings.

Spark's ``StreamingQueryProgress`` is the model (input rows, the watermark, rows dropped by it, state rows, per-phase
durations); Flink's checkpoint statistics add what a rescalable job needs (how each subtask's state came: warm,
caught up or restored cold, and the bytes read and written). Everything here is plain numbers, computed from the
metadata and the reports alone: building a report opens no state file, so its cost grows with the number of
subtasks and key groups, never with the state.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from keygroups._ranges import key_group_range
from keygroups.checkpoint import CheckpointMetadata
from keygroups.checkpoint.planning import chain_stats
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.assignment import DECISION_PROPERTY, AssignmentDecision, checkpoint_boundaries
from keygroups.state.timers import NO_WATERMARK

#: The phases a batch's time is reported in, in the order they run.
PHASES = ("plan", "restore", "process", "snapshot", "commit")


@dataclass(frozen=True)
class PhaseSeconds:
    """Seconds a batch spent per phase. ``plan`` and ``commit`` are the driver's (finding the restore point, the
    batch's count and largest event time; writing ``_metadata``); ``restore``, ``process`` (records, then timers)
    and ``snapshot`` (output and state files) are the slowest subtask's, since subtasks run side by side."""

    plan: float = 0.0
    restore: float = 0.0
    process: float = 0.0
    snapshot: float = 0.0
    commit: float = 0.0


@dataclass(frozen=True)
class BatchReport:
    """One committed micro-batch in figures (see the module docs). Times are epoch milliseconds; a watermark or an
    event time is None where there is none (no event time seen yet, or no timestamp column)."""

    checkpoint_id: int
    job: str
    #: Whether the batch was a replay of a checkpoint already complete (nothing ran; the figures are the original
    #: run's).
    replayed: bool
    records_in: int
    #: Records at or before ``watermark_before``: dropped, or written to the late output.
    records_late: int
    records_out: int
    watermark_before: int | None
    watermark_after: int | None
    #: The smallest and largest event time among the batch's records, late ones included (None: no event time).
    event_time_min: int | None
    event_time_max: int | None
    parallelism: int
    #: Why this parallelism: ``"fixed"``, or what the parallelism policy saw and chose.
    parallelism_reason: str
    max_parallelism: int
    #: Key groups whose state was resumed in memory or on local disk (nothing read), caught up (read only the blocks
    #: committed since), or restored cold from the checkpoint files, counted per key group (a subtask whose range
    #: moved keeps some warm and restores only those that arrived); key groups of a job's first batch are in none.
    key_groups_warm: int
    key_groups_caught_up: int
    key_groups_cold: int
    bytes_restored: int
    #: Bytes of state files this checkpoint wrote itself (keyed and raw keyed; an incremental checkpoint writes only
    #: what changed).
    bytes_written: int
    #: Timers registered and fired in this batch (every time domain).
    timers_registered: int
    timers_fired: int
    #: Timers registered after the batch, every time domain: exactly those the checkpoint holds (None for a
    #: checkpoint written before keygroups counted them).
    timers_pending: int | None
    #: Entries of keyed state after the batch, the timers' own state included: an estimate where restored blocks
    #: are not merged yet (heap) and RocksDB's own estimate; a heap map state counts once per key; None when a
    #: backend gives none.
    state_entries: int | None
    #: Bytes a full restore of the checkpoint reads (every key group's chain: its full block and deltas).
    state_bytes: int
    seconds: PhaseSeconds
    #: The key-group ranges the batch ran with and why (see :class:`~keygroups.runtime.AssignmentDecision`: the
    #: assignment, whether the ranges moved, the load's max/mean under them, before, and under Flink's ranges, the
    #: key groups and bytes that changed owner); None for a checkpoint written before decisions were stored.
    assignment: AssignmentDecision | None = None

    @property
    def total_seconds(self) -> float:
        """The batch's time over all phases."""
        return sum(getattr(self.seconds, p) for p in PHASES)

    @property
    def late_share(self) -> float:
        """The share of the batch's records that were late (0.0 for an empty batch)."""
        return self.records_late / self.records_in if self.records_in else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able plain values (``seconds`` a dict of its phases)."""
        return asdict(self)

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """One line for logs and the console."""
        late = f", {self.records_late:,} late ({self.late_share:.0%})" if self.records_late else ""
        watermark = ""
        if self.watermark_after is not None:
            watermark = f", watermark {format_time(self.watermark_before)} -> {format_time(self.watermark_after)}"
        restored = f"warm {self.key_groups_warm}/caught-up {self.key_groups_caught_up}/cold {self.key_groups_cold}"
        phases = " ".join(f"{p} {getattr(self.seconds, p):.2f}" for p in PHASES)
        return (f"checkpoint {self.checkpoint_id}{' (replayed)' if self.replayed else ''}: {self.records_in:,} in"
                f"{late}, {self.records_out:,} out{watermark}; p={self.parallelism} ({self.parallelism_reason}); "
                f"key groups {restored}; {self.bytes_restored:,} B restored, {self.bytes_written:,} B written; timers "
                f"+{self.timers_registered} fired {self.timers_fired} pending "
                f"{'?' if self.timers_pending is None else self.timers_pending}; state "
                f"{'?' if self.state_entries is None else f'{self.state_entries:,}'} entries "
                f"{self.state_bytes:,} B; {self.total_seconds:.2f}s ({phases})"
                f"{'' if self.assignment is None else '; ranges ' + self.assignment.summary()}")

    @classmethod
    def from_checkpoint(cls, metadata: CheckpointMetadata, *, replayed: bool = False,
                        plan_seconds: float | None = None, commit_seconds: float | None = None) -> BatchReport:
        """The report of the committed checkpoint ``metadata`` (its subtask reports are in its properties); the
        driver's ``plan_seconds`` and ``commit_seconds`` default to what the batch stored (commit: 0.0, as the
        metadata is written by the commit it would time)."""
        properties = metadata.properties
        reports: Sequence[Mapping[str, Any]] = properties.get("reports") or []
        driver = properties.get("driver_seconds") or {}
        timers = properties.get("timers") or {}
        modes = {"warm": 0, "caught-up": 0, "cold": 0}
        for r in reports:
            restored = r.get("restored") or {}
            mode = restored.get("mode")
            if mode in ("warm", "caught-up", "cold", "moved") and "warm_key_groups" in restored:
                # per key group: a subtask whose range moved keeps some warm and reads only the ones that arrived
                modes["warm"] += _runs_size(restored.get("warm_key_groups"))
                modes["caught-up"] += _runs_size(restored.get("caught_up_key_groups"))
                modes["cold"] += _runs_size(restored.get("restored_key_groups"))
            elif mode in modes:
                modes[mode] += _range_size(r.get("key_group_range"))
        entries = [r.get("state_entries") for r in reports]
        known = [int(e) for e in entries if e is not None]
        ranges = [r["event_time_range"] for r in reports if r.get("event_time_range")]
        return cls(
            checkpoint_id=metadata.checkpoint_id,
            job=metadata.job_id,
            replayed=replayed,
            records_in=sum(int(r.get("records_in", 0)) for r in reports),
            records_late=int(properties.get("records_late", 0)),
            records_out=sum(int(r.get("records_out", 0)) for r in reports),
            watermark_before=_watermark(properties.get("start_watermark")),
            watermark_after=_watermark(properties.get("watermark")),
            event_time_min=min(lo for lo, _ in ranges) if ranges else None,
            event_time_max=max(hi for _, hi in ranges) if ranges else None,
            parallelism=metadata.parallelism,
            parallelism_reason=_reason(properties.get("parallelism_policy")),
            max_parallelism=metadata.max_parallelism,
            key_groups_warm=modes["warm"],
            key_groups_caught_up=modes["caught-up"],
            key_groups_cold=modes["cold"],
            bytes_restored=sum(int((r.get("restored") or {}).get("bytes_read", 0)) for r in reports),
            bytes_written=sum(int(r.get("snapshot_bytes", 0)) + int(r.get("raw_keyed_bytes", 0)) for r in reports),
            timers_registered=sum(int(t.get("registered", 0)) for t in timers.values()),
            timers_fired=sum(int(t.get("fired", 0)) for t in timers.values()),
            timers_pending=(sum(int(t["pending"]) for t in timers.values())
                            if timers and all("pending" in t for t in timers.values()) else None),
            state_entries=sum(known) if entries and len(known) == len(entries) else None,
            state_bytes=_state_bytes(metadata),
            seconds=PhaseSeconds(
                plan=float(driver.get("plan", 0.0)) if plan_seconds is None else plan_seconds,
                restore=_slowest(reports, "restore"),
                process=_slowest(reports, "prepare", "process", "timers"),
                snapshot=_slowest(reports, "snapshot"),
                commit=float(driver.get("commit", 0.0)) if commit_seconds is None else commit_seconds,
            ),
            assignment=_decision(metadata),
        )


def format_time(ms: int | None) -> str:
    """Epoch milliseconds as an ISO UTC time; ``none`` for None."""
    if ms is None:
        return "none"
    try:
        return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms (outside the calendar)"


def _decision(metadata: CheckpointMetadata) -> AssignmentDecision | None:
    stored = metadata.properties.get(DECISION_PROPERTY)
    if not isinstance(stored, dict):
        return None
    try:
        return AssignmentDecision.from_json(stored, checkpoint_boundaries(metadata))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id}: properties[{DECISION_PROPERTY!r}] is "
                                   f"not an assignment decision: {e}") from None


def _watermark(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value == NO_WATERMARK:
        return None
    return value


def _reason(decision: Any) -> str:
    if not isinstance(decision, dict):
        return "fixed"
    return f"{decision.get('policy')} chose {decision.get('chose')} for {decision.get('records')} records"


def _range_size(bounds: Any) -> int:
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
        return 0
    return max(0, int(bounds[1]) - int(bounds[0]) + 1)


def _runs_size(runs: Any) -> int:
    return sum(_range_size(run) for run in runs) if isinstance(runs, list) else 0


def _slowest(reports: Sequence[Mapping[str, Any]], *phases: str) -> float:
    """The largest time over subtasks of the sum of ``phases`` in their reports' ``seconds``."""
    return max((sum(float((r.get("seconds") or {}).get(p, 0.0)) for p in phases) for r in reports), default=0.0)


def _state_bytes(metadata: CheckpointMetadata) -> int:
    """Bytes of every key group's chain, from the handles alone."""
    if not metadata.keyed_handles:
        return 0
    everything = key_group_range(metadata.max_parallelism, 1, 0)
    return sum(c.full_bytes + c.delta_bytes for c in chain_stats(metadata, everything).values())


__all__ = ["BatchReport", "PhaseSeconds", "PHASES", "format_time"]
