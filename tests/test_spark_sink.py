"""In-task sinks on Spark (the wiring; the logic is in tests/test_sink.py on the Spark-free spine): KeyedJob's tasks
stage the output through the sink, the driver publishes it after the checkpoint, across a rescale; Spark's own
reader of the directory sees exactly the committed rows, and ``BatchResult.output`` says where the output went."""

from __future__ import annotations

import pytest

from keygroups.errors import KeyGroupsError
from keygroups.sinks import CountingSink, ParquetSink
from keygroups.spark import KeyedJob
from spark_functions import KEY_TOTALS as OUT, Total

pytestmark = pytest.mark.spark


def test_keyed_job_writes_through_the_parquet_sink_exactly_once(spark, tmp_path):
    out = str(tmp_path / "out")
    job = KeyedJob("sink", "k", Total(), output_schema=OUT, max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"), sink=ParquetSink(out))
    expected: dict[tuple[int, int], int] = {}
    totals: dict[int, int] = {}
    for p, keys, v in ((2, range(40), 1), (3, range(20, 60), 2)):   # a rescale between the batches
        result = job.run_batch(spark.createDataFrame([(k, v) for k in keys], "k long, v long"), parallelism=p)
        for k in keys:
            totals[k] = totals.get(k, 0) + v
            expected[(k, totals[k])] = expected.get((k, totals[k]), 0) + 1
        assert result.metadata.outputs == [] and result.report.records_out == len(keys)
        seen: dict[tuple[int, int], int] = {}
        for row in spark.read.parquet(out).collect():   # Spark's reader skips _staging/
            seen[(row.k, row.total)] = seen.get((row.k, row.total), 0) + 1
        assert seen == expected
        attempts = {r.sink_committable.attempt for r in result.reports if r.sink_committable is not None}
        assert attempts == {0}
    with pytest.raises(KeyGroupsError, match="went to the job's sink only"):
        result.output  # noqa: B018
    with pytest.raises(ValueError, match="checkpoint_output=True"):
        job.foreach_batch(lambda df, batch_id: None, parallelism=2)


def test_a_counting_sink_beside_the_checkpoint_output(spark, tmp_path):
    sink = CountingSink()
    job = KeyedJob("count", "k", Total(), output_schema=OUT, max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"), sink=sink, checkpoint_output=True)
    result = job.run_batch(spark.createDataFrame([(k % 37, 1) for k in range(500)], "k long, v long"),
                           parallelism=2)
    assert sink.committed == {1: 500} == {1: result.output.count()}
    with pytest.raises(TypeError, match="sink must be a keygroups.sinks.Sink"):
        KeyedJob("bad", "k", Total(), output_schema=OUT, max_parallelism=16,
                 checkpoint_location=str(tmp_path / "bad"), sink=lambda df, batch_id: None)
