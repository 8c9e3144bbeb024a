"""Declarative keyed aggregates: running ``count``, ``sum``, ``min``, ``max``, ``first``, ``last``, ``mean`` and a numpy
ufunc's reduction per key, computed a micro-batch at a time with numpy and compiled kernels, not a Python call per
record::

    from keygroups.aggregates import aggregate, count, sum_of, max_of

    totals = aggregate(count(), sum_of("amount"), max_of("amount"), input_schema=schema, key_columns="user")
    KeyedJob("totals", "user", totals, output_schema=totals.output_schema, ...)

It emits per record the key's results so far (``emit="per_record"``, Flink's rolling ``keyBy().sum()``), per key of
each batch its results after it (``"per_key"``, Spark's update mode), or per key once it expires (``"final"`` with
``expire_after``). Each aggregation keeps one ordinary keyed ``ValueState`` named after its output column (see
:mod:`keygroups.aggregates.specs`), so the job's checkpoints hold exactly what a per-record ``KeyedProcessFunction``
with those value states would hold: they restore at any parallelism and on either backend, read through the state
reader and the test harness, export to Flink, and a job can switch between the two forms through a savepoint.

On the heap backend the accumulators live as numpy columns per key (``keygroups.aggregates.table``, bound to the
backend as external states, ``keygroups.state.external``); on RocksDB in the database, read and written once per key
of a batch.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from keygroups.aggregates.function import EMITS, EXPIRY_STATE, Emit, KeyedAggregate
from keygroups.aggregates.specs import (
    Aggregation,
    count,
    first,
    last,
    max_of,
    mean,
    min_of,
    reduce_with,
    sum_of,
)
from keygroups.state import StateTtlConfig
from keygroups.state.timers import TIMER_STATE_PREFIX


def _millis(value: Any, what: str) -> int:
    if isinstance(value, datetime.timedelta):
        ms = round(value.total_seconds() * 1000)
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise TypeError(f"{what} must be a datetime.timedelta or an int of milliseconds, got {value!r}")
    if ms <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return int(ms)


def aggregate(*aggregations: Aggregation, input_schema: pa.Schema, key_columns: Sequence[str] | str,
              emit: Emit = "per_record", keep_columns: Sequence[str] | str = (), ttl: StateTtlConfig | None = None,
              expire_after: datetime.timedelta | int | None = None,
              timestamp_column: str | None = None) -> KeyedAggregate:
    """A keyed function computing ``aggregations`` (:func:`count`, :func:`sum_of`, :func:`min_of`, :func:`max_of`,
    :func:`first`, :func:`last`, :func:`mean`, :func:`reduce_with`) per key of a job whose input is
    ``input_schema``, keyed by ``key_columns`` (the job's). Its ``output_schema`` is the job's output schema: the key
    columns, with ``emit="per_record"`` the ``keep_columns`` (input columns carried into each record's row), then one
    column per aggregation.

    ``emit``: ``"per_record"`` (a row per record with the key's results after it), ``"per_key"`` (a row per key of
    the batch with its results after the batch) or ``"final"`` (a row per key when it expires; needs
    ``expire_after``).

    ``ttl``: a ``StateTtlConfig`` for the aggregations' states: a key not seen for that long starts again from
    nothing (processing or event time, either update type; expired values are never returned, Flink's default
    visibility). ``expire_after`` (a timedelta or ms): a key's accumulation ends that long after its latest record,
    by a timer of the key: in event time (``timestamp_column``, the job's event-time column: the record's time, fired
    by the watermark) or, without ``timestamp_column``, in processing time (the batch's)."""
    if not aggregations:
        raise TypeError("aggregate needs at least one aggregation: count(), sum_of('amount'), ...")
    bad = [a for a in aggregations if not isinstance(a, Aggregation)]
    if bad:
        raise TypeError(f"aggregate takes aggregations (count(), sum_of('amount'), min_of, max_of, first, last, mean, "
                        f"reduce_with), got {bad[0]!r}")
    if not isinstance(input_schema, pa.Schema):
        raise TypeError(f"input_schema must be a pyarrow Schema (the keyed job's input), got {input_schema!r}")
    keys = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
    missing = [c for c in keys if c not in input_schema.names]
    if not keys or missing:
        raise ValueError(f"key_columns {keys} must be columns of the input; missing {missing}, the input has "
                         f"{input_schema.names}")
    if emit not in EMITS:
        raise ValueError(f"emit must be one of {list(EMITS)}, got {emit!r}")
    keep = (keep_columns,) if isinstance(keep_columns, str) else tuple(keep_columns)
    if keep and emit != "per_record":
        raise ValueError(f"keep_columns {keep} are carried into per-record rows only; emit={emit!r} has one row per key")
    missing = [c for c in keep if c not in input_schema.names]
    if missing:
        raise ValueError(f"keep_columns {missing} are not columns of the input {input_schema.names}")
    if ttl is not None:
        if not isinstance(ttl, StateTtlConfig):
            raise TypeError(f"ttl must be a keygroups.state.StateTtlConfig, got {ttl!r}")
        if ttl.return_expired:
            raise ValueError("ttl: declarative aggregates never return expired values (StateVisibility."
                             "NeverReturnExpired, Flink's default); ReturnExpiredIfNotCleanedUp is not supported")
        if not ttl.is_enabled:
            ttl = None
    expire_ms = _millis(expire_after, "expire_after") if expire_after is not None else None
    if emit == "final" and expire_ms is None:
        raise ValueError("emit='final' emits a key's results when it expires: give expire_after (a timedelta or ms)")
    if timestamp_column is not None:
        if expire_ms is None:
            raise ValueError("timestamp_column is the event time of expire_after; give expire_after too")
        if timestamp_column not in input_schema.names:
            raise ValueError(f"timestamp_column {timestamp_column!r} is not a column of the input {input_schema.names}")
        t = input_schema.field(timestamp_column).type
        if not (pa.types.is_timestamp(t) or pa.types.is_integer(t)):
            raise TypeError(f"timestamp_column {timestamp_column!r} is {t}; it must be a timestamp, or a long of "
                            "epoch milliseconds")
    bound = []
    for a in aggregations:
        a = copy.copy(a)
        a.bind(input_schema)
        bound.append(a)
    names = [a.name for a in bound]
    taken = list(keys) + (list(keep) if emit == "per_record" else [])
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(taken)))
    if clash:
        raise ValueError(f"output columns would repeat {clash}: name the aggregations (e.g. sum_of('x', "
                         "name='total'))")
    for n in names:
        if n.startswith(TIMER_STATE_PREFIX) or (expire_ms is not None and n == EXPIRY_STATE):
            raise ValueError(f"aggregation name {n!r} is reserved (it names the aggregate's own state); choose another")
    return KeyedAggregate(bound, input_schema=input_schema, key_columns=keys, emit=emit, keep_columns=keep, ttl=ttl,
                          expire_after=expire_ms, timestamp_column=timestamp_column)


__all__ = ["aggregate", "KeyedAggregate", "Aggregation", "Emit", "count", "sum_of", "min_of", "max_of", "first",
           "last", "mean", "reduce_with"]
