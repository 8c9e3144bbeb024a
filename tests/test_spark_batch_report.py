"""What a job tells its user: the batch report (``BatchResult.report``, the sink's third argument, the ``keygroups``
logger's INFO and WARNING lines, ``keygroups inspect``), one read of the input per batch, and every misconfiguration
refused on the driver before any Spark job starts."""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import uuid

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from keygroups.cli import main as cli_main
from keygroups.errors import StateMigrationError
from keygroups.runtime import KeyedProcessFunction, RecordsPerSubtask, WatermarkStrategy
from keygroups.serializers import Int32Serializer, Int64Serializer, StrSerializer
from keygroups.spark import KeyedJob
from keygroups.state import StateTtlConfig, ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark

OUTPUT = "user long, total long"
EPOCH_MS = 1_767_225_600_000   # 2026-01-01T00:00:00Z


class TotalWithTimer(KeyedProcessFunction):
    """Per user the running sum of ``v``; an event-time timer a minute after each event (fired timers emit -1)."""

    def __init__(self, serializer=None, ttl=None):
        self.serializer = serializer or Int64Serializer()
        self.ttl = ttl

    def open(self, context):
        descriptor = ValueStateDescriptor("total", self.serializer)
        if self.ttl is not None:
            descriptor.enable_time_to_live(self.ttl)
        self.total = context.get_state(descriptor)

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        if context.has_timestamp:
            context.timer_service.register_event_time_timer(context.timestamp + 60_000)
        return [(record["user"], total)]

    def on_timer(self, timestamp, context):
        return [(context.current_key, -1)]


def _rows(n, users, start_ms, step_ms=10):
    return [(i % users, 1, start_ms + i * step_ms) for i in range(n)]


def _df(spark, rows, names=("user", "v", "t")):
    quoted = ["`" + n.replace("`", "``") + "`" for n in names]
    return spark.createDataFrame(rows, ", ".join(f"{n} long" for n in quoted))


def _job(tmp_path, name="report", **kwargs):
    options = {"output_schema": OUTPUT, "max_parallelism": 16, "checkpoint_location": str(tmp_path / "chk")}
    options.update(kwargs)
    return KeyedJob(name, "user", options.pop("function", TotalWithTimer()), **options)


# ---- the report -------------------------------------------------------------------------------------------------

def test_report_figures_over_batches(spark, tmp_path):
    job = _job(tmp_path, timestamp_column="t",
               watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=1)))
    first = job.run_batch(_df(spark, _rows(400, 20, EPOCH_MS)), parallelism=2)
    r = first.report
    assert (r.checkpoint_id, r.records_in, r.records_late, r.records_out) == (1, 400, 0, 400)
    assert r.watermark_before is None and r.watermark_after == EPOCH_MS + 399 * 10 - 1000 - 1
    assert (r.event_time_min, r.event_time_max) == (EPOCH_MS, EPOCH_MS + 3990)
    assert r.parallelism == 2 and r.parallelism_reason == "fixed" and r.max_parallelism == 16
    assert (r.key_groups_warm, r.key_groups_caught_up, r.key_groups_cold) == (0, 0, 0)   # nothing to restore
    assert r.timers_registered == 400 and r.timers_fired == 0 and r.timers_pending >= 20
    assert r.state_entries is not None and r.state_entries >= 20
    assert r.bytes_written > 0 and r.state_bytes > 0 and r.bytes_restored == 0
    assert all(getattr(r.seconds, p) >= 0 for p in ("plan", "restore", "process", "snapshot", "commit"))
    assert r.seconds.process > 0 and r.seconds.commit > 0

    # a minute later: every earlier timer fires, and the state comes back at another parallelism
    second = job.run_batch(_df(spark, _rows(100, 20, EPOCH_MS + 120_000)), parallelism=4).report
    assert second.watermark_before == r.watermark_after and second.watermark_after > second.watermark_before
    assert second.timers_fired == 400 and second.records_out == 100 + 400   # one timer per first-batch record
    assert second.key_groups_warm + second.key_groups_caught_up + second.key_groups_cold == 16
    assert "checkpoint 2" in str(second) and "p=4 (fixed)" in str(second)
    assert json.loads(json.dumps(second.to_dict()))["records_in"] == 100


