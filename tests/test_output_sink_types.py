"""The compiled output sink's typed buffers (keygroups._native.recordloop.OutputSink): random output rows of mixed
types with nulls come out as ``pa.Table.from_pylist`` of the same rows; values the buffers do not take (numpy
scalars, wrong types, values out of range, other time zones) give what the Python path (``output_table``) gives,
its table or its error."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keygroups._native.recordloop import OutputSink
from keygroups.runtime.subtask_input import output_table

UTC = dt.timezone.utc
INT64 = (-(2**63), 2**63 - 1)
DATETIMES = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59, 999999))
# nanoseconds hold about 1677-09-22 to 2262-04-11
NS_DATETIMES = st.datetimes(min_value=dt.datetime(1677, 9, 22), max_value=dt.datetime(2262, 4, 11))


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0]))


def _floats(width: Literal[32, 64], exact: int) -> st.SearchStrategy[Any]:
    # floats (inf and NaN included) and the ints pyarrow converts exactly
    return st.one_of(st.floats(width=width), _ints(-exact, exact))


def _timestamps(unit: str) -> st.SearchStrategy[Any]:
    datetimes = NS_DATETIMES if unit == "ns" else DATETIMES
    return st.one_of(_ints(*INT64), datetimes, datetimes.map(lambda d: d.replace(tzinfo=UTC)))


# Each output column is one of these: an Arrow type and the Python values the typed buffers take for it.
TYPED: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.int8(), _ints(-(2**7), 2**7 - 1)),
    (pa.int16(), _ints(-(2**15), 2**15 - 1)),
    (pa.int32(), _ints(-(2**31), 2**31 - 1)),
    (pa.int64(), _ints(*INT64)),
    (pa.uint8(), _ints(0, 2**8 - 1)),
    (pa.uint16(), _ints(0, 2**16 - 1)),
    (pa.uint32(), _ints(0, 2**32 - 1)),
    (pa.uint64(), _ints(0, 2**64 - 1)),
    (pa.float32(), _floats(32, 2**24)),
    (pa.float64(), _floats(64, 2**53)),
    (pa.bool_(), st.booleans()),
    (pa.string(), st.text(max_size=6)),
    (pa.large_string(), st.text(max_size=6)),
    (pa.binary(), st.binary(max_size=6)),
    (pa.large_binary(), st.binary(max_size=6)),
    (pa.timestamp("s"), _timestamps("s")),
    (pa.timestamp("ms", "UTC"), _timestamps("ms")),
    (pa.timestamp("us"), _timestamps("us")),
    (pa.timestamp("ns", "Europe/Paris"), _timestamps("ns")),
    (pa.date32(), st.one_of(st.dates(), _ints(-(2**31), 2**31 - 1))),
    # (any int is taken as pyarrow takes it; whole days here, which full validation asks of a date64)
    (pa.date64(), st.one_of(st.dates(), _ints(-(2**24), 2**24).map(lambda d: d * 86_400_000))),
    (pa.list_(pa.int64()), st.lists(st.integers(-5, 5), max_size=2)),   # a type without typed buffers
]

# Values the buffers do not take: each goes to pyarrow, which converts it or raises as the Python path did.
UNTAKEN = st.sampled_from([
    np.int64(3), np.int8(-1), np.float32(1.5), np.float64(2.5), np.bool_(True), np.datetime64(5, "ms"), True, False,
    1.0, 1.5, -7, 2**63, 2**64, -(2**63) - 1, 2**53 + 1, 2**24 + 1, "x", "\ud800", b"\xff", b"ab", bytearray(b"q"),
    dt.datetime(2020, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=2))), dt.datetime(9999, 1, 1),
    dt.datetime(2020, 5, 6, 7, 8, 9), dt.date(2021, 3, 4), dt.timedelta(seconds=1), [1], {"a": 1}, object(),
])


@st.composite
def outputs(draw: st.DrawFn, untaken: bool) -> tuple[pa.Schema, list[tuple[Any, ...]]]:
    kinds = draw(st.lists(st.integers(0, len(TYPED) - 1), min_size=1, max_size=5))
    schema = pa.schema([(f"c{i}", TYPED[k][0]) for i, k in enumerate(kinds)])
    n = draw(st.integers(0, 40))
    columns = []
    for k in kinds:
        values = st.one_of(st.none(), TYPED[k][1])
        if untaken:
            values = st.one_of(values, UNTAKEN)
        columns.append(draw(st.lists(values, min_size=n, max_size=n)))
    return schema, list(zip(*columns)) if columns else []


def _bits(table: pa.Table) -> pa.Table:
    """``table`` with its float columns as their bit patterns: NaN equals NaN, -0.0 differs from 0.0."""
    columns = []
    for column in table.columns:
        array = column.combine_chunks()
        if pa.types.is_floating(array.type):
            array = array.view(pa.int32() if array.type == pa.float32() else pa.int64())
        columns.append(array)
    return pa.table(columns, names=table.column_names)


def _same(table: pa.Table, expected: pa.Table) -> bool:
    return table.schema == expected.schema and _bits(table).equals(_bits(expected))


def _sink_table(schema: pa.Schema, rows: list[Any], batches: list[int]) -> pa.Table:
    """The rows through one sink, its table taken after each of ``batches`` rows (as a subtask's parts are)."""
    sink = OutputSink(schema)
    parts, start = [], 0
    for size in [*batches, len(rows)]:
        sink.extend(rows[start:start + size])
        start += size
        parts.append(sink.table())
        if start >= len(rows):
            break
    return pa.concat_tables(parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs(untaken=False), st.booleans(), st.lists(st.integers(0, 20), max_size=2))
@example(output=(pa.schema([("c0", pa.float32())]), [(1e300,), (-(2**24),), (float("nan"),)]), as_dicts=False,
         batches=[])
@example(output=(pa.schema([("c0", pa.timestamp("ms"))]), [(dt.datetime(1969, 12, 31, 23, 59, 59, 999999),)]),
         as_dicts=True, batches=[])
def test_typed_columns_are_from_pylist(output, as_dicts, batches):
    schema, rows = output
    records = [dict(zip(schema.names, row)) for row in rows]
    table = _sink_table(schema, records if as_dicts else rows, batches)
    table.validate(full=True)
    expected = pa.Table.from_pylist(records, schema=schema)
    assert _same(table, expected), (table.to_pylist(), expected.to_pylist())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs(untaken=True), st.booleans())
