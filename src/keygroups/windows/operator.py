"""The window operator: a ``KeyedProcessFunction`` that assigns a key's records to windows, keeps each window's
contents in namespaced keyed state (namespace = the window), and emits a window's result when its timer fires.

Per key batch (``process_key_batch``): the window of every record is computed with numpy, the records of each window
are combined into one partial (Arrow-native aggregations: numpy per window group) and merged into the window's stored
accumulator once. Whole-window processing keeps the window's records as Arrow IPC streams (one per batch) in a
namespaced list state and hands them to :meth:`ProcessWindowFunction.process` as one table.

Triggers (Flink's defaults): an event-time window fires when the watermark reaches ``end - 1``; a processing-time
window when a batch's processing time does. Each window registers a timer of its key at ``end - 1`` (and, with
allowed lateness, its cleanup timer at ``end - 1 + lateness``); a timer looks up the key's windows in state (the
namespaces of its contents), so the windows of a key that end together fire together and a timer whose window was
merged away does nothing.

Allowed lateness (event time): a window's state is kept until the watermark reaches ``end - 1 + lateness``; a
record for a window that already fired but is within that time fires it again at once with the updated result (one
more output row for the window, as Flink's late firing). A record is *late* once every window it belongs to has
expired (:meth:`WindowOperator.late_mask`): the runtime then drops it, or writes it to the job's late output with
``KeyedJob(late_records="output")``, which is this API's late output. Session windows decide by the record's own
session ``[t, t + gap)``: a late record that would have joined a still-open longer session is late here (Flink would
merge it).

Sessions merge (Flink's ``MergingWindowSet`` without its state-window indirection, which RocksDB does not need here):
a batch's sessions of a key are merged among themselves and with the key's stored sessions that overlap or touch;
the stored contents move into the covering window with ``merge_namespaces`` and it registers its own timers.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from keygroups.runtime import functions as fn
from keygroups.runtime.subtask_input import event_time_millis
from keygroups.serializers import BytesSerializer
from keygroups.state import AggregatingStateDescriptor, ListStateDescriptor
from keygroups.state.descriptors import AggregateFunction
from keygroups.state.timers import NO_WATERMARK, TimeDomain
from keygroups.windows.aggregates import Aggregations, PythonReduce, WindowAggregation
from keygroups.windows.assigners import TimeWindow, WindowAssigner

#: The namespaced state holding each window's contents.
CONTENTS_STATE = "window-contents"
#: Output columns of aggregations: window start and end, epoch ms.
WINDOW_FIELDS = [pa.field("window_start", pa.int64()), pa.field("window_end", pa.int64())]


class ProcessWindowFunction:
    """Whole-window processing: :meth:`process` gets all of a window's records as one Arrow table when it fires."""

    def process(self, key: Any, window: TimeWindow, records: pa.Table, context: fn.ProcessContext
                ) -> Iterable[Any] | pa.Table | None:
        """Output records (tuples, dicts or an Arrow table of the job's output schema) for ``window`` of ``key``."""
        raise NotImplementedError


class _Accumulators(AggregateFunction):
    """The aggregations as the AggregateFunction of the namespaced state (so it is a valid descriptor and merges)."""

    def __init__(self, aggregations: Aggregations) -> None:
        self.aggregations = aggregations

    def create_accumulator(self) -> Any:
        raise TypeError("window accumulators are built from partials, not added one value at a time")

    def add(self, value: Any, accumulator: Any) -> Any:
        return self.aggregations.merge(accumulator, value)

    def get_result(self, accumulator: Any) -> Any:
        return self.aggregations.result(accumulator)

    def merge(self, a: Any, b: Any) -> Any:
        return self.aggregations.merge(a, b)


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _from_ipc(parts: list[bytes]) -> pa.Table:
    return pa.concat_tables([pa.ipc.open_stream(p).read_all() for p in parts])