def test_policy_reason_and_log_lines(spark, tmp_path, caplog):
    job = _job(tmp_path)
    caplog.set_level(logging.INFO, logger="keygroups")
    result = job.run_batch(_df(spark, _rows(300, 30, EPOCH_MS)), parallelism=RecordsPerSubtask(100))
    assert result.parallelism == 3
    assert result.report.parallelism_reason == "RecordsPerSubtask(records_per_subtask=100, min_parallelism=1, " \
                                               "max_parallelism=None) chose 3 for 300 records"
    infos = [r for r in caplog.records if r.name == "keygroups" and r.levelno == logging.INFO]
    assert len(infos) == 1 and "300 in" in infos[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- a streaming query with a file taken out of order -------------------------------------------------------------

def test_streaming_late_file_warns_reports_and_inspect_shows_it(spark, tmp_path, caplog, capsys):
    source = tmp_path / "in"
    source.mkdir()
    results = []

    def sink(output, batch_id, result):
        results.append((batch_id, output.count(), result.report))

    job = _job(tmp_path, timestamp_column="t", late_warning_share=0.5,
               watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=1)))
    caplog.set_level(logging.INFO, logger="keygroups")
    stream = (spark.readStream.schema("user long, v long, t long").option("maxFilesPerTrigger", 1)
              .json(str(source)))
    query = stream.writeStream.foreachBatch(job.foreach_batch(sink, parallelism=2)).start()
    try:
        # the newer file first, then an hour older one: every record of the second batch is behind the watermark
        for name, start in (("b-new.json", EPOCH_MS + 3_600_000), ("a-old.json", EPOCH_MS)):
            with open(source / name, "w") as f:
                f.writelines(json.dumps({"user": u, "v": v, "t": t}) + "\n" for u, v, t in _rows(200, 10, start))
            query.processAllAvailable()
        progress = query.recentProgress
    finally:
        query.stop()

    assert [(b, n) for b, n, _ in results] == [(0, 200), (1, 0)]
    late = results[1][2]
    assert (late.records_in, late.records_late, late.records_out) == (200, 200, 0)
    assert late.watermark_before == EPOCH_MS + 3_600_000 + 1990 - 1000 - 1
    assert (late.event_time_min, late.event_time_max) == (EPOCH_MS, EPOCH_MS + 1990)
    # Spark's own progress counts each record once: the input is read once per batch
    assert [p["numInputRows"] for p in progress if p["numInputRows"]] == [200, 200]

    warnings = [r.getMessage() for r in caplog.records if r.name == "keygroups" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "checkpoint 1 dropped 200 of 200 records (100%) as late" in warnings[0]
    assert "2026-01-01T01:00:00.989+00:00" in warnings[0]   # the watermark
    assert "from 2026-01-01T00:00:00.000+00:00 to 2026-01-01T00:00:01.990+00:00" in warnings[0]

    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "chk")]) == 0
    out = capsys.readouterr().out
    assert "watermark 2026-01-01T01:00:00.989+00:00" in out
    assert "200 late" in out and "checkpoint 0:" in out and "checkpoint 1:" in out
    assert "_timers" not in out
    assert cli_main(["inspect", str(tmp_path / "chk"), "--internal"]) == 0
    assert "_timers" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path / "chk"), "--json", "--no-timers"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["watermark"] == late.watermark_after and shown["records_late"] == 200
    assert [b["records_late"] for b in shown["recent_batches"]] == [0, 200]
    assert list(shown["states"]) == ["total"]


def test_sinks_of_two_and_of_any_arguments(spark, tmp_path):
    seen = []
    job = _job(tmp_path)
    job.foreach_batch(lambda df, batch_id: seen.append(("two", batch_id)), parallelism=1)(
        _df(spark, _rows(10, 2, EPOCH_MS)), 0)
    job.foreach_batch(lambda *args: seen.append(("any", args[1], args[2].report.records_in)), parallelism=1)(
        _df(spark, _rows(10, 2, EPOCH_MS + 1000)), 1)
    assert seen == [("two", 0), ("any", 1, 10)]


# ---- one read of the input per batch ----------------------------------------------------------------------------

