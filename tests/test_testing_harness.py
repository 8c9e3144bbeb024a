"""keygroups.testing.KeyedFunctionHarness, call by call: inputs in every form a job takes, output order, a fresh
function per batch, event and processing time (timers, lateness, TTL), state of all kinds and namespaced, timers by
key, snapshots as real savepoints, restores at another parallelism, max parallelism and backend, the fixture, and
the errors a user meets."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle

import pandas as pd
import pyarrow as pa
import pytest

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import KeyGroupsError, StateMigrationError
from keygroups.runtime import NO_WATERMARK, KeyedProcessFunction, TimeDomain, WatermarkStrategy
from keygroups.runtime.state_reader import KeyedStateReader, StateNotFoundError
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import ListStateDescriptor, StateTtlConfig, TtlTimeCharacteristic, ValueStateDescriptor
from keygroups.testing import HarnessSnapshot, KeyedFunctionHarness, Timer
from keygroups.testing._ddl import arrow_schema
from keygroups.windows import TimeWindow

pytest_plugins = ["pytester"]

OUT = "user string, n long, total long"


class Totals(KeyedProcessFunction):
    """Per user: records seen and their amounts' total; emits both after each record."""

    def open(self, context):
        self.n = context.get_state(ValueStateDescriptor("n", Int64Serializer()))
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))
        self.seen = context.get_list_state(ListStateDescriptor("seen", Int64Serializer()))

    def process_element(self, record, context):
        n, total = (self.n.value() or 0) + 1, (self.total.value() or 0) + record["amount"]
        self.n.update(n)
        self.total.update(total)
        self.seen.add(record["amount"])
        yield (context.current_key, n, total)


def rows(*pairs):
    return [{"user": u, "amount": a} for u, a in pairs]


def test_records_in_every_form_a_job_takes(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT)
    h.process(rows(("ann", 1), ("bob", 2)))
    h.process(pa.table({"user": ["ann"], "amount": [10]}))
    h.process(pa.RecordBatch.from_pylist(rows(("bob", 5))))
    h.process(pd.DataFrame({"user": ["ann", "cy"], "amount": [100, 7]}))
    report = h.process([])
    assert report.records_in == 0 and report.checkpoint_id == 5
    out = h.output()
    assert [(r["user"], r["n"], r["total"]) for r in out] == [("bob", 1, 2), ("ann", 1, 1), ("ann", 2, 11),
                                                              ("bob", 2, 7), ("cy", 1, 7), ("ann", 3, 111)]
    assert h.output() == []   # taken
    assert h.state("ann", "seen") == [1, 10, 100]
    assert h.input_schema == pa.schema([("user", pa.string()), ("amount", pa.int64())])


def test_wrong_input_is_refused_naming_the_columns(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT)
    with pytest.raises(KeyGroupsError, match="input_schema"):
        h.advance_watermark(5)
    h.process(rows(("ann", 1)))
    with pytest.raises(ValueError, match=r"\['amout'\].*input schema"):
        h.process([{"user": "ann", "amout": 1}])
    with pytest.raises(ValueError, match="missing"):
        h.process(pa.table({"user": ["x"]}))
    with pytest.raises(TypeError, match="list of dicts"):
        h.process({"user": "ann", "amount": 1})
    with pytest.raises(ValueError, match="key column 'nope'"):
        KeyedFunctionHarness(Totals(), "nope", output_schema=OUT, input_schema="user string, amount long")
    with pytest.raises(TypeError, match="order_by"):
        KeyedFunctionHarness(Totals(), "user", output_schema=OUT, order_by="amount")


def test_output_order_is_the_jobs_by_key_group_then_key_then_order_by(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT, order_by=["amount"], parallelism=3,
                          max_parallelism=8)
    users = [f"u{i}" for i in range(20)]
    h.process(rows(*[(u, 9 - i % 3) for i, u in enumerate(users)], *[(u, i % 3) for i, u in enumerate(users)]))
    out = h.output()
    groups = [h._key_group(r["user"]) for r in out]
    assert groups == sorted(groups)                        # subtask by subtask, key group by key group
    for u in users:
        assert [r["n"] for r in out if r["user"] == u] == [1, 2]   # the smaller amount first (order_by)


