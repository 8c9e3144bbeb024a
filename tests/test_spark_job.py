"""The stateful job runner on a real local Spark session: rescaling between batches, Spark task retries, a driver
that dies before committing, idempotent replays, and the Structured Streaming foreachBatch adapter.

The tests that take ``any_spark`` run over Spark Connect too (each entry point with a rescale: ``run_batch``,
``run_source_batch``, ``foreach_batch`` by policy, a savepoint restart, and timestamps, which Connect converts
itself); the rest drive the same code from the same driver on both session types (test_spark_connect.py runs
replays, idle subtasks and both file readers over Connect)."""

from __future__ import annotations

import os
import sys

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.errors import CheckpointNotFoundError, DriverFencedError, ReplayMismatchError
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.scaling import RecordsPerSubtask
from keygroups.serializers import Int64Serializer
from keygroups.sources import write_partitioned_log
from keygroups.spark import KeyedJob
from keygroups.state import ValueStateDescriptor
from shop_runtime import final_states
from spark_functions import TOTALS, RunningTotal

pytestmark = pytest.mark.spark
# The functions below live in this test file, which Spark's Python workers cannot import: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
MAX_PARALLELISM = 32


class DiesOnFirstAttempt(shop.CartFunction):
    """Kills the Python worker running subtask 0 half-way through its first run (as a lost executor would): the
    task's own worker, or the one holding the subtask's state warm when the task forwarded it there (the served run
    has no TaskContext of its own, so the first run is told by a marker file, not by Spark's attempt number)."""

    def __init__(self, marker):
        self.marker = marker

    def open(self, context):
        super().open(context)
        self.seen, self.subtask = 0, context.subtask_index

    def process_element(self, event, context):
        self.seen += 1
        if self.subtask == 0 and self.seen == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(17)
        return super().process_element(event, context)


def totals(job, batches, spark, parallelisms, **kwargs):
    out = []
    for rows, p in zip(batches, parallelisms):
        df = spark.createDataFrame(rows, "k long, v long")
        out.append(sorted(tuple(r) for r in job.run_batch(df, parallelism=p, **kwargs).output.collect()))
    return out


