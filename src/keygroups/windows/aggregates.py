"""Window aggregations: Arrow-native ones over a column (``Count``, ``Sum``, ``Min``, ``Max``, ``Mean``), computed
with numpy per window group of a batch before they touch state, and adapters for Python ``AggregateFunction`` /
``ReduceFunction`` (applied per record).

An aggregation turns a batch's rows, grouped by window (``order`` lists the rows group after group, ``bounds`` the
group offsets into it), into one partial accumulator per group (:meth:`WindowAggregation.partials`), merges two
accumulators (:meth:`merge`: a partial into the stored one, or two sessions' accumulators), and gives the result
fields of an accumulator (:meth:`result`). Accumulators are stored with :meth:`accumulator_serializer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups.serializers import (
    Float64Serializer,
    Int64Serializer,
    NullableSerializer,
    RecordSerializer,
    TupleSerializer,
    TypeSerializer,
)
from keygroups.state import AggregateFunction, ReduceFunction

#: Mean's accumulator: the sum and the count of the values (tuples in, tuples out).
MEAN_ACCUMULATOR = RecordSerializer.from_fields([("sum", "double", False), ("count", "bigint", False)], form="tuple")


class WindowAggregation:
    """One aggregation of a window's rows; see the module docstring."""

    def bind(self, schema: pa.Schema) -> None:
        """Resolve the input columns against the job's input schema (called once by the window builder)."""

    def output_fields(self) -> list[pa.Field]:
        raise NotImplementedError

    def accumulator_serializer(self) -> TypeSerializer:
        raise NotImplementedError

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        raise NotImplementedError

    def merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        raise NotImplementedError


class Count(WindowAggregation):
    """The number of rows of the window (``count``, int64)."""

    def __init__(self, name: str = "count") -> None:
        self.name = name

    def output_fields(self) -> list[pa.Field]:
        return [pa.field(self.name, pa.int64())]

    def accumulator_serializer(self) -> TypeSerializer:
        return Int64Serializer()

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        return np.diff(bounds).tolist()

    def merge(self, a: Any, b: Any) -> Any:
        return a + b

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return (accumulator,)


class _ColumnAggregation(WindowAggregation):
    """An aggregation of one numeric column; nulls are ignored (as SQL's aggregates ignore them)."""

    prefix = ""

    def __init__(self, column: str, name: str | None = None) -> None:
        self.column = column
        self.name = name if name is not None else f"{self.prefix}_{column}"
        self.integer = False

    def bind(self, schema: pa.Schema) -> None:
        if self.column not in schema.names:
            raise ValueError(f"{type(self).__name__}({self.column!r}): the input has no column {self.column!r}; its "
                             f"columns are {schema.names}")
        t = schema.field(self.column).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise TypeError(f"{type(self).__name__}({self.column!r}) needs a numeric column, got {t}")
        self.integer = pa.types.is_integer(t)

    def _values(self, records: pa.Table, order: np.ndarray, fill: Any) -> tuple[np.ndarray, np.ndarray]:
        """The column's values in group order (nulls replaced by ``fill``) and whether each was not null."""
        column = records.column(self.column)
        valid = column.is_valid().to_numpy(zero_copy_only=False)[order]
        dtype = np.int64 if self.integer else np.float64
        values = np.asarray(column.fill_null(fill).to_numpy(zero_copy_only=False), dtype=dtype)[order]
        return values, valid

    def _scalar(self) -> TypeSerializer:
        return Int64Serializer() if self.integer else Float64Serializer()

    def _type(self) -> pa.DataType:
        return pa.int64() if self.integer else pa.float64()


def _starts(bounds: np.ndarray) -> np.ndarray:
    return bounds[:-1]


class Sum(_ColumnAggregation):
    """The sum of a column (``sum_<column>``; int64 for an integer column, else double). No value: null."""

    prefix = "sum"

    def output_fields(self) -> list[pa.Field]:
        return [pa.field(self.name, self._type())]

    def accumulator_serializer(self) -> TypeSerializer:
        return NullableSerializer(self._scalar())

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        values, valid = self._values(records, order, 0)
        sums = np.add.reduceat(values, _starts(bounds)).tolist()
        seen = np.add.reduceat(valid.astype(np.int64), _starts(bounds)).tolist()
        return [s if n else None for s, n in zip(sums, seen)]

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else a + b

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return (accumulator,)


class _Extreme(_ColumnAggregation):
    ufunc: Any = None
    pick: Any = min

    def output_fields(self) -> list[pa.Field]:
        return [pa.field(self.name, self._type())]

    def accumulator_serializer(self) -> TypeSerializer:
        return NullableSerializer(self._scalar())

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        values, valid = self._values(records, order, 0)
        if not valid.all():
            info = np.iinfo(np.int64) if self.integer else None
            far = (info.max if self.ufunc is np.minimum else info.min) if info else (
                np.inf if self.ufunc is np.minimum else -np.inf)
            values = np.where(valid, values, far)
        out = self.ufunc.reduceat(values, _starts(bounds)).tolist()
        seen = np.add.reduceat(valid.astype(np.int64), _starts(bounds)).tolist()
        return [v if n else None for v, n in zip(out, seen)]

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else type(self).pick(a, b)

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return (accumulator,)


