"""A KeyedJob on a real local Spark session whose max parallelism changes between batches (32 -> 128 -> 64): each
batch restores the previous one's state re-keyed into the new key groups, and the results equal a reference."""

from __future__ import annotations

import pytest

from keygroups.spark import KeyedJob
from spark_functions import TOTALS, RunningTotal

pytestmark = pytest.mark.spark


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
