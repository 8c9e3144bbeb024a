"""What one committed micro-batch did, per batch, per subtask and per key group: :class:`BatchMetrics`.

A :class:`~keygroups.runtime.report.BatchReport` is what a user reads of the last batch; a ``BatchMetrics`` is what a
dashboard plots over many: the same batch figures, plus each subtask's and each key group's, as plain numbers and
numpy arrays. Every figure is of the batch alone (``records`` per key group: the records that batch processed, not
the decayed load the balanced assignment weighs, which is ``decayed_work``), except those named as state after the
batch (``state_bytes``, ``state_entries``, ``timers_pending``).

They are built by :func:`keygroups.metrics.batch_metrics` from what a batch commits, kept beside the checkpoints by
:class:`~keygroups.metrics.MetricsStore`, exported to Prometheus by :class:`~keygroups.metrics.PrometheusExporter`
and drawn by :func:`~keygroups.metrics.write_dashboard`. As tables (:func:`batch_table`, :func:`subtask_table`,
:func:`key_group_table`) they are what ``spark.read.format("keygroups").option("view", "metrics")`` reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

#: How each key group's state came in a batch, by code (:attr:`KeyGroupFigures.restore`): ``none`` (nothing to
#: restore: the job's first batch), ``warm`` (kept from the last batch, nothing read), ``caught-up`` (kept, the
#: blocks committed since read), ``cold`` (read from the checkpoint files: a cold restore, or a key group that arrived
#: at its subtask in a rescale).
RESTORE_MODES = ("none", "warm", "caught-up", "cold")
RESTORE_NONE, RESTORE_WARM, RESTORE_CAUGHT_UP, RESTORE_COLD = range(4)

#: A subtask's own phases, in the order they run (seconds in :class:`SubtaskMetrics`).
SUBTASK_PHASES = ("restore", "prepare", "process", "timers", "snapshot")


@dataclass(frozen=True)
class SubtaskMetrics:
    """One subtask of one batch: its key groups (``first_key_group``..``last_key_group``), its records, how its
    state came (``restore_mode``: ``new``, ``warm``, ``caught-up``, ``moved`` or ``cold``, as its report says), the
    bytes it read to restore and wrote to snapshot, its state entries after the batch (None: the backend gives no
    estimate), the seconds of its own phases (:data:`SUBTASK_PHASES`), and ``spark_task_seconds``: the Spark task's
    duration as Spark's status store has it (None where it is not known: the test harness, Spark Connect, an idle
    subtask). The task's time minus ours is Spark's: starting the task, its Python worker, the shuffle read and
    the hand-over of the records to Python (those the function waits for are in ``prepare_seconds``)."""

    subtask: int
    first_key_group: int
    last_key_group: int
    records_in: int
    records_late: int
    records_out: int
    restore_mode: str
    bytes_restored: int
    bytes_written: int
    state_entries: int | None
    restore_seconds: float
    prepare_seconds: float
    process_seconds: float
    timers_seconds: float
    snapshot_seconds: float
    spark_task_seconds: float | None = None

    @property
    def ours_seconds(self) -> float:
        """The subtask's own phases together."""
        return (self.restore_seconds + self.prepare_seconds + self.process_seconds + self.timers_seconds
                + self.snapshot_seconds)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SUBTASK_FIELDS}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SubtaskMetrics:
        values: dict[str, Any] = {name: d.get(name) for name in _SUBTASK_FIELDS}
        return cls(**values)


_SUBTASK_FIELDS = ("subtask", "first_key_group", "last_key_group", "records_in", "records_late", "records_out",
                   "restore_mode", "bytes_restored", "bytes_written", "state_entries", "restore_seconds",
                   "prepare_seconds", "process_seconds", "timers_seconds", "snapshot_seconds", "spark_task_seconds")


