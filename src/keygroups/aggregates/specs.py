"""The aggregations a declarative keyed aggregate computes: ``count``, ``sum_of``, ``min_of``, ``max_of``, ``first``,
``last``, ``mean`` and ``reduce_with`` (a numpy ufunc).

Each aggregation keeps one keyed ``ValueState`` named after it (its output column): the same state a per-record
function would keep for it, so a job can move between the two forms through a savepoint, and both read alike in the
state reader. What each one stores, and how a record changes it (``v``: the record's value of the column; a null
``v`` changes nothing, as SQL's aggregates ignore nulls; the state of a key with no value yet is absent, and its
result null, except ``count``'s, which is 0):

=================  =========================================  ==========================================================
aggregation        state (serializer)                         on a record with a value ``v``
=================  =========================================  ==========================================================
``count()``        records so far (``Int64Serializer``)        ``n + 1`` (every record counts, null or not)
``count(c)``       non-null values so far (``Int64Serializer``) ``n + 1``
``sum_of(c)``      the sum (``Int64Serializer`` for integer    ``s + v``, one value after the other in record order (an
                   columns, ``Float64Serializer`` for floats)  integer sum past the int64 range raises)
``min_of(c)``      the smallest value (by column type)         ``v`` if ``v`` < ``m`` (doubles as Java compares them:
``max_of(c)``      the largest                                 NaN above every number, -0.0 below 0.0)
``first(c)``       the first non-null value                    unchanged
``last(c)``        the latest non-null value                   ``v``
``mean(c)``        ``(sum double, count bigint)``, a record    ``(s + float(v), n + 1)``; the result is ``s / n``
``reduce_with(f,   ``f``'s running value (by its result type)  ``f(a, v)`` (``a`` the value so far); the first value as
c)``                                                           it is
=================  =========================================  ==========================================================

Integer columns of any width are kept as int64 (the min, max, first and last come back in the column's own type),
floats as double, booleans as bool (count, min, max, first, last), and timestamps, dates, times and durations as their
int64 count of the column's unit (count, min, max, first, last). ``count(c)`` takes a column of any type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups._native import aggregates as _kernels
from keygroups.serializers import (
    BoolSerializer,
    Float64Serializer,
    Int64Serializer,
    RecordSerializer,
    TypeSerializer,
)

#: What ``mean`` stores: the sum (as a double) and the count of the values, in a record (values as tuples).
MEAN_STATE = RecordSerializer.from_fields([("sum", "double", False), ("count", "bigint", False)], form="tuple")

INT64 = np.dtype(np.int64)
FLOAT64 = np.dtype(np.float64)
BOOL = np.dtype(np.bool_)

_SERIALIZERS: dict[np.dtype[Any], Callable[[], TypeSerializer[Any]]] = {
    INT64: Int64Serializer, FLOAT64: Float64Serializer, BOOL: BoolSerializer}
_ARROW = {INT64: pa.int64(), FLOAT64: pa.float64(), BOOL: pa.bool_()}


def storage_of(t: pa.DataType) -> np.dtype[Any] | None:
    """The numpy dtype a column of Arrow type ``t`` is aggregated in (None: not a numeric, boolean or temporal
    type)."""
    if pa.types.is_integer(t):
        return None if t == pa.uint64() else INT64
    if pa.types.is_floating(t):
        return FLOAT64
    if pa.types.is_boolean(t):
        return BOOL
    if pa.types.is_temporal(t):
        return INT64
    return None


def column_values(column: pa.ChunkedArray | pa.Array, storage: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """A column's values as a contiguous array of ``storage`` (nulls as 0) and its validity as uint8 (None: no
    nulls)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    t = column.type
    if pa.types.is_temporal(t):
        column = column.view(pa.int64()) if t.bit_width == 64 else column.cast(pa.int32()).cast(pa.int64())
    valid = None
    if column.null_count:
        valid = np.ascontiguousarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=np.uint8)
        column = column.fill_null(False if storage == BOOL else 0)
    values = np.ascontiguousarray(column.to_numpy(zero_copy_only=False), dtype=storage)
    return values, valid


