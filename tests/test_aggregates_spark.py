"""A declarative aggregate as a ``KeyedJob`` on local Spark (the wiring: pickled to the tasks, run by the job's
subtask code on the executors, its state read back with ``spark.read.format("keygroups")``)."""

from __future__ import annotations

import pyarrow as pa
import pytest

import keygroups.spark as kspark
from keygroups.aggregates import aggregate, count, mean, sum_of
from keygroups.spark import KeyedJob

pytestmark = pytest.mark.spark

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


def test_a_keyed_job_runs_the_aggregate_and_the_state_source_reads_its_states(spark, tmp_path):
    kspark.register()
    totals = aggregate(count(), sum_of("v", name="total"), mean("v"), input_schema=SCHEMA, key_columns="k",
                       emit="per_key")
    job = KeyedJob("totals", "k", totals, output_schema=totals.output_schema, max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"))
    first = job.run_batch(spark.createDataFrame([(k, k) for k in range(10)] * 2, "k long, v long"), parallelism=2)
    assert sorted(map(tuple, first.output.collect())) == [(k, 2, 2 * k, float(k)) for k in range(10)]
    second = job.run_batch(spark.createDataFrame([(k, 1) for k in range(0, 10, 3)], "k long, v long"),
                           parallelism=3)
    assert sorted(map(tuple, second.output.collect())) == [(k, 3, 2 * k + 1, (2 * k + 1) / 3) for k in range(0, 10, 3)]
    state = spark.read.format("keygroups").option("state", "total").load(str(tmp_path / "chk"))
    assert sorted((r["k"] if "k" in state.columns else r["key"], r["value"]) for r in state.collect()) == [
        (k, 2 * k + (1 if k % 3 == 0 else 0)) for k in range(10)]