class Min(_Extreme):
    """The smallest value of a column (``min_<column>``)."""

    prefix = "min"
    ufunc = np.minimum
    pick = min


class Max(_Extreme):
    """The largest value of a column (``max_<column>``)."""

    prefix = "max"
    ufunc = np.maximum
    pick = max


class Mean(_ColumnAggregation):
    """The mean of a column (``avg_<column>``, double; accumulator (sum, count) so that windows merge exactly).

    The accumulator is a record ``sum double, count bigint`` (values as tuples), so the state reader shows named
    fields; checkpoints written when it was a ``TupleSerializer`` of the two migrate to it on restore."""

    prefix = "avg"

    def output_fields(self) -> list[pa.Field]:
        return [pa.field(self.name, pa.float64())]

    def accumulator_serializer(self) -> TypeSerializer:
        return MEAN_ACCUMULATOR

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        values, valid = self._values(records, order, 0)
        sums = np.add.reduceat(values.astype(np.float64), _starts(bounds)).tolist()
        counts = np.add.reduceat(valid.astype(np.int64), _starts(bounds)).tolist()
        return list(zip(sums, counts))

    def merge(self, a: Any, b: Any) -> Any:
        return (a[0] + b[0], a[1] + b[1])

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return (accumulator[0] / accumulator[1] if accumulator[1] else None,)


class PythonAggregate(WindowAggregation):
    """A Python ``AggregateFunction`` applied per record (``add(record_dict, accumulator)``); ``get_result`` gives
    a tuple of the ``result_fields`` (or one value when there is one field). ``merge`` is needed for sessions.

    A ``RecordSerializer`` (of a dataclass, say) makes a good ``accumulator_serializer``: the accumulator is stored
    compactly, read back as that dataclass, shown by the state reader as named fields, and it can evolve (add,
    drop, widen fields) between runs."""

    def __init__(self, function: AggregateFunction, accumulator_serializer: TypeSerializer,
                 result_fields: list[pa.Field]) -> None:
        self.function = function
        self._serializer = accumulator_serializer
        self.fields = list(result_fields)

    def output_fields(self) -> list[pa.Field]:
        return self.fields

    def accumulator_serializer(self) -> TypeSerializer:
        return self._serializer

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        rows = records.take(pa.array(order)).to_pylist()
        f = self.function
        out = []
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            acc = f.create_accumulator()
            for row in rows[lo:hi]:
                acc = f.add(row, acc)
            out.append(acc)
        return out

    def merge(self, a: Any, b: Any) -> Any:
        return self.function.merge(a, b)

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        r = self.function.get_result(accumulator)
        return tuple(r) if len(self.fields) > 1 else (r,)


class PythonReduce(WindowAggregation):
    """A ``ReduceFunction`` (or callable ``(a, b) -> c``) over one column's values, per record; the result field is
    the column (same name and type)."""

    def __init__(self, function: ReduceFunction | Callable[[Any, Any], Any], column: str,
                 serializer: TypeSerializer) -> None:
        self.reduce = function.reduce if isinstance(function, ReduceFunction) else function
        self.column = column
        self._serializer = serializer
        self.field: pa.Field | None = None

    def bind(self, schema: pa.Schema) -> None:
        if self.column not in schema.names:
            raise ValueError(f"reduce over {self.column!r}: the input has no such column; its columns are "
                             f"{schema.names}")
        self.field = schema.field(self.column)

    def output_fields(self) -> list[pa.Field]:
        assert self.field is not None, "bind() first"
        return [self.field]

    def accumulator_serializer(self) -> TypeSerializer:
        return self._serializer

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[Any]:
        values = records.column(self.column).take(pa.array(order)).to_pylist()
        out = []
        reduce = self.reduce
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            acc = values[lo]
            for v in values[lo + 1:hi]:
                acc = reduce(acc, v)
            out.append(acc)
        return out

    def merge(self, a: Any, b: Any) -> Any:
        return self.reduce(a, b)

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return (accumulator,)


class Aggregations:
    """Several aggregations side by side: one tuple accumulator, results concatenated."""

    def __init__(self, parts: list[WindowAggregation]) -> None:
        self.parts = parts

    def output_fields(self) -> list[pa.Field]:
        return [f for p in self.parts for f in p.output_fields()]

    def accumulator_serializer(self) -> TypeSerializer:
        return TupleSerializer(*(p.accumulator_serializer() for p in self.parts))

    def partials(self, records: pa.Table, order: np.ndarray, bounds: np.ndarray) -> list[tuple[Any, ...]]:
        return list(zip(*(p.partials(records, order, bounds) for p in self.parts)))

    def merge(self, a: Any, b: Any) -> tuple[Any, ...]:
        return tuple(p.merge(x, y) for p, x, y in zip(self.parts, a, b))

    def result(self, accumulator: Any) -> tuple[Any, ...]:
        return tuple(v for p, acc in zip(self.parts, accumulator) for v in p.result(acc))


__all__ = ["WindowAggregation", "Count", "Sum", "Min", "Max", "Mean", "PythonAggregate", "PythonReduce",
           "Aggregations"]