class Remembers(KeyedProcessFunction):
    """Keeps a count in an attribute: a job unpickles a fresh copy every batch, so it restarts at each batch."""

    def __init__(self):
        self.calls = 0

    def process_element(self, record, context):
        self.calls += 1
        yield (context.current_key, self.calls, 0)


def test_each_batch_runs_a_fresh_copy_of_the_function_as_a_job_does(keygroups_harness):
    function = Remembers()
    h = keygroups_harness(function, "user", output_schema=OUT)
    h.process(rows(("a", 1), ("a", 2)))
    h.process(rows(("a", 3)))
    assert [r["n"] for r in h.output()] == [1, 2, 1]
    assert function.calls == 0   # the test's own object is never run


def test_a_function_defined_inside_a_test_runs(keygroups_harness):
    class Local(KeyedProcessFunction):
        def process_element(self, record, context):
            yield (context.current_key, record["amount"] * 2, 0)

    h = keygroups_harness(Local(), "user", output_schema=OUT)
    h.process(rows(("a", 21)))
    assert h.output() == [{"user": "a", "n": 42, "total": 0}]


class Timers(KeyedProcessFunction):
    """Registers an event-time timer at the record's ``at`` and a processing-time timer at ``clock``; fired timers
    emit (key, timestamp, domain as 0/1)."""

    def process_element(self, record, context):
        if record["at"] is not None:
            context.timer_service.register_event_time_timer(record["at"])
        if record["clock"] is not None:
            context.timer_service.register_processing_time_timer(record["clock"])

    def on_timer(self, timestamp, context):
        yield (context.current_key, timestamp, 0 if context.time_domain is TimeDomain.EVENT_TIME else 1)


TIMER_IN = "user string, at long, clock long"


def test_timers_fire_when_the_test_moves_time(keygroups_harness):
    h = keygroups_harness(Timers(), "user", output_schema=OUT, input_schema=TIMER_IN, parallelism=2,
                          max_parallelism=16, processing_time=1_000)
    h.process([{"user": "a", "at": 50, "clock": 2_000}, {"user": "b", "at": 20, "clock": None},
               {"user": "c", "at": None, "clock": 1_000}])
    assert h.output() == [{"user": "c", "n": 1_000, "total": 1}]   # due at the batch's own processing time
    assert h.timers() == [Timer("b", TimeDomain.EVENT_TIME, 20), Timer("a", TimeDomain.EVENT_TIME, 50),
                          Timer("a", TimeDomain.PROCESSING_TIME, 2_000)]
    assert h.timers("a") == [Timer("a", TimeDomain.EVENT_TIME, 50), Timer("a", TimeDomain.PROCESSING_TIME, 2_000)]
    assert h.timers("nobody") == []
    report = h.advance_watermark(49)
    assert h.output() == [{"user": "b", "n": 20, "total": 0}] and report.watermark == 49 == h.watermark
    assert report.timers["event-time"].fired == 1
    h.advance_processing_time(1_999)
    assert h.output() == []
    h.advance_processing_time(5_000)
    assert h.output() == [{"user": "a", "n": 2_000, "total": 1}]
    assert h.processing_time == 5_000
    with pytest.raises(ValueError, match="cannot go back"):
        h.advance_watermark(10)
    with pytest.raises(ValueError, match="cannot go back"):
        h.advance_processing_time(4_999)


class Stamped(KeyedProcessFunction):
    def process_element(self, record, context):
        yield (context.current_key, context.timestamp, context.timer_service.current_watermark())


def test_the_watermark_strategy_moves_the_watermark_and_late_records_never_reach_the_function(keygroups_harness):
    h = keygroups_harness(Stamped(), "user", output_schema=OUT, timestamp_column="ts",
                          watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(0.01))   # 10 ms
    report = h.process([{"user": "a", "ts": 100}, {"user": "b", "ts": 40}])
    assert report.watermark == 89 and h.late() == []
    report = h.process([{"user": "a", "ts": 89}, {"user": "b", "ts": 90}, {"user": "c", "ts": 5}])
    assert report.records_late == 2 and report.records_in == 3
    assert h.late() == [{"user": "a", "ts": 89}, {"user": "c", "ts": 5}]
    assert h.late() == []
    assert sorted((r["user"], r["n"], r["total"]) for r in h.output()) == [
        ("a", 100, NO_WATERMARK), ("b", 40, NO_WATERMARK), ("b", 90, 89)]
    with pytest.raises(ValueError, match="timestamp_column"):
        KeyedFunctionHarness(Stamped(), "user", output_schema=OUT, watermark_strategy=WatermarkStrategy())


