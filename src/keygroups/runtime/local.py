"""A :class:`~keygroups.runtime.batch.BatchExecutor` in this process: the batch's records are an Arrow table placed
by key group as a job's shuffle places them, and every subtask runs as a plain call, one after another. The test
harness runs on it, and so can any Spark-free driver of the runtime."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from keygroups._hashing import KeyType, assign_key_groups, assign_key_groups_for_tuples
from keygroups._ranges import operator_indexes_for_boundaries
from keygroups.runtime.backends import key_type_for_schema
from keygroups.runtime.batch import InputFigures
from keygroups.runtime.driver import BatchPlan
from keygroups.runtime.report import InputDigest, SourceReport, SubtaskReport
from keygroups.runtime.source import SourceTaskSpec
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_input import event_time_millis
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.state.timers import NO_WATERMARK, TimerQueueRegistry


class LocalExecutor:
    """Runs one batch over ``table`` in this process (see the module docs). ``warm`` and ``warm_timers`` are the
    registries warm heap backends and timer queues are kept in between batches (the process's by default). Every
    subtask runs, with or without records, and its report crosses JSON as a Spark task's does."""

    def __init__(self, table: pa.Table, *, warm: HeapBackendRegistry | None = None,
                 warm_timers: TimerQueueRegistry | None = None) -> None:
        self._table = table
        self._warm = warm
        self._warm_timers = warm_timers
        self._spec: KeyedTaskSpec | None = None
        self._placed: list[list[pa.RecordBatch]] = []

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._placed = []

    @property
    def input_schema(self) -> pa.Schema:
        return self._table.schema

    def key_type(self, key_columns: tuple[str, ...]) -> KeyType:
        return key_type_for_schema(self._table.schema, key_columns)

    def read_input(self, *, count: bool, timestamp_column: str | None) -> InputFigures:
        max_event = None
        if timestamp_column is not None:
            if timestamp_column not in self._table.column_names:
                raise ValueError(f"event-time column {timestamp_column!r} is not in the input; its columns are "
                                 f"{self._table.column_names}")
            stamps = event_time_millis(self._table.column(timestamp_column), timestamp_column)
            stamps = stamps[stamps != NO_WATERMARK]
            max_event = int(stamps.max()) if len(stamps) else None
        return InputFigures(self._table.num_rows if count else None, max_event)

    def input_digest(self) -> InputDigest | None:
        return None

    def run_sources(self, spec: SourceTaskSpec) -> list[SourceReport]:
        raise NotImplementedError("the local executor runs keyed batches over a table; a source batch runs on Spark")

    def prepare(self, spec: KeyedTaskSpec, plan: BatchPlan) -> None:
        """Each subtask's records: those whose key group it owns (key groups by ``assign_key_groups`` over the Arrow
        key columns, owners by the plan's ranges), in input order."""
        self._spec = spec
        table, p, mp = self._table, plan.parallelism, plan.max_parallelism
        if not table.num_rows:
            self._placed = [[] for _ in range(p)]
            return
        if p == 1:
            self._placed = [table.to_batches()]
            return
        columns = [table.column(c) for c in spec.key_columns]
        if len(columns) == 1:
            groups = assign_key_groups(columns[0], mp, spec.key_type)   # type: ignore[arg-type]
        else:
            groups = assign_key_groups_for_tuples(columns, mp, spec.key_type)
        owners = operator_indexes_for_boundaries((*(r.start for r in plan.ranges), mp), groups)
        self._placed = [table.filter(pa.array(owners == i)).to_batches() for i in range(p)]

    def _run(self, index: int, batches: list[pa.RecordBatch]) -> SubtaskReport:
        assert self._spec is not None
        report = run_keyed_subtask(self._spec, index, batches, warm=self._warm, warm_timers=self._warm_timers)
        return SubtaskReport.from_json(json.loads(json.dumps(report.to_json())))   # as it crosses from a task

    def run_keyed(self) -> list[SubtaskReport]:
        return [self._run(i, batches) for i, batches in enumerate(self._placed)]

    def run_idle(self, subtasks: Sequence[int]) -> list[SubtaskReport]:
        return [self._run(i, []) for i in subtasks]

    def spark_seconds(self) -> float | None:
        return None


__all__ = ["LocalExecutor"]
