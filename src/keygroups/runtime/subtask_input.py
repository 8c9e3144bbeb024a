"""A keyed subtask's input, made ready for the function: the records split into late and on time, each record's key
group computed and checked against the subtask's own, the records sorted by key group, key (as Java's ``equals``
groups keys) and ``order_by``, and the runs of equal keys found; and the function's output records as one Arrow
table of the output schema."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keygroups._hashing import assign_key_groups, assign_key_groups_for_tuples
from keygroups._native.aggregates import group_key_order
from keygroups._ranges import KeyGroupRange
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.state.timers import NO_WATERMARK


@dataclass(frozen=True)
class SubtaskInput:
    """One subtask's records of one batch, ready for the function: ``table`` the on-time records sorted by key group,
    key and ``order_by`` (input columns only), ``groups`` their key groups and ``event_times`` their event times
    (epoch ms; empty without a timestamp column), both in the table's order; ``late`` the records at or before the
    batch's start watermark; ``records_in`` all it got; ``event_time_range`` the smallest and largest event time it
    got, late ones included (None: none); ``records_per_group`` the on-time records per key group of its range."""

    table: pa.Table
    groups: np.ndarray
    event_times: np.ndarray
    late: pa.Table
    records_in: int
    event_time_range: tuple[int, int] | None
    records_per_group: np.ndarray


def prepare_input(spec: KeyedTaskSpec, subtask_index: int, own_range: KeyGroupRange,
                  batches: Iterable[pa.RecordBatch], late_mask: Any) -> SubtaskInput:
    """Subtask ``subtask_index``'s records (``batches``) ready for the function; ``late_mask(event_times,
    watermark)`` is the function's lateness rule. KeyGroupOutOfRangeError naming the key if a record's key group is
    not the subtask's (the input was not placed by key group)."""
    table = pa.Table.from_batches(list(batches), schema=spec.input_schema)
    records_in = table.num_rows
    late = spec.input_schema.empty_table()
    event_times = np.zeros(0, dtype=np.int64)
    event_time_range = None
    if records_in and spec.timestamp_column is not None:
        event_times = event_time_millis(table.column(spec.timestamp_column), spec.timestamp_column)
        stamped = event_times[event_times != NO_WATERMARK]
        if len(stamped):   # late records included: the range of what arrived
            event_time_range = (int(stamped.min()), int(stamped.max()))
        if spec.start_watermark != NO_WATERMARK:
            is_late = late_mask(event_times, spec.start_watermark) & (event_times != NO_WATERMARK)
            if is_late.any():
                late = table.filter(pa.array(is_late))
                table = table.filter(pa.array(~is_late))
                event_times = event_times[~is_late]
    groups = np.zeros(0, dtype=np.int32)
    records_per_group = np.zeros(len(own_range), dtype=np.int64)   # the load figures (runtime.assignment)
    if table.num_rows:
        groups = key_groups_of(table, spec)
        outside = (groups < own_range.start) | (groups > own_range.end)
        if outside.any():
            pos = int(np.argmax(outside))
            key = tuple(table.column(c)[pos].as_py() for c in spec.key_columns)
            raise KeyGroupOutOfRangeError(
                f"subtask {subtask_index} of {spec.parallelism} owns key groups {own_range} but received key "
                f"{key if len(key) > 1 else key[0]!r} of key group {int(groups[pos])}: the input was not partitioned "
                "by key group (or the key's hash is not deterministic)"
            )
        records_per_group = np.bincount(groups - own_range.start, minlength=len(own_range))
        table, order = _sorted(table, groups, spec)
        groups = groups[order]
        if len(event_times):
            event_times = event_times[order]
    return SubtaskInput(table, groups, event_times, late, records_in, event_time_range, records_per_group)


def _sorted(table: pa.Table, groups: np.ndarray, spec: KeyedTaskSpec) -> tuple[pa.Table, np.ndarray]:
    """``table`` sorted by key group, key (floats by their bits: -0.0 and 0.0 do not interleave) and ``order_by``,
    and the order (indices into ``table``)."""
    if len(spec.key_columns) == 1 and not spec.order_columns:
        keys = _int64_sort_keys(table.column(spec.key_columns[0]))
        if keys is not None:   # one integer (or float) key: a compiled radix sort, the same stable order
            order = group_key_order(np.ascontiguousarray(groups, dtype=np.int32), keys)
            return table.take(order), order
    group_column = unused_name(table.column_names, "__key_group")   # input columns may have any name
    table = table.append_column(group_column, pa.array(groups, pa.int16()))
    sort_keys = [(group_column, "ascending")]
    for i, c in enumerate(spec.key_columns):
        column = java_equality_column(table.column(c))
        if column is table.column(c):
            sort_keys.append((c, "ascending"))
        else:
            bits_column = unused_name(table.column_names, f"__key_bits_{i}")
            table = table.append_column(bits_column, column)
            sort_keys.append((bits_column, "ascending"))
    sort_keys += [(c, "ascending") for c in spec.order_columns]
    order = pc.sort_indices(table, sort_keys=sort_keys)
    return table.take(order).select(list(spec.input_schema.names)), order.to_numpy()