class Expiring(KeyedProcessFunction):
    """A value with a 10 s processing-time TTL and one with a 10 s event-time TTL."""

    def open(self, context):
        wall = ValueStateDescriptor("wall", Int64Serializer())
        wall.enable_time_to_live(StateTtlConfig.new_builder(10).build())
        event = ValueStateDescriptor("event", Int64Serializer())
        event.enable_time_to_live(StateTtlConfig.new_builder(10).set_ttl_time_characteristic(
            TtlTimeCharacteristic.EventTime).build())
        self.wall, self.event = context.get_state(wall), context.get_state(event)

    def process_element(self, record, context):
        self.wall.update(record["amount"])
        self.event.update(record["amount"])


def test_ttl_follows_the_tests_clocks_not_the_wall_clock(keygroups_harness):
    h = keygroups_harness(Expiring(), "user", output_schema=OUT, input_schema="user string, amount long",
                          processing_time=1_000_000)
    h.advance_watermark(0)
    h.process(rows(("a", 7)))
    h.advance_processing_time(1_009_999)
    assert h.state("a", "wall") == 7
    h.advance_processing_time(1_010_000)
    assert h.state("a", "wall") is None
    assert h.state("a", "event") == 7
    h.advance_watermark(10_000)
    assert h.state("a", "event") is None


class Windowed(KeyedProcessFunction):
    """A namespaced list state per window of 10 ms."""

    def open(self, context):
        self.per_window = context.get_namespaced_state(ListStateDescriptor("per_window", StrSerializer()),
                                                       TimeWindow(0, 10), TimeWindow.serializer())

    def process_element(self, record, context):
        start = record["amount"] // 10 * 10
        self.per_window.set_current_namespace(TimeWindow(start, start + 10))
        self.per_window.add(str(record["amount"]))


def test_namespaced_state_reads_as_a_dict_per_namespace(keygroups_harness):
    h = keygroups_harness(Windowed(), "user", output_schema=OUT)
    h.process(rows(("a", 1), ("a", 12), ("a", 5)))
    assert h.state("a", "per_window") == {TimeWindow(0, 10): ["1", "5"], TimeWindow(10, 20): ["12"]}


def test_state_of_an_undeclared_name_names_the_declared_ones(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT)
    h.process(rows(("a", 1)))
    with pytest.raises(StateNotFoundError, match=r"declares no state 'totl'.*\['n', 'seen', 'total'\]"):
        h.state("a", "totl")
    assert h.state("never-seen", "total") is None and h.state("never-seen", "seen") == []


class PerShop(KeyedProcessFunction):
    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        user, shop = context.current_key
        self.total.update((self.total.value() or 0) + record["amount"])
        yield (f"{user}@{shop}", self.total.value(), 0)


def test_several_key_columns_make_tuple_keys(keygroups_harness):
    h = keygroups_harness(PerShop(), ["user", "shop"], output_schema=OUT, parallelism=2, max_parallelism=16,
                          order_by=["amount"])
    h.process([{"user": "a", "shop": 1, "amount": 5}, {"user": "a", "shop": 2, "amount": 6},
               {"user": "a", "shop": 1, "amount": 1}])
    assert h.state(("a", 1), "total") == 6 and h.state(("a", 2), "total") == 6
    assert sorted((r["user"], r["n"]) for r in h.output()) == [("a@1", 1), ("a@1", 6), ("a@2", 6)]


def test_a_snapshot_is_a_real_savepoint_and_outlives_its_harness(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT, parallelism=2, max_parallelism=16)
    with pytest.raises(KeyGroupsError, match="nothing to snapshot"):
        h.snapshot()
    h.process(rows(*[(f"u{i}", i) for i in range(30)]))
    snapshot = h.snapshot()
    assert isinstance(snapshot, HarnessSnapshot) and os.path.isdir(snapshot.path)
    storage = CheckpointStorage(snapshot.location)
    assert storage.savepoint_names() == [snapshot.name]
    reader = KeyedStateReader(storage, snapshot.metadata, "total", key_columns=["user"])
    read = {row["user"]: row["value"] for batch in reader.read(KeyGroupRange(0, 15)) for row in batch.to_pylist()}
    assert read == {f"u{i}": i for i in range(30)}
    h.close()
    assert h.closed and os.path.isdir(snapshot.path)
    with pytest.raises(KeyGroupsError, match="closed"):
        h.process(rows(("a", 1)))
    restored = h.restore(snapshot, parallelism=5)
    assert restored.state("u7", "total") == 7
    restored.process(rows(("u7", 1)))
    assert restored.output() == [{"user": "u7", "n": 2, "total": 8}]
    path = snapshot.path
    del snapshot, storage
    import gc

    gc.collect()
    assert not os.path.exists(path)   # the snapshot's directory goes with the object


