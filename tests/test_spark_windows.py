"""Event-time windows as a keyed job on Spark, rescaled between batches, against Spark's own windowed aggregation
(``groupBy(window(...))``, ``groupBy(session_window(...))``) over the same events: once a final batch has moved the
watermark past every window (and no event was late, so both define the same answer), every window's count and sum
agree."""

from __future__ import annotations

import datetime
import random

import pyarrow as pa
import pytest
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from keygroups.runtime import WatermarkStrategy
from keygroups.spark import KeyedJob
from keygroups.windows import Count, EventTimeSessionWindows, Sum, TumblingEventTimeWindows, WindowAssigner, window

pytestmark = pytest.mark.spark
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
EPOCH_MS = int(EPOCH.timestamp() * 1000)
SENTINEL = -1   # the key of the event that only moves the watermark past every window
SCHEMA = pa.schema([("k", pa.int64()), ("t", pa.timestamp("us", "UTC")), ("v", pa.int64())])
ROW_DDL = "k long, t timestamp, v long"
PARALLELISM = [2, 4, 1, 3, 2]   # one per batch, the last for the watermark-only batch


def random_batches(seed: int, *, batches: int, batch_ms: int, rows: int, keys: int) -> list[list[tuple]]:
    """``batches`` batches of ``batch_ms`` of events each, at most 3 s out of order: none is late with a 5 s delay
    (a batch's earliest event is within 3 s of the previous batch's end, the watermark 5 s behind its latest)."""
    rng = random.Random(seed)
    return [[(rng.randrange(keys), EPOCH + datetime.timedelta(milliseconds=b * batch_ms + rng.randrange(batch_ms)
                                                               - rng.randrange(3_000)), rng.randrange(-5, 50))
             for _ in range(rows)] for b in range(batches)]


def keygroups_windows(spark, checkpoint: str, assigner: WindowAssigner, batches: list[list[tuple]]) -> list[tuple]:
    """(k, window start ms, window end ms, count, sum) of every window the keyed job emits over ``batches`` and a
    final batch whose one event (key SENTINEL) moves the watermark past them all; parallelism changes each batch."""
    job_def = window(assigner, input_schema=SCHEMA, key_columns="k", timestamp_column="t").aggregate(Count(), Sum("v"))
    job = KeyedJob("windows", "k", job_def.function, output_schema=job_def.output_schema, max_parallelism=16,
                   checkpoint_location=checkpoint, timestamp_column="t",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=5)))
    out = []
    final = [(SENTINEL, EPOCH + datetime.timedelta(days=1), 0)]
    for rows, parallelism in zip([*batches, final], PARALLELISM, strict=True):
        result = job.run_batch(spark.createDataFrame(rows, ROW_DDL), parallelism=parallelism)
        assert result.records_late == 0
        out += [tuple(r) for r in result.output.collect()]
    return sorted(out)


def spark_windows(spark, batches: list[list[tuple]], group: Column, window_column: str) -> list[tuple]:
    """The same windows from Spark's windowed aggregation of all the events (none late, so the watermark drops none)."""
    events: DataFrame = spark.createDataFrame([r for rows in batches for r in rows], ROW_DDL)
    theirs = (events.withWatermark("t", "5 seconds").groupBy(group, "k")
              .agg(F.count("*").alias("n"), F.sum("v").alias("s"))
              .select("k", F.unix_millis(F.col(f"{window_column}.start")).alias("start"),
                      F.unix_millis(F.col(f"{window_column}.end")).alias("end"), "n", "s"))
    return sorted(tuple(r) for r in theirs.collect())


def test_tumbling_window_counts_and_sums_equal_sparks_windowed_aggregation(spark, tmp_path):
    batches = random_batches(7, batches=4, batch_ms=20_000, rows=300, keys=12)
    ours = keygroups_windows(spark, str(tmp_path / "chk"), TumblingEventTimeWindows.of(datetime.timedelta(seconds=10)),
                             batches)
    expected = spark_windows(spark, batches, F.window("t", "10 seconds"), "window")
    assert len(expected) > 40
    assert ours == expected


def test_session_window_counts_and_sums_equal_sparks_session_window(spark, tmp_path):
    # ~5 events per key per 30 s batch and a 5 s gap: about half the gaps between a key's events close a session,
    # and sessions run across batch boundaries (merged with stored sessions, after a rescale).
    batches = random_batches(11, batches=4, batch_ms=30_000, rows=50, keys=10)
    ours = keygroups_windows(spark, str(tmp_path / "chk"), EventTimeSessionWindows.with_gap(
        datetime.timedelta(seconds=5)), batches)
    expected = spark_windows(spark, batches, F.session_window("t", "5 seconds"), "session_window")
    assert len(expected) > 50
    assert sum(n for _, _, _, n, _ in expected) == 200
    assert any(n > 1 for _, _, _, n, _ in expected)   # sessions merged records
    batches_in = [{b for b, rows in enumerate(batches) for k, t, _ in rows
                   if k == key and start <= (t - EPOCH) // datetime.timedelta(milliseconds=1) + EPOCH_MS < end}
                  for key, start, end, _, _ in expected]
    assert any(len(b) > 1 for b in batches_in)   # sessions merged across batches (and rescales)
    assert ours == expected
