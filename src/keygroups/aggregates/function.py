"""``KeyedAggregate``: the keyed function a declarative aggregate runs as (build one with
:func:`keygroups.aggregates.aggregate`).

Per batch (``process_batch``: the subtask's records sorted by key group, then key), with no Python step per record
and none per key on the heap backend:

1. the rows of the batch's keys in the state (:class:`~keygroups.aggregates.table.ColumnarStates`, bound to the heap
   backend as external states; on a backend that keeps state itself, RocksDB, each state's values of the batch's
   keys, read in one pass);
2. per aggregation, each key's run of values folded into its accumulator in record order by a compiled kernel
   (``_native/aggregates.pyx``; a user's ufunc by numpy, still in record order), optionally keeping the accumulator
   after every record;
3. the accumulators written back (TTL timestamps as a per-record function's reads and writes would leave them);
4. the output: a row per record (``emit="per_record"``), per key (``"per_key"``), or none until a key expires
   (``"final"``).

It is an ordinary keyed function otherwise: late records never reach it (the runtime drops them or writes them to the
late output), its states are checkpointed, restored and rescaled with every other keyed state, and with
``expire_after`` each key has a timer (event or processing time) that ends its accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keygroups._native import aggregates as _kernels
from keygroups.aggregates.specs import BOOL, FLOAT64, INT64, Aggregation, _Fold, _Reduce, column_values
from keygroups.aggregates.table import ColumnarStates, ValueLayout
from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext
from keygroups.serializers import Int64Serializer
from keygroups.state import StateTtlConfig, ValueStateDescriptor
from keygroups.state.timers import NO_WATERMARK, TimeDomain
from keygroups.state.ttl import EVENT_TIME_NOT_STARTED

#: What a declarative aggregate emits: a row per record with the key's running results (Flink's rolling
#: aggregations), a row per key of the batch with its results after it (Spark's update mode), or a row per key when
#: it expires (``expire_after``; Spark's append mode with a timeout).
Emit = Literal["per_record", "per_key", "final"]
EMITS = ("per_record", "per_key", "final")

#: The state that holds a key's expiry time when the aggregate has ``expire_after``.
EXPIRY_STATE = "expires_at"

_EMPTY_U8 = np.zeros(0, dtype=np.uint8)


def _layout(agg: Aggregation) -> ValueLayout:
    if agg.kind == "mean":
        return ValueLayout([FLOAT64, INT64], record=("sum", "count"))
    return ValueLayout([agg.storage])


def _as_kernel(a: np.ndarray) -> np.ndarray:
    """An accumulator array as the kernels take it (booleans as bytes)."""
    return a.view(np.uint8) if a.dtype == np.bool_ else a


class _Accumulators:
    """One aggregation's accumulators over the batch's keys (one per run): the value's fields and whether it has
    one, after the batch; per row too (``rows``) when records get their running values."""

    __slots__ = ("fields", "has", "row_fields", "row_has", "written")

    def __init__(self, fields: list[np.ndarray], has: np.ndarray) -> None:
        self.fields = fields
        self.has = has
        self.row_fields: list[np.ndarray] | None = None
        self.row_has: np.ndarray | None = None
        self.written = np.zeros(len(has), dtype=bool)


class _ColumnarIO:
    """The accumulators of a batch's keys in :class:`ColumnarStates` (the heap backend)."""

    def __init__(self, table: ColumnarStates, ttl: StateTtlConfig | None, backend: Any) -> None:
        self.table = table
        self.ttl = ttl
        self.backend = backend
        self.expired: dict[int, np.ndarray] = {}

    def locate(self, records: pa.Table, runs: np.ndarray, keys: list[Any], key_columns: Sequence[str]) -> Any:
        if self.table.key_mode != "object":
            column = records.column(key_columns[0])
            if column.null_count:
                starts = column.take(pa.array(runs[:-1])).to_numpy(zero_copy_only=False)
            else:   # each run's first key, read from the column's buffer
                starts = column.to_numpy()[runs[:-1]]
            return self.table.rows(np.asarray(starts, dtype=np.int64))
        return self.table.rows(keys)

    def _clocks(self) -> tuple[int | None, int]:
        """(the deadline: entries stamped at or before it are expired, None if none can be; the stamp of a write)."""
        assert self.ttl is not None
        now_clock, stamp_clock = self.backend._ttl_clocks(self.ttl)
        now = now_clock()
        deadline = None if self.ttl.event_time and now == NO_WATERMARK else now - self.ttl.ttl_ms
        if deadline is not None and deadline < -2**63:
            deadline = None
        return deadline, stamp_clock()

    def read(self, j: int, rows: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        t = self.table
        has = t.present[j][rows]
        if self.ttl is not None:
            deadline, _ = self._clocks()
            expired = has & (t.stamps[j][rows] <= deadline) if deadline is not None else np.zeros(len(rows), bool)
            self.expired[j] = expired
            has = has & ~expired
        return [f[rows] for f in t.fields[j]], has

    def write(self, j: int, rows: np.ndarray, acc: _Accumulators, has_before: np.ndarray) -> None:
        t = self.table
        for column, values in zip(t.fields[j], acc.fields):
            column[rows] = values
        t.present[j][rows] = acc.has
        changed = acc.written
        if self.ttl is not None:
            _, stamp = self._clocks()
            old = t.stamps[j][rows]
            new = old.copy()
            new[acc.written] = stamp
            read_only = has_before & ~acc.written   # read (to emit), not written: a read refreshes on read
            if self.ttl.update_on_read:
                new[read_only] = stamp
            elif stamp != EVENT_TIME_NOT_STARTED:
                new[read_only & (old == EVENT_TIME_NOT_STARTED)] = stamp
            t.stamps[j][rows] = new
            changed = changed | (new != old) | self.expired.pop(j)
        t.mark(j, rows[changed])


class _StateIO:
    """The accumulators of a batch's keys through the ordinary state objects of a backend that keeps state itself
    (RocksDB), in bulk: ``get_values`` reads the batch's keys the backend's cache does not hold with one multi-get
    and takes every value from the cache in one compiled pass; ``put_values`` puts the written ones into the cache
    the same way, and the next snapshot writes them with one WriteBatch. States with TTL go key by key through the
    state objects' own TTL handling."""

    def __init__(self, backend: Any, names: list[str], layouts: list[ValueLayout]) -> None:
        self.backend = backend
        self.names = names
        self.layouts = layouts

    def locate(self, records: pa.Table, runs: np.ndarray, keys: list[Any], key_columns: Sequence[str]) -> Any:
        return keys

    def read(self, j: int, keys: list[Any]) -> tuple[list[np.ndarray], np.ndarray]:
        values = self.backend.get_values(self.names[j], keys)
        layout = self.layouts[j]
        boxed = np.fromiter(values, dtype=object, count=len(values))   # a tuple stays one element
        has = np.not_equal(boxed, None)
        fields = []
        if layout.record is None:
            boxed[~has] = False if layout.fields[0] == BOOL else 0
            fields.append(boxed.astype(layout.fields[0]))
        else:
            zero = (0,) * len(layout.fields)
            rows = [zero if v is None else v for v in values]
            for i, dtype in enumerate(layout.fields):
                fields.append(np.array([r[i] for r in rows], dtype=dtype))
        return fields, has

    def write(self, j: int, keys: list[Any], acc: _Accumulators, has_before: np.ndarray) -> None:
        written = np.flatnonzero(acc.written).tolist()
        if not written:
            return
        layout = self.layouts[j]
        columns = [f.tolist() for f in acc.fields]
        if layout.record is None:
            values = [columns[0][i] for i in written]
        else:
            values = [tuple(c[i] for c in columns) for i in written]
        self.backend.put_values(self.names[j], [keys[i] for i in written], values)


def _arrow(values: np.ndarray, has: np.ndarray | None, out_type: pa.DataType) -> pa.Array:
    """Accumulator values as an Arrow array of ``out_type`` (null where ``has`` is 0)."""
    mask = None if has is None or has.all() else ~has.astype(bool)
    if values.dtype == np.uint8 and pa.types.is_boolean(out_type):
        values = values.view(np.bool_)
    array = pa.array(values, mask=mask)
    if array.type == out_type:
        return array
    if pa.types.is_temporal(out_type):
        if out_type.bit_width == 32:
            array = array.cast(pa.int32())
        return array.view(out_type)
    return array.cast(out_type, safe=not pa.types.is_floating(out_type))


def _ufunc_fold(ufunc: np.ufunc, dtype: np.dtype[Any], values: np.ndarray, valid: np.ndarray | None,
                runs: np.ndarray, acc: np.ndarray, has: np.ndarray, per_row: bool
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``a = ufunc(a, v)`` over each run's valid values in row order (the first value as it is when the run's
    accumulator has none), by numpy: the rows at the same position of their runs are folded together, one position
    after the other; a run longer than ``_LONG`` folds with ``ufunc.accumulate``. Updates ``acc`` and ``has`` (per
    run) in place; returns the accumulator after each row (and whether it has one) when ``per_row``. Every value
    equals what the per-record form's one-value call ``ufunc(a, v)`` gives (see :func:`_apply`)."""
    n, k = len(values), len(runs) - 1
    carried, carried_has = acc.copy(), has.copy()
    run_of = np.repeat(np.arange(k), np.diff(runs))
    idx = np.flatnonzero(valid) if valid is not None else np.arange(n)
    x = values[idx].astype(dtype)
    r = run_of[idx]
    m = len(x)
    y = np.empty(m, dtype=dtype)
    if m:
        first_of_run = np.searchsorted(r, np.arange(k), side="left")
        pos = np.arange(m) - first_of_run[r]
        counts = np.bincount(r, minlength=k)
        long_runs = np.flatnonzero(counts > _LONG)
        in_long = np.isin(r, long_runs) if len(long_runs) else np.zeros(m, bool)
        # position 0: the run's carried accumulator, if it has one
        p0 = np.flatnonzero((pos == 0) & ~in_long)
        carry = has[r[p0]].astype(bool)
        y[p0] = x[p0]
        if carry.any():
            c = p0[carry]
            y[c] = _apply(ufunc, dtype, acc[r[c]].astype(dtype), x[c])
        short = ~in_long
        for p in range(1, int(pos[short].max(initial=0)) + 1):
            at = np.flatnonzero((pos == p) & short)
            y[at] = _apply(ufunc, dtype, y[at - 1], x[at])
        for run in long_runs.tolist():
            lo, hi = first_of_run[run], first_of_run[run] + counts[run]
            seq = x[lo:hi]
            if has[run]:
                seq = np.concatenate([acc[run:run + 1].astype(dtype), seq])
                y[lo:hi] = _accumulate(ufunc, dtype, seq)[1:]
            else:
                y[lo:hi] = _accumulate(ufunc, dtype, seq)
        last = first_of_run + counts - 1
        touched = counts > 0
        acc[touched] = y[last[touched]]
        has[touched] = 1
    if not per_row:
        return None, None
    # each row: the accumulator after the last valid row of its run at or before it, else the carried one
    seen = np.full(n, -1, dtype=np.int64)
    seen[idx] = np.arange(m)
    latest = np.maximum.accumulate(np.where(seen >= 0, np.arange(n), -1)) if n else seen
    run_start = runs[:-1][run_of] if n else seen
    from_batch = latest >= run_start
    row_acc = np.empty(n, dtype=dtype)
    row_has = np.zeros(n, dtype=np.uint8)
    if n:
        where = np.flatnonzero(from_batch)
        row_acc[where] = y[seen[latest[where]]]
        row_has[where] = 1
        before = np.flatnonzero(~from_batch)   # no value of the batch yet: the carried accumulator
        row_acc[before] = carried[run_of[before]]
        row_has[before] = carried_has[run_of[before]]
    return row_acc, row_has


#: Runs longer than this fold with ``ufunc.accumulate`` (one call each) instead of position by position.
_LONG = 32


# numpy computes a float ufunc over an array in SIMD lanes and over one value (the per-record form's 0-d call) in
# scalar code, and the two may disagree where the result is a choice between the operands: np.fmax(-0.0, 0.0) is
# -0.0 by the scalar loop (the first operand when they are equal) but 0.0 in a SIMD lane, likewise maximum, minimum
# and fmin, and which NaN's payload comes out; ufunc.accumulate has its own loops. Those are the pairs where the two
# operands compare equal or a NaN is involved: they are recomputed one at a time, as the per-record form does.
def _scalar(ufunc: np.ufunc, dtype: np.dtype[Any], a: Any, v: Any) -> Any:
    """``ufunc(a, v)`` for one value, exactly as the per-record form calls it (0-d arrays, accumulator first)."""
    return ufunc(np.asarray(a, dtype=dtype), np.asarray(v, dtype=dtype)).astype(dtype)[()]


def _doubtful(a: np.ndarray, v: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where a vectorized ``y = ufunc(a, v)`` of doubles may differ from the one-value call (see above)."""
    return np.flatnonzero((a == v) | np.isnan(a) | np.isnan(v) | np.isnan(y))


def _apply(ufunc: np.ufunc, dtype: np.dtype[Any], a: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``ufunc(a[i], v[i])`` for every i, each equal to the per-record form's call ``ufunc(a[i], v[i])``."""
    y = ufunc(a, v).astype(dtype)
    if dtype.kind == "f" and len(y):
        for i in _doubtful(a, v, y).tolist():
            y[i] = _scalar(ufunc, dtype, a[i], v[i])
    return y


#: After this many corrections, ``_accumulate`` finishes a run one value at a time.
_FIXES = 8


def _accumulate(ufunc: np.ufunc, dtype: np.dtype[Any], seq: np.ndarray) -> np.ndarray:
    """``ufunc.accumulate(seq)`` (``y[0] = seq[0]``, ``y[i] = ufunc(y[i - 1], seq[i])``), each step equal to the
    per-record form's one-value call: a doubtful step (see above) is recomputed, and if that changes it, the rest of
    the run is accumulated again from it."""
    y = ufunc.accumulate(seq, dtype=dtype)
    if dtype.kind != "f" or len(y) < 2:
        return y
    start, fixes = 1, 0
    while start < len(y):
        for i in (_doubtful(y[start - 1:-1], seq[start:], y[start:]) + start).tolist():
            want = _scalar(ufunc, dtype, y[i - 1], seq[i])
            if want.tobytes() == y[i].tobytes():
                continue
            y[i] = want
            fixes += 1
            if fixes >= _FIXES:   # many ties (signed zeros, NaNs): the rest one value at a time
                for j in range(i + 1, len(y)):
                    y[j] = _scalar(ufunc, dtype, y[j - 1], seq[j])
                return y
            if i + 1 < len(y):
                y[i:] = ufunc.accumulate(np.concatenate([y[i:i + 1], seq[i + 1:]]), dtype=dtype)
            start = i + 1
            break
        else:
            return y
    return y


class KeyedAggregate(KeyedProcessFunction):
    """Declarative aggregations of a keyed job, computed a batch at a time with numpy and compiled kernels. Build it
    with :func:`keygroups.aggregates.aggregate`; its :attr:`output_schema` is the job's output schema.

    It is a :class:`~keygroups.runtime.KeyedProcessFunction`: subclass it to act on timers (``on_timer``, reading
    :meth:`results` and ending a key's accumulation with :meth:`clear` for the current key)."""

    def __init__(self, aggregations: Sequence[Aggregation], *, input_schema: pa.Schema, key_columns: Sequence[str],
                 emit: Emit, keep_columns: Sequence[str] = (), ttl: StateTtlConfig | None = None,
                 expire_after: int | None = None, timestamp_column: str | None = None) -> None:
        self.aggregations = list(aggregations)
        self.key_columns = tuple(key_columns)
        self.emit = emit
        self.keep_columns = tuple(keep_columns)
        self.ttl = ttl
        self.expire_after = expire_after
        self.timestamp_column = timestamp_column
        self.input_schema = input_schema
        self.descriptors = []
        for agg in self.aggregations:
            d: ValueStateDescriptor[Any] = ValueStateDescriptor(agg.name, agg.serializer())
            if ttl is not None:
                d.enable_time_to_live(ttl)
            self.descriptors.append(d)
        self.expiry_descriptor = ValueStateDescriptor(EXPIRY_STATE, Int64Serializer())
        key_fields = [input_schema.field(c) for c in self.key_columns]
        results = [a.output_field() for a in self.aggregations]
        if emit == "per_record":
            fields = key_fields + [input_schema.field(c) for c in self.keep_columns] + results
        else:
            fields = key_fields + results
        #: The schema of what the aggregate emits: the key columns, the kept columns (per record), the results.
        self.output_schema = pa.schema(fields)
        #: Whether the heap backend may keep the accumulators as columns (tests switch it off to run the form every
        #: other backend runs).
        self.columnar = True

    # ---- setup --------------------------------------------------------------------------------------------------
    def open(self, context: RuntimeContext, /) -> None:
        backend = context._backend
        self._backend = backend
        layouts = [_layout(a) for a in self.aggregations]
        table = None
        if self.columnar:
            descriptors = self.descriptors
            table = backend.bind_external_states(descriptors, lambda b: ColumnarStates(b, descriptors, layouts))
        self.states = [context.get_state(d) for d in self.descriptors]
        self.expiry = context.get_state(self.expiry_descriptor) if self.expire_after is not None else None
        if table is not None:
            self._io: _ColumnarIO | _StateIO = _ColumnarIO(table, self.ttl, backend)
        else:
            self._io = _StateIO(backend, [d.name for d in self.descriptors], layouts)

    # ---- records ------------------------------------------------------------------------------------------------
    def process_key_batch(self, key: Any, records: pa.Table, context: ProcessContext, /) -> list[pa.Table] | None:
        return self.process_batch(records, np.array([0, records.num_rows], dtype=np.int64), [key],
                                  lambda i: None, context)

    def process_batch(self, records: pa.Table, runs: np.ndarray, keys: list[Any],
                      select_key: Callable[[int], None], context: ProcessContext, /) -> list[pa.Table] | None:
        """The whole batch at once: returns its output as one Arrow table (in a list), or None."""
        if not keys:
            return None
        runs = np.ascontiguousarray(runs, dtype=np.int64)
        per_row = self.emit == "per_record"
        io = self._io
        where = io.locate(records, runs, keys, self.key_columns)
        computed = []
        for j, agg in enumerate(self.aggregations):
            fields, has = io.read(j, where)
            computed.append((has.copy(), self._fold(agg, records, runs, keys, fields, has, per_row)))
        for j, (has_before, acc) in enumerate(computed):
            io.write(j, where, acc, has_before)
        if self.expire_after is not None:
            self._schedule(records, runs, keys, select_key, context)
        if self.emit == "final":
            return None
        if per_row:
            columns = [records.column(c) for c in self.key_columns + self.keep_columns]
            columns += [self._column(agg, acc.row_fields, acc.row_has) for agg, (_, acc) in
                        zip(self.aggregations, computed)]
        else:
            starts = pa.array(runs[:-1])
            columns = [records.column(c).take(starts) for c in self.key_columns]
            columns += [self._column(agg, acc.fields, acc.has) for agg, (_, acc) in zip(self.aggregations, computed)]
        return [pa.Table.from_arrays(columns, schema=self.output_schema)]

    def _fold(self, agg: Aggregation, records: pa.Table, runs: np.ndarray, keys: list[Any],
              fields: list[np.ndarray], has: np.ndarray, per_row: bool) -> _Accumulators:
        n = records.num_rows
        acc = _Accumulators(fields, has.view(np.uint8) if has.dtype == np.bool_ else has)
        if agg.column is None:
            values, valid = np.zeros(0), None
        elif agg.kind == "count":   # any column type: only its nulls matter
            column = records.column(agg.column)
            values = np.zeros(0)
            valid = (np.ascontiguousarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=np.uint8)
                     if column.null_count else None)
        else:
            values, valid = column_values(records.column(agg.column), agg.storage)
        if valid is None:
            acc.written[:] = True
        else:
            acc.written[:] = np.add.reduceat(valid, runs[:-1]) > 0
        h = acc.has
        if agg.kind == "count":
            row_acc = np.empty(n if per_row else 0, dtype=np.int64)
            row_has = np.empty(len(row_acc), dtype=np.uint8)
            bad = _kernels.count_runs(valid if valid is not None else _EMPTY_U8, runs, fields[0], h, row_acc,
                                      row_has, n)
            self._overflow(agg, bad, runs, keys, "the count")
            if per_row:
                acc.row_fields, acc.row_has = [row_acc], row_has
        elif agg.kind == "fold":
            assert isinstance(agg, _Fold)
            a = _as_kernel(fields[0])
            v = _as_kernel(values)
            row_acc = np.empty(n if per_row else 0, dtype=a.dtype)
            row_has = np.empty(len(row_acc), dtype=np.uint8)
            bad = _kernels.fold_runs(agg.op, v, valid if valid is not None else _EMPTY_U8, runs, a, h,
                                     row_acc, row_has)
            self._overflow(agg, bad, runs, keys, "the sum")
            if per_row:
                acc.row_fields, acc.row_has = [row_acc], row_has
        elif agg.kind == "mean":
            empty = valid if valid is not None else _EMPTY_U8
            sums, counts = fields
            sums[h == 0] = 0.0   # the sum starts at 0.0 (so a first -0.0 sums to 0.0, as s + v does)
            has_sum = np.ones(len(h), dtype=np.uint8)
            sum_rows = np.empty(n if per_row else 0, dtype=np.float64)
            count_rows = np.empty(len(sum_rows), dtype=np.int64)
            has_rows = np.empty(len(sum_rows), dtype=np.uint8)
            _kernels.fold_runs(_kernels.SUM, values.astype(np.float64), empty, runs, sums, has_sum, sum_rows,
                               np.empty(len(sum_rows), dtype=np.uint8))
            bad = _kernels.count_runs(empty, runs, counts, h, count_rows, has_rows, n)
            self._overflow(agg, bad, runs, keys, "the count")
            if per_row:
                acc.row_fields, acc.row_has = [sum_rows, count_rows], has_rows
        else:   # a user's ufunc
            assert isinstance(agg, _Reduce)
            ufunc_rows, ufunc_has = _ufunc_fold(agg.ufunc, agg.storage, values, valid, runs, fields[0], h, per_row)
            if per_row:
                assert ufunc_rows is not None and ufunc_has is not None
                acc.row_fields, acc.row_has = [ufunc_rows], ufunc_has
        acc.has = h.view(np.bool_) if h.dtype == np.uint8 else h
        return acc

    def _overflow(self, agg: Aggregation, row: int, runs: np.ndarray, keys: list[Any], what: str) -> None:
        if row < 0:
            return
        key = keys[int(np.searchsorted(runs, row, side="right")) - 1]
        raise ArithmeticError(f"aggregation {agg.name!r}: {what} of key {key!r} does not fit a long (int64) at its "
                              "record of this batch; the batch fails and nothing is committed")

    def _column(self, agg: Aggregation, fields: list[np.ndarray] | None, has: np.ndarray | None) -> pa.Array:
        assert fields is not None
        if agg.kind == "count":
            return pa.array(fields[0], type=pa.int64())
        if agg.kind == "mean":
            sums, counts = fields
            ok = counts > 0
            out = np.divide(sums, counts, out=np.zeros(len(sums)), where=ok)
            return _arrow(out, ok, pa.float64())
        return _arrow(fields[0], has, agg.output_type())

    # ---- expiry -------------------------------------------------------------------------------------------------
    def _schedule(self, records: pa.Table, runs: np.ndarray, keys: list[Any], select_key: Callable[[int], None],
                  context: ProcessContext) -> None:
        """Each key of the batch expires ``expire_after`` after its latest record (event time: the record's; else the
        batch's processing time): its timer moves there."""
        assert self.expire_after is not None and self.expiry is not None
        service = context.timer_service
        if self.timestamp_column is not None:
            column = records.column(self.timestamp_column)
            if pa.types.is_timestamp(column.type):
                column = pc.cast(column, pa.timestamp("ms", column.type.tz), safe=False).cast(pa.int64())
            times = np.asarray(column.fill_null(NO_WATERMARK).to_numpy(zero_copy_only=False), dtype=np.int64)
            latest = np.maximum.reduceat(times, runs[:-1]).tolist()
            register, delete = service.register_event_time_timer, service.delete_event_time_timer
        else:
            latest = [service.current_processing_time()] * len(keys)
            register, delete = service.register_processing_time_timer, service.delete_processing_time_timer
        expiry = self.expiry
        for i, at in enumerate(latest):
            if at == NO_WATERMARK:
                continue
            select_key(i)
            old = expiry.value()
            deadline = at + self.expire_after
            if old is not None and old >= deadline:
                continue
            if old is not None:
                delete(old)
            register(deadline)
            expiry.update(deadline)

    def on_timer(self, timestamp: int, context: ProcessContext, /) -> Iterable[Any] | None:
        """A key's expiry timer: with ``emit="final"`` its results are emitted; its accumulation ends."""
        if self.expiry is None or self.expiry.value() != timestamp:
            return None
        row = None
        if self.emit == "final":
            key = context.current_key
            row = (*(key if len(self.key_columns) > 1 else (key,)), *self.results().values())
        self.clear()
        return [row] if row is not None else None

    # ---- the current key ------------------------------------------------------------------------------------------
    def results(self) -> dict[str, Any]:
        """The current key's results (output column -> value), as its row would show them (in ``on_timer``)."""
        return {agg.name: agg.result(state.value()) for agg, state in zip(self.aggregations, self.states)}

    def clear(self) -> None:
        """End the current key's accumulation: its states are cleared (and its expiry timer, if any, forgotten)."""
        for state in self.states:
            state.clear()
        if self.expiry is not None:
            self.expiry.clear()


__all__ = ["KeyedAggregate", "Emit", "EMITS", "EXPIRY_STATE"]
