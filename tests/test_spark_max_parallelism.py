"""A KeyedJob on a real local Spark session whose max parallelism changes between batches (32 -> 128 -> 64): each
batch restores the previous one's state re-keyed into the new key groups, and the results equal a reference."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.state import ValueStateDescriptor

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])
TOTALS = pa.schema([("k", pa.int64()), ("total", pa.int64()), ("batch", pa.int64())])


class RunningTotal(KeyedProcessFunction):
    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total, context.checkpoint_id)]


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_max_parallelism_changes_between_batches(spark, tmp_path, backend):
    location = str(tmp_path / "chk")
    schedule = [(32, 3), (128, 5), (64, 2)]   # (max parallelism, parallelism) per batch
    reference: dict[int, int] = {}
    for batch, (max_parallelism, parallelism) in enumerate(schedule, start=1):
        rows = [(k, batch * 10 + k % 3) for k in range(0, 300, batch)]
        job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=max_parallelism,
                       checkpoint_location=location, backend=backend)
        result = job.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=parallelism)
        expected = []
        for k, v in rows:
            reference[k] = reference.get(k, 0) + v
            expected.append((k, reference[k], batch))
        assert sorted(tuple(r) for r in result.output.collect()) == sorted(expected)
        latest = job.latest_checkpoint()
        assert (latest.max_parallelism, latest.parallelism) == (max_parallelism, parallelism)
        restored = [r["restored"] for r in latest.properties["reports"]]
        if batch > 1:   # every subtask restored (re-keyed) state, none found it warm
            assert all(r["mode"] == "cold" and r["bytes_read"] > 0 for r in restored)