class Aggregation:
    """One aggregation of a keyed aggregate (see the module docstring); build one with the functions below."""

    #: The kind of computation: "count", "fold" (a kernel op), "mean" or "ufunc".
    kind = ""
    prefix = ""

    def __init__(self, column: str | None, name: str | None) -> None:
        if column is not None and not isinstance(column, str):
            raise TypeError(f"{type(self).__name__}: the column must be a column name (str), got {column!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{type(self).__name__}: name must be a non-empty str, got {name!r}")
        self.column = column
        self.name = name if name is not None else (f"{self.prefix}_{column}" if column is not None else self.prefix)
        self.input_type: pa.DataType | None = None
        self.storage: np.dtype[Any] = INT64

    def __repr__(self) -> str:
        args = [repr(self.column)] if self.column is not None else []
        return f"{type(self).__name__}({', '.join(args)}, name={self.name!r})"

    def bind(self, schema: pa.Schema) -> None:
        """Resolve the column against the job's input schema (its type decides the storage)."""
        if self.column is None:
            return
        if self.column not in schema.names:
            raise ValueError(f"{self!r}: the input has no column {self.column!r}; its columns are {schema.names}")
        self.input_type = schema.field(self.column).type
        storage = storage_of(self.input_type)
        allowed = self.allowed()
        if storage is None or storage not in allowed:
            raise TypeError(f"{self!r}: column {self.column!r} is {self.input_type}; {self.prefix} takes "
                            f"{self.describe_allowed()} columns")
        self.storage = storage

    def allowed(self) -> tuple[np.dtype[Any], ...]:
        return (INT64, FLOAT64, BOOL)

    def describe_allowed(self) -> str:
        return "integer, floating-point, boolean, timestamp, date, time or duration"

    def serializer(self) -> TypeSerializer[Any]:
        """The serializer of the aggregation's ValueState."""
        return _SERIALIZERS[self.storage]()

    def output_type(self) -> pa.DataType:
        return _ARROW[self.storage]

    def output_field(self) -> pa.Field:
        return pa.field(self.name, self.output_type(), nullable=True)

    # ---- the per-record reference (documentation and tests: what the vectorized form must equal) ----------------
    def fold(self, acc: Any, value: Any) -> Any:
        """The state after a record with non-null ``value`` (``acc``: the state before, None if absent)."""
        raise NotImplementedError

    def result(self, acc: Any) -> Any:
        """The output value of state ``acc`` (None if absent)."""
        return acc

    def python_value(self, value: Any) -> Any:
        """A record's value of the column as the state keeps it (temporal values as their int64 count)."""
        return value


class _Count(Aggregation):
    """Records (``count()``) or non-null values of a column (``count("c")``) so far, as a long."""

    kind = "count"
    prefix = "count"

    def bind(self, schema: pa.Schema) -> None:
        if self.column is not None and self.column not in schema.names:
            raise ValueError(f"{self!r}: the input has no column {self.column!r}; its columns are {schema.names}")
        self.input_type = schema.field(self.column).type if self.column is not None else None
        self.storage = INT64

    def output_field(self) -> pa.Field:
        return pa.field(self.name, pa.int64(), nullable=False)

    def fold(self, acc: Any, value: Any) -> Any:
        return (acc or 0) + 1

    def result(self, acc: Any) -> Any:
        return acc or 0


class _Fold(Aggregation):
    """An aggregation one kernel op folds (sum, min, max, first, last)."""

    kind = "fold"
    op = -1

    def output_type(self) -> pa.DataType:
        if self.input_type is not None and self.op != _kernels.SUM:
            return self.input_type   # min, max, first, last: values of the column, in its type
        return _ARROW[self.storage]

    def python_value(self, value: Any) -> Any:
        if self.input_type is not None and pa.types.is_temporal(self.input_type):
            return pa.scalar(value, self.input_type).cast(pa.int64()).as_py() if not isinstance(value, int) else value
        if self.storage == FLOAT64:
            return float(value)
        return value


class _Sum(_Fold):
    prefix = "sum"
    op = _kernels.SUM

    def allowed(self) -> tuple[np.dtype[Any], ...]:
        return (INT64, FLOAT64)

    def describe_allowed(self) -> str:
        return "integer or floating-point"

    def bind(self, schema: pa.Schema) -> None:
        super().bind(schema)
        if self.input_type is not None and pa.types.is_temporal(self.input_type):
            raise TypeError(f"{self!r}: column {self.column!r} is {self.input_type}; sum takes integer or "
                            "floating-point columns")

    def fold(self, acc: Any, value: Any) -> Any:
        if acc is None:
            return value
        out = acc + value
        if self.storage == INT64 and not -2**63 <= out < 2**63:
            raise ArithmeticError(f"{self.name}: the sum {acc} + {value} does not fit a long (int64)")
        return out


def java_less(a: Any, b: Any) -> bool:
    """a < b as Java's compare orders doubles (NaN above every number, -0.0 below 0.0); plain < otherwise."""
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        if a < b:
            return True
        if a > b or a != a:
            return False
        if b != b:
            return True
        return np.signbit(a) and not np.signbit(b)
    return bool(a < b)


class _Min(_Fold):
    prefix = "min"
    op = _kernels.MIN

    def fold(self, acc: Any, value: Any) -> Any:
        return value if acc is None or java_less(value, acc) else acc


class _Max(_Fold):
    prefix = "max"
    op = _kernels.MAX

    def fold(self, acc: Any, value: Any) -> Any:
        return value if acc is None or java_less(acc, value) else acc


class _First(_Fold):
    prefix = "first"
    op = _kernels.FIRST

    def fold(self, acc: Any, value: Any) -> Any:
        return value if acc is None else acc


class _Last(_Fold):
    prefix = "last"
    op = _kernels.LAST

    def fold(self, acc: Any, value: Any) -> Any:
        return value