def _counting_source(spark, counter_file, rows, partitions):
    """A Python data source over ``rows`` in ``partitions`` partitions whose every ``read`` appends a line to
    ``counter_file``."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class CountingReader(DataSourceReader):
        def partitions(self):
            return [InputPartition(i) for i in range(partitions)]

        def read(self, partition):
            with open(counter_file, "a") as f:
                f.write(f"{partition.value}\n")
            for i, row in enumerate(rows):
                if i % partitions == partition.value:
                    yield row

    class CountingSource(DataSource):
        @classmethod
        def name(cls):
            return "kg_counting"

        def schema(self):
            return "user long, v long, t long"

        def reader(self, schema):
            return CountingReader()

    spark.dataSource.register(CountingSource)
    return spark.read.format("kg_counting").load()


@pytest.mark.parametrize("watermark, policy", [(False, False), (True, False), (False, True), (True, True)])
def test_input_read_once_per_batch(spark, tmp_path, watermark, policy):
    counter = tmp_path / "reads"
    counter.write_text("")
    options = {}
    if watermark:
        options = {"timestamp_column": "t",
                   "watermark_strategy": WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(0))}
    job = _job(tmp_path, **options)
    df = _counting_source(spark, str(counter), _rows(500, 25, EPOCH_MS), partitions=3)
    result = job.run_batch(df, parallelism=RecordsPerSubtask(200) if policy else 2)
    assert result.report.records_in == 500 and result.output.count() == 500
    assert sorted(counter.read_text().split()) == ["0", "1", "2"]   # each input partition read exactly once


def test_former_multi_read_path_reads_each_figure_again(spark, tmp_path):
    """The comparison path kept for the benchmark reads once per figure: the counter sees it, so the test above
    would catch a return to it."""
    counter = tmp_path / "reads"
    counter.write_text("")
    job = _job(tmp_path, timestamp_column="t",
               watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(0)))
    job._read_input_once = False
    df = _counting_source(spark, str(counter), _rows(100, 5, EPOCH_MS), partitions=2)
    job.run_batch(df, parallelism=RecordsPerSubtask(50))
    assert len(counter.read_text().split()) == 6   # count, max, keyed stage: 3 reads of 2 partitions


# ---- column names users may choose ---------------------------------------------------------------------------------

@pytest.mark.parametrize("names", [("a.user", "v", "t"), ("us`er", "v", "t"), ("user", "__key_group", "t"),
                                   ("user", "__keygroups_input_digest", "t"), ("user", "v", "__key_bits_0")])
def test_any_input_column_name_works(spark, tmp_path, names):
    class Totals(KeyedProcessFunction):
        def open(self, context):
            self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

        def process_element(self, record, context):
            total = (self.total.value() or 0) + record[names[1]]
            self.total.update(total)
            return [(context.current_key, total)]

    job = KeyedJob("names", names[0], Totals(), output_schema=OUTPUT, max_parallelism=8,
                   checkpoint_location=str(tmp_path / "chk"), order_by=names[2], timestamp_column=names[2])
    rows = _rows(60, 6, EPOCH_MS)
    out = job.run_batch(_df(spark, rows, names), parallelism=2).output.collect()
    assert sorted((r["user"], r["total"]) for r in out) == sorted(
        (u, sum(1 for x, _, _ in rows[: i + 1] if x == u)) for i, (u, _, _) in enumerate(rows))


# ---- misconfigurations: refused on the driver, before any Spark job -----------------------------------------------

def _refused_before_any_job(spark, error, match, call):
    group = f"kg-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "misconfiguration")
    try:
        with pytest.raises(error, match=match):
            call()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(group) == []


@pytest.mark.parametrize("options, error, match", [
    ({"backend": "rockdb"}, ValueError, r"backend 'rockdb' is not a state backend \(did you mean 'rocksdb'\?\); "
                                        r"allowed: 'heap'"),
    ({"order_by": [1]}, TypeError, r"order_by must be a column name or a list of column names"),
    ({"key_columns": ()}, ValueError, r"key_columns must name at least one input column"),
    ({"key_columns": ("user", "v", "user")}, ValueError, r"key_columns \['user', 'v', 'user'\] name 'user' more "
                                                         r"than once; each key column is named once"),
    ({"output_schema": ""}, ValueError, r"output_schema has no fields; give the fields"),
    ({"output_schema": "  "}, ValueError, r"output_schema has no fields"),
    ({"output_schema": pa.schema([])}, ValueError, r"output_schema has no fields"),
    ({"output_schema": "user long, total long, user long"}, ValueError,
     r"output_schema .*'user'.* (twice|more than once).*; each output field needs its own name"),
    ({"output_schema": pa.schema([("user", pa.int64()), ("User", pa.int64())])}, ValueError,
     r"output_schema names field 'User' as 'user' and 'User' \(Spark compares names case-insensitively\)"),
    ({"late_warning_share": 2}, ValueError, r"late_warning_share must be a number in \[0, 1\]"),
    ({"output_schema": 5}, TypeError, r"output_schema must be a pyarrow Schema"),
    ({"name": ""}, ValueError, r"name must be a non-empty string"),
])
def test_constructor_refuses(tmp_path, options, error, match):
    arguments = {"name": "bad", "key_columns": "user", "function": TotalWithTimer(), "output_schema": OUTPUT,
                 "max_parallelism": 16, "checkpoint_location": str(tmp_path / "chk")}
    arguments.update(options)
    with pytest.raises(error, match=match):
        KeyedJob(**arguments)


class DeclaresOutput(TotalWithTimer):
    output_schema = pa.schema([("user", pa.int64()), ("sum", pa.int64())])


def test_declared_output_schema_must_match(tmp_path):
    with pytest.raises(ValueError, match=r"output_schema \(user: int64, total: int64\) differs from the "
                                         r"output_schema the function declares \(user: int64, sum: int64\)"):
        _job(tmp_path, function=DeclaresOutput())


@pytest.mark.parametrize("options, error, match", [
    ({"timestamp_column": "time"}, ValueError, r"timestamp_column: column 'time' is not in the input; the "
                                                r"input's columns are \['user', 'v', 't', 's', 'm'\]"),
    ({"timestamp_column": "s"}, TypeError, r"timestamp_column 's' is string; allowed: a timestamp, or an integral"),
    ({"order_by": "tt"}, ValueError, r"order_by: column 'tt' is not in the input"),
    ({"order_by": "m"}, TypeError, r"order_by: column 'm' is map<string,bigint>, which has no order"),
    ({"key_columns": "usr"}, ValueError, r"key_columns: column 'usr' is not in the input"),
    ({"key_columns": "m"}, TypeError, r"key column 'm'"),
])
def test_input_mismatches_refused_before_any_job(spark, tmp_path, options, error, match):
    df = spark.createDataFrame([(1, 1, EPOCH_MS, "x", {"a": 1})], "user long, v long, t long, s string, "
                                                                  "m map<string,long>")
    job = KeyedJob("bad", options.pop("key_columns", "user"), TotalWithTimer(), output_schema=OUTPUT,
                   max_parallelism=16, checkpoint_location=str(tmp_path / "chk"), **options)
    _refused_before_any_job(spark, error, match, lambda: job.run_batch(df, parallelism=2))


def test_order_by_as_a_string_works(spark, tmp_path):
    job = _job(tmp_path, order_by="t")
    assert job.order_by == ("t",)
    assert job.run_batch(_df(spark, _rows(20, 2, EPOCH_MS)), parallelism=1).report.records_out == 20


@pytest.mark.parametrize("function, match", [
    (TotalWithTimer(Int32Serializer()), r"For state 'total', the new value serializer .* cannot read what the old "
                                        r"value serializer"),
    (TotalWithTimer(StrSerializer()), r"cannot read what the old value serializer"),
    (TotalWithTimer(ttl=StateTtlConfig.new_builder(datetime.timedelta(hours=1)).build()),
     r"state 'total' was snapshotted without TTL; it must be registered without TTL"),
])
def test_restore_point_incompatibility_refused_before_any_job(spark, tmp_path, function, match):
    _job(tmp_path).run_batch(_df(spark, _rows(20, 4, EPOCH_MS)), parallelism=2)
    changed = _job(tmp_path, function=function)
    df = _df(spark, _rows(20, 4, EPOCH_MS))
    _refused_before_any_job(spark, StateMigrationError, match, lambda: changed.run_batch(df, parallelism=2))


def test_max_parallelism_change_refused_before_any_job(spark, tmp_path):
    _job(tmp_path).run_batch(_df(spark, _rows(20, 4, EPOCH_MS)), parallelism=2)
    df = _df(spark, _rows(20, 4, EPOCH_MS))
    changed = _job(tmp_path, max_parallelism=24)
    _refused_before_any_job(spark, StateMigrationError, r"max parallelism", lambda: changed.run_batch(
        df, parallelism=2))


def test_job_needs_no_spark_session_to_be_built(tmp_path):
    code = ("from keygroups.spark import KeyedJob\n"
            "from keygroups.runtime import KeyedProcessFunction\n"
            "class F(KeyedProcessFunction):\n    pass\n"
            f"job = KeyedJob('j', 'user', F(), output_schema='user long, total long', max_parallelism=8, "
            f"checkpoint_location={str(tmp_path / 'chk')!r})\n"
            "print(job.key_columns)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYSPARK_SUBMIT_ARGS": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "('user',)"
