"""The compiled per-record loop (keygroups._native.recordloop) against a plain-Python reference loop: the rows the
function sees, the context it sees, the state it leaves, the outputs and the errors are the same for random records
(nulls, nested types, timestamps) and for functions returning None, lists, tuples or generators."""

from __future__ import annotations

import datetime as dt
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keygroups._native.recordloop import OutputSink, RecordBatchView, Row, process_records
from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.functions import ProcessContext
from keygroups.runtime.subtask_input import output_table
from keygroups.state.timers import NO_WATERMARK

UTC = dt.timezone.utc

# (Arrow type, values of it): each column of a random table is one of these, nulls mixed in.
COLUMN_KINDS: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    (pa.int8(), st.integers(-128, 127)),
    (pa.uint8(), st.integers(0, 255)),
    (pa.uint16(), st.integers(0, 2**16 - 1)),
    (pa.uint32(), st.integers(0, 2**32 - 1)),
    (pa.uint64(), st.integers(0, 2**64 - 1)),
    (pa.float64(), st.floats(allow_nan=False)),
    (pa.float32(), st.floats(width=32, allow_nan=False)),
    (pa.bool_(), st.booleans()),
    (pa.string(), st.text(max_size=8)),
    (pa.large_string(), st.text(max_size=8)),
    (pa.binary(), st.binary(max_size=8)),
    (pa.large_binary(), st.binary(max_size=8)),
    (pa.timestamp("ms"), st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1))
     .map(lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000))),
    (pa.timestamp("us", "UTC"), st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1),
                                             timezones=st.just(UTC))),
    (pa.date32(), st.dates()),
    (pa.list_(pa.int64()), st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)), max_size=3)),
    (pa.struct([("a", pa.int32()), ("b", pa.string())]),
     st.fixed_dictionaries({"a": st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
                            "b": st.one_of(st.none(), st.text(max_size=4))})),
    (pa.map_(pa.string(), pa.float64()),
     st.lists(st.tuples(st.text(max_size=3), st.floats(allow_nan=False)), max_size=3, unique_by=lambda kv: kv[0])),
]


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    """A table with an int64 key column "k" (few keys, nulls never: keys are not null here) and random others."""
    n = draw(st.integers(0, 30))
    kinds = draw(st.lists(st.integers(0, len(COLUMN_KINDS) - 1), min_size=0, max_size=5))
    columns = {"k": pa.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), pa.int64())}
    for c, kind in enumerate(kinds):
        arrow_type, values = COLUMN_KINDS[kind]
        data = draw(st.lists(st.one_of(st.none(), values), min_size=n, max_size=n))
        columns[f"c{c}"] = pa.array(data, type=arrow_type)
    table = pa.table(columns)
    if n and draw(st.booleans()):   # an offset into its buffers, several chunks: combine_chunks is read correctly
        cut = draw(st.integers(0, n))
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    return table


def sorted_by_key(table: pa.Table) -> tuple[pa.Table, np.ndarray, list[Any]]:
    """The table sorted by "k" (stable), the runs of equal keys and the key of each run."""
    table = table.take(pa.array(np.argsort(np.asarray(table.column("k").to_numpy()), kind="stable")))
    keys_col = table.column("k").to_numpy()
    change = np.flatnonzero(keys_col[1:] != keys_col[:-1]) + 1 if len(keys_col) else np.zeros(0, np.int64)
    runs = np.concatenate([[0], change, [len(keys_col)]]).astype(np.int64) if len(keys_col) else np.zeros(1, np.int64)
    keys = [int(keys_col[r]) for r in runs[:-1]]
    return table, runs, keys


class Recorder(KeyedProcessFunction):
    """Records what it sees (the row as a dict, the context's key, key group and time) and keeps per-key state; emits
    what ``mode`` says: None, a list, a tuple, a generator of the row's values (tuple, list or dict form), or a
    wrong record."""

    def __init__(self, mode: str, form: str) -> None:
        self.mode, self.form = mode, form
        self.seen: list[tuple[dict[str, Any], Any, int, int | None]] = []
        self.state: dict[Any, list[Any]] = {}

    def _record(self, record: Any) -> Any:
        if self.form == "tuple":
            return tuple(record[n] for n in record)
        if self.form == "list":
            return [record[n] for n in record.keys()]
        return dict(record)

    def process_element(self, record, context):
        self.seen.append((dict(record), context.current_key, context.current_key_group,
                          context.timestamp if context.has_timestamp else None))
        self.state.setdefault(context.current_key, []).append(record.get("c0"))
        out = self._record(record)
        if self.mode == "none":
            return None
        if self.mode == "list":
            return [out, out]
        if self.mode == "tuple":
            return (out,)
        if self.mode == "empty":
            return []
        return (x for x in [out])