def test_running_totals_across_rescales(any_spark, tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    batches = [[(k, 1) for k in range(20)], [(k, 10) for k in range(0, 20, 2)], [(k, 100) for k in range(20)]]
    out = totals(job, batches, any_spark, [3, 1, 7])
    assert out[0] == [(k, 1, 1) for k in range(20)]
    assert out[1] == [(k, 11, 2) for k in range(0, 20, 2)]
    assert out[2] == [(k, 111 if k % 2 == 0 else 101, 3) for k in range(20)]
    assert [r["subtask"] for r in job.latest_checkpoint().properties["reports"]] == list(range(7))


def test_output_evaluated_twice_and_replayed_batch_ids_apply_once(spark, tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    df = spark.createDataFrame([(1, 5), (2, 7), (1, 5)], "k long, v long")
    out = job.run_batch(df, parallelism=2, checkpoint_id=0).output
    first = sorted(map(tuple, out.collect()))
    assert sorted(map(tuple, out.collect())) == first == [(1, 5, 0), (1, 10, 0), (2, 7, 0)]
    replayed = job.run_batch(df, parallelism=4, checkpoint_id=0)  # Spark replays batch 0, even at another parallelism
    assert replayed.replayed and replayed.checkpoint_id == 0
    replay = replayed.output
    assert sorted(map(tuple, replay.collect())) == first
    nxt = job.run_batch(spark.createDataFrame([(1, 1)], "k long, v long"), parallelism=3, checkpoint_id=1).output
    assert [tuple(r) for r in nxt.collect()] == [(1, 11, 1)]
    assert CheckpointStorage(str(tmp_path / "chk")).checkpoint_ids() == [0, 1]



def test_a_small_output_reads_as_one_partition_from_a_location_with_glob_characters(spark, tmp_path, monkeypatch):
    """The output's file names are taken literally ('[', '*' and '?' in the location are no patterns); an output of
    at most ONE_PARTITION_RECORDS records is one partition (a sink's count is one Spark job), a larger one a
    partition per file, and a replay's output reads the same way."""
    from keygroups.spark import executor

    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk[0]*?"))
    df = spark.createDataFrame([(k, k) for k in range(8)], "k long, v long")
    result = job.run_batch(df, parallelism=3, checkpoint_id=0)
    assert len(result.metadata.outputs) == 3
    assert result.output.rdd.getNumPartitions() == 1
    assert sorted(map(tuple, result.output.collect())) == [(k, k, 0) for k in range(8)]
    monkeypatch.setattr(executor, "ONE_PARTITION_RECORDS", 7)
    replayed = job.run_batch(df, parallelism=2, checkpoint_id=0)
    assert replayed.replayed and replayed.output.rdd.getNumPartitions() == 3
    assert sorted(map(tuple, replayed.output.collect())) == [(k, k, 0) for k in range(8)]

def run_shop(spark, location, log_dir, function, schedule):
    orders = []
    for parallelism, limit in schedule:
        job = KeyedJob("carts", "user", function, output_schema=shop.ORDER_SCHEMA, max_parallelism=MAX_PARALLELISM,
                       checkpoint_location=location, order_by=("_partition", "_offset"))
        result = job.run_source_batch(spark, log_dir, parallelism=parallelism, record_schema=shop.EVENT_SCHEMA,
                                      max_records_per_subtask=limit)
        orders += [tuple(r) for r in result.output.collect()]
    return orders


@pytest.fixture(scope="module")
def carts(tmp_path_factory):
    root = tmp_path_factory.mktemp("carts")
    partitions = shop.generate_events(4000, 300, partitions=6, seed=11)
    write_partitioned_log(root / "log", partitions)
    return shop.reference(partitions), str(root / "log")


def test_source_job_resumed_4_2_8_1_equals_reference(any_spark, tmp_path, carts):
    (expected_state, expected_orders), log_dir = carts
    location = str(tmp_path / "chk")
    orders = run_shop(any_spark, location, log_dir, shop.CartFunction(), [(4, 300), (2, 500), (8, 100), (1, None)])
    assert sorted(orders) == sorted(expected_orders)
    assert final_states(location, MAX_PARALLELISM) == expected_state
    # the offsets went around: each batch read from where the previous one stopped, across all rescales
    metadata = CheckpointStorage(location).latest()
    assert metadata.parallelism == 1 and len(metadata.operator_handles) == 1


def test_a_task_killed_mid_batch_is_retried_and_applied_once(spark, tmp_path, carts):
    (expected_state, expected_orders), log_dir = carts
    location = str(tmp_path / "chk")
    orders = run_shop(spark, location, log_dir, shop.CartFunction(), [(3, 400)])
    marker = str(tmp_path / "died")
    orders += run_shop(spark, location, log_dir, DiesOnFirstAttempt(marker), [(2, 600)])
    assert os.path.exists(marker)   # a worker did die mid-batch
    orders += run_shop(spark, location, log_dir, shop.CartFunction(), [(5, None)])
    assert sorted(orders) == sorted(expected_orders)
    assert final_states(location, MAX_PARALLELISM) == expected_state


def test_a_driver_stopped_before_metadata_leaves_the_last_checkpoint(spark, tmp_path, carts, monkeypatch):
    (expected_state, expected_orders), log_dir = carts
    location = str(tmp_path / "chk")
    orders = run_shop(spark, location, log_dir, shop.CartFunction(), [(2, 700)])
    storage = CheckpointStorage(location)
    before = storage.latest().checkpoint_id

    class DriverDied(BaseException):
        pass

    def die(self, metadata, **options):  # every subtask wrote and reported its snapshot; the driver dies right here
        raise DriverDied()

    monkeypatch.setattr(CheckpointStorage, "commit", die)
    with pytest.raises(DriverDied):
        run_shop(spark, location, log_dir, shop.CartFunction(), [(4, 700)])
    monkeypatch.undo()
    assert storage.latest().checkpoint_id == before
    # the subtasks' keyed files (in shared/, named keyed-<subtask>-<checkpoint>-<uuid>) were written, and are unused
    assert any(name.startswith("keyed-") and name.split("-")[2] == str(before + 1)
               for name in os.listdir(os.path.join(location, "shared")))
    orders += run_shop(spark, location, log_dir, shop.CartFunction(), [(4, 700), (3, None)])
    assert sorted(orders) == sorted(expected_orders)
    assert final_states(location, MAX_PARALLELISM) == expected_state


def test_foreach_batch_on_a_stream_with_a_replayed_batch(spark, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    job = KeyedJob("stream-totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    received: dict[int, list] = {}

    def sink(output, batch_id):
        received.setdefault(batch_id, []).append(sorted(map(tuple, output.collect())))

    run = job.foreach_batch(sink, parallelism=3)
    for i, rows in enumerate([[(1, 1), (2, 2)], [(1, 10), (3, 3)]]):
        spark.createDataFrame(rows, "k long, v long").write.parquet(str(source / f"part-{i}"))
        query = (spark.readStream.schema("k long, v long").parquet(str(source / f"part-{i}"))
                 .writeStream.foreachBatch(lambda df, bid, i=i: run(df, i))
                 .option("checkpointLocation", str(tmp_path / f"spark-chk-{i}")).trigger(availableNow=True).start())
        query.awaitTermination(120)
    replayed = spark.createDataFrame([(1, 10), (3, 3)], "k long, v long")
    run(replayed, 1)  # Spark replays batch 1 after a failure: same output, no second application
    assert received[0] == [[(1, 1, 0), (2, 2, 0)]]
    assert received[1] == [[(1, 11, 1), (3, 3, 1)], [(1, 11, 1), (3, 3, 1)]]
    assert CheckpointStorage(str(tmp_path / "chk")).checkpoint_ids() == [0, 1]


def test_an_empty_batch_still_carries_every_key_group_into_the_new_checkpoint(spark, tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    first = job.run_batch(spark.createDataFrame([(k, 1) for k in range(10)], "k long, v long"), parallelism=2).output
    assert first.count() == 10
    # a rescale with no records
    empty = job.run_batch(spark.createDataFrame([], "k long, v long"), parallelism=5).output
    assert empty.count() == 0
    assert [r["subtask"] for r in job.latest_checkpoint().properties["reports"]] == list(range(5))
    after = job.run_batch(spark.createDataFrame([(k, 1) for k in range(10)], "k long, v long"), parallelism=3).output
    assert sorted(tuple(r) for r in after.collect()) == [(k, 2, 3) for k in range(10)]


class EchoTimes(KeyedProcessFunction):
    def process_element(self, record, context):
        return [(context.current_key, record["ts"], record["day"])]


def test_timestamp_and_date_columns_pass_through_a_job(any_spark, tmp_path):
    import datetime as dt

    rows = [(1, dt.datetime(2026, 3, 29, 1, 30, 5, 123456), dt.date(2026, 3, 29)),
            (2, dt.datetime(1969, 12, 31, 23, 59, 59), dt.date(1900, 1, 1)),
            (3, None, None)]
    df = any_spark.createDataFrame(rows, "k long, ts timestamp, day date")
    job = KeyedJob("times", "k", EchoTimes(), output_schema="k long, ts timestamp, day date", max_parallelism=8,
                   checkpoint_location=str(tmp_path / "chk"))
    got = sorted(tuple(r) for r in job.run_batch(df, parallelism=2).output.collect())
    assert got == sorted(tuple(r) for r in df.collect())


def test_a_replayed_id_with_other_records_is_refused_and_the_same_records_replay(spark, tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    rows = [(k, k % 3) for k in range(50)]
    first = sorted(map(tuple, job.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=2,
                                            checkpoint_id=7).output.collect()))
    # the same records in another order and partitioning replay the committed output
    same = spark.createDataFrame(list(reversed(rows)), "k long, v long").repartition(5)
    again = job.run_batch(same, parallelism=3, checkpoint_id=7)
    assert again.replayed and sorted(map(tuple, again.output.collect())) == first
    # one record more, one value changed, or one record fewer: refused, naming both digests; nothing processed
    for other in (rows + [(99, 1)], [(0, 5)] + rows[1:], rows[1:]):
        with pytest.raises(ReplayMismatchError, match=r"checkpoint 7 is already complete .* committed from 50 "
                                                      r"records with digest \d+, but this batch has \d+ records"):
            job.run_batch(spark.createDataFrame(other, "k long, v long"), parallelism=2, checkpoint_id=7)
    assert CheckpointStorage(str(tmp_path / "chk")).checkpoint_ids() == [7]
    nxt = job.run_batch(spark.createDataFrame([(1, 1)], "k long, v long"), parallelism=2, checkpoint_id=8)
    assert [tuple(r) for r in nxt.output.collect()] == [(1, 2, 8)]


def test_a_second_driver_of_a_job_fences_the_first(spark, tmp_path):
    location = str(tmp_path / "chk")
    first = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                     checkpoint_location=location)
    first.run_batch(spark.createDataFrame([(1, 1), (2, 1)], "k long, v long"), parallelism=2)
    second = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                      checkpoint_location=location)
    out = second.run_batch(spark.createDataFrame([(1, 1)], "k long, v long"), parallelism=3).output
    assert [tuple(r) for r in out.collect()] == [(1, 2, 2)]
    with pytest.raises(DriverFencedError, match="was fenced: a newer driver claimed"):
        first.run_batch(spark.createDataFrame([(1, 100)], "k long, v long"), parallelism=2)
    out = second.run_batch(spark.createDataFrame([(1, 1), (2, 1)], "k long, v long"), parallelism=2).output
    assert sorted(tuple(r) for r in out.collect()) == [(1, 3, 3), (2, 2, 3)]


def _rescaling_stream(spark, tmp_path, parallelism):
    """One streaming query over three files, one micro-batch each (400, 200 and 800 records over 50 keys), through
    ``foreach_batch`` with ``parallelism``; returns what the sink got per batch and each checkpoint's parallelism.
    The sink writes to Parquet: over Connect it runs in the server's Python worker, not in this process."""
    source = tmp_path / "in"
    sizes = [400, 200, 800]
    expected: dict[int, list] = {}
    totals: dict[int, int] = {}
    for i, n in enumerate(sizes):
        rows = [(r % 50, r + 1000 * i) for r in range(n)]
        spark.createDataFrame(rows, "k long, v long").coalesce(1).write.parquet(str(source / f"part-{i}"))
        for k, v in rows:
            totals[k] = totals.get(k, 0) + v
        expected[i] = sorted({k: (k, totals[k], i) for k, _ in rows}.values())
    job = KeyedJob("rescaling-stream", "k", LastTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    sunk = str(tmp_path / "sunk")
    run = job.foreach_batch(write_sink(sunk), parallelism=parallelism)
    query = (spark.readStream.schema("k long, v long").option("maxFilesPerTrigger", 1)
             .parquet(str(source / "part-*")).writeStream.foreachBatch(run)
             .option("checkpointLocation", str(tmp_path / "spark-chk")).trigger(availableNow=True).start())
    query.awaitTermination(300)
    assert query.exception() is None
    received: dict[int, list] = {}
    for row in spark.read.parquet(sunk).collect():
        received.setdefault(row["batch_id"], []).append(tuple(row)[:-1])
    received = {bid: sorted(rows) for bid, rows in received.items()}
    storage = CheckpointStorage(str(tmp_path / "chk"))
    return received, expected, [storage.load(c).parallelism for c in storage.checkpoint_ids()]


def write_sink(location: str):
    """A foreachBatch sink that appends each batch's committed output, with its batch id, to Parquet under
    ``location``: over Connect the function runs in the server's Python worker, so it cannot hand anything back in
    memory."""

    def sink(output, batch_id):
        output.withColumn("batch_id", F.lit(batch_id)).write.mode("append").parquet(location)

    return sink


class LastTotal(KeyedProcessFunction):
    """A key's running total, emitted once per batch (its last record's), with the batch id."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_key_batch(self, key, records, context):
        total = (self.total.value() or 0) + sum(records.column("v").to_pylist())
        self.total.update(total)
        return [(key, total, context.checkpoint_id)]


def test_a_streaming_query_rescales_between_micro_batches_by_policy(any_spark, tmp_path):
    received, expected, parallelisms = _rescaling_stream(any_spark, tmp_path, RecordsPerSubtask(100, max_parallelism=8))
    assert parallelisms == [4, 2, 8]
    assert received == expected


def test_a_streaming_query_rescales_between_micro_batches_by_a_callable(spark, tmp_path):
    seen = []

    def choose(records, history):
        seen.append((records, [(b.parallelism, b.records) for b in history]))
        return [4, 2, 8][len(history)]

    received, expected, parallelisms = _rescaling_stream(spark, tmp_path, choose)
    assert parallelisms == [4, 2, 8]
    assert received == expected
    assert seen == [(400, []), (200, [(4, 400)]), (800, [(4, 400), (2, 200)])]


def test_a_job_starts_from_a_savepoint_taken_between_batches(any_spark, tmp_path):
    spark = any_spark
    location = str(tmp_path / "chk")
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=location)
    totals(job, [[(k, 1) for k in range(10)]], spark, [2])
    job.savepoint("before-bad-deploy")
    totals(job, [[(k, 1000) for k in range(10)]], spark, [3])   # the batch the savepoint rolls back

    restarted = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                         checkpoint_location=location, restore_from_savepoint="before-bad-deploy")
    out = totals(restarted, [[(k, 1) for k in range(10)]], spark, [5])
    assert out == [[(k, 2, 3) for k in range(10)]]   # from the savepoint's totals; the id follows the latest (2)
    md = restarted.latest_checkpoint()
    assert md.properties["started_from_savepoint"] == "before-bad-deploy"
    assert not [h.file for h in md.keyed_handles if h.file.startswith("savepoints/")]   # written in full

    # a driver restarted with the same argument continues from its latest checkpoint, not the savepoint again
    again = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                     checkpoint_location=location, restore_from_savepoint="before-bad-deploy")
    assert totals(again, [[(1, 1)]], spark, [2]) == [[(1, 3, 4)]]
    with pytest.raises(CheckpointNotFoundError, match="savepoint 'missing' does not exist"):
        KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                 checkpoint_location=str(tmp_path / "other"), restore_from_savepoint="missing").run_batch(
            spark.createDataFrame([(1, 1)], "k long, v long"), parallelism=1)


def test_a_streaming_query_continues_a_savepoint_from_batch_0_exactly_once(any_spark, tmp_path):
    """The migration path: a savepoint bootstrapped as ``write_savepoint`` and ``keygroups flink import`` write
    one (checkpoint id 0), continued by a new streaming query whose first batch is Spark's batch 0; the query
    restarted after losing its last commit (Spark replays that batch: applied once); then a new query (a new Spark
    checkpoint) on the same location, numbered on from its checkpoints."""
    import pyarrow as pa

    from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask

    spark, location = any_spark, str(tmp_path / "chk")
    schema = pa.schema([("k", pa.int64()), ("total", pa.int64())])
    plan = plan_savepoint(schema, location, "boot", key_columns="k", states={"total": "total"},
                          max_parallelism=MAX_PARALLELISM, parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, pa.table({"k": [1, 2], "total": [100, 200]},
                                                                      schema=schema).to_batches())])
    source = tmp_path / "in"
    for i, rows in enumerate([[(1, 1), (2, 2)], [(1, 10), (3, 3)], [(2, 5)]]):
        spark.createDataFrame(rows, "k long, v long").coalesce(1).write.parquet(str(source / f"part-{i}"))
    sunk = str(tmp_path / "sunk")

    def run_query(files: str, spark_checkpoint: str) -> None:
        job = KeyedJob("migrated", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                       checkpoint_location=location, restore_from_savepoint="boot")
        query = (spark.readStream.schema("k long, v long").option("maxFilesPerTrigger", 1)
                 .parquet(str(source / files)).writeStream.foreachBatch(job.foreach_batch(write_sink(sunk),
                                                                                          parallelism=2))
                 .option("checkpointLocation", str(tmp_path / spark_checkpoint)).trigger(availableNow=True).start())
        query.awaitTermination(300)
        assert query.exception() is None

    def sunk_rows():
        return sorted(tuple(r) for r in spark.read.parquet(sunk).collect())

    run_query("part-[01]", "spark-chk")
    # (key, total, checkpoint id, Spark batch id): the savepoint's totals go on; checkpoint ids follow it
    first = [(1, 101, 1, 0), (1, 111, 2, 1), (2, 202, 1, 0), (3, 3, 2, 1)]
    assert sunk_rows() == first
    assert CheckpointStorage(location).checkpoint_ids() == [1, 2]

    # Spark lost its commit of batch 1 (a crash after the sink, before the commit log): the restarted query replays
    # it, and gets the committed output again, without applying it twice
    for name in os.listdir(tmp_path / "spark-chk" / "commits"):
        if name.split(".")[-1] == "1" or name == ".1.crc":
            os.remove(tmp_path / "spark-chk" / "commits" / name)
    run_query("part-[01]", "spark-chk")
    assert sunk_rows() == sorted(first + [(1, 111, 2, 1), (3, 3, 2, 1)])
    assert CheckpointStorage(location).checkpoint_ids() == [1, 2]

    # a new query (a new Spark checkpoint: batch ids from 0 again) over new input: new checkpoints, never replays
    run_query("part-2", "spark-chk-new")
    assert sunk_rows() == sorted(first + [(1, 111, 2, 1), (3, 3, 2, 1), (2, 207, 3, 0)])
    assert CheckpointStorage(location).checkpoint_ids() == [1, 2, 3]
