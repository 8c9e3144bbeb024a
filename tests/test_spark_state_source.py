"""State as DataFrames on a real local Spark session: ``spark.read.format("keygroups")`` equals what a backend
restored from the same checkpoint shows (all five kinds, heap and RocksDB, TTL on and off, a chain of incremental
checkpoints written at parallelisms 1, 3 and 2), its metadata and operator views, its errors; and
``write_savepoint`` -> ``KeyedJob(restore_from_savepoint=...)`` -> reader gives back the input. Every test runs on
the classic session and over Spark Connect (the RocksDB/TTL chain only there: the heap chain reads the same way)."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest
from conftest import partition_count
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql import functions as F
from state_views import MAXP, STATES, backend_view, build_chain, expected_rows
from test_state_reader import plain
from timer_checkpoints import run_timer_job

import keygroups.spark as kspark
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, SerializedState, write_operator_snapshot
from keygroups.checkpoint.metadata import DistributionMode
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Float64Serializer, Int64Serializer, StrSerializer
from keygroups.spark import KeyedJob, KeyGroupsDataSource, StateColumn, write_savepoint
from keygroups.spark.state_source import default_parallelism
from keygroups.state import ListStateDescriptor, MapStateDescriptor, StateTtlConfig, ValueStateDescriptor

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])
KEYS = list(range(80))


def spark_plain(value):
    """A collected Spark value in the state API's form (Rows as tuples, maps as dicts, timestamps as ms)."""
    if isinstance(value, Row):
        return tuple(spark_plain(v) for v in value)
    if isinstance(value, dict):
        return {spark_plain(k): spark_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [spark_plain(v) for v in value]
    return plain(value)


def collected(df) -> list[tuple]:
    return sorted((tuple(spark_plain(v) for v in row) for row in df.collect()), key=repr)


def read(spark, location, **options):
    return spark.read.format("keygroups").options(**{k: str(v) for k, v in options.items()}).load(str(location))


@pytest.fixture
def registered(any_spark):
    """``any_spark`` with format("keygroups") registered (this module imported keygroups.spark before any session
    existed; a Connect session is a session of its own)."""
    kspark.register()   # with the active session
    return any_spark


# Both backends and TTL on and off (every pairing runs without Spark in test_state_reader.py), each over a chain of
# incremental checkpoints written at three parallelisms.
@pytest.mark.parametrize(("any_spark", "backend", "ttl", "parallelisms"),
                         [("classic", "heap", False, [1, 3, 2]), ("classic", "rocksdb", True, [2, 1, 3]),
                          ("connect", "rocksdb", True, [2, 1, 3])], indirect=["any_spark"])
def test_rows_equal_the_backends_view(registered, tmp_path, backend, ttl, parallelisms):
    spark = registered
    storage, md, model = build_chain(str(tmp_path), backend, ttl, parallelisms, KEYS)
    view = backend_view(storage, md, backend, ttl)
    for state in STATES:
        df = read(spark, tmp_path, state=state, partitions=3)
        assert collected(df) == expected_rows(view, model, state, ttl=ttl, flatten=False), state
    assert partition_count(df) == 3
    for state in ("l", "m"):
        df = read(spark, tmp_path, state=state, flattenCollections="true")
        assert collected(df) == expected_rows(view, model, state, ttl=ttl, flatten=True), state
    if ttl:
        assert dict(read(spark, tmp_path, state="v").dtypes)["ttl_timestamp"] == "timestamp"


def test_chosen_checkpoint_savepoint_metadata_and_operator_views(registered, tmp_path):
    spark = registered
    storage, md, model = build_chain(str(tmp_path), "heap", False, [2, 2], KEYS)
    first = read(spark, tmp_path, state="r", checkpointId=1).select("key", "value")
    latest = read(spark, tmp_path, state="r").select("key", "value")
    assert dict(collected(latest)) == model.values["r"] and collected(first) != collected(latest)
    storage.savepoint(md, "sp")
    assert collected(read(spark, tmp_path, state="r", savepoint="sp").select("key", "value")) == collected(latest)

    meta = read(spark, tmp_path, view="metadata")
    per_state = {r["state"]: (r["keys"], r["kind"]) for r in
                 meta.groupBy("state", "kind").agg(F.sum("keys").alias("keys")).collect()}
    assert per_state == {s: (len(model.values[s]), k) for s, k in
                         (("v", "value"), ("l", "list"), ("m", "map"), ("r", "reducing"), ("a", "aggregating"))}

    data, offsets = Int64Serializer().serialize_many([10, 20])
    handle = write_operator_snapshot(storage, storage.new_file(3, "operator-0"), [SerializedState(
        "positions", DistributionMode.SPLIT_DISTRIBUTE, {"serializer": Int64Serializer().snapshot().to_json()},
        data, offsets)], subtask=0, operator_id="source")
    storage.commit(CheckpointMetadata(3, "j", 0, MAXP, 1, md.keyed_handles, [handle]))
    ops = read(spark, tmp_path, view="operator", state="positions").collect()
    assert [tuple(r) for r in ops] == [("source", 0, "SPLIT_DISTRIBUTE", 0, 10),
                                       ("source", 0, "SPLIT_DISTRIBUTE", 1, 20)]


def test_bad_options_and_foreign_input_fail_clearly(registered, tmp_path):
    spark = registered
    build_chain(str(tmp_path), "heap", False, [1], KEYS[:5])
    cases = [   # checked by the data source itself, without running a query
        ({}, "option 'state' names the state to read"),
        ({"state": "v", "view": "rows"}, "option 'view' must be one of keyed, metadata, operator, timers, metrics, got 'rows'"),
        ({"state": "v", "checkpointId": "x"}, "option 'checkpointId' must be an int >= 0, got 'x'"),
        ({"state": "v", "checkpointId": "7"}, "checkpoint 7 does not exist"),
        ({"state": "v", "savepoint": "nope"}, "savepoint 'nope' does not exist"),
        ({"state": "v", "flattenCollections": "maybe"}, "option 'flattenCollections' must be true or false"),
        ({"state": "v", "Stat": "v"}, r"unknown option\(s\) \['stat'\]"),
        ({"state": "v", "partitions": "0"}, "option 'partitions' must be an int >= 1, got '0'"),
        ({"state": "v", "storageOptions": "[1]"}, "option 'storageOptions' must be a JSON object"),
    ]
    for options, message in cases:
        with pytest.raises(Exception, match=message):
            KeyGroupsDataSource({"path": str(tmp_path), **options}).schema()
    # and through Spark, as a user meets them
    with pytest.raises(Exception, match=r"holds no keyed state named 'nope'; its keyed states: \['a', 'l', 'm', "
                                        r"'r', 'v'\]"):
        read(spark, tmp_path, state="nope").schema
    with pytest.raises(Exception, match="holds no complete checkpoint"):
        read(spark, tmp_path / "elsewhere", state="v").schema
    (tmp_path / "chk-1" / "_metadata").write_bytes(b"\x89KGM garbage")
    with pytest.raises(Exception, match="CorruptSnapshotError"):
        read(spark, tmp_path, state="v").schema


# ---- writing: bootstrap a job, edit its state ----------------------------------------------------------------------


class Tally(KeyedProcessFunction):
    """Adds each record's ``v`` to the key's total; keeps the bootstrapped tags and prefs as they are."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))
        context.get_state(ListStateDescriptor("tags", StrSerializer()))
        prefs = MapStateDescriptor("prefs", StrSerializer(), Float64Serializer())
        prefs.enable_time_to_live(StateTtlConfig.new_builder(86400 * 365 * 100).build())
        context.get_state(prefs)

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total)]


def test_write_savepoint_bootstrap_job_read_back_and_edit(registered, tmp_path):
    spark = registered
    location = str(tmp_path / "chk")
    n = 50
    rows = [(k, k * 100, [f"t{k}", "x"] if k % 3 else None, {"a": k / 2}) for k in range(n)]
    df = spark.createDataFrame(rows, "k long, total long, tags array<string>, prefs map<string,double>")
    ttl = StateTtlConfig.new_builder(86400 * 365 * 100).build()
    path = write_savepoint(df, location, "boot", key_columns="k", max_parallelism=MAXP, parallelism=3,
                           states={"total": "total", "tags": "tags", "prefs": StateColumn("prefs", ttl=ttl)})
    assert path.endswith("savepoints/boot")
    boot = read(spark, location, savepoint="boot", state="total")
    assert boot.columns == ["k", "key_group", "value"]   # the key column's name comes with the savepoint
    assert sorted(tuple(r) for r in boot.select("k", "value").collect()) == [(k, k * 100) for k in range(n)]

    job = KeyedJob("tally", "k", Tally(), output_schema=pa.schema([("k", pa.int64()), ("total", pa.int64())]),
                   max_parallelism=MAXP, checkpoint_location=location, restore_from_savepoint="boot")
    out = job.run_batch(spark.createDataFrame([(k, 1) for k in range(5)], "k long, v long"), parallelism=2)
    assert sorted(tuple(r) for r in out.output.collect()) == [(k, k * 100 + 1) for k in range(5)]

    def state(name, **options):
        return read(spark, location, state=name, keyColumns="k", **options)

    assert sorted(tuple(r) for r in state("total").select("k", "value").collect()) == [
        (k, k * 100 + (1 if k < 5 else 0)) for k in range(n)]
    assert sorted((r["k"], r["value"]) for r in state("tags").collect()) == [
        (k, [f"t{k}", "x"]) for k in range(n) if k % 3]
    prefs = state("prefs", flattenCollections="true").collect()
    assert sorted((r["k"], r["map_key"], r["value"]) for r in prefs) == [(k, "a", k / 2) for k in range(n)]
    assert len({r["ttl_timestamp"] for r in prefs}) == 1   # all stamped at the time of writing

    # edit: fix a bug's damage in one state, drop the others, and start again from the result
    fixed = state("total").where("k < 5").withColumn("value", F.col("value") - 1)
    write_savepoint(fixed, location, "fixed", key_columns="k", max_parallelism=MAXP,
                    states={"total": "value"})
    # no parallelism given: Spark's default parallelism (over Connect, asked of the server)
    assert CheckpointStorage(location).load_savepoint("fixed").parallelism == min(MAXP, default_parallelism(spark))
    again = read(spark, location, savepoint="fixed", state="total")
    assert sorted(tuple(r) for r in again.select("k", "value").collect()) == [(k, k * 100) for k in range(5)]
    with pytest.raises(Exception, match="holds no keyed state named 'tags'"):
        read(spark, location, savepoint="fixed", state="tags").schema


def test_timers_view_lists_every_registered_timer(registered, tmp_path):
    spark = registered
    _, live = run_timer_job(str(tmp_path))
    df = read(spark, tmp_path, view="timers", partitions=3, keyColumns="user")
    assert df.columns == ["user", "key_group", "domain", "timestamp"]
    assert partition_count(df) == 3
    rows = df.collect()
    assert sorted((r["user"], r["domain"], r["timestamp"]) for r in rows) == sorted(live)


def test_default_parallelism_over_connect_is_the_servers(spark, connect):
    """Connect has no SparkContext: the default comes from the partitions the server splits a range into, which
    follow the server's settings (here the session's leaf-node parallelism, then its default again)."""
    assert default_parallelism(connect) == default_parallelism(spark) == spark.sparkContext.defaultParallelism
    connect.conf.set("spark.sql.leafNodeDefaultParallelism", "3")
    try:
        assert default_parallelism(connect) == 3
    finally:
        connect.conf.unset("spark.sql.leafNodeDefaultParallelism")
    assert default_parallelism(connect) == spark.sparkContext.defaultParallelism
