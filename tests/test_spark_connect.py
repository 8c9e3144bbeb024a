"""Every public Spark entry point over Spark Connect, on a local Connect server the tests start themselves (fixture
``connect`` in conftest: served by the classic session's JVM; the client has no py4j gateway and no SparkContext).

Flink's golden key groups through ``with_key_groups``, exact placement by ``partition_by_key_group``, replays checked
by their input digest, a ``foreachBatch`` streaming query, and the refusals (the ``"jvm"`` engine, ``key_by`` on a
DataFrame) naming what to use instead. The tests that take ``any_spark`` run on the classic session too, the same
assertions on both. The classic suites run their key tests over both sessions as well (``any_spark`` there): the
job runner's entry points with rescales and savepoints (test_spark_job.py), the state data source and
``write_savepoint`` (test_spark_state_source.py), the partitioner's and ``with_key_groups``' DataFrame paths
(test_spark_keyby_*.py), and ``keygroups demo --connect`` (test_cli.py)."""

from __future__ import annotations

import sys

import pytest

pyspark = pytest.importorskip("pyspark")
from pyspark import cloudpickle  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from keygroups.checkpoint import CheckpointStorage  # noqa: E402
from keygroups.errors import ReplayMismatchError  # noqa: E402
from keygroups.spark import (  # noqa: E402
    KeyedJob,
    key_by,
    partition_by_key_group,
    read_checkpoint_files,
    with_key_groups,
)
from keygroups.spark.columns import choose_engine, resolve_key_columns  # noqa: E402
from spark_functions import TOTALS, RunningTotal  # noqa: E402
from test_spark_job import MAX_PARALLELISM, write_sink  # noqa: E402
from test_spark_keyby_columns import GOLDEN, _field_types, check_golden_key_groups  # noqa: E402
from test_spark_keyby_placement import _check_placement  # noqa: E402

pytestmark = pytest.mark.spark
# Spark's workers (and the Connect server's) cannot import this file: functions of it that they run go by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_the_connect_session_has_no_gateway(connect):
    """What the fallbacks are for: no py4j gateway, no SparkContext (so no RDDs)."""
    assert getattr(connect, "_jvm", None) is None
    with pytest.raises(Exception, match="(?i)sparkContext|not supported|not implemented"):
        connect.sparkContext  # noqa: B018


# ---- key-group columns ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", sorted(GOLDEN))
def test_golden_key_groups_over_connect(connect, type_name):
    """Flink's own key groups through every engine Connect can run ("auto" picks one), one Spark job per type."""
    fields = _field_types(type_name)
    check_golden_key_groups(connect, type_name, ["auto", "arrow"] + ([] if "bytes" in fields else ["sql"]))


def test_auto_picks_a_portable_engine_and_jvm_is_refused_naming_the_others(connect):
    df = connect.createDataFrame([(1, "a", b"x")], "l long, s string, b binary")
    _, keys, _ = resolve_key_columns(df, ["l", "s"])
    _, binary, _ = resolve_key_columns(df, ["b"])
    assert choose_engine(keys, "auto", jvm_available=False) == "sql"
    assert choose_engine(binary, "auto", jvm_available=False) == "arrow"
    with pytest.raises(ValueError, match=r"engine 'jvm' .*\(Spark Connect\); use engine='sql', 'arrow' or 'auto'"):
        with_key_groups(df, "l", max_parallelism=8, engine="jvm")
    with pytest.raises(ValueError, match=r"engine 'jvm' .*\(Spark Connect\)"):
        partition_by_key_group(df, "l", max_parallelism=8, parallelism=2, engine="jvm")


# ---- placement -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("parallelism", "method", "engine"),
                         [(7, "by_id", "auto"), (7, "hash", "auto"), (3, "by_id", "arrow"), (1, "by_id", "auto")])