def _int64_sort_keys(column: pa.ChunkedArray) -> np.ndarray | None:
    """A key column without nulls as int64 values in its sort order (integers up to 32-bit unsigned, floats by their
    bits as :func:`java_equality_column` gives them); None for any other column."""
    if column.null_count:
        return None
    t = column.type
    if pa.types.is_floating(t):
        column = java_equality_column(column)
    elif not pa.types.is_integer(t) or t == pa.uint64():
        return None
    return np.ascontiguousarray(column.to_numpy(), dtype=np.int64)


def key_groups_of(table: pa.Table, spec: KeyedTaskSpec) -> np.ndarray:
    """The key group of every record of ``table``, as ``assign_key_groups`` computes it."""
    columns = [table.column(c) for c in spec.key_columns]
    if len(columns) == 1:
        return assign_key_groups(columns[0], spec.max_parallelism, spec.key_type)  # type: ignore[arg-type]
    return assign_key_groups_for_tuples(columns, spec.max_parallelism, spec.key_type)


_CANONICAL_NAN_BITS = {pa.float16(): 0x7E00, pa.float32(): 0x7FC00000, pa.float64(): 0x7FF8000000000000}
_BITS = {pa.float16(): np.int16, pa.float32(): np.int32, pa.float64(): np.int64}


def java_equality_column(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A key column as Java's ``equals`` groups it: floats by their IEEE bits with one canonical NaN (every NaN is
    one key; -0.0 is not 0.0), anything else as it is (the same object)."""
    if not pa.types.is_floating(column.type):
        return column
    values = column.to_numpy(zero_copy_only=False)
    bits = values.view(_BITS[column.type]).astype(np.int64)
    bits[np.isnan(values)] = _CANONICAL_NAN_BITS[column.type]
    return pa.chunked_array([pa.array(bits, mask=column.is_null().to_numpy(zero_copy_only=False))])


def unused_name(names: Sequence[str], wanted: str) -> str:
    """``wanted``, or ``wanted`` with a numbered suffix if a column of that name exists."""
    taken = set(names)
    name, n = wanted, 0
    while name in taken:
        n += 1
        name = f"{wanted}_{n}"
    return name


def key_runs(table: pa.Table, key_columns: tuple[str, ...]) -> np.ndarray:
    """Start offsets of the runs of equal keys (equal as Java compares them) in a table sorted by key (plus the
    end offset)."""
    n = table.num_rows
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    change = np.zeros(n - 1, dtype=bool)
    for name in key_columns:
        col = java_equality_column(table.column(name))
        change |= pc.not_equal(col.slice(1), col.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.flatnonzero(change) + 1, [n]]).astype(np.int64)


def event_time_millis(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """An event-time column as int64 epoch milliseconds (nulls as ``NO_WATERMARK``): a timestamp of any unit and
    time zone, or an integer column already in epoch ms. TypeError naming the column and the allowed types
    otherwise."""
    t = column.type
    if pa.types.is_timestamp(t):
        column = pc.cast(column, pa.timestamp("ms", t.tz), safe=False).cast(pa.int64())
    elif not pa.types.is_integer(t):
        raise TypeError(f"event-time column {name!r} is {t}; it must be a timestamp, or a long of epoch "
                        "milliseconds")
    return np.asarray(pc.fill_null(column.cast(pa.int64()), NO_WATERMARK).to_numpy(zero_copy_only=False),
                      dtype=np.int64)


def output_table(outputs: list[Any], schema: pa.Schema) -> pa.Table:
    """The function's output records as one table of ``schema``, in order. A record is a dict with exactly the
    schema's field names, a tuple (or list) of its width in its order, or an Arrow table holding at least its columns
    (others are dropped). Anything else raises, naming the record and the schema: a misspelled field must never
    become a silent null."""
    names = schema.names
    wanted = frozenset(names)
    parts: list[pa.Table] = []
    dicts: list[dict[str, Any]] = []
    tuples: list[Any] = []

    def flush() -> None:
        if dicts:
            parts.append(pa.Table.from_pylist(dicts, schema=schema))
            dicts.clear()
        if tuples:
            columns = list(zip(*tuples))
            parts.append(pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, schema)],
                                              schema=schema))
            tuples.clear()

    for record in outputs:
        if isinstance(record, dict):
            if record.keys() != wanted:
                unknown = sorted(str(k) for k in record.keys() - wanted)
                missing = [n for n in names if n not in record]
                raise ValueError(f"output record {record!r} does not match the output schema {names}: "
                                 f"unknown fields {unknown}, missing fields {missing} (give every field, None for "
                                 "a null)")
            if tuples:
                flush()
            dicts.append(record)
        elif isinstance(record, (tuple, list)):
            if len(record) != len(names):
                raise ValueError(f"output record {record!r} has {len(record)} fields; the output schema has "
                                 f"{len(names)}: {names}")
            if dicts:
                flush()
            tuples.append(record)
        elif isinstance(record, pa.Table):
            flush()
            missing = [n for n in names if n not in record.column_names]
            if missing:
                raise ValueError(f"an output table lacks the output schema's columns {missing}; it has "
                                 f"{record.column_names}, the schema {names}")
            parts.append(record.select(names).cast(schema))
        else:
            raise TypeError(f"output record {record!r} is a {type(record).__name__}; records are dicts (field "
                            f"names {names}), tuples in that order, or Arrow tables")
    flush()
    if not parts:
        return schema.empty_table()
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


__all__ = ["SubtaskInput", "prepare_input", "key_groups_of", "java_equality_column", "unused_name", "key_runs",
           "event_time_millis", "output_table"]