@example(output=(pa.schema([("c0", pa.int64())]), [(1,), (True,), (2,)]), as_dicts=False)
@example(output=(pa.schema([("c0", pa.string())]), [("a",), ("\ud800",)]), as_dicts=False)
@example(output=(pa.schema([("c0", pa.timestamp("ns"))]), [(dt.datetime(2000, 1, 1),), (dt.datetime(9999, 1, 1),)]),
         as_dicts=True)
@example(output=(pa.schema([("c0", pa.float64())]), [(1.5,), (2**53 + 1,)]), as_dicts=False)
def test_values_the_buffers_do_not_take_convert_or_fail_as_the_python_path(output, as_dicts):
    schema, rows = output
    records = [dict(zip(schema.names, row)) for row in rows] if as_dicts else rows
    try:
        expected = output_table(records, schema)
    except Exception as e:   # noqa: BLE001 -- the error itself is compared
        expected = e
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)) as raised:
            _sink_table(schema, records, [])
        message = str(raised.value)
        assert str(expected) in message, (message, expected)
        # names the field: in the message, or (an error made of other arguments, as UnicodeEncodeError) in a note
        assert message.startswith("output field 'c") or any(
            note.startswith("output field 'c") for note in getattr(raised.value, "__notes__", [])), message
    else:
        table = _sink_table(schema, records, [])
        table.validate()   # (in full only where pyarrow's own is valid: it takes a date64 of a part of a day)
        assert _same(table, expected), (table.to_pylist(), expected.to_pylist())


def test_a_sink_recovers_its_typed_buffers_after_a_batch_that_fell_back():
    """A column whose batch met a numpy scalar goes back to its buffers for the next batch, and a failed batch
    leaves the sink empty and usable."""
    schema = pa.schema([("s", pa.string()), ("b", pa.bool_()), ("n", pa.int32())])
    sink = OutputSink(schema)
    sink.extend([("a", True, 1), ("b", np.bool_(False), np.int32(2)), (None, None, None)])
    assert sink.table().to_pylist() == [{"s": "a", "b": True, "n": 1}, {"s": "b", "b": False, "n": 2},
                                        {"s": None, "b": None, "n": None}]
    sink.extend([("é" * 3000, False, -(2**31))] * 500)
    table = sink.table()
    assert table.num_rows == 500 and table.column("s")[499].as_py() == "é" * 3000
    sink.extend([("x", True, 2**31)])
    with pytest.raises(pa.ArrowInvalid, match=r"output field 'n' \(of type int32\)"):
        sink.table()
    assert sink.table().num_rows == 0
    sink.append(("y", False, 3))
    assert sink.table().to_pylist() == [{"s": "y", "b": False, "n": 3}]