def test_exact_placement_on_both_sessions(any_spark, parallelism, method, engine):
    users = any_spark.range(0, 2000).select(
        F.col("id"), F.concat(F.lit("user-"), (F.col("id") % 331).cast("string")).alias("user"))
    out = partition_by_key_group(users, "user", "id", max_parallelism=128, parallelism=parallelism, method=method,
                                 engine=engine, key_group_col="key_group")
    rows = _check_placement(out, lambda r: (r["user"], r["id"]), ("string", "long"), 128, parallelism)
    assert sorted(r["id"] for r in rows) == list(range(2000))


def test_key_by_refuses_a_dataframe_naming_partition_by_key_group(any_spark):
    with pytest.raises(TypeError, match=r"RDD partitioners cannot exist over Spark Connect .*partition_by_key_group\("):
        key_by(any_spark.range(3), lambda v: v, max_parallelism=8, parallelism=2)


# ---- the job runner ------------------------------------------------------------------------------------------------


def test_replays_idle_subtasks_and_the_storage_reader_on_both_sessions(any_spark, tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    rows = [(k, k % 3) for k in range(50)]
    first = job.run_batch(any_spark.createDataFrame(rows, "k long, v long"), parallelism=2, checkpoint_id=7)
    expected = sorted((k, k % 3, 7) for k in range(50))
    assert sorted(map(tuple, first.output.collect())) == expected
    # the digest (xxhash64 per record) is computed over Connect as on a classic session
    again = job.run_batch(any_spark.createDataFrame(list(reversed(rows)), "k long, v long").repartition(3),
                          parallelism=3, checkpoint_id=7)
    assert again.replayed and sorted(map(tuple, again.output.collect())) == expected
    with pytest.raises(ReplayMismatchError, match="checkpoint 7 is already complete"):
        job.run_batch(any_spark.createDataFrame(rows[1:], "k long, v long"), parallelism=2, checkpoint_id=7)
    # an empty batch: every subtask is idle and runs as its own task (no SparkContext to parallelize with)
    empty = job.run_batch(any_spark.createDataFrame([], "k long, v long"), parallelism=5)
    assert empty.output.count() == 0
    assert [r["subtask"] for r in job.latest_checkpoint().properties["reports"]] == list(range(5))
    nxt = job.run_batch(any_spark.createDataFrame([(1, 1), (2, 1)], "k long, v long"), parallelism=2)
    outputs = nxt.metadata.outputs
    by_storage = read_checkpoint_files(any_spark, job.storage, outputs, TOTALS, reader="storage")
    by_spark = read_checkpoint_files(any_spark, job.storage, outputs, TOTALS, reader="spark")
    expected = [(1, 2, 9), (2, 3, 9)]   # k=2 had 2 from checkpoint 7
    assert sorted(map(tuple, by_storage.collect())) == sorted(map(tuple, by_spark.collect())) == expected


def test_foreach_batch_streaming_query_on_both_sessions(any_spark, tmp_path):
    source = tmp_path / "in"
    for i, rows in enumerate([[(1, 1), (2, 2)], [(1, 10), (3, 3)]]):
        any_spark.createDataFrame(rows, "k long, v long").coalesce(1).write.parquet(str(source / f"part-{i}"))
    job = KeyedJob("stream-totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    sunk = str(tmp_path / "sunk")
    query = (any_spark.readStream.schema("k long, v long").option("maxFilesPerTrigger", 1)
             .parquet(str(source / "part-*"))
             .writeStream.foreachBatch(job.foreach_batch(write_sink(sunk), parallelism=3))
             .option("checkpointLocation", str(tmp_path / "spark-chk")).trigger(availableNow=True).start())
    query.awaitTermination(180)
    assert query.exception() is None
    got = sorted(tuple(r) for r in any_spark.read.parquet(sunk).collect())
    assert got == [(1, 1, 0, 0), (1, 11, 1, 1), (2, 2, 0, 0), (3, 3, 1, 1)]
    storage = CheckpointStorage(str(tmp_path / "chk"))
    assert storage.checkpoint_ids() == [0, 1]
    assert storage.latest().parallelism == 3