def reference_loop(function: Recorder, table: pa.Table, runs: np.ndarray, keys: list[Any], groups: np.ndarray,
                   stamps: np.ndarray | None, context: ProcessContext, schema: pa.Schema) -> pa.Table:
    """The loop as plain Python: rows as dicts of the columns' to_pylist, outputs through ``output_table``."""
    names = table.column_names
    columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
    rows = [dict(zip(names, values)) for values in zip(*columns)]
    outputs: list[Any] = []
    for i, key in enumerate(keys):
        context.current_key, context.current_key_group = key, int(groups[runs[i]])
        for j in range(int(runs[i]), int(runs[i + 1])):
            if stamps is not None:
                context._timestamp = None if stamps[j] == NO_WATERMARK else int(stamps[j])
            result = function.process_element(rows[j], context)
            if result is not None:
                outputs.extend(result)
    return output_table(outputs, schema)


def run_both(table: pa.Table, mode: str, form: str, stamped: bool, schema: pa.Schema | None = None):
    table, runs, keys = sorted_by_key(table)
    schema = schema if schema is not None else table.schema
    groups = (np.asarray(table.column("k").to_numpy(), dtype=np.int64) * 7 % 128).astype(np.int32)
    stamps = None
    if stamped:
        stamps = np.arange(table.num_rows, dtype=np.int64) * 1000
        stamps[::3] = NO_WATERMARK
    results = []
    for compiled in (True, False):
        function = Recorder(mode, form)
        context = ProcessContext(checkpoint_id=1, subtask_index=0)
        current: list[Any] = []
        try:
            if compiled:
                sink = OutputSink(schema)
                process_records(function.process_element, current.append, context, table, runs, keys, groups,
                                stamps if stamps is not None else np.zeros(0, np.int64), NO_WATERMARK, sink)
                out = sink.table()
            else:
                out = reference_loop(function, table, runs, keys, groups, stamps, context, schema)
                current = list(keys)
        except Exception as e:   # noqa: BLE001 - the errors themselves are compared
            out = e
        results.append((out, function.seen, function.state, current))
    return results


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.sampled_from(["none", "list", "tuple", "empty", "generator"]),
       st.sampled_from(["tuple", "list", "dict"]), st.booleans())
def test_the_compiled_loop_matches_the_python_loop(table, mode, form, stamped):
    (out, seen, state, current), (ref_out, ref_seen, ref_state, ref_current) = run_both(table, mode, form, stamped)
    assert not isinstance(ref_out, Exception), ref_out
    assert not isinstance(out, Exception), out
    assert out.schema == ref_out.schema
    assert out.equals(ref_out)
    assert out.to_pylist() == ref_out.to_pylist()
    assert seen == ref_seen
    assert state == ref_state
    assert current == ref_current   # every key made current once, in order


WRONG_RECORDS = st.sampled_from([
    {"k": 1}, {"k": 1, "x": 2}, (1, 2), [1, 2, 3], 7, "text", None, {"k": "not a number"}, ("not a number",),
    (2**70,), (True,), (np.int64(3),), {"k": 1.5}, pa.table({"j": [1]}), pa.table({"k": [1, 2], "z": [3, 4]}),
])


class Emits(KeyedProcessFunction):
    def __init__(self, records: list[Any]) -> None:
        self.records = records

    def process_element(self, record, context):
        return list(self.records)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(WRONG_RECORDS, st.sampled_from([(5,), {"k": None}, [6]])), min_size=1, max_size=4))
@example(records=[{"k": "not a number"}, (5,), {"k": 1, "x": 2}])   # a value error before a shape error (CI)
@example(records=[7, {"k": 1, "x": 2}])
def test_output_errors_are_the_python_loops(records):
    """Whatever a function emits, the compiled sink gives the reference's table, or its error (the same type, its
    message, a value's error naming the field)."""
    schema = pa.schema([("k", pa.int64())])
    table = pa.table({"k": pa.array([1], pa.int64())})
    outcome = []
    for compiled in (True, False):
        function = Emits(records)
        context = ProcessContext(checkpoint_id=1, subtask_index=0)
        try:
            if compiled:
                sink = OutputSink(schema)
                process_records(function.process_element, lambda key: None, context, table,
                                np.array([0, 1], np.int64), [1], np.array([3], np.int32), np.zeros(0, np.int64),
                                NO_WATERMARK, sink)
                outcome.append(sink.table())
            else:
                outcome.append(output_table(function.process_element({"k": 1}, context), schema))
        except Exception as e:   # noqa: BLE001
            outcome.append(e)
    compiled, reference = outcome
    # The compiled sink checks each record's shape as it is emitted and converts values column by column at the
    # end, or when an Arrow table is emitted (before it); the Python loop converted each run of dicts or tuples when
    # the next run began. So when a batch holds a record of the wrong shape, the compiled sink names the first such
    # record (its own error, word for word) even where the Python loop stopped earlier at a value it could not
    # convert, unless that record is a table: then the values emitted before it come first.
    for i, record in enumerate(records):
        try:
            output_table([record], schema)
        except (ValueError, TypeError) as e:
            if not isinstance(e, pa.ArrowException):   # a record's shape, not a value Arrow cannot convert
                reference = e
                if isinstance(record, pa.Table):
                    try:
                        output_table(records[:i], schema)
                    except Exception as before:   # noqa: BLE001 -- a value emitted before the table
                        reference = before
                break
        except Exception:   # noqa: BLE001 -- a value error: checked at the end
            pass
    if isinstance(reference, Exception):
        assert type(compiled) is type(reference), (compiled, reference)
        assert str(reference) in str(compiled)
        if str(compiled) != str(reference):
            assert "output field 'k' (of type int64)" in str(compiled)
    else:
        assert not isinstance(compiled, Exception), compiled
        assert compiled.equals(reference)


