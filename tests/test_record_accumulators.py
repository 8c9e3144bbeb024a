"""Records as accumulators: an AggregatingState whose accumulator is a dataclass record survives snapshot and
restore on both backends; a window aggregation keeps a dataclass accumulator across batches at changing
parallelism, and the state reader shows window accumulators with named fields (Mean's sum and count)."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
from test_windows import MAXP, SCHEMA, aggregate_job, make_backend, run_batch

import keygroups as kg
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime.state_reader import KeyedStateReader, load_restore_point
from keygroups.serializers import RecordSerializer, SerializerSnapshot, TupleSerializer
from keygroups.serializers import Float64Serializer, Int64Serializer, resolve_compatibility
from keygroups.state import AggregateFunction, AggregatingStateDescriptor
from keygroups.windows import PythonAggregate, TumblingEventTimeWindows, window
from keygroups.windows.aggregates import MEAN_ACCUMULATOR


@dataclasses.dataclass
class Spread:
    count: int = 0
    low: int | None = None
    high: int | None = None


class SpreadOf(AggregateFunction):
    """Count, min and max of ``v`` (or of the values themselves), in a dataclass accumulator mutated in place."""

    def create_accumulator(self) -> Spread:
        return Spread()

    def add(self, value, acc: Spread) -> Spread:
        v = value["v"] if isinstance(value, dict) else value
        acc.count += 1
        acc.low = v if acc.low is None else min(acc.low, v)
        acc.high = v if acc.high is None else max(acc.high, v)
        return acc

    def get_result(self, acc: Spread) -> tuple:
        return (acc.count, acc.low, acc.high)

    def merge(self, a: Spread, b: Spread) -> Spread:
        lows = [x for x in (a.low, b.low) if x is not None]
        highs = [x for x in (a.high, b.high) if x is not None]
        return Spread(a.count + b.count, min(lows, default=None), max(highs, default=None))


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_aggregating_state_with_a_record_accumulator(kind, tmp_path):
    storage = CheckpointStorage(tmp_path / "chk")
    descriptor = AggregatingStateDescriptor("spread", SpreadOf(), RecordSerializer(Spread))
    be = make_backend(kind, tmp_path / "a")
    state = be.get_state(descriptor)
    for k in range(10):
        be.set_current_key(k)
        for v in range(k + 1):
            state.add(v * 10)
    handle = be.snapshot(1, storage).result(30)
    be.dispose()
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="acc", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    again = make_backend(kind, tmp_path / "b")
    again.restore(storage, storage.load(1))
    state = again.get_state(descriptor)
    for k in range(10):
        again.set_current_key(k)
        assert state.get() == (k + 1, 0, k * 10)
    again.dispose()


def test_window_aggregate_keeps_a_dataclass_accumulator_across_batches(tmp_path):
    location = str(tmp_path / "chk")
    stream = window(TumblingEventTimeWindows.of(10), input_schema=SCHEMA, key_columns="k", timestamp_column="t")
    job = stream.aggregate(PythonAggregate(SpreadOf(), RecordSerializer(Spread),
                                           [pa.field("n", pa.int64()), pa.field("low", pa.int64()),
                                            pa.field("high", pa.int64())]))
    first = pa.table({"k": [1, 1, 2], "t": [1, 2, 3], "v": [5, 9, 4]}, schema=SCHEMA)
    assert run_batch(location, job, first, parallelism=1, backend="heap", watermark=0)[0] == []
    storage = CheckpointStorage(location)
    reader = KeyedStateReader(storage, load_restore_point(storage), "window-contents", flatten=True)
    value = reader.schema.field("value").type.field("_1").type
    assert [value.field(i).name for i in range(value.num_fields)] == ["count", "low", "high"]
    second = pa.table({"k": [1, 2], "t": [4, 5], "v": [1, 7]}, schema=SCHEMA)
    out, _ = run_batch(location, job, second, parallelism=3, backend="rocksdb", watermark=100)
    assert sorted(out) == [(1, 0, 10, 3, 1, 9), (2, 0, 10, 2, 4, 7)]


def test_mean_accumulators_are_named_and_old_tuple_ones_migrate(tmp_path):
    location = str(tmp_path / "chk")
    t = pa.table({"k": [1, 1], "t": [1, 2], "v": [4, 6]}, schema=SCHEMA)
    run_batch(location, aggregate_job(TumblingEventTimeWindows.of(10), 0), t, parallelism=2, backend="heap",
              watermark=0)
    storage = CheckpointStorage(location)
    reader = KeyedStateReader(storage, load_restore_point(storage), "window-contents", flatten=True)
    rows = pa.Table.from_batches(list(reader.read(kg.KeyGroupRange(0, MAXP - 1))), schema=reader.schema).to_pylist()
    assert [r["value"]["_5"] for r in rows] == [{"sum": 10.0, "count": 2}]
    old = TupleSerializer(Float64Serializer(), Int64Serializer())   # Mean's accumulator before records
    outcome, reader_ser = resolve_compatibility("window-contents", old.snapshot(), MEAN_ACCUMULATOR)
    assert reader_ser.deserialize(old.serialize((10.0, 2))) == (10.0, 2)
    assert isinstance(MEAN_ACCUMULATOR.snapshot(), SerializerSnapshot)