class _Mean(Aggregation):
    prefix = "avg"
    kind = "mean"

    def allowed(self) -> tuple[np.dtype[Any], ...]:
        return (INT64, FLOAT64)

    def describe_allowed(self) -> str:
        return "integer or floating-point"

    def bind(self, schema: pa.Schema) -> None:
        super().bind(schema)
        if self.input_type is not None and pa.types.is_temporal(self.input_type):
            raise TypeError(f"{self!r}: column {self.column!r} is {self.input_type}; mean takes integer or "
                            "floating-point columns")

    def serializer(self) -> TypeSerializer[Any]:
        return MEAN_STATE

    def output_type(self) -> pa.DataType:
        return pa.float64()

    def fold(self, acc: Any, value: Any) -> Any:
        s, n = acc if acc is not None else (0.0, 0)
        return (s + float(value), n + 1)

    def result(self, acc: Any) -> Any:
        return None if acc is None or not acc[1] else acc[0] / acc[1]


class _Reduce(Aggregation):
    """A numpy ufunc's running reduction of a column."""

    kind = "ufunc"
    prefix = "reduce"

    def __init__(self, ufunc: np.ufunc, column: str, name: str | None) -> None:
        if not isinstance(ufunc, np.ufunc) or ufunc.nin != 2 or ufunc.nout != 1:
            raise TypeError(f"reduce_with takes a binary numpy ufunc (np.add, np.maximum, np.bitwise_or, np.fmax, "
                            f"...: two inputs, one output), got {ufunc!r}")
        self.ufunc = ufunc
        super().__init__(column, name if name is not None else f"{ufunc.__name__}_{column}")

    def __repr__(self) -> str:
        return f"reduce_with(np.{self.ufunc.__name__}, {self.column!r}, name={self.name!r})"

    def bind(self, schema: pa.Schema) -> None:
        super().bind(schema)
        probe = np.zeros(1, dtype=self.storage)
        try:
            out = self.ufunc(probe, probe)
        except TypeError as e:
            raise TypeError(f"{self!r}: np.{self.ufunc.__name__} does not take two {self.storage} values: {e}") from None
        dtype = np.dtype(out.dtype)
        if dtype not in (INT64, FLOAT64, BOOL):
            raise TypeError(f"{self!r}: np.{self.ufunc.__name__} of two {self.storage} values gives {dtype}; the "
                            "state keeps int64, float64 or bool")
        self.storage = dtype

    def fold(self, acc: Any, value: Any) -> Any:
        v = np.asarray(value).astype(self.storage)
        if acc is None:
            return v.item()
        return self.ufunc(np.asarray(acc, dtype=self.storage), v).astype(self.storage).item()


# ---- the builders ---------------------------------------------------------------------------------------------------
def count(column: str | None = None, *, name: str | None = None) -> Aggregation:
    """The number of records of the key so far (``count()``, Flink's and Spark's ``COUNT(*)``), or of its non-null
    values of ``column`` (``COUNT(column)``). Output column ``count`` (``count_<column>``), a long, never null."""
    return _Count(column, name)


def sum_of(column: str, *, name: str | None = None) -> Aggregation:
    """The sum of ``column``'s values (``sum_<column>``): a long for integer columns (raises past the int64 range),
    a double for floating-point ones, added one value after the other in record order. Null before any value."""
    return _Sum(column, name)


def min_of(column: str, *, name: str | None = None) -> Aggregation:
    """The smallest of ``column``'s values (``min_<column>``, in the column's type; doubles ordered as Java compares
    them: NaN above every number, -0.0 below 0.0)."""
    return _Min(column, name)


def max_of(column: str, *, name: str | None = None) -> Aggregation:
    """The largest of ``column``'s values (``max_<column>``, in the column's type; ordered as :func:`min_of`)."""
    return _Max(column, name)


def first(column: str, *, name: str | None = None) -> Aggregation:
    """The key's first non-null value of ``column`` (``first_<column>``), in record order."""
    return _First(column, name)


def last(column: str, *, name: str | None = None) -> Aggregation:
    """The key's latest non-null value of ``column`` (``last_<column>``), in record order."""
    return _Last(column, name)


def mean(column: str, *, name: str | None = None) -> Aggregation:
    """The mean of ``column``'s values (``avg_<column>``, a double): the state keeps their sum and count."""
    return _Mean(column, name)


def reduce_with(ufunc: np.ufunc, column: str, *, name: str | None = None) -> Aggregation:
    """A binary numpy ufunc folded over ``column``'s values in record order: ``a = ufunc(a, v)``, the first value
    as it is (``np.bitwise_or``, ``np.maximum``, ``np.fmin``, ``np.multiply``, ...). Output ``<ufunc>_<column>`` in
    the ufunc's result type for the column (int64, float64 or bool)."""
    return _Reduce(ufunc, column, name)


__all__ = ["Aggregation", "count", "sum_of", "min_of", "max_of", "first", "last", "mean", "reduce_with",
           "MEAN_STATE", "storage_of", "column_values", "java_less"]