def test_a_value_the_schema_cannot_take_names_the_field():
    sink = OutputSink(pa.schema([("user", pa.string()), ("n", pa.int64())]))
    sink.extend([("a", 1), ("b", "two")])
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError), match=r"output field 'n' \(of type int64\)"):
        sink.table()


# ---- rows are mappings, and attributes ----------------------------------------------------------------------------

ROW_TABLE = pa.table({"user": ["ann", None], "amount": [12.5, None], "n": pa.array([3, None], pa.int32()),
                      "when": pa.array([dt.datetime(2026, 1, 2), None], pa.timestamp("ms")),
                      "tags": pa.array([["a", "b"], None], pa.list_(pa.string()))})


def test_a_row_is_a_read_only_mapping_of_its_record():
    view = RecordBatchView(ROW_TABLE)
    row, expected = view.row(0), ROW_TABLE.to_pylist()[0]
    assert isinstance(row, Mapping) and not isinstance(row, dict)
    assert row["amount"] == 12.5 and row.amount == 12.5 and row.user == "ann" and row.tags == ["a", "b"]
    assert row.when == dt.datetime(2026, 1, 2)
    assert dict(row) == expected and row == expected and expected == row and not (row != expected)
    assert row != {**expected, "n": 4} and row != [1]
    assert list(row) == list(expected) and list(row.keys()) == list(expected.keys()) and len(row) == 5
    assert list(row.items()) == list(expected.items()) and list(row.values()) == list(expected.values())
    assert row.items() == expected.items() and row.keys() == expected.keys()
    assert "user" in row and "nope" not in row and 3 not in row
    assert row.get("nope") is None and row.get("nope", 1) == 1 and row.get("n") == 3
    assert row.copy() == expected and type(row.copy()) is dict
    assert repr(row) == repr(expected)
    assert pickle.loads(pickle.dumps(row)) == expected
    assert view.row(1) == ROW_TABLE.to_pylist()[1]
    with pytest.raises(KeyError, match="nope"):
        row["nope"]
    with pytest.raises(AttributeError, match=r"no field 'nope'; its fields are \['user', 'amount', 'n', 'when'"):
        row.nope
    with pytest.raises(TypeError):
        row["user"] = "bob"   # read-only: dict(row) is the copy to change
    with pytest.raises(TypeError):
        hash(row)
    with pytest.raises(IndexError):
        view.row(2)


class Keeps(KeyedProcessFunction):
    """Keeps every other row it is given: a kept row must keep showing its own record."""

    def __init__(self) -> None:
        self.kept: list[Any] = []

    def process_element(self, record, context):
        if record["i"] % 2 == 0:
            self.kept.append(record)


def test_a_row_the_function_keeps_stays_its_record():
    table = pa.table({"k": pa.array([1] * 6 + [2] * 4, pa.int64()), "i": list(range(10))})
    function = Keeps()
    process_records(function.process_element, lambda key: None, ProcessContext(checkpoint_id=1, subtask_index=0),
                    table, np.array([0, 6, 10], np.int64), [1, 2], np.zeros(10, np.int32), np.zeros(0, np.int64),
                    NO_WATERMARK, OutputSink(pa.schema([("i", pa.int64())])))
    del table
    assert [dict(r) for r in function.kept] == [{"k": 1 if i < 6 else 2, "i": i} for i in range(0, 10, 2)]
    assert all(isinstance(r, Row) for r in function.kept)


def test_runs_that_do_not_fit_the_table_are_refused():
    table = pa.table({"k": pa.array([1, 1], pa.int64())})
    with pytest.raises(ValueError, match="do not fit the table"):
        process_records(lambda r, c: None, lambda k: None, ProcessContext(checkpoint_id=1, subtask_index=0), table,
                        np.array([0, 3], np.int64), [1], np.zeros(3, np.int32), np.zeros(0, np.int64),
                        NO_WATERMARK, OutputSink(pa.schema([("k", pa.int64())])))