@dataclass(frozen=True, eq=False)
class KeyGroupFigures:
    """Per key group of one batch, arrays of ``max_parallelism``: ``records`` and ``calls`` (steps: one per key of
    the batch, plus one per record for a function called per record) the batch processed, ``timers_fired``,
    ``state_bytes`` after the batch (the key group's chain: its full block and the deltas after it),
    ``moved_bytes`` (its state, as the restore point held it, when the batch gave it to another holder: the subtask
    that owns it now did not take over the warm state of the previous range that held it, whatever the subtasks'
    numbers; 0 otherwise), ``decayed_work`` (calls plus timers, decayed over the last batches: what the balanced
    assignment weighs) and ``restore`` (a :data:`RESTORE_MODES` code)."""

    records: npt.NDArray[np.int64]
    calls: npt.NDArray[np.int64]
    timers_fired: npt.NDArray[np.int64]
    state_bytes: npt.NDArray[np.int64]
    moved_bytes: npt.NDArray[np.int64]
    decayed_work: npt.NDArray[np.float64]
    restore: npt.NDArray[np.int8]

    def __post_init__(self) -> None:
        lengths = {len(getattr(self, name)) for name in KEY_GROUP_FIELDS}
        if len(lengths) != 1:
            raise ValueError(f"key-group figures must all hold one figure per key group, got lengths {lengths}")

    def __len__(self) -> int:
        return len(self.records)

    @classmethod
    def zeros(cls, max_parallelism: int) -> KeyGroupFigures:
        return cls(*(np.zeros(max_parallelism, dtype=_KEY_GROUP_DTYPES[n]) for n in KEY_GROUP_FIELDS))


#: The arrays of :class:`KeyGroupFigures`, with their dtypes.
_KEY_GROUP_DTYPES: dict[str, Any] = {"records": np.int64, "calls": np.int64, "timers_fired": np.int64,
                                     "state_bytes": np.int64, "moved_bytes": np.int64, "decayed_work": np.float64,
                                     "restore": np.int8}
KEY_GROUP_FIELDS = tuple(_KEY_GROUP_DTYPES)