@pytest.mark.parametrize(("parallelism", "max_parallelism", "backend"),
                         [(1, 16, "rocksdb"), (4, 64, "heap"), (2, 8, "rocksdb"), (16, 16, "heap")])
def test_restore_rescales_switches_backend_and_changes_max_parallelism_by_a_factor(
        keygroups_harness, parallelism, max_parallelism, backend):
    h = keygroups_harness(Timers(), "user", output_schema=OUT, input_schema=TIMER_IN, parallelism=3,
                          max_parallelism=16, processing_time=10)
    h.process([{"user": f"u{i}", "at": 100 + i, "clock": 1_000 + i} for i in range(40)])
    h.advance_watermark(5)
    restored = h.restore(h.snapshot(), parallelism=parallelism, max_parallelism=max_parallelism, backend=backend)
    assert restored.watermark == 5 and restored.processing_time == 10
    assert restored.timers() == h.timers()
    report = restored.advance_watermark(119)
    assert report.parallelism == parallelism and report.metadata.max_parallelism == max_parallelism
    assert sorted(r["user"] for r in restored.output()) == sorted(f"u{i}" for i in range(20))
    restored.advance_processing_time(2_000)
    assert len(restored.output()) == 40 and len(restored.timers()) == 20


def test_a_max_parallelism_that_is_no_integer_factor_is_refused_at_restore(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT, max_parallelism=16)
    h.process(rows(("a", 1)))
    with pytest.raises(StateMigrationError, match="integer factor"):
        h.restore(h.snapshot(), max_parallelism=24)


class TotalsV2(Totals):
    def process_element(self, record, context):
        for out in super().process_element(record, context):
            yield (out[0], out[1], out[2] * 100)


def test_restore_with_a_new_version_of_the_function(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT)
    h.process(rows(("a", 1)))
    restored = h.restore(h.snapshot(), function=TotalsV2())
    restored.process(rows(("a", 2)))
    assert restored.output() == [{"user": "a", "n": 2, "total": 300}]


def test_reports_are_the_jobs(keygroups_harness):
    h = keygroups_harness(Totals(), "user", output_schema=OUT, parallelism=2, max_parallelism=8)
    first = h.process(rows(("a", 1), ("b", 2), ("c", 3)))
    again = h.process(rows(("a", 1)))
    assert first.restored_modes == ["new", "new"] and again.restored_modes == ["warm", "warm"]
    assert first.records_out == 3 and again.records_in == 1
    assert first.checkpoint_bytes > 0 and again.restored_bytes == [0, 0]
    assert set(first.phases) == {"plan", "subtasks", "commit", "output"} and first.seconds > 0
    assert [r.subtask for r in first.reports] == [0, 1]
    assert first.metadata.properties["processing_time"] == 0 == first.processing_time
    cold = keygroups_harness(Totals(), "user", output_schema=OUT, warm_heap_backends=0)
    cold.process(rows(("a", 1)))
    assert cold.process(rows(("a", 1))).restored_modes == ["cold"]
    assert cold.state("a", "n") == 2


