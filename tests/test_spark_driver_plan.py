"""The keyed stage's driver-side plan (issue 32): the stage's plan is analysed once and put on each batch's input
(:class:`KeyedStagePlan`), and it runs in a clone of the user's session without adaptive execution where the input
is narrow (:func:`keyed_stage_session`), never changing the user's session."""

from __future__ import annotations

import json
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


def test_the_rerooted_stage_is_handed_to_spark_analysed_and_already_optimized(spark, tmp_path):
    """Each batch's stage is put right on the input (the aliases' attributes rewritten to the input's own) and
    marked analysed: Spark's analyser returns it as it is, and the optimizer, its constants folded once, changes
    nothing in it over a plain scan; the rows are still placed exactly."""
    path = str(tmp_path / "in.parquet")
    spark.range(0, 200, numPartitions=2).selectExpr("id * 37 AS key", "id AS v").write.parquet(path)

    def stage(frame):
        return partition_by_key_group(frame, "key", max_parallelism=128, parallelism=3)

    plan = KeyedStagePlan.of(spark.read.parquet(path), spark._jsparkSession, stage)
    assert plan is not None
    df = spark.read.parquet(path)   # the same schema, other column ids
    placed, _ = plan.on(df, spark._jsparkSession)
    execution = placed._jdf.queryExecution()
    identity = spark._jvm.System.identityHashCode
    assert identity(execution.analyzed()) == identity(execution.logical())   # not analysed again

    def chain(node, leaf):   # the node kinds from node down to leaf (by identity)
        kinds = []
        while identity(node) != identity(leaf):
            assert len(kinds) < 8 and node.children().size() == 1
            kinds.append(node.getClass().getSimpleName())
            node = node.children().apply(0)
        return kinds

    # right on the input's own plan, with the node kinds DataFrame methods give (no projection of aliases between)
    leaf = df._jdf.logicalPlan()
    assert chain(execution.analyzed(), leaf) == chain(stage(df)._jdf.logicalPlan(), leaf)
    assert execution.optimizedPlan().fastEquals(execution.analyzed())   # nothing left for the optimizer to do
    owner = KeyGroupPartitioner(128, 3, "long")
    rows = placed.select("key", "v", F.spark_partition_id().alias("p")).collect()
    assert sorted((r.key, r.v) for r in rows) == [(i * 37, i) for i in range(200)]
    assert all(r.p == owner(r.key) for r in rows)


def test_a_key_column_that_becomes_nullable_gets_a_plan_of_its_own_and_its_null_is_refused(spark, tmp_path):
    """The re-rooted nodes keep the nullability of the input they were planned over, so a plan is only put on an
    input of the same schema, nullability included: a batch whose key column turns nullable (and holds a null)
    gets a plan of its own, whose null-key check is not folded away, and is refused with the null-key error."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    job = KeyedJob("nulls", "key", Total(), output_schema="key long, total long", max_parallelism=32,
                   checkpoint_location=str(tmp_path / "chk"))
    job.run_batch(spark.range(0, 20).selectExpr("id AS key", "id AS v"), parallelism=2)   # key not nullable
    nullable = spark.createDataFrame([(1, 1), (None, 2)], "key long, v long")
    with pytest.raises((PySparkException, Py4JJavaError), match="null key"):
        job.run_batch(nullable, parallelism=2)
    # the plans are per input schema (a new schema drops the old ones): the one held now is the nullable input's
    (schema, *_), = [key for key, plan in job._plans.stages.items() if plan is not None]
    assert json.loads(schema)["fields"][0] == {"metadata": {}, "name": "key", "nullable": True, "type": "long"}