@dataclass(frozen=True, eq=False)
class BatchMetrics:
    """One committed micro-batch in figures (see the module docs). Times are epoch milliseconds; a watermark is None
    where there is none.

    The rescale: ``previous_parallelism`` and ``previous_max_parallelism`` are the restore point's (None: the job's
    first batch); ``ranges_moved`` whether the batch's key-group ranges differ from the restore point's (another
    parallelism, or boundaries the balanced assignment moved; False across a max-parallelism change, where every key
    group is new); ``moved_key_groups`` and ``moved_bytes`` the key groups that changed holder and their state: warm
    state belongs to a range, so a key group stays with the subtask that takes over its previous range's warm state
    (the decision's ``takeover``) whatever its number, and the others are what the subtasks read for state they did
    not hold (the assignment decision's figures, and :attr:`KeyGroupFigures.moved_bytes` summed); ``decision`` the
    decision as the checkpoint stores it (the assignment, its reason, the load's max/mean under the new ranges,
    before, and under Flink's). :attr:`rescaled` says whether the batch rescaled at all.

    Time: ``plan_seconds`` and ``commit_seconds`` the driver's phases; ``wall_seconds`` the batch on the driver, from
    the call to the commit (None: not measured); ``spark_seconds`` Spark's own time for the batch's Spark jobs (the
    union of their runs, submission to completion, from Spark's status store; None where it is not known: the test
    harness, Spark Connect); :attr:`ours_seconds` the rest.

    A streaming batch (``foreach_batch``) names its Structured Streaming query and batch where the checkpoint records
    them (``streaming_query_id``, ``streaming_batch_id``; None otherwise)."""

    job: str
    checkpoint_id: int
    timestamp_ms: int
    parallelism: int
    max_parallelism: int
    boundaries: tuple[int, ...]
    previous_parallelism: int | None
    previous_max_parallelism: int | None
    records_in: int
    records_late: int
    records_out: int
    watermark_before: int | None
    watermark_after: int | None
    timers_registered: int
    timers_fired: int
    timers_pending: int
    state_entries: int | None
    state_bytes: int
    bytes_restored: int
    bytes_written: int
    assignment: str | None
    ranges_moved: bool
    moved_key_groups: int
    moved_bytes: int
    max_over_mean: float | None
    decision: Mapping[str, Any] | None
    plan_seconds: float
    commit_seconds: float
    wall_seconds: float | None
    spark_seconds: float | None
    subtasks: tuple[SubtaskMetrics, ...]
    key_groups: KeyGroupFigures
    streaming_query_id: str | None = None
    streaming_batch_id: int | None = None
    #: Why this parallelism: ``"fixed"``, or the parallelism policy's choice.
    parallelism_reason: str = "fixed"

    @property
    def rescaled(self) -> bool:
        """Whether the batch ran with other key-group ranges than its restore point: another parallelism, another
        max parallelism, or ranges the balanced assignment moved."""
        if self.previous_parallelism is None:
            return False
        return (self.previous_parallelism != self.parallelism or self.previous_max_parallelism != self.max_parallelism
                or self.ranges_moved)

    @property
    def ours_seconds(self) -> float | None:
        """The batch's time on the driver outside Spark's jobs (``wall_seconds - spark_seconds``; None without
        both)."""
        if self.wall_seconds is None or self.spark_seconds is None:
            return None
        return max(0.0, self.wall_seconds - self.spark_seconds)

    @property
    def late_share(self) -> float:
        return self.records_late / self.records_in if self.records_in else 0.0

    def subtask_of_key_groups(self) -> npt.NDArray[np.int32]:
        """The subtask that owned each key group in this batch."""
        b = np.asarray(self.boundaries, dtype=np.int64)
        return (np.searchsorted(b[1:-1], np.arange(self.max_parallelism), side="right")).astype(np.int32)

    def batch_json(self) -> dict[str, Any]:
        """The batch and subtask figures as JSON-able values (the key-group arrays are :meth:`key_group_arrow`)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _BATCH_FIELDS}
        out["boundaries"] = list(self.boundaries)
        out["decision"] = None if self.decision is None else dict(self.decision)
        out["subtasks"] = [s.to_json() for s in self.subtasks]
        return out

    def key_group_arrow(self) -> pa.Table:
        """The key-group arrays as one table (a row per key group), with the subtask that owned each."""
        kg = self.key_groups
        columns = {"key_group": pa.array(np.arange(self.max_parallelism, dtype=np.int32)),
                   "subtask": pa.array(self.subtask_of_key_groups())}
        columns.update({name: pa.array(getattr(kg, name)) for name in KEY_GROUP_FIELDS})
        return pa.table(columns)

    @classmethod
    def from_parts(cls, batch: Mapping[str, Any], key_groups: pa.Table) -> BatchMetrics:
        """:meth:`batch_json` and :meth:`key_group_arrow` back into a ``BatchMetrics`` (KeyError/ValueError/TypeError
        on parts that do not fit: the store names the file)."""
        figures = KeyGroupFigures(*(np.asarray(key_groups.column(name).to_numpy(), dtype=_KEY_GROUP_DTYPES[name])
                                    for name in KEY_GROUP_FIELDS))
        values = {name: batch[name] for name in _BATCH_FIELDS}
        metrics = cls(**values, boundaries=tuple(int(b) for b in batch["boundaries"]), decision=batch.get("decision"),
                      subtasks=tuple(SubtaskMetrics.from_json(s) for s in batch["subtasks"]), key_groups=figures)
        if len(figures) != metrics.max_parallelism or metrics.boundaries[-1] != metrics.max_parallelism:
            raise ValueError(f"{len(figures)} key groups and boundaries {metrics.boundaries[:1]}..."
                             f"{metrics.boundaries[-1:]} for max parallelism {metrics.max_parallelism}")
        return metrics


_BATCH_FIELDS = ("job", "checkpoint_id", "timestamp_ms", "parallelism", "max_parallelism", "previous_parallelism",
                 "previous_max_parallelism", "records_in", "records_late", "records_out", "watermark_before",
                 "watermark_after", "timers_registered", "timers_fired", "timers_pending", "state_entries",
                 "state_bytes", "bytes_restored", "bytes_written", "assignment", "ranges_moved", "moved_key_groups",
                 "moved_bytes", "max_over_mean", "plan_seconds", "commit_seconds", "wall_seconds", "spark_seconds",
                 "streaming_query_id", "streaming_batch_id", "parallelism_reason")


# ---- tables ------------------------------------------------------------------------------------------------------

_TIME = pa.timestamp("ms", tz="UTC")

#: One row per batch (:func:`batch_table`).
BATCH_SCHEMA = pa.schema([
    ("job", pa.string()), ("checkpoint_id", pa.int64()), ("committed_at", _TIME), ("parallelism", pa.int32()),
    ("max_parallelism", pa.int32()), ("previous_parallelism", pa.int32()), ("parallelism_reason", pa.string()),
    ("rescaled", pa.bool_()), ("ranges_moved", pa.bool_()), ("moved_key_groups", pa.int32()),
    ("moved_bytes", pa.int64()), ("assignment", pa.string()), ("max_over_mean", pa.float64()),
    ("decision", pa.string()), ("boundaries", pa.list_(pa.int32())), ("records_in", pa.int64()),
    ("records_late", pa.int64()), ("records_out", pa.int64()), ("watermark_before", _TIME),
    ("watermark_after", _TIME), ("timers_registered", pa.int64()), ("timers_fired", pa.int64()),
    ("timers_pending", pa.int64()), ("state_entries", pa.int64()), ("state_bytes", pa.int64()),
    ("bytes_restored", pa.int64()), ("bytes_written", pa.int64()), ("key_groups_warm", pa.int32()),
    ("key_groups_caught_up", pa.int32()), ("key_groups_cold", pa.int32()), ("plan_seconds", pa.float64()),
    ("commit_seconds", pa.float64()), ("wall_seconds", pa.float64()), ("spark_seconds", pa.float64()),
    ("ours_seconds", pa.float64()), ("streaming_query_id", pa.string()), ("streaming_batch_id", pa.int64()),
])

#: One row per batch and subtask (:func:`subtask_table`).
SUBTASK_SCHEMA = pa.schema([
    ("job", pa.string()), ("checkpoint_id", pa.int64()), ("subtask", pa.int32()), ("first_key_group", pa.int32()),
    ("last_key_group", pa.int32()), ("records_in", pa.int64()), ("records_late", pa.int64()),
    ("records_out", pa.int64()), ("restore_mode", pa.string()), ("bytes_restored", pa.int64()),
    ("bytes_written", pa.int64()), ("state_entries", pa.int64()), ("state_bytes", pa.int64()),
    *((f"{p}_seconds", pa.float64()) for p in SUBTASK_PHASES), ("ours_seconds", pa.float64()),
    ("spark_task_seconds", pa.float64()),
])

#: One row per batch and key group (:func:`key_group_table`).
KEY_GROUP_SCHEMA = pa.schema([
    ("job", pa.string()), ("checkpoint_id", pa.int64()), ("key_group", pa.int32()), ("subtask", pa.int32()),
    ("records", pa.int64()), ("calls", pa.int64()), ("timers_fired", pa.int64()), ("state_bytes", pa.int64()),
    ("moved_bytes", pa.int64()), ("decayed_work", pa.float64()), ("restore_mode", pa.string()),
])

#: The tables by level, as the metrics view's ``level`` option names them.
SCHEMAS = {"batch": BATCH_SCHEMA, "subtask": SUBTASK_SCHEMA, "keygroup": KEY_GROUP_SCHEMA}


def _restore_counts(m: BatchMetrics) -> npt.NDArray[np.int64]:
    return np.bincount(m.key_groups.restore.astype(np.int64), minlength=len(RESTORE_MODES))


def batch_table(history: Sequence[BatchMetrics]) -> pa.Table:
    """One row per batch of ``history`` (:data:`BATCH_SCHEMA`)."""
    rows = []
    for m in history:
        counts = _restore_counts(m)
        rows.append({
            "job": m.job, "checkpoint_id": m.checkpoint_id, "committed_at": m.timestamp_ms,
            "parallelism": m.parallelism, "max_parallelism": m.max_parallelism,
            "previous_parallelism": m.previous_parallelism, "parallelism_reason": m.parallelism_reason,
            "rescaled": m.rescaled, "ranges_moved": m.ranges_moved, "moved_key_groups": m.moved_key_groups,
            "moved_bytes": m.moved_bytes, "assignment": m.assignment, "max_over_mean": m.max_over_mean,
            "decision": None if m.decision is None else json.dumps(m.decision, sort_keys=True),
            "boundaries": list(m.boundaries), "records_in": m.records_in, "records_late": m.records_late,
            "records_out": m.records_out, "watermark_before": m.watermark_before,
            "watermark_after": m.watermark_after, "timers_registered": m.timers_registered,
            "timers_fired": m.timers_fired, "timers_pending": m.timers_pending, "state_entries": m.state_entries,
            "state_bytes": m.state_bytes, "bytes_restored": m.bytes_restored, "bytes_written": m.bytes_written,
            "key_groups_warm": int(counts[RESTORE_WARM]), "key_groups_caught_up": int(counts[RESTORE_CAUGHT_UP]),
            "key_groups_cold": int(counts[RESTORE_COLD]), "plan_seconds": m.plan_seconds,
            "commit_seconds": m.commit_seconds, "wall_seconds": m.wall_seconds, "spark_seconds": m.spark_seconds,
            "ours_seconds": m.ours_seconds, "streaming_query_id": m.streaming_query_id,
            "streaming_batch_id": m.streaming_batch_id,
        })
    return pa.Table.from_pylist(rows, schema=BATCH_SCHEMA)


def subtask_table(history: Sequence[BatchMetrics]) -> pa.Table:
    """One row per batch and subtask of ``history`` (:data:`SUBTASK_SCHEMA`); ``state_bytes`` is the state of the
    subtask's key groups after the batch."""
    rows = []
    for m in history:
        state = np.add.reduceat(m.key_groups.state_bytes, np.asarray(m.boundaries[:-1], dtype=np.int64))
        for s in m.subtasks:
            row = s.to_json()
            row.update(job=m.job, checkpoint_id=m.checkpoint_id, ours_seconds=s.ours_seconds,
                       state_bytes=int(state[s.subtask]) if s.subtask < len(state) else 0)
            rows.append(row)
    return pa.Table.from_pylist(rows, schema=SUBTASK_SCHEMA)


