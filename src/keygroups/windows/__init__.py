"""Time windows on namespaced keyed state: tumbling, sliding and session windows in event and processing time,
incremental aggregation and whole-window processing, run as a keyed job (so their state and timers move with their
key groups when the job's parallelism changes).

    job = windows.window(TumblingEventTimeWindows.of(timedelta(minutes=1)), input_schema=schema,
                         key_columns=["user"], timestamp_column="t").aggregate(Count(), Sum("amount"))
    KeyedJob("per-minute", ["user"], job.function, output_schema=job.output_schema, timestamp_column="t",
             watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(timedelta(seconds=10)), ...)

See :mod:`keygroups.windows.operator` for triggers, allowed lateness, late output and session merging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from keygroups.windows.aggregates import (
    Count,
    Max,
    Mean,
    Min,
    PythonAggregate,
    PythonReduce,
    Sum,
    WindowAggregation,
)
from keygroups.windows.assigners import (
    EventTimeSessionWindows,
    ProcessingTimeSessionWindows,
    SlidingEventTimeWindows,
    SlidingProcessingTimeWindows,
    TimeWindow,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
    WindowAssigner,
    to_millis,
)
from keygroups.windows.operator import (
    CONTENTS_STATE,
    ProcessWindowFunction,
    WindowedStream,
    WindowJob,
    WindowOperator,
)


def window(assigner: WindowAssigner, *, input_schema: pa.Schema, key_columns: Sequence[str] | str,
           timestamp_column: str | None = None, allowed_lateness: Any = 0) -> WindowedStream:
    """The records of a keyed job (``input_schema``, keyed by ``key_columns``) in the windows of ``assigner``.
    Event-time windows need the job's event-time column (``timestamp_column``, the same as the job's);
    ``allowed_lateness`` (timedelta or ms) keeps event-time windows open for late records after they fired."""
    if not isinstance(assigner, WindowAssigner):
        raise TypeError(f"window takes a window assigner (TumblingEventTimeWindows.of(...), ...), got {assigner!r}")
    if not isinstance(input_schema, pa.Schema):
        raise TypeError(f"input_schema must be a pyarrow Schema (the keyed job's input), got {input_schema!r}")
    keys = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
    missing = [c for c in keys if c not in input_schema.names]
    if not keys or missing:
        raise ValueError(f"key_columns {keys} must be columns of the input; missing {missing}, the input has "
                         f"{input_schema.names}")
    if assigner.event_time and timestamp_column not in input_schema.names:
        raise ValueError(f"event-time windows need timestamp_column, the job's event-time column in the input "
                         f"({input_schema.names}); got {timestamp_column!r}")
    lateness = to_millis(allowed_lateness, "allowed_lateness")
    if lateness < 0:
        raise ValueError(f"allowed_lateness must be >= 0, got {lateness} ms")
    return WindowedStream(assigner, input_schema=input_schema, key_columns=keys, timestamp_column=timestamp_column,
                          allowed_lateness=lateness)


__all__ = [
    "window",
    "WindowedStream",
    "WindowJob",
    "WindowOperator",
    "ProcessWindowFunction",
    "CONTENTS_STATE",
    "TimeWindow",
    "WindowAssigner",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "EventTimeSessionWindows",
    "ProcessingTimeSessionWindows",
    "WindowAggregation",
    "Count",
    "Sum",
    "Min",
    "Max",
    "Mean",
    "PythonAggregate",
    "PythonReduce",
]
