"""Tumbling event-time windows as a keyed job on Spark, rescaled between batches, against Spark's own
``groupBy(window(...))`` over the same events: once a final batch has moved the watermark past every window (and no
event was late, so both define the same answer), every window's count and sum agree."""

from __future__ import annotations

import datetime
import random

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from keygroups.runtime import WatermarkStrategy
from keygroups.spark import KeyedJob
from keygroups.windows import Count, Sum, TumblingEventTimeWindows, window

pytestmark = pytest.mark.spark
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
SENTINEL = -1   # the key of the event that only moves the watermark past every window


def test_tumbling_window_counts_and_sums_equal_sparks_windowed_aggregation(spark, tmp_path):
    rng = random.Random(7)
    batches = []
    for b in range(4):   # each batch 20 s of events, at most 3 s out of order: none is late with a 5 s delay
        batches.append([(rng.randrange(12), EPOCH + datetime.timedelta(milliseconds=b * 20_000 + rng.randrange(20_000)
                                                                        - rng.randrange(3_000)), rng.randrange(-5, 50))
                        for _ in range(300)])
    schema = pa.schema([("k", pa.int64()), ("t", pa.timestamp("us", "UTC")), ("v", pa.int64())])
    job_def = window(TumblingEventTimeWindows.of(datetime.timedelta(seconds=10)), input_schema=schema,
                     key_columns="k", timestamp_column="t").aggregate(Count(), Sum("v"))
    job = KeyedJob("windows", "k", job_def.function, output_schema=job_def.output_schema, max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"), timestamp_column="t",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=5)))
    ours = []
    final = [(SENTINEL, EPOCH + datetime.timedelta(days=1), 0)]
    for rows, parallelism in zip([*batches, final], [2, 4, 1, 3, 2]):
        result = job.run_batch(spark.createDataFrame(rows, "k long, t timestamp, v long"), parallelism=parallelism)
        assert result.records_late == 0
        ours += [tuple(r) for r in result.output.collect()]
    events = spark.createDataFrame([r for rows in batches for r in rows], "k long, t timestamp, v long")
    theirs = (events.withWatermark("t", "5 seconds").groupBy(F.window("t", "10 seconds"), "k")
              .agg(F.count("*").alias("n"), F.sum("v").alias("s"))
              .select("k", (F.unix_millis(F.col("window.start"))).alias("start"),
                      (F.unix_millis(F.col("window.end"))).alias("end"), "n", "s"))
    expected = sorted(tuple(r) for r in theirs.collect())
    assert len(expected) > 40
    assert sorted(ours) == expected