_MODE_NAMES = pa.array(RESTORE_MODES)


def key_group_table(history: Sequence[BatchMetrics]) -> pa.Table:
    """One row per batch and key group of ``history`` (:data:`KEY_GROUP_SCHEMA`)."""
    parts = []
    for m in history:
        t = m.key_group_arrow()
        n = t.num_rows
        columns = {"job": pa.array([m.job] * n, pa.string()),
                   "checkpoint_id": pa.array(np.full(n, m.checkpoint_id, dtype=np.int64))}
        for name in ("key_group", "subtask", "records", "calls", "timers_fired", "state_bytes", "moved_bytes",
                     "decayed_work"):
            columns[name] = t.column(name)
        columns["restore_mode"] = _MODE_NAMES.take(pa.array(m.key_groups.restore.astype(np.int64)))
        parts.append(pa.table(columns, schema=KEY_GROUP_SCHEMA))
    return pa.concat_tables(parts) if parts else KEY_GROUP_SCHEMA.empty_table()


def metrics_table(history: Sequence[BatchMetrics], level: str = "batch") -> pa.Table:
    """``history`` as the table of ``level``: ``batch``, ``subtask`` or ``keygroup`` (ValueError otherwise)."""
    tables = {"batch": batch_table, "subtask": subtask_table, "keygroup": key_group_table}
    if level not in tables:
        raise ValueError(f"level must be one of {', '.join(tables)}, got {level!r}")
    return tables[level](history)


__all__ = ["BatchMetrics", "SubtaskMetrics", "KeyGroupFigures", "RESTORE_MODES", "SUBTASK_PHASES", "BATCH_SCHEMA",
           "SUBTASK_SCHEMA", "KEY_GROUP_SCHEMA", "SCHEMAS", "batch_table", "subtask_table", "key_group_table",
           "metrics_table"]
