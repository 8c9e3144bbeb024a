"""The keyed stage's driver-side plan (issue 32): the stage's plan is analysed once and put on each batch's input
(:class:`KeyedStagePlan`), and it runs in a clone of the user's session without adaptive execution where the input
is narrow (:func:`keyed_stage_session`), never changing the user's session."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

from keygroups.runtime import RecordsPerSubtask
from keygroups.spark import KeyedJob
from keygroups.spark.executor import _REPORT_ARROW, _REPORT_SCHEMA, KeyedStagePlan, SparkPlanCache, keyed_stage_session
from keygroups.spark.partitioner import KeyGroupPartitioner, partition_by_key_group
from spark_functions import Total

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark

AQE = "spark.sql.adaptive.enabled"


@pytest.mark.parametrize("method", ["by_id", "hash"])   # "hash": Spark 4.0's path (no repartitionById)
def test_a_stage_plan_made_over_one_input_places_another_inputs_rows_exactly(spark, method):
    def stage(frame):
        return partition_by_key_group(frame, "key", max_parallelism=128, parallelism=3, method=method)

    first = spark.createDataFrame([(i, i) for i in range(10)], "key long, v long")
    plan = KeyedStagePlan.of(first, spark._jsparkSession, stage)
    assert plan is not None
    # another plan with other column ids (and a filter): the plan made over `first` is put on it
    second = spark.range(0, 600, numPartitions=2).selectExpr("id * 7919 - 300 AS key", "id AS v").where("v % 5 <> 0")
    placed, mapped = plan.on(second, spark._jsparkSession)
    assert not mapped and placed.columns == ["key", "v"] and placed.rdd.getNumPartitions() == 3
    rows = placed.select("key", "v", F.spark_partition_id().alias("p")).collect()
    owner = KeyGroupPartitioner(128, 3, "long")
    assert sorted((r.key, r.v) for r in rows) == sorted((i * 7919 - 300, i) for i in range(600) if i % 5)
    assert all(r.p == owner(r.key) for r in rows)


def _counting_task(tag: str):
    def task(batches):
        from pyspark import TaskContext

        keys = [k for b in batches for k in b.column(0).to_pylist()]
        yield pa.RecordBatch.from_pylist([{"subtask": TaskContext.get().partitionId(),
                                           "report": f"{tag}:{','.join(map(str, sorted(keys)))}"}],
                                         schema=_REPORT_ARROW)
    return task


def test_each_batch_runs_its_own_function_in_the_copied_map_in_arrow(spark):
    """The plan's mapInArrow is copied around each batch's function: the second input's tasks run the second
    function (its tag), over exactly their subtask's keys."""
    def stage(frame):
        return partition_by_key_group(frame, "key", max_parallelism=64, parallelism=2)

    first = spark.createDataFrame([(i,) for i in range(10)], "key long")
    plan = KeyedStagePlan.of(first, spark._jsparkSession, stage, _counting_task("first"), _REPORT_SCHEMA)
    assert plan is not None
    second = spark.range(0, 50, numPartitions=3).selectExpr("id * 31 AS key")
    keyed, mapped = plan.on(second, spark._jsparkSession, _counting_task("second"))
    assert mapped
    owner = KeyGroupPartitioner(64, 2, "long")
    expected = {p: sorted(k * 31 for k in range(50) if owner(k * 31) == p) for p in range(2)}
    got = {r["subtask"]: r["report"] for r in keyed.collect()}
    assert got == {p: "second:" + ",".join(map(str, keys)) for p, keys in expected.items()}


def test_the_stage_runs_in_a_clone_without_adaptive_execution_and_the_users_session_is_untouched(spark):
    assert spark.conf.get(AQE) == "true"
    cache = SparkPlanCache()
    df = spark.range(0, 10).selectExpr("id AS key").where("key > 2")
    stage = keyed_stage_session(df, cache)
    assert stage is not None and stage.sessionState().conf().getConfString(AQE) == "false"
    assert spark.conf.get(AQE) == "true"   # the user's session is not the clone, and keeps its setting
    assert keyed_stage_session(df, cache) is stage   # the same settings: the same clone
    # the user's settings change: a new clone that carries them (here the session time zone)
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        changed = keyed_stage_session(df, cache)
        assert changed is not None and changed is not stage
        assert changed.sessionState().conf().sessionLocalTimeZone() == "America/New_York"
        assert changed.sessionState().conf().getConfString(AQE) == "false"
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    # an input with an aggregate or a join keeps adaptive execution: its own session
    assert keyed_stage_session(df.groupBy("key").count(), cache) is None
    assert keyed_stage_session(df.join(spark.range(0, 5).selectExpr("id AS key"), "key"), cache) is None
    # a user who switched adaptive execution off needs no clone
    spark.conf.set(AQE, "false")
    try:
        assert keyed_stage_session(df, cache) is None
    finally:
        spark.conf.set(AQE, "true")


def test_a_job_over_inputs_of_every_kind_places_and_counts_exactly(spark, tmp_path):
    """Batches over a scan, a filtered projection (the planned stage, in the clone) and an aggregate (the user's
    session, adaptive execution on): the subtasks refuse any record outside their key groups, and the totals are
    a plain model's."""
    job = KeyedJob("plan", "key", Total(), output_schema="key long, total long", max_parallelism=64,
                   checkpoint_location=str(tmp_path / "chk"))
    path = str(tmp_path / "in.parquet")
    spark.createDataFrame([(k, 1) for k in range(40)], "key long, v long").write.parquet(path)
    inputs = [
        spark.read.parquet(path),
        spark.range(0, 120, numPartitions=3).selectExpr("id % 40 AS key", "id AS v").where("v % 3 = 0"),
        spark.range(0, 80).selectExpr("id % 40 AS key", "id AS v").groupBy("key").agg(F.sum("v").alias("v")),
        spark.read.parquet(path),
    ]
    model: dict[int, int] = {}
    for i, df in enumerate(inputs):
        rows = [(r["key"], r["v"]) for r in df.collect()]
        result = job.run_batch(df, parallelism=3 if i % 2 else 2)
        for key, v in rows:
            model[key] = model.get(key, 0) + v
        assert result.records_in == len(rows)
        latest: dict[int, int] = {}   # a key's totals only grow (every v >= 0): its latest is its largest
        for r in result.output.collect():
            latest[r["key"]] = max(latest.get(r["key"], 0), r["total"])
        assert latest == {key: model[key] for key, _ in rows}
    assert spark.conf.get(AQE) == "true"
    assert [plan for plan in job._plans.stages.values() if plan is not None]   # the batches took the planned stage


def test_a_persisted_narrow_input_is_read_once_by_the_stage_in_the_clone(spark, tmp_path):
    """A policy batch persists its input to count it; the keyed stage, in the clone session, reads the persisted
    rows (the cache is shared by the sessions), not the input again: the input's Python filter runs once per row."""
    calls = spark.sparkContext.accumulator(0)

    @F.udf("boolean")
    def keep(v):
        calls.add(1)
        return True

    df = spark.range(0, 300, numPartitions=3).selectExpr("id % 50 AS key", "id AS v").where(keep("v"))
    assert keyed_stage_session(df, SparkPlanCache()) is not None   # narrow: the stage runs in the clone
    job = KeyedJob("once", "key", Total(), output_schema="key long, total long", max_parallelism=32,
                   checkpoint_location=str(tmp_path / "chk"))
    result = job.run_batch(df, parallelism=RecordsPerSubtask(100))
    assert result.records_in == 300 and result.parallelism == 3
    assert calls.value == 300