class WindowOperator(fn.KeyedProcessFunction):
    """Windows over a keyed job's records; build one with :func:`keygroups.windows.window`."""

    def __init__(self, assigner: WindowAssigner, *, timestamp_column: str | None, allowed_lateness: int,
                 aggregations: Aggregations | None = None, process_function: ProcessWindowFunction | None = None
                 ) -> None:
        self.assigner = assigner
        self.timestamp_column = timestamp_column
        self.allowed_lateness = allowed_lateness if assigner.event_time else 0
        self.aggregations = aggregations
        self.process_function = process_function

    # ---- setup --------------------------------------------------------------------------------------------------
    def open(self, context: fn.RuntimeContext) -> None:
        if self.aggregations is not None:
            descriptor: Any = AggregatingStateDescriptor(CONTENTS_STATE, _Accumulators(self.aggregations),
                                                         self.aggregations.accumulator_serializer())
        else:
            descriptor = ListStateDescriptor(CONTENTS_STATE, BytesSerializer())
        self.contents = context.get_namespaced_state(descriptor, TimeWindow(0, 0), TimeWindow.serializer())

    def late_mask(self, event_times: np.ndarray, watermark: int) -> np.ndarray:
        if not self.assigner.event_time:
            return np.zeros(len(event_times), dtype=bool)
        return self.assigner.last_end(event_times) - 1 + self.allowed_lateness <= watermark

    # ---- records ------------------------------------------------------------------------------------------------
    def process_key_batch(self, key: Any, records: pa.Table, context: fn.ProcessContext) -> list[Any]:
        return self._process(records, np.zeros(records.num_rows, dtype=np.int64), [key], lambda i: None, context)

    def process_batch(self, records: pa.Table, runs: np.ndarray, keys: list[Any],
                      select_key: Callable[[int], None], context: fn.ProcessContext) -> list[Any]:
        key_of_row = np.repeat(np.arange(len(keys), dtype=np.int64), np.diff(runs))
        return self._process(records, key_of_row, keys, select_key, context)

    def _process(self, records: pa.Table, key_of_row: np.ndarray, keys: list[Any],
                 select_key: Callable[[int], None], context: fn.ProcessContext) -> list[Any]:
        """Assign the records (of one or many keys) to windows, combine each (key, window)'s records into one
        partial, and merge it into the window's state: a Python step per (key, window), none per record."""
        service = context.timer_service
        if self.assigner.event_time:
            column = self.timestamp_column
            assert column is not None, "window() requires timestamp_column for event-time windows"
            times = event_time_millis(records.column(column), column)
            keep = times != NO_WATERMARK   # a record without event time belongs to no window
            if not keep.all():
                records, times, key_of_row = records.filter(pa.array(keep)), times[keep], key_of_row[keep]
            watermark = service.current_watermark()
        else:
            times = np.full(records.num_rows, service.current_processing_time(), dtype=np.int64)
            watermark = NO_WATERMARK
        rows, starts, ends = self.assigner.assign(times)
        if watermark != NO_WATERMARK:   # windows already expired take nothing (Flink's isWindowLate)
            live = ends - 1 + self.allowed_lateness > watermark
            rows, starts, ends = rows[live], starts[live], ends[live]
        if not len(rows):
            return []
        owner = key_of_row[rows]
        order = np.lexsort((rows, ends, starts, owner))
        rows, starts, ends, owner = rows[order], starts[order], ends[order], owner[order]
        # groups: (key index, window, stored windows merged into it, first row, end row)
        groups: list[tuple[int, TimeWindow, list[Any], int, int]] = []
        if self.assigner.merging:
            key_change = np.flatnonzero(np.diff(owner) != 0) + 1
            key_bounds = np.concatenate([[0], key_change, [len(owner)]]).tolist()
            for lo, hi in zip(key_bounds[:-1], key_bounds[1:]):
                k = int(owner[lo])
                select_key(k)
                groups += [(k, w, merged, lo + a, lo + b)
                           for w, merged, a, b in self._merge_sessions(starts[lo:hi], ends[lo:hi])]
        else:
            change = np.flatnonzero((np.diff(starts) != 0) | (np.diff(owner) != 0)) + 1
            bounds = np.concatenate([[0], change, [len(starts)]]).tolist()
            firsts = bounds[:-1]
            groups = [(k, TimeWindow(s, e), [], lo, hi) for k, s, e, lo, hi in zip(
                owner[firsts].tolist(), starts[firsts].tolist(), ends[firsts].tolist(), firsts, bounds[1:])]
        bounds_array = np.array([g[3] for g in groups] + [len(rows)], dtype=np.int64)
        if self.aggregations is not None:
            partials = self.aggregations.partials(records, rows, bounds_array)
        out: list[Any] = []
        state = self.contents
        current = -1
        lateness = self.allowed_lateness
        event_time = self.assigner.event_time
        for i, (k, window, merged, lo, hi) in enumerate(groups):
            if k != current:
                select_key(k)
                current = k
            if merged:
                state.merge_namespaces(window, merged)
            state.set_current_namespace(window)
            if self.aggregations is not None:
                stored = state.get_internal()
                state.update_internal(partials[i] if stored is None else self.aggregations.merge(stored, partials[i]))
            else:
                state.add(_ipc(records.take(pa.array(rows[lo:hi]))))
            fire_at = window.end - 1
            if event_time:
                if fire_at <= watermark:   # a late record within the allowed lateness: fire again now
                    out.extend(self._emit(keys[k], window, context))
                else:
                    service.register_event_time_timer(fire_at)
                if lateness:
                    service.register_event_time_timer(fire_at + lateness)
            else:
                service.register_processing_time_timer(fire_at)
        return out

    def _merge_sessions(self, starts: np.ndarray, ends: np.ndarray) -> list[tuple[TimeWindow, list[Any], int, int]]:
        """The batch's sessions (rows sorted by start) merged among themselves and with the key's stored ones:
        (covering window, stored windows merged into it, first row, end row) per session."""
        stored = sorted(TimeWindow(*w) for w in self.contents.namespaces())
        groups: list[tuple[TimeWindow, list[Any], int, int]] = []
        lo = 0
        n = len(starts)
        s_list, e_list = starts.tolist(), ends.tolist()
        while lo < n:
            window = TimeWindow(s_list[lo], e_list[lo])
            hi = lo + 1
            while hi < n and s_list[hi] <= window.end:
                window = window.cover((s_list[hi], e_list[hi]))
                hi += 1
            groups.append((window, [], lo, hi))
            lo = hi
        # Fold stored sessions in; a stored session can join two batch sessions into one.
        result: list[tuple[TimeWindow, list[Any], int, int]] = []
        for window, _, lo, hi in groups:
            merged: list[Any] = []
            changed = True
            while changed:
                changed = False
                for w in stored:
                    if w not in merged and window.intersects(w):
                        merged.append(w)
                        window = window.cover(w)
                        changed = True
            if result and result[-1][0].intersects(window):
                prev_window, prev_merged, prev_lo, _ = result[-1]
                result[-1] = (prev_window.cover(window), list(dict.fromkeys(prev_merged + merged)), prev_lo, hi)
            else:
                result.append((window, merged, lo, hi))
        # A stored session that is the covering window itself needs no move.
        return [(w, [m for m in merged if m != w], lo, hi) for w, merged, lo, hi in result]

    # ---- firing -------------------------------------------------------------------------------------------------
    def on_timer(self, timestamp: int, context: fn.ProcessContext) -> list[Any]:
        state = self.contents
        event_time = context.time_domain is TimeDomain.EVENT_TIME
        if event_time != self.assigner.event_time:
            return []
        out: list[Any] = []
        lateness = self.allowed_lateness
        for w in sorted(state.namespaces()):   # (start, end) tuples: a TimeWindow only for the windows touched
            last = w[1] - 1
            if last == timestamp:
                out.extend(self._emit(context.current_key, TimeWindow(*w), context))
            if last + lateness <= timestamp:
                state.set_current_namespace(w)
                state.clear()
        return out

    def _emit(self, key: Any, window: TimeWindow, context: fn.ProcessContext) -> list[Any]:
        state = self.contents
        state.set_current_namespace(window)
        if self.aggregations is not None:
            acc = state.get_internal()
            if acc is None:
                return []
            if isinstance(key, tuple):
                return [(*key, window.start, window.end, *self.aggregations.result(acc))]
            return [(key, window.start, window.end, *self.aggregations.result(acc))]
        parts = state.get()
        if not parts:
            return []
        assert self.process_function is not None
        result = self.process_function.process(key, window, _from_ipc(parts), context)
        if result is None:
            return []
        return [result] if isinstance(result, pa.Table) else list(result)