def test_the_fixture_comes_with_the_package_and_closes_every_harness_it_made_and_restored(pytester):
    """A suite of its own, in a new process: the fixture is there through the package's pytest11 entry point, with
    no conftest, and after each test every harness it made or restored from one is closed."""
    pytester.makepyfile(test_user_suite="""
        import json, os
        from keygroups.runtime import KeyedProcessFunction

        class Echo(KeyedProcessFunction):
            def process_element(self, record, context):
                yield (record["user"],)

        def test_uses_the_fixture(keygroups_harness):
            h = keygroups_harness(Echo(), "user", output_schema="user string")
            h.process([{"user": "a"}])
            restored = h.restore(h.snapshot(), parallelism=2)
            assert h.output() == [{"user": "a"}]
            with open("dirs.json", "w") as f:
                json.dump([h._root, restored._root], f)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    dirs = json.loads((pytester.path / "dirs.json").read_text())
    assert len(dirs) == 2 and not any(os.path.exists(d) for d in dirs)


def test_a_suite_that_never_uses_the_fixture_loads_nothing_heavy(pytester):
    """pytest loads the plugin of every installed keygroups at its start: that must not import numpy, pyarrow or
    the runtime (seconds of start-up for a suite that never asks for the fixture)."""
    pytester.makepyfile(test_other_suite="""
        import sys

        def test_nothing_heavy_was_imported():
            assert "keygroups.testing.pytest_plugin" in sys.modules
            heavy = [m for m in ("numpy", "pyarrow", "keygroups._hashing", "keygroups.runtime",
                                 "keygroups.testing.harness") if m in sys.modules]
            assert heavy == []
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_ddl_schemas_as_keyed_job_takes_them():
    assert arrow_schema("user string, n long, at timestamp, tags array<string>, m map<string,int>, "
                        "s struct<a:int,b:double>, d decimal(10,2), `odd name` binary") == pa.schema([
        ("user", pa.string()), ("n", pa.int64()), ("at", pa.timestamp("us", tz="UTC")),
        ("tags", pa.list_(pa.string())), ("m", pa.map_(pa.string(), pa.int32())),
        ("s", pa.struct([("a", pa.int32()), ("b", pa.float64())])), ("d", pa.decimal128(10, 2)),
        ("odd name", pa.binary())])
    with pytest.raises(ValueError, match=r"'n lng' at 'lng' \(an unknown type.*types tinyint, smallint"):
        arrow_schema("n lng")
    with pytest.raises(TypeError, match="DDL"):
        arrow_schema(42)


def test_the_pickled_function_is_only_ever_loaded_in_process():
    from keygroups.testing._pickling import pickle_in_process

    class Local(KeyedProcessFunction):
        pass

    data, kept = pickle_in_process(Local())
    assert Local in kept and type(pickle.loads(data)) is Local
    with pytest.raises(Exception):
        pickle.dumps(Local())   # what the standard pickle does with it


def test_a_timestamp_event_time_column(keygroups_harness):
    h = keygroups_harness(Stamped(), "user", output_schema=OUT, timestamp_column="at",
                          watermark_strategy=WatermarkStrategy.for_monotonous_timestamps())
    at = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    h.process([{"user": "a", "at": at}])
    ms = int(at.timestamp() * 1000)
    assert h.output() == [{"user": "a", "n": ms, "total": NO_WATERMARK}] and h.watermark == ms - 1


def test_the_harness_works_in_the_directory_it_is_given_and_removes_what_it_made(keygroups_harness, tmp_path):
    h = keygroups_harness(Totals(), "user", output_schema=OUT, directory=tmp_path, backend="rocksdb")
    h.process(rows(("a", 1)))
    snapshot = h.snapshot()
    made = sorted(p.name.split("-")[1] for p in tmp_path.iterdir())
    assert made == ["harness", "snapshot"]
    h.close()
    assert [p.name.split("-")[1] for p in tmp_path.iterdir()] == ["snapshot"]
    del snapshot
    import gc

    gc.collect()
    assert list(tmp_path.iterdir()) == []


class FailsOn(Totals):
    def process_element(self, record, context):
        if record["amount"] < 0:
            raise ArithmeticError(f"negative amount for {context.current_key}")
        yield from super().process_element(record, context)


def test_a_batch_that_fails_leaves_the_last_checkpoint_as_a_job_does(keygroups_harness):
    h = keygroups_harness(FailsOn(), "user", output_schema=OUT, parallelism=2, max_parallelism=8)
    h.process(rows(("a", 1), ("b", 2)))
    with pytest.raises(ArithmeticError, match="negative amount for b"):
        h.process(rows(("a", 10), ("b", -1)))
    assert h.checkpoint.checkpoint_id == 1
    assert h.state("a", "total") == 1       # a's update of the failed batch was never committed
    report = h.process(rows(("a", 10)))
    assert report.checkpoint_id == 2 and h.state("a", "total") == 11
    assert [r["total"] for r in h.output() if r["user"] == "a"] == [1, 11]


def test_a_spark_struct_type_gives_the_schema_spark_would_hand_over():
    types = pytest.importorskip("pyspark.sql.types")
    from pyspark.sql.pandas.types import to_arrow_schema

    struct = types.StructType([
        types.StructField("user", types.StringType()), types.StructField("n", types.LongType()),
        types.StructField("at", types.TimestampType()),
        types.StructField("tags", types.ArrayType(types.StringType())),
        types.StructField("m", types.MapType(types.StringType(), types.IntegerType())),
        types.StructField("s", types.StructType([types.StructField("a", types.IntegerType()),
                                                 types.StructField("b", types.DoubleType())])),
        types.StructField("d", types.DecimalType(12, 3))])
    assert arrow_schema(struct) == to_arrow_schema(struct, timezone="UTC")


def test_each_batch_carries_the_report_a_keyed_job_batch_returns(keygroups_harness):
    """``HarnessBatch.report`` is the job's BatchReport, built from the committed checkpoint as a KeyedJob builds
    it: records in and out, the watermark before and after, restore modes, timers and bytes."""
    from keygroups.runtime.report import BatchReport

    h = keygroups_harness(Totals(), "user", output_schema=OUT, parallelism=2, max_parallelism=16)
    first = h.process(rows(("ann", 1), ("bob", 2), ("ann", 3)))
    second = h.process(rows(("cy", 4)))
    assert isinstance(first.report, BatchReport) and isinstance(second.report, BatchReport)
    assert (first.report.records_in, first.report.records_out, first.report.records_late) == (3, 3, 0)
    assert (second.report.records_in, second.report.records_out) == (1, 1)
    assert first.report.checkpoint_id == first.checkpoint_id and second.report.parallelism == 2
    assert first.report.watermark_before is None and first.report.watermark_after is None   # no event time
    assert second.report.bytes_written > 0 and second.report.state_bytes > 0
    read_back = BatchReport.from_checkpoint(second.metadata, commit_seconds=second.report.seconds.commit)
    assert dataclasses.replace(second.report, wall_seconds=0.0) == read_back   # the wall time is not stored


def test_the_harness_takes_an_assignment_as_a_job_does(keygroups_harness):
    """A balanced assignment cuts each batch's ranges by the load earlier batches measured, as a job's does, once
    its forecast has gained over Flink's ranges on ``evidence`` batches; the state stays exact whatever the ranges."""
    from keygroups._ranges import flink_boundaries
    from keygroups.runtime.assignment import BalancedRanges

    h = keygroups_harness(Totals(), "user", output_schema=OUT, parallelism=2, max_parallelism=16,
                          assignment=BalancedRanges(evidence=1, caution=0))
    skewed = rows(*[(f"u{i}", 1) for i in range(40)], *[("ann", 1)] * 300)
    batches = [h.process(skewed) for _ in range(4)]
    assert {b.report.assignment.assignment for b in batches} == {"balanced"}
    assert batches[0].report.assignment.boundaries == flink_boundaries(16, 2)   # nothing measured yet
    last = batches[-1].report.assignment   # measured on batch 2, gaining over Flink's ranges on batches 3 and 4
    assert last.moved and last.boundaries != flink_boundaries(16, 2)
    assert last.max_over_mean < last.flink_max_over_mean
    assert h.state("ann", "n") == 1200 and h.state("u3", "total") == 4
    default = keygroups_harness(Totals(), "user", output_schema=OUT, parallelism=2, max_parallelism=16,
                                assignment="balanced")
    assert default.process(skewed).report.assignment.assignment == "balanced"
    with pytest.raises(ValueError, match="assignment must be one of"):
        KeyedFunctionHarness(Totals(), "user", output_schema=OUT, assignment="even")


@pytest.mark.parametrize("options, match", [
    ({"key_columns": ["user", "user"]}, r"key_columns \['user', 'user'\] name 'user' more than once"),
    ({"output_schema": ""}, r"a DDL schema must be a non-empty string|output_schema has no fields"),
    ({"output_schema": pa.schema([])}, r"output_schema has no fields"),
    ({"output_schema": pa.schema([("n", pa.int64()), ("N", pa.int64())])}, r"output_schema names field 'N' as 'n'"),
])
def test_the_harness_refuses_what_a_job_refuses(options, match):
    arguments = {"key_columns": "user", "output_schema": OUT, **options}
    with pytest.raises(ValueError, match=match):
        KeyedFunctionHarness(Totals(), **arguments)