class WindowJob(NamedTuple):
    """What a keyed job needs to run windows: ``KeyedJob(name, key_columns, job.function,
    output_schema=job.output_schema, timestamp_column=..., watermark_strategy=...)``."""

    function: WindowOperator
    output_schema: pa.Schema


class WindowedStream:
    """A keyed job's records in windows (see :func:`window`); finish it with :meth:`aggregate` or :meth:`process`."""

    def __init__(self, assigner: WindowAssigner, *, input_schema: pa.Schema, key_columns: tuple[str, ...],
                 timestamp_column: str | None, allowed_lateness: int) -> None:
        self.assigner = assigner
        self.input_schema = input_schema
        self.key_columns = key_columns
        self.timestamp_column = timestamp_column
        self.allowed_lateness = allowed_lateness

    def aggregate(self, *aggregations: WindowAggregation) -> WindowJob:
        """Incremental aggregation: one output row per window firing, ``(*key columns, window_start, window_end,
        *results)``. Arrow-native aggregations (``Count``, ``Sum``, ...) or ``PythonAggregate``/``PythonReduce``."""
        if not aggregations or not all(isinstance(a, WindowAggregation) for a in aggregations):
            raise TypeError(f"aggregate takes keygroups.windows aggregations (Count(), Sum('col'), ..., "
                            f"PythonAggregate(...), PythonReduce(...)), got {aggregations!r}")
        for a in aggregations:
            a.bind(self.input_schema)
        combined = Aggregations(list(aggregations))
        fields = [self.input_schema.field(c) for c in self.key_columns] + WINDOW_FIELDS + combined.output_fields()
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"the window output would repeat a column name: {names}; name the aggregations "
                             "(e.g. Sum('x', name='total'))")
        return WindowJob(self._operator(aggregations=combined), pa.schema(fields))

    def reduce(self, function: Any, column: str, serializer: Any) -> WindowJob:
        """Reduce one column's values per window with a ``ReduceFunction`` (or callable); shorthand for
        ``aggregate(PythonReduce(function, column, serializer))``."""
        return self.aggregate(PythonReduce(function, column, serializer))

    def process(self, function: ProcessWindowFunction, output_schema: pa.Schema) -> WindowJob:
        """Whole-window processing: ``function.process(key, window, records, context)`` with all the window's
        records as one Arrow table, when the window fires."""
        if not isinstance(function, ProcessWindowFunction):
            raise TypeError(f"process takes a keygroups.windows.ProcessWindowFunction, got {function!r}")
        return WindowJob(self._operator(process_function=function), output_schema)

    def _operator(self, **kwargs: Any) -> WindowOperator:
        return WindowOperator(self.assigner, timestamp_column=self.timestamp_column,
                              allowed_lateness=self.allowed_lateness, **kwargs)


__all__ = ["ProcessWindowFunction", "WindowOperator", "WindowJob", "WindowedStream", "CONTENTS_STATE",
           "WINDOW_FIELDS"]
